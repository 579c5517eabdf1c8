"""A learning rate steered by how far the update moves the policy (docs/design.md, "A learning
rate that follows the update").

One learning rate moves different models, adapters and tasks by amounts that differ by orders of
magnitude: the same lr that leaves PPO's clip idle on one task (approx_kl 1e-4 an iteration) tears
the policy away on another.  rsl_rl's "adaptive" schedule (Rudin et al., 2022, legged_gym) steers
the lr instead by the KL the update measures anyway: after each step, the policy's approx_kl from
the one that sampled the batch is compared with a target, and the lr falls when the update went
too far and rises when it stayed too close.

Here the correction is proportional: a step's KL grows about as the square of the lr that made it
(a small move in the weights, a quadratic in the KL), so ``sqrt(target / kl)`` is the factor that
would have hit the target.  It is applied only outside ``[target / 2, 2 target]`` (rsl_rl's band:
inside it the measurement's noise would make the lr wander), at most halving or doubling the lr at
one measurement, and the lr stays within ``span`` times the one given, either way.
"""

from __future__ import annotations

import math

# At most this factor, up or down, at one measurement.
MAX_FACTOR = 2.0
# Within this factor of the target, the lr is left as it is.
BAND = 2.0
# The lr stays within this factor of the one given, either way.
SPAN = 100.0


class KLAdaptiveLR:
    """The lr of an update whose steps should each leave the policy about ``target`` approx_kl
    from the one that sampled the batch; ``span``: the lr stays within [lr / span, lr * span]."""

    def __init__(self, lr: float, target: float, span: float = SPAN):
        if lr <= 0 or target <= 0 or span < 1:
            raise ValueError(f"need lr > 0, target > 0 and span >= 1, got {lr}, {target}, {span}")
        self.lr = lr
        self.target = target
        self.low, self.high = lr / span, lr * span

    def update(self, approx_kl: float) -> float:
        """The lr after one measurement of the policy's approx_kl (a non-finite one changes nothing)."""
        if not math.isfinite(approx_kl) or self.target / BAND <= approx_kl <= self.target * BAND:
            return self.lr
        factor = math.sqrt(self.target / approx_kl) if approx_kl > 0 else MAX_FACTOR
        factor = min(max(factor, 1.0 / MAX_FACTOR), MAX_FACTOR)
        self.lr = min(max(self.lr * factor, self.low), self.high)
        return self.lr

    def state_dict(self) -> dict:
        return {"lr": self.lr, "low": self.low, "high": self.high}

    def load_state_dict(self, state: dict) -> None:
        self.lr, self.low, self.high = state["lr"], state["low"], state["high"]
