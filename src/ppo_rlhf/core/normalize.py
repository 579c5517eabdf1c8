"""Running mean and variance (Chan et al.'s parallel update), for score and observation
normalisation."""

from __future__ import annotations

import torch


def merge_moments(mean, var, count, batch_mean, batch_var, batch_count):
    """(mean, var, count) of two sets from those of each (Chan et al.'s parallel update).

    Plain arithmetic, so torch tensors and numpy arrays (the gym trainer's observation
    statistics, kept in numpy on its per-step path) both work.
    """
    delta = batch_mean - mean
    total = count + batch_count
    new_mean = mean + delta * batch_count / total
    m2 = var * count + batch_var * batch_count + delta * delta * count * batch_count / total
    return new_mean, m2 / total, total


class RunningMoments:
    """Mean and std of every value seen so far, updated one batch at a time."""

    def __init__(self, shape: tuple[int, ...] = (), eps: float = 1e-4):
        self.mean = torch.zeros(shape, dtype=torch.float64)
        self.var = torch.ones(shape, dtype=torch.float64)
        self.count = eps  # a tiny prior count keeps the first update finite

    def update(self, batch: torch.Tensor) -> None:
        """Merge ``batch`` in (with several processes: the whole batch, gathered, in each)."""
        batch = batch.detach().to(torch.float64).reshape(-1, *self.mean.shape)
        count = batch.shape[0]
        batch_mean = batch.sum(dim=0) / count
        batch_var = (batch - batch_mean).square().sum(dim=0) / count
        self.mean, self.var, self.count = merge_moments(
            self.mean, self.var, self.count, batch_mean.cpu(), batch_var.cpu(), count
        )

    @property
    def std(self) -> torch.Tensor:
        return self.var.sqrt()

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]
