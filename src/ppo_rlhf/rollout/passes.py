"""How the trainer's forward passes run (docs/design.md, "Long responses"): per-token log-probs,
entropies and hidden states of a batch's responses, from one of three layouts -- padded, shared
prompts, packed -- through the model's own output (the logits it computes) or the fused output
layer (rollout/output_layer.py: a chunk of positions at a time, no (B, T, V) tensor).

A run decides its plan on its first batch (:func:`checked_plan`): each faster way is kept only
where it gives the model's own padded pass's log-probs; a model where it does not falls back, and
the run says why.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ppo_rlhf.core import entropy_from_logits, full_kl
from ppo_rlhf.rollout.logprobs import PromptSharingUnsupported, distinct_prompts, forward_response, logprobs_from_logits
from ppo_rlhf.rollout.output_layer import OutputHead, full_kl_stats, token_stats
from ppo_rlhf.rollout.sequences import Sequences


@dataclass(frozen=True)
class PassPlan:
    temperature: float = 1.0
    pad_token_id: int = 0
    share_prompts: bool = False  # each distinct prompt once a pass (K samples per prompt)
    fused: bool = False  # the output layer a chunk of positions at a time
    pack: bool = False  # rows packed without padding (with fused)

    def forward(self, model, sequences: Sequences):
        return forward_response(model, sequences, self.temperature, self.share_prompts, self.fused,
                                self.fused and self.pack, self.pad_token_id)

    def describe(self) -> str:
        layout = " and ".join(name for name, on in (("packed without padding", self.fused and self.pack),
                                                     ("prompts shared", self.share_prompts)) if on) or "padded"
        head = "the output layer a chunk of positions at a time" if self.fused else "the model's own logits"
        return f"{layout}; {head}"


@dataclass
class ResponseStats:
    logprobs: torch.Tensor  # (B, T) of the response tokens (0 where the loss mask is 0, fused)
    hidden: torch.Tensor  # (B, T, H) what the output layer reads at those positions
    entropy: torch.Tensor | None = None  # (B, T)
    logits: torch.Tensor | None = None  # (B, T, V) the model's own path only
    head: OutputHead | None = None  # the fused path's output layer


def response_stats(model, sequences: Sequences, plan: PassPlan, entropy: bool = False, entropy_grad: bool = False
                   ) -> ResponseStats:
    """Log-probs (and entropies: with a gradient only for ``entropy_grad``) of ``sequences``'
    response tokens under ``model``, by ``plan``."""
    out = plan.forward(model, sequences)
    tokens, mask = sequences.response_ids, sequences.loss_mask
    if out.logits is None:
        head = OutputHead(model, plan.temperature)
        logprobs, entropies = token_stats(head, out.hidden, tokens, mask, entropy, entropy_grad)
        return ResponseStats(logprobs, out.hidden, entropies, head=head)
    entropies = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropies = entropy_from_logits(out.logits)
    return ResponseStats(logprobs_from_logits(out.logits, tokens), out.hidden, entropies, logits=out.logits)


def full_kl_between(stats: ResponseStats, ref_stats: ResponseStats, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) exact KL(policy || other) over the vocabulary (``--kl-estimator full``, ``--teacher-in
    loss``).  The reference runs the policy's plan; a teacher of its own may keep another output
    path (its plan is checked on it), and then its side's logits are made whole at the masked
    positions."""
    if stats.logits is not None and ref_stats.logits is not None:
        return full_kl(stats.logits, ref_stats.logits)
    if stats.logits is None and ref_stats.logits is None:
        return full_kl_stats(stats.head, stats.hidden, ref_stats.head, ref_stats.hidden, mask)
    selected = mask.bool()
    logits, ref_logits = (s.logits[selected] if s.logits is not None else s.head.logits(s.hidden[selected])
                          for s in (stats, ref_stats))
    per_position = full_kl(logits, ref_logits.detach())
    return per_position.new_zeros(mask.shape).masked_scatter(selected, per_position)


# Rounding alone: ~1e-6 in float32, ~1e-2 in bf16; a wrong mask or position moves log-probs by ~1.
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}
HALF_TOLERANCE = 5e-2


def gap(model, sequences: Sequences, plan: PassPlan, reference: torch.Tensor) -> str | None:
    """None where ``plan`` gives ``reference`` (the model's own padded log-probs) on ``sequences``,
    else why not."""
    try:
        with torch.no_grad():
            got = response_stats(model, sequences, plan).logprobs
    except PromptSharingUnsupported as why:
        return str(why)
    mask = sequences.loss_mask.bool()
    difference = (got - reference)[mask].abs()
    parameter = next(model.parameters())
    device = parameter.device.type  # under --mixed-precision the passes round as the autocast dtype does
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else parameter.dtype
    tolerance = TOLERANCE.get(dtype, HALF_TOLERANCE)
    if difference.numel() and difference.mean() > tolerance:
        return f"its log-probs differ from the model's own padded pass by {difference.mean():.2g} on average " \
               f"(tolerance {tolerance:g})"
    return None


