"""Which advantage estimator a PPO run uses, and what each one needs (docs/design.md,
"Advantage estimators").

Everything else in an iteration -- rollout, reward, KL, clipped loss, logging, run folder -- is
the same for every estimator: only the advantage changes, so a comparison measures the estimator.

    gae          PPO's own: GAE against a learned critic
    grpo         group baseline (mean), divided by the group's std         K >= 2 per prompt
    dr-grpo      group baseline (mean), no std division                    K >= 2 per prompt
    rloo         leave-one-out group baseline                              K >= 2 per prompt
    reinforce++  no baseline: the return, whitened over the batch
    remax        the score of the prompt's greedy response as the baseline (one greedy rollout)

The formulas are in core/advantages.py; this module says which one runs.
"""

from __future__ import annotations

import torch

from ppo_rlhf.core import (
    GROUP_METHODS,
    group_advantages,
    keep_masked,
    masked_gae,
    masked_whiten,
    reward_to_go,
    shaped_rewards,
)

ESTIMATORS = ("gae", "grpo", "dr-grpo", "rloo", "reinforce++", "remax")
GROUP_ESTIMATORS = GROUP_METHODS  # the ones whose baseline is the other responses to the same prompt

# What each estimator's paper did, the defaults of --loss-aggregation and --whiten-advantages.
# GRPO averages each response's tokens then the responses; Dr. GRPO sums each response's tokens
# over a constant.  REINFORCE++ whitens its returns over the batch (that is its baseline); the
# group and greedy baselines already centre the scores.
PAPER_LOSS_AGGREGATION = {"gae": "token-mean", "grpo": "sequence-mean", "dr-grpo": "sequence-sum-norm",
                          "rloo": "token-mean", "reinforce++": "token-mean", "remax": "token-mean"}
PAPER_WHITENING = {"gae": True, "grpo": False, "dr-grpo": False, "rloo": False, "reinforce++": True, "remax": False}


def uses_critic(estimator: str) -> bool:
    return estimator == "gae"


def needs_greedy_baseline(estimator: str) -> bool:
    return estimator == "remax"


def teacher_in_score(estimator: str) -> bool:
    """Where on-policy distillation's per-token reward goes (docs/design.md, "On-policy
    distillation"): summed over each response into its score for the group estimators, whose
    advantage is one number a response measured against its group's; per token in the rewards,
    as the KL penalty is, for the estimators that take per-token rewards (gae's critic,
    reinforce++'s and remax's reward-to-go)."""
    return estimator in GROUP_ESTIMATORS


def check_prompt_groups(prompts: list, samples_per_prompt: int) -> None:
    """The rollout batch holds each prompt ``samples_per_prompt`` times in adjacent rows (the
    group baselines and ReMax's greedy response rely on it); ValueError naming the first row
    that breaks it."""
    if len(prompts) % samples_per_prompt:
        raise ValueError(f"{len(prompts)} rows cannot form groups of {samples_per_prompt} samples per prompt")
    for start in range(0, len(prompts), samples_per_prompt):
        for offset in range(1, samples_per_prompt):
            if prompts[start + offset] != prompts[start]:
                raise ValueError(f"row {start + offset} holds another prompt than row {start}: the "
                                 f"{samples_per_prompt} samples of a prompt must sit in adjacent rows")


def score_advantages(estimator: str, scores: torch.Tensor, samples_per_prompt: int,
                     greedy_scores: torch.Tensor | None = None, unscored: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) each response's score less the estimator's baseline; B = prompts x samples_per_prompt,
    the samples of a prompt adjacent.  ``greedy_scores``: (B,) ReMax's baseline.  ``unscored``:
    (B,) bool, the responses whose score is a stand-in, left out of their group's baseline (their
    own advantage is zeroed by :func:`advantages_and_returns`)."""
    if estimator in GROUP_ESTIMATORS:
        groups = scores.reshape(-1, samples_per_prompt)  # (P, K)
        scored = None if unscored is None else ~unscored.reshape(-1, samples_per_prompt)
        return group_advantages(groups, estimator, scored=scored).reshape(-1)
    if estimator == "remax":
        return scores - greedy_scores
    if estimator == "reinforce++":
        return scores
    raise ValueError(f"estimator {estimator!r} has no score baseline (gae's baseline is its critic)")


def critic_free_advantages(estimator: str, scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                           kl_coef_in_reward: float, gamma: float, samples_per_prompt: int,
                           greedy_scores: torch.Tensor | None = None, token_rewards: torch.Tensor | None = None,
                           unscored: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) advantages without a critic: the reward-to-go of the shaped rewards in which the
    score is replaced by the score less its baseline.  With the KL in the loss (coefficient 0
    here) and gamma 1, every token of a response gets that one number.  ``token_rewards``: an
    episode's per-turn rewards (reinforce++ only: a baseline of whole episodes has none).
    ``unscored``: (B,) bool, the responses left out of the group baselines (:func:`score_advantages`)."""
    centred = score_advantages(estimator, scores, samples_per_prompt, greedy_scores, unscored)  # (B,)
    return reward_to_go(shaped_rewards(centred, kl, mask, kl_coef_in_reward, token_rewards), mask, gamma)


def advantages_and_returns(config, rewards: torch.Tensor, values: torch.Tensor | None, scores: torch.Tensor,
                           kl: torch.Tensor, mask: torch.Tensor, kl_coef_in_reward: float,
                           greedy_scores: torch.Tensor | None = None, token_rewards: torch.Tensor | None = None,
                           unscored: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 6 of a PPO iteration (trainers/ppo.py): (B, T) advantages and returns -- GAE of the
    shaped ``rewards`` against the critic's ``values`` (None: the estimator's score baseline,
    :func:`critic_free_advantages`), whitened over the batch when ``config.whiten_advantages``.

    ``unscored`` (B,) bool: the responses whose score is not known (a judge's unparsed answer, or
    ReMax's greedy baseline unparsed), which must teach nothing under every estimator: advantage 0
    on every token, out of the group baselines and of the whitening statistics, and with a critic
    the return its own value, so the value loss has nothing to fit either (docs/design.md, "Judges")."""
    if not (unscored is not None and unscored.any()):
        unscored = None
    if values is not None:
        advantages, returns = masked_gae(rewards, values, mask, config.gamma, config.lam)
    else:
        advantages = critic_free_advantages(config.estimator, scores, kl, mask, kl_coef_in_reward, config.gamma,
                                            config.samples_per_prompt, greedy_scores, token_rewards, unscored)
        returns = reward_to_go(rewards, mask, config.gamma)  # the return itself, logged
    scored_mask = mask if unscored is None else keep_masked(mask, ~unscored[:, None])  # (B, T)
    if config.whiten_advantages:
        if unscored is not None and scored_mask.sum() < 2:  # next to nothing scored: no statistics, nothing taught
            advantages = torch.zeros_like(advantages)
        else:
            advantages = masked_whiten(advantages, scored_mask)
    if unscored is not None:
        advantages = keep_masked(advantages, scored_mask)
        if values is not None:
            returns = torch.where(unscored[:, None], values, returns)
    return advantages, returns
