"""The output layer applied a chunk of positions at a time, so no pass holds (rows, positions,
vocabulary) logits (docs/design.md, "Long responses").

A causal LM's forward ends in ``logits = lm_head(hidden)`` over every kept position, then whatever
its architecture does to them: Granite divides by ``logits_scaling``, Cohere multiplies by
``logit_scale``, Gemma 2/3 cap them with ``tanh(x / c) * c``.  With SmolLM2's 49k vocabulary, 64
responses of 1,024 tokens are 12.9 GB of float32 logits.  Here the trunk's hidden states at the
response positions are taken instead, and each chunk of positions goes through the output layer,
the architecture's change and the temperature, and is reduced at once to what the update needs
(the sampled token's log-prob, the entropy, the KL to another model's distribution).

A chunk is as many positions as make a 64 MiB float32 (positions, vocabulary) tensor: 341 of
SmolLM2's 49k vocabulary, 110 of Qwen2's 152k.  A chunk's backward pass holds a few of those at the
moment the trunk's activations are all alive, so their size adds to the update's peak.  With a
gradient, a pass whose logits come to more than 256 MiB makes each chunk a checkpoint: its logits
are recomputed in the backward pass, one chunk at a time.  A smaller pass keeps them for the
backward pass instead: recomputing would cost a second pass through the output layer to save
less than the chunks' own backward passes hold.  The entropy, where it is only a statistic
(no entropy bonus), is computed outside the graph: it holds nothing for the backward pass, and a
checkpoint's recomputation, which stops once it has remade the tensors the backward pass needs,
never reaches it.  The first batch of a run checks these numbers against the model's own forward
(rollout/passes.py).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ppo_rlhf.core.kl import full_kl
from ppo_rlhf.core.precision import compute_dtype
from ppo_rlhf.models.loading import base_of

CHUNK_BYTES = 64 * 2**20  # one chunk's float32 (positions, vocabulary) tensor
KEPT_LOGITS_BYTES = 256 * 2**20  # a pass with more float32 logits than this recomputes them in the backward pass


def chunk_positions(vocab_size: int) -> int:
    """Positions in a chunk of the fused output layer: a float32 (positions, vocabulary) tensor of CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


