"""The Python API, in the shape TRL users know: a config, a trainer, ``train()``.

    from ppo_rlhf import PPOConfig, PPOTrainer
    trainer = PPOTrainer(PPOConfig(model="DIR", prompts="prompts.jsonl", out="runs/x"), reward=my_function)
    summary = trainer.train()

``PPOTrainer`` is the trainer itself (trainers/ppo.py).  ``SFTTrainer`` and ``RewardTrainer`` are
thin classes over the ``sft`` and ``rm`` stages: the same run folder as the command line, the same
summary.  Each config is checked when it is built (a bad field raises ConfigError naming it), and
again when a trainer takes it; a trainer trains once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ppo_rlhf.config import ConfigError, checked_config
from ppo_rlhf.data import DataError
from ppo_rlhf.models.loading import ModelError
from ppo_rlhf.run_folder import check_out_spares_inputs
from ppo_rlhf.trainers.ppo_loop import refuse_a_second_train
from ppo_rlhf.trainers.reward import RewardConfig
from ppo_rlhf.trainers.sft import SFTConfig

# What a stage raises when it refuses to start, before its run folder is touched: such a call has
# trained nothing, and may be made again once the input is fixed.
REFUSED_AT_START = (ConfigError, DataError, ModelError, FileNotFoundError)


def train_once(trainer, run: Callable[[object], dict]) -> dict:
    """``run(trainer.config)`` (a stage: run_sft, run_reward) as the trainer's one run: a second
    call is refused (trainers/ppo_loop.py, ``refuse_a_second_train``), the config is checked
    again as it is now, and ``--out`` against its inputs, as the command line checks them."""
    refuse_a_second_train(trainer)
    check_out_spares_inputs(checked_config(trainer.config, type(trainer).config_class, type(trainer).__name__))
    trainer.trained_into = Path(trainer.config.out)
    try:
        return run(trainer.config)
    except REFUSED_AT_START:
        trainer.trained_into = None
        raise


class SFTTrainer:
    """``ppo-rlhf sft`` from Python: ``SFTTrainer(SFTConfig(...)).train()`` returns its summary."""

    config_class = SFTConfig

    def __init__(self, config: SFTConfig):
        self.config = checked_config(config, SFTConfig, "SFTTrainer")

    def train(self) -> dict:
        from ppo_rlhf.stages.sft import run_sft

        return train_once(self, run_sft)


class RewardTrainer:
    """``ppo-rlhf rm`` from Python: ``RewardTrainer(RewardConfig(...)).train()`` returns its summary."""

    config_class = RewardConfig

    def __init__(self, config: RewardConfig):
        self.config = checked_config(config, RewardConfig, "RewardTrainer")

    def train(self) -> dict:
        from ppo_rlhf.stages.reward import run_reward

        return train_once(self, run_reward)
