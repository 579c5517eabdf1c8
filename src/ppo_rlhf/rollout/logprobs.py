"""Per-token log-probs, entropies and values over the response part of a sequence batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo_rlhf.core.logprobs import token_logprobs
from ppo_rlhf.models.loading import base_of, trunk_of
from ppo_rlhf.rollout.generation import cache_of
from ppo_rlhf.rollout.packing import pack_if_shorter, without_padding_warning
from ppo_rlhf.rollout.sequences import Sequences, position_ids_from_mask


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits, (B, T) token ids -> (B, T) log-probabilities of those tokens, a chunk of
    positions at a time (no full (B, T, V) log-softmax is ever held)."""
    return token_logprobs(logits, tokens)


def output_layer(model) -> torch.nn.Module:
    """The module that turns hidden states into vocabulary logits, also through a peft wrapper."""
    return base_of(model).get_output_embeddings()


@dataclass
class ResponseForward:
    logits: torch.Tensor | None  # (B, T, V) float32, already divided by the temperature; None: fused (hidden only)
    hidden: torch.Tensor  # (B, T, H) input of the output layer at the positions that predict each response token


class PromptSharingUnsupported(RuntimeError):
    """The model's forward cannot continue from a cache of shared prompts (see forward_shared_prompts)."""


def forward_response(model, sequences: Sequences, temperature: float = 1.0, share_prompts: bool = False,
                     fused: bool = False, pack: bool = False, pad_token_id: int = 0) -> ResponseForward:
    """Run the causal LM over prompt + response; keep the positions that predict the response.

    The logits come from the model's own forward, the one generation samples from: some
    architectures change the logits after the output layer (Granite divides them, Cohere
    multiplies them, Gemma caps them), and the trained distribution must be the sampled one.
    ``logits_to_keep`` projects only the T + 1 last positions onto the vocabulary, which saves
    the projection of every prompt token.  The hidden states the value head reads are what the
    output layer receives, caught on their way in: the same positions, after the final norm.

    ``fused``: no logits at all (the model projects one position), only the hidden states, caught
    as the trunk gives them; rollout/output_layer.py turns them into log-probs a chunk at a time.
    ``share_prompts``: where rows repeat a prompt (``--samples-per-prompt K``), run each distinct
    prompt once and the responses on its keys and values (:func:`forward_shared_prompts`).
    ``pack`` (with ``fused``): rows packed end to end without padding (rollout/packing.py).  With
    both, each call takes the layout that runs fewer positions.
    """
    packed = pack_if_shorter(sequences, pad_token_id) if pack and fused else None
    if share_prompts and len(sequences.prompt_ids) > 1:
        first_rows, prompt_of_row = distinct_prompts(sequences)
        if len(first_rows) < len(prompt_of_row) and (packed is None or shared_tokens(sequences, first_rows) < packed.tokens):
            return forward_shared_prompts(model, sequences, first_rows, prompt_of_row, temperature, fused)
    if packed is not None:  # no attention mask: the position ids say where each row starts (packing.py)
        with caught_hidden(model, fused=True, calls=1) as caught, without_padding_warning():
            model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, logits_to_keep=1)
        return ResponseForward(logits=None, hidden=packed.gather(caught[0]))
    attention_mask = sequences.attention_mask
    response_length = sequences.response_ids.shape[1]
    with caught_hidden(model, fused, calls=1) as caught:
        out = model(
            input_ids=sequences.input_ids, attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask), use_cache=False,
            logits_to_keep=1 if fused else response_length + 1,
        )
    if fused:  # the trunk's every position: P-1+t predicts response token t
        start = sequences.prompt_length - 1
        return ResponseForward(logits=None, hidden=caught[0][:, start:start + response_length])
    # Position P-1+t predicts response token t: of the T+1 kept positions, drop the last.
    return scaled(ResponseForward(logits=out.logits[:, :-1], hidden=caught[0][:, :-1]), temperature)


def shared_tokens(sequences: Sequences, first_rows: torch.Tensor) -> int:
    """The positions a pass with shared prompts runs: each distinct prompt once, every response."""
    return len(first_rows) * sequences.prompt_length + sequences.response_ids.numel()


def distinct_prompts(sequences: Sequences) -> tuple[torch.Tensor, torch.Tensor]:
    """(U,) one row holding each distinct prompt (ids and mask), and (B,) each row's prompt among those U."""
    prompts = torch.cat([sequences.prompt_ids, sequences.prompt_mask], dim=1)
    _, prompt_of_row = torch.unique(prompts, dim=0, return_inverse=True)
    rows = torch.arange(len(prompt_of_row), device=prompt_of_row.device)
    first_rows = torch.full((int(prompt_of_row.max()) + 1,), len(rows), dtype=torch.long, device=rows.device)
    return first_rows.scatter_reduce_(0, prompt_of_row, rows, reduce="amin"), prompt_of_row  # (deterministic)


