"""Generalised advantage estimation (Schulman et al., 2016), one implementation for every trainer.

``gae_advantages`` works on any batch of trajectories laid out along the last dimension.  The
caller says, for every step, what value to bootstrap from and whether the recursion continues:

- a language-model response: the episode is the response; it ends after the last unmasked token,
  where nothing is bootstrapped (V after the last token is 0).  ``masked_gae`` builds that case,
  and for a multi-turn episode runs over the model's tokens only: what the environment wrote in
  between is not a step of the policy, so token t's successor is the model's next token.
- a gym rollout: a *terminated* step bootstraps from 0, a *truncated* step (time limit) bootstraps
  from V(final observation) -- the episode did not really end, it was cut off -- and in both cases
  the advantage recursion stops there because the next step belongs to a new episode.
"""

from __future__ import annotations

import torch

from ppo_rlhf.core.masked import keep_masked


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    continues: torch.Tensor,
    gamma: float,
    lam: float,
) -> torch.Tensor:
    """Advantages A[t] over trajectories laid out along the last dimension.

    Args:
        rewards:     (..., T) reward received after step t.
        values:      (..., T) V(s_t).
        next_values: (..., T) the value to bootstrap from after step t: V(s_{t+1}), or 0 where the
                     episode terminated at t (callers zero it; truncation keeps V of the final state).
        continues:   (..., T) 1 where step t+1 belongs to the same episode as step t, else 0.
        gamma, lam:  discount and GAE lambda.

    Returns:
        (..., T) advantages; ``returns = advantages + values``.
    """
    delta = rewards + gamma * next_values - values  # (..., T) one-step TD errors
    advantages = torch.zeros_like(delta)
    running = torch.zeros_like(delta[..., 0])
    for t in reversed(range(delta.shape[-1])):
        running = delta[..., t] + gamma * lam * continues[..., t] * running
        advantages[..., t] = running
    return advantages


def masked_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE for token sequences: (B, T) rewards and values, ``mask`` 1 on the tokens the policy wrote.

    A response is one episode that ends at its last unmasked token; V after it is 0.  The
    recursion runs over the unmasked tokens only, in order: where the mask has a gap (the
    environment's tokens between two turns of an episode) token t's next step is the next
    unmasked token, and the gap is neither discounted nor bootstrapped (docs/design.md,
    "Episodes").  Masked positions come back as 0 in both outputs.

    Returns:
        advantages (B, T), returns (B, T) with ``returns = advantages + values``.
    """
    # The unmasked tokens of each row moved to its front, in order (a stable sort; the identity for
    # a single-turn response, whose mask is already a prefix), and moved back at the end.
    order = torch.sort((~mask.bool()).to(torch.uint8), dim=-1, stable=True).indices  # (B, T)
    mask, rewards, values = (t.gather(-1, order) for t in (mask, rewards, values))
    # Padding is selected away (keep_masked), never multiplied by 0: padded positions may hold
    # anything, a critic's output past the end of a response say, and 0 * inf is NaN.
    values, rewards = keep_masked(values, mask), keep_masked(rewards, mask)
    # Shift left by one: what follows token t.  Past the end there is nothing (0).
    next_mask = torch.nn.functional.pad(mask[..., 1:].to(values.dtype), (0, 1), value=0.0)  # (B, T)
    next_values = torch.nn.functional.pad(values[..., 1:], (0, 1), value=0.0) * next_mask
    advantages = keep_masked(gae_advantages(rewards, values, next_values, next_mask, gamma, lam), mask)
    returns = keep_masked(advantages + values, mask)
    return tuple(torch.empty_like(t).scatter_(-1, order, t) for t in (advantages, returns))
