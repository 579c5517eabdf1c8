"""PPO for language models: one iteration in numbered stages (docs/design.md, "One PPO iteration").

    1. rollout     the actor generates responses (eval mode, same temperature as the log-probs)
    2. score       the reward model / function scores each finished response
                   -- trainers/ppo_rollout.py
    3. old pass    actor (and critic) log-probs and values of what was generated, eval mode
    4. ref pass    the frozen reference's log-probs (and the teacher's, distilling: --teacher)
                   -- trainers/ppo_passes.py
    5. rewards     r[t] = -kl_coef * kl[t], plus the score on the last response token (distilling:
                   -teacher_coef * (log pi - log teacher) per token, or summed into the score)
    6. advantages  GAE over the response tokens, returns = A + V_old, whitened A; or, with a
                   critic-free estimator (trainers/estimators.py), the reward-to-go of the
                   rewards with the score less its baseline; 0 for a response with no score
                   -- trainers/ppo_advantages.py
    7. update      ppo_epochs passes of minibatch steps on the clipped losses
                   -- trainers/ppo_update.py
    8. log         the metrics of docs/design.md ("Metrics"), timings and throughput
                   -- trainers/ppo_metrics.py

:class:`PPOTrainer` holds the four roles -- actor, critic, ref, reward -- and composes the stages:
:meth:`PPOTrainer.step` is one iteration, stage by stage, and each stage's methods live in the
module named beside it (what the stages hand each other: trainers/ppo_batch.py).  The whole run --
iterations, held-out evaluation, checkpoints, resume -- is trainers/ppo_loop.py; what a config
builds, trainers/ppo_setup.py.  Nothing here is task-specific: the task (or the user) supplies
prompts, a reward and an optional metric.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ppo_rlhf.config import ConfigError, checked_config
from ppo_rlhf.core import AdaptiveKLController, FixedKLController, KLAdaptiveLR
from ppo_rlhf.core.normalize import RunningMoments
from ppo_rlhf.data import DataError, environment_prompt, prompt_check, row_complaint
from ppo_rlhf.distributed import gather_rows, max_across_processes, rank, world_size
from ppo_rlhf.envs.chat import prepare_episode_chat, template_name
from ppo_rlhf.envs.options import check_template_file_used
from ppo_rlhf.hardware import train_in_float32
from ppo_rlhf.models import load_tokenizer
from ppo_rlhf.models.value import Critic, SharedHeadCritic
from ppo_rlhf.rollout.episodes import EpisodeLimits, samples_of
from ppo_rlhf.rollout.generation import Generator
from ppo_rlhf.rollout.passes import PassPlan
from ppo_rlhf.sharding import load_whole_optimizer_state, shard, sharding_from_launch, whole_optimizer_state
from ppo_rlhf.trainers.estimators import needs_greedy_baseline, uses_critic
from ppo_rlhf.trainers.guard import DivergenceGuard, is_finite
from ppo_rlhf.trainers.optimizer import adamw
from ppo_rlhf.trainers.ppo_async import Generated
from ppo_rlhf.trainers.ppo_advantages import AdvantageStage
from ppo_rlhf.trainers.ppo_batch import Experience, Rollout  # noqa: F401 -- Rollout: where callers find it
from ppo_rlhf.trainers.ppo_config import PPOConfig, default_lr
from ppo_rlhf.trainers.ppo_loop import PPOLoop
from ppo_rlhf.trainers.ppo_metrics import IterationMetrics
from ppo_rlhf.trainers.ppo_passes import (ForwardPasses, old_logprobs_from_update,  # noqa: F401 -- the
                                          prompt_sharing_possible, token_micro_batches,  # helpers, where callers
                                          under_autocast)  # find them
from ppo_rlhf.trainers.ppo_rollout import RolloutStage, environments_of
from ppo_rlhf.trainers.ppo_setup import RunParts, build_run, complete_parts, record_given_episodes
from ppo_rlhf.trainers.ppo_update import PolicyUpdate
from ppo_rlhf.trainers.teacher import Teacher
from ppo_rlhf.trainers.token_budget import run_budget

SAMPLES_KEPT = 4  # training rollouts kept from each iteration for the console, samples.jsonl and TensorBoard


def disable_dropout(model: torch.nn.Module, keep_lora_dropout: bool = False) -> None:
    """Dropout off everywhere: in modules and in attention kernels that read a float attribute.
    ``keep_lora_dropout``: leave peft's dropout on the LoRA path, which --lora-dropout asked for."""
    for name, module in model.named_modules():
        if keep_lora_dropout and "lora_dropout" in name.split("."):
            continue
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def check_step_rows(rows, prompt_field: str, check_prompt) -> None:
    """DataError naming the first row given to ``step()`` that is not a prompt row: a dict whose
    prompt field holds a prompt (as a data file's rows are checked; data.py)."""
    if not isinstance(rows, (list, tuple)) or not rows:
        raise DataError(f"step(): rows must be a non-empty list of prompt rows, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"step(): row {i} must be a prompt row, a dict holding '{prompt_field}', got "
                            f"{type(row).__name__} {str(row)[:40]!r}")
        complaint = row_complaint(row, {prompt_field: check_prompt})
        if complaint:
            raise DataError(f"step(): row {i} {complaint}")


