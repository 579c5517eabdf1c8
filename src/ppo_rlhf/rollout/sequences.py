"""Token sequences as PPO sees them: a left-padded prompt followed by a right-padded response.

    position:   0 ... P-1 | P ... P+T-1
    tokens:     P P S a b | r1 r2 E  P P     (left pad | response, pad after the first EOS)
    mask:       0 0 1 1 1 | 1  1  1  0 0

The logits that predict response token t sit at position P-1+t, so every per-token tensor of
the response (log-probs, values, KL, rewards, advantages) is (B, T) and aligned with
``response_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def response_mask_from_eos(response_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 up to and including the first EOS, 0 after it; all ones if no EOS was emitted.

    Built from EOS, never from the pad id: many tokenizers use EOS as pad, and a mask from
    ``ids != pad`` would then drop the EOS itself (or everything after an early one).
    """
    is_eos = (response_ids == eos_token_id).long()
    eos_before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens strictly before t
    return (eos_before == 0).long()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token is position 0."""
    return (torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0)


@dataclass
class Sequences:
    """A batch of prompt + response token sequences."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    response_ids: torch.Tensor  # (B, T) pad after the first EOS
    response_mask: torch.Tensor  # (B, T) 1 up to and including the first EOS

    @property
    def input_ids(self) -> torch.Tensor:  # (B, P+T)
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # (B, P+T)
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def prompt_length(self) -> int:
        return self.prompt_ids.shape[1]

    def select(self, index: torch.Tensor) -> "Sequences":
        return Sequences(self.prompt_ids[index], self.prompt_mask[index], self.response_ids[index], self.response_mask[index])


def finished_flags(response_ids: torch.Tensor, response_mask: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """(B,) bool: an EOS sits inside the response mask."""
    return ((response_ids == eos_token_id) & response_mask.bool()).any(dim=1)
