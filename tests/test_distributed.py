"""Whole-batch statistics from parts held by two processes (gloo on CPU) equal one process's."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ppo_rlhf.core import masked_mean, masked_var, masked_whiten
from ppo_rlhf.core.normalize import RunningMoments
from ppo_rlhf.distributed import shard, sum_across_processes

torch.manual_seed(0)
VALUES = torch.randn(4, 6, dtype=torch.float64)
MASK = (torch.rand(4, 6) > 0.3).long()
MASK[:, 0] = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = shard(list(range(4)), rank, world)
        values, mask = VALUES[rows], MASK[rows]
        moments = RunningMoments()
        moments.update(values[:, 0], sum_across=sum_across_processes)
        results[rank] = {
            "moments": (moments.mean, moments.var, moments.count),
            "mean": masked_mean(values, mask, sum_across=sum_across_processes),
            "var": masked_var(values, mask, sum_across=sum_across_processes),
            "whitened": masked_whiten(values, mask, sum_across=sum_across_processes),
        }
    finally:
        dist.destroy_process_group()


def test_two_processes_see_the_whole_batch():
    results = mp.Manager().dict()
    mp.start_processes(_worker, args=(2, free_port(), results), nprocs=2, join=True, start_method="fork")
    expected_whitened = masked_whiten(VALUES, MASK)
    for rank in (0, 1):
        assert torch.allclose(results[rank]["mean"], masked_mean(VALUES, MASK))
        assert torch.allclose(results[rank]["var"], masked_var(VALUES, MASK))
    assert torch.allclose(torch.cat([results[0]["whitened"], results[1]["whitened"]]), expected_whitened)
    alone = RunningMoments()
    alone.update(VALUES[:, 0])
    for rank in (0, 1):
        mean, var, count = results[rank]["moments"]
        assert torch.allclose(mean, alone.mean) and torch.allclose(var, alone.var) and count == alone.count


def test_shard_splits_a_batch_in_rank_order_and_refuses_uneven_splits():
    assert shard(list(range(6)), 0, 2) + shard(list(range(6)), 1, 2) == list(range(6))
    with pytest.raises(ValueError, match="cannot be split evenly"):
        shard(list(range(5)), 0, 2)
