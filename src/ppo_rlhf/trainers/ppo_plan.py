"""What a PPO run will do, said before its first update, and the settings that cannot learn.

A run that cannot learn should say so at start, not after 200 flat iterations: greedy rollouts
explore nothing, and a reward that gives every response the same score has nothing to teach.
"""

from __future__ import annotations

import dataclasses
import math

from ppo_rlhf.config import flag_name, recipe_line
from ppo_rlhf.core.adaptive_lr import BAND, MAX_FACTOR
from ppo_rlhf.models.lora import ALL_LINEAR_AND_OUTPUT, LoraOptions, output_layer_tied
from ppo_rlhf.trainers.estimators import teacher_in_score
from ppo_rlhf.trainers.ppo_config import GSPO_CLIP, PPOConfig
from ppo_rlhf.trainers.roles import float32_merge_note, float32_merges
from ppo_rlhf.trainers.token_budget import AUTO, TokenBudget, describe


def _count(parameters) -> str:
    n = sum(p.numel() for p in parameters)
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n:,}"


def plan_lines(config: PPOConfig, roles, trainer, n_prompts: int) -> list[str]:
    """A few lines: each role, the rollout, the update, the KL.  ``roles``: anything with the
    ``actor`` and ``reward`` (the trainer itself)."""
    first = next(roles.actor.parameters())
    where = f"{first.device}, {str(first.dtype).replace('torch.', '')}"
    critic_ids = {id(p) for p in trainer.critic.parameters()} if trainer.critic is not None else set()
    actor_trained = [p for p in trainer.trainable_parameters if id(p) not in critic_ids]
    critic_trained = [p for p in trainer.trainable_parameters if id(p) in critic_ids]
    if config.lora:
        actor = f"LoRA policy adapter (r {config.lora_r}) on {config.model}" + (
            " (its output layer, tied to the input embeddings, not adapted: the layers below it move the logits)"
            if tied_head_unadapted(config, roles.actor) and not tied_head_matters(config, roles.actor) else "")
        reference = "the same base with adapters disabled"
    else:
        actor = f"{config.model} (all weights trained)"
        reference = f"a frozen copy of {config.model}"
    critic = {"shared": "value head on the actor's trunk", "separate": "a separate model",
              "lora": "its own LoRA adapter + value head on the shared base"}[config.critic]
    critic = (f"{critic}; {_count(critic_trained)} parameters trained" if trainer.critic is not None
              else f"none (estimator {config.estimator})")
    k = config.samples_per_prompt
    prompts = f"{config.batch_size} prompts" if k == 1 else f"{config.batch_size // k} prompts x {k} samples"
    reward = roles.reward.plan() if hasattr(roles.reward, "plan") else type(roles.reward).__name__  # a ScoringReward of one's own
    environments = getattr(trainer, "environments", None)
    if environments is not None and environments.pays:
        paid = f"{config.environment_reward_weight:g} x the environment's rewards" + (
            " (each step's on its turn)" if config.turn_rewards == "per-turn" else "")
        reward = paid if roles.reward is None else f"{reward} + {paid}"
    teacher = getattr(trainer, "teacher", None)
    if teacher is not None:
        reward = teacher_reward(config) + ("" if roles.reward is None and not (environments and environments.pays)
                                           else f"; plus {reward}")
    decoding = f"sampled at temperature {config.temperature:g}" if config.do_sample else "GREEDY"
    if config.estimator == "remax":
        decoding += ", plus one greedy response per prompt (the baseline)"
    minibatches = config.batch_size // config.mini_batch_size
    merges = float32_merges(config)  # adapters loaded as models, merged into 16-bit bases
    kl = (f"{config.kl_estimator_used} in the {config.kl_in}, kl_coef {config.kl_coef:g}"
          + (f" adapted toward {config.target_kl:g} per response" if config.target_kl is not None else " (fixed)"))
    recipe = recipe_line(config)
    return [
        *([f"recipe:    {recipe}"] if recipe else []),
        f"actor:     {actor}; {_count(actor_trained)} parameters trained, on {where}",
        f"reference: {reference}",
        *([f"teacher:   {teacher.description}, frozen; its log-probs of the model's own tokens, at the rollout's "
           f"temperature" + ("; the model's own, for its reward: those it sampled with (no pass of their own)"
                             if trainer.old_logprobs_from_update else "")] if teacher is not None else []),
        f"critic:    {critic}",
        f"reward:    {reward}",
        *([f"merged:    {float32_merge_note(merges)}"] if merges else []),
        f"rollout:   {prompts} per iteration (drawn from {n_prompts}), {decoding}, "
        f"up to {config.max_new_tokens} new tokens" + (" a turn" if environments is not None else "")
        + _engine(config, trainer.actor, trainer.generator),
        *([episode_line(config, environments)] if environments is not None else []),
        f"update:    {config.ppo_epochs} epochs x {minibatches} minibatches of {config.mini_batch_size}, "
        f"lr {config.lr:g}" + _lr_control(trainer.lr_control)
        + (f" (critic {config.critic_lr or config.lr:g})" if trainer.critic is not None else "")
        + f"; advantages: {config.estimator}, loss {config.loss_aggregation}" + _entropy_term(config),
        *(["old log-probs: read off the update's forward pass (one step per batch: the weights that sampled "
           "it; no pass of their own)"] if trainer.old_logprobs_from_update else []),
        f"passes:    {trainer.wanted_pass_plan.describe()} (checked against the model's own padded pass on the "
        f"first batch)" + (f"; each distinct prompt runs once per forward pass, its {k} responses on its cached keys "
                           f"and values, where that runs fewer positions" if trainer.wanted_pass_plan.share_prompts
                           else "") + "; " + micro_batch_line(config, trainer.token_budget, trainer.wanted_pass_plan.fused),
        f"KL:        {kl}",
        *variant_lines(config),
    ]


