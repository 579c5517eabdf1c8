"""PPO's clipped losses and the diagnostics people read to see whether an update was sane.

Each loss returns ``(loss, stats)``: ``loss`` is the differentiable scalar, ``stats`` a dict of
detached scalars named as in the metrics (docs/design.md, "Metrics").

Padded positions may hold anything (inf log-probs, garbage values).  Every per-token input is
*selected* with the mask before any arithmetic, so neither the loss nor its gradient can see
the padding: a product with a 0 mask would still turn an inf into NaN, in the forward pass or
in the backward pass (0 * inf).
"""

from __future__ import annotations

import torch

from ppo_rlhf.core.masked import keep_masked, masked_mean, masked_var
from ppo_rlhf.core.logprobs import chunked_entropy

# How a per-token loss becomes one number (see aggregate_loss).
LOSS_AGGREGATIONS = ("token-mean", "sequence-mean", "sequence-sum-norm")


def aggregate_loss(
    per_token: torch.Tensor, mask: torch.Tensor | None, aggregation: str = "token-mean",
    norm_length: int | None = None,
) -> torch.Tensor:
    """(B, T) per-token loss -> scalar, over the positions ``mask`` selects.

    - ``token-mean``: mean over every response token of the batch.  Each token weighs the same,
      so a long response weighs more than a short one.
    - ``sequence-mean``: mean over each response's tokens, then over responses (GRPO's
      original).  Each response weighs the same, so a token of a short response weighs more
      than one of a long response: with a negative advantage, a long wrong answer is penalised
      less per token than a short one, which lets wrong answers grow (Liu et al., 2025).
    - ``sequence-sum-norm``: sum over each response's tokens divided by a constant
      ``norm_length`` (the longest response allowed), then mean over responses (Dr. GRPO).
      Every token weighs the same whatever its response's length or its batch's make-up.
    """
    if aggregation == "token-mean":
        return masked_mean(per_token, mask)
    if mask is None:
        mask = torch.ones_like(per_token)
    if aggregation == "sequence-mean":
        return masked_mean(per_token, mask, dim=-1).mean()
    if aggregation == "sequence-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError(f"sequence-sum-norm needs norm_length > 0 (the longest response), got {norm_length}")
        return (keep_masked(per_token, mask).sum(dim=-1) / norm_length).mean()
    raise ValueError(f"unknown loss aggregation {aggregation!r}; allowed: {', '.join(LOSS_AGGREGATIONS)}")


