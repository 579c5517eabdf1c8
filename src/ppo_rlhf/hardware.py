"""Where a stage runs and in which precision: ``--device``, ``--mixed-precision`` and ``--dtype``,
turned into a Hugging Face ``accelerate.Accelerator`` (the device and the autocast) and a load
dtype.  docs/design.md (scale) has the whole picture; in short:

- ``device``: auto is CUDA, then MPS, then the CPU.  A device asked for and absent stops the
  stage at start; nothing falls back to the CPU silently.
- ``dtype``: the dtype checkpoints load in; auto keeps the stored one (bf16 for most hub models).
  Models built from scratch for the built-in task are float32.
- Trained weights are float32 whatever they were stored in (:func:`train_in_float32`): AdamW
  on bf16 weights drops every update smaller than bf16's spacing around the weight.  Frozen
  roles (PPO's reference and reward model, a LoRA base) stay as loaded.
- ``mixed_precision``: bf16 or fp16 autocast around the forward passes, so trained float32
  weights still compute in half precision; fp16 adds accelerate's loss scaling.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn

from ppo_rlhf.config import HARDWARE, check, option

DEVICES = ("auto", "cpu", "cuda", "mps")
MIXED_PRECISIONS = ("no", "bf16", "fp16")
DTYPES = ("auto", "float32", "bfloat16", "float16")
HALF = (torch.bfloat16, torch.float16)
# accelerate launch modes that shard the weights (FSDP, DeepSpeed ZeRO, Megatron): refused at start.
SHARDED_LAUNCHES = ("FSDP", "DEEPSPEED", "MEGATRON_LM")


@dataclass
class HardwareOptions:
    """The device and precision fields shared by every language-model stage."""

    option_group = HARDWARE  # --help's group of all these options (config.py, GROUPS)

    device: str = option("auto", "where to run: auto (CUDA, then MPS, then the CPU), cpu, cuda or mps", choices=DEVICES,
                         first=True)
    mixed_precision: str = option("no", "autocast the forward passes to bf16 or fp16 (fp16: CUDA or MPS only); "
                                        "trained weights and optimizer state stay float32", choices=MIXED_PRECISIONS,
                                  first=True)
    dtype: str = option("auto", "dtype checkpoints load in: auto (as stored), float32, bfloat16 or float16; trained "
                                "weights are upcast to float32, frozen roles stay as loaded", choices=DTYPES,
                        first=True)

    def validate_hardware(self) -> None:
        device = resolve_device(self.device)
        if self.mixed_precision == "fp16":
            check(device != "cpu", "mixed_precision", "no or bf16 on a CPU (torch's CPU autocast has no useful fp16)",
                  self.mixed_precision)
        if self.mixed_precision == "bf16":
            check(bf16_supported(device), "mixed_precision",
                  f"no or fp16: this {device} device has no native bfloat16", self.mixed_precision)

    @property
    def load_dtype(self) -> torch.dtype | str:
        """What ``from_pretrained(dtype=...)`` takes: "auto" (the stored dtype) or a torch dtype."""
        return "auto" if self.dtype == "auto" else getattr(torch, self.dtype)

    def accelerator(self, shards: bool = False):
        """``shards``: the stage shards what it trains under an FSDP launch (sft, rm, ppo)."""
        return make_accelerator(self.device, self.mixed_precision, shards)


def resolve_device(device: str) -> str:
    """"auto" -> the best device here; an explicit device that is absent -> ConfigError naming it."""
    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()
    if device == "auto":
        return "cuda" if cuda else "mps" if mps else "cpu"
    check(device != "cuda" or cuda, "device", "auto or cpu: torch finds no CUDA GPU here", device)
    check(device != "mps" or mps, "device", "auto or cpu: torch finds no MPS (Apple GPU) device here", device)
    return device


def bf16_supported(device: str) -> bool:
    if device == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device == "mps":
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True  # CPU autocast computes bf16 on any CPU


def make_accelerator(device: str = "auto", mixed_precision: str = "no", shards: bool = False):
    """An ``Accelerator`` on ``device`` with ``mixed_precision`` autocast, for one process;
    ``shards``: the caller shards its model itself under an FSDP launch (:mod:`ppo_rlhf.sharding`).

    accelerate keeps one state per process; one process that runs stages one after another with
    their own settings (the demo, a notebook, the tests) gets that state replaced.  Under
    ``accelerate launch`` the launcher's state is kept.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState

    device = resolve_device(device)
    if PartialState._shared_state and PartialState().num_processes == 1:
        AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision=mixed_precision)
    check_launch(accelerator.distributed_type.value, shards)
    if accelerator.device.type != device:
        raise RuntimeError(f"accelerate placed this process on {accelerator.device}, not on the {device} asked for")
    return accelerator


