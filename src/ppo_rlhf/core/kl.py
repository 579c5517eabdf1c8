"""KL between the actor and the frozen reference, and the controllers that weigh it.

With ``log_ratio = logprobs - ref_logprobs`` on tokens sampled from the actor:

- ``k1 = log_ratio``: unbiased for KL(actor || ref), but a single sample can be negative.
- ``k2 = log_ratio**2 / 2``: biased, always >= 0, low variance.
- ``k3 = exp(-log_ratio) - 1 + log_ratio``: unbiased and always >= 0 (Schulman, "Approximating
  KL divergence", 2020).
- ``full``: the exact KL summed over the vocabulary at each position (needs both logits).

Where the KL goes decides which estimator is right (Tang & Munos, 2025, "On a few pitfalls in
KL divergence gradient estimation for RL"):

- in the **reward** (``r[t] = -kl_coef * k[t]``), PPO differentiates it through the score
  function, ``E[k * grad log pi]``.  Only k1 then gives the gradient of KL(actor || ref).  k2
  and k3 give a small gradient that can point *away* from the reference, and ``full``, a
  function of the state only, gives none to the distribution it measures.
- in the **loss** (``+ kl_coef * mean(k)``, differentiated directly, as GRPO-style trainers
  do), k2 and ``full`` give the gradient of KL(actor || ref) and k3 that of KL(ref || actor):
  all three pull toward the reference.  k1 there has zero expected gradient
  (``E[grad log pi] = 0``): it measures the KL but never pulls.
"""

from __future__ import annotations

import math

import torch

from ppo_rlhf.core.masked import keep_masked
from ppo_rlhf.core.precision import compute_dtype

KL_ESTIMATORS = ("k1", "k2", "k3", "full")
# Which estimators are correct in each placement (see the module docstring), the first the default.
KL_PLACEMENTS = {"reward": ("k1",), "loss": ("k3", "k2", "full")}


def check_kl_placement(placement: str, estimator: str | None) -> str:
    """The estimator to use in ``placement`` (its default when ``estimator`` is None), or
    ValueError saying why the combination is wrong and what is allowed."""
    if placement not in KL_PLACEMENTS:
        raise ValueError(f"unknown KL placement {placement!r}; allowed: {', '.join(KL_PLACEMENTS)}")
    allowed = KL_PLACEMENTS[placement]
    if estimator is None:
        return allowed[0]
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {', '.join(KL_ESTIMATORS)}")
    if estimator not in allowed:
        why = ("in the reward, PPO differentiates the KL through the score function, and only k1 then pulls "
               "toward the reference; put k2, k3 or full in the loss (kl_in: loss)" if placement == "reward" else
               "k1 differentiated directly has zero expected gradient (E[grad log pi] = 0): it would never pull "
               "toward the reference; use k1 in the reward (kl_in: reward), or k3, k2 or full in the loss")
        raise ValueError(f"KL estimator {estimator} cannot go in the {placement}: {why}")
    return estimator


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL estimate from the log-probs of the sampled tokens, shape as the inputs."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        # exp(-x) - 1 + x loses precision for tiny x; expm1 keeps it.
        return torch.expm1(-log_ratio) + log_ratio
    if estimator == "full":
        raise ValueError("the 'full' KL needs the logits of both models: call full_kl(logits, ref_logits)")
    raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {', '.join(KL_ESTIMATORS)}")


def teacher_reverse_kl(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """On-policy distillation's per-token term (docs/design.md, "On-policy distillation"): (B, T)
    ``log pi(x_t) - log teacher(x_t)`` of the tokens the policy sampled, on the tokens it wrote
    (``mask``: an episode's environment tokens are not its to answer for), 0 elsewhere.

    It is k1 of the reverse KL(pi || teacher), the estimate the KL penalty puts in the reward,
    for the reason given above: in the reward, PPO differentiates it through the score function,
    and only k1 then gives the gradient of that KL.  The trainer's reward is ``-teacher_coef``
    times it, as the penalty's is ``-kl_coef`` times the KL to the reference: negative where the
    policy wrote a token the teacher finds less likely than it does, positive where more.
    """
    return keep_masked(kl_penalty(logprobs, teacher_logprobs, "k1"), mask)


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(actor || ref) at every position: (..., V) logits -> (...)."""
    dtype = compute_dtype(logits)
    logp = torch.log_softmax(logits.to(dtype), dim=-1)
    ref_logp = torch.log_softmax(ref_logits.to(dtype), dim=-1)
    return (logp.exp() * (logp - ref_logp)).sum(dim=-1)


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class AdaptiveKLController:
    """Adapts the KL coefficient toward a target KL (Ziegler et al., 2019, section 2.2).

    The step is proportional to the relative error, clipped to +-20% so a single noisy batch
    cannot swing the coefficient; ``horizon`` (in samples) sets how fast it moves.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0:
            raise ValueError(f"target KL must be > 0, got {target}")
        self.value = init_kl_coef
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            return
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
