"""Log-probabilities and entropies from logits, without materialising (B, T, V) float32 copies.

``log_softmax(logits.float()).gather(...)`` holds two float32 tensors the size of the logits at
once (and the float copy of bf16 logits besides): with a 152k vocabulary, 64 sequences and 512
new tokens that is 40 GB for one pass.  Here the work goes row-chunk by row-chunk: each chunk is
cast to float32, reduced to one number per position (``logsumexp``, or the entropy), and freed.
The extra memory is one chunk's float32 copy, whatever the batch.
"""

from __future__ import annotations

import torch

from ppo_rlhf.core.precision import compute_dtype

# Positions per chunk: 1024 x 152k x 4 bytes = 0.6 GB of float32 at most.
CHUNK_POSITIONS = 1024


def _row_chunks(flat_rows: int, chunk: int):
    return range(0, flat_rows, max(1, chunk))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, chunk: int = CHUNK_POSITIONS) -> torch.Tensor:
    """(..., V) logits, (...) token ids -> (...) log-probabilities of those tokens.

    ``log p(token) = logit[token] - logsumexp(logits)``, computed in float32 (float64 stays
    float64) one chunk of positions at a time.  Differentiable: autograd keeps only what each
    chunk's logsumexp needs.
    """
    dtype = compute_dtype(logits)
    flat_logits = logits.reshape(-1, logits.shape[-1])  # (N, V)
    flat_tokens = tokens.reshape(-1)  # (N,)
    pieces = []
    for start in _row_chunks(flat_logits.shape[0], chunk):
        rows = flat_logits[start:start + chunk].to(dtype)  # (n, V), one chunk in float32
        chosen = rows.gather(-1, flat_tokens[start:start + chunk, None]).squeeze(-1)  # (n,)
        pieces.append(chosen - torch.logsumexp(rows, dim=-1))
    if not pieces:
        return torch.zeros(tokens.shape, dtype=dtype, device=logits.device)
    return torch.cat(pieces).reshape(tokens.shape)


def chunked_entropy(logits: torch.Tensor, chunk: int = CHUNK_POSITIONS) -> torch.Tensor:
    """(..., V) logits -> (...) entropy of each position's distribution, one chunk at a time."""
    dtype = compute_dtype(logits)
    flat_logits = logits.reshape(-1, logits.shape[-1])
    pieces = []
    for start in _row_chunks(flat_logits.shape[0], chunk):
        logp = torch.log_softmax(flat_logits[start:start + chunk].to(dtype), dim=-1)  # (n, V)
        pieces.append(-(logp.exp() * logp).sum(dim=-1))
    if not pieces:
        return torch.zeros(logits.shape[:-1], dtype=dtype, device=logits.device)
    return torch.cat(pieces).reshape(logits.shape[:-1])
