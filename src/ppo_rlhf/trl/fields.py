"""What every field of TRL's configs becomes here (docs/migrating_from_trl.md prints this table).

A field has one of three fates:

- **maps**: it sets the setting of this project named beside it (ppo_rlhf/trl/translate.py does
  the arithmetic, and refuses a value with no counterpart, naming it);
- **inert**: accepted and without effect on training here (logging, data loaders, the Hub while
  nothing is pushed, sizes TRL computes itself), for the reason given;
- **refused**: accepted at TRL's default (and the values listed), refused at construction otherwise,
  the message naming the field and what to do.

A TrainingArguments field of a transformers release newer than this table is refused unless left at
its default, so nothing a config says is dropped without a word.  ``python -m ppo_rlhf.trl.fields``
prints the table as docs/migrating_from_trl.md holds it (tests/test_trl.py compares the two).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MAPS, INERT, REFUSED = "maps", "inert", "refused"


@dataclass(frozen=True)
class Fate:
    kind: str  # MAPS, INERT or REFUSED
    text: str  # the setting it maps to, why it does nothing here, or what to do instead
    allowed: tuple = ()  # REFUSED: values accepted besides TRL's default (they mean the same here)


def maps(text: str) -> Fate:
    return Fate(MAPS, text)


def inert(text: str) -> Fate:
    return Fate(INERT, text)


def refused(text: str, *allowed) -> Fate:
    return Fate(REFUSED, text, tuple(allowed))


def each(names: str, fate: Fate) -> dict[str, Fate]:
    return dict.fromkeys(names.split(), fate)


LAUNCH = "ppo-rlhf runs several processes under `accelerate launch` / torchrun (docs/scaling.md)"
NO_METRIC = "evaluation here is generation scored by the reward or the task, not a loss over labels"
HUB = "used only by push_to_hub, which is refused (ppo-rlhf runs offline)"
CONSTANT_LR = "ppo-rlhf keeps the learning rate constant (no scheduler, no warmup)"

# ---------------------------------------------------------------- transformers.TrainingArguments
TRAINING_ARGUMENTS: dict[str, Fate] = {
    "output_dir": maps("out: the run folder (config.yaml, metrics.jsonl, checkpoints/, summary.json)"),
    "per_device_train_batch_size": maps("the rows of one forward/backward pass; x gradient_accumulation_steps x "
                                        "processes: the sequences of one optimizer step (mini_batch_size)"),
    "gradient_accumulation_steps": maps("with per_device_train_batch_size: the sequences of one optimizer step "
                                        "(mini_batch_size, in train_micro_batch_size passes)"),
    "num_train_epochs": maps("iterations, where max_steps (GRPO, RLOO) or total_episodes (PPO) is not given: the "
                             "passes over the training prompts"),
    "max_steps": maps("iterations = max_steps / (steps_per_generation x num_iterations) (GRPO, RLOO: optimizer "
                      "steps); PPO ignores it, as TRL's did (total_episodes)"),
    "learning_rate": maps("lr"),
    "lr_scheduler_type": refused(f"{CONSTANT_LR}; TRL's default (linear decay to 0) is the one accepted, and the "
                                 f"plan says the rate stays constant", "constant"),
    "lr_scheduler_kwargs": refused(CONSTANT_LR),
    "warmup_steps": refused(f"{CONSTANT_LR}; leave warmup_steps at 0"),
    "optim": refused("ppo-rlhf trains with AdamW (fused where torch has the kernel)", "adamw_torch",
                     "adamw_torch_fused"),
    "optim_args": refused("ppo-rlhf's AdamW takes weight_decay, adam_epsilon and the learning rate"),
    "weight_decay": maps("weight_decay"),
    "adam_beta1": refused("ppo-rlhf's AdamW keeps torch's betas (0.9, 0.999)"),
    "adam_beta2": refused("ppo-rlhf's AdamW keeps torch's betas (0.9, 0.999)"),
    "adam_epsilon": maps("adam_eps"),
    "optim_target_modules": refused("no GaLore-style optimizers here"),
    "average_tokens_across_devices": inert("the loss is averaged as one process would average it, whatever the "
                                           "process count (docs/design.md, \"Scale\")"),
    "max_grad_norm": maps("max_grad_norm"),
    "label_smoothing_factor": refused("no labels: the losses are PPO's"),
    "bf16": maps("mixed_precision bf16 (left empty: TRL's default where a GPU computes in bf16, float32 elsewhere)"),
    "fp16": maps("mixed_precision fp16"),
    "bf16_full_eval": inert("held-out generation runs under the training precision"),
    "fp16_full_eval": inert("held-out generation runs under the training precision"),
    "tf32": inert("torch's matmul precision is left as torch has it"),
    "activation_checkpointing": maps("gradient_checkpointing (transformers 5's name)"),
    "activation_checkpointing_kwargs": inert("ppo-rlhf checkpoints each decoder layer, non-reentrant"),
    "gradient_checkpointing": maps("gradient_checkpointing (TRL's default: on)"),
    "gradient_checkpointing_kwargs": inert("ppo-rlhf checkpoints each decoder layer, non-reentrant"),
    "torch_compile": refused("ppo-rlhf does not compile the model (benchmarks/results/compile.md measured no gain)"),
    "torch_compile_backend": refused("ppo-rlhf does not compile the model"),
    "torch_compile_mode": refused("ppo-rlhf does not compile the model"),
    "use_liger_kernel": refused("no Liger kernels here; ppo-rlhf's fused output layer already avoids the logits"),
    "liger_kernel_config": refused("no Liger kernels here"),
    "use_cache": inert("generation always uses the key/value cache, training passes never"),
    "neftune_noise_alpha": refused("no embedding noise here"),
    "torch_empty_cache_steps": inert("memory is managed by the trainer's micro-batches"),
    "auto_find_batch_size": refused("give the batch sizes (train_micro_batch_size / "
                                    "per_device_train_batch_size splits a step into passes)"),
    "logging_strategy": inert("ppo-rlhf logs every iteration to metrics.jsonl"),
    "logging_steps": inert("ppo-rlhf logs every iteration to metrics.jsonl (TRL: every 10 steps)"),
    "logging_first_step": inert("every iteration is logged"),
    "log_on_each_node": inert("the main process logs"),
    "logging_nan_inf_filter": inert("a non-finite loss skips the step (--max-bad-steps) and is counted"),
    "include_num_input_tokens_seen": inert("tokens_per_s and the token counts are logged every iteration"),
    "log_level": inert("ppo-rlhf prints its plan and progress"),
    "log_level_replica": inert("ppo-rlhf prints its plan and progress"),
    "disable_tqdm": inert("the progress bar is shown on the main process"),
    "report_to": maps("report_to (none, tensorboard, wandb, mlflow, trackio; all: tensorboard); metrics.jsonl "
                      "is always written"),
    "run_name": inert("the run is named by its folder (output_dir)"),
    "project": inert("the trackers' project is their own setting (trackers.py)"),
    "trackio_space_id": inert("Trackio runs locally here"),
    "trackio_bucket_id": inert("Trackio runs locally here"),
    "trackio_static_space_id": inert("Trackio runs locally here"),
    "eval_strategy": maps("eval_every: steps -> eval_steps' iterations; no -> at the start and the end only"),
    "eval_steps": maps("eval_every (in iterations)"),
    "eval_delay": inert("evaluation runs at the start, every eval_every iterations and at the end"),
    "per_device_eval_batch_size": inert("held-out prompts are generated in batches of the evaluator's own"),
    "prediction_loss_only": inert(NO_METRIC),
    "eval_on_start": inert("ppo-rlhf evaluates before the first iteration whenever it has held-out prompts"),
    "eval_do_concat_batches": inert(NO_METRIC),
    "eval_use_gather_object": inert(NO_METRIC),
    "eval_accumulation_steps": inert(NO_METRIC),
    "include_for_metrics": inert(NO_METRIC),
    "batch_eval_metrics": inert(NO_METRIC),
    "save_only_model": inert("a checkpoint holds the trained weights, the optimizer and the run's state; the final "
                             "model is saved alone in checkpoints/actor"),
    "save_strategy": maps("save_every: steps -> save_steps' iterations; no -> only at the end"),
    "save_steps": maps("save_every (in iterations)"),
    "save_on_each_node": inert("the main process writes the run folder"),
    "save_total_limit": inert("ppo-rlhf keeps one resumable checkpoint, checkpoints/last"),
    "enable_jit_checkpoint": inert("Ctrl-C saves a checkpoint and stops at the next iteration (interrupts.py)"),
    "push_to_hub": refused("ppo-rlhf runs offline; upload the run's checkpoints/actor folder with `hf upload` "
                           "afterwards"),
    "load_best_model_at_end": refused("ppo-rlhf keeps the final model (checkpoints/actor) and the held-out "
                                      "metrics of every evaluation in metrics.jsonl"),
    "metric_for_best_model": inert("only with load_best_model_at_end, which is refused"),
    "greater_is_better": inert("only with load_best_model_at_end, which is refused"),
    "ignore_data_skip": inert("a resume redraws the prompts from the saved generators"),
    "restore_callback_states_from_checkpoint": inert("callbacks are the script's own"),
    "full_determinism": inert("a run is repeatable from its seed on one machine"),
    "seed": maps("seed"),
    "data_seed": inert("the prompts are drawn from seed's generator"),
    "use_cpu": maps("device cpu"),
    "accelerator_config": refused(LAUNCH),
    "parallelism_config": refused(LAUNCH),
    "dataloader_drop_last": inert("no data loader: each iteration draws its prompts (prompt_order)"),
    "dataloader_num_workers": inert("no data loader: each iteration draws its prompts (prompt_order)"),
    "dataloader_pin_memory": inert("no data loader: each iteration draws its prompts (prompt_order)"),
    "dataloader_persistent_workers": inert("no data loader: each iteration draws its prompts (prompt_order)"),
    "dataloader_prefetch_factor": inert("no data loader: each iteration draws its prompts (prompt_order)"),
    "dataloader_multiprocessing_context": inert("no data loader"),
    "dataloader_in_order": inert("no data loader"),
    "remove_unused_columns": inert("every column of a row reaches the reward functions, as TRL's GRPO passes them"),
    "label_names": inert(NO_METRIC),
    "train_sampling_strategy": refused("prompts are drawn at random (prompt_order random) or in turn "
                                       "(shuffle_dataset=False)"),
    "length_column_name": inert("no length-grouped sampling"),
    "ddp_find_unused_parameters": inert(LAUNCH),
    "ddp_bucket_cap_mb": inert(LAUNCH),
    "ddp_broadcast_buffers": inert(LAUNCH),
    "ddp_static_graph": inert(LAUNCH),
    "ddp_backend": inert(LAUNCH),
    "ddp_timeout": inert(LAUNCH),
    "fsdp": refused(f"{LAUNCH}; FSDP: configs/accelerate/ (docs/scaling.md)"),
    "fsdp_config": refused(f"{LAUNCH}; FSDP: configs/accelerate/ (docs/scaling.md)"),
    "deepspeed": refused(f"no DeepSpeed here; {LAUNCH}, FSDP for models that need sharding"),
    "debug": refused("no debug modes here"),
    "skip_memory_metrics": inert("no memory metrics"),
    "do_train": inert("train() trains"),
    "do_eval": inert("evaluation runs where held-out prompts are given"),
    "do_predict": inert("no prediction loop"),
    "resume_from_checkpoint": maps("resume (train(resume_from_checkpoint=True), or this field: the run in "
                                   "output_dir continues from checkpoints/last)"),
    "local_rank": inert(LAUNCH),
    # TRL's overrides of TrainingArguments (its base config), and TRL fields every config has.
    "hub_token": inert(HUB), "hub_private_repo": inert(HUB), "hub_model_id": inert(HUB),
    "hub_strategy": inert(HUB), "hub_always_push": inert(HUB), "hub_revision": inert(HUB),
}

# ---------------------------------------------------------------- TRL's PPOConfig (0.23 - 0.29)
PPO_FIELDS: dict[str, Fate] = {
    "exp_name": inert("the run is named by its folder (output_dir)"),
    "reward_model_path": inert("read by TRL's scripts to load the reward model they pass as reward_model="),
    "sft_model_path": inert("read by TRL's scripts to load the policy they pass as model="),
    "model_adapter_name": refused("the policy is the LoRA adapter ppo-rlhf makes from peft_config (or the peft "
                                  "model's active adapter)"),
    "ref_adapter_name": refused("the reference is the LoRA base with its adapters disabled"),
    "num_ppo_epochs": maps("ppo_epochs"),
    "whiten_rewards": refused("no per-token reward whitening here; the advantages are whitened (as TRL's are), and "
                              "score_norm normalises scores by their running moments"),
    "kl_coef": maps("kl_coef, the KL as a per-token reward (kl_in reward)"),
    "kl_estimator": maps("kl_estimator k1 (k3 in the reward is refused: only k1 pulls toward the reference there)"),
    "cliprange": maps("clip_ratio"),
    "vf_coef": maps("vf_coef"),
    "cliprange_value": maps("cliprange_value"),
    "gamma": maps("gamma"),
    "lam": maps("lam (TRL's 0.95; ppo-rlhf's own default is 1)"),
    "ds3_gather_for_generation": inert("no DeepSpeed here"),
    "dataset_num_proc": inert("read by TRL's scripts for their dataset.map"),
    "num_mini_batches": maps("mini_batch_size = the rollout batch / num_mini_batches"),
    "total_episodes": maps("iterations = total_episodes / the rollout batch, rounded up (TRL's rule)"),
    "local_rollout_forward_batch_size": maps("rollout_micro_batch_size"),
    "num_sample_generations": maps("sample_every = the iterations / num_sample_generations (training rollouts "
                                   "printed and kept in samples.jsonl)"),
    "response_length": maps("max_new_tokens"),
    "stop_token": maps("eos: responses end at EOS, as every response here does; left empty TRL generates "
                       "response_length tokens whatever comes, which the plan says ppo-rlhf does not"),
    "stop_token_id": maps("the model's generation_config stop id (ppo-rlhf ends a response at EOS as well)"),
    "temperature": maps("temperature"),
    "missing_eos_penalty": maps("missing_eos_penalty"),
    "world_size": inert("computed by the trainer, as TRL's did"),
    "num_total_batches": inert("computed by the trainer, as TRL's did"),
    "micro_batch_size": inert("computed by the trainer, as TRL's did"),
    "local_batch_size": inert("computed by the trainer, as TRL's did"),
    "batch_size": inert("computed by the trainer, as TRL's did"),
    "local_mini_batch_size": inert("computed by the trainer, as TRL's did"),
    "mini_batch_size": inert("computed by the trainer, as TRL's did"),
}

VLLM_SERVER = "only with vllm_mode='server', which is not built yet"
ENGINE_ONLY = "with use_vllm only"

# ---------------------------------------------------------------- TRL 1.16's GRPOConfig and RLOOConfig
ONLINE_FIELDS: dict[str, Fate] = {
    "model_init_kwargs": maps("dtype (its dtype / torch_dtype); other keys are refused"),
    "trust_remote_code": refused("ppo-rlhf loads the architectures transformers ships"),
    "router_aux_loss_coef": refused("no Mixture-of-Experts auxiliary loss here"),
    "disable_dropout": maps("disable_dropout (TRL's default: off, dropout kept)"),
    "remove_unused_columns": inert("every column of a row reaches the reward functions"),
    "num_generations": maps("samples_per_prompt"),
    "num_generations_eval": maps("eval_samples (sampled held-out answers per prompt)"),
    "max_completion_length": maps("max_new_tokens (and with tools, max_episode_tokens: TRL counts the whole "
                                  "completion, tool answers included)"),
    "ds3_gather_for_generation": inert("no DeepSpeed here"),
    "shuffle_dataset": maps("prompt_order: True -> random (drawn with replacement; TRL shuffles each epoch), "
                            "False -> in-order"),
    "pad_to_multiple_of": inert("passes are packed or padded to the longest row"),
    "generation_batch_size": maps("batch_size (the rollout batch, in sequences)"),
    "steps_per_generation": maps("batch_size / mini_batch_size: the optimizer steps one rollout batch makes"),
    "temperature": maps("temperature"),
    "top_p": refused("responses are sampled from the whole distribution (its log-probs are the trainer's)"),
    "top_k": refused("responses are sampled from the whole distribution (its log-probs are the trainer's)"),
    "min_p": refused("responses are sampled from the whole distribution (its log-probs are the trainer's)"),
    "generation_kwargs": refused("generation takes temperature and max_completion_length only"),
    "chat_template_kwargs": maps("chat_template_kwargs"),
    "repetition_penalty": refused("responses are sampled from the whole distribution (its log-probs are the "
                                  "trainer's)"),
    "cache_implementation": inert("generation keeps its own key/value cache"),
    "use_vllm": maps("rollout_engine vllm (needs vLLM installed: make vllm-venv)"),
    "vllm_mode": maps("colocate: ppo-rlhf's vLLM engine in the training process; server is refused until the "
                      "generation server exists"),
    "vllm_model_impl": refused("the engine loads the model with vLLM's own implementation", "vllm"),
    "vllm_enable_sleep_mode": refused("the engine keeps its memory (vllm_gpu_memory_utilization)"),
    "vllm_structured_outputs_regex": refused("no constrained decoding here"),
    "vllm_server_base_url": inert(VLLM_SERVER),
    "vllm_server_host": inert(VLLM_SERVER),
    "vllm_server_port": inert(VLLM_SERVER),
    "vllm_server_timeout": inert(VLLM_SERVER),
    "vllm_group_port": inert(VLLM_SERVER),
    "vllm_gpu_memory_utilization": maps("vllm_memory_utilization (with use_vllm)"),
    "vllm_max_model_length": inert("the engine's length is max_length"),
    "vllm_tensor_parallel_size": refused("the engine runs on one GPU per process", 1),
    "beta": maps("kl_coef (GRPO: k3 in the loss, kl_in loss; RLOO: k1 summed into the reward)"),
    "num_iterations": maps("ppo_epochs"),
    "epsilon": maps("clip_ratio"),
    "epsilon_high": maps("clip_ratio_high"),
    "reward_weights": maps("reward_weights"),
    "mask_truncated_completions": refused("a response cut at max_completion_length is trained on; "
                                          "missing_eos_penalty is the way to weigh such responses here"),
    "sync_ref_model": refused("the reference stays the model training started from"),
    "ref_model_mixup_alpha": inert("only with sync_ref_model, which is refused"),
    "ref_model_sync_steps": inert("only with sync_ref_model, which is refused"),
    "log_completions": maps("sample_every 1 and save_rollouts 1: each iteration's rollouts printed, kept in "
                            "samples.jsonl and rollouts/iteration_N.jsonl (TRL's completions table)"),
    "log_multimodal": inert("text only here"),
    "num_completions_to_print": inert("the first rollouts of each logged iteration are printed"),
    "log_unique_prompts": inert("samples.jsonl keeps each rollout logged"),
    "use_transformers_continuous_batching": refused("generation is ppo-rlhf's own loop or its vLLM engine"),
    "transformers_continuous_batching_config": refused("generation is ppo-rlhf's own loop or its vLLM engine"),
    "use_transformers_paged": refused("generation is ppo-rlhf's own loop or its vLLM engine"),
}

GRPO_FIELDS: dict[str, Fate] = {
    **ONLINE_FIELDS,
    "cast_lm_head_to_fp32": refused("the output layer computes in the training precision; log-probs are taken in "
                                    "float32 chunk by chunk (fused_output_layer)"),
    "delta": refused("no upper bound on the unclipped ratio here (dual_clip bounds a negative advantage's loss)"),
    "sapo_temperature_neg": maps("sapo_tau_neg (loss_type sapo)"),
    "sapo_temperature_pos": maps("sapo_tau_pos (loss_type sapo)"),
    "vespo_k_pos": inert("only with loss_type vespo, which is refused"),
    "vespo_lambda_pos": inert("only with loss_type vespo, which is refused"),
    "vespo_k_neg": inert("only with loss_type vespo, which is refused"),
    "vespo_lambda_neg": inert("only with loss_type vespo, which is refused"),
    "importance_sampling_level": maps("ratio_level (token, or sequence: GSPO)"),
    "multi_objective_aggregation": refused("the rewards are summed with their weights, then normalised (TRL's "
                                           "sum_then_normalize)"),
    "scale_rewards": maps("estimator: group -> grpo (score - group mean) / group std; none -> dr-grpo (score - "
                          "group mean); batch is refused"),
    "loss_type": maps("loss_aggregation and policy_loss: dapo / bnpo -> token-mean; grpo -> sequence-mean; "
                      "dr_grpo -> sequence-sum-norm; cispo -> policy_loss cispo; sapo -> policy_loss sapo; luspo "
                      "and vespo are refused"),
    "top_entropy_quantile": refused("every token's loss is kept (no entropy mask)"),
    "entropy_coef": maps("entropy_coef"),
    "use_adaptive_entropy": refused("entropy_coef is fixed (or ramped in by entropy_warmup)"),
    "entropy_coef_min": inert("only with use_adaptive_entropy, which is refused"),
    "entropy_coef_max": inert("only with use_adaptive_entropy, which is refused"),
    "entropy_coef_delta": inert("only with use_adaptive_entropy, which is refused"),
    "entropy_target": inert("only with use_adaptive_entropy, which is refused"),
    "max_tool_calling_iterations": maps("max_turns = iterations + 1 (left empty: TRL's unlimited is max_turns' "
                                        "default, 8, beside max_completion_length's token budget)"),
    "vllm_importance_sampling_correction": maps(f"is_correction ({ENGINE_ONLY}; False: none)"),
    "vllm_importance_sampling_mode": maps(f"is_correction: token_truncate, token_mask, sequence_truncate, "
                                          f"sequence_mask as token-truncate, ... ({ENGINE_ONLY})"),
    "vllm_importance_sampling_clip_max": maps(f"is_cap ({ENGINE_ONLY})"),
    "vllm_importance_sampling_clip_min": maps(f"is_floor ({ENGINE_ONLY}, masking modes)"),
    "vllm_importance_sampling_cap": maps(f"is_cap ({ENGINE_ONLY}; TRL's deprecated name)"),
    "off_policy_mask_threshold": refused("no off-policy sequence mask here; is_correction's masks bound the "
                                         "engine's mismatch"),
    "use_bias_correction_kl": inert("the KL is taken on the trainer's own samples"),
    "log_completions_hub_repo": refused("ppo-rlhf runs offline; samples.jsonl keeps the completions"),
}

RLOO_FIELDS: dict[str, Fate] = {
    **ONLINE_FIELDS,
    "normalize_advantages": maps("whiten_advantages"),
    "reward_clip_range": refused("score_clip clips scores to [-x, x]; give a symmetric range through it"),
}


def fates_of(config_class) -> dict[str, Fate]:
    """Every field of ``config_class`` (a TRL config of ppo_rlhf.trl.configs) and its fate; a field
    of none of the tables (a newer transformers' TrainingArguments field) is refused unless left
    at its default."""
    from ppo_rlhf.trl.configs import GRPOConfig, PPOConfig, RLOOConfig

    own = {PPOConfig: PPO_FIELDS, GRPOConfig: GRPO_FIELDS, RLOOConfig: RLOO_FIELDS}[config_class]
    unknown = refused("a field this table does not know (a newer transformers'); leave it at its default")
    return {f.name: own.get(f.name) or TRAINING_ARGUMENTS.get(f.name) or unknown
            for f in dataclasses.fields(config_class) if f.init}


def default_of(config_class, name: str):
    field = next(f for f in dataclasses.fields(config_class) if f.name == name)
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def table(config_class) -> str:
    """The fates of ``config_class``'s fields as a Markdown table (docs/migrating_from_trl.md)."""
    rows = ["| field | TRL's default | here |", "|---|---|---|"]
    for name, fate in fates_of(config_class).items():
        default = default_of(config_class, name)
        also = f" (also {', '.join(map(repr, fate.allowed))})" if fate.allowed else ""
        what = {MAPS: f"-> {fate.text}", INERT: f"no effect: {fate.text}",
                REFUSED: f"refused unless at its default{also}: {fate.text}"}[fate.kind]
        rows.append(f"| `{name}` | `{default!r}` | {what.replace('|', '/')} |")
    return "\n".join(rows)


def tables() -> str:
    from ppo_rlhf.trl.configs import GRPOConfig, PPOConfig, RLOOConfig

    return "\n\n".join(f"### `{cls.__name__}`\n\n{table(cls)}" for cls in (PPOConfig, GRPOConfig, RLOOConfig))


if __name__ == "__main__":
    print(tables())
