"""AdamW as every language-model trainer builds it (sft, rm, ppo): torch's fused kernel.

Fused AdamW updates every tensor of a parameter group in one kernel.  On the built-in task's
4-layer model on a CPU one step took 0.3 ms fused, 1.3 ms with the multi-tensor (foreach) path
and 2.1 ms with the per-parameter loop, torch's default on a CPU; on a GPU fused is the fastest
path too.  It also holds no temporaries: the foreach path allocates a copy of the second
moments (the whole group's size) at every step.  It rounds differently from the loop, by float
round-off (tests/test_trainer_paths.py bounds it).
"""

from __future__ import annotations

import torch

# Devices with torch's fused AdamW kernel; elsewhere torch picks its own path.
FUSED_DEVICES = ("cpu", "cuda", "mps", "xpu")


def adamw(param_groups, lr: float, weight_decay: float, eps: float = 1e-8) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``param_groups`` (tensors, or dicts of them with their own lr),
    fused where every parameter's device has the kernel."""
    groups = list(param_groups)
    tensors = [p for group in groups for p in (group["params"] if isinstance(group, dict) else [group])]
    fused = all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in tensors) or None
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, eps=eps, fused=fused)
