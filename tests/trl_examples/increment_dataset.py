"""TRL's docs, "Providing an external dataset" and "Rewards": the task in the data set's rows --
reset(target, **kwargs) reads its column -- and a reward function of the trainer's
(format_reward, on the completion) beside the environment's own get_reward."""

from datasets import Dataset

from ppo_rlhf.trl import GRPOConfig, GRPOTrainer  # TRL: from trl import GRPOTrainer
from trl_examples import BUDGET

# Each row carries the prompt and the task data (here, the counter target to reach).
dataset = Dataset.from_dict(
    {
        "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
        "target": list(range(1, 7)),
    }
)


class IncrementEnv:
    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:  # exposed as a tool (see the full docstring above)
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def format_reward(completions, **kwargs):  # trainer-owned: scores the completion text
    # TRL: ...   (the docs leave its body out) 1 for an episode whose last message is a plain answer.
    return [float(completion[-1]["role"] == "assistant" and not completion[-1].get("tool_calls"))
            for completion in completions]


def train(model_path: str, out: str):
    trainer = GRPOTrainer(
        model=model_path,  # TRL: model="Qwen/Qwen3-0.6B",
        args=GRPOConfig(output_dir=out, **BUDGET),  # TRL: (the docs' defaults; "Rewards": max_steps=1000)
        train_dataset=dataset,  # the dataset owns the task; the "target" column reaches reset(target=...)
        reward_funcs=format_reward,  # trainer-owned: scores the completion
        environment_factory=IncrementEnv,  # env-owned: scores its internal state via `get_reward`
    )
    return trainer.train()
