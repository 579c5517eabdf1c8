"""Stages 3-4 of a PPO iteration, the rollout passes (docs/design.md, "One PPO iteration"): the
actor's old log-probs and the critic's values of what was generated (eval mode, as it was
sampled), the reference's log-probs and the per-token KL, and a teacher's log-probs when
distilling -- on this process's rows, in micro-batches, by the pass plan checked on the first
batch (rollout/passes.py: packing, shared prompts, the fused output layer).  :class:`ForwardPasses`
is the part of PPOTrainer these are; a new role's pass, or a new way to run one, enters here."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ppo_rlhf.core import keep_masked, kl_penalty
from ppo_rlhf.distributed import gather_rows, max_across_processes
from ppo_rlhf.models.lora import active_adapter, adapters_disabled
from ppo_rlhf.models.value import Critic
from ppo_rlhf.rollout.logprobs import distinct_prompts
from ppo_rlhf.rollout.passes import PassPlan, ResponseStats, checked_plan, full_kl_between, response_stats
from ppo_rlhf.rollout.sequences import Sequences
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.teacher import TEACHER


def prompt_sharing_possible(config: PPOConfig, sharding) -> bool:
    """Whether forward passes may run each distinct prompt once (docs/design.md, "Shared prompts"):
    asked for, prompts that repeat, and neither of the two things a cache cannot go through --
    FSDP (each model call gathers the layers: every process must make the same calls) and
    gradient checkpointing (its recomputation would append the keys to the cache a second time)."""
    return config.share_prompts and config.samples_per_prompt > 1 and sharding is None and not config.gradient_checkpointing


def old_logprobs_from_update(config: PPOConfig, critic: Critic | None, sampler_logprobs: bool = False) -> bool:
    """Whether the old log-probs can be read off the update's own forward pass instead of a pass
    of their own (docs/design.md, "Old log-probs from the update"): exact when the batch gets one
    optimizer step (the update's forward then runs the weights that sampled it), no dropout
    differs between that forward and the rollout's, and nothing computed before the update needs
    them -- no critic (GAE's values come from the same pass), no KL in the reward, and no teacher
    unless ``sampler_logprobs``: a teacher's reward is the policy's log-probs less the teacher's,
    and the built-in loop keeps the ones it sampled with (rollout/generation.py), the same
    numbers to round-off, so that reward needs no pass of its own either."""
    one_step = config.ppo_epochs == 1 and config.mini_batch_size == config.batch_size
    no_dropout = config.disable_dropout and not (config.lora and config.lora_dropout > 0)
    kl_free_reward = config.kl_in == "loss" or (config.kl_coef == 0 and config.target_kl is None)
    return one_step and no_dropout and kl_free_reward and critic is None and (config.teacher is None or sampler_logprobs)


def token_micro_batches(lengths: torch.Tensor, max_tokens: int | None, max_rows: int | None = None,
                        prompts: torch.Tensor | None = None, prompt_tokens: int = 0) -> list[list[int]]:
    """Row indices 0..B-1 in micro-batches: without a token budget, consecutive groups of
    ``max_rows`` (None: one group of all); with one (--max-tokens-per-micro-batch), rows longest
    first, each into the first group whose ``lengths`` (B,) still fit ``max_tokens`` (a longer row
    alone) and that holds fewer than ``max_rows`` rows -- uneven rows then share a pass by their
    tokens, not by their count (docs/design.md, "Long responses").

    ``prompts`` (B,): each row's prompt, where a pass runs each distinct prompt once (shared
    prompts): a row then counts its ``lengths`` (its response) and, if its prompt is not in the
    group yet, ``prompt_tokens``; rows go prompt by prompt, the largest first, so that a prompt's
    rows share its passes."""
    rows = len(lengths)
    if max_tokens is None:
        return [list(range(start, min(start + (max_rows or rows), rows))) for start in range(0, rows, max_rows or rows)]
    lengths = lengths.tolist()  # one device sync, not one a row
    prompt_of = [None] * rows if prompts is None else prompts.tolist()
    size: dict = {}  # each prompt's tokens: itself once and its rows
    for row in range(rows):
        size[prompt_of[row]] = size.get(prompt_of[row], prompt_tokens) + lengths[row]
    order = sorted(range(rows), key=lambda r: (-size[prompt_of[r]], prompt_of[r] or 0, -lengths[r]))
    groups: list[list[int]] = []
    room: list[int] = []
    held: list[set] = []  # the prompts each group runs already
    for row in order:
        def cost(group: int | None) -> int:
            shared = prompts is not None and group is not None and prompt_of[row] in held[group]
            return lengths[row] + (0 if shared or prompts is None else prompt_tokens)
        target = next((g for g, left in enumerate(room) if left >= cost(g) and len(groups[g]) < (max_rows or rows)),
                      None)
        if target is None:
            groups.append([])
            room.append(max_tokens)
            held.append(set())
            target = len(groups) - 1
        room[target] -= cost(target)
        groups[target].append(row)
        held[target].add(prompt_of[row])
    return [sorted(group) for group in groups]


def under_autocast(method):
    """Run a PPOTrainer method under the trainer's autocast (``--mixed-precision``; none by default)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.accelerator.autocast():
            return method(self, *args, **kwargs)

    return run


class ForwardPasses:
    """Stages 3-4 of PPOTrainer (module docstring)."""

    def policy_and_values(self, sequences: Sequences) -> tuple[ResponseStats, torch.Tensor | None]:
        """The actor's log-probs of the response tokens (and what the full KL needs) and the critic's
        values (B, T) (None without one)."""
        stats = response_stats(self.actor, sequences, self.checked_pass_plan(sequences))
        values = None if self.critic is None else self.critic.values(sequences, stats.hidden)
        return stats, values

    @under_autocast
    def reference_stats(self, sequences: Sequences) -> ResponseStats:
        """The reference's log-probs of the response tokens (rollout/passes.py)."""
        plan = self.checked_pass_plan(sequences)
        if self.ref is None:  # LoRA on one base: the reference is the base itself
            with adapters_disabled(self.actor):
                return response_stats(self.actor, sequences, plan)
        return response_stats(self.ref, sequences, plan)

    @under_autocast
    def teacher_stats(self, sequences: Sequences) -> ResponseStats:
        """The teacher's log-probs of the response tokens, at the policy's temperature as the
        reference's are (docs/design.md, "On-policy distillation"): an adapter on the actor's base
        runs on the actor's checked plan, a model of its own on a plan checked on it."""
        if self.teacher.model is None:  # LoRA: the teacher adapter on the shared base
            with active_adapter(self.actor, TEACHER):
                stats = response_stats(self.actor, sequences, self.checked_pass_plan(sequences))
                if self.config.teacher_in == "loss" and stats.head is not None and hasattr(stats.head.layer, "lora_A"):
                    # An output layer that carries the adapters reads the active one: the teacher's
                    # logits are made now (--teacher-in loss reads them after the switch back).
                    stats.logits = stats.head.logits(stats.hidden)
                return stats
        if self._teacher_plan is None:  # another model than the actor: the faster passes checked on it
            with torch.no_grad():
                self._teacher_plan, warnings = checked_plan(self.teacher.model, sequences, self.wanted_pass_plan)
            if self.rank == 0:
                for warning in warnings:
                    tqdm.write(f"warning: the teacher's passes: {warning}")
        return response_stats(self.teacher.model, sequences, self._teacher_plan)

    def old_and_reference_passes(self, sequences: Sequences) -> tuple:
        """Stages 3-4 on this process's rows, --rollout-micro-batch-size rows at a time (only that
        many rows' (rows, T, V) logits are ever held): (logprobs, ref_logprobs, kl, values or None), (b, T).
        With the old log-probs taken from the update (``old_logprobs_from_update``) only the
        reference runs here, and logprobs and kl are zeros the update fills in."""
        self.actor.eval()
        if self.critic is not None:
            self.critic.eval()
        if self._pass_plan is None and len(sequences.response_ids):
            # checked on a padded pass's share of the budget, then cut by the plan
            self.checked_pass_plan(sequences.select(self.micro_batches(sequences)[0]))
        passes = self.rollout_passes(sequences, self.old_and_reference)
        if passes is None:  # dynamic sampling kept none of this process's groups
            empty = torch.zeros_like(sequences.response_ids, dtype=torch.float32)
            return empty, empty, empty, None if self.critic is None else empty
        return passes

    def teacher_passes(self, sequences: Sequences) -> torch.Tensor:
        """(b, T) the teacher's log-probs of this process's rows, in the rollout's micro-batches."""
        if self.teacher.model is None:
            self.actor.eval()  # the adapter runs on the actor's base: no dropout, as the old pass
        logprobs = self.rollout_passes(sequences, lambda part: self.teacher_stats(part).logprobs)
        return torch.zeros_like(sequences.response_ids, dtype=torch.float32) if logprobs is None else logprobs

    def micro_batches(self, sequences: Sequences) -> list[torch.Tensor]:
        """The row indices of each of the rollout passes' micro-batches (--rollout-micro-batch-size,
        --max-tokens-per-micro-batch)."""
        rows = torch.arange(len(sequences.response_ids), device=self.device)
        return [rows[group] for group in self.cut(sequences, rows, self.config.rollout_micro_batch_size)]

    def cut(self, sequences: Sequences, rows: torch.Tensor, max_rows: int | None,
            decided_on: torch.Tensor | None = None) -> list[list[int]]:
        """Positions in ``rows`` (indices of ``sequences``' rows) cut into micro-batches of at most
        ``max_rows`` rows and of --max-tokens-per-micro-batch's tokens: the number given, or auto's
        (trainers/token_budget.py) for the rows ``decided_on`` (default: ``rows``; the update gives
        the whole minibatch, so that every process decides alike).  A row counts the positions its
        pass runs (``pass_lengths``); where passes run each distinct prompt once, its response and,
        once a micro-batch, its prompt (each at the batch's width, as that pass runs them)."""
        plan = self._pass_plan or self.wanted_pass_plan
        decided_on = rows if decided_on is None else decided_on
        if plan.share_prompts and len(rows) > 1:
            _, prompt_of_row = distinct_prompts(sequences)
            prompt, response = sequences.prompt_length, sequences.response_ids.shape[1]
            tokens = len(decided_on) * response + len(torch.unique(prompt_of_row[decided_on])) * prompt
            budget = self.token_budget.for_rows(tokens, prompt + response, plan.fused)
            return token_micro_batches(torch.full((len(rows),), response), budget, max_rows, prompt_of_row[rows],
                                       prompt)
        lengths = self.pass_lengths(sequences)
        decided = lengths[decided_on]
        budget = self.token_budget.for_rows(int(decided.sum()), int(decided.max()), plan.fused) if len(decided) \
            else self.token_budget.given
        return token_micro_batches(lengths[rows], budget, max_rows)

    def rollout_passes(self, sequences: Sequences, one_pass: Callable[[Sequences], torch.Tensor | tuple]):
        """``one_pass`` on each micro-batch of this process's rows (it returns a (b, T) tensor, or a
        tuple of them and Nones), the micro-batches' results joined back in row order (a token
        budget groups rows by length); None for no rows (dynamic sampling kept none here).

        Sharded (FSDP): each pass of a sharded model gathers its layers, a collective, so every
        process runs as many passes as the one that runs the most (dynamic sampling keeps different
        numbers of rows in each, a token budget groups them by each one's width); the extra ones on
        a throwaway row, their results dropped (docs/design.md, "Collectives of a rollout")."""
        rows = len(sequences.response_ids)
        passes = self.micro_batches(sequences) if rows else []
        extra = 0 if self.sharding is None else max_across_processes(len(passes)) - len(passes)  # agreed first
        parts = [one_pass(sequences.select(index)) for index in passes]
        if extra:
            throwaway = sequences.select(passes[0][:1]) if rows else Sequences.placeholder(
                self.tokenizer.pad_token_id, self.device)
            for _ in range(extra):
                one_pass(throwaway)
        if not rows:
            return None
        order = torch.argsort(torch.cat(passes))
        if not isinstance(parts[0], tuple):
            return torch.cat(parts)[order]
        return tuple(None if parts[0][i] is None else torch.cat([part[i] for part in parts])[order]
                     for i in range(len(parts[0])))

    def checked_pass_plan(self, sequences: Sequences) -> PassPlan:
        """How the forward passes run, checked once, on the first batch a pass sees: the faster ways
        (rollout/passes.py) that give the actor's own padded log-probs; a model where one does not
        trains without it, and the run says so."""
        if self._pass_plan is None:
            with torch.no_grad(), self.accelerator.autocast():
                self._pass_plan, warnings = checked_plan(self.actor, sequences, self.wanted_pass_plan)
            if self.rank == 0:
                for warning in warnings:
                    tqdm.write(f"warning: {warning}")
        return self._pass_plan

    def pass_lengths(self, sequences: Sequences) -> torch.Tensor:
        """(B,) the positions each row takes in a pass, for --max-tokens-per-micro-batch: its own
        tokens where the passes are packed, the batch's whole width where they run padded (under
        FSDP, --no-padding-free, or before the plan is checked)."""
        if self._pass_plan is not None and self._pass_plan.pack:
            return sequences.attention_mask.sum(dim=1)
        width = sequences.attention_mask.shape[1]
        return torch.full((sequences.attention_mask.shape[0],), width, device=sequences.attention_mask.device)

    @property
    def pass_plan(self) -> PassPlan | None:
        """The checked plan (None before the first pass)."""
        return self._pass_plan

    def old_and_reference(self, sequences: Sequences) -> tuple:
        """(logprobs, ref_logprobs, kl, values or None), each (b, T), of a micro-batch of rows."""
        if self.old_logprobs_from_update:  # filled in by the update's forward pass (actor_loss)
            ref_logprobs = self.reference_stats(sequences).logprobs
            return torch.zeros_like(ref_logprobs), ref_logprobs, torch.zeros_like(ref_logprobs), None
        stats, values = self.policy_and_values(sequences)
        ref_stats = self.reference_stats(sequences)
        estimator = self.config.kl_estimator_used
        kl = (full_kl_between(stats, ref_stats, sequences.loss_mask) if estimator == "full"
              else kl_penalty(stats.logprobs, ref_stats.logprobs, estimator))
        return stats.logprobs, ref_stats.logprobs, keep_masked(kl, sequences.loss_mask), values

    def gather_sequences(self, sequences: Sequences) -> Sequences:
        """Every process's sequences, padded as one process pads the whole batch (prompts on the left)."""
        pad = self.tokenizer.pad_token_id
        return Sequences(gather_rows(sequences.prompt_ids, pad, left=True), gather_rows(sequences.prompt_mask, left=True),
                         gather_rows(sequences.response_ids, pad), gather_rows(sequences.response_mask),
                         sequences.separate_loss_mask(gather_rows))
