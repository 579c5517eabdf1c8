"""What a rollout engine with weights of its own receives, and the precision its weight probe
compares in (docs/design.md, "The vLLM rollout engine" and "The weight probe's tolerance"): the
actor's weights named as in its checkpoint, a LoRA policy merged into them in float32 and rounded
once to the engine's dtype; the least precise side of a comparison; an actor's forward computed in
float32 one module at a time; the probe's comparison of an engine's log-probs with the actor's.
What is here needs no vLLM: the colocated engine and the generation server's client share it."""

from __future__ import annotations

import contextlib

import torch

from ppo_rlhf.models.loading import base_of
from ppo_rlhf.rollout.generation import EngineWeightsError
from ppo_rlhf.sharding import unique_state_dict

# The weight probe: the last tokens of the first prompt an engine is given, and the mean gap per
# token that stops a run by default, by the lower precision of the two sides (the actor's weights
# and compute dtype, the engine's dtype: ``probe_tolerance``).  Measured gaps of correct and broken
# syncs are in docs/design.md, "The weight probe's tolerance".
PROBE_TOKENS = 32
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.1}


def named_tensors(model) -> dict[str, torch.Tensor]:
    """Every name ``state_dict()`` has, a tied weight under each of its names (the engine loads its
    output layer by its own name), read from the parameters and persistent buffers themselves."""
    state = {name: parameter.detach() for name, parameter in model.named_parameters(remove_duplicate=False)}
    return {**unique_state_dict(model), **state}


def policy_weights(model, dtype: torch.dtype):
    """The weights to sample from, named as in the model's own checkpoint, one at a time (so no
    more than one merged weight exists at once).  A peft model: its base with the active adapter
    merged into each adapted weight, ``W + scale B A`` computed aside in float32 and rounded once
    to the engine's ``dtype`` (the base is not touched: a bf16 ``W`` plus a delta rounded to bf16
    first would lose every update under half a bf16 ulp, which a float32 engine can hold); the
    other adapters (a critic's) and their parameters left out.  A sharded (FSDP) model is read
    inside the rollout's ``gathered``: from its parameters, which are whole there, where
    ``state_dict()`` would give this process's shards (``named_tensors``)."""
    for name, tensor, module in policy_entries(model):
        if module is not None:
            tensor = (tensor.float() + module.get_delta_weight(model.active_adapter).float()).to(dtype)
        yield name, tensor