def check_launch(distributed_type: str, shards: bool = False) -> None:
    """ConfigError for an ``accelerate launch`` mode that shards the weights where the stage does
    not (``shards``: sft, rm and ppo shard under FSDP; nothing takes DeepSpeed or Megatron).  On a CPU
    accelerate reports an FSDP launch as MULTI_CPU: its environment says what it is."""
    from ppo_rlhf.config import ConfigError
    from ppo_rlhf.sharding import fsdp_launched

    if fsdp_launched() and distributed_type not in SHARDED_LAUNCHES:
        distributed_type = "FSDP"
    if distributed_type == "FSDP" and shards:
        return
    if distributed_type == "DEEPSPEED":
        # Not followed: ZeRO's sharding is FSDP's, which the trainers do themselves (sharding.py).
        raise ConfigError("accelerate launch: distributed_type DEEPSPEED shards the models with DeepSpeed ZeRO, which "
                          "ppo-rlhf does not take; the same sharding is FSDP's: configs/accelerate/fsdp.yaml for sft, "
                          "rm and ppo (fsdp_reshard_after_forward: true is ZeRO-3-like, false ZeRO-2-like).  Allowed "
                          "here: FSDP (sft, rm, ppo), MULTI_GPU (configs/accelerate/gpus_ddp.yaml, which also runs on "
                          "CPUs), torchrun, or one process")
    if distributed_type in SHARDED_LAUNCHES:
        raise ConfigError(f"accelerate launch: distributed_type {distributed_type} shards the models; ppo-rlhf's sft, "
                          f"rm and ppo shard under FSDP (configs/accelerate/fsdp.yaml), its other commands do not: "
                          f"every process holds whole models (data parallel).  Allowed here: MULTI_GPU "
                          f"(configs/accelerate/gpus_ddp.yaml, which also runs on CPUs), torchrun, or one process")


def train_in_float32(model: nn.Module, what: str) -> torch.dtype | None:
    """Upcast the trainable half-precision weights of ``model`` to float32, in place, with a
    one-line notice; returns the dtype they were stored in (None: nothing to upcast).

    A model trained in full becomes a float32 model (as if loaded in float32); with LoRA only the
    trained tensors are upcast and the frozen base stays as loaded.
    """
    half = [p for p in model.parameters() if p.requires_grad and p.dtype in HALF]
    if not half:
        return None
    stored = half[0].dtype
    if all(p.requires_grad for p in model.parameters()):
        model.float()
    else:
        for parameter in half:
            parameter.data = parameter.data.float()
    print(f"ppo-rlhf: the {what} is stored in {str(stored).removeprefix('torch.')}; training it in float32 "
          f"(--mixed-precision bf16 computes in bf16)", file=sys.stderr)
    return stored


# Where a Linux container's memory limit is read (cgroup v2, then v1): its limit and what it uses.
CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def free_memory(device: torch.device | str) -> int:
    """Bytes this process can still take on ``device``: on a CUDA GPU what the driver has free plus
    what torch's caching allocator holds unused (handed out first); elsewhere -- the CPU, MPS's
    memory shared with it -- the RAM the system reports available (psutil's ``available``: free
    pages and the caches it can drop), no more than a container's memory limit leaves."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    import psutil

    available = psutil.virtual_memory().available
    limited = container_room()
    return available if limited is None else min(available, limited)


def container_room() -> int | None:
    """Bytes a container's memory limit still leaves (its limit less what its processes use, page
    cache included); None where no limit is set (or none can be read: not Linux)."""
    for limit_file, usage_file in CGROUP_MEMORY:
        try:
            with open(limit_file) as limit, open(usage_file) as usage:
                limit_bytes, used = int(limit.read()), int(usage.read())  # cgroup v2's "max" (no limit): ValueError
        except (OSError, ValueError):
            continue
        if limit_bytes < 2**60:  # cgroup v1 writes "no limit" as a number near 2**63
            return max(limit_bytes - used, 0)
    return None