def teacher_reward(config: PPOConfig) -> str:
    """What on-policy distillation adds to the reward, and where the estimator takes it."""
    if config.teacher_in == "loss":
        return (f"{config.teacher_coef:g} x the exact reverse KL to the teacher over the vocabulary at each position "
                f"the model wrote, in the loss (on-policy distillation, GKD's divergence); no reward of its own")
    where = ("summed over each response into its score, before the group baseline" if teacher_in_score(config.estimator)
             else "per token, in the reward-to-go" + (" and the critic's returns" if config.estimator == "gae" else ""))
    return f"{config.teacher_coef:g} x -(log pi - log teacher) on each token the model wrote (on-policy distillation), {where}"


def episode_line(config: PPOConfig, environments) -> str:
    """How an episode runs (docs/agents.md)."""
    tools = environments.tools
    names = ", ".join(t["function"]["name"] for t in tools)
    budget = (f"{config.max_episode_tokens} tokens" if config.max_episode_tokens is not None
              else "what --max-length leaves after the prompt")
    return (f"episodes:  {environments.description}; up to {config.max_turns} turns and {budget}"
            + (f"; tools {names} (parsed as {environments.parser_name}, {config.tool_timeout:g} s each)" if tools else "")
            + "; the environment's tokens attended, never trained on"
            + "".join(f"; {note}" for note in environments.notes))


def micro_batch_line(config: PPOConfig, budget: TokenBudget | None = None, fused: bool = True) -> str:
    """How the rollout's passes and the update's minibatches are cut into micro-batches; ``budget``:
    the run's (trainers/token_budget.py; None: the config's number), ``fused``: the output layer's way."""
    rollout, update = config.rollout_micro_batch_size, config.train_micro_batch_size
    rollout_text = f"{rollout} rows a rollout pass" if rollout else "the whole batch a rollout pass"
    update_text = f"{update} rows an update micro-batch" if update else "the whole minibatch an update pass"
    cap = lambda rows: f", {rows} rows at most" if rows else ""  # noqa: E731
    grouped = (f"rows grouped longest first (rollout passes{cap(rollout)}; update{cap(update)}; a minibatch split "
               f"over processes by tokens)")
    if config.max_tokens_per_micro_batch == AUTO:
        if budget is None:  # before a trainer has measured the memory
            return f"micro-batches of a token budget chosen at start (auto), {grouped}"
        tokens = budget.tokens(config.max_length, fused)
        short = (" -- less than one --max-length row, which then runs alone and may not fit: "
                 "--gradient-checkpointing holds less" if tokens < config.max_length else "")
        return (f"micro-batches of up to {tokens:,} tokens ({describe(budget, config.max_length, fused)}{short}), "
                f"{grouped}; rows that fit in one pass as without a budget: {rollout_text}, {update_text}")
    if config.max_tokens_per_micro_batch is not None:
        return f"micro-batches of up to {config.max_tokens_per_micro_batch} tokens, {grouped}"
    return f"{rollout_text}, {update_text}"


