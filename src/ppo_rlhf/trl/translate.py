"""A TRL config read into this project's settings (docs/migrating_from_trl.md).

:func:`refuse_unmatched` holds a config to ppo_rlhf/trl/fields.py's table: a field with no
counterpart here, set to anything but TRL's default, stops the trainer's construction, named.
:func:`common_settings`, :func:`ppo_settings` and :func:`online_settings` turn the rest into the
values of this project's ``PPOConfig`` (trainers/ppo_config.py), TRL's arithmetic for the batch
sizes and the run's length included; each returns beside them the notes the run's plan prints
where the run will differ from TRL's (a learning rate kept constant, prompts drawn with
replacement, ...).
"""

from __future__ import annotations

import json
import math

from ppo_rlhf.config import ConfigError
from ppo_rlhf.trl.fields import REFUSED, fates_of

# The trackers this project writes to; TrainingArguments' report_to may name more.
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
IS_MODES = {"token_truncate": "token-truncate", "token_mask": "token-mask", "sequence_truncate": "sequence-truncate",
            "sequence_mask": "sequence-mask"}


def refused_value(config, name: str, value, why: str) -> ConfigError:
    return ConfigError(f"{type(config).__name__}.{name}={value!r}: {why} (docs/migrating_from_trl.md)")


def refuse_unmatched(config) -> None:
    """ConfigError for the first field set to a value this project has no counterpart for: one the
    table refuses, away from TRL's default (compared after TrainingArguments' own normalising, on a
    config of the same class built with defaults) and from the values it also accepts."""
    reference = type(config)(output_dir=config.output_dir, **reference_sizes(config))
    for name, fate in fates_of(type(config)).items():
        value = getattr(config, name)
        if fate.kind != REFUSED or value == getattr(reference, name) or value in fate.allowed:
            continue
        raise refused_value(config, name, value, f"no counterpart in ppo-rlhf: {fate.text}")


def reference_sizes(config) -> dict:
    """The fields a config of the GRPO family needs to build with defaults beside this one (its
    generation batch must hold whole groups)."""
    if hasattr(config, "num_generations"):
        return {"num_generations": config.num_generations, "per_device_train_batch_size": config.num_generations}
    return {}


def steps_of(config, strategy: str, steps: float | None, iterations: int, per_epoch: float) -> int:
    """An evaluation or save interval of TrainingArguments in iterations: 'steps' every ``steps``
    (a fraction below 1: of the run, as transformers reads it), 'epoch' every pass over the
    prompts, 'no' 0 (only at the end)."""
    strategy = str(getattr(strategy, "value", strategy))
    if strategy == "no":
        return 0
    if strategy == "epoch":
        return max(1, round(per_epoch))
    if strategy != "steps":
        raise refused_value(config, "save_strategy", strategy, "allowed: steps, epoch or no")
    steps = steps if steps is not None else config.logging_steps
    return max(1, math.ceil(steps * iterations) if steps < 1 else int(steps))


def report_to(config) -> str:
    names = [name for name in config.report_to or [] if name != "none"]
    unknown = [name for name in names if name not in TRACKERS]
    if unknown and "all" not in names:
        raise refused_value(config, "report_to", config.report_to,
                            f"ppo-rlhf writes metrics.jsonl and reports to {', '.join(TRACKERS)}; {unknown[0]} is none "
                            f"of them")
    names = [name for name in names if name in TRACKERS]
    return ",".join(names) or "none"


