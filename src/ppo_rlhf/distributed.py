"""What several processes share: who they are, sums over all of them, and who writes.

One process (no ``torch.distributed`` group) is the degenerate case of every function here:
rank 0 of 1, sums are the local values, every process is the main one.  ``accelerate launch``
and ``torchrun`` set up the group (gloo on CPUs, NCCL on GPUs); nothing here starts one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Several processes share the work.  A group of one process (the one vLLM's in-process engine
    sets up for itself) is not: this process does all of it, and the group is vLLM's to take down."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """Rank 0: the one process that writes the run folder."""
    return rank() == 0


def sum_across_processes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed over every process (a new tensor; the input is left alone): the sums a
    trainer's logged numbers need over each process's part of a batch (its loss, its correct pairs)."""
    if not is_distributed():
        return tensor
    total = tensor.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def max_across_processes(value: int) -> int:
    """The largest of every process's ``value`` (one process: ``value``)."""
    if not is_distributed():
        return value
    largest = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest.item())


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def end_processes() -> None:
    """After a command has finished in every process: wait for all of them, then take the group
    down.  A process that exits with its group still up can abort in the communication library's
    teardown while another is still writing the run folder (seen as "terminate called without an
    active exception", exit -6, under a loaded CPU)."""
    if is_distributed():
        dist.barrier()
        dist.destroy_process_group()


def batch_for_rank(items: list, of_rank: int | None = None, processes: int | None = None) -> list:
    """This process's contiguous part of a global batch; the parts of all ranks, in rank order,
    are the batch itself (so N processes see exactly what one process would)."""
    of_rank = rank() if of_rank is None else of_rank
    processes = world_size() if processes is None else processes
    if len(items) % processes:
        raise ValueError(f"a batch of {len(items)} cannot be split evenly over {processes} processes")
    size = len(items) // processes
    return items[of_rank * size:(of_rank + 1) * size]


def split_for_rank(items: list, of_rank: int | None = None, processes: int | None = None) -> list:
    """This process's contiguous part of ``items`` when the split need not be even (held-out
    prompts): part sizes differ by at most one, and the parts in rank order are ``items``."""
    of_rank = rank() if of_rank is None else of_rank
    processes = world_size() if processes is None else processes
    size, extra = divmod(len(items), processes)
    begin = of_rank * size + min(of_rank, extra)
    return items[begin:begin + size + (of_rank < extra)]


def gather_objects(items: list) -> list:
    """The lists of every process, concatenated in rank order (every process gets all of it)."""
    if not is_distributed():
        return items
    parts = [None] * world_size()
    dist.all_gather_object(parts, items)
    return [item for part in parts for item in part]


def gather_rows(tensor: torch.Tensor | None, pad_value: float = 0, left: bool = False) -> torch.Tensor | None:
    """(b, T_r, ...) of every process -> (sum of b, max T_r, ...) on every process, rows in rank order.

    Each process's tensor is padded along dim 1 to the longest one first (on the left for
    left-padded prompts), so the result is the tensor one process would hold for the whole
    batch.  The row counts may differ; a 1-D tensor is gathered as it is.
    """
    if tensor is None or not is_distributed():
        return tensor
    shapes = [torch.zeros(2, dtype=torch.long, device=tensor.device) for _ in range(world_size())]
    width = tensor.shape[1] if tensor.dim() > 1 else 0
    dist.all_gather(shapes, torch.tensor([tensor.shape[0], width], device=tensor.device))
    rows = [int(s[0]) for s in shapes]
    longest = max(int(s[1]) for s in shapes)
    # gloo and NCCL move numbers, not bools: bools travel as uint8.
    send = tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor
    if tensor.dim() > 1 and width < longest:
        pad = send.new_full((send.shape[0], longest - width, *send.shape[2:]), pad_value)
        send = torch.cat([pad, send] if left else [send, pad], dim=1)
    most = max(rows)
    if send.shape[0] < most:  # all_gather needs equal shapes: pad rows, drop them after
        send = torch.cat([send, send.new_zeros((most - send.shape[0], *send.shape[1:]))])
    parts = [torch.empty_like(send) for _ in rows]
    dist.all_gather(parts, send.contiguous())
    gathered = torch.cat([part[:n] for part, n in zip(parts, rows)])
    return gathered.bool() if tensor.dtype == torch.bool else gathered


def sum_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Each parameter's gradient replaced by its sum over every process (one flat all-reduce).
    With each process's loss scaled by its share of the batch, the sum is the whole batch's
    gradient, exactly as one process would compute it.  The gradients of a sharded model
    (DTensors) were summed by its backward pass already (ppo_rlhf.sharding)."""
    if not is_distributed():
        return
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None and not isinstance(p.grad, DTensor)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def on_main_process(function, *args, **kwargs):
    """``function(*args, **kwargs)`` run by the main process alone (file writes, folder checks);
    every process returns its result, or raises the error it raised, so no process waits on one
    that has stopped.  The result travels pickled: keep it small."""
    if not is_distributed():
        return function(*args, **kwargs)
    outcome = [(None, None)]
    if is_main_process():
        try:
            outcome = [(function(*args, **kwargs), None)]
        except Exception as error:  # noqa: BLE001 - re-raised in every process below
            outcome = [(None, error)]
    dist.broadcast_object_list(outcome, src=0)
    result, error = outcome[0]
    if error is not None:
        raise error
    return result


def check_batch_split(batch_size: int, key: str = "batch_size") -> None:
    """ConfigError unless ``batch_size`` splits evenly over the processes."""
    from ppo_rlhf.config import ConfigError

    if batch_size % world_size():
        raise ConfigError(f"invalid value for '{key}': {batch_size}; with {world_size()} processes it must be a "
                          f"multiple of {world_size()}, each process computing an equal part of every batch")
