"""Per-token log-probs, entropies and values over the response part of a sequence batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo_rlhf.rollout.sequences import Sequences, position_ids_from_mask


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits, (B, T) token ids -> (B, T) log-probabilities of those tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, dim=-1, index=tokens.unsqueeze(-1)).squeeze(-1)


def causal_lm_parts(model):
    """(trunk, lm_head) of a causal LM, also through a peft wrapper.

    Running the trunk and then the head on the response positions only saves the vocabulary
    projection of every prompt token, which dominates for long prompts and large vocabularies.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return inner.base_model, inner.get_output_embeddings(), inner.config


@dataclass
class ResponseForward:
    logits: torch.Tensor  # (B, T, V) already divided by the temperature
    hidden: torch.Tensor  # (B, T, H) trunk output at the positions that predict each response token


def forward_response(model, sequences: Sequences, temperature: float = 1.0) -> ResponseForward:
    """Run the causal LM over prompt + response; keep the positions that predict the response."""
    trunk, lm_head, config = causal_lm_parts(model)
    attention_mask = sequences.attention_mask
    hidden = trunk(
        input_ids=sequences.input_ids, attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask), use_cache=False,
    ).last_hidden_state  # (B, P+T, H)
    start = sequences.prompt_length - 1
    hidden = hidden[:, start:-1]  # (B, T, H)
    logits = lm_head(hidden)
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap:  # Gemma-style models cap logits inside their forward; keep that here too
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.float()
    if temperature != 1.0:  # (no copy of a (B, T, V) tensor for nothing)
        logits = logits / temperature
    return ResponseForward(logits=logits, hidden=hidden)


def critic_values(critic, sequences: Sequences) -> torch.Tensor:
    """(B, T) values from a separate critic at the positions that predict each response token."""
    attention_mask = sequences.attention_mask
    values = critic(sequences.input_ids, attention_mask, position_ids_from_mask(attention_mask))  # (B, P+T)
    start = sequences.prompt_length - 1
    return values[:, start:-1]
