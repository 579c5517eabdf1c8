"""Loading and saving Hugging Face models; building tiny ones from a config for the built-in task.

Every checkpoint ppo-rlhf writes is a standard folder: ``AutoModelForCausalLM`` /
``AutoModelForSequenceClassification`` / ``AutoTokenizer.from_pretrained`` load it as is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ppo_rlhf.checkpoint import atomic_directory


def require_model_folder(path: str | Path, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{what} at {path} is not a Hugging Face model folder (no config.json)")
    return path


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer not found: {path}")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        # Common for causal LMs; masks never come from the pad id (they come from the first EOS),
        # so reusing EOS as pad is safe here.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str | Path, dtype: torch.dtype | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = require_model_folder(path, "causal LM")
    config = AutoConfig.from_pretrained(path)
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except ValueError as error:
        raise ValueError(
            f"{path} holds a '{config.model_type}' model ({', '.join(config.architectures or [])}), "
            f"which AutoModelForCausalLM cannot load as a causal LM: {error}"
        ) from None


def load_sequence_classifier(path: str | Path, dtype: torch.dtype | None = None):
    from transformers import AutoModelForSequenceClassification

    path = require_model_folder(path, "reward model")
    return AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)


def _gpt2_config(tokenizer, n_layer: int, n_head: int, n_embd: int, n_positions: int, dropout: float, **extra):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=len(tokenizer), n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Exact (erf) GELU instead of GPT-2's tanh approximation "gelu_new": on a CPU the
        # approximation's elementwise ops made up over half of each training step.
        activation_function="gelu", **extra,
    )


def build_causal_lm(tokenizer, n_layer=4, n_head=4, n_embd=64, n_positions=128, dropout=0.0, seed=0):
    """A freshly initialised ``GPT2LMHeadModel`` sized for the tokenizer."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(_gpt2_config(tokenizer, n_layer, n_head, n_embd, n_positions, dropout))


def build_sequence_classifier(tokenizer, num_labels: int, n_layer=4, n_head=4, n_embd=64, n_positions=128,
                              dropout=0.0, seed=0):
    """A freshly initialised ``GPT2ForSequenceClassification`` (score read at the last token)."""
    from transformers import GPT2ForSequenceClassification

    torch.manual_seed(seed)
    config = _gpt2_config(tokenizer, n_layer, n_head, n_embd, n_positions, dropout, num_labels=num_labels)
    return GPT2ForSequenceClassification(config)


def save_pretrained_atomic(model, tokenizer, path: str | Path) -> Path:
    """``save_pretrained`` of model and tokenizer into ``path``, replacing it in one step."""
    path = Path(path)
    with atomic_directory(path) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return path