def common_settings(config) -> tuple[dict, list[str]]:
    """The TrainingArguments fields every TRL trainer reads, as this project's settings."""
    notes = []
    if str(getattr(config.lr_scheduler_type, "value", config.lr_scheduler_type)) != "constant":
        notes.append(f"learning rate: {config.learning_rate:g} throughout; TRL's lr_scheduler_type "
                     f"{getattr(config.lr_scheduler_type, 'value', config.lr_scheduler_type)} would decay it to 0")
    if getattr(config, "bf16_unavailable", False):
        notes.append("bf16: no GPU here computes in bf16, so the run trains in float32 (TRL's bf16 default would "
                     "refuse to start)")
    settings = {
        "out": config.output_dir, "overwrite": True, "seed": config.seed, "lr": config.learning_rate,
        "weight_decay": config.weight_decay, "adam_eps": config.adam_epsilon, "max_grad_norm": config.max_grad_norm,
        "mixed_precision": "bf16" if config.bf16 else "fp16" if config.fp16 else "no",
        "device": "cpu" if config.use_cpu else "auto",
        "gradient_checkpointing": bool(config.gradient_checkpointing or config.activation_checkpointing),
        "report_to": report_to(config),
    }
    notes.append(f"output_dir {config.output_dir}: a run already there is replaced, as TRL writes over it")
    return settings, notes


def run_length(settings: dict, config, iterations: int, prompts: int | None, prompts_per_iteration: int) -> None:
    """The evaluation and save intervals, in iterations, beside ``iterations``."""
    per_epoch = (prompts or prompts_per_iteration) / prompts_per_iteration
    settings["iterations"] = iterations
    settings["eval_every"] = steps_of(config, config.eval_strategy, config.eval_steps, iterations, per_epoch)
    settings["save_every"] = steps_of(config, config.save_strategy, config.save_steps, iterations, per_epoch)


def exact_share(config, total: int, parts: int, what: str, name: str) -> int:
    """``total / parts``, or TRL's refusal where it does not divide."""
    if total % parts:
        raise refused_value(config, name, getattr(config, name), f"{what} ({total}) must be a multiple of {name}")
    return total // parts


