"""The KV cache carried from one turn of an episode to the next (docs/design.md, "Episodes").

An episode's next turn asks the model to continue its whole conversation so far: the prompt, the
turns it wrote, each tool's answer and the next header.  Without this, every turn's ``generate``
call runs the model over all of it again; on the strategy games (benchmarks/bench_strategy.py) a
turn's context is ~450-700 tokens of which ~40 are new, and re-reading it was most of a rollout's
time.  ``TurnCache`` keeps the last call's cache, the ids it holds for each row, and which of its
columns hold a row's tokens (a left-padded prompt, and the stop-padding a finished row is fed
while others go on, hold none); the next call's rows that begin with a kept row's ids start from
that row's cache and run the model over what is new only.

It is only correct while the weights do not change, so the torch loop keeps one only inside
``holding_weights`` (one rollout, all its turns, the same policy), and only for caches made of
plain ``DynamicLayer``s: a sliding window drops columns, and other caches (recurrent states) cannot
be cut by row.  The columns of a row never move: a reused row's new tokens are appended after the
whole cache, left-padded among themselves, so the cache has holes that the attention mask covers,
as it covers left padding, and positions count a row's own tokens only.  The numbers are those of
reading the conversation again up to round-off (the same keys and values, summed in another
order); tests/test_turn_cache.py compares them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def cache_rows_selectable(cache) -> bool:
    """Whether ``cache`` (a forward's output cache) is made of plain dynamic layers only."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # a transformers whose caches are not made of layers
        return False
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


class Start(NamedTuple):
    """A call's first forward from the kept cache (``TurnCache.start``)."""

    inputs: torch.Tensor  # (B, S) each row's new tokens, left-padded among themselves
    attention_mask: torch.Tensor  # (B, L + S) the kept columns a row reuses, then its new tokens
    position_ids: torch.Tensor  # (B, S) counting a row's own tokens only
    cache: object  # the kept cache, its rows those the call's rows continue
    next_position: torch.Tensor  # (B, 1) each row's first position after its context
    holds: torch.Tensor  # (B, L + S) bool: the columns holding a row's tokens
    contexts: list  # each row's context, its tokens


class TurnCache:
    """One rollout's kept cache (module docstring): ``start`` a call from it, ``keep`` what a call
    leaves."""

    def __init__(self):
        self.cache = None  # the last call's cache, (B, heads, L, head_dim) per layer
        self.valid: torch.Tensor | None = None  # (B, L) bool: the columns holding a row's tokens
        self.ids: list[tuple[int, ...]] = []  # each row's tokens, in the order of its valid columns
        self.rows_of: dict[tuple[int, tuple[int, ...]], int] = {}  # (length, ids) -> row
        self.keyword = "past_key_values"  # the name a forward takes its cache by (generation.cache_of)

    def keep(self, keyword: str, cache, valid: torch.Tensor, ids: list[list[int]]) -> None:
        if not cache_rows_selectable(cache):
            self.cache = None
            return
        self.keyword, self.cache, self.valid = keyword, cache, valid.bool()
        self.ids = [tuple(row) for row in ids]
        self.rows_of = {(len(row), row): i for i, row in enumerate(self.ids)}

    def match(self, context: list[int]) -> tuple[int, int]:
        """(kept row, tokens of it reused) for the longest kept row that ``context`` begins with,
        leaving at least one token of ``context`` to run (its logits choose the first new token);
        (-1, 0) where none."""
        lengths = sorted({length for length, _ in self.rows_of if length <= len(context)}, reverse=True)
        for length in lengths:
            row = self.rows_of.get((length, tuple(context[:length])))
            if row is not None:
                return row, min(length, len(context) - 1)
        return -1, 0

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, pad_token_id: int) -> Start | None:
        """The first forward of a call on left-padded ``prompt_ids`` from the kept cache, or None
        where no row begins with a kept one (the call reads everything)."""
        if self.cache is None:
            return None
        contexts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        matches = [self.match(context) for context in contexts]
        if all(row < 0 for row, _ in matches):
            return None
        device = prompt_ids.device
        rows = torch.tensor([max(row, 0) for row, _ in matches], device=device)
        for layer in self.cache.layers:
            layer.batch_select_indices(rows)
        reused = torch.tensor([length for _, length in matches], device=device)
        # A row's columns up to the tokens reused (none for a row that continues no kept one).
        past_valid = self.valid.to(device)[rows]
        past_valid &= torch.cumsum(past_valid.long(), dim=1) <= reused[:, None]
        news = [context[length:] for context, (_, length) in zip(contexts, matches)]
        width = max(len(new) for new in news)
        inputs = torch.tensor([[pad_token_id] * (width - len(new)) + new for new in news], device=device)
        new_mask = torch.tensor([[0] * (width - len(new)) + [1] * len(new) for new in news], device=device)
        positions = (reused[:, None] + torch.cumsum(new_mask, dim=1) - 1).clamp(min=0)
        attention_mask = torch.cat([past_valid.to(prompt_mask.dtype), new_mask.to(prompt_mask.dtype)], dim=1)
        cache, self.cache = self.cache, None  # the call grows it; what it leaves is kept again
        return Start(inputs, attention_mask, positions, cache, reused[:, None] + new_mask.sum(dim=1, keepdim=True),
                     attention_mask.bool(), contexts)
