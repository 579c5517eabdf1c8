"""What several processes share: who they are, sums over all of them, and who writes.

One process (no ``torch.distributed`` group) is the degenerate case of every function here:
rank 0 of 1, sums are the local values, every process is the main one.  ``accelerate launch``
and ``torchrun`` set up the group (gloo on CPUs, NCCL on GPUs); nothing here starts one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """Rank 0: the one process that writes the run folder."""
    return rank() == 0


def sum_across_processes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over every process (a new tensor; the input is left alone).  The core's
    ``sum_across`` hook: whole-batch statistics from each process's part of the batch."""
    if not is_distributed():
        return tensor
    total = tensor.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def shard(items: list, of_rank: int | None = None, processes: int | None = None) -> list:
    """This process's contiguous part of a global batch; the parts of all ranks, in rank order,
    are the batch itself (so N processes see exactly what one process would)."""
    of_rank = rank() if of_rank is None else of_rank
    processes = world_size() if processes is None else processes
    if len(items) % processes:
        raise ValueError(f"a batch of {len(items)} cannot be split evenly over {processes} processes")
    size = len(items) // processes
    return items[of_rank * size:(of_rank + 1) * size]
