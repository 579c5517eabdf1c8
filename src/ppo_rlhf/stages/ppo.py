"""``ppo-rlhf ppo``: a PPO run from its config; the trainer owns the run (trainers/ppo_loop.py).

Run folder (as every stage's, docs/design.md "Resume and divergence"):
    OUT/config.yaml, metrics.jsonl, tb/, curves.png, summary.json
    OUT/checkpoints/actor/    the final actor, a standard causal-LM folder (with tokenizer)
    OUT/checkpoints/critic/   the final critic (value head, plus its trunk or adapter); estimator gae only
    OUT/checkpoints/last/     resumable state (trainers/resume.py), rewritten atomically every --save-every iterations
"""

from __future__ import annotations

from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.ppo_setup import draw_batch, prompt_sets  # noqa: F401 (tests and benchmarks draw batches)


def run_ppo(config: PPOConfig, config_record: dict | None = None, show_samples: int | None = None) -> dict:
    """Build the trainer from ``config`` -- which checks the run folder, the processes and the
    data before any model loads -- and run it; returns the summary.  ``config_record``:
    config.yaml's content; ``show_samples``: overrides ``config.show_samples`` (the demo prints
    its own)."""
    trainer = PPOTrainer(config)
    return trainer.train(config_record=config_record, show_samples=show_samples)