def policy_layout(model, dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of each tensor ``policy_weights`` gives, in its order, nothing computed:
    what a file of them says in its header before the first is merged (rollout/weight_push.py)."""
    return [(name, dtype if module is not None else tensor.dtype, tuple(tensor.shape))
            for name, tensor, module in policy_entries(model)]


def policy_entries(model):
    """(name as in the checkpoint, the base's tensor, the LoRA layer adapting it or None) of each
    weight ``policy_weights`` gives."""
    base = base_of(model)
    if base is model:
        for name, tensor in named_tensors(model).items():
            yield name, tensor, None
        return
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapter
    adapted = {f"{name}.weight": module for name, module in base.named_modules()
               if isinstance(module, LoraLayer) and adapter in module.lora_A}
    for name, tensor in base.state_dict().items():
        if "lora_" in name or ".modules_to_save." in name:
            continue
        name = name.replace(".base_layer.", ".").replace(".original_module.", ".")
        yield name, tensor, adapted.get(name)


def lower_precision(*dtypes: torch.dtype) -> torch.dtype:
    """The least precise of ``dtypes`` (the largest machine epsilon: bfloat16 below float16)."""
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).eps)


def actor_precision(model) -> torch.dtype:
    """The precision the actor computes in, now: the least precise of its floating weights (a LoRA
    base kept in bf16 computes in bf16, whatever its float32 adapters) and the autocast dtype in
    force on its device (--mixed-precision)."""
    device = next(model.parameters()).device
    dtypes = {p.dtype for p in base_of(model).parameters() if p.is_floating_point()}
    if torch.is_autocast_enabled(device.type):
        dtypes.add(torch.get_autocast_dtype(device.type))
    return lower_precision(*dtypes)


def probe_precision(actor, engine_dtype: torch.dtype) -> torch.dtype:
    """The precision the weight probe compares in: the engine's where the actor's side can be
    lifted to it (a float32 engine: the actor's forward computed in float32, ``computed_in_float32``),
    else the lower of the two sides' (a 16-bit engine: the actor's own compute, or float32 beside it)."""
    return engine_dtype if engine_dtype == torch.float32 else lower_precision(actor_precision(actor), engine_dtype)


@contextlib.contextmanager
def computed_in_float32(model):
    """``model``'s forward passes computed in float32, autocast off: each module's 16-bit weights
    are read as float32 for that module's own forward only (one module's copy at a time, not a
    float32 copy of the model), then put back as they were (bf16 -> float32 -> bf16 is exact)."""
    device = next(model.parameters()).device

    def upcast(module, args):
        module._ppo_rlhf_16bit = {name: p.data for name, p in module.named_parameters(recurse=False)
                                  if p.dtype in (torch.bfloat16, torch.float16)}
        for name, data in module._ppo_rlhf_16bit.items():
            getattr(module, name).data = data.float()

    def restore(module, args, output):
        for name, data in module.__dict__.pop("_ppo_rlhf_16bit", {}).items():
            getattr(module, name).data = data

    modules = [m for m in model.modules() if any(p.dtype in (torch.bfloat16, torch.float16)
                                                 for p in m.parameters(recurse=False))]
    handles = [hook for m in modules for hook in (m.register_forward_pre_hook(upcast),
                                                  m.register_forward_hook(restore))]
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        for handle in handles:
            handle.remove()
        for module in modules:
            restore(module, None, None)


def probe_tolerance(given: float | None, model, engine_dtype: torch.dtype) -> float:
    """The probe's bound: ``given`` (--vllm-probe-tolerance), else the default of the precision it
    compares in (docs/design.md, "The weight probe's tolerance")."""
    return given if given is not None else PROBE_TOLERANCE[probe_precision(model, engine_dtype)]


def probe_gap(model, ids: list[int], engine_logprobs: list[float], engine_dtype: torch.dtype) -> float:
    """The mean gap per position between an engine's log-probs of ``ids`` after the first (its
    prompt log-probs of the raw logits) and the actor's own (``actor_probe_logprobs``)."""
    actor = actor_probe_logprobs(model, ids, engine_dtype)
    return (torch.tensor(engine_logprobs) - actor).abs().mean().item()


@torch.no_grad()
def actor_probe_logprobs(model, ids: list[int], engine_dtype: torch.dtype) -> torch.Tensor:
    """(L - 1,) the actor's log-prob of each token of ``ids`` after the first, on the CPU, in the
    probe's precision: the actor's side lifted to float32 where the engine is float32
    (``probe_precision``); eval mode, as the trainer's old pass (no dropout, a LoRA dropout included)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    lifted = engine_dtype == torch.float32 and actor_precision(model) != torch.float32
    with computed_in_float32(model) if lifted else contextlib.nullcontext():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()  # (L - 1, V)
    model.train(was_training)
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:], device=device)[:, None])[:, 0].cpu()


def refuse_probe_gap(gap: float, tolerance: float, engine: str, sync: str, positions: int) -> None:
    """EngineWeightsError when the probe's ``gap`` passes ``tolerance`` (a NaN too: the engine's
    log-probs are not numbers); ``engine`` and ``sync`` name what was checked ("the vLLM engine",
    "weight sync 3")."""
    if not gap <= tolerance:
        raise EngineWeightsError(
            f"{engine} does not hold the actor's weights: after {sync} its log-probs of the probe sequence "
            f"({positions} positions) differ from the actor's by {gap:.3g} per token on average, past the tolerance "
            f"{tolerance:g} (--vllm-probe-tolerance).  An adapter that did not reach the engine, a sync that loaded "
            f"nothing or a wrong dtype do this; every rollout after it would train on another policy's samples")
