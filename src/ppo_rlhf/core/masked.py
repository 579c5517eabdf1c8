"""Statistics over the positions a mask selects.

Language-model batches are ragged: each response stops at its own EOS and the rest is padding.
Every mean, variance and whitening in PPO must ignore that padding, or a batch with long
padding tails would shrink the losses and bias the advantage statistics.  ``mask=None`` means
"every position counts" (the gym trainer's case).

With several processes, these run on the whole batch, gathered first, in every process alike
(docs/design.md, "Scale: many processes"): no statistic needs its own all-reduce.
"""

from __future__ import annotations

import torch


def keep_masked(values: torch.Tensor, mask: torch.Tensor | None, fill: float = 0.0) -> torch.Tensor:
    """``values`` where ``mask`` is set, ``fill`` elsewhere.

    A selection, not a product: ``values * mask`` turns an inf or NaN in the padding into NaN,
    in the forward pass and in the backward pass (0 * inf), and padded positions may hold
    anything.  The gradient at a position ``mask`` leaves out is exactly 0.
    """
    if mask is None:
        return values
    return torch.where(mask.bool(), values, torch.full((), fill, dtype=values.dtype, device=values.device))


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions ``mask`` selects.

    Masked-out positions may hold anything, even inf or NaN: they are replaced before summing
    so they can never leak into the result.
    """
    if mask is None:
        return values.mean() if dim is None else values.mean(dim=dim)
    values = keep_masked(values, mask)
    mask = mask.to(values.dtype)
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    total = values.sum() if dim is None else values.sum(dim=dim)
    return total / count.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor | None, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked positions, with Bessel's correction by default.

    Raises ``ValueError`` when the mask selects no position (or only one, with ``unbiased``):
    a silent 0 or NaN there would whiten advantages into garbage.
    """
    count = int(values.numel() if mask is None else mask.sum().item())
    needed = 2 if unbiased else 1
    if count < needed:
        raise ValueError(
            f"masked_var needs at least {needed} selected position(s), the mask selects {count}; "
            "check that the responses are not all empty"
        )
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor | None, shift_mean: bool = True, eps: float = 1e-8
                  ) -> torch.Tensor:
    """Scale ``values`` to unit variance over the masked positions (and mean 0 if ``shift_mean``).

    Masked-out positions come back as 0.
    """
    mean = masked_mean(values, mask)
    variance = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(variance + eps)
    if not shift_mean:
        whitened = whitened + mean
    return keep_masked(whitened, mask)  # padding never carries a signal
