"""The critic: a value per response position, behind one interface (docs/design.md, "Roles").

Three kinds fill it: a value head on the actor's trunk (:class:`SharedHeadCritic`), a model of
its own (:class:`ModelCritic`), and an adapter of its own on a LoRA base (``AdapterCritic`` in
models/lora.py).  The trainer asks a critic for its values and trains its ``parameters()``;
the one thing it must know is whether the values read the actor's own forward pass
(``reads_actor_trunk``), which decides whether actor and critic share one backward pass.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from ppo_rlhf.config import ConfigError
from ppo_rlhf.models.loading import (  # noqa: F401 -- VALUE_HEAD: a critic folder's value head, named there
    VALUE_HEAD,
    enable_activation_checkpointing,
    from_pretrained,
    is_adapter_only,
    load_adapter_as_model,
    write_model_folder,
)
from ppo_rlhf.sharding import load_whole_state, shard, shard_unit, unique_state_dict


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
    """What the PPO trainer needs of a critic.

    ``values(sequences, actor_hidden)`` gives (B, T) float32 values at the positions that predict
    each response token of ``sequences`` (a rollout/sequences.py ``Sequences``: prompt + response
    ids, masks and positions).  ``actor_hidden`` is the actor's (B, T, H) hidden state at those
    positions, from the forward pass the trainer has just run: a critic that reads it
    (``reads_actor_trunk``) is trained in that pass's backward; any other runs its own forward
    and backward inside ``scope()``.  ``parameters()`` are exactly what the critic trains.
    ``save``/``load_saved`` write and read a folder (checkpoints/critic, and the resume point).
    ``shard(settings)`` splits what the critic trains over the processes of an FSDP launch.
    """

    reads_actor_trunk = False
    stored_dtype: torch.dtype | None = None  # a trunk loaded in half precision is saved back so

    def values(self, sequences, actor_hidden: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def scope(self):
        """Context for this critic's forward and backward passes (an adapter critic activates
        its adapter); nothing to set up by default."""
        return contextlib.nullcontext()

    def enable_gradient_checkpointing(self) -> None:
        """Recompute activations in the backward pass, where the critic has a trunk of its own."""

    def save(self, path: str | Path, tokenizer=None, dtype: torch.dtype | None = None) -> None:
        raise NotImplementedError

    def load_saved(self, path: str | Path) -> None:
        raise NotImplementedError

    def shard(self, settings) -> None:
        raise ConfigError(f"FSDP: a {type(self).__name__} cannot be sharded; allowed critics under an FSDP launch: "
                          f"shared (a value head on the actor) or separate (a model of its own)")


def values_over_response(values: torch.Tensor, sequences) -> torch.Tensor:
    """(B, P+T) values over a whole sequence -> (B, T) at the positions that predict each
    response token (position P-1+t predicts token t), as the actor's log-probs are taken."""
    start = sequences.prompt_length - 1
    return values[:, start:-1]


def values_of_own_pass(critic: nn.Module, sequences) -> torch.Tensor:
    """(B, T) values of a critic that runs its own forward pass over whole sequences:
    ``critic(input_ids, attention_mask, position_ids) -> (B, P+T)``."""
    full = critic(sequences.input_ids, sequences.attention_mask, sequences.position_ids)
    return values_over_response(full, sequences)


def save_value_head(head: ValueHead, path: Path) -> None:
    from safetensors.torch import save_file

    # unique_state_dict: inside sharding.gathered, the whole head rather than this process's shard
    save_file({k: v.contiguous() for k, v in unique_state_dict(head).items()}, str(path / VALUE_HEAD))


def load_value_head(head: ValueHead, path: Path) -> None:
    from safetensors.torch import load_file

    load_whole_state(head, load_file(str(path / VALUE_HEAD)))  # the head may be sharded


class SharedHeadCritic(Critic):
    """A value head on the actor's trunk: the cheapest critic (one forward and one backward
    pass serve actor and critic), at the price of a value loss that moves the actor's trunk."""

    reads_actor_trunk = True

    def __init__(self, value_head: ValueHead):
        super().__init__()
        self.value_head = value_head

    @classmethod
    def on(cls, actor: nn.Module) -> "SharedHeadCritic":
        """A fresh head for ``actor`` (a causal LM or a peft model), on its device, in float32."""
        return cls(value_head_on(actor))

    def values(self, sequences, actor_hidden: torch.Tensor | None = None) -> torch.Tensor:
        if actor_hidden is None:
            raise ValueError("a value head on the actor's trunk reads the actor's hidden states; none were given")
        return self.value_head(actor_hidden)

    def save(self, path: str | Path, tokenizer=None, dtype: torch.dtype | None = None) -> None:
        """The head alone (the trunk is the actor's, saved as the actor); float32 as trained."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_value_head(self.value_head, path)

    def load_saved(self, path: str | Path) -> None:
        load_value_head(self.value_head, Path(path))

    def shard(self, settings) -> None:
        """Nothing: the trunk is the actor's (sharded with it); the head is a few numbers per
        process, its gradient summed with the unsharded ones."""


class ModelCritic(Critic):
    """A separate critic: a transformer trunk (``AutoModel``) plus a value head.

    Initialised from the reward model's trunk by default, as published RLHF recipes do: it
    already reads the responses the way the reward does.
    """

    def __init__(self, backbone, value_head: ValueHead | None = None):
        super().__init__()
        self.backbone = backbone
        self.value_head = value_head or value_head_on(backbone)
        self.stored_dtype = backbone.dtype  # before the trainer upcasts a half-precision trunk

    @classmethod
    def from_pretrained_trunk(cls, path: str | Path, dtype: torch.dtype | str = "auto") -> "ModelCritic":
        from transformers import AutoModel

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

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """(B, L) values over whole sequences."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # (B, L, H)
        return self.value_head(hidden)  # (B, L)

    def values(self, sequences, actor_hidden: torch.Tensor | None = None) -> torch.Tensor:
        return values_of_own_pass(self, sequences)

    def enable_gradient_checkpointing(self) -> None:
        enable_activation_checkpointing(self.backbone)

    def save(self, path: str | Path, tokenizer=None, dtype: torch.dtype | None = None) -> None:
        """Trunk as a standard HF folder, value head beside it as safetensors; the tokenizer
        says which token ids the critic reads.  ``dtype``: the trunk is cast to it first (the
        end of a run: a bf16 trunk goes back out in bf16); the head stays float32."""
        path = Path(path)
        write_model_folder(self.backbone, path, dtype=dtype)
        save_value_head(self.value_head, path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    def load_saved(self, path: str | Path) -> None:
        """Load weights written by :meth:`save` into this critic."""
        from transformers import AutoModel

        load_whole_state(self.backbone, AutoModel.from_pretrained(path).state_dict())
        load_value_head(self.value_head, Path(path))

    def shard(self, settings) -> None:
        """The trunk per decoder layer, the head as a unit of its own (it is called on its own)."""
        shard(self.backbone, settings)
        shard_unit(self.value_head, settings)
