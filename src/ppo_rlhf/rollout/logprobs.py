"""Per-token log-probs, entropies and values over the response part of a sequence batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo_rlhf.core.logprobs import token_logprobs
from ppo_rlhf.rollout.sequences import Sequences, position_ids_from_mask


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits, (B, T) token ids -> (B, T) log-probabilities of those tokens, a chunk of
    positions at a time (no full (B, T, V) log-softmax is ever held)."""
    return token_logprobs(logits, tokens)


def output_layer(model) -> torch.nn.Module:
    """The module that turns hidden states into vocabulary logits, also through a peft wrapper."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.get_output_embeddings()


@dataclass
class ResponseForward:
    logits: torch.Tensor  # (B, T, V) float32, already divided by the temperature
    hidden: torch.Tensor  # (B, T, H) input of the output layer at the positions that predict each response token


def forward_response(model, sequences: Sequences, temperature: float = 1.0) -> ResponseForward:
    """Run the causal LM over prompt + response; keep the positions that predict the response.

    The logits come from the model's own forward, the one generation samples from: some
    architectures change the logits after the output layer (Granite divides them, Cohere
    multiplies them, Gemma caps them), and the trained distribution must be the sampled one.
    ``logits_to_keep`` projects only the T + 1 last positions onto the vocabulary, which saves
    the projection of every prompt token.  The hidden states the value head reads are what the
    output layer receives, caught on their way in: the same positions, after the final norm.
    """
    attention_mask = sequences.attention_mask
    response_length = sequences.response_ids.shape[1]
    caught = []
    hook = output_layer(model).register_forward_pre_hook(lambda module, args: caught.append(args[0]))
    try:
        out = model(
            input_ids=sequences.input_ids, attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask), use_cache=False,
            logits_to_keep=response_length + 1,
        )
    finally:
        hook.remove()
    if len(caught) != 1:
        raise RuntimeError(f"{type(model).__name__} ran its output layer {len(caught)} times in one forward; "
                           f"forward_response expects once")
    # Position P-1+t predicts response token t: of the T+1 kept positions, drop the last.
    hidden = caught[0][:, :-1]  # (B, T, H)
    logits = out.logits[:, :-1].float()  # (B, T, V)
    if temperature != 1.0:  # (no copy of a (B, T, V) tensor for nothing)
        logits = logits / temperature
    return ResponseForward(logits=logits, hidden=hidden)
