"""Loading and saving Hugging Face models; building tiny ones from a config for the built-in task.

Every checkpoint ppo-rlhf writes is a standard folder: ``AutoModelForCausalLM`` /
``AutoModelForSequenceClassification`` / ``AutoTokenizer.from_pretrained`` load it as is.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from ppo_rlhf.checkpoint import atomic_directory
from ppo_rlhf.hardware import HALF
from ppo_rlhf.sharding import unique_state_dict


class ModelError(ValueError):
    """A model folder that cannot serve the role asked of it; the message names the folder."""


def base_of(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def trunk_of(model: nn.Module) -> nn.Module:
    """The transformer trunk (no output layer or head), also through a peft wrapper: what the
    output layer or a score head reads the last hidden state of."""
    return base_of(model).base_model


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Each decoder layer's activations recomputed in the backward pass (non-reentrant), called by
    the name this transformers has: ``activation_checkpointing_enable`` in 5.2x, where
    ``gradient_checkpointing_enable`` is a deprecated alias (warns, goes in v6), the old name before."""
    options = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def require_model_folder(path: str | Path, what: str, prefer: tuple[str, ...] = ()) -> Path:
    """``path`` if it holds a model (config.json); otherwise an error that says what it is when
    ppo-rlhf wrote it -- a critic, an adapter, a run folder (and where that run's model is:
    ``prefer`` names the checkpoints that fit the role asked for, e.g. actor or sft)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} not found: {path}")
    if not (path / "config.json").is_file():
        refuse_folder_of_another_kind(path, what, prefer)
        if is_adapter_folder(path):
            raise ModelError(f"{what} at {path}: {path} is a LoRA adapter (adapter_config.json), not a full model "
                             f"folder")
        raise FileNotFoundError(f"{what} at {path} is not a Hugging Face model folder (no config.json)")
    return path


def refuse_folder_of_another_kind(path: str | Path, what: str, prefer: tuple[str, ...] = ()) -> None:
    """ModelError if ``path``, given as ``what``, is a folder ppo-rlhf wrote that holds no model of
    its own: a critic, or a run folder (named with where its model is; ``prefer``: the checkpoints
    that fit the role, e.g. actor or sft).  Every model-folder input goes through it, whichever
    file is read first (a model's config.json, or its tokenizer: :func:`load_tokenizer`)."""
    described = critic_description(path) or run_folder_description(path, prefer)
    if described is not None:
        raise ModelError(f"{what} at {path}: {described}")


# What ppo-rlhf writes, read back to say what a folder given in the wrong place is (docs/design.md,
# "Resume and divergence": folders say what they are).
VALUE_HEAD = "value_head.safetensors"  # a critic folder's value head, beside its trunk or adapter (models/value.py)
POLICY_CHECKPOINTS = ("actor", "sft")  # a run's causal LMs: ppo's final actor, sft's model
REWARD_CHECKPOINTS = ("reward",)


def critic_description(path: str | Path) -> str | None:
    """What a critic a ppo run saved is (None for any other folder): it reads a sequence and
    gives values; it writes no tokens and scores no answers, so it serves as no policy and no
    reward model."""
    path = Path(path)
    if not (path / VALUE_HEAD).is_file():
        return None
    if is_adapter_folder(path):
        kind = f"a critic adapter (a LoRA adapter with a value head, {VALUE_HEAD}: ppo --critic lora)"
    elif (path / "config.json").is_file():
        kind = f"a critic (a model's trunk with a value head, {VALUE_HEAD}: ppo --critic separate)"
    else:
        kind = f"a critic's value head alone ({VALUE_HEAD}: ppo --critic shared, a head on the actor's trunk)"
    policy = path.parent / "actor"
    has_policy = (policy / "config.json").is_file() or is_adapter_folder(policy)
    beside = f"; the run's policy is {policy}" if has_policy else ""
    return f"{path} is {kind}: it gives values of tokens, and neither writes nor scores answers{beside}"


def refuse_critic(path: str | Path, what: str) -> None:
    """ModelError if ``path`` is a critic (see :func:`critic_description`), given as ``what``."""
    described = critic_description(path)
    if described is not None:
        raise ModelError(f"{what} at {path}: {described}")


def run_folder_description(path: str | Path, prefer: tuple[str, ...] = ()) -> str | None:
    """What a run folder given as a model holds (None for any other folder): where its model is."""
    checkpoints = Path(path) / "checkpoints"
    if not checkpoints.is_dir():
        return None
    models = [folder for folder in sorted(checkpoints.iterdir())
              if folder.name != "last" and folder.is_dir() and critic_description(folder) is None
              and ((folder / "config.json").is_file() or is_adapter_folder(folder))]
    if not models:
        return f"{path} is a run folder, not a model folder, and its run has saved no model yet ({checkpoints})"
    fitting = [folder for folder in models if folder.name in prefer] or models
    others = [str(folder) for folder in models if folder != fitting[0]]
    return (f"{path} is a run folder, not a model folder: its model is {fitting[0]}"
            + (f" (it also holds {', '.join(others)})" if others else ""))


def refuse_adapter(path: str | Path, command: str) -> None:
    """ModelError if ``path`` is a LoRA adapter: ``command`` (sft, rm) trains a full model, and an
    adapter is only a difference from its base."""
    if path is not None and is_adapter_only(path):
        base = adapter_record(path).get("base_model_name_or_path") or "its base"
        raise ModelError(f"--model {path} is a LoRA adapter (adapter_config.json, trained on {base}), and {command} "
                         f"trains a full model: merge it into its base first (ppo-rlhf merge --adapter {path} --out "
                         f"DIR) and give --model DIR")


def is_adapter_only(path: str | Path) -> bool:
    """A peft adapter folder (adapter_config.json, no config.json of its own)."""
    path = Path(path)
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


# ------------------------------------------------------------------ adapter folders, read as models
# (written by ``models/lora.py``; read here so that loading any model folder needs nothing above it)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_folder(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_record(path: str | Path) -> dict:
    """The adapter's ``adapter_config.json`` as a dict (peft type, task type, base folder)."""
    return json.loads((Path(path) / ADAPTER_CONFIG).read_text())


def adapter_base_path(path: str | Path) -> Path:
    """The base model folder an adapter was trained on, as recorded in its config."""
    base = adapter_record(path).get("base_model_name_or_path")
    if not base:
        raise FileNotFoundError(f"adapter {path} does not record its base model (base_model_name_or_path)")
    return Path(base)


def read_adapter(path: str | Path):
    """(LoraConfig, LoRA weights, other weights) of an adapter folder.  "Other" holds what peft
    saved beside the LoRA matrices, such as a reward adapter's score head."""
    from peft import PeftConfig
    from safetensors.torch import load_file

    path = Path(path)
    config = PeftConfig.from_pretrained(path)
    state = load_file(str(path / ADAPTER_WEIGHTS))
    lora = {k: v for k, v in state.items() if "lora_" in k}
    other = {k: v for k, v in state.items() if "lora_" not in k}
    return config, lora, other


def score_head_from(other_weights: dict, path: str | Path) -> nn.Linear:
    """The score head saved in a reward adapter folder (peft's ``modules_to_save``)."""
    weight_keys = [k for k in other_weights if k.endswith("score.weight")]
    if not weight_keys:
        raise ValueError(f"{path} holds no score head (score.weight): is it a reward adapter from `ppo-rlhf rm --lora`?")
    weight = other_weights[weight_keys[0]]
    bias = other_weights.get(weight_keys[0][: -len("weight")] + "bias")
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)  # (K, H) weight
    with torch.no_grad():
        head.weight.copy_(weight)
        if bias is not None:
            head.bias.copy_(bias)
    return head