class PPOTrainer(RolloutStage, ForwardPasses, AdvantageStage, PolicyUpdate, IterationMetrics, PPOLoop):
    """Actor, critic, reference and reward, and the PPO iteration that ties them together;
    :meth:`train` runs a whole run into ``config.out`` (trainers/ppo_loop.py), :meth:`step` one
    iteration.

    Args:
        config: PPOConfig.  Whatever is not given below is built from it (trainers/ppo_setup.py):
            with no ``model``, the whole run as the command line builds it -- seeded, data
            checked, the four roles loaded (trainers/roles.py) -- so ``PPOTrainer(config).train()``
            is ``ppo-rlhf ppo``.
        reward: None (the config's rewards, or the task's rule); a Python function
            ``f(prompts, responses, **columns)``; a ``module:function`` string or a reward-model
            folder; a sequence classifier; a :class:`ScoringReward` (the reward classes of
            rollout/reward.py, or your own: used as it is); or a list of these, summed with
            ``config.reward_weights`` (trainers/roles.py, ``as_reward``).  A CombinedReward's
            ``last_components`` give the ``reward/<name>`` metrics.
        model: the causal LM being tuned (initialised from the SFT model), in memory, or a peft
            model whose active adapter is the policy (LoRA on one base, see models/lora.py).
        ref: a frozen copy of the SFT model; default: a copy of ``model`` (a peft model: its base
            with adapters disabled).
        tokenizer: the actor's tokenizer; default: ``config.model``'s.
        critic: a Critic (models/value.py: a value head on the actor's trunk, a model of its own,
            or an adapter on a LoRA base); None: a fresh value head on the actor's trunk for
            estimator gae, no critic at all for every other estimator.
        generator: the rollout engine; default: a TorchGenerator as the config asks.
        accelerator: the device and autocast (hardware.py); default: the ones ``config`` asks for.
            Every role is moved to its device; the trained weights (actor, critic) are upcast to
            float32, the frozen ones (reference, reward, a LoRA base) stay as loaded.
        environment: play each prompt as a multi-turn episode (docs/agents.md): a class of TRL's
            ``environment_factory`` shape (``reset()`` and tool methods) or of gymnasium's with
            text (``reset`` / ``step``), a function making one, or a string as ``--environment``
            takes it; default: ``config.environment``.
        tools: functions the model may call (type hints and a docstring each), besides
            ``config.tool``; alone, an episode ends at the first turn that calls none.

    Built from the config, the trainer seeds everything with ``config.seed`` before it loads a
    model; given a model, it draws a fresh value head from torch's random state as it finds it
    (seed it first for a repeatable run).
    """

    def __init__(self, config: PPOConfig, reward=None, *, model=None, ref=None, tokenizer=None,
                 critic: Critic | None = None, generator: Generator | None = None, accelerator=None,
                 environment=None, tools: list | None = None):
        # Checked again as it is now: a field set after the config was built is held to its rules, and an
        # environment or tools given here are recorded in it first, as the flags would name them.
        record_given_episodes(config, environment, tools)
        config = checked_config(config, PPOConfig, "PPOTrainer")
        self.run_parts: RunParts | None = None  # built from the config: its task and prompts too
        # Episodes' environments, made (and checked) before any model loads.
        self.environments = environments_of(config, environment, tools)
        check_template_file_used(config)  # here, not in validate: tools given in Python turn the template on
        if model is None:  # the pieces around a model of one's own, given without it, would be dropped
            given = [name for name, part in (("ref", ref), ("tokenizer", tokenizer), ("critic", critic),
                                             ("generator", generator), ("accelerator", accelerator)) if part is not None]
            if given:
                raise ConfigError(f"{', '.join(given)} given without model=: give the model too, or leave them to "
                                  f"the config's model (config.model)")
        if isinstance(model, (str, Path)):  # a folder (or a cached hub name) is the config's to load
            config.model, model = str(model), None
        if isinstance(tokenizer, (str, Path)):
            tokenizer = load_tokenizer(str(tokenizer))
        pays = self.environments is not None and self.environments.pays
        if model is None:
            self.run_parts = run = build_run(config, reward, self.environments)
            model, ref, reward, tokenizer, critic = run.model, run.ref, run.reward, run.tokenizer, run.critic
            generator, accelerator, teacher = run.generator, run.accelerator, run.teacher
        else:
            ref, reward, tokenizer, generator, accelerator, teacher = complete_parts(
                config, model, ref, reward, tokenizer, generator, accelerator, pays)
            if self.environments is not None and not hasattr(self.environments, "play"):  # the template's checks
                prepare_episode_chat(tokenizer, self.environments,                      # for episodes (envs/chat.py)
                                     template_name(config.model or "model=", config.chat_template_file))
        self.set_up(model, ref, reward, tokenizer, config, generator, critic, accelerator, teacher)

    def set_up(self, actor, ref, reward, tokenizer, config: PPOConfig, generator: Generator, critic: Critic | None,
               accelerator, teacher: Teacher | None = None) -> None:
        self.actor, self.ref, self.reward, self.tokenizer = actor, ref, reward, tokenizer
        self.teacher = teacher  # on-policy distillation's (trainers/teacher.py); None: none
        self.config, self.generator = config, generator
        self.stored_dtype = actor.dtype  # the final actor is saved as it came in (trained in float32)
        if critic is not None and not uses_critic(config.estimator):
            raise ValueError(f"estimator {config.estimator} has no critic, but one was given")
        if critic is None and uses_critic(config.estimator):
            critic = SharedHeadCritic.on(actor)
        self.critic: Critic | None = critic
        self.accelerator = accelerator or config.accelerator(shards=True)
        self.device = self.accelerator.device
        self.place_roles()
        # ReMax's baseline: the score of each prompt's greedy response, from one more rollout.
        self.greedy_generator = self.decoding(do_sample=False) if needs_greedy_baseline(config.estimator) else None
        self.build_optimizer()
        self.kl_controller = (
            AdaptiveKLController(config.kl_coef, config.target_kl, config.kl_horizon)
            if config.target_kl is not None else FixedKLController(config.kl_coef)
        )
        # --lr-target-kl: the actor's lr follows how far each step moves the policy (core/adaptive_lr.py).
        self.lr_control = None if config.lr_target_kl is None else KLAdaptiveLR(config.lr, config.lr_target_kl)
        self.score_moments = RunningMoments()
        # Several processes: each rolls out its own part of the batch and trains on its slice of
        # every minibatch; every process draws the same minibatches from this generator.
        self.rank, self.processes = rank(), world_size()
        self.minibatch_rng = torch.Generator().manual_seed(config.seed)
        # A minibatch step with a non-finite loss or gradient is skipped; max_bad_steps in a row stop the run.
        self.guard = DivergenceGuard(config.max_bad_steps, unit="iteration")
        self.iteration = 0
        # The run's progress as transformers' Trainer keeps it: what TRL gives reward functions as
        # trainer_state (global_step: iterations done; max_steps: the run's), moved on by step().
        from transformers import TrainerState  # here, not at import: it brings transformers' Trainer (seconds)

        self.state = TrainerState(max_steps=config.iterations)
        self.steps_per_iteration = 1  # the state's steps an iteration counts (ppo_rlhf.trl: TRL's optimizer steps)
        if reward is not None:
            reward.follow_run(self.state)
        self.draws = 0  # rollouts drawn in this iteration (the environments' seeds)
        self.sampled_versions: list[int] = []  # this iteration's: the policy version that sampled each row
        self.rollouts = None  # an asynchronous run's rollout worker (trainers/ppo_async.py), while it runs
        self.episode_limits = EpisodeLimits(config.max_prompt_length, config.max_length, config.max_turns,
                                            config.max_episode_tokens, config.chat_template)
        self.old_logprobs_from_update = old_logprobs_from_update(config, self.critic,
                                                                 getattr(self.generator, "keeps_logprobs", False))
        # How the forward passes run (rollout/passes.py): what the config asks for, decided on the
        # first batch against the model's own padded pass (None until then).
        # Under FSDP the output layer's weights are whole only inside the model's own forward: no fused layer.
        self.wanted_pass_plan = PassPlan(config.temperature, tokenizer.pad_token_id,
                                         share_prompts=prompt_sharing_possible(config, self.sharding),
                                         fused=config.fused_output_layer and self.sharding is None,
                                         pack=config.padding_free)
        self._pass_plan: PassPlan | None = None
        self._teacher_plan: PassPlan | None = None  # a teacher of its own: its plan, checked on it
        # How many tokens a micro-batch holds, chosen now that the models are in place (auto: from
        # the memory they leave free); under FSDP every process cuts alike (trainers/token_budget.py).
        sharded = self.sharding is not None
        self.token_budget = run_budget(config, actor, self.critic, self.trainable_parameters, self.device,
                                       self.processes if sharded else 1,
                                       agree=(lambda room: -max_across_processes(-room)) if sharded else None)

    def place_roles(self) -> None:
        """Every role on the device; what trains in float32, what is frozen frozen; dropout off;
        under an FSDP launch each model sharded."""
        actor, ref, reward, critic, config = self.actor, self.ref, self.reward, self.critic, self.config
        teacher = getattr(self.teacher, "model", None)  # a teacher of its own (an adapter lives on the actor)
        for model in (actor, ref, getattr(reward, "model", None), critic, teacher):
            if isinstance(model, torch.nn.Module):
                model.to(self.device)
        train_in_float32(actor, "actor")
        if critic is not None:
            train_in_float32(critic, "critic")
        for model in (ref, getattr(reward, "model", None), teacher):
            if model is not None:
                model.eval().requires_grad_(False)
        if config.disable_dropout:
            keep_lora_dropout = config.lora and config.lora_dropout > 0
            disable_dropout(actor, keep_lora_dropout)
            if critic is not None:
                disable_dropout(critic, keep_lora_dropout)
        # An FSDP launch: what trains is split over the processes, before the optimizer sees it, and
        # so are the frozen roles, for inference only: each of their forward passes gathers one
        # layer at a time and frees it again (docs/design.md, "Scale").
        self.sharding = sharding_from_launch()
        if self.sharding is not None:
            shard(actor, self.sharding)
            if critic is not None:
                critic.shard(self.sharding)
            for frozen in (ref, getattr(reward, "model", None), teacher):
                if isinstance(frozen, torch.nn.Module):
                    shard(frozen, dataclasses.replace(self.sharding, reshard_after_forward=True))

    def build_optimizer(self) -> None:
        """One AdamW over the actor's and the critic's trained parameters, a group each."""
        config, critic = self.config, self.critic
        critic_params = [] if critic is None else [p for p in critic.parameters() if p.requires_grad]
        # With LoRA the actor's base also carries the critic's adapter: each tensor trains once.
        critic_ids = {id(p) for p in critic_params}
        actor_params = [p for p in self.actor.parameters() if p.requires_grad and id(p) not in critic_ids]
        self.trainable_parameters = actor_params + critic_params  # what the gradient-norm clip covers
        if config.lr is None:  # a full model's default follows its width; recorded in the config
            config.lr = default_lr(getattr(self.actor.config.get_text_config(), "hidden_size", None), config.lora)
        self.optimizer = self.accelerator.prepare(adamw(
            [{"params": actor_params, "lr": config.lr}, {"params": critic_params, "lr": config.critic_lr or config.lr}],
            lr=config.lr, weight_decay=config.weight_decay, eps=config.adam_eps))

    # ------------------------------------------------------------ one iteration
    @torch.no_grad()
    @under_autocast
    def make_experience(self, rows: list[dict], draw_more: Callable[[], list[dict]] | None = None
                        ) -> tuple[Experience, dict[str, float]]:
        """Stages 1-6 on this process's ``rows``; returns the experience and the stages' metrics
        (timings, and dynamic sampling's counts).  With several processes, the per-row work (rollout,
        scoring, the forward passes) is done on each process's own rows; the batch-level arithmetic
        (score normalisation, whitening, the statistics) then runs on the gathered whole batch, in
        every process alike, so N processes compute what one process would (docs/design.md, "Scale").

        ``draw_more``: another batch of this process's prompt rows, which --dynamic-sampling draws
        when the groups it keeps do not fill the batch."""
        metrics = {"time/generate": 0.0, "time/score": 0.0}
        # 1-2. roll out and score (this process's rows)
        rollout = self.roll_out(rows, metrics)
        # Each reward's own scores, of the batch as drawn (step's reward/<name> metrics).
        self.reward_components = {name: gather_rows(part) for name, part in rollout.components.items()}
        # A few of this batch's rollouts, for people to read (trainers/ppo_loop.py logs them).
        self.last_samples = samples_of(rollout.episodes, rollout.raw_scores, SAMPLES_KEPT)
        self.last_rollout = rollout  # as drawn: --save-rollouts writes it, the episode metrics read it
        if self.config.dynamic_sampling:
            rollout = self.keep_informative_groups(rollout, draw_more, metrics)
        greedy = greedy_unscored = None
        if self.greedy_generator is not None:  # ReMax
            greedy, greedy_unscored = self.greedy_baseline(rollout, metrics)
        self.staleness_metrics(metrics)

        # 3-4. old log-probs and values (eval mode: no dropout, so they match the generation), the
        # reference's log-probs and the per-token KL (and a teacher's log-probs)
        start = time.perf_counter()
        logprobs, ref_logprobs, kl, values = self.old_and_reference_passes(rollout.sequences)
        teacher_logprobs = self.teacher_passes(rollout.sequences) if self.teacher is not None else None

        # 5-6. shaped rewards, advantages and returns, on the whole batch
        experience = self.experience(rollout, logprobs, ref_logprobs, kl, values, teacher_logprobs, greedy,
                                     greedy_unscored, metrics)
        metrics["time/forward"] = time.perf_counter() - start
        return experience, metrics

    def step(self, rows: list[dict], draw_more: Callable[[], list[dict]] | None = None) -> dict[str, float]:
        """Stages 1-8 on one batch of prompt rows; returns the iteration's metrics.  ``draw_more``:
        another batch of rows, for --dynamic-sampling (see make_experience)."""
        check_step_rows(rows, self.config.prompt_field, environment_prompt if self.environments is not None
                        else prompt_check(self.config.chat_template))
        self.state.global_step = self.iteration * self.steps_per_iteration
        self.state.max_steps = self.config.iterations * self.steps_per_iteration
        kl_coef = self.kl_controller.value  # what this iteration uses; the controller moves after it
        entropy_coef = self.entropy_coef()
        self.draws = 0  # rollouts drawn in this iteration (environment seeds)
        self.sampled_versions = []
        if self.reward is not None:
            self.reward.new_iteration()  # a judge's scores are cached within an iteration

        # 1-6. rollout, scores, passes, rewards and advantages
        experience, stage_metrics = self.make_experience(rows, draw_more)
        # The vLLM engine's weight probe after its sync (docs/design.md, "The vLLM rollout engine"):
        # its gap, and its seconds taken out of the rollout's.  (A batch an asynchronous run's
        # worker generated had no sync of its own: the push after the update is probed below.)
        probe = getattr(self.generator, "last_probe", None) if not isinstance(rows, Generated) else None
        if probe:
            stage_metrics.update(probe)
            stage_metrics["time/generate"] -= probe["time/engine_probe"]

        # 7. the update.  A reward that gave a non-finite score: this batch teaches nothing, skip it.
        # (Checked only when bad: a finite batch of scores must not reset the count of bad steps.)
        start = time.perf_counter()
        bad_scores = not is_finite(experience.raw_scores) and self.guard.skip(self.iteration + 1,
                                                                              score=experience.raw_scores)
        update_stats = {"skipped_steps": self.guard.skipped} if bad_scores else self.update(experience)
        stage_metrics["time/train"] = time.perf_counter() - start
        # Old log-probs read off an update that was skipped were never computed: no KL measured.
        old_logprobs_known = not (bad_scores and self.old_logprobs_from_update)
        if old_logprobs_known:
            kl_per_response = experience.kl.sum(dim=1).mean().item()  # kl is 0 on padding
            self.kl_controller.update(kl_per_response, experience.scores.shape[0])
        else:
            kl_per_response = float("nan")
        self.iteration += 1
        self.policy_moved()
        if self.rollouts is not None:  # asynchronous: the new weights to the servers now, for the worker
            self.push_weights(stage_metrics)
        self.state.global_step = self.iteration * self.steps_per_iteration

        # 8. the iteration's metrics
        return self.iteration_metrics(experience, update_stats, stage_metrics, kl_coef, entropy_coef, kl_per_response,
                                      old_logprobs_known)

    # ------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        state = {
            "iteration": self.iteration,
            "optimizer": whole_optimizer_state(self.optimizer),  # sharded: gathered to the main process
            "kl_controller": self.kl_controller.state_dict(),
            "score_moments": self.score_moments.state_dict(),
            "guard": self.guard.state_dict(),
            "minibatch_rng": self.minibatch_rng.get_state(),
        }
        if self.lr_control is not None:
            state["lr_control"] = self.lr_control.state_dict()
        return state  # the weights are saved beside it (trainers/ppo_loop.py, trained_modules)

    def push_weights(self, metrics: dict[str, float]) -> None:
        """An asynchronous run's push right after the update (docs/design.md, "Asynchronous
        rollouts"): it waits for the worker's rollout on the weights before to end; its seconds and
        its probe go in this iteration's metrics."""
        seconds = self.generator.sync(self.actor)
        probe = self.generator.last_probe
        metrics["time/weight_sync"] = metrics.get("time/weight_sync", 0.0) + seconds - probe.get("time/engine_probe", 0.0)
        if probe:
            metrics.update(probe)

    def policy_moved(self) -> None:
        """An engine with weights of its own that is told versions (a generation server: rollout/
        server_client.py) learns that the actor is now at ``self.iteration`` (updates made)."""
        moved = getattr(self.generator, "policy_moved", None)
        if moved is not None:
            moved(self.iteration)

    def load_state_dict(self, state: dict) -> None:
        self.iteration = state["iteration"]
        self.policy_moved()
        if "optimizer" in state:  # a checkpoint's is restored with its weights (trainers/resume.py)
            load_whole_optimizer_state(self.optimizer, state["optimizer"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.score_moments.load_state_dict(state["score_moments"])
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
        if "minibatch_rng" in state:
            self.minibatch_rng.set_state(state["minibatch_rng"])
        if self.lr_control is not None and "lr_control" in state:
            self.lr_control.load_state_dict(state["lr_control"])
        if state.get("value_head") is not None and isinstance(self.critic, SharedHeadCritic):
            self.critic.value_head.load_state_dict(state["value_head"])  # a checkpoint from before critic folders