def variant_lines(config: PPOConfig) -> list[str]:
    """A line for each policy-loss variant in force (docs/design.md, "Policy-loss variants")."""
    lines = []
    if config.policy_loss == "cispo":
        low = ("no lower bound" if config.clip_ratio_low is None or config.clip_ratio_low >= 1
               else f"1 - {config.clip_ratio_low:g}")
        lines.append(f"loss:      CISPO: each token's log-prob gradient weighted by its ratio clipped to [{low}, "
                     f"1 + {config.clip_high:g}], a constant (no token loses its gradient)")
    elif config.policy_loss == "sapo":
        lines.append(f"loss:      SAPO: a soft gate 4/tau sigmoid(tau (ratio - 1)) in place of the clip, tau "
                     f"{config.sapo_tau_pos:g} for positive advantages, {config.sapo_tau_neg:g} for the others")
    elif config.clip_low != config.clip_high or config.ratio_level == "sequence" or config.dual_clip is not None:
        level = ("per response (GSPO-token: exp of the mean token log-ratio, each token keeping its own advantage)"
                 if config.ratio_level == "sequence" else "per token")
        clip = f"ratio {level} clipped to [1 - {config.clip_low:g}, 1 + {config.clip_high:g}]"
        if config.ratio_level == "sequence":
            clip += f" (the GSPO paper: {GSPO_CLIP})"
        if config.dual_clip is not None:
            clip += f"; dual clip: a negative advantage's loss at most {config.dual_clip:g} x |A|"
        lines.append(f"clip:      {clip}")
    if config.dynamic_sampling:
        on = ("rewards, before any shaping, are" if config.dynamic_sampling_on == "accuracy"
              else "shaped scores are")
        lines.append(f"sampling:  dynamic (DAPO): groups whose {config.samples_per_prompt} {on} all equal are "
                     f"dropped and more prompts rolled out, up to {config.max_resample_rounds} extra rounds; a batch "
                     f"still short is completed with dropped groups")
    if config.overlong_buffer is not None:
        start = config.max_new_tokens - config.overlong_buffer
        lines.append(f"overlong:  responses past {start} tokens lose up to {config.overlong_penalty:g} of their score, "
                     f"linearly to {config.max_new_tokens}")
    return lines


def _entropy_term(config: PPOConfig) -> str:
    if config.entropy_coef == 0:
        return ""
    kind = "bonus" if config.entropy_coef > 0 else "penalty"
    ramp = f", ramped in over {config.entropy_warmup} iterations" if config.entropy_warmup else ""
    return f"; entropy {kind} {config.entropy_coef:g}{ramp}"


def sharded_roles(trainer) -> str:
    """The roles an FSDP launch split over the processes, as a phrase for the run's plan."""
    from torch.distributed.fsdp import FSDPModule

    roles = {"actor": trainer.actor, "critic": getattr(trainer.critic, "backbone", None), "reference": trainer.ref,
             "reward model": getattr(trainer.reward, "model", None), "teacher": getattr(trainer.teacher, "model", None)}
    names = [name for name, model in roles.items() if isinstance(model, FSDPModule)]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]


# Below this temperature sampling is greedy decoding in all but name: two tokens one logit apart
# are drawn e^(1 / T) : 1 (22,026 : 1 at 0.1), so the copies of a prompt get the same response.
GREEDY_TEMPERATURE = 0.1


def plan_warnings(config: PPOConfig, actor=None) -> list[str]:
    """Settings that cannot learn, known before the first rollout.  ``actor``: the policy as built
    (what LoRA adapted on it)."""
    warnings = []
    if not config.do_sample:
        warnings.append("greedy rollouts (--no-do-sample): every copy of a prompt gets the same response and nothing "
                        "is explored, so PPO barely learns; this is a debugging mode (drop --no-do-sample to sample)")
    elif config.temperature < GREEDY_TEMPERATURE:
        odds = math.exp(min(1 / config.temperature, 700))
        warnings.append(f"--temperature {config.temperature:g} samples as greedy decoding does: two tokens one logit "
                        f"apart are drawn {odds:.3g} : 1, so the copies of a prompt get the same response and little "
                        f"is explored, and PPO barely learns; sample at 0.6 to 1 (1: as the model was trained)")
    if tied_head_matters(config, actor):
        warnings.append(f"--lora: the output layer of {config.model} is tied to its input embeddings, so it is not "
                        f"adapted (an adapter merged into it would change the embeddings as well), and the policy "
                        f"moves its logits only through the layers below it; a model this small "
                        f"({_count(actor.parameters())} parameters, under {_count_number(SMALL_MODEL)}) may have too "
                        f"little below its head for that, and stay flat where training every weight learns (a random "
                        f"tiny Llama did): drop --lora to train them all.  A larger model trains its other layers "
                        f"well enough (SmolLM2-135M, tied too, learns with the agents recipes' --lora)")
    if not config.lora:  # the LoRA shape options do nothing on a full model (docs/design.md, "Configuration")
        unused = [flag_name(f) for f in dataclasses.fields(LoraOptions)
                  if f.name != "lora" and getattr(config, f.name) != f.default]
        if unused:
            warnings.append(f"{', '.join(unused)} given without --lora: they shape LoRA adapters, and this run trains "
                            f"the full model (add --lora, or drop them)")
    return warnings


