"""LoRA with peft: one base model in memory serves every PPO role.

    actor      base + the "policy" adapter (trained)
    reference  the same base with every adapter disabled (the model PPO started from)
    critic     the policy adapter's trunk + a value head (shared), or base + a "critic" adapter
               + a value head (its own adapter, initialised from the reward adapter when there is one)
    reward     base + a "reward" adapter + its score head, trained by ``ppo-rlhf rm --lora``

Only one adapter is active at a time; :func:`active_adapter` switches for one forward pass.
Gradients flow to whichever adapters took part in the graph, so the actor and a critic adapter
train together in one backward pass.

Every adapter is saved as a standard peft folder (``adapter_config.json`` +
``adapter_model.safetensors``) that ``PeftModel.from_pretrained(base, folder)`` loads;
:func:`merge_adapter_folder` folds one into a full Hugging Face model.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ppo_rlhf.checkpoint import atomic_directory
from ppo_rlhf.config import MODEL_DATA, ConfigError, above, between, check, option
from ppo_rlhf.models.loading import (
    ADAPTER_WEIGHTS,
    ModelError,
    adapter_base_path,
    adapter_record,
    load_adapter_as_model,
    load_tokenizer,
    read_adapter,
    save_pretrained_atomic,
    stored_dtype,
    trunk_of,
)
from ppo_rlhf.models.value import (
    VALUE_HEAD,
    Critic,
    ValueHead,
    load_value_head,
    value_head_on,
    values_of_own_pass,
)

# peft asks transformers a deprecated question on every wrap; the user can do nothing about it.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*is deprecated", category=FutureWarning)



# The default targets (docs/design.md, "Defaults that learn"): peft's 'all-linear' leaves the output
# layer frozen, and with it the most direct way a policy has to write a token more often; a 0/1
# reward under the README's command on a user's tiny Llama rose 1.43x in 30 iterations that way
# and 2.34x with the output layer adapted too.  A tied output layer is left out: merging an
# adapter into it (ppo-rlhf merge, the vLLM engine's weight sync) would change the input
# embeddings as well.
ALL_LINEAR_AND_OUTPUT = "all-linear+output"


def target_modules(targets: str, model: nn.Module | None, output_layer: bool = True) -> str | list[str]:
    """peft's ``target_modules`` for ``--lora-target-modules``: 'all-linear' as is, a list of
    names, or (the default) the model's linear layers' names plus its output layer's when the
    model has one of its own (a causal LM whose output weights are not its input embeddings) and
    ``output_layer`` asks for it."""
    targets = targets.strip()
    if targets == "all-linear":
        return targets
    if targets != ALL_LINEAR_AND_OUTPUT:
        return [t.strip() for t in targets.split(",") if t.strip()]
    if not output_layer:
        return "all-linear"
    if model is None or model.get_output_embeddings() is None or model.get_input_embeddings() is None \
            or output_layer_tied(model):
        return "all-linear"
    return linear_layer_names(model, most=None)


def output_layer_tied(model: nn.Module) -> bool:
    """Whether the model's output layer is its input embeddings (one weight): the default targets
    then leave it unadapted, and the run's plan says so (trainers/ppo_plan.py)."""
    output, inputs = model.get_output_embeddings(), model.get_input_embeddings()
    return output is not None and inputs is not None and output.weight.data_ptr() == inputs.weight.data_ptr()


