"""ppo-rlhf: PPO from feedback for language models, readable from the core math up.

Layers, bottom to top:
- ``ppo_rlhf.core``      pure-tensor math (masked statistics, GAE, KL, clipped losses); imports only torch
- ``ppo_rlhf.envs``      environments for multi-turn episodes: gymnasium's protocol with text, tools,
                         TRL's environment classes
- ``ppo_rlhf.models``    loading Hugging Face models, value heads, the four PPO roles
- ``ppo_rlhf.rollout``   generation, episodes, response and loss masks, log-probs, scoring
- ``ppo_rlhf.trainers``  SFT, reward model, PPO for language models
- ``ppo_rlhf.tasks``     the built-in "double it, in the style asked" task
- ``ppo_rlhf.stages``    each command's run from its config (run folders)
- ``ppo_rlhf.cli``       the ``ppo-rlhf`` command

From Python (``ppo_rlhf.api``)::

    from ppo_rlhf import PPOConfig, PPOTrainer
    config = PPOConfig(model="DIR", prompts="prompts.jsonl", out="runs/x", iterations=5)
    summary = PPOTrainer(config, reward=my_function).train()

and ``SFTConfig, SFTTrainer``, ``RewardConfig, RewardTrainer`` alike.
"""

__version__ = "0.1.0"

# Imported when first used, so that ``import ppo_rlhf`` (and ``ppo-rlhf --help``) stays fast.
_EXPORTS = {
    "PPOConfig": "ppo_rlhf.trainers.ppo_config",
    "PPOTrainer": "ppo_rlhf.trainers.ppo",
    "SFTConfig": "ppo_rlhf.trainers.sft",
    "SFTTrainer": "ppo_rlhf.api",
    "RewardConfig": "ppo_rlhf.trainers.reward",
    "RewardTrainer": "ppo_rlhf.api",
    "ScoringReward": "ppo_rlhf.rollout.reward",
    "ConfigError": "ppo_rlhf.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ppo_rlhf' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
