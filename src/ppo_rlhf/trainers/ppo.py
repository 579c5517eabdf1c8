"""PPO for language models: one iteration in numbered stages (docs/design.md, "One PPO iteration").

    1. rollout     the actor generates responses (eval mode, same temperature as the log-probs)
    2. score       the reward model / function scores each finished response
    3. old pass    actor (and critic) log-probs and values of what was generated, eval mode
    4. ref pass    the frozen reference's log-probs (and the teacher's, distilling: --teacher)
    5. rewards     r[t] = -kl_coef * kl[t], plus the score on the last response token (distilling:
                   -teacher_coef * (log pi - log teacher) per token, or summed into the score)
    6. advantages  GAE over the response tokens, returns = A + V_old, whitened A; or, with a
                   critic-free estimator (trainers/estimators.py), the reward-to-go of the
                   rewards with the score less its baseline; 0 for a response with no score
    7. update      ppo_epochs passes of minibatch steps on the clipped losses
    8. log         the metrics of docs/design.md ("Metrics"), timings and throughput

The trainer holds the four roles -- actor, critic, ref, reward -- and nothing task-specific:
the task (or the user) supplies prompts, a reward and an optional metric.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ppo_rlhf.config import ConfigError, checked_config
from ppo_rlhf.core import (
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    cispo_loss,
    engine_importance_weights,
    explained_variance,
    informative_groups,
    keep_masked,
    kl_penalty,
    masked_mean,
    mismatch_statistics,
    overlong_penalty,
    policy_loss,
    sapo_loss,
    shaped_rewards,
    teacher_reverse_kl,
    value_loss,
)
from ppo_rlhf.core.normalize import RunningMoments
from ppo_rlhf.data import DataError, environment_prompt, prompt_check, row_complaint
from ppo_rlhf.envs import environment_source
from ppo_rlhf.envs.chat import prepare_episode_chat, template_name
from ppo_rlhf.envs.options import check_template_file_used
from ppo_rlhf.distributed import gather_rows, rank, sum_across_processes, sum_gradients, world_size
from ppo_rlhf.hardware import train_in_float32
from ppo_rlhf.models import load_tokenizer
from ppo_rlhf.models.lora import active_adapter, adapters_disabled
from ppo_rlhf.models.value import Critic, SharedHeadCritic
from ppo_rlhf.rollout.generation import Generator, TorchGenerator
from ppo_rlhf.rollout.passes import PassPlan, ResponseStats, checked_plan, full_kl_between, response_stats
from ppo_rlhf.rollout.episodes import Episodes, EpisodeLimits, episode_seeds, roll_out, samples_of, score_episodes
from ppo_rlhf.rollout.reward import unscored_rows
from ppo_rlhf.rollout.sequences import Sequences, pad_columns
from ppo_rlhf.sharding import gathered, load_whole_optimizer_state, plain, shard, sharding_from_launch, whole_optimizer_state
from ppo_rlhf.trainers.estimators import (
    advantages_and_returns,
    check_prompt_groups,
    needs_greedy_baseline,
    teacher_in_score,
    uses_critic,
)
from ppo_rlhf.trainers.guard import DivergenceGuard, is_finite
from ppo_rlhf.trainers.optimizer import adamw
from ppo_rlhf.trainers.ppo_loop import PPOLoop
from ppo_rlhf.trainers.ppo_setup import RunParts, build_run, complete_parts, episode_objects, record_given_episodes
from ppo_rlhf.trainers.ppo_config import PPOConfig, default_lr
from ppo_rlhf.trainers.teacher import TEACHER, Teacher


@dataclass
class Experience:
    """One scored rollout batch with everything the update needs; (B, T) aligned with the response."""

    sequences: Sequences
    logprobs: torch.Tensor  # (B, T) actor log-probs at rollout time
    ref_logprobs: torch.Tensor  # (B, T)
    values: torch.Tensor | None  # (B, T) critic at rollout time; None without a critic
    kl: torch.Tensor  # (B, T) per-token KL estimate
    rewards: torch.Tensor  # (B, T) shaped per-token rewards
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    scores: torch.Tensor  # (B,) reward of each response (after clipping / normalisation)
    raw_scores: torch.Tensor  # (B,) reward as the reward model / function gave it
    greedy_scores: torch.Tensor | None = None  # (B,) ReMax: score of the prompt's greedy response, as used
    engine_logprobs: torch.Tensor | None = None  # (B, T) the rollout engine's log-probs (vllm), for --is-correction

    @property
    def mask(self) -> torch.Tensor:
        """(B, T) the tokens the model wrote: every loss, KL, entropy and value term reads this one."""
        return self.sequences.loss_mask

    def select(self, index: torch.Tensor) -> "Experience":
        tensors = [getattr(self, field.name) for field in dataclasses.fields(self)[1:]]
        return Experience(self.sequences.select(index), *(None if t is None else t[index] for t in tensors))


@dataclass
class Rollout:
    """Stages 1-2 on this process's rows: the episodes (one turn each without an environment) and
    their scores, before any batch-level arithmetic; (b,) and (b, T) row for row with ``rows``."""

    rows: list[dict]
    episodes: Episodes
    finished: torch.Tensor  # (b,) bool: the last model turn ended with a stop id
    raw_scores: torch.Tensor  # (b,) as the rewards gave them (the environment's included)
    scores: torch.Tensor  # (b,) each shaped on its own (missing EOS, overlong); what lands on the last token
    components: dict[str, torch.Tensor]  # name -> (b,) each reward's own scores, before its weight
    turn_rewards: torch.Tensor | None = None  # (b, T) --turn-rewards per-turn: step rewards on each turn's last token
    filler: torch.Tensor | None = None  # (b,) bool: a dropped group that fills a short batch (dynamic sampling)
    unscored: torch.Tensor | None = None  # (b,) bool: no score known (a judge's unparsed answer): teaches nothing

    @property
    def sequences(self) -> Sequences:
        return self.episodes.sequences

    def select(self, index: list[int]) -> "Rollout":
        tensor_index = torch.tensor(index, dtype=torch.long, device=self.scores.device)
        return Rollout([self.rows[i] for i in index], self.episodes.select(index), self.finished[tensor_index],
                       self.raw_scores[tensor_index], self.scores[tensor_index],
                       {name: part[tensor_index] for name, part in self.components.items()},
                       None if self.turn_rewards is None else self.turn_rewards[tensor_index],
                       None if self.filler is None else self.filler[tensor_index],
                       None if self.unscored is None else self.unscored[tensor_index])

    @staticmethod
    def concat(parts: list["Rollout"], pad_token_id: int) -> "Rollout":
        episodes = Episodes.concat([p.episodes for p in parts], pad_token_id)
        turn_rewards = None
        if parts[0].turn_rewards is not None:
            width = episodes.sequences.response_ids.shape[1]
            turn_rewards = torch.cat([pad_columns(p.turn_rewards, width, 0.0) for p in parts])
        filler = None
        if any(p.filler is not None for p in parts):
            filler = torch.cat([torch.zeros_like(p.finished) if p.filler is None else p.filler for p in parts])
        unscored = None
        if any(p.unscored is not None for p in parts):
            unscored = torch.cat([torch.zeros_like(p.finished) if p.unscored is None else p.unscored for p in parts])
        return Rollout([r for p in parts for r in p.rows], episodes, torch.cat([p.finished for p in parts]),
                       torch.cat([p.raw_scores for p in parts]), torch.cat([p.scores for p in parts]),
                       {name: torch.cat([p.components[name] for p in parts]) for name in parts[0].components},
                       turn_rewards, filler, unscored)


def engine_gap(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """rollout/logprob_diff_mean and _max: |trainer's old log-prob - engine's| over the response tokens."""
    width = logprobs.shape[1]
    engine_logprobs = pad_columns(engine_logprobs.to(logprobs.device), width, 0.0)[:, :width]
    gap = keep_masked((logprobs - engine_logprobs).abs(), mask)
    return {"rollout/logprob_diff_mean": (gap.sum() / mask.sum().clamp(min=1)).item(),
            "rollout/logprob_diff_max": gap.max().item() if gap.numel() else 0.0}


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


def prompt_sharing_possible(config: PPOConfig, sharding) -> bool:
    """Whether forward passes may run each distinct prompt once (docs/design.md, "Shared prompts"):
    asked for, prompts that repeat, and neither of the two things a cache cannot go through --
    FSDP (each model call gathers the layers: every process must make the same calls) and
    gradient checkpointing (its recomputation would append the keys to the cache a second time)."""
    return config.share_prompts and config.samples_per_prompt > 1 and sharding is None and not config.gradient_checkpointing


def old_logprobs_from_update(config: PPOConfig, critic: Critic | None) -> bool:
    """Whether the old log-probs can be read off the update's own forward pass instead of a pass
    of their own (docs/design.md, "Old log-probs from the update"): exact when the batch gets one
    optimizer step (the update's forward then runs the weights that sampled it), no dropout
    differs between that forward and the rollout's, and nothing computed before the update needs
    them -- no critic (GAE's values come from the same pass), no KL in the reward, no teacher (its
    reward is the old log-probs' difference from the teacher's)."""
    one_step = config.ppo_epochs == 1 and config.mini_batch_size == config.batch_size
    no_dropout = config.disable_dropout and not (config.lora and config.lora_dropout > 0)
    kl_free_reward = config.kl_in == "loss" or (config.kl_coef == 0 and config.target_kl is None)
    return one_step and no_dropout and kl_free_reward and critic is None and config.teacher is None


def environments_of(config: PPOConfig, environment=None, tools: list | None = None):
    """The EnvironmentSource of the run's episodes (envs/__init__.py), from the config and what was
    given in Python (recorded in the config already: ``record_given_episodes``); None: single-turn
    rollouts.  Episode options without episodes are refused here, at start: a config may be built
    with them for objects given to the trainer."""
    config.check_episode_options_used()
    environment, tools = episode_objects(config, environment, tools)
    return environment_source(environment, tools, tool_parser=config.tool_parser,
                              tool_timeout=config.tool_timeout, env_workers=config.env_workers,
                              environment_config=config.environment_config,
                              action_names=config.action_names or None, observation_text=config.observation_text)


def token_micro_batches(lengths: torch.Tensor, max_tokens: int | None, max_rows: int | None = None) -> list[list[int]]:
    """Row indices 0..B-1 in micro-batches: without a token budget, consecutive groups of
    ``max_rows`` (None: one group of all); with one (--max-tokens-per-micro-batch), rows longest
    first, each into the first group whose ``lengths`` (B,) still fit ``max_tokens`` (a longer row
    alone) and that holds fewer than ``max_rows`` rows -- uneven rows then share a pass by their
    tokens, not by their count (docs/design.md, "Long responses")."""
    rows = len(lengths)
    if max_tokens is None:
        return [list(range(start, min(start + (max_rows or rows), rows))) for start in range(0, rows, max_rows or rows)]
    groups: list[list[int]] = []
    room: list[int] = []
    lengths = lengths.tolist()  # one device sync, not one a row
    for row in sorted(range(rows), key=lambda r: -lengths[r]):
        length = lengths[row]
        target = next((g for g, left in enumerate(room) if left >= length and len(groups[g]) < (max_rows or rows)),
                      None)
        if target is None:
            groups.append([row])
            room.append(max_tokens - length)
        else:
            groups[target].append(row)
            room[target] -= length
    return [sorted(group) for group in groups]


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


def under_autocast(method):
    """Run a PPOTrainer method under the trainer's autocast (``--mixed-precision``; none by default)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with self.accelerator.autocast():
            return method(self, *args, **kwargs)

    return run


class PPOTrainer(PPOLoop):
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
            if self.environments is not None:  # the template's checks for episodes (envs/chat.py)
                prepare_episode_chat(tokenizer, self.environments,
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
        self.score_moments = RunningMoments()
        # Several processes: each rolls out its own part of the batch and trains on its slice of
        # every minibatch; every process draws the same minibatches from this generator.
        self.rank, self.processes = rank(), world_size()
        self.minibatch_rng = torch.Generator().manual_seed(config.seed)
        # A minibatch step with a non-finite loss or gradient is skipped; max_bad_steps in a row stop the run.
        self.guard = DivergenceGuard(config.max_bad_steps, unit="iteration")
        self.iteration = 0
        self.draws = 0  # rollouts drawn in this iteration (the environments' seeds)
        self.episode_limits = EpisodeLimits(config.max_prompt_length, config.max_length, config.max_turns,
                                            config.max_episode_tokens, config.chat_template)
        self.old_logprobs_from_update = old_logprobs_from_update(config, self.critic)
        # How the forward passes run (rollout/passes.py): what the config asks for, decided on the
        # first batch against the model's own padded pass (None until then).
        # Under FSDP the output layer's weights are whole only inside the model's own forward: no fused layer.
        self.wanted_pass_plan = PassPlan(config.temperature, tokenizer.pad_token_id,
                                         share_prompts=prompt_sharing_possible(config, self.sharding),
                                         fused=config.fused_output_layer and self.sharding is None,
                                         pack=config.padding_free)
        self._pass_plan: PassPlan | None = None
        self._teacher_plan: PassPlan | None = None  # a teacher of its own: its plan, checked on it

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

    # ------------------------------------------------------------ forward passes
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
                return response_stats(self.actor, sequences, self.checked_pass_plan(sequences))
        if self._teacher_plan is None:  # another model than the actor: the faster passes checked on it
            with torch.no_grad():
                self._teacher_plan, warnings = checked_plan(self.teacher.model, sequences, self.wanted_pass_plan)
            if self.rank == 0:
                for warning in warnings:
                    tqdm.write(f"warning: the teacher's passes: {warning}")
        return response_stats(self.teacher.model, sequences, self._teacher_plan)

    # ------------------------------------------------------------ stages 1-6
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
        config = self.config
        metrics = {"time/generate": 0.0, "time/score": 0.0}
        rollout = self.roll_out(rows, metrics)  # 1-2
        # Each reward's own scores, of the batch as drawn (step's reward/<name> metrics).
        self.reward_components = {name: gather_rows(part) for name, part in rollout.components.items()}
        # A few of this batch's rollouts, for people to read (trainers/ppo_loop.py logs them).
        self.last_samples = samples_of(rollout.episodes, rollout.raw_scores, SAMPLES_KEPT)
        self.last_rollout = rollout  # as drawn: --save-rollouts writes it, the episode metrics read it
        if config.dynamic_sampling:
            rollout = self.keep_informative_groups(rollout, draw_more, metrics)
        greedy = greedy_unscored = None
        if self.greedy_generator is not None:  # ReMax
            greedy, greedy_unscored = self.greedy_baseline(rollout, metrics)

        # 3-4. old log-probs and values (eval mode: no dropout, so they match the generation), the
        # reference's log-probs and the per-token KL.
        start = time.perf_counter()
        logprobs, ref_logprobs, kl, values = self.old_and_reference_passes(rollout.sequences)
        teacher_logprobs = self.teacher_passes(rollout.sequences) if self.teacher is not None else None

        # The whole batch, in every process (one process: these are the tensors themselves).
        sequences = self.gather_sequences(rollout.sequences)
        mask = sequences.loss_mask
        logprobs, ref_logprobs, values, kl, teacher_logprobs = (
            gather_rows(t) for t in (logprobs, ref_logprobs, values, kl, teacher_logprobs))
        engine_logprobs = gather_rows(rollout.episodes.engine_logprobs)
        raw_scores = gather_rows(rollout.raw_scores)
        unscored = gather_rows(rollout.unscored)  # (B,) no score known (a judge's unparsed answer)
        # An episode's per-turn rewards (--turn-rewards per-turn) go through the same --score-norm and --score-clip.
        scores, turn_rewards = self.normalise_scores(gather_rows(rollout.scores), gather_rows(rollout.turn_rewards),
                                                     scored=~unscored)
        greedy_scores = None
        if greedy is not None:  # ReMax: normalised as the sampled scores, without moving their statistics
            greedy_scores, _ = self.normalise_scores(gather_rows(greedy), update_moments=False)
            greedy_scores = greedy_scores.repeat_interleave(config.samples_per_prompt)
            # a greedy response with no score leaves its prompt's samples without a baseline
            unscored = unscored | gather_rows(greedy_unscored).repeat_interleave(config.samples_per_prompt)

        # 5. shaped rewards: the KL goes in the reward, or (kl_in: loss) into the update's loss
        # and the reward is the score alone; either way kl[t] is logged and drives the controller.
        # An episode's per-turn rewards (--turn-rewards per-turn) land on each turn's last token.
        kl_coef_in_reward = self.kl_controller.value if config.kl_in == "reward" else 0.0
        if teacher_logprobs is not None:  # distilling: the teacher's reward per token, or summed into the score
            scores, turn_rewards = self.add_teacher_rewards(logprobs, teacher_logprobs, mask, scores, turn_rewards,
                                                            metrics)
        rewards = shaped_rewards(scores, kl, mask, kl_coef_in_reward, turn_rewards)

        # 6. advantages and returns: GAE against the critic, or the score less the estimator's baseline;
        # an unscored response gets advantage 0 and is in no baseline
        if values is not None:
            values = keep_masked(values, mask)
        advantages, returns = advantages_and_returns(config, rewards, values, scores, kl, mask, kl_coef_in_reward,
                                                     greedy_scores, turn_rewards, unscored)
        if rollout.filler is not None:  # dynamic sampling's filler groups keep the batch's size and teach nothing
            advantages = advantages.masked_fill(gather_rows(rollout.filler)[:, None], 0.0)
        metrics["time/forward"] = time.perf_counter() - start

        experience = Experience(sequences, logprobs, ref_logprobs, values, kl, rewards, advantages, returns,
                                scores, raw_scores, greedy_scores, engine_logprobs)
        return experience, metrics

    def add_teacher_rewards(self, logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                            scores: torch.Tensor, token_rewards: torch.Tensor | None, metrics: dict[str, float]
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On-policy distillation's reward, ``-teacher_coef * (log pi - log teacher)`` on each token the
        policy wrote, where the estimator takes it (docs/design.md, "On-policy distillation"): per
        token beside the other token rewards, as the KL penalty is (gae, reinforce++, remax), or
        summed over each response into its score before the group baseline (grpo, dr-grpo, rloo:
        their advantage is one number a response).  Returns (scores, token rewards); logs
        ``teacher/reverse_kl``, the KL summed over a response, averaged over the batch."""
        reverse_kl = teacher_reverse_kl(logprobs, teacher_logprobs, mask)  # (B, T)
        metrics["teacher/reverse_kl"] = reverse_kl.sum(dim=1).mean().item()
        teacher_rewards = -self.config.teacher_coef * reverse_kl
        if teacher_in_score(self.config.estimator):
            return scores + teacher_rewards.sum(dim=1), token_rewards
        return scores, teacher_rewards if token_rewards is None else token_rewards + teacher_rewards

    def roll_out(self, rows: list[dict], metrics: dict[str, float]) -> Rollout:
        """Stages 1-2 on this process's ``rows``: episodes played by the actor (one turn each without
        an environment), then scored, each score shaped on its own (missing EOS, overlong) -- what
        needs the whole batch waits for the gathered batch."""
        config = self.config
        start = time.perf_counter()
        prompts = [row.get(config.prompt_field) for row in rows]
        check_prompt_groups(prompts, config.samples_per_prompt)
        with gathered(self.actor):  # sharded: the whole actor, gathered once for the whole rollout
            episodes = roll_out(self.actor, self.tokenizer, self.generator, rows, prompts, self.episode_limits,
                                self.environments, self.environment_seeds(len(rows)))
        # An engine with weights of its own (vllm) reports the seconds it took to receive the actor's.
        sync = getattr(self.generator, "last_sync_seconds", None)
        if sync is not None:
            metrics["time/weight_sync"] = metrics.get("time/weight_sync", 0.0) + sync
        metrics["time/generate"] += time.perf_counter() - start - (sync or 0.0)
        start = time.perf_counter()
        raw_scores, components, unscored = self.score(rows, episodes)
        metrics["time/score"] += time.perf_counter() - start
        finished = torch.tensor(episodes.finished, device=self.device)
        scores, turn_rewards = self.place_turn_rewards(raw_scores, episodes)
        scores = self.shape_scores(scores, finished, episodes.sequences.loss_mask.sum(dim=1))
        return Rollout(rows, episodes, finished, raw_scores, scores, components, turn_rewards, unscored=unscored)

    def environment_seeds(self, rows: int) -> list[int] | None:
        """This process's episodes' environment seeds (rollout/episodes.py, episode_seeds); None
        without an environment.  Each call within an iteration is a new draw."""
        if self.environments is None:
            return None
        k = self.config.samples_per_prompt
        self.draws += 1
        return episode_seeds(self.config.seed, self.iteration, self.draws, self.rank * rows // k, rows // k, k)

    def score(self, rows: list[dict], episodes: Episodes
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """(b,) scores as the rewards gave them (the environment's included), on the trainer's
        device, each reward's own (b,) scores by name, and (b,) which rows a reward could not score."""
        raw, parts = score_episodes(self.reward, rows, episodes, self.config.environment_reward_weight)
        unscored = unscored_rows(self.reward, len(rows)).to(self.device)
        if raw is None:  # no reward but a teacher's (--teacher alone): the score is 0, the signal per token
            return torch.zeros(len(rows), device=self.device), {}, unscored
        # A reward function's scores come on the CPU.
        return raw.to(self.device).float(), {name: part.to(self.device) for name, part in parts.items()}, unscored

    def place_turn_rewards(self, raw_scores: torch.Tensor, episodes: Episodes
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """--turn-rewards per-turn: the environment's step rewards moved from the episode's score to
        the last model token of each turn they answered, (b, T); the score keeps the rest."""
        if self.config.turn_rewards != "per-turn" or not episodes.environments:
            return raw_scores, None
        weight = self.config.environment_reward_weight
        turn_rewards = torch.zeros_like(episodes.sequences.loss_mask, dtype=torch.float32, device=self.device)
        for row, (ends, steps) in enumerate(zip(episodes.turn_ends, episodes.step_rewards)):
            for end, reward in zip(ends, steps):
                if end is not None:  # a turn with no model token before it keeps its reward in the score
                    turn_rewards[row, end] += weight * reward
        return raw_scores - turn_rewards.sum(dim=1), turn_rewards

    def keep_informative_groups(self, rollout: Rollout, draw_more: Callable[[], list[dict]] | None,
                                metrics: dict[str, float]) -> Rollout:
        """DAPO's dynamic sampling (docs/design.md, "Policy-loss variants"): the prompt groups whose
        K rewards (--dynamic-sampling-on) are all equal -- all right or all wrong -- are dropped, and
        more prompts are rolled out until the kept groups fill the batch, for at most --max-resample-rounds extra
        rounds; a batch still short then is completed with dropped groups, marked ``filler``: their
        advantages are set to 0 (DAPO trains on no dropped group; under --dynamic-sampling-on accuracy
        their shaped scores may still differ), so every update sees batch_size sequences and learns
        from the kept groups alone.  Decided on the gathered scores, in every process alike; each
        process then keeps its own rows of the chosen groups."""
        config, k = self.config, self.config.samples_per_prompt
        wanted = config.batch_size // k  # groups in the whole batch
        # accuracy: the rewards as they came (DAPO filters on the task's accuracy), so a group all
        # right stays one whatever lengths the overlong shaping penalises; score: after shaping.
        decided_on = "raw_scores" if config.dynamic_sampling_on == "accuracy" else "scores"
        first = gather_rows(rollout.raw_scores)
        metrics["score"], metrics["score_std"] = first.mean().item(), first.std(unbiased=False).item()
        rounds: list[tuple[Rollout, torch.Tensor]] = []  # (this process's rollout, informative flag of every group)
        found, generated_tokens = 0, 0.0
        while True:
            informative = informative_groups(gather_rows(getattr(rollout, decided_on)).reshape(-1, k),
                                             ~gather_rows(rollout.unscored).reshape(-1, k))  # (groups,)
            generated_tokens += sum_across_processes(rollout.sequences.loss_mask.sum().float()).item()
            rounds.append((rollout, informative))
            found += int(informative.sum())
            if found >= wanted or len(rounds) > config.max_resample_rounds:
                break
            if draw_more is None:
                raise ValueError("dynamic sampling needs draw_more, a source of more prompt rows")
            rollout = self.roll_out(draw_more(), metrics)
        # The first `wanted` informative groups, in order of rounds and of processes; then, if short,
        # the first dropped groups to fill the batch.
        informative_left, fill_left = wanted, max(wanted - found, 0)
        parts = []
        for part, informative in rounds:
            take = informative & (informative.cumsum(0) <= informative_left)
            fill = ~informative & ((~informative).cumsum(0) <= fill_left)
            informative_left -= int(take.sum())
            fill_left -= int(fill.sum())
            mine = (take | fill).reshape(self.processes, -1)[self.rank]  # this process's groups of the round
            filled = fill.reshape(self.processes, -1)[self.rank]
            rows = mine.repeat_interleave(k).nonzero().squeeze(1)
            parts.append(part.select(rows.tolist()))
            parts[-1].filler = filled.repeat_interleave(k)[rows].to(part.finished.device)
        kept = min(found, wanted)
        metrics.update({
            "dynamic_sampling/rounds": len(rounds),
            "dynamic_sampling/dropped_groups": sum(int((~informative).sum()) for _, informative in rounds),
            "dynamic_sampling/filled_groups": wanted - kept,
            # The price of the filter: response tokens generated per sequence that carries a signal.
            "dynamic_sampling/generated_tokens": generated_tokens,
            "dynamic_sampling/generated_tokens_per_kept_sample": generated_tokens / (kept * k) if kept else float("nan"),
        })
        return Rollout.concat(parts, self.tokenizer.pad_token_id)

    def old_and_reference_passes(self, sequences: Sequences) -> tuple:
        """Stages 3-4 on this process's rows, --rollout-micro-batch-size rows at a time (only that
        many rows' (rows, T, V) logits are ever held): (logprobs, ref_logprobs, kl, values or None), (b, T).
        With the old log-probs taken from the update (``old_logprobs_from_update``) only the
        reference runs here, and logprobs and kl are zeros the update fills in."""
        self.actor.eval()
        if self.critic is not None:
            self.critic.eval()
        rows = sequences.response_ids.shape[0]
        if rows == 0:  # dynamic sampling kept none of this process's groups
            empty = torch.zeros_like(sequences.response_ids, dtype=torch.float32)
            return empty, empty, empty, None if self.critic is None else empty
        def micro_batches() -> list[torch.Tensor]:
            return [torch.tensor(group, device=self.device) for group in
                    token_micro_batches(self.pass_lengths(sequences), self.config.max_tokens_per_micro_batch,
                                        self.config.rollout_micro_batch_size)]

        passes = micro_batches()
        if self._pass_plan is None:  # checked on a padded pass's share of the budget, then cut by the plan
            self.checked_pass_plan(sequences.select(passes[0]))
            passes = micro_batches()
        parts = [self.old_and_reference(sequences.select(index)) for index in passes]
        # Back in row order (a token budget groups rows by length).
        order = torch.argsort(torch.cat(passes))
        logprobs, ref_logprobs, kl = (torch.cat([part[i] for part in parts])[order] for i in range(3))
        values = None if parts[0][3] is None else torch.cat([part[3] for part in parts])[order]
        return logprobs, ref_logprobs, kl, values

    def teacher_passes(self, sequences: Sequences) -> torch.Tensor:
        """(b, T) the teacher's log-probs of this process's rows, in the rollout's micro-batches."""
        rows = sequences.response_ids.shape[0]
        if rows == 0:
            return torch.zeros_like(sequences.response_ids, dtype=torch.float32)
        passes = [torch.tensor(group, device=self.device) for group in
                  token_micro_batches(self.pass_lengths(sequences), self.config.max_tokens_per_micro_batch,
                                      self.config.rollout_micro_batch_size)]
        if self.teacher.model is None:
            self.actor.eval()  # the adapter runs on the actor's base: no dropout, as the old pass
        parts = [self.teacher_stats(sequences.select(index)).logprobs for index in passes]
        return torch.cat(parts)[torch.argsort(torch.cat(passes))]  # back in row order

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

    def decoding(self, do_sample: bool, temperature: float = 1.0, seed: int | None = None) -> Generator:
        """The rollout engine with other decoding settings (ReMax's greedy baseline, the in-run
        evaluations): the same engine where it offers them (vLLM holds one per process), else the
        built-in loop with the run's stop ids and length."""
        if hasattr(self.generator, "with_decoding"):
            return self.generator.with_decoding(do_sample, temperature, seed)
        return TorchGenerator(self.generator.stop_token_ids, self.tokenizer.pad_token_id, self.config.max_new_tokens,
                              do_sample=do_sample, temperature=temperature, seed=seed)

    def greedy_baseline(self, rollout: Rollout, metrics: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
        """ReMax: the shaped score (one per prompt) of each prompt's greedy response, and whether a
        reward could not score it."""
        k = self.config.samples_per_prompt
        start = time.perf_counter()
        rows, prompts = rollout.rows[::k], [row.get(self.config.prompt_field) for row in rollout.rows[::k]]
        seeds = None if self.environments is None else rollout.episodes.seeds[::k]
        with gathered(self.actor):
            greedy = roll_out(self.actor, self.tokenizer, self.greedy_generator, rows, prompts, self.episode_limits,
                              self.environments, seeds)
        metrics["time/generate"] += time.perf_counter() - start
        start = time.perf_counter()
        raw, _, unscored = self.score(rows, greedy)
        metrics["time/score"] += time.perf_counter() - start
        finished = torch.tensor(greedy.finished, device=self.device)
        return self.shape_scores(raw, finished, greedy.sequences.loss_mask.sum(dim=1)), unscored

    def shape_scores(self, scores: torch.Tensor, finished: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Each response's score on its own: --missing-eos-penalty, --overlong-buffer."""
        config = self.config
        if config.missing_eos_penalty is not None:
            scores = torch.where(finished, scores, scores - config.missing_eos_penalty)
        if config.overlong_buffer is not None:
            scores = scores + overlong_penalty(lengths.to(scores.device), config.max_new_tokens, config.overlong_buffer,
                                               config.overlong_penalty)
        return scores

    def normalise_scores(self, scores: torch.Tensor, turn_rewards: torch.Tensor | None = None,
                         update_moments: bool = True, scored: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The whole batch's scores (b,) and per-turn rewards (b, T) (--turn-rewards per-turn; None
        otherwise): --score-norm, running moments of each episode's whole return (its score and its
        turns' rewards; ``scored`` (b,): the rows that move them, not an unscored one's stand-in):
        the score less their mean, every reward over their std, so the normalised rewards of an
        episode sum to its normalised return; then --score-clip on each reward."""
        config = self.config
        if config.score_norm:
            returns = scores if turn_rewards is None else scores + turn_rewards.sum(dim=1)
            if update_moments and (scored is None or scored.any()):
                self.score_moments.update(returns if scored is None else returns[scored])
            scale = self.score_moments.std + 1e-8
            scores = (scores - self.score_moments.mean) / scale
            turn_rewards = None if turn_rewards is None else turn_rewards / scale
        if config.score_clip is not None:
            scores = scores.clamp(-config.score_clip, config.score_clip)
            turn_rewards = None if turn_rewards is None else turn_rewards.clamp(-config.score_clip, config.score_clip)
        return scores, turn_rewards

    # ------------------------------------------------------------ stage 7
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
        for mb_index in minibatches:
            mb_index = mb_index.to(self.device)
            step_stats = self.accumulate_gradients(experience, mb_index, warming_up)
            if step_stats is None or self.moved_too_far(step_stats["approx_kl"], warming_up):
                self.optimizer.zero_grad(set_to_none=True)
                break  # the policy has moved far enough from the one that collected the batch
            sum_gradients(self.trainable_parameters)
            grad_norm = plain(self.accelerator.clip_grad_norm_(self.trainable_parameters, config.max_grad_norm))
            loss = sum(step_stats[key] for key in ("pg_loss", "vf_loss", "kl_loss", "entropy") if key in step_stats)
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
        stats["skipped_steps"] = self.guard.skipped
        return stats

    def entropy_coef(self) -> float:
        """This iteration's entropy coefficient: --entropy-coef, ramped in over --entropy-warmup iterations."""
        warmup = self.config.entropy_warmup
        return self.config.entropy_coef * (min(1.0, (self.iteration + 1) / warmup) if warmup else 1.0)

    def moved_too_far(self, approx_kl: torch.Tensor, warming_up: bool) -> bool:
        """--max-approx-kl: the update stops once a minibatch's approx_kl passes it."""
        return self.config.max_approx_kl is not None and not warming_up and approx_kl > self.config.max_approx_kl

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
        lengths = experience.sequences.attention_mask.sum(dim=1)
        mine = split_by_tokens(mb_index, lengths, self.processes)[self.rank]
        totals: dict[str, torch.Tensor] = {}
        parts = [torch.tensor(group, dtype=torch.long, device=self.device) for group in
                 token_micro_batches(self.pass_lengths(experience.sequences)[mine], config.max_tokens_per_micro_batch,
                                     config.train_micro_batch_size)]
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
            shares = {"pg_loss": policy_share, "kl_loss": policy_share}
            for key, value in stats.items():
                weighted = value * shares.get(key, token_share)
                totals[key] = weighted if key not in totals else totals[key] + weighted
        return self.sum_shares(totals)

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

    def sum_shares(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Scalar statistics summed over the processes, in one all-reduce (one process: as given)."""
        if self.processes == 1:
            return stats
        total = sum_across_processes(torch.stack([v.detach().float().reshape(()) for v in stats.values()]))
        return dict(zip(stats, total))

    # ------------------------------------------------------------ one iteration
    def step(self, rows: list[dict], draw_more: Callable[[], list[dict]] | None = None) -> dict[str, float]:
        """Stages 1-8 on one batch of prompt rows; returns the iteration's metrics.  ``draw_more``:
        another batch of rows, for --dynamic-sampling (see make_experience)."""
        check_step_rows(rows, self.config.prompt_field, environment_prompt if self.environments is not None
                        else prompt_check(self.config.chat_template))
        kl_coef = self.kl_controller.value  # what this iteration uses; the controller moves after it
        entropy_coef = self.entropy_coef()
        self.draws = 0  # rollouts drawn in this iteration (environment seeds)
        if self.reward is not None:
            self.reward.new_iteration()  # a judge's scores are cached within an iteration
        experience, stage_metrics = self.make_experience(rows, draw_more)
        # The vLLM engine's weight probe after its sync (docs/design.md, "The vLLM rollout engine"):
        # its gap, and its seconds taken out of the rollout's.
        probe = getattr(self.generator, "last_probe", None)
        if probe:
            stage_metrics.update(probe)
            stage_metrics["time/generate"] -= probe["time/engine_probe"]
        timings = {k: v for k, v in stage_metrics.items() if k.startswith("time/")}
        start = time.perf_counter()
        # A reward that gave a non-finite score: this batch teaches nothing, skip its update.
        # (Checked only when bad: a finite batch of scores must not reset the count of bad steps.)
        bad_scores = not is_finite(experience.raw_scores) and self.guard.skip(self.iteration + 1,
                                                                              score=experience.raw_scores)
        stats = {"skipped_steps": self.guard.skipped} if bad_scores else self.update(experience)
        timings["time/train"] = time.perf_counter() - start
        # How far the engine's numerics are from the trainer's (old log-probs read off an update
        # that was skipped were never computed: no gap to log).
        if experience.engine_logprobs is not None and not (bad_scores and self.old_logprobs_from_update):
            stage_metrics.update(engine_gap(experience.logprobs, experience.engine_logprobs, experience.mask))
            stage_metrics.update(mismatch_statistics(experience.logprobs, experience.engine_logprobs, experience.mask,
                                                     self.config.is_correction, self.config.is_cap,
                                                     self.config.is_floor))
        mask = experience.mask.float()
        if bad_scores and self.old_logprobs_from_update:  # no update, so no old log-probs and no KL measured
            kl_per_response = float("nan")
        else:
            kl_per_response = experience.kl.sum(dim=1).mean().item()  # kl is 0 on padding
            self.kl_controller.update(kl_per_response, experience.scores.shape[0])
        self.iteration += 1

        total_time = sum(timings.values())
        n_response_tokens = mask.sum().item()
        n_tokens = n_response_tokens + experience.sequences.prompt_mask.sum().item()
        metrics = {
            "score": experience.raw_scores.mean().item(),
            "score_std": experience.raw_scores.std(unbiased=False).item(),
            "kl": kl_per_response,
            "kl_coef": kl_coef,
            # The KL's share of the reward (step 5's -kl_coef * kl): not rewards less the score, which
            # would count an episode's per-turn rewards in it too.
            "non_score_reward": (-kl_coef * experience.kl.sum(dim=1).mean().item()
                                 if self.config.kl_in == "reward" else 0.0),
            "response_length": mask.sum(dim=1).mean().item(),
            "advantages_mean": masked_mean(experience.advantages, experience.mask).item(),
            "returns_mean": masked_mean(experience.returns, experience.mask).item(),
            **stats,
            **timings,
            "time/iteration": total_time,
            "tokens_per_s": n_tokens / total_time,
            "generated_tokens_per_s": stage_metrics.get("dynamic_sampling/generated_tokens", n_response_tokens)
                                      / timings["time/generate"],
            # Dynamic sampling: its counts, and the score of the batch as drawn (the kept groups are
            # chosen for their spread, so their mean says less of how the policy does).
            **{k: v for k, v in stage_metrics.items() if not k.startswith("time/")},
        }
        metrics.update(self.episode_metrics(self.last_rollout.episodes))
        metrics.update(self.reward_counts())
        for name, part in self.reward_components.items():  # each reward as it came, before its weight
            scored = part[~torch.isnan(part)]  # the rows this reward applies to (None: not this one's)
            metrics[f"reward/{name}"] = scored.mean().item() if scored.numel() else math.nan
            metrics[f"reward/{name}_std"] = scored.std(unbiased=False).item() if scored.numel() else math.nan
        if self.config.entropy_coef != 0:
            metrics["entropy_coef"] = entropy_coef
        if experience.values is not None:
            metrics["explained_variance"] = explained_variance(experience.values, experience.returns,
                                                               experience.mask).item()
        if experience.greedy_scores is not None:
            metrics["greedy_score"] = experience.greedy_scores.mean().item()
        if (self.config.score_norm or self.config.score_clip is not None or self.config.missing_eos_penalty is not None
                or self.config.overlong_buffer is not None):
            metrics["score_used"] = experience.scores.mean().item()
        return metrics

    def reward_counts(self) -> dict[str, float]:
        """What the rewards counted this iteration (a judge's judge/unparsed), summed over the processes."""
        counts = self.reward.iteration_counts() if self.reward is not None else {}
        if not counts or self.processes == 1:
            return counts
        return dict(zip(counts, sum_across_processes(torch.tensor(list(counts.values()), dtype=torch.float64,
                                                                  device=self.device)).tolist()))

    def episode_metrics(self, episodes: Episodes) -> dict[str, float]:
        """Per episode of the batch as drawn, over every process: turns, tokens (the model's and the
        environment's), the share cut by a limit, and tool calls, errors and timeouts (and what else
        the environments count, as env/<name>); nothing for single-turn rollouts."""
        if self.environments is None:
            return {}
        names = sorted(set(episodes.stats) | {"calls", "errors", "timeouts"})
        totals = torch.tensor([len(episodes.turns), sum(episodes.turns), episodes.sequences.response_mask.sum().item(),
                               sum(episodes.truncated), *(episodes.stats[name] for name in names)],
                              dtype=torch.float64, device=self.device)
        totals = sum_across_processes(totals).tolist() if self.processes > 1 else totals.tolist()
        count = max(totals[0], 1)
        metrics = {"episode/turns": totals[1] / count, "episode/tokens": totals[2] / count,
                   "episode/truncated": totals[3] / count}
        for name, total in zip(names, totals[4:]):
            metrics[f"tools/{name}" if name in ("calls", "errors", "timeouts") else f"env/{name}"] = total / count
        return metrics

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
        return state  # the weights are saved beside it (trainers/ppo_loop.py, trained_modules)

    def load_state_dict(self, state: dict) -> None:
        self.iteration = state["iteration"]
        if "optimizer" in state:  # a checkpoint's is restored with its weights (trainers/resume.py)
            load_whole_optimizer_state(self.optimizer, state["optimizer"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.score_moments.load_state_dict(state["score_moments"])
        if "guard" in state:
            self.guard.load_state_dict(state["guard"])
        if "minibatch_rng" in state:
            self.minibatch_rng.set_state(state["minibatch_rng"])
        if state.get("value_head") is not None and isinstance(self.critic, SharedHeadCritic):
            self.critic.value_head.load_state_dict(state["value_head"])  # a checkpoint from before critic folders
