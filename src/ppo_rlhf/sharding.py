"""Sharded data parallel: what ``sft``, ``rm`` and ``ppo`` train (the SFT model, the reward
model, PPO's actor and critic) split over the processes with torch's FSDP2 (``fully_shard``),
started by ``accelerate launch --config_file configs/accelerate/fsdp.yaml``.  docs/design.md
("Scale") has the picture; in short:

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
    from torch.distributed.fsdp import fully_shard

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
    _sum_gradients(model, settings)
    return model


def shard_unit(module: nn.Module, settings: ShardingSettings) -> nn.Module:
    """``module`` sharded as one unit (a value head called on its own), gradients summed."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, reshard_after_forward=settings.reshard_after_forward)
    _sum_gradients(module, settings)
    return module


def _sum_gradients(model: nn.Module, settings: ShardingSettings) -> None:
    from torch.distributed.fsdp import FSDPModule

    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            # A sum: the losses are already scaled by each process's share of the batch.  gloo has
            # no pre-multiplied sum, hence the plain SUM reduction.
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            _SHARDED[unit] = settings


def shard_if_launched(model: nn.Module) -> nn.Module:
    """``model`` sharded when this is an FSDP launch (:func:`shard`), else as it is."""
    settings = sharding_from_launch()
    return shard(model, settings) if settings is not None else model


@contextmanager
def gathered(model: nn.Module | None):
    """The whole of every sharded unit inside ``model``, in every process, for the duration
    (evaluation, generation, saving): gathered once, so that processes may run different numbers
    of forward passes, and the parameters are plain whole tensors (read them through
    ``named_parameters`` or ``unique_state_dict``: a sharded module's
    ``state_dict()`` still gives its shards).  Writes to them are not kept (load with
    :func:`load_whole_state`).  Nothing for a model without sharded units."""
    from torch.distributed.fsdp import FSDPModule

    units = [] if model is None else [unit for unit in model.modules() if isinstance(unit, FSDPModule)]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for unit in units:
            unit.set_reshard_after_forward(_SHARDED[unit].reshard_after_forward, recurse=False)
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


def unique_state_dict(model) -> dict[str, torch.Tensor]:
    """What ``model.state_dict()`` holds, each tensor once (of tied weights, such as GPT-2's
    embedding and head, the first name, as transformers writes them), read from the parameters
    and persistent buffers themselves: inside :func:`gathered` those are the whole tensors,
    where a sharded model's ``state_dict()`` would give its shards."""
    state = {name: parameter.detach() for name, parameter in model.named_parameters()}
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                state[f"{module_name}.{name}" if module_name else name] = buffer
    return state


def whole_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict for ``save_pretrained``, each tensor once, sharded ones gathered
    whole to the main process (see :func:`whole_tensors`)."""
    return whole_tensors(unique_state_dict(model))


def load_whole(parameter: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy a whole tensor into ``parameter``, which may be this process's shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(parameter, DTensor):
            parameter.copy_(distribute_tensor(whole.to(parameter.device, parameter.dtype), parameter.device_mesh,
                                              parameter.placements))
        else:
            parameter.copy_(whole)


def load_whole_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Whole weights (a saved folder's state dict) into ``module``'s parameters, sharded or not;
    buffers are left as they are (derived, never trained)."""
    parameters = dict(module.named_parameters())
    missing = sorted(parameters.keys() - state.keys())
    if missing:
        raise KeyError(f"the saved weights lack {missing[:3]}")
    for name, parameter in parameters.items():
        load_whole(parameter, state[name])


def whole_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every sharded moment gathered whole, one at a time (every
    process must call it); the main process keeps them on the CPU, the others get none.  The
    same layout as an unsharded optimizer's: moments by parameter index."""
    from torch.distributed.tensor import DTensor

    state = optimizer.state_dict()
    if not any(isinstance(v, DTensor) for moments in state["state"].values() for v in moments.values()):
        return state
    whole = {}
    for index, moments in state["state"].items():
        entry = {key: (plain(value).detach().cpu() if isinstance(value, DTensor) else value)
                 for key, value in moments.items()}
        if is_main_process():
            whole[index] = entry
    return {**state, "state": whole}


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every sharded moment as this process's own shard (no
    communication): enough to check it, where gathering it whole would cost a model's worth of
    memory in the main process."""
    from torch.distributed.tensor import DTensor

    state = optimizer.state_dict()
    return {**state, "state": {index: {key: (value.to_local() if isinstance(value, DTensor) else value)
                                       for key, value in moments.items()}
                               for index, moments in state["state"].items()}}


def load_whole_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Put a :func:`whole_optimizer_state` (or any optimizer state dict) back; each sharded
    parameter's moments become its shards of them."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    optimizer.load_state_dict(state)
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper: the torch optimizer in it
    for group in inner.param_groups:
        for parameter in group["params"]:
            if not isinstance(parameter, DTensor):
                continue
            moments = inner.state[parameter]
            for key, value in moments.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == parameter.shape:
                    moments[key] = distribute_tensor(value.to(parameter.device), parameter.device_mesh,
                                                     parameter.placements)
