"""Padding-free passes: a batch's rows packed end to end, position ids restarting at each row
(docs/design.md, "Long responses").

A batch of responses of 32 to 1,024 tokens padded to its longest spends about half of every pass
on padding.  Packed, each row's real tokens (its prompt without the left padding, then its
response) sit one after another in a few long rows, and transformers reads the packing from the
position ids: where they restart, a new sequence begins, and attention stays inside each one (its
block-diagonal mask for sdpa and eager, varlen kernels for flash attention).  Rows go into bins
first-fit by decreasing length, each bin as long as the longest row: a row attends no more
positions than it would padded, and the bins hold little padding.

    rows:   [p p a b c d]  [p q r]  [p p p x y]        (prompt | response, left padding dropped)
    packed: [p p a b c d | p q r _ _ _]                 one bin, positions 0..5 0 1 2 0 1 2
            [p p p x y _ ]                              another

The hidden state that predicts response token t of a row is read back at its own place, into the
(B, T) layout of every other per-token tensor.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from ppo_rlhf.rollout.sequences import Sequences


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (bins, C) rows end to end, pad id after the last
    position_ids: torch.Tensor  # (bins, C) from 0 at each row's first token (and at the padding after)
    source: torch.Tensor  # (B, T) index into the flattened (bins * C) positions predicting each response token
    mask: torch.Tensor  # (B, T) bool: the response tokens there are (``response_mask``)

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    def gather(self, packed: torch.Tensor) -> torch.Tensor:
        """(bins, C, ...) from a packed pass -> (B, T, ...) at the response positions (0 elsewhere)."""
        flat = packed.reshape(-1, *packed.shape[2:])
        picked = flat[self.source.reshape(-1)].reshape(*self.source.shape, *packed.shape[2:])
        mask = self.mask.reshape(*self.mask.shape, *([1] * (packed.dim() - 2)))
        return torch.where(mask, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))


def first_fit_bins(lengths: list[int], capacity: int) -> list[list[int]]:
    """Row indices in bins of at most ``capacity`` tokens, first fit by decreasing length
    (deterministic: ties keep row order)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        target = next((b for b, left in enumerate(room) if left >= lengths[row]), None)
        if target is None:
            bins.append([row])
            room.append(capacity - lengths[row])
        else:
            bins[target].append(row)
            room[target] -= lengths[row]
    return bins


def row_lengths(sequences: Sequences) -> list[int]:
    """Each row's real tokens: its prompt without the left padding, then its response."""
    return (sequences.prompt_mask.bool().sum(dim=1) + sequences.response_mask.bool().sum(dim=1)).tolist()


def pack_if_shorter(sequences: Sequences, pad_token_id: int) -> PackedBatch | None:
    """The batch packed, where that runs fewer positions than padded: decided from the rows'
    lengths alone, before any tensor is built."""
    lengths = row_lengths(sequences)
    bins = first_fit_bins(lengths, max(lengths))
    if len(bins) * max(lengths) >= padded_tokens(sequences):
        return None
    return pack(sequences, pad_token_id, lengths, bins)


def pack(sequences: Sequences, pad_token_id: int, lengths: list[int] | None = None,
         bins: list[list[int]] | None = None) -> PackedBatch:
    """``sequences`` packed into bins as long as the longest row (module docstring); ``lengths``
    (each row's real tokens) and ``bins``, where the caller has them already.

    Only the bins are planned row by row (Python integers); the tokens move in one scatter, so
    a pass over a tiny model does not pay a loop of tensor operations per row."""
    if lengths is None:
        lengths = row_lengths(sequences)
    capacity = max(lengths)
    if bins is None:
        bins = first_fit_bins(lengths, capacity)
    device = sequences.prompt_ids.device
    start = [0] * len(lengths)  # each row's first position in the flattened (bins * capacity) layout
    used = []  # each bin's tokens
    for b, rows in enumerate(bins):
        offset = b * capacity
        for row in rows:
            start[row] = offset
            offset += lengths[row]
        used.append(offset - b * capacity)
    start = torch.tensor(start, dtype=torch.long, device=device)
    # A row's real tokens in order (left padding of the prompt, padding after the response dropped):
    # token k of the row goes to start + k.
    ids = torch.cat([sequences.prompt_ids, sequences.response_ids], dim=1)
    real = torch.cat([sequences.prompt_mask, sequences.response_mask], dim=1).bool()
    rank = real.long().cumsum(dim=1) - 1
    # The padding after a bin's last row: a sequence of its own, from 0 (the real tokens overwrite the rest).
    positions = torch.arange(capacity, device=device)[None, :] - torch.tensor(used, device=device)[:, None]
    position_ids = positions.clamp(min=0)
    input_ids = torch.full((len(bins), capacity), pad_token_id, dtype=ids.dtype, device=device)
    target = (start[:, None] + rank)[real]
    input_ids.view(-1)[target] = ids[real]
    position_ids.view(-1)[target] = rank[real]
    # Response token t of a row is its token prompt_length + t, predicted one position earlier.
    response_mask = sequences.response_mask.bool()
    prompt_lengths = sequences.prompt_mask.bool().sum(dim=1)
    steps = torch.arange(sequences.response_ids.shape[1], device=device)
    source = (start + prompt_lengths - 1)[:, None] + steps[None, :]
    source = torch.where(response_mask, source, torch.zeros_like(source))
    return PackedBatch(input_ids, position_ids, source, response_mask)


def padded_tokens(sequences: Sequences) -> int:
    """The positions a padded pass over ``sequences`` computes."""
    return sequences.prompt_ids.numel() + sequences.response_ids.numel()


class _PaddingWarning(logging.Filter):
    """Drops transformers' "We strongly recommend passing in an `attention_mask`" record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "attention_mask" not in record.getMessage()


@contextlib.contextmanager
def without_padding_warning():
    """A packed pass without transformers' warning that its input may be padded and has no
    attention mask.  The pass has none on purpose: transformers reads the packing from the
    position ids only when no mask is given (a mask of ones would merge the rows of a bin into one
    sequence), and the padding after a bin's last row is a sequence of its own, from position 0,
    that no row attends to and whose outputs are never read.  The warning (printed once, in the
    middle of the first iteration's progress bar) would tell a user to fix what is right."""
    logger = logging.getLogger("transformers.modeling_utils")
    quiet = _PaddingWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