# Where the importance ratio is taken (see policy_loss).
RATIO_LEVELS = ("token", "sequence")
# The policy-gradient surrogates: PPO's clipped ratio (with its variants), CISPO, SAPO.
POLICY_LOSSES = ("clip", "cispo", "sapo")


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None,
                clip_ratio: float, aggregation: str = "token-mean", norm_length: int | None = None,
                clip_ratio_high: float | None = None, dual_clip: float | None = None, ratio_level: str = "token",
                token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective (Schulman et al., 2017, eq. 7), as a loss to minimise.

    Per token: ``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``, aggregated over ``mask``
    as ``aggregation`` says (:func:`aggregate_loss`); the other statistics are token means.
    Where the clipped branch wins, the gradient is zero: the policy has already moved far enough
    in the direction the advantage asks for.  The variants (docs/design.md, "Policy-loss variants"):

    - ``clip_ratio_high``: the upper bound ``1 + high`` apart from the lower ``1 - clip_ratio``
      (DAPO's clip-higher): unlikely tokens with a positive advantage may gain more per update.
    - ``dual_clip`` C > 1: for a negative advantage the loss is at most ``-C * A`` (dual-clip PPO),
      so a ratio far above 1 on a bad token cannot give an unbounded step; zero gradient there.
    - ``ratio_level="sequence"``: GSPO's one ratio per response, ``s = exp(mean_t(logprobs -
      old_logprobs))``, in its per-token form (GSPO-token, Zheng et al., 2025):
      ``s_t = sg(s) * pi_t / sg(pi_t)``, whose value is ``s`` on every token and whose gradient is
      ``s * grad log pi_t``.  Each token keeps its own advantage and weight, and with one
      advantage per response this is GSPO exactly (loss, clipping and gradient).
    - ``token_weights`` (B, T): each token's loss multiplied by its weight, taken as a constant
      (the importance weights of a rollout engine's samples, core/offpolicy.py).
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio level {ratio_level!r}; allowed: {', '.join(RATIO_LEVELS)}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (the bound -C * A must lie beyond the clipped branch), got {dual_clip}")
    clip_ratio_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    log_ratio = keep_masked(logprobs - old_logprobs, mask)  # padding: ratio 1, gradient 0
    advantages = keep_masked(advantages, mask)
    importance_log_ratio = log_ratio
    if ratio_level == "sequence":
        sequence_log_ratio = masked_mean(log_ratio, mask, dim=-1)  # (B,) length-normalised
        # sg(log s) + log pi_t - sg(log pi_t): the value log s, the gradient that of log pi_t.  Taking
        # s itself on every token would weigh each token's gradient by the response's *mean*
        # advantage and weight instead of its own.
        importance_log_ratio = keep_masked(sequence_log_ratio.detach()[:, None] + log_ratio - log_ratio.detach(), mask)
    ratio = torch.exp(importance_log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio_high)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * clipped_ratio
    pg_loss_per_token = torch.maximum(pg_loss1, pg_loss2)
    if dual_clip is not None:
        pg_loss3 = -advantages * dual_clip  # the bound, for A < 0 only
        dual_clipped = (advantages < 0) & (pg_loss3 < pg_loss_per_token)
        pg_loss_per_token = torch.where(dual_clipped, pg_loss3, pg_loss_per_token)
    loss, stats = weighted_and_aggregated(pg_loss_per_token, log_ratio, ratio, mask, token_weights, aggregation,
                                          norm_length)
    with torch.no_grad():
        clipped = pg_loss2 > pg_loss1  # the clipped branch is the one used: no gradient there
        stats["ppo_ratio_clamped"] = masked_mean(clipped_ratio, mask)
        stats["clipfrac"] = masked_mean(clipped.to(logprobs.dtype), mask)
        if clip_ratio_high != clip_ratio:  # which side clips: clip-higher should lower the upper one
            stats["clipfrac_high"] = masked_mean((clipped & (ratio > 1)).to(logprobs.dtype), mask)
            stats["clipfrac_low"] = masked_mean((clipped & (ratio < 1)).to(logprobs.dtype), mask)
        if dual_clip is not None:
            stats["dual_clipfrac"] = masked_mean(dual_clipped.to(logprobs.dtype), mask)
    return loss, stats


def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None,
               clip_ratio_low: float | None, clip_ratio_high: float, aggregation: str = "token-mean",
               norm_length: int | None = None, token_weights: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, MiniMax, 2025): REINFORCE weighted by the clipped importance
    ratio, the weight a constant: ``J = sg(clip(r, 1 - low, 1 + high)) * A * log pi``, on every token.

    PPO's clip zeroes the gradient of a token whose ratio left the range (often the rare tokens
    that open a line of reasoning, after the first minibatch); CISPO keeps every token's gradient
    and only bounds its weight.  ``clip_ratio_low`` None: no lower bound (the paper sets its
    lower range large enough to remove it; so does verl's example); a range >= 1 is the same.

    As a loss: ``-A * sg(w) * pi / sg(pi)`` per token, whose gradient is ``-A w grad log pi``
    (verl's and TRL's ``-A w log pi`` has the same gradient) and whose value ``-A w`` reads like
    PPO's pg_loss.  ``clipfrac``: the tokens whose weight was clipped.
    """
    log_ratio = keep_masked(logprobs - old_logprobs, mask)
    advantages = keep_masked(advantages, mask)
    ratio = torch.exp(log_ratio)
    low = 0.0 if clip_ratio_low is None else max(1.0 - clip_ratio_low, 0.0)
    weight = torch.clamp(ratio, low, 1.0 + clip_ratio_high).detach()
    # exp(log_ratio - sg(log_ratio)) is 1 with the gradient of log pi.
    per_token = -advantages * weight * torch.exp(log_ratio - log_ratio.detach())
    loss, stats = weighted_and_aggregated(per_token, log_ratio, ratio, mask, token_weights, aggregation, norm_length)
    with torch.no_grad():
        stats["ppo_ratio_clamped"] = masked_mean(weight, mask)
        stats["clipfrac"] = masked_mean((weight != ratio).to(logprobs.dtype), mask)
    return loss, stats


def sapo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor | None,
              tau_pos: float, tau_neg: float, aggregation: str = "token-mean", norm_length: int | None = None,
              token_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Gao et al., 2025, "Soft Adaptive Policy Optimization"): a soft gate in place of the clip.

    Per token ``-A * f(r)``, ``f(r) = 4 / tau * sigmoid(tau * (r - 1))``, with ``tau = tau_pos`` for a
    positive advantage and ``tau_neg`` otherwise.  Its gradient is ``-A * w * r * grad log pi`` with
    ``w = 4 sigmoid(tau (r - 1)) (1 - sigmoid(tau (r - 1)))``: 1 on-policy (r = 1, so PPO's gradient),
    falling smoothly as the ratio leaves 1 instead of dropping to 0 at a clip bound.  A larger
    ``tau_neg`` damps negative-advantage tokens faster: lowering a token's probability spreads mass
    over the whole vocabulary, the less stable direction.  ``sapo_gate``: the mean of ``w``.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"SAPO's temperatures must be > 0, got tau_pos {tau_pos}, tau_neg {tau_neg}")
    log_ratio = keep_masked(logprobs - old_logprobs, mask)
    advantages = keep_masked(advantages, mask)
    ratio = torch.exp(log_ratio)
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -advantages * gate * (4.0 / tau)
    loss, stats = weighted_and_aggregated(per_token, log_ratio, ratio, mask, token_weights, aggregation, norm_length)
    with torch.no_grad():
        stats["sapo_gate"] = masked_mean(4.0 * gate * (1.0 - gate), mask)
    return loss, stats


def weighted_and_aggregated(per_token: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor,
                            mask: torch.Tensor | None, token_weights: torch.Tensor | None, aggregation: str,
                            norm_length: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """What every policy loss does last: each token's loss times its (constant) weight, aggregated,
    and the statistics they share (token means)."""
    if token_weights is not None:
        per_token = per_token * keep_masked(token_weights.detach(), mask)
    loss = aggregate_loss(per_token, mask, aggregation, norm_length)
    with torch.no_grad():
        stats = {
            "pg_loss": loss.detach(),
            "abs_pg_loss": masked_mean(per_token.abs(), mask),
            "ppo_ratio": masked_mean(ratio, mask),
            # Token-level always: the early stop (max_approx_kl) reads how far each token moved.
            "approx_kl": masked_mean(approx_kl_per_token(log_ratio), mask),
        }
    return loss, stats


def approx_kl_per_token(log_ratio: torch.Tensor) -> torch.Tensor:
    """Estimate of KL(old || new) from tokens sampled by the *old* policy, ``log_ratio = log new/old``.

    ``(ratio - 1) - log ratio`` (Schulman's k3 with ratio = new/old): unbiased under the old
    policy's samples and >= 0.  The mirror form ``exp(-r) - 1 + r`` estimates KL(new || old)
    and, on the old policy's samples, overestimates it (it fires early stops too soon).
    """
    return torch.expm1(log_ratio) - log_ratio


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor | None,
    clip_range_value: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: ``0.5 * mean(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))``.

    ``clip_range_value=None`` gives the plain squared error.  ``vf_clipfrac`` is the fraction of
    tokens where the clip is active: V left the range *and* the clipped branch is the one used
    (its gradient is zero there).  Comparing the two losses alone would count float round-off
    inside the range as clipping.
    """
    values, old_values, returns = keep_masked(values, mask), keep_masked(old_values, mask), keep_masked(returns, mask)
    loss_unclipped = (values - returns).square()
    if clip_range_value is None:
        per_token = loss_unclipped
        clip_active = torch.zeros_like(loss_unclipped)
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -clip_range_value, clip_range_value)
        loss_clipped = (values_clipped - returns).square()
        per_token = torch.maximum(loss_unclipped, loss_clipped)
        outside = (values - old_values).abs() > clip_range_value
        clip_active = (outside & (loss_clipped > loss_unclipped)).to(values.dtype)
    loss = 0.5 * masked_mean(per_token, mask)
    with torch.no_grad():
        stats = {"vf_loss": loss.detach(), "vf_clipfrac": masked_mean(clip_active, mask)}
    return loss, stats


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution at each position: (..., V) -> (...)."""
    return chunked_entropy(logits)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 no better than a constant.

    NaN when the returns do not vary (nothing to explain).
    """
    var_returns = masked_var(returns, mask)
    if var_returns.item() == 0.0:
        return torch.full((), float("nan"), dtype=returns.dtype, device=returns.device)
    return 1.0 - masked_var(returns - values, mask) / var_returns
