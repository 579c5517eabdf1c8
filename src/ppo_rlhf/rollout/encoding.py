"""Texts to padded token ids, the one way prompts (for generation) and reward-model rows (for
training) are encoded: the padding side chosen by the caller, never left to the tokenizer's
default, and long texts cut from the left."""

from __future__ import annotations

import torch


def encode_texts(tokenizer, texts: list[str], max_length: int, padding_side: str, add_special_tokens: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and attention mask, padded on ``padding_side``.  A text longer than
    ``max_length`` loses its *start*: the end is what matters (what a response continues
    from, or the response a reward model judges)."""
    saved_sides = tokenizer.padding_side, tokenizer.truncation_side
    tokenizer.padding_side, tokenizer.truncation_side = padding_side, "left"
    try:
        encoded = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=max_length,
                            add_special_tokens=add_special_tokens)
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = saved_sides
    return encoded["input_ids"], encoded["attention_mask"]


def drop_padding_columns(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` and ``mask`` without the columns that are padding in every row: rows encoded
    together are padded to the longest of them all, a batch of some rows needs less.  Read
    from the mask, so it holds for padding on either side."""
    keep = mask.any(dim=0)  # (L,)
    return ids[:, keep], mask[:, keep]



def with_eos(tokenizer, text: str) -> str:
    """``text`` ending with EOS, as a finished response ends (the reward model scores a
    response at its EOS); not a second one when it is there already."""
    eos = tokenizer.eos_token or ""
    return text if text.endswith(eos) else text + eos
