"""Rollout: turn prompts into scored responses (generation, masks, log-probs, rewards)."""