def checked_plan(model, sequences: Sequences, wanted: PassPlan) -> tuple[PassPlan, list[str]]:
    """The plan a run keeps, from what it ``wanted``, checked on its first batch (up to
    ``CHECK_ROWS`` of its rows: :func:`rows_to_check`) against the model's own padded pass: the
    fused output layer (it applies the architecture's known changes to the
    logits), packing, shared prompts -- each dropped where its log-probs differ; and the
    warnings saying so."""
    own = dataclasses.replace(wanted, share_prompts=False, fused=False, pack=False)
    if not (wanted.fused or wanted.share_prompts):  # nothing faster asked for (packing rides on the fused layer)
        return own, []  # and no pass run: under FSDP, where both are off, each would be a collective
    sequences = sequences.select(rows_to_check(sequences))
    reference = own_logprobs(model, sequences, own)
    plan, warnings = own, []
    for name, change, flag in (("the fused output layer", {"fused": True}, "--no-fused-output-layer"),
                               ("padding-free passes", {"pack": True}, "--no-padding-free"),
                               ("--share-prompts", {"share_prompts": True}, "--no-share-prompts")):
        if not all(getattr(wanted, key) for key in change) or (name == "padding-free passes" and not plan.fused):
            continue
        candidate = dataclasses.replace(plan, **change)
        if name == "--share-prompts" and not repeated_prompts(sequences):
            plan = candidate  # nothing to check on this batch; the full pass is taken where nothing repeats
            continue
        # Shared prompts checked on their own layout: with packing, a call may take either.
        checked = dataclasses.replace(candidate, pack=False) if name == "--share-prompts" else candidate
        why = gap(model, sequences, checked, reference)
        if why is None:
            plan = candidate
        else:
            warnings.append(f"{name} off for this run ({flag}): {why}")
    return plan, warnings


CHECK_ROWS = 8  # rows a first-batch check compares on: enough for every layout's ways to go wrong


def rows_to_check(sequences: Sequences, most: int = CHECK_ROWS) -> torch.Tensor:
    """(R,) sorted indices of at most ``most`` rows of a batch that exercise what the check compares:
    the longest row and the shortest (the widest and narrowest padding, rows of unlike lengths to
    pack), each with the other rows of its prompt (a prompt shared, two prompts where they differ),
    then rows in order.  A wrong mask, position or logit scale shows on any row; the own padded
    pass runs a row at a time, so a whole batch checked costs more than the iteration's other
    passes (the agents benchmark's 32 episodes on SmolLM2: the first iteration's passes took
    150.7 s, the next iteration's 13.1 s)."""
    rows = len(sequences.prompt_ids)
    device = sequences.prompt_ids.device
    if rows <= most:
        return torch.arange(rows, device=device)
    by_length = torch.argsort(sequences.attention_mask.sum(dim=1), stable=True).tolist()
    _, prompt_of_row = distinct_prompts(sequences)
    prompt_of_row = prompt_of_row.tolist()
    picked: list[int] = []
    for end in (by_length[-1], by_length[0]):
        group = [end] + [row for row in range(rows) if prompt_of_row[row] == prompt_of_row[end] and row != end]
        picked += [row for row in group[:most // 2] if row not in picked]
    picked += [row for row in range(rows) if row not in picked][:most - len(picked)]
    return torch.tensor(sorted(picked[:most]), device=device)


def own_logprobs(model, sequences: Sequences, own: PassPlan) -> torch.Tensor:
    """(B, T) log-probs from the model's own padded pass, a row at a time: with long responses and
    a large vocabulary, the micro-batch's (B, T, V) logits at once are what the fused output layer
    exists to avoid (4 rows of 4,096 tokens of a 152k vocabulary: 10 GB in bf16)."""
    rows = torch.arange(len(sequences.prompt_ids), device=sequences.prompt_ids.device)
    with torch.no_grad():
        return torch.cat([response_stats(model, sequences.select(rows[row:row + 1]), own).logprobs
                          for row in range(len(rows))])


def repeated_prompts(sequences: Sequences) -> bool:
    first_rows, prompt_of_row = distinct_prompts(sequences)
    return len(first_rows) < len(prompt_of_row)

