"""Importance weights for samples drawn by a rollout engine whose numerics differ from the trainer's.

An engine (vLLM) samples from its own kernels, precision and cache, so the tokens come from
``pi_engine``, not from the trainer's ``pi_old`` that PPO's ratio assumes.  Each mode turns the
ratio ``rho = pi_old / pi_engine`` of the sampled tokens into a constant weight on each token's
policy-gradient term (docs/design.md, "Off-policy corrections"):

    token-truncate     w_t = min(rho_t, cap)                           (TIS: TRL, verl)
    token-mask         w_t = rho_t if floor <= rho_t <= cap, else 0    (TRL's token_mask)
    sequence-truncate  w = min(prod_t rho_t, cap) on every token of a response
    sequence-mask      w = prod_t rho_t if floor <= it <= cap, else 0
    geometric-mask     w = 1 if floor <= exp(mean_t log rho_t) <= cap, else 0
                       (verl's geometric rejection sampling: no reweighting, a response
                       whose tokens moved too far on average is left out)
    none               no weights; the mismatch is still measured

The product is the unbiased sequence-level correction and the most variable (over 100 tokens a
per-token mismatch of 1% is a factor e^{+-1}); truncation keeps every sample with its weight
bounded, masking drops the worst.  Masked tokens keep their place in the loss's normaliser (weight
0, as TRL), where verl removes them from its response mask.
"""

from __future__ import annotations

import math

import torch

from ppo_rlhf.core.masked import keep_masked, masked_mean

IS_CORRECTIONS = ("token-truncate", "token-mask", "sequence-truncate", "sequence-mask", "geometric-mask", "none")
TRUNCATING = ("token-truncate", "sequence-truncate")
MASKING = ("token-mask", "sequence-mask", "geometric-mask")
# Default upper bounds: TIS's 2 (verl's default threshold); the geometric mean of a response's
# per-token ratios moves far less than one token's, so its band is verl's 0.999..1.001.
DEFAULT_CAP = 2.0
DEFAULT_GEOMETRIC_CAP = 1.001
# exp() of a sequence's summed log-ratio overflows float32 past ~88; the statistics read the ratio
# within e^{+-20} (verl's safety bound), and the weights are bounded before exp() is taken.
LOG_RATIO_BOUND = 20.0


def default_cap(mode: str) -> float | None:
    """The upper bound a mode takes when none is given (None: a mode without one)."""
    if mode == "none":
        return None
    return DEFAULT_GEOMETRIC_CAP if mode == "geometric-mask" else DEFAULT_CAP


def response_log_ratio(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                       mode: str) -> torch.Tensor:
    """(B,) each response's log-ratio in a sequence mode: the sum of its tokens' (the log of the
    product), or their mean (geometric-mask)."""
    log_rho = keep_masked(old_logprobs - engine_logprobs, mask)
    return log_rho.sum(dim=-1) if mode.startswith("sequence") else masked_mean(log_rho, mask, dim=-1)


def level_log_ratio(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                    mode: str) -> torch.Tensor:
    """(B, T) log of the ratio each token's weight is decided on: its own (token modes), its
    response's sum (sequence modes: the log of the product) or mean (geometric-mask); 0 on padding."""
    if mode.startswith("token") or mode == "none":
        return keep_masked(old_logprobs - engine_logprobs, mask)
    per_response = response_log_ratio(old_logprobs, engine_logprobs, mask, mode)  # (B,)
    return keep_masked(per_response[:, None].expand_as(old_logprobs), mask)


def engine_importance_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                              mode: str, cap: float | None = None, floor: float | None = None
                              ) -> torch.Tensor | None:
    """(B, T) constant weights of the mode (see the module docstring), 0 on padding; None for "none".

    ``cap``: the upper bound (truncation's cap, the masks' upper end); ``floor``: the masks'
    lower end (default ``1 / cap``, symmetric in log space as verl's bounds)."""
    if mode not in IS_CORRECTIONS:
        raise ValueError(f"unknown importance correction {mode!r}; allowed: {', '.join(IS_CORRECTIONS)}")
    if mode == "none":
        return None
    cap = default_cap(mode) if cap is None else cap
    if mode in TRUNCATING and floor is not None:
        raise ValueError(f"{mode} truncates from above only; a floor is for the masking modes")
    floor = 1.0 / cap if floor is None else floor
    if not 0 < floor <= 1 <= cap:
        raise ValueError(f"the weights' bounds must hold 1: 0 < floor <= 1 <= cap, got floor {floor}, cap {cap}")
    with torch.no_grad():
        log_ratio = level_log_ratio(old_logprobs.detach(), engine_logprobs.detach(), mask, mode)
        if mode in TRUNCATING:  # min(rho, cap), taken in log space: a sum of log-ratios may overflow exp()
            weights = torch.exp(log_ratio.clamp(max=math.log(cap)))
        else:
            inside = (log_ratio >= math.log(floor)) & (log_ratio <= math.log(cap))
            if mode == "geometric-mask":  # rejection only: a response kept weighs 1
                kept = torch.ones_like(log_ratio)
            else:  # (bounded before exp(): the values outside are dropped anyway)
                kept = torch.exp(log_ratio.clamp(max=math.log(cap)))
            weights = torch.where(inside, kept, torch.zeros_like(log_ratio))
        return keep_masked(weights, mask)


def mismatch_statistics(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor, mode: str,
                        cap: float | None = None, floor: float | None = None) -> dict[str, float]:
    """What TRL and verl log of the engine's mismatch, over a batch's response tokens:

    - ``is/mismatch_kl``: ``(rho - 1) - log rho`` per token, averaged (k3 with the trainer over the
      engine, on the engine's samples: unbiased for KL(engine || trainer) and >= 0);
    - ``is/ratio_min``, ``_mean``, ``_max``: the ratio the mode decides on (per token, or per
      response for the sequence and geometric modes), before truncation or masking;
    - ``is/weight_mean``: the weight applied, per token; ``is/truncated_fraction`` (truncating
      modes) or ``is/masked_fraction`` (masking modes): the response tokens whose weight was
      capped, or set to 0."""
    log_rho = keep_masked(old_logprobs - engine_logprobs, mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    stats = {"is/mismatch_kl": masked_mean(torch.expm1(log_rho) - log_rho, mask).item()}
    level = level_log_ratio(old_logprobs, engine_logprobs, mask, mode).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if mode.startswith("token") or mode == "none":
        values = level[mask.bool()]
    else:  # one value per response that has a model token (its first position may be the environment's)
        values = response_log_ratio(old_logprobs, engine_logprobs, mask, mode).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        values = values[mask.bool().any(dim=-1)]
    if values.numel():
        stats.update({"is/ratio_min": values.min().exp().item(), "is/ratio_mean": values.exp().mean().item(),
                      "is/ratio_max": values.max().exp().item()})
    weights = engine_importance_weights(old_logprobs, engine_logprobs, mask, mode, cap, floor)
    if weights is not None:
        stats["is/weight_mean"] = masked_mean(weights, mask).item()
        cap = default_cap(mode) if cap is None else cap
        if mode in TRUNCATING:
            stats["is/truncated_fraction"] = masked_mean((level > math.log(cap)).float(), mask).item()
        else:
            stats["is/masked_fraction"] = masked_mean((weights == 0).float(), mask).item()
    return stats
