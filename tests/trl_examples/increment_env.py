"""TRL's docs, "Environments": an environment that owns its data -- reset() draws the task and
returns the prompt -- and its reward (get_reward); TRL trains it without a data set (rows of an
empty user message, TRL's own placeholder, stand in here)."""

import random

# TRL: from trl import GRPOConfig, GRPOTrainer
from ppo_rlhf import PPOConfig, PPOTrainer
from trl_examples import BUDGET


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def train(model_path: str, rows: str, out: str, **given) -> dict:
    # TRL: trainer = GRPOTrainer(
    # TRL:     model="Qwen/Qwen3-0.6B",
    # TRL:     args=GRPOConfig(max_steps=1000, chat_template_kwargs={"enable_thinking": False}),
    # TRL:     environment_factory=IncrementEnv,
    # TRL: )
    trainer = PPOTrainer(PPOConfig(model=model_path, prompts=rows, out=out, **BUDGET), environment=IncrementEnv,
                         **given)
    return trainer.train()
