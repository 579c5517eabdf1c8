"""The Python API, in the shape TRL users know: a config, a trainer, ``train()``.

    from ppo_rlhf import PPOConfig, PPOTrainer
    trainer = PPOTrainer(PPOConfig(model="DIR", prompts="prompts.jsonl", out="runs/x"), reward=my_function)
    summary = trainer.train()

``PPOTrainer`` is the trainer itself (trainers/ppo.py).  ``SFTTrainer`` and ``RewardTrainer`` are
thin classes over the ``sft`` and ``rm`` stages: the same run folder as the command line, the same
summary.  Each config is checked when it is built (a bad field raises ConfigError naming it).
"""

from __future__ import annotations

from ppo_rlhf.run_folder import check_out_spares_inputs
from ppo_rlhf.trainers.reward import RewardConfig
from ppo_rlhf.trainers.sft import SFTConfig


class SFTTrainer:
    """``ppo-rlhf sft`` from Python: ``SFTTrainer(SFTConfig(...)).train()`` returns its summary."""

    def __init__(self, config: SFTConfig):
        self.config = config

    def train(self) -> dict:
        from ppo_rlhf.stages.sft import run_sft

        check_out_spares_inputs(self.config)  # as the command line checks it
        return run_sft(self.config)


class RewardTrainer:
    """``ppo-rlhf rm`` from Python: ``RewardTrainer(RewardConfig(...)).train()`` returns its summary."""

    def __init__(self, config: RewardConfig):
        self.config = config

    def train(self) -> dict:
        from ppo_rlhf.stages.reward import run_reward

        check_out_spares_inputs(self.config)
        return run_reward(self.config)
