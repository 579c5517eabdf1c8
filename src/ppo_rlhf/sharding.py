"""Sharded data parallel: the trained model of ``sft`` and ``rm`` split over the processes with
torch's FSDP2 (``fully_shard``), started by ``accelerate launch --config_file
configs/accelerate/fsdp.yaml``.  docs/design.md ("Scale") has the picture; in short:

- Each decoder layer (the model's ``_no_split_modules``, or the config's
  ``fsdp_transformer_layer_cls_to_wrap``) is one unit; the embeddings, final norm and head are
  the root's.  A process holds 1/N of every weight, gradient and AdamW moment, and gathers a
  layer's weights just before it runs.
- Gradients are *summed* over the processes, as :func:`ppo_rlhf.distributed.sum_gradients` does
  for whole models: each process scales its loss by its share of the batch, so the sum is the
  whole batch's gradient and N processes train like one.
- Evaluation and generation run on the whole model, gathered once (:func:`gathered`): each
  process then runs as many forward passes as its own part needs, with no collective per pass.
- Checkpoints hold whole tensors: each is gathered in turn and kept by the main process alone.

accelerate sets ``ACCELERATE_USE_FSDP`` and ``FSDP_*`` for its launch, and on a CPU it reports
MULTI_CPU and does no sharding itself; ppo-rlhf reads those variables and shards in both cases.
"""

from __future__ import annotations

import os
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ppo_rlhf.config import ConfigError
from ppo_rlhf.distributed import is_distributed, is_main_process


@dataclass(frozen=True)
class ShardingSettings:
    """What an FSDP launch asks for, as ppo-rlhf follows it."""

    reshard_after_forward: bool  # True: ZeRO-3-like (weights gathered again for the backward); False: ZeRO-2-like
    layer_classes: tuple[str, ...]  # class names that are one unit each; empty: the model's _no_split_modules


_SHARDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its ShardingSettings


def _flag(name: str, default: str = "false") -> bool:
    return os.environ.get(name, default).strip().lower() in ("true", "1", "yes")


def fsdp_launched() -> bool:
    """True under ``accelerate launch`` with an FSDP config (on any device)."""
    return _flag("ACCELERATE_USE_FSDP")


def sharding_from_launch() -> ShardingSettings | None:
    """The FSDP settings of this launch (None: not an FSDP launch); ConfigError naming a setting
    ppo-rlhf does not follow, with what is allowed."""
    if not fsdp_launched():
        return None
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ConfigError(f"accelerate launch: fsdp_version {version}; ppo-rlhf shards with FSDP2 (torch's "
                          f"fully_shard): allowed fsdp_version: 2 (configs/accelerate/fsdp.yaml)")
    refused = {"FSDP_OFFLOAD_PARAMS": "fsdp_offload_params", "FSDP_ACTIVATION_CHECKPOINTING":
               "fsdp_activation_checkpointing"}
    for variable, setting in refused.items():
        if _flag(variable):
            raise ConfigError(f"accelerate launch: {setting} is true; ppo-rlhf does not follow it: allowed false")
    strategy = os.environ.get("FSDP_SHARDING_STRATEGY", "FULL_SHARD").upper()
    if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP", "1", "2"):
        raise ConfigError(f"accelerate launch: fsdp_sharding_strategy {strategy}; allowed: FULL_SHARD or "
                          f"SHARD_GRAD_OP (or fsdp_reshard_after_forward: true/false)")
    default = "false" if strategy in ("SHARD_GRAD_OP", "2") else "true"
    layers = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    return ShardingSettings(reshard_after_forward=_flag("FSDP_RESHARD_AFTER_FORWARD", default),
                            layer_classes=tuple(name.strip() for name in layers.split(",") if name.strip()))


def _layer_classes(model: nn.Module, settings: ShardingSettings) -> set[str]:
    if settings.layer_classes:
        return set(settings.layer_classes)
    # A peft model wraps the transformers model: the first module that names its layers.
    for module in model.modules():
        names = getattr(module, "_no_split_modules", None)
        if names:
            return set(names)
    return set()


