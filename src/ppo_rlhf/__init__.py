"""ppo-rlhf: PPO from feedback for language models, readable from the core math up.

Layers, bottom to top:
- ``ppo_rlhf.core``      pure-tensor math (masked statistics, GAE, KL, clipped losses); imports only torch
- ``ppo_rlhf.models``    loading Hugging Face models, value heads, the four PPO roles
- ``ppo_rlhf.rollout``   generation, response masks, log-probs, scoring
- ``ppo_rlhf.trainers``  SFT, reward model, PPO for language models
- ``ppo_rlhf.tasks``     the built-in "double it, in the style asked" task
- ``ppo_rlhf.cli``       the ``ppo-rlhf`` command
"""

__version__ = "0.1.0"
