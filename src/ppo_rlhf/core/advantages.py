"""The rewards an advantage is computed from, and the critic-free advantage estimators.

PPO's advantage is GAE against a learned critic (core/gae.py).  The estimators people compare
it with keep PPO's clipped update but replace the critic by a *baseline* for each response's
score, taken from other samples (docs/design.md, "Advantage estimators"):

- GRPO (Shao et al., 2024): K responses per prompt; ``(score - group mean) / (group std + eps)``.
- Dr. GRPO (Liu et al., 2025): ``score - group mean``.  Dividing by the group's std weighs most
  the prompts whose responses barely differ (all nearly right or all nearly wrong).
- RLOO (Ahmadian et al., 2024): ``score - mean of the other K - 1 scores``: a baseline that
  leaves the response itself out is independent of it, so the gradient stays unbiased.  It
  equals ``K / (K - 1) * (score - group mean)``.
- ReMax (Li et al., 2023): ``score - score of the greedy response to the same prompt``.
- REINFORCE++ (Hu, 2025): no baseline; the return, whitened over the batch.

The score less its baseline then takes the score's place in the shaped rewards, and the
advantage of token t is the reward-to-go from t: with the KL in the loss and gamma 1, that is
the same advantage on every token of a response.
"""

from __future__ import annotations

import torch

from ppo_rlhf.core.gae import masked_gae
from ppo_rlhf.core.masked import keep_masked

GROUP_METHODS = ("grpo", "dr-grpo", "rloo")


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each response's last unmasked token (0 for an empty response).  Read from
    the positions, not the count: a multi-turn episode's mask has gaps where the environment spoke."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return (mask.bool() * positions).argmax(dim=-1)


def shaped_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float,
                   token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    """``r[t] = -kl_coef * kl[t]`` on every response token, plus the score on the last: (B,) and
    (B, T) -> (B, T).  ``token_rewards``: (B, T) rewards given at tokens of their own besides (a
    multi-turn episode's step rewards, each on the last token of its turn)."""
    rewards = keep_masked(-kl_coef * kl, mask)
    if token_rewards is not None:
        rewards = rewards + keep_masked(token_rewards, mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last_token_index(mask)] += scores
    return rewards


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G[t] = sum_{s >= t} gamma^(s - t) r[s]`` over each response: (B, T) -> (B, T), 0 on padding.

    GAE with no critic (V = 0) and lambda 1 is exactly this sum, so it is computed by the one GAE.
    """
    returns, _ = masked_gae(rewards, torch.zeros_like(rewards), mask, gamma, lam=1.0)
    return returns


def group_advantages(scores: torch.Tensor, method: str, eps: float = 1e-6, scored: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Each score less its group's baseline: (P, K) scores of K responses to each of P prompts
    -> (P, K).  ``method``: grpo, dr-grpo or rloo (see the module docstring).

    A group whose scores are all equal gets 0 advantage (GRPO: 0 / (0 + eps)): every response
    was as good as the others, there is nothing to prefer.

    ``scored`` (P, K) bool: the responses whose score is known.  One whose score is not (a judge's
    unparsed answer) gets 0 and is left out of its group's baseline: the others are compared with
    each other as a group of the scored ones alone, and a group of fewer than 2 scored gets 0.
    """
    if scored is not None and not scored.all():
        advantages = group_advantages(scores, method, eps)
        for group in (~scored).any(dim=-1).nonzero().flatten().tolist():
            kept = scored[group]
            advantages[group] = 0.0
            if kept.sum() >= 2:
                advantages[group, kept] = group_advantages(scores[group, kept][None], method, eps)[0]
        return advantages
    group_size = scores.shape[-1]
    if group_size < 2:
        raise ValueError(f"a group baseline needs at least 2 responses per prompt, got {group_size}")
    mean = scores.mean(dim=-1, keepdim=True)  # (P, 1)
    if method == "grpo":
        # Bessel-corrected, as GRPO's implementations (TRL, verl) use torch.std.
        advantages = (scores - mean) / (scores.std(dim=-1, keepdim=True) + eps)
    elif method == "dr-grpo":
        advantages = scores - mean
    elif method == "rloo":
        mean_of_others = (scores.sum(dim=-1, keepdim=True) - scores) / (group_size - 1)
        advantages = scores - mean_of_others
    else:
        raise ValueError(f"unknown group baseline {method!r}; allowed: {', '.join(GROUP_METHODS)}")
    # Exactly 0 for a group of equal scores: a float mean can miss the common value by a rounding
    # step, and GRPO's division by (std + eps) would blow that up to a visible advantage.
    all_equal = (scores == scores[..., :1]).all(dim=-1, keepdim=True)  # (P, 1)
    return torch.where(all_equal, torch.zeros_like(advantages), advantages)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13): (B,) response lengths -> (B,)
    penalties <= 0, added to the scores.

    0 up to ``max_length - buffer`` tokens, then falling linearly to ``-penalty`` at
    ``max_length``: ``-penalty * clamp((length - (max_length - buffer)) / buffer, 0, 1)``.  A
    response cut at the limit has no answer to score; this tells the policy so before it gets
    there, rather than with the cliff of one fixed penalty.
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"the overlong buffer must be in 1..{max_length} (the longest response), got {buffer}")
    excess = (lengths.to(torch.float32) - (max_length - buffer)) / buffer
    return -penalty * excess.clamp(0.0, 1.0)


def informative_groups(scores: torch.Tensor, scored: torch.Tensor | None = None) -> torch.Tensor:
    """(P, K) scores of K responses to each of P prompts -> (P,) bool: the group's scores are not
    all equal.  A group of equal scores (all right, or all wrong) has zero advantage under every
    group baseline, so it teaches the policy nothing but dilutes the batch (DAPO's dynamic
    sampling keeps only the others).  ``scored`` (P, K) bool: the responses whose score is known;
    the others' stand-ins are not compared (:func:`group_advantages`)."""
    if scored is None:
        return (scores != scores[:, :1]).any(dim=-1)
    lowest = scores.masked_fill(~scored, torch.inf).min(dim=-1).values
    highest = scores.masked_fill(~scored, -torch.inf).max(dim=-1).values
    return scored.any(dim=-1) & (lowest < highest)
