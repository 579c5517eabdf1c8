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


def cut_pair_alike(first: list[int], second: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """Two token sequences that start with a shared prompt, cut to ``max_length`` so that they stay
    aligned position by position (a loss that compares them token by token, ``rm --rm-loss
    divergence``, needs position t of one to be position t of the other).

    First the start of the shared prefix goes, the same tokens from both, as far as needed and as
    far as it is shared (each keeps at least its first differing token): both responses keep their
    ends, the EOS a reward is read at.  A pair still too long after that -- the responses alone do
    not fit -- loses its ends, both cut to ``max_length`` from the right, as DeepSpeed-Chat cuts.
    Cutting each from the left on its own would shift the shorter against the longer by the
    difference of their lengths (docs/design.md, "The pipeline and its roles")."""
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    excess = max(len(first), len(second)) - max_length
    drop = max(0, min(excess, shared, len(first) - 1, len(second) - 1))
    return first[drop:][:max_length], second[drop:][:max_length]


def encode_pairs(tokenizer, first: list[str], second: list[str], max_length: int, add_special_tokens: bool = True
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """((ids, mask), (ids, mask)) of the pairs ``first[i]``, ``second[i]``, each pair cut alike by
    :func:`cut_pair_alike`, all right-padded to one width."""
    encoded = tokenizer(first + second, add_special_tokens=add_special_tokens)["input_ids"]
    pairs = [cut_pair_alike(a, b, max_length) for a, b in zip(encoded[:len(first)], encoded[len(first):])]
    rows = [a for a, _ in pairs] + [b for _, b in pairs]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return (ids[:len(first)], mask[:len(first)]), (ids[len(first):], mask[len(first):])


def with_eos(tokenizer, text: str) -> str:
    """``text`` ending with EOS, as a finished response ends (the reward model scores a
    response at its EOS); not a second one when it is there already."""
    eos = tokenizer.eos_token or ""
    return text if text.endswith(eos) else text + eos