def shard(model: nn.Module, settings: ShardingSettings) -> nn.Module:
    """``model`` sharded in place over the processes (returned for convenience): one FSDP unit
    per decoder layer, the rest in the root; gradients summed, not averaged.  Call it after the
    model is on its device and its trained weights are float32, before building the optimizer."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not is_distributed():
        raise ConfigError("accelerate launch: an FSDP config needs several processes (num_processes > 1)")
    # fully_shard flattens each unit's weights into one all-gather: they must share a dtype.
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) > 1:
        raise ConfigError(f"FSDP: the model holds weights of several dtypes ({sorted(map(str, dtypes))}), as LoRA on a "
                          f"half-precision base does; load the base in float32 (--dtype float32) to shard it")
    classes = _layer_classes(model, settings)
    layers = [module for module in model.modules() if type(module).__name__ in classes]
    if not layers:
        raise ConfigError(f"FSDP: no module of this model is one of {sorted(classes) or 'its layer classes'}; name "
                          f"the decoder layer class in fsdp_transformer_layer_cls_to_wrap")
    for layer in layers:
        fully_shard(layer, reshard_after_forward=settings.reshard_after_forward)
    head = getattr(model, "score", None)
    if isinstance(head, nn.Module) and model.base_model is not model:
        # A sequence classifier is run as trunk, then head (last_token_scores reads each row's last
        # real token), never through its own forward: each is a unit whose hooks gather its weights.
        fully_shard(model.base_model, reshard_after_forward=settings.reshard_after_forward)
        fully_shard(head, reshard_after_forward=settings.reshard_after_forward)
    fully_shard(model, reshard_after_forward=settings.reshard_after_forward)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            # A sum: the losses are already scaled by each process's share of the batch.  gloo has
            # no pre-multiplied sum, hence the plain SUM reduction.
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
    _SHARDED[model] = settings
    return model


def shard_if_launched(model: nn.Module) -> nn.Module:
    """``model`` sharded when this is an FSDP launch (:func:`shard`), else as it is."""
    settings = sharding_from_launch()
    return shard(model, settings) if settings is not None else model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextmanager
def gathered(model: nn.Module):
    """The whole of a sharded model in every process for the duration (evaluation, generation):
    gathered once, so that processes may run different numbers of forward passes.  Nothing for a
    model that is not sharded."""
    if not is_sharded(model):
        yield model
        return
    from torch.distributed.fsdp import FSDPModule

    units = [unit for unit in model.modules() if isinstance(unit, FSDPModule)]
    for unit in units:
        unit.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield model
    finally:
        model.set_reshard_after_forward(_SHARDED[model].reshard_after_forward)
        for unit in units:
            unit.reshard()


def plain(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor as the whole tensor it stands for (a collective); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with each sharded one gathered, one at a time (every process must call it);
    sharded ones are kept on the CPU by the main process alone (the others get an empty dict), so
    no process ever holds the whole model twice."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(t, DTensor) for t in tensors.values()):
        return tensors
    whole = {}
    for name, tensor in tensors.items():
        full = plain(tensor)
        if is_main_process():
            whole[name] = full.detach().cpu() if isinstance(tensor, DTensor) else full
    return whole


def whole_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict for ``save_pretrained``, whole (see :func:`whole_tensors`), each tensor
    once: of tied weights (GPT-2's embedding and head) the first name, as transformers writes them."""
    seen, unique = set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique[name] = tensor.detach()
    return whole_tensors(unique)


def load_whole(parameter: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy a whole tensor into ``parameter``, which may be this process's shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(parameter, DTensor):
            parameter.copy_(distribute_tensor(whole.to(parameter.device, parameter.dtype), parameter.device_mesh,
                                              parameter.placements))
        else:
            parameter.copy_(whole)


def whole_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state with whole moments, keyed by parameter name, on the main process
    (every process must call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper: the torch optimizer in it
    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_whole_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Put a :func:`whole_optimizer_state` back, each process taking its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    optimizer = getattr(optimizer, "optimizer", optimizer)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))
