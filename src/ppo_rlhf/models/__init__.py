"""Models: loading Hugging Face checkpoints, building tiny ones from configs, critics."""

from ppo_rlhf.models.loading import (
    ModelError,
    adapter_merge_dtype,
    build_causal_lm,
    build_sequence_classifier,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    same_vocabulary,
    save_pretrained_atomic,
)
from ppo_rlhf.models.value import Critic, ModelCritic, SharedHeadCritic, ValueHead

__all__ = [
    "Critic",
    "ModelCritic",
    "ModelError",
    "SharedHeadCritic",
    "ValueHead",
    "adapter_merge_dtype",
    "build_causal_lm",
    "build_sequence_classifier",
    "load_causal_lm",
    "load_sequence_classifier",
    "load_tokenizer",
    "same_vocabulary",
    "save_pretrained_atomic",
]
