"""What a rollout engine with weights of its own receives, and the precision its weight probe
compares in (docs/design.md, "The vLLM rollout engine" and "The weight probe's tolerance"): the
actor's weights named as in its checkpoint, a LoRA policy merged into them in float32 and rounded
once to the engine's dtype; the least precise side of a comparison; an actor's forward computed in
float32 one module at a time."""

from __future__ import annotations

import contextlib

import torch

from ppo_rlhf.models.loading import base_of
from ppo_rlhf.sharding import unique_state_dict


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
    base = base_of(model)
    if base is model:
        yield from named_tensors(model).items()
        return
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapter
    adapted = {f"{name}.weight": module for name, module in base.named_modules()
               if isinstance(module, LoraLayer) and adapter in module.lora_A}
    for name, tensor in base.state_dict().items():
        if "lora_" in name or ".modules_to_save." in name:
            continue
        name = name.replace(".base_layer.", ".").replace(".original_module.", ".")
        module = adapted.get(name)
        if module is not None:
            tensor = (tensor.float() + module.get_delta_weight(adapter).float()).to(dtype)
        yield name, tensor


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