def load_adapter_as_model(path: str | Path, kind: str, dtype: torch.dtype | str | None = None,
                          base: str | Path | None = None):
    """Base + adapter merged into one plain ``transformers`` model, held in ``dtype``
    (:func:`adapter_merge_dtype`: float32 at None or "auto" for a base stored in 16 bits) and
    merged in float32 whatever it is held in (:func:`merge_in_float32`).  ``kind``: "causal_lm" or
    "classifier" (the adapter's score head is loaded as the classifier's head).  ``base``: the
    base folder, if not the one the adapter records."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    path = Path(path)
    refuse_critic(path, "adapter")
    record = adapter_record(path)
    if record.get("peft_type") != "LORA":
        raise ModelError(f"{path} holds a {record.get('peft_type')} adapter; ppo-rlhf loads LoRA adapters")
    is_reward = record.get("task_type") == "SEQ_CLS"
    if is_reward != (kind == "classifier"):
        wanted, found = ("a reward", "a causal-LM") if kind == "classifier" else ("a causal-LM", "a reward")
        raise ModelError(f"{path} holds {found} adapter (task_type {record.get('task_type')}), not {wanted} adapter")
    recorded = record.get("base_model_name_or_path")
    given, base = base, Path(base) if base is not None else adapter_base_path(path)
    if not (base / "config.json").is_file():
        if given is not None and (not recorded or base.resolve() != Path(recorded).resolve()):
            raise FileNotFoundError(f"--base {base} is not a model folder (no config.json); adapter {path} records its "
                                    f"base as {recorded or 'nothing'}: give that base, or a copy of it, as --base "
                                    f"(or leave --base out to use the one it records)")
        raise FileNotFoundError(f"adapter {path} was trained on {base}, which is not a model folder (no config.json)")
    dtype = adapter_merge_dtype(path, dtype, base)
    if kind == "classifier":
        _, _, other = read_adapter(path)
        num_labels = score_head_from(other, path).out_features
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=num_labels, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    try:
        merged = merge_in_float32(PeftModel.from_pretrained(model, path))
    except (ValueError, RuntimeError) as error:  # layers it names are missing, or of other shapes
        reason = str(error).strip().splitlines()[0]
        raise ModelError(f"adapter {path} does not fit the base {base} ({reason}); give the base it was trained on "
                         f"(it records {recorded})") from None
    merged.name_or_path = str(path)
    return merged


def merge_in_float32(peft_model):
    """``merge_and_unload`` of the active adapter, each adapted weight's ``W + delta`` computed in
    float32 and rounded once to the dtype ``W`` is held in: the one merge of an adapter into a
    model (``load_adapter_as_model``: eval, merge, and an adapter given as --model, --teacher,
    --reward-model or a local --reward-judge).  A model held in float32 gets the whole update; one
    held in 16 bits, the update rounded once.  One layer at a time is lifted to float32, so a
    model held in 16 bits never has a float32 copy."""
    from peft.tuners.lora import LoraLayer

    adapter = peft_model.active_adapter
    with torch.no_grad():
        for layer in peft_model.modules():
            weight = getattr(layer.get_base_layer(), "weight", None) if isinstance(layer, LoraLayer) else None
            if weight is None:
                continue
            held = weight.dtype
            weight.data = weight.data.float()
            layer.merge(adapter_names=[adapter])  # peft's formula (LoRA, DoRA, ...), here in float32
            weight.data = weight.data.to(held)
    with warnings.catch_warnings():  # the LoRA layers are merged above; peft unloads them and merges the rest
        warnings.filterwarnings("ignore", message="All adapters are already merged")
        return peft_model.merge_and_unload()


# Any one of these says a folder holds a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load_tokenizer(path: str | Path, what: str = "model", prefer: tuple[str, ...] = ()):
    """The tokenizer of a model folder (``what`` names the folder's role in messages; ``prefer``:
    the checkpoints of a run folder that fit it, as :func:`require_model_folder` takes them)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer not found: {path}")
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is a file, not a Hugging Face model folder (a folder with the "
                                f"tokenizer and config.json)")
    # Checked here because AutoTokenizer, given a model folder without one, builds an empty
    # tokenizer of the model's type instead of failing.
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        if not (path / "config.json").is_file():  # a run folder or a critic: said what it is, and where its model is
            refuse_folder_of_another_kind(path, what, prefer)
        raise FileNotFoundError(f"{path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                                f"save one there with tokenizer.save_pretrained")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        # Common for causal LMs; masks never come from the pad id (they come from the first EOS),
        # so reusing EOS as pad is safe here.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def same_vocabulary(tokenizer, other) -> bool:
    """Whether token ids mean the same thing under both tokenizers."""
    return tokenizer is other or tokenizer.get_vocab() == other.get_vocab()


def _model_config(path: Path, what: str):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError) as error:  # an unknown model_type, or a config.json that is not JSON
        raise ModelError(f"{what} at {path}: transformers cannot read its config.json: {error}") from None
    check_heads(config, path / "config.json")
    return config


