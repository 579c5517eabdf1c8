"""Whole-batch statistics from parts held by two processes (gloo on CPU) equal one process's:
each process gathers the rows (``gather_rows``) and computes on the whole batch (docs/design.md,
"Scale: many processes")."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ppo_rlhf.core import masked_mean, masked_var, masked_whiten
from ppo_rlhf.core.normalize import RunningMoments
from ppo_rlhf.distributed import batch_for_rank, gather_rows
from zoo import free_port

torch.manual_seed(0)
VALUES = torch.randn(4, 6, dtype=torch.float64)
MASK = (torch.rand(4, 6) > 0.3).long()
MASK[:, 0] = 1


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = batch_for_rank(list(range(4)), rank, world)
        values, mask = gather_rows(VALUES[rows]), gather_rows(MASK[rows])
        moments = RunningMoments()
        moments.update(values[:, 0])
        results[rank] = {
            "moments": (moments.mean, moments.var, moments.count),
            "mean": masked_mean(values, mask),
            "var": masked_var(values, mask),
            "whitened": masked_whiten(values, mask),
        }
    finally:
        dist.destroy_process_group()


def test_two_processes_see_the_whole_batch():
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(2, free_port(), results), nprocs=2, join=True, start_method="fork")
    alone = RunningMoments()
    alone.update(VALUES[:, 0])
    for rank in (0, 1):
        assert torch.allclose(results[rank]["mean"], masked_mean(VALUES, MASK))
        assert torch.allclose(results[rank]["var"], masked_var(VALUES, MASK))
        assert torch.allclose(results[rank]["whitened"], masked_whiten(VALUES, MASK))
        mean, var, count = results[rank]["moments"]
        assert torch.allclose(mean, alone.mean) and torch.allclose(var, alone.var) and count == alone.count


def test_batch_for_rank_splits_a_batch_in_rank_order_and_refuses_uneven_splits():
    assert batch_for_rank(list(range(6)), 0, 2) + batch_for_rank(list(range(6)), 1, 2) == list(range(6))
    with pytest.raises(ValueError, match="cannot be split evenly"):
        batch_for_rank(list(range(5)), 0, 2)