def forward_shared_prompts(model, sequences: Sequences, first_rows: torch.Tensor, prompt_of_row: torch.Tensor,
                           temperature: float = 1.0, fused: bool = False) -> ResponseForward:
    """forward_response's logits and hidden states with each distinct prompt run once
    (docs/design.md, "Shared prompts").

    GRPO's K responses to a prompt repeat its P tokens K times in every forward pass; here the U
    distinct prompts run once (``use_cache``), their keys and values are indexed out to the B
    rows (an index, so the backward pass sums each prompt's gradient over its K rows, as K
    copies would), and the responses run on that cache.  The prompt pass's last position
    predicts response token 0; the response pass over tokens 0..T-2 predicts tokens 1..T-1.
    Positions and masks are the full pass's, so the numbers are the same up to rounding.

    Needs a cache that concatenates keys and values (transformers' DynamicLayer, every layer):
    sliding-window, static or recurrent caches drop or fold positions, and raise
    PromptSharingUnsupported instead."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    prompt_length, response_length = sequences.prompt_length, sequences.response_ids.shape[1]
    attention_mask = sequences.attention_mask
    positions = position_ids_from_mask(attention_mask)
    calls = 1 if response_length == 1 else 2
    with caught_hidden(model, fused, calls) as caught:
        prompt_out = model(input_ids=sequences.prompt_ids[first_rows], attention_mask=sequences.prompt_mask[first_rows],
                           position_ids=positions[first_rows, :prompt_length], use_cache=True, logits_to_keep=1)
        cache_name, cache = cache_of(prompt_out)
        if not isinstance(cache, DynamicCache) or any(type(layer) is not DynamicLayer for layer in cache.layers):
            layers = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])})
            raise PromptSharingUnsupported(f"{type(model).__name__}'s cache is {type(cache).__name__} "
                                           f"({', '.join(layers)}), not DynamicLayers that keep every position")
        cache.batch_select_indices(prompt_of_row)
        logits = [prompt_out.logits[prompt_of_row]]
        if response_length > 1:
            response_out = model(input_ids=sequences.response_ids[:, :-1], attention_mask=attention_mask[:, :-1],
                                 position_ids=positions[:, prompt_length:-1], use_cache=True,
                                 logits_to_keep=1 if fused else 0, **{cache_name: cache})
            logits.append(response_out.logits)
    if fused:  # the prompt pass's last position, then every position of the response pass
        hidden = torch.cat([caught[0][prompt_of_row][:, -1:], *caught[1:]], dim=1)
        return ResponseForward(logits=None, hidden=hidden)
    hidden = torch.cat([caught[0][prompt_of_row], *caught[1:]], dim=1)
    return scaled(ResponseForward(logits=torch.cat(logits, dim=1), hidden=hidden), temperature)


class caught_hidden:
    """Context: one hidden-state tensor per model call -- what the output layer receives (a forward
    pre-hook: the positions the model projects), or with ``fused`` what the trunk gives (a forward
    hook: every position); checks on exit that the model made exactly ``calls`` of them."""

    def __init__(self, model, fused: bool, calls: int):
        self.layer = trunk_of(model) if fused else output_layer(model)
        self.fused, self.calls, self.caught = fused, calls, []
        self.model_name = type(model).__name__

    def __enter__(self) -> list[torch.Tensor]:
        if self.fused:
            self.hook = self.layer.register_forward_hook(
                lambda module, args, output: self.caught.append(output.last_hidden_state if hasattr(
                    output, "last_hidden_state") else output[0]))
        else:
            self.hook = self.layer.register_forward_pre_hook(lambda module, args: self.caught.append(args[0]))
        return self.caught

    def __exit__(self, kind, error, traceback) -> None:
        self.hook.remove()
        if kind is None and len(self.caught) != self.calls:
            where = "its trunk" if self.fused else "its output layer"
            raise RuntimeError(f"{self.model_name} ran {where} {len(self.caught)} times in {self.calls} "
                               f"forward pass(es); forward_response expects once a pass")


def scaled(out: ResponseForward, temperature: float) -> ResponseForward:
    """Logits as float32 and divided by the sampling temperature."""
    logits = out.logits.float()
    if temperature != 1.0:  # (no copy of a (B, T, V) tensor for nothing)
        logits = logits / temperature
    return ResponseForward(logits=logits, hidden=out.hidden)
