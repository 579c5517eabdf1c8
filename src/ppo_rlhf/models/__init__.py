"""Models: loading Hugging Face checkpoints, building tiny ones from configs, value heads."""

from ppo_rlhf.models.loading import (
    ModelError,
    build_causal_lm,
    build_sequence_classifier,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    same_vocabulary,
    save_pretrained_atomic,
)
from ppo_rlhf.models.value import Critic, ValueHead

__all__ = [
    "Critic",
    "ModelError",
    "ValueHead",
    "build_causal_lm",
    "build_sequence_classifier",
    "load_causal_lm",
    "load_sequence_classifier",
    "load_tokenizer",
    "same_vocabulary",
    "save_pretrained_atomic",
]
