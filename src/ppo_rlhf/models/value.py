"""The critic: a scalar value per position, on the actor's trunk (shared) or its own model."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn


class ValueHead(nn.Module):
    """hidden (B, T, H) -> value (B, T).  Small init so early values start near 0 and the
    first value-loss gradients do not swamp a shared trunk.

    Its weights are trained, so float32 (see hardware.py); a bf16 trunk's hidden state is cast
    to them, and under autocast the projection itself still computes in bf16.  Values are float32.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = nn.Linear(hidden_size, 1)
        nn.init.normal_(self.summary.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.to(self.summary.weight.dtype)).squeeze(-1).float()


def value_head_on(trunk: nn.Module) -> ValueHead:
    """A fresh value head on ``trunk``'s device (in float32, whatever the trunk's dtype)."""
    return ValueHead(hidden_size_of(trunk)).to(next(trunk.parameters()).device)


def hidden_size_of(model) -> int:
    config = model.config
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise ValueError(f"cannot tell the hidden size of a {type(model).__name__}")


class Critic(nn.Module):
    """A separate critic: a transformer trunk (``AutoModel``) plus a value head.

    Initialised from the reward model's trunk by default, as published RLHF recipes do: it
    already reads the responses the way the reward does.
    """

    def __init__(self, backbone, value_head: ValueHead | None = None):
        super().__init__()
        self.backbone = backbone
        self.value_head = value_head or value_head_on(backbone)

    @classmethod
    def from_pretrained_trunk(cls, path: str | Path, dtype: torch.dtype | str = "auto") -> "Critic":
        from transformers import AutoModel

        from ppo_rlhf.models.loading import from_pretrained, is_adapter_only, load_adapter_as_model

        path = Path(path)
        if is_adapter_only(path):  # a reward adapter: its base with the adapter merged in
            return cls(load_adapter_as_model(path, "classifier", dtype).base_model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"critic initialisation model not found: {path}")
        # The trunk of a reward model (or causal LM): its head stays behind on purpose, which
        # transformers would report at length as unexpected weights.
        from transformers.utils import logging as hf_logging

        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            return cls(from_pretrained(AutoModel, path, f"{path}: AutoModel cannot load a critic trunk from it",
                                       dtype=dtype))
        finally:
            hf_logging.set_verbosity(verbosity)

    def scope(self):
        """Context for this critic's forward and backward passes (nothing to set up for a model
        of its own; see AdapterCritic)."""
        return contextlib.nullcontext()

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # (B, L, H)
        return self.value_head(hidden)  # (B, L)

    def save(self, path: str | Path, tokenizer=None) -> None:
        """Trunk as a standard HF folder, value head beside it as safetensors; the tokenizer
        says which token ids the critic reads."""
        from safetensors.torch import save_file

        path = Path(path)
        self.backbone.save_pretrained(path)
        save_file({k: v.contiguous() for k, v in self.value_head.state_dict().items()}, str(path / "value_head.safetensors"))
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    def load_saved(self, path: str | Path) -> None:
        """Load weights written by :meth:`save` into this critic."""
        from safetensors.torch import load_file
        from transformers import AutoModel

        self.backbone.load_state_dict(AutoModel.from_pretrained(path).state_dict())
        self.value_head.load_state_dict(load_file(str(Path(path) / "value_head.safetensors")))
