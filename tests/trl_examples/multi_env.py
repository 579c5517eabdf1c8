"""TRL's docs, "Multiple environments": a dict of environments, each row choosing its own by its
``environment`` column; only that environment's tools are in the row's prompt, and the reward
function branches on the environment it is given."""

import random

from datasets import Dataset

from ppo_rlhf.trl import GRPOConfig, GRPOTrainer  # TRL: from trl import GRPOConfig, GRPOTrainer
from trl_examples import BUDGET


class CodingEnv:
    def reset(self, **kwargs) -> str:
        n = random.randint(1, 20)
        return f"Compute the {n}th Fibonacci number."

    def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        ...

class GameEnv:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        ...

# The dataset only routes: each row picks the environment for that rollout
dataset = Dataset.from_dict({"environment": ["coding", "game"] * 500})


def reward_func(environments, **kwargs):
    # TRL: (left to the reader: "it can branch on the environment type (e.g. isinstance(env, CodingEnv))")
    return [1.0 if isinstance(env, CodingEnv) else 0.5 for env in environments]


def train(model_path: str, out: str):
    trainer = GRPOTrainer(
        model=model_path,  # TRL: model="Qwen/Qwen3-0.6B",
        args=GRPOConfig(output_dir=out, **BUDGET, chat_template_kwargs={"enable_thinking": False}),
        train_dataset=dataset,
        reward_funcs=reward_func,
        environment_factory={"coding": CodingEnv, "game": GameEnv},
    )
    return trainer.train()