# ---------------------------------------------------------------- TRL's PPOTrainer
def ppo_settings(config, prompts: int, processes: int = 1) -> tuple[dict, list[str]]:
    """TRL's PPOConfig as settings of this project's PPO (estimator gae): TRL's batch arithmetic --
    per_device_train_batch_size x gradient_accumulation_steps x processes sequences a rollout,
    num_mini_batches minibatches of it, num_ppo_epochs passes, ceil(total_episodes / batch)
    iterations -- and its PPO: k1 KL per token in the reward, whitened advantages, TRL's lam."""
    if config.stop_token and config.stop_token_id is not None:
        raise refused_value(config, "stop_token_id", config.stop_token_id, "give stop_token or stop_token_id, not "
                                                                            "both (TRL's rule)")
    if config.stop_token not in (None, "eos"):
        raise refused_value(config, "stop_token", config.stop_token, "allowed: 'eos' or None (TRL's rule)")
    if config.kl_estimator != "k1":
        raise refused_value(config, "kl_estimator", config.kl_estimator,
                            "ppo-rlhf puts only k1 in the reward, where PPO differentiates the KL through the score "
                            "function and only k1 pulls toward the reference; use kl_estimator='k1'")
    settings, notes = common_settings(config)
    batch = config.per_device_train_batch_size * config.gradient_accumulation_steps * processes
    mini_batch = exact_share(config, batch, config.num_mini_batches, "the rollout batch", "num_mini_batches")
    micro = config.per_device_train_batch_size
    episodes = config.total_episodes if config.total_episodes is not None else int(config.num_train_epochs * prompts)
    iterations = max(1, math.ceil(episodes / batch))
    settings.update({
        "estimator": "gae", "samples_per_prompt": 1, "batch_size": batch, "mini_batch_size": mini_batch,
        "train_micro_batch_size": micro if (mini_batch // processes) % micro == 0 else None,
        "ppo_epochs": config.num_ppo_epochs, "kl_coef": config.kl_coef, "kl_in": "reward", "kl_estimator": "k1",
        "clip_ratio": config.cliprange, "vf_coef": config.vf_coef, "cliprange_value": config.cliprange_value,
        "gamma": config.gamma, "lam": config.lam, "whiten_advantages": True, "max_new_tokens": config.response_length,
        "temperature": config.temperature, "missing_eos_penalty": config.missing_eos_penalty,
        "rollout_micro_batch_size": config.local_rollout_forward_batch_size, "disable_dropout": True,
        "sample_every": (max(1, iterations // config.num_sample_generations) if config.num_sample_generations > 0
                         else 0),
    })
    run_length(settings, config, iterations, prompts, batch)
    notes.append(f"batch: {batch} rollouts an iteration (per_device_train_batch_size x gradient_accumulation_steps"
                 f" x {processes} process(es)), {config.num_mini_batches} minibatch(es), {iterations} iterations "
                 f"for {episodes} episodes")
    notes.append("prompts: drawn at random with replacement each iteration; TRL's data loader shuffled each epoch")
    if config.stop_token is None and config.stop_token_id is None:
        notes.append(f"stop_token: a response ends at EOS here; TRL (stop_token unset) generated "
                     f"{config.response_length} tokens whatever came and scored them all")
    elif config.stop_token_id is not None:
        notes.append(f"stop_token_id {config.stop_token_id}: a response ends there, and at EOS too")
    return settings, notes


# ---------------------------------------------------------------- TRL's GRPOTrainer and RLOOTrainer
def online_settings(config, kind: str, prompts: int | None, processes: int = 1) -> tuple[dict, list[str]]:
    """TRL 1.16's GRPOConfig (``kind`` grpo) or RLOOConfig (rloo) as this project's settings: the
    generation batch is the rollout batch, per_device_train_batch_size x gradient_accumulation_steps
    x processes sequences an optimizer step, num_iterations passes, max_steps / (steps_per_generation
    x num_iterations) iterations; GRPO's KL k3 in the loss, RLOO's k1 in the reward."""
    settings, notes = common_settings(config)
    group = config.num_generations
    batch = config.generation_batch_size
    step = config.per_device_train_batch_size * config.gradient_accumulation_steps * processes
    if config.max_steps > 0:
        iterations = max(1, math.ceil(config.max_steps / (config.steps_per_generation * config.num_iterations)))
    elif prompts is None:
        raise refused_value(config, "max_steps", config.max_steps, "a streamed train_dataset has no length: give "
                                                                    "max_steps, as TRL requires")
    else:
        iterations = max(1, math.ceil(config.num_train_epochs * prompts * group / batch))
    settings.update({
        "estimator": kind, "samples_per_prompt": group, "batch_size": batch, "mini_batch_size": step,
        "train_micro_batch_size": config.per_device_train_batch_size, "ppo_epochs": config.num_iterations,
        "kl_coef": config.beta, "temperature": config.temperature, "max_new_tokens": config.max_completion_length,
        "disable_dropout": config.disable_dropout, "clip_ratio": config.epsilon,
        "clip_ratio_high": config.epsilon_high, "reward_weights": list(config.reward_weights or []),
        "prompt_order": "random" if config.shuffle_dataset else "in-order",
        "chat_template_kwargs": template_kwargs_text(config.chat_template_kwargs),
        # TRL's completions table: each iteration's rollouts printed, kept in samples.jsonl and rollouts/.
        "sample_every": 1 if config.log_completions else 10, "save_rollouts": 1 if config.log_completions else 0,
    })
    if config.num_generations_eval is not None:
        settings["eval_samples"] = config.num_generations_eval
    settings.update(model_init_settings(config))
    if kind == "grpo":
        settings.update(grpo_loss(config), kl_in="loss", kl_estimator="k3",
                        ratio_level=config.importance_sampling_level, entropy_coef=config.entropy_coef)
        notes.append("KL: beta x k3 per token in the loss, as TRL's GRPO" if config.beta else
                     "KL: none (beta 0, TRL's default)")
    else:  # RLOO: the KL summed into the reward, the leave-one-out baseline, advantages as they come
        settings.update(kl_in="reward", kl_estimator="k1", whiten_advantages=config.normalize_advantages,
                        loss_aggregation="sequence-mean")
        notes.append("RLOO's ratio: one per token, clipped per token; TRL's RLOO clips one ratio a sequence "
                     "(exp of its summed log-ratio)")
    settings.update(engine_settings(config))
    run_length(settings, config, iterations, prompts, batch // group)
    notes.append(f"batch: {batch // group} prompts x {group} completions an iteration (generation_batch_size), "
                 f"{batch // step} optimizer step(s) of {step} x {config.num_iterations} pass(es); {iterations} "
                 f"iterations")
    if config.shuffle_dataset:
        notes.append("prompts: drawn at random with replacement; TRL shuffles them once an epoch")
    return settings, notes


def grpo_loss(config) -> dict:
    """GRPO's loss_type and scale_rewards as this project's estimator and loss."""
    scale = config.scale_rewards
    if scale == "batch":
        raise refused_value(config, "scale_rewards", scale, "the group estimators divide by the group's std (group) "
                                                             "or nothing (none); allowed: group, none")
    settings = {"estimator": "grpo" if scale == "group" else "dr-grpo"}
    loss = config.loss_type
    aggregation = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "sequence-mean", "dr_grpo": "sequence-sum-norm",
                   "cispo": "token-mean", "sapo": "token-mean"}.get(loss)
    if aggregation is None:
        raise refused_value(config, "loss_type", loss, "allowed: dapo, bnpo, grpo, dr_grpo, cispo, sapo")
    settings["loss_aggregation"] = aggregation
    if loss in ("cispo", "sapo"):
        settings["policy_loss"] = loss
    if loss == "sapo":
        settings.update(sapo_tau_pos=config.sapo_temperature_pos, sapo_tau_neg=config.sapo_temperature_neg,
                        clip_ratio=None, clip_ratio_high=None)
    return settings


def engine_settings(config) -> dict:
    """use_vllm and its importance weights as --rollout-engine vllm and --is-correction."""
    if config.vllm_mode != "colocate":
        raise refused_value(config, "vllm_mode", config.vllm_mode,
                            "ppo-rlhf's vLLM engine runs in the training process (vllm_mode='colocate'); a generation "
                            "server (TRL's 'server' mode, trl vllm-serve) is not built yet: use vllm_mode='colocate', "
                            "or leave use_vllm off for the built-in decoding loop")
    if not config.use_vllm:
        return {}
    from ppo_rlhf.rollout.vllm_engine import import_vllm

    try:
        import_vllm()
    except ConfigError as error:  # its message says how to install vLLM
        raise refused_value(config, "use_vllm", True, f"{str(error).removeprefix('--rollout-engine vllm: ')}; or "
                                                      f"leave use_vllm off for the built-in decoding loop") from None
    settings = {"rollout_engine": "vllm", "vllm_memory_utilization": config.vllm_gpu_memory_utilization}
    if not getattr(config, "vllm_importance_sampling_correction", True):
        return {**settings, "is_correction": "none"}
    mode = getattr(config, "vllm_importance_sampling_mode", "sequence_mask")
    if mode not in IS_MODES:
        raise refused_value(config, "vllm_importance_sampling_mode", mode, f"allowed: {', '.join(IS_MODES)}")
    settings.update(is_correction=IS_MODES[mode], is_cap=config.vllm_importance_sampling_clip_max)
    if mode.endswith("mask") and config.vllm_importance_sampling_clip_min is not None:
        settings["is_floor"] = config.vllm_importance_sampling_clip_min
    return settings


def model_init_settings(config) -> dict:
    """model_init_kwargs: the dtype the model loads in; any other key is refused."""
    kwargs = config.model_init_kwargs or {}
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    others = sorted(set(kwargs) - {"dtype", "torch_dtype"})
    if others:
        raise refused_value(config, "model_init_kwargs", kwargs, f"ppo-rlhf loads the model in a dtype of its "
                                                                 f"choosing only; {others[0]} has no counterpart")
    if dtype is None:
        return {}
    name = str(dtype).replace("torch.", "")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "float": "float32", "half": "float16"}
    name = aliases.get(name, name)
    if name not in ("auto", "float32", "bfloat16", "float16"):
        raise refused_value(config, "model_init_kwargs", kwargs, "allowed dtypes: auto, float32, bfloat16, float16")
    return {"dtype": name}


def template_kwargs_text(kwargs) -> str:
    """chat_template_kwargs (a dict, or its JSON) as --chat-template-kwargs' key=value text."""
    if not kwargs:
        return ""
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    return ",".join(f"{key}={json.dumps(value)}" for key, value in kwargs.items())