class OutputHead:
    """``model``'s output layer and the changes its forward makes to the logits, then / temperature.
    ``known``: whether ppo-rlhf knows the architecture's changes (checked on a first batch anyway)."""

    def __init__(self, model, temperature: float = 1.0):
        inner = base_of(model)
        self.layer = inner.get_output_embeddings()
        if getattr(self.layer, "disable_adapters", False):
            # Built under adapters_disabled (the LoRA reference): the head keeps the base's layer, as
            # its logits may be read after the context has closed (the full KL, in the update).
            self.layer = self.layer.get_base_layer()
        config = inner.config.get_text_config()
        self.scale = 1.0
        if getattr(config, "logits_scaling", None):  # Granite
            self.scale /= config.logits_scaling
        if getattr(config, "logit_scale", None):  # Cohere
            self.scale *= config.logit_scale
        self.softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 / 3
        self.temperature = temperature
        self.vocab_size = getattr(self.layer, "out_features", None) or config.vocab_size

    def recomputes(self, positions: int, keep_bytes: int = KEPT_LOGITS_BYTES) -> bool:
        """Whether a pass with a gradient over ``positions`` recomputes its logits in the backward pass."""
        return positions * self.vocab_size * 4 > keep_bytes

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, H) hidden states -> (n, V) float32 logits of the sampling distribution."""
        logits = self.layer(hidden)
        logits = logits.to(compute_dtype(logits))
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits / self.temperature if self.temperature != 1.0 else logits


def _token_stats(head: OutputHead, hidden: torch.Tensor, tokens: torch.Tensor, entropy: bool, entropy_grad: bool):
    """One chunk: (n, H), (n,) -> log-probs (n,) and entropies (n,) (or an empty tensor)."""
    logits = head.logits(hidden)
    logsumexp = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, tokens[:, None]).squeeze(-1) - logsumexp
    if not entropy:
        return logprobs, logprobs.new_zeros(0)
    # Last, and without a graph unless it is trained: a checkpoint's recomputation stops before it.
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probabilities = torch.softmax(logits, dim=-1)
        return logprobs, logsumexp - (probabilities * logits).sum(dim=-1)


def token_stats(head: OutputHead, hidden: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor,
                entropy: bool = False, entropy_grad: bool = False, chunk: int | None = None,
                keep_bytes: int = KEPT_LOGITS_BYTES) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T, H) hidden states at the positions predicting (B, T) ``tokens`` -> (B, T) log-probs and,
    with ``entropy``, (B, T) entropies (with a gradient only for ``entropy_grad``); only the
    positions ``mask`` selects are computed, the rest are 0.  ``chunk`` positions at a time (default:
    :func:`chunk_positions`); with a gradient, recomputed in the backward pass where the pass's
    logits would come to more than ``keep_bytes``."""
    selected = mask.bool()
    flat_hidden, flat_tokens = hidden[selected], tokens[selected]  # (N, H), (N,)
    chunk = chunk or chunk_positions(head.vocab_size)
    recompute = torch.is_grad_enabled() and flat_hidden.requires_grad and head.recomputes(len(flat_tokens), keep_bytes)
    logprob_parts, entropy_parts = [], []
    for start in range(0, flat_tokens.shape[0], chunk):
        piece = slice(start, start + chunk)
        if recompute:  # recomputed in the backward pass: one chunk's logits alive at a time
            logprobs, entropies = checkpoint(_token_stats, head, flat_hidden[piece], flat_tokens[piece],
                                             entropy, entropy_grad, use_reentrant=False)
        else:
            logprobs, entropies = _token_stats(head, flat_hidden[piece], flat_tokens[piece], entropy, entropy_grad)
        logprob_parts.append(logprobs)
        entropy_parts.append(entropies if entropy_grad else entropies.detach())
    dtype = compute_dtype(hidden)
    logprobs = hidden.new_zeros(tokens.shape, dtype=dtype).masked_scatter(
        selected, torch.cat(logprob_parts) if logprob_parts else hidden.new_zeros(0, dtype=dtype))
    if not entropy:
        return logprobs, None
    entropies = hidden.new_zeros(tokens.shape, dtype=dtype).masked_scatter(
        selected, torch.cat(entropy_parts) if entropy_parts else hidden.new_zeros(0, dtype=dtype))
    return logprobs, entropies


def _full_kl(head: OutputHead, hidden: torch.Tensor, ref_head: OutputHead, ref_hidden: torch.Tensor) -> torch.Tensor:
    return full_kl(head.logits(hidden), ref_head.logits(ref_hidden))


def full_kl_stats(head: OutputHead, hidden: torch.Tensor, ref_head: OutputHead, ref_hidden: torch.Tensor,
                  mask: torch.Tensor, chunk: int | None = None, keep_bytes: int = KEPT_LOGITS_BYTES) -> torch.Tensor:
    """(B, T) exact KL(policy || reference) over the vocabulary at each selected position, from both
    models' hidden states, a chunk at a time (core/kl.py ``full_kl``, without the (B, T, V) logits)."""
    selected = mask.bool()
    flat, ref_flat = hidden[selected], ref_hidden[selected].detach()
    chunk = chunk or chunk_positions(head.vocab_size)
    recompute = torch.is_grad_enabled() and flat.requires_grad and head.recomputes(len(flat), keep_bytes)
    parts = []
    for start in range(0, flat.shape[0], chunk):
        piece = slice(start, start + chunk)
        if recompute:
            parts.append(checkpoint(_full_kl, head, flat[piece], ref_head, ref_flat[piece], use_reentrant=False))
        else:
            parts.append(_full_kl(head, flat[piece], ref_head, ref_flat[piece]))
    dtype = compute_dtype(hidden)
    return hidden.new_zeros(mask.shape, dtype=dtype).masked_scatter(
        selected, torch.cat(parts) if parts else hidden.new_zeros(0, dtype=dtype))
