"""The dtype the core computes in."""

from __future__ import annotations

import torch


def compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """float32 for half-precision inputs (a softmax over a vocabulary loses too much in bf16 or
    fp16); float32 and float64 inputs keep their own dtype."""
    return torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype
