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

from ppo_rlhf.core import GROUP_METHODS, group_advantages, reward_to_go, shaped_rewards

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
                     greedy_scores: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) each response's score less the estimator's baseline; B = prompts x samples_per_prompt,
    the samples of a prompt adjacent.  ``greedy_scores``: (B,) ReMax's baseline."""
    if estimator in GROUP_ESTIMATORS:
        groups = scores.reshape(-1, samples_per_prompt)  # (P, K)
        return group_advantages(groups, estimator).reshape(-1)
    if estimator == "remax":
        return scores - greedy_scores
    if estimator == "reinforce++":
        return scores
    raise ValueError(f"estimator {estimator!r} has no score baseline (gae's baseline is its critic)")


def critic_free_advantages(estimator: str, scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                           kl_coef_in_reward: float, gamma: float, samples_per_prompt: int,
                           greedy_scores: torch.Tensor | None = None, token_rewards: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """(B, T) advantages without a critic: the reward-to-go of the shaped rewards in which the
    score is replaced by the score less its baseline.  With the KL in the loss (coefficient 0
    here) and gamma 1, every token of a response gets that one number.  ``token_rewards``: an
    episode's per-turn rewards (reinforce++ only: a baseline of whole episodes has none)."""
    centred = score_advantages(estimator, scores, samples_per_prompt, greedy_scores)  # (B,)
    return reward_to_go(shaped_rewards(centred, kl, mask, kl_coef_in_reward, token_rewards), mask, gamma)
