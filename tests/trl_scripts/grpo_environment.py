# TRL's own code, run by tests/test_trl_scripts.py with its imports changed from trl to ppo_rlhf.trl
# and nothing else (the test restores the lines below and checks TRL's text by its sha256).
# Source: docs/source/grpo_trainer.md, "Environments", huggingface/trl f2cd577.
# TRL is Apache-2.0, (c) the HuggingFace team (http://www.apache.org/licenses/LICENSE-2.0).
# sha256 of TRL's text: 93ce33101caa039f317dc5d3caa672359b2ab74b8088c2b143984f625f392130
# TRL's import lines:
#   line 3: from trl import GRPOConfig, GRPOTrainer
# ---- TRL's text from here ----
import random

from ppo_rlhf.trl import GRPOConfig, GRPOTrainer

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

trainer = GRPOTrainer(
    model="Qwen/Qwen3-0.6B",
    args=GRPOConfig(max_steps=1000, chat_template_kwargs={"enable_thinking": False}),
    environment_factory=IncrementEnv,
)
trainer.train()
