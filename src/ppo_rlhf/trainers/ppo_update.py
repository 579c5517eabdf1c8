"""Stage 7 of a PPO iteration, the update (docs/design.md, "One PPO iteration"):
--ppo-epochs passes of minibatch steps on the clipped losses -- the policy's (PPO's clipped ratio,
or CISPO, SAPO, each token weighted by --is-correction), the entropy bonus, the KL in the loss
(--kl-in loss) and the critic's clipped value loss -- each process computing its 1/N share of a
minibatch in micro-batches (gradient accumulation), the gradients summed over the processes before
the clip.  :class:`PolicyUpdate` is the part of PPOTrainer these are; a new loss term or policy
loss enters here (its formula in core/)."""

from __future__ import annotations

import torch

from ppo_rlhf.core import (aggregate_loss, cispo_loss, engine_importance_weights, keep_masked, kl_penalty,
                           masked_mean, policy_loss, sapo_loss, value_loss)
from ppo_rlhf.distributed import sum_across_processes, sum_gradients
from ppo_rlhf.rollout.passes import ResponseStats, full_kl_between, response_stats
from ppo_rlhf.sharding import plain
from ppo_rlhf.trainers.ppo_batch import Experience


def split_by_tokens(index: torch.Tensor, lengths: torch.Tensor, processes: int) -> list[torch.Tensor]:
    """A minibatch's rows ``index`` split over the processes with about equal tokens each: longest
    first, each to the process holding the fewest so far (every process computes the same split).
    One process: all of them, in order."""
    if processes == 1:
        return [index]
    shares: list[list[int]] = [[] for _ in range(processes)]
    tokens = [0] * processes
    row_lengths = lengths[index].tolist()
    for position in sorted(range(len(index)), key=lambda i: -row_lengths[i]):
        process = min(range(processes), key=lambda p: (tokens[p], p))
        shares[process].append(position)
        tokens[process] += row_lengths[position]
    return [index[sorted(share)] for share in shares]


