"""TRL's docs, "Tools": plain functions, one of them async, as the model's tools; reward functions
from "Using a custom reward function" (Examples 1 and 2): one on the completion's token ids, one
on the format of its text."""

import re

from ppo_rlhf.trl import GRPOConfig, GRPOTrainer  # TRL: from trl import GRPOTrainer
from trl_examples import BUDGET


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def train(model_path: str, dataset, out: str):
    trainer = GRPOTrainer(
        tools=[multiply, async_add],
        # TRL: ...,   (the model, the data set and the reward functions, left out of the snippet)
        model=model_path, args=GRPOConfig(output_dir=out, **BUDGET), train_dataset=dataset,
        reward_funcs=[reward_func, format_reward_func],
    )
    return trainer.train()
