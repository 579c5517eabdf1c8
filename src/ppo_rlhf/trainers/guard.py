"""Divergence guard: a step with a non-finite loss, gradient norm, score, reward or observation
is skipped (the weights keep their last finite values) and counted; ``max_bad_steps`` of them in
a row stop the run with a message naming the step and the cause.  And nothing non-finite is
ever saved: :func:`require_finite` refuses a state dict holding a NaN or an infinity.

A single bad step is usually noise (one overflowing batch); a run of them means the run has
diverged, and training on would only write NaN weights over the last good checkpoint.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

# What each checked value is called in a message.
CAUSES = {"loss": "loss", "grad_norm": "gradient norm", "score": "score", "reward": "reward from the env",
          "observation": "observation from the env"}


class DivergenceError(RuntimeError):
    """The run stopped: training diverged, or a non-finite tensor was about to be saved."""


def is_finite(value) -> bool:
    """True when ``value`` (a number or a tensor of any shape) holds only finite numbers."""
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return math.isfinite(float(value))


class DivergenceGuard:
    """Counts steps that had to be skipped; raises :class:`DivergenceError` after too many in a row.

        loss.backward()
        grad_norm = clip_grad_norm_(parameters, max_norm)
        guard.step(optimizer, step, loss=loss, grad_norm=grad_norm)   # optimizer.step() if all finite
    """

    def __init__(self, max_bad_steps: int = 5, unit: str = "step"):
        self.max_bad_steps = max_bad_steps
        self.unit = unit  # what a step is called in the message: "step", "iteration"
        self.in_a_row = 0
        self.skipped = 0  # over the whole run, logged as skipped_steps

    def skip(self, step: int, **values) -> bool:
        """True when one of ``values`` (named as in ``CAUSES``; None: not checked) is not finite.

        Raises DivergenceError when this makes ``max_bad_steps`` skipped steps in a row."""
        bad = next((name for name, value in values.items() if value is not None and not is_finite(value)), None)
        if bad is None:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.skipped += 1
        if self.in_a_row >= self.max_bad_steps:
            value = values[bad]
            shown = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else "non-finite values"
            raise DivergenceError(
                f"training diverged at {self.unit} {step}: non-finite {CAUSES.get(bad, bad)} ({shown}), "
                f"{self.in_a_row} times in a row (each time the step was skipped); stopped without saving "
                f"non-finite weights.  Lower the learning rate, or look at the data or rewards of these steps")
        return True

    def step(self, optimizer, step: int, accelerator=None, **values) -> bool:
        """``optimizer.step()`` unless one of ``values`` is non-finite, in which case the step's
        gradients are dropped instead; returns whether it stepped.

        Under fp16 loss scaling (``accelerator.scaler``) an overflowing gradient is the scaler's
        to skip (it lowers the scale and goes on), so the gradient norm is not checked; and a
        skipped step still goes through the scaler, empty, since it expects one per unscale."""
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None:
            values.pop("grad_norm", None)
        if self.skip(step, **values):
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:
                optimizer.step()
            return False
        optimizer.step()
        return True

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.skipped = state["in_a_row"], state["skipped"]


def require_finite(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """Refuse to save ``tensors`` (a state dict) if any holds a NaN or an infinity, naming it."""
    bad = next((name for name, tensor in tensors.items()
                if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not is_finite(tensor)), None)
    if bad is not None:
        raise DivergenceError(f"{what}: {bad} holds non-finite values; not saved (the previous checkpoint, if "
                              f"any, is left as it was).  Lower the learning rate")


def require_finite_in_every_process(tensors: Mapping[str, torch.Tensor], what: str) -> None:
    """:func:`require_finite` where each process holds different tensors (its shards of a sharded
    optimizer's moments): a non-finite value in any process stops all of them, together."""
    from ppo_rlhf.distributed import sum_across_processes

    try:
        require_finite(tensors, what)
        mine = None
    except DivergenceError as error:
        mine = error
    if sum_across_processes(torch.tensor(float(mine is not None))).item():
        raise mine or DivergenceError(f"{what}: another process's part holds non-finite values; not saved.  "
                                      f"Lower the learning rate")
