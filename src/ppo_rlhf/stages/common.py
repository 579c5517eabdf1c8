"""Pieces every stage runner uses: seeding, threads, the task lookup."""

from __future__ import annotations

import random

import numpy as np
import torch

from ppo_rlhf.tasks import get_task


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_threads(num_threads: int) -> None:
    """0 keeps torch's default.  Tiny models run fastest on one thread: the per-op work is too
    small to amortise OpenMP synchronisation, which turns pathological when another process
    holds a core."""
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def load_task(name: str | None, seed: int = 0):
    return get_task(name).make_task(seed=seed) if name else None