# A tied output layer left unadapted by --lora matters where the layers below it are few and
# narrow: a user's random tiny Llama stayed flat with --lora over 200 iterations where training every
# weight learned (docs/design.md, "Defaults that learn"), while SmolLM2-135M, whose head is tied too,
# learns with --lora in the agents recipes (docs/benchmarks.md, "Agents").  Between the two, below
# this many parameters the plan warns; above it, it says so in the actor's line.
SMALL_MODEL = 50_000_000


def tied_head_unadapted(config: PPOConfig, actor) -> bool:
    """--lora with the default targets on a model whose output layer is its input embeddings: the
    head is not adapted (models/lora.py, ``target_modules``)."""
    return bool(config.lora and actor is not None and config.lora_target_modules == ALL_LINEAR_AND_OUTPUT
                and output_layer_tied(actor))


def tied_head_matters(config: PPOConfig, actor) -> bool:
    """Whether the unadapted tied head is worth a warning: on a model under SMALL_MODEL parameters."""
    return tied_head_unadapted(config, actor) and sum(p.numel() for p in actor.parameters()) < SMALL_MODEL


def _count_number(n: int) -> str:
    return f"{n / 1e6:g}M"


def score_spread_warning(metrics: dict, iteration: int) -> str | None:
    """A reward that gives the whole batch one score teaches nothing: the advantages are then the
    KL penalty's alone (under distillation the teacher's reward is the signal: no warning)."""
    if metrics.get("score_std") == 0.0 and "teacher/reverse_kl" not in metrics:  # a teacher's signal is per token
        return (f"every response of iteration {iteration} got the same score ({metrics['score']:g}): the reward has "
                f"no spread across the batch, so there is nothing to learn from it; check the reward on a few "
                f"responses (the first training samples are in the metrics)")
    return None


def _engine(config, actor=None, generator=None) -> str:
    """The rollout engine, when it is not the built-in one: its precision and the weight probe's,
    from ``actor`` where it is built (a LoRA base kept in bf16 computes in bf16); a server's from
    the ``generator`` that asked it."""
    if config.rollout_engine == "torch":
        return ""
    mode = config.is_correction
    if mode == "none":
        weights = "no importance weights"
    elif mode in ("token-truncate", "sequence-truncate"):
        weights = f"importance weights {mode}, cap {config.is_cap:g}"
    else:
        weights = f"importance weights {mode} to [{config.is_floor:.4g}, {config.is_cap:g}]"
    import torch

    from ppo_rlhf.rollout.vllm_engine import PROBE_TOLERANCE, engine_dtype, probe_precision  # (vLLM is not imported)

    dtype = getattr(generator, "dtype", None) or engine_dtype(config.mixed_precision)
    compared = probe_precision(actor, dtype) if actor is not None else dtype
    tolerance = config.vllm_probe_tolerance or PROBE_TOLERANCE[compared]
    name = str(dtype).removeprefix("torch.")
    probe = f"checked by a probe in {str(compared).removeprefix('torch.')}, tolerance {tolerance:g}"
    if config.rollout_engine == "vllm-server":
        servers = ", ".join(getattr(generator, "servers_described", lambda: config.server_url)())
        staleness = getattr(config, "max_staleness", 0)
        timing = ("synchronous: each rollout after the update's push" if not staleness else
                  f"asynchronous: the next batches generated while the trainer updates, samples at most {staleness} "
                  f"versions old")
        return (f"; engine vllm-server at {servers} in {name} (weights pushed after each update, {probe}; {timing}; "
                f"{weights})")
    return f"; engine vllm in {name} (weights synced before each rollout and {probe}; {weights})"


def _lr_control(control) -> str:
    """--lr-target-kl: how the actor's lr moves (core/adaptive_lr.py)."""
    if control is None:
        return ""
    return (f" adapted at each step after the first toward approx_kl {control.target:g} from the sampling policy "
            f"(x sqrt(target / kl) outside [{control.target / BAND:g}, {control.target * BAND:g}], at most "
            f"x{MAX_FACTOR:g} or /{MAX_FACTOR:g} a step, within [{control.low:g}, {control.high:g}])")