def check_heads(config, where) -> None:
    """ModelError naming ``where`` if the attention heads cannot share the width evenly, which
    transformers reports only as a ValueError while building the model.  A config with its own
    ``head_dim`` (Llama and its kin) sets the head size apart from the width and is not checked."""
    heads, width = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    if heads and width and width % heads and getattr(config, "head_dim", None) is None:
        raise ModelError(f"{where}: its {heads} attention heads do not divide its width {width} (hidden_size), so "
                         f"the heads cannot share it; fix num_attention_heads or hidden_size (n_head, n_embd)")


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def from_pretrained(loader, path: Path, refusal: str, **kwargs):
    """``loader.from_pretrained(path)``, its failures named: a class that cannot load this model
    (``refusal`` says so, naming the folder) or weight files that cannot be read (truncated,
    corrupt, the wrong shapes)."""
    from safetensors import SafetensorError

    try:
        return loader.from_pretrained(path, **kwargs)
    except ValueError as error:
        raise ModelError(f"{refusal}: {str(error).strip().splitlines()[0]}") from None
    except (OSError, RuntimeError, SafetensorError) as error:
        files = sorted(f.name for f in Path(path).iterdir() if f.suffix in WEIGHT_SUFFIXES) or ["no weight file"]
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelError(f"{path}: cannot read the model's weights ({', '.join(files)}): {reason}; the file may be "
                         f"truncated or corrupt: save or download it again") from None


