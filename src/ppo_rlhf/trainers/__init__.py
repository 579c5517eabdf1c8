"""Trainers: SFT, reward model, PPO for language models, PPO for gym."""
