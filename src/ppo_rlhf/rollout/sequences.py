"""Token sequences as PPO sees them: a left-padded prompt followed by a right-padded response.

    position:   0 ... P-1 | P ... P+T-1
    tokens:     P P S a b | r1 r2 E  P P     (left pad | response, pad after the first stop id)
    mask:       0 0 1 1 1 | 1  1  1  0 0

The logits that predict response token t sit at position P-1+t, so every per-token tensor of
the response (log-probs, values, KL, rewards, advantages) is (B, T) and aligned with
``response_mask``.

Two masks over the response (docs/design.md, "Episodes"): ``response_mask`` says which tokens are
there (attended to), ``loss_mask`` which of them the model wrote and is trained on.  A single-turn
response is all the model's own, and the two are one tensor.  A multi-turn episode continues the
prompt with the model's turns *and* what the environment or its tools answered in between:

    response:   r1 r2 E | o1 o2 o3 | r3 E  P P     (model | environment | model | pad)
    response_mask: 1  1 1 |  1  1  1 |  1 1  0 0
    loss_mask:     1  1 1 |  0  0  0 |  1 1  0 0

Every policy, KL, entropy and value term reads ``loss_mask``; the forward passes attend
``response_mask``.

A response ends at the first of its *stop ids* (E above): the tokenizer's EOS and every
end-of-turn id the model declares (see :func:`stop_token_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

StopIds = int | Sequence[int] | torch.Tensor


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Every token id that ends a response: the tokenizer's EOS, then the ids the model's
    generation config names (an int or a list).

    Chat models put their end of turn there and not in the tokenizer (gemma-it's <end_of_turn>,
    Phi-3.5's <|end|>, Qwen3's <|im_end|> beside <|endoftext|>); Hugging Face's generate stops on
    those, and so must a response here.  ``from_pretrained`` reads the generation config from
    generation_config.json, or from config.json when there is none, so a model config's own
    eos_token_id is already in it.  Works through a peft wrapper (it forwards the attribute).
    """
    ids = [tokenizer.eos_token_id]
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += list(declared) if isinstance(declared, (list, tuple)) else [declared]
    return list(dict.fromkeys(i for i in ids if i is not None))  # unique, EOS first


def is_stop(token_ids: torch.Tensor, stop_ids: StopIds) -> torch.Tensor:
    """Bool tensor of ``token_ids``' shape: the token is one of the stop ids."""
    return torch.isin(token_ids, torch.as_tensor(stop_ids, device=token_ids.device).reshape(-1))


def response_mask_from_eos(response_ids: torch.Tensor, stop_ids: StopIds) -> torch.Tensor:
    """1 up to and including the first stop id, 0 after it; all ones if none was emitted.

    Built from the stop ids, never from the pad id: many tokenizers use EOS as pad, and a mask
    from ``ids != pad`` would then drop the EOS itself (or everything after an early one).
    """
    stops = is_stop(response_ids, stop_ids).long()
    stops_before = torch.cumsum(stops, dim=1) - stops  # stop tokens strictly before t
    return (stops_before == 0).long()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token is position 0."""
    return (torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0)


@dataclass
class Sequences:
    """A batch of prompt + response token sequences."""

    prompt_ids: torch.Tensor  # (B, P) left-padded
    prompt_mask: torch.Tensor  # (B, P)
    response_ids: torch.Tensor  # (B, T) pad after the response (a single turn: after its first stop id)
    response_mask: torch.Tensor  # (B, T) 1 on every token of the response, attended to
    loss_mask: torch.Tensor | None = None  # (B, T) 1 on the tokens the model wrote; None: response_mask

    def __post_init__(self) -> None:
        if self.loss_mask is None:  # a single turn: every response token is the model's
            self.loss_mask = self.response_mask

    @property
    def input_ids(self) -> torch.Tensor:  # (B, P+T)
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # (B, P+T)
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    @property
    def position_ids(self) -> torch.Tensor:  # (B, P+T) from 0 at the first real token
        return position_ids_from_mask(self.attention_mask)

    @property
    def prompt_length(self) -> int:
        return self.prompt_ids.shape[1]

    @staticmethod
    def placeholder(pad_token_id: int, device: torch.device) -> "Sequences":
        """One row of a pad token as prompt and as response: a pass whose result nobody reads, run
        only to take part in the other processes' collectives (trainers/ppo.py, rollout_passes)."""
        one = torch.full((1, 1), pad_token_id, dtype=torch.long, device=device)
        return Sequences(one, torch.ones_like(one), one.clone(), torch.ones_like(one))

    def select(self, index: torch.Tensor) -> "Sequences":
        return Sequences(self.prompt_ids[index], self.prompt_mask[index], self.response_ids[index],
                         self.response_mask[index], self.separate_loss_mask(lambda mask: mask[index]))

    def separate_loss_mask(self, transform) -> torch.Tensor | None:
        """``transform(loss_mask)`` where it is a tensor of its own, None where it is response_mask."""
        return None if self.loss_mask is self.response_mask else transform(self.loss_mask)

    @staticmethod
    def concat(parts: list["Sequences"], pad_token_id: int) -> "Sequences":
        """The rows of ``parts`` in order, padded to the widest (prompts on the left, responses on
        the right), as one batch of them all would be."""
        prompt_width = max(p.prompt_ids.shape[1] for p in parts)
        response_width = max(p.response_ids.shape[1] for p in parts)
        own_loss_masks = any(p.loss_mask is not p.response_mask for p in parts)
        return Sequences(
            torch.cat([pad_columns(p.prompt_ids, prompt_width, pad_token_id, left=True) for p in parts]),
            torch.cat([pad_columns(p.prompt_mask, prompt_width, 0, left=True) for p in parts]),
            torch.cat([pad_columns(p.response_ids, response_width, pad_token_id) for p in parts]),
            torch.cat([pad_columns(p.response_mask, response_width, 0) for p in parts]),
            torch.cat([pad_columns(p.loss_mask, response_width, 0) for p in parts]) if own_loss_masks else None,
        )


def pad_columns(tensor: torch.Tensor, width: int, value: float, left: bool = False) -> torch.Tensor:
    """(B, W, ...) -> (B, width, ...), the new columns filled with ``value`` on the left or right."""
    missing = width - tensor.shape[1]
    if missing <= 0:
        return tensor
    pad = tensor.new_full((tensor.shape[0], missing, *tensor.shape[2:]), value)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)


def finished_flags(response_ids: torch.Tensor, response_mask: torch.Tensor, stop_ids: StopIds) -> torch.Tensor:
    """(B,) bool: a stop id sits inside the response mask."""
    return (is_stop(response_ids, stop_ids) & response_mask.bool()).any(dim=1)
