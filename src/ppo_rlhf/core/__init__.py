"""The pure-tensor core of PPO: every formula once, shared by the language-model and gym trainers.

Nothing here knows about models, tokenizers or files; every function takes and returns tensors.
"""

from ppo_rlhf.core.adaptive_lr import KLAdaptiveLR
from ppo_rlhf.core.advantages import (
    GROUP_METHODS,
    group_advantages,
    informative_groups,
    last_token_index,
    overlong_penalty,
    reward_to_go,
    shaped_rewards,
)
from ppo_rlhf.core.gae import gae_advantages, masked_gae
from ppo_rlhf.core.kl import (
    AdaptiveKLController,
    FixedKLController,
    KL_ESTIMATORS,
    KL_PLACEMENTS,
    check_kl_placement,
    full_kl,
    kl_penalty,
    teacher_reverse_kl,
)
from ppo_rlhf.core.logprobs import chunked_entropy, token_logprobs
from ppo_rlhf.core.losses import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    RATIO_LEVELS,
    aggregate_loss,
    approx_kl_per_token,
    cispo_loss,
    entropy_from_logits,
    explained_variance,
    policy_loss,
    sapo_loss,
    value_loss,
)
from ppo_rlhf.core.masked import keep_masked, masked_mean, masked_var, masked_whiten
from ppo_rlhf.core.pass_at_k import pass_at_k
from ppo_rlhf.core.offpolicy import IS_CORRECTIONS, engine_importance_weights, mismatch_statistics

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "GROUP_METHODS",
    "IS_CORRECTIONS",
    "KLAdaptiveLR",
    "KL_ESTIMATORS",
    "KL_PLACEMENTS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "RATIO_LEVELS",
    "aggregate_loss",
    "check_kl_placement",
    "chunked_entropy",
    "cispo_loss",
    "engine_importance_weights",
    "approx_kl_per_token",
    "entropy_from_logits",
    "explained_variance",
    "full_kl",
    "gae_advantages",
    "group_advantages",
    "informative_groups",
    "keep_masked",
    "kl_penalty",
    "last_token_index",
    "masked_gae",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "mismatch_statistics",
    "overlong_penalty",
    "pass_at_k",
    "policy_loss",
    "reward_to_go",
    "sapo_loss",
    "shaped_rewards",
    "teacher_reverse_kl",
    "token_logprobs",
    "value_loss",
]