@dataclass
class LoraOptions:
    """The LoRA fields shared by every stage that can train adapters (``sft``, ``rm`` and ``ppo``)."""

    option_group = MODEL_DATA  # --help's group of all these options (config.py, GROUPS)

    lora: bool = option(False, "train LoRA adapters on one frozen base instead of the full model (peft)")
    lora_r: int = option(16, "LoRA rank", range=above(0))
    lora_alpha: float = option(32.0, "LoRA alpha: the adapter's update is scaled by alpha / r", range=above(0))
    lora_dropout: float = option(0.0, "dropout on the LoRA path; ppo keeps it on in its training passes (rollouts "
                                      "and old/ref passes run in eval mode), so > 0 makes the first PPO ratio "
                                      "differ from 1 there", range=between(0, 1, high_open=True))
    lora_target_modules: str = option(ALL_LINEAR_AND_OUTPUT, f"modules to adapt: '{ALL_LINEAR_AND_OUTPUT}' (every "
                                      "linear layer, and the output layer unless it is tied to the input "
                                      "embeddings), 'all-linear' (peft's: every linear layer but the output "
                                      "layer) or comma-separated module names, e.g. q_proj,v_proj")

    def validate_lora(self) -> None:
        check(bool(self.lora_target_modules.strip()), "lora_target_modules",
              f"'{ALL_LINEAR_AND_OUTPUT}', 'all-linear' or module names", self.lora_target_modules)

    def lora_config(self, task_type: str, model: nn.Module | None = None, output_layer: bool = True):
        """``output_layer=False``: the default targets without the output layer (an adapter that
        never reaches the logits: the critic's)."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
            target_modules=target_modules(self.lora_target_modules, model, output_layer),
            task_type=task_type,
            # GPT-2 stores its linear layers transposed (Conv1D); peft needs to be told.
            fan_in_fan_out=model is not None and uses_conv1d(model),
        )


def with_adapter(options: LoraOptions, model: nn.Module, task_type: str, adapter_name: str = "default"):
    """``get_peft_model`` with the options' adapter; ``--lora-target-modules`` naming no module of
    the model (peft's NoMatchingPeftModuleError, a ValueError) becomes a ConfigError that names
    the flag and the model's linear layers."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, options.lora_config(task_type, model), adapter_name=adapter_name)
    except ValueError as error:
        if "target" not in str(error).lower():
            raise
        raise ConfigError(f"--lora-target-modules {options.lora_target_modules!r} matches no layer of the model "
                          f"that LoRA can adapt; its linear layers are named {', '.join(linear_layer_names(model))} "
                          f"(or give '{ALL_LINEAR_AND_OUTPUT}' or 'all-linear')") from None


def linear_layer_names(model: nn.Module, most: int | None = 12) -> list[str]:
    """The distinct last parts of the model's linear layers' names (q_proj, c_attn, ...), the
    first ``most`` of them (None: all)."""
    from transformers.pytorch_utils import Conv1D

    names = dict.fromkeys(name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                          if isinstance(module, (nn.Linear, Conv1D)))
    return list(names)[:most]


def uses_conv1d(model: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return any(isinstance(module, Conv1D) for module in model.modules())


# ------------------------------------------------------------------ adapter folders
def save_adapter(peft_model, adapter_name: str, path: str | Path, tokenizer=None, extra: dict | None = None) -> Path:
    """One adapter as a standard peft folder at ``path`` (not in a sub-folder named after the
    adapter, as ``save_pretrained`` would put it), written atomically.  ``extra``: more
    safetensors files to write beside it, ``{file name: state dict}``."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    path = Path(path)
    config = copy.deepcopy(peft_model.peft_config[adapter_name])
    config.inference_mode = True
    config.base_model_name_or_path = str(Path(peft_model.get_base_model().name_or_path).resolve())
    # Only the adapter: with the output layer adapted, peft would also save the (frozen) embedding
    # and output weights, a vocabulary x width matrix each, unless told not to.
    state = get_peft_model_state_dict(peft_model, adapter_name=adapter_name, save_embedding_layers=False)
    with atomic_directory(path) as staging:
        config.save_pretrained(staging)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(staging / ADAPTER_WEIGHTS))
        for name, tensors in (extra or {}).items():
            save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(staging / name))
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return path


def add_adapter_from(peft_model, adapter_name: str, config, lora_weights: dict) -> None:
    """Add an adapter with given weights to ``peft_model`` (on whatever head it has)."""
    from peft import set_peft_model_state_dict

    config = copy.deepcopy(config)
    config.modules_to_save = None  # a reward adapter's score head is kept apart, not wrapped into the LM
    config.task_type = peft_model.peft_config[peft_model.active_adapter].task_type
    config.inference_mode = False
    peft_model.add_adapter(adapter_name, config)
    result = set_peft_model_state_dict(peft_model, lora_weights, adapter_name=adapter_name)
    missing = [k for k in result.missing_keys if "lora_" in k and f".{adapter_name}." in k]
    if missing:
        raise ModelError(f"the {adapter_name} adapter's weights do not fit the base model: {len(missing)} LoRA "
                         f"matrices missing, e.g. {missing[0]}")


def load_adapter_weights(peft_model, adapter_name: str, path: str | Path) -> None:
    """Load the LoRA weights saved at ``path`` into the existing adapter ``adapter_name``."""
    from peft import set_peft_model_state_dict

    _, lora, _ = read_adapter(path)
    set_peft_model_state_dict(peft_model, lora, adapter_name=adapter_name)


@contextlib.contextmanager
def trainable_flags_kept(peft_model) -> Iterator[None]:
    """Restore every adapter's ``requires_grad`` on exit.

    peft's ``set_adapter`` and the exit of ``disable_adapter`` make the active adapter the only
    trainable one; which adapters train is the trainer's decision, not a side effect of a
    forward pass.
    """
    flags = [(p, p.requires_grad) for name, p in peft_model.named_parameters() if "lora_" in name]
    try:
        yield
    finally:
        for parameter, flag in flags:
            parameter.requires_grad_(flag)


@contextlib.contextmanager
def active_adapter(peft_model, adapter_name: str) -> Iterator[None]:
    """Run the base with ``adapter_name`` active, then switch back."""
    previous = peft_model.active_adapter
    if previous == adapter_name:
        yield
        return
    with trainable_flags_kept(peft_model):
        peft_model.set_adapter(adapter_name)
        try:
            yield
        finally:
            peft_model.set_adapter(previous)


@contextlib.contextmanager
def adapters_disabled(peft_model) -> Iterator[None]:
    """Run the base alone (the PPO reference)."""
    with trainable_flags_kept(peft_model), peft_model.disable_adapter():
        yield


def adapter_parameters(peft_model, adapter_name: str) -> list[nn.Parameter]:
    return [p for name, p in peft_model.named_parameters() if f".{adapter_name}." in name and "lora_" in name]


# ------------------------------------------------------------------ roles on the shared base
class AdapterCritic(Critic):
    """The critic as its own adapter on the shared base, plus a value head (models/value.py
    has the interface).

    The adapter's parameters are registered here too (as the same tensors), so the critic's
    ``parameters()`` are exactly what the critic trains; the base is not a sub-module: it
    belongs to the actor.
    """

    def __init__(self, peft_model, adapter_name: str = "critic", value_head: ValueHead | None = None):
        super().__init__()
        self._peft_model = [peft_model]  # a list keeps it out of this module's sub-modules
        self.adapter_name = adapter_name
        self.value_head = value_head or value_head_on(peft_model.get_base_model())
        self.adapter = nn.ParameterList(adapter_parameters(peft_model, adapter_name))

    @property
    def peft_model(self):
        return self._peft_model[0]

    def scope(self):
        """The critic adapter active: around its backward pass too, where gradient checkpointing
        recomputes the activations (with another adapter active they would be another model's)."""
        return active_adapter(self.peft_model, self.adapter_name)

    def forward(self, input_ids, attention_mask, position_ids) -> torch.Tensor:
        """(B, L) values over whole sequences."""
        with self.scope():
            hidden = trunk_of(self.peft_model)(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state  # (B, L, H)
        return self.value_head(hidden)  # (B, L)

    def values(self, sequences, actor_hidden: torch.Tensor | None = None) -> torch.Tensor:
        return values_of_own_pass(self, sequences)

    def save(self, path: str | Path, tokenizer=None, dtype: torch.dtype | None = None) -> None:
        """The adapter as a peft folder with the value head beside it; both float32 as trained
        (the base, saved by no one here, keeps its dtype), so ``dtype`` changes nothing."""
        save_adapter(self.peft_model, self.adapter_name, path, tokenizer, extra={VALUE_HEAD: self.value_head.state_dict()})

    def load_saved(self, path: str | Path) -> None:
        load_adapter_weights(self.peft_model, self.adapter_name, path)
        load_value_head(self.value_head, Path(path))


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Run ``module`` in eval mode, then give every sub-module back the mode it had."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


class _AdapterTrunk:
    """Callable trunk that runs the shared base with one adapter active (not an nn.Module:
    freezing the reward must not freeze the base that the actor trains).

    The base is in whatever mode the actor is in -- train mode after an update, dropout on --
    so the reward switches it to eval mode for its own pass: a score must not be random."""

    def __init__(self, peft_model, adapter_name: str):
        self.peft_model, self.adapter_name = peft_model, adapter_name

    def __call__(self, **inputs):
        with active_adapter(self.peft_model, self.adapter_name), eval_mode(self.peft_model):
            return trunk_of(self.peft_model)(**inputs)


class AdapterRewardModel(nn.Module):
    """A reward adapter on the shared base, shaped like a sequence classifier for
    :class:`~ppo_rlhf.rollout.reward.ModelReward`: ``base_model`` (the trunk, run with the
    reward adapter) and ``score`` (its head)."""

    def __init__(self, peft_model, adapter_name: str, score: nn.Linear):
        super().__init__()
        self.score = score
        self.base_model = _AdapterTrunk(peft_model, adapter_name)
        self.config = peft_model.get_base_model().config


def merge_adapter_folder(adapter: str | Path, out: str | Path, base: str | Path | None = None,
                         dtype: torch.dtype | None = torch.float32) -> Path:
    """Fold an adapter into its base and save a full model folder (with the tokenizer), its weights
    in ``dtype`` (None: the base's stored dtype).  The merge is float32 whatever is saved
    (``merge_in_float32``); a 16-bit ``dtype`` rounds each merged weight once."""
    adapter = Path(adapter)
    kind = "classifier" if adapter_record(adapter).get("task_type") == "SEQ_CLS" else "causal_lm"
    if dtype is None:  # a dtype by name: "auto" would hold an adapter on a 16-bit base in float32
        dtype = stored_dtype(base or adapter_base_path(adapter)) or "auto"
    model = load_adapter_as_model(adapter, kind, dtype, base=base)
    has_tokenizer = (adapter / "tokenizer_config.json").is_file()
    tokenizer = load_tokenizer(adapter if has_tokenizer else (base or adapter_base_path(adapter)))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id  # HF's own classifier pooling needs it
    return save_pretrained_atomic(model, tokenizer, out)