class PolicyUpdate:
    """Stage 7 of PPOTrainer (module docstring)."""

    def update(self, experience: Experience) -> dict[str, float]:
        """ppo_epochs passes of clipped-loss minibatch steps over the whole batch.

        With N processes every one holds the whole batch (make_experience) and draws the same
        minibatches; each computes its 1/N slice of a minibatch, its losses scaled by its share of
        the minibatch, and the gradients are summed over the processes before the clip: the step
        one process would take on the whole minibatch (docs/design.md, "Scale")."""
        config = self.config
        # During critic warm-up the policy loss is left out and the actor gets no gradient.
        warming_up = self.iteration < config.critic_warmup
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        totals: dict[str, float] = {}
        n_steps = 0
        batch_size = experience.scores.shape[0]
        # Minibatches from the trainer's own generator, which every process holds alike (the
        # global RNG differs between processes: each samples its own rollouts).
        minibatches = [mb for _ in range(config.ppo_epochs)
                       for mb in torch.randperm(batch_size, generator=self.minibatch_rng).split(config.mini_batch_size)]
        for position, mb_index in enumerate(minibatches):
            mb_index = mb_index.to(self.device)
            step_stats = self.accumulate_gradients(experience, mb_index, warming_up)
            if step_stats is not None and position > 0 and not warming_up:
                self.adapt_lr(step_stats["approx_kl"])
            if step_stats is None or self.moved_too_far(step_stats["approx_kl"], warming_up):
                self.optimizer.zero_grad(set_to_none=True)
                break  # the policy has moved far enough from the one that collected the batch
            sum_gradients(self.trainable_parameters)
            grad_norm = plain(self.accelerator.clip_grad_norm_(self.trainable_parameters, config.max_grad_norm))
            loss = sum(step_stats[key] for key in ("pg_loss", "vf_loss", "kl_loss", "teacher_loss", "entropy")
                       if key in step_stats)
            if not self.guard.step(self.optimizer, self.iteration + 1, self.accelerator, loss=loss, grad_norm=grad_norm):
                continue  # skipped: its statistics are not the update's
            # Statistics averaged over every minibatch of the update, not just the last one.
            step_stats["grad_norm"] = grad_norm
            for key, value in step_stats.items():
                totals[key] = totals.get(key, 0.0) + float(value)
            n_steps += 1
        if self.old_logprobs_from_update and self.processes > 1:  # each process filled its slice's rows
            experience.logprobs = sum_across_processes(experience.logprobs)
            experience.kl = sum_across_processes(experience.kl)
        stats = {key: value / max(n_steps, 1) for key, value in totals.items()}
        stats["update_steps"] = n_steps
        if self.lr_control is not None:
            stats["lr"] = self.lr_control.lr
        stats["skipped_steps"] = self.guard.skipped
        return stats

    def accumulate_gradients(self, experience: Experience, mb_index: torch.Tensor, warming_up: bool
                             ) -> dict[str, torch.Tensor] | None:
        """Gradients of one minibatch's losses, left in ``.grad``; returns its statistics.

        This process computes its 1/N slice of the minibatch, --train-micro-batch-size rows at a
        time (gradient accumulation).  Each micro-batch's losses are scaled by its share of what
        the minibatch's loss averages over -- response tokens for token means, responses for the
        per-response aggregations -- so the accumulated (and, over processes, summed) gradient is
        the whole minibatch's, and so are the statistics (1 and 1 for the whole minibatch at once).

        None: --max-approx-kl stops the update at this minibatch, known from its forward pass when
        each process computes its slice in one micro-batch, so no backward pass is spent on it
        (with several micro-batches the update checks the accumulated approx_kl instead)."""
        config = self.config
        self.optimizer.zero_grad(set_to_none=True)
        mb_tokens = experience.mask[mb_index].sum().item()
        mine, parts = self.update_micro_batches(experience, mb_index)
        totals: dict[str, torch.Tensor] = {}
        for part_index in parts:
            mb = experience.select(mine[part_index])
            token_share = mb.mask.sum().item() / max(mb_tokens, 1)
            row_share = len(part_index) / len(mb_index)
            policy_share = token_share if config.loss_aggregation == "token-mean" else row_share
            # Without an entropy bonus the entropy is only a statistic: no graph (it would hold
            # several (B, T, V) tensors for the backward pass).
            entropy_grad = self.entropy_coef() != 0 and not warming_up
            with torch.set_grad_enabled(not warming_up), self.accelerator.autocast():
                response = response_stats(self.actor, mb.sequences, self.checked_pass_plan(mb.sequences),
                                          entropy=True, entropy_grad=entropy_grad)
            actor_loss, stats = self.actor_loss(mb, response, token_share, policy_share, warming_up)
            if self.old_logprobs_from_update:  # the old log-probs this forward gave, kept for the metrics
                experience.logprobs[mine[part_index]] = mb.logprobs
                experience.kl[mine[part_index]] = mb.kl
            if len(parts) == 1 and config.max_approx_kl is not None:
                approx_kl = self.sum_shares({"approx_kl": stats["approx_kl"] * token_share})["approx_kl"]
                if self.moved_too_far(approx_kl, warming_up):
                    return None
            stats.update(self.backward(mb, response.hidden, actor_loss, token_share))
            shares = {"pg_loss": policy_share, "kl_loss": policy_share, "teacher_loss": policy_share}
            for key, value in stats.items():
                weighted = value * shares.get(key, token_share)
                totals[key] = weighted if key not in totals else totals[key] + weighted
        return self.sum_shares(totals)

    def update_micro_batches(self, experience: Experience, mb_index: torch.Tensor
                             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This process's rows of the minibatch ``mb_index`` and its micro-batches (positions in
        them): the minibatch split over the processes by the positions each row takes in a pass,
        then cut by --max-tokens-per-micro-batch and --train-micro-batch-size.  Under FSDP a pass
        is padded, every row counts the batch's whole width, so every process gets as many rows
        and micro-batches, each a collective (docs/design.md, "Collectives of a rollout")."""
        sequences = experience.sequences
        mine = split_by_tokens(mb_index, self.pass_lengths(sequences), self.processes)[self.rank]
        groups = self.cut(sequences, mine, self.config.train_micro_batch_size, decided_on=mb_index)
        return mine, [torch.tensor(group, dtype=torch.long, device=self.device) for group in groups]

    def actor_loss(self, mb: Experience, response: ResponseStats, token_share: float, policy_share: float,
                   warming_up: bool) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Stage 7's policy side on one micro-batch: the clipped policy loss, the entropy term and,
        with --kl-in loss, the KL term, each scaled by its share of the minibatch; None while the
        critic warms up.  Returns the loss and the (unscaled) statistics."""
        config = self.config
        logprobs = response.logprobs
        if self.old_logprobs_from_update:  # the weights that sampled the batch: the ratio is exactly 1
            mb.logprobs = logprobs.detach()
        pg_loss, stats = self.policy_gradient_loss(logprobs, mb, self.is_weights(mb))
        entropy_coef = self.entropy_coef()
        entropy = masked_mean(response.entropy, mb.mask)
        stats["entropy"] = entropy.detach()
        if warming_up:
            return None, stats
        loss = policy_share * pg_loss - entropy_coef * token_share * entropy
        per_token_kl = None
        if config.kl_in == "loss":
            kl_loss, per_token_kl = self.kl_loss(response, mb)
            stats["kl_loss"] = kl_loss.detach()
            loss = loss + self.kl_controller.value * policy_share * kl_loss
        if self.teacher is not None and config.teacher_in == "loss":
            teacher_loss = self.teacher_loss(response, mb)
            stats["teacher_loss"] = teacher_loss.detach()
            loss = loss + config.teacher_coef * policy_share * teacher_loss
        if self.old_logprobs_from_update:  # the rollout's KL, as old_and_reference would have logged it
            if per_token_kl is None:
                per_token_kl = kl_penalty(mb.logprobs, mb.ref_logprobs, config.kl_estimator_used)
            mb.kl = keep_masked(per_token_kl.detach(), mb.mask)
        return loss, stats

    def policy_gradient_loss(self, logprobs: torch.Tensor, mb: Experience, weights: torch.Tensor | None
                             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """--policy-loss on one micro-batch: PPO's clipped ratio (and its variants), CISPO or SAPO, each
        token's term times its importance weight (core/losses.py)."""
        config = self.config
        common = dict(aggregation=config.loss_aggregation, norm_length=config.max_new_tokens, token_weights=weights)
        if config.policy_loss == "cispo":
            return cispo_loss(logprobs, mb.logprobs, mb.advantages, mb.mask, config.clip_ratio_low, config.clip_high,
                              **common)
        if config.policy_loss == "sapo":
            return sapo_loss(logprobs, mb.logprobs, mb.advantages, mb.mask, config.sapo_tau_pos, config.sapo_tau_neg,
                             **common)
        return policy_loss(logprobs, mb.logprobs, mb.advantages, mb.mask, config.clip_low,
                           clip_ratio_high=config.clip_high, dual_clip=config.dual_clip, ratio_level=config.ratio_level,
                           **common)

    def kl_loss(self, stats: ResponseStats, mb: Experience) -> tuple[torch.Tensor, torch.Tensor]:
        """kl_in: loss.  The per-token KL estimate of the *current* policy against the reference,
        aggregated as the policy loss is and differentiated directly (core/kl.py says why k1 is
        not allowed here); returns the loss and the (B, T) per-token estimate."""
        estimator = self.config.kl_estimator_used
        if estimator == "full":
            with torch.no_grad():  # the reference's full distribution, for this minibatch only
                ref_stats = self.reference_stats(mb.sequences)
            per_token = full_kl_between(stats, ref_stats, mb.mask)
        else:
            per_token = kl_penalty(stats.logprobs, mb.ref_logprobs, estimator)
        return aggregate_loss(per_token, mb.mask, self.config.loss_aggregation, self.config.max_new_tokens), per_token

    def teacher_loss(self, stats: ResponseStats, mb: Experience) -> torch.Tensor:
        """--teacher-in loss: the exact reverse KL(policy || teacher) over the vocabulary at each
        response position of the minibatch (the teacher's pass run here, without a gradient),
        aggregated as the policy loss is and differentiated directly (docs/design.md, "On-policy
        distillation")."""
        with torch.no_grad():
            teacher_stats = self.teacher_stats(mb.sequences)
        per_token = full_kl_between(stats, teacher_stats, mb.mask)
        return aggregate_loss(per_token, mb.mask, self.config.loss_aggregation, self.config.max_new_tokens)

    def is_weights(self, mb: Experience) -> torch.Tensor | None:
        """--is-correction: the importance weights of the engine's samples, from pi_old / pi_engine per
        token (core/offpolicy.py; docs/design.md, "Off-policy corrections"); None without engine
        log-probs (the torch engine is the trainer's own forward) or with --is-correction none."""
        if mb.engine_logprobs is None:
            return None
        config = self.config
        return engine_importance_weights(mb.logprobs, mb.engine_logprobs, mb.mask, config.is_correction, config.is_cap,
                                         config.is_floor)

    def backward(self, mb: Experience, actor_hidden: torch.Tensor, actor_loss: torch.Tensor | None,
                 token_share: float) -> dict[str, torch.Tensor]:
        """Stage 7's backward passes on one micro-batch: the actor's loss, and the critic's value
        loss where there is a critic; returns the value loss's statistics."""
        config = self.config
        if self.critic is None:  # a critic-free estimator: the policy's loss alone
            self.accelerator.backward(actor_loss)
            return {}
        if self.critic.reads_actor_trunk:
            # The critic reads the actor's forward pass: one graph, one backward pass.
            vf_loss, vf_stats = value_loss(self.critic.values(mb.sequences, actor_hidden), mb.values, mb.returns,
                                           mb.mask, config.cliprange_value)
            loss = config.vf_coef * token_share * vf_loss
            self.accelerator.backward(loss if actor_loss is None else actor_loss + loss)
            return vf_stats
        # A critic with a forward pass of its own shares no graph with the actor: the actor's
        # backward pass runs first and frees its graph before the critic's is built (same
        # gradients as one backward of the sum, half the activation memory).
        if actor_loss is not None:
            self.accelerator.backward(actor_loss)
        # The critic's scope spans its backward pass too: gradient checkpointing recomputes
        # activations there, and a critic adapter must be the active one when it does.
        with self.critic.scope():
            with self.accelerator.autocast():
                values = self.critic.values(mb.sequences)
            vf_loss, vf_stats = value_loss(values, mb.values, mb.returns, mb.mask, config.cliprange_value)
            self.accelerator.backward(config.vf_coef * token_share * vf_loss)
        return vf_stats

    def entropy_coef(self) -> float:
        """This iteration's entropy coefficient: --entropy-coef, ramped in over --entropy-warmup iterations."""
        warmup = self.config.entropy_warmup
        return self.config.entropy_coef * (min(1.0, (self.iteration + 1) / warmup) if warmup else 1.0)

    def adapt_lr(self, approx_kl: torch.Tensor) -> None:
        """--lr-target-kl: the actor's lr for this step and after, from how far the steps before it
        moved the policy (this minibatch's approx_kl, measured before its step; the first step of
        an update is not measured: its policy is the one that sampled the batch)."""
        if self.lr_control is not None:
            self.optimizer.param_groups[0]["lr"] = self.lr_control.update(float(approx_kl))

    def moved_too_far(self, approx_kl: torch.Tensor, warming_up: bool) -> bool:
        """--max-approx-kl: the update stops once a minibatch's approx_kl passes it."""
        return self.config.max_approx_kl is not None and not warming_up and approx_kl > self.config.max_approx_kl

    def sum_shares(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Scalar statistics summed over the processes, in one all-reduce (one process: as given)."""
        if self.processes == 1:
            return stats
        total = sum_across_processes(torch.stack([v.detach().float().reshape(()) for v in stats.values()]))
        return dict(zip(stats, total))