def max_positions(config) -> int | None:
    """Longest sequence a model's position embeddings allow (None: no fixed limit known)."""
    for name in ("max_position_embeddings", "n_positions"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return None


def check_tokenizer(tokenizer, where, chat_template: bool = False, needs_eos: bool = True,
                    template_flag: str = "--chat-template") -> None:
    """Refuse a tokenizer that cannot do what the stage asks of it: without EOS a response could
    never end (and SFT could not teach one to); without a pad token (load_tokenizer pads with EOS
    when there is none) rows of different lengths cannot be batched; ``--chat-template`` needs a
    chat template.  ``template_flag``: what asked for the template (a task that formats its
    prompts with it names itself: the user never gave --chat-template)."""
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ModelError(f"{where}: its tokenizer has no pad token and no EOS token to pad with, so rows of "
                         f"different lengths cannot be batched; set pad_token (or eos_token) in its "
                         f"tokenizer_config.json (tokenizer.pad_token = ...; tokenizer.save_pretrained)")
    if needs_eos and tokenizer.eos_token_id is None:
        raise ModelError(f"{where}: its tokenizer has no EOS token, so a response could never end; set eos_token "
                         f"in its tokenizer_config.json (e.g. tokenizer.eos_token = '</s>'; tokenizer.save_pretrained)")
    if chat_template and getattr(tokenizer, "chat_template", None) is None:
        fix = ("drop --chat-template (prompts are then plain text) or give a model whose tokenizer has one"
               if template_flag == "--chat-template" else "give a model whose tokenizer has one (an instruct or chat "
                                                          "model)")
        raise ModelError(f"{where}: its tokenizer has no chat template, so {template_flag} cannot format the "
                         f"prompts with it; {fix}")


def check_vocabulary(model, tokenizer, where) -> None:
    """Refuse a model whose embeddings cannot take the tokenizer's ids (``where`` names the model:
    its folder, or ``model=`` / ``reward=`` for one given in Python)."""
    vocabulary = model.get_input_embeddings().num_embeddings
    if vocabulary < len(tokenizer):
        raise ModelError(f"{where}: the model's vocabulary has {vocabulary} tokens but its tokenizer has "
                         f"{len(tokenizer)}, so ids from {vocabulary} up would index past the embeddings; give the "
                         f"tokenizer the model was trained with")


def check_fits(model, tokenizer, longest: int, where, limit: str) -> None:
    """Refuse a model whose embeddings cannot take the tokenizer's ids, or whose positions stop
    before the ``longest`` sequence the stage will build (``limit``: the setting that allows it)."""
    check_vocabulary(model, tokenizer, where)
    positions = max_positions(model.config)
    if positions is not None and longest > positions:
        raise ModelError(f"{where}: the model has {positions} positions but sequences here reach {longest} tokens "
                         f"({limit}); lower it so that sequences fit in {positions} tokens")


def _describe(path: Path, config) -> str:
    architectures = ", ".join(config.architectures or []) or "no architectures listed"
    return f"{path} holds a '{config.model_type}' model ({architectures})"


def _is_causal_lm(architecture: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
    return known or architecture.endswith(("ForCausalLM", "LMHeadModel"))  # or remote code named as usual


def adapter_merge_dtype(path: str | Path, dtype: torch.dtype | str | None,
                        base: str | Path | None = None) -> torch.dtype | str | None:
    """The dtype to hold ``path`` in for it to compute what training computed.  A LoRA adapter
    trained on a base stored in 16 bits keeps its own weights in float32, and the trained policy
    is the 16-bit base plus a float32 update: held in 16 bits, every change under half a 16-bit
    ulp of its weight is rounded away (docs/design.md, "The weight probe's tolerance": 84% of
    SmolLM2's adapted weights after one iteration).  So at None or ``"auto"`` (the stored dtype)
    such an adapter is held in float32; a dtype given by name is kept, as asked (the merge itself
    is float32 either way: :func:`merge_in_float32`).  ``base``: the adapter's base, if not the
    one it records."""
    if dtype not in (None, "auto") or not is_adapter_folder(path):
        return dtype
    return torch.float32 if stored_dtype(base if base is not None else adapter_base_path(path)) in HALF else dtype


def stored_dtype(folder: str | Path) -> torch.dtype | None:
    """The dtype a model folder's config.json records for its weights (None: no folder, or none recorded)."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return None
    stored = getattr(_model_config(folder, "the adapter's base"), "dtype", None)
    return getattr(torch, stored, None) if isinstance(stored, str) else stored


def load_causal_lm(path: str | Path, dtype: torch.dtype | str | None = None):
    """A causal LM folder; anything else is refused rather than loaded with a fresh random head
    (AutoModelForCausalLM would happily wrap a BERT encoder or a reward model's trunk)."""
    from transformers import AutoModelForCausalLM

    refuse_critic(path, "causal LM")
    if is_adapter_only(path):  # a LoRA adapter (e.g. RUN/checkpoints/actor of a --lora run)
        return load_adapter_as_model(path, "causal_lm", dtype)
    path = require_model_folder(path, "causal LM", prefer=POLICY_CHECKPOINTS)
    config = _model_config(path, "causal LM")
    # A folder without architectures (a config written by hand) gets the benefit of the doubt.
    if config.architectures and not any(_is_causal_lm(a) for a in config.architectures):
        raise ModelError(f"{_describe(path, config)}, not a causal LM: give a folder saved from an "
                         f"AutoModelForCausalLM (for example ...ForCausalLM or GPT2LMHeadModel)")
    return from_pretrained(AutoModelForCausalLM, path, f"{_describe(path, config)}, which AutoModelForCausalLM "
                           f"cannot load", dtype=dtype)


def load_sequence_classifier(path: str | Path, dtype: torch.dtype | str | None = None):
    """A reward model folder: a sequence classifier.  A causal LM here would load with a freshly
    initialised, random score head, and PPO would chase noise: refuse it."""
    from transformers import AutoModelForSequenceClassification

    refuse_critic(path, "reward model")
    if is_adapter_only(path):  # a reward adapter from `ppo-rlhf rm --lora`
        return load_adapter_as_model(path, "classifier", dtype)
    path = require_model_folder(path, "reward model", prefer=REWARD_CHECKPOINTS)
    config = _model_config(path, "reward model")
    if config.architectures and not any(a.endswith("ForSequenceClassification") for a in config.architectures):
        raise ModelError(f"{_describe(path, config)}, not a reward model (a ...ForSequenceClassification): "
                         f"train one with `ppo-rlhf rm --model {path}`, or give --reward-fn")
    return from_pretrained(AutoModelForSequenceClassification, path, f"{_describe(path, config)}, which "
                           f"AutoModelForSequenceClassification cannot load", dtype=dtype)


def check_scratch_model(config) -> None:
    """The shape options of a model built from scratch (``n_layer``, ``n_head``, ``n_embd``,
    ``dropout`` of sft and rm): refused with ``--model``, where they would do nothing, and
    otherwise checked as GPT-2 needs them (each head gets n_embd / n_head of the width)."""
    import dataclasses

    from ppo_rlhf.config import check

    if config.model is not None:
        for field in dataclasses.fields(config):
            if field.name in ("n_layer", "n_head", "n_embd", "dropout"):
                check(getattr(config, field.name) == field.default, field.name,
                      "left out with --model (it shapes a model built from scratch)", getattr(config, field.name))
        return
    check(config.n_embd % config.n_head == 0, "n_head", f"a divisor of n_embd ({config.n_embd}): each head gets "
                                                        f"n_embd / n_head of the width", config.n_head)


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


def write_model_folder(model, folder: Path, state_dict: dict | None = None, dtype: torch.dtype | None = None) -> None:
    """``model.save_pretrained(folder)``, its weights (or ``state_dict``) written in ``dtype``
    (default: as they are), the model itself left as it is."""
    weights = unique_state_dict(model) if state_dict is None else state_dict
    if dtype is not None:
        weights = {name: tensor.to(dtype) for name, tensor in weights.items()}
    model.save_pretrained(folder, state_dict=weights)
    if dtype is not None:
        # transformers records the dtype of the model's own (float32) weights, not of the ones written.
        config_file = Path(folder) / "config.json"
        config = json.loads(config_file.read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_pretrained_atomic(model, tokenizer, path: str | Path, state_dict: dict | None = None,
                           dtype: torch.dtype | None = None) -> Path:
    """``save_pretrained`` of model and tokenizer into ``path``, replacing it in one step.

    ``state_dict``: the weights to write instead of the model's own (a sharded model's, gathered
    whole); ``dtype``: the dtype to write them in (default: as they are)."""
    path = Path(path)
    with atomic_directory(path) as staging:
        write_model_folder(model, staging, state_dict, dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
    return path
