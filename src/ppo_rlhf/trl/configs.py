"""TRL's configuration classes, field for field: ``PPOConfig`` as TRL kept it until it deleted
its PPOTrainer (``trl.trainer.ppo_config`` up to 0.25, ``trl.experimental.ppo`` in 0.27-0.29: the
0.29 fields and defaults, with 0.23's ``exp_name``), ``GRPOConfig`` and ``RLOOConfig`` as TRL 1.16
has them (docs/migrating_from_trl.md).

Each is a ``transformers.TrainingArguments``, as TRL's are, so ``HfArgumentParser`` reads them
from a script's command line and every field has TRL's name, type and default.  What each field
becomes here is ppo_rlhf/trl/fields.py's table; a trainer of ppo_rlhf.trl (ppo_trainer.py,
online_trainers.py) reads the config when it is built and refuses a field set to something this
project has no counterpart for.

The field declarations are TRL's (Apache-2.0, (c) the HuggingFace team; read in the trl 0.23.0,
0.29.0 and 1.16.0 wheels), each help text cut to its first sentence.  ``__post_init__`` keeps
TRL's own checks and derived sizes (GRPO's generation batch); one default differs where TRL's
cannot run: ``bf16`` left empty is TRL's ``not fp16`` only where a GPU computes in bf16, since
TrainingArguments refuses bf16 on a machine without one (the run's plan says so).
"""

import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import TrainingArguments


def bf16_available() -> bool:
    """A GPU that computes in bf16 (what TrainingArguments requires of bf16 without use_cpu)."""
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


@dataclass
class TRLConfig(TrainingArguments):
    """TRL's ``_BaseConfig`` (1.16; ``BaseConfig`` in 0.29, ``OnPolicyConfig``'s overrides in 0.23):
    TrainingArguments with TRL's defaults for logging, gradient checkpointing and bf16."""

    logging_steps: float = field(default=10, metadata={"help": 'Log every X updates steps.'})
    gradient_checkpointing: bool = field(default=True, metadata={
        "help": 'Enable gradient checkpointing to trade compute for memory.'})
    bf16: bool | None = field(default=None, metadata={
        "help": 'Whether to use bf16 (mixed) precision instead of 32-bit.'})
    lr_scheduler_kwargs: dict | str | None = field(default=None, metadata={
        "help": "Additional parameters for the lr_scheduler, such as {'num_cycles': 1} for cosine with hard restarts."})
    use_liger_kernel: bool = field(default=False, metadata={
        "help": "Enable Liger Kernel optimizations: transformers patches the model's layers with Liger's Triton "
                'kernels.'})
    torch_empty_cache_steps: int | None = field(default=None, metadata={
        "help": 'Number of steps to wait before calling `torch.<device>.empty_cache()`.'})

    def __post_init__(self):
        if self.bf16 is None:  # TRL's rule (not fp16), where the machine can: see the module docstring
            self.bf16 = not self.fp16 and not self.use_cpu and bf16_available()
            self.bf16_unavailable = not self.fp16 and not self.bf16  # TRL's default, not taken: the plan says so
        with warnings.catch_warnings():  # transformers 5 renames it activation_checkpointing; TRL sets the old name
            warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated", category=FutureWarning)
            super().__post_init__()


@dataclass
class PPOConfig(TRLConfig):
    """TRL's ``PPOConfig`` (the on-policy fields of 0.23's ``OnPolicyConfig`` and PPO's own)."""

    exp_name: str = field(default="ppo_config", metadata={"help": "Name of this experiment (TRL 0.23)."})
    learning_rate: float = field(default=3e-06, metadata={"help": 'The initial learning rate for AdamW.'})
    dataset_num_proc: int | None = field(default=None, metadata={
        "help": 'Number of processes to use for processing the dataset.'})
    num_mini_batches: int = field(default=1, metadata={"help": 'Number of minibatches to split a batch into.'})
    total_episodes: int | None = field(default=None, metadata={"help": 'Total number of episodes in the dataset.'})
    local_rollout_forward_batch_size: int = field(default=64, metadata={
        "help": 'Per rank no grad forward pass in the rollout phase.'})
    num_sample_generations: int = field(default=10, metadata={
        "help": 'Number of debugging samples generations (i.e., `generate_completions` calls) throughout training.'})
    response_length: int = field(default=53, metadata={"help": 'Length of the response.'})
    stop_token: Literal['eos'] | None = field(default=None, metadata={
        "help": 'Specifies the stop token to use for text generation.'})
    stop_token_id: int | None = field(default=None, metadata={
        "help": 'Specifies the ID of the stop token to use for text generation.'})
    temperature: float = field(default=0.7, metadata={"help": 'Sampling temperature.'})
    missing_eos_penalty: float | None = field(default=None, metadata={
        "help": 'Penalty applied to the score when the model fails to generate an EOS token.'})
    sft_model_path: str = field(default='EleutherAI/pythia-160m', metadata={"help": 'Path to the SFT model.'})
    world_size: int | None = field(default=None, metadata={
        "help": 'Number of processes (GPUs) to use for the training.'})
    num_total_batches: int | None = field(default=None, metadata={"help": 'Number of total batches to train.'})
    micro_batch_size: int | None = field(default=None, metadata={
        "help": "Micro batch size across devices (HF's `per_device_train_batch_size` * `world_size`)."})
    local_batch_size: int | None = field(default=None, metadata={
        "help": "Batch size per GPU (HF's `per_device_train_batch_size` * `gradient_accumulation_steps`)."})
    batch_size: int | None = field(default=None, metadata={
        "help": "Batch size across devices (HF's `per_device_train_batch_size` * `world_size` * "
                '`gradient_accumulation_steps`).'})
    local_mini_batch_size: int | None = field(default=None, metadata={"help": 'Mini batch size per GPU.'})
    mini_batch_size: int | None = field(default=None, metadata={"help": 'Mini batch size across GPUs.'})
    push_to_hub: bool = field(default=False, metadata={
        "help": 'Whether to push the model to the Hub after training.'})
    reward_model_path: str = field(default='EleutherAI/pythia-160m', metadata={"help": 'Path to the reward model.'})
    model_adapter_name: str | None = field(default=None, metadata={
        "help": 'Name of the train target PEFT adapter, when using LoRA with multiple adapters.'})
    ref_adapter_name: str | None = field(default=None, metadata={
        "help": 'Name of the reference PEFT adapter, when using LoRA with multiple adapters.'})
    num_ppo_epochs: int = field(default=4, metadata={"help": 'Number of epochs to train.'})
    whiten_rewards: bool = field(default=False, metadata={"help": 'Whether to whiten the rewards.'})
    kl_coef: float = field(default=0.05, metadata={"help": 'KL coefficient.'})
    kl_estimator: Literal['k1', 'k3'] = field(default='k1', metadata={
        "help": 'Which estimator for KL-Divergence to use from Approximating KL Divergence '
                '(http://joschu.net/blog/kl-approx.html).'})
    cliprange: float = field(default=0.2, metadata={"help": 'Clip range.'})
    vf_coef: float = field(default=0.1, metadata={"help": 'Value function coefficient.'})
    cliprange_value: float = field(default=0.2, metadata={"help": 'Clip range for the value function.'})
    gamma: float = field(default=1.0, metadata={"help": 'Discount factor.'})
    lam: float = field(default=0.95, metadata={"help": 'Lambda value for GAE.'})
    ds3_gather_for_generation: bool = field(default=True, metadata={
        "help": 'This setting applies to DeepSpeed ZeRO-3.'})


@dataclass
class OnlineConfig(TRLConfig):
    """The fields GRPOConfig and RLOOConfig share in TRL 1.16, with its rules between them."""

    num_generations: int | None = field(default=8, metadata={"help": "Number of generations to sample."})
    learning_rate: float = field(default=1e-06, metadata={"help": 'The initial learning rate for AdamW.'})
    model_init_kwargs: dict[str, Any] | str | None = field(default=None, metadata={
        "help": 'Keyword arguments for `transformers.AutoModelForCausalLM.from_pretrained`, used when the `model` '
                'argument of the trainer is provided as a string.'})
    trust_remote_code: bool = field(default=False, metadata={
        "help": 'Whether to allow loading models and tokenizers that ship custom Python code from the Hub.'})
    router_aux_loss_coef: float | None = field(default=None, metadata={
        "help": 'Coefficient of the load-balancing auxiliary loss for Mixture-of-Experts (MoE) models, added to the '
                'training loss with this weight.'})
    disable_dropout: bool = field(default=False, metadata={"help": 'Whether to disable dropout in the model.'})
    remove_unused_columns: bool | None = field(default=False, metadata={
        "help": "Whether to only keep the column 'prompt' in the dataset."})
    num_generations_eval: int | None = field(default=None, metadata={
        "help": 'Number of generations to sample during evaluation.'})
    max_completion_length: int | None = field(default=512, metadata={
        "help": 'Maximum length of the generated completion.'})
    ds3_gather_for_generation: bool = field(default=True, metadata={
        "help": 'This setting applies to DeepSpeed ZeRO-3.'})
    shuffle_dataset: bool | None = field(default=True, metadata={
        "help": 'Whether to shuffle the training dataset.'})
    pad_to_multiple_of: int | str | None = field(default='auto', metadata={
        "help": 'If set, the prompts ids and completions ids will be padded to a multiple of this value.'})
    generation_batch_size: int | None = field(default=None, metadata={"help": 'Batch size to use for generation.'})
    steps_per_generation: int | None = field(default=None, metadata={"help": 'Number of steps per generation.'})
    temperature: float = field(default=1.0, metadata={"help": 'Temperature for sampling.'})
    top_p: float = field(default=1.0, metadata={
        "help": 'Float that controls the cumulative probability of the top tokens to consider.'})
    top_k: int = field(default=0, metadata={
        "help": 'Number of highest probability vocabulary tokens to keep for top-k-filtering.'})
    min_p: float | None = field(default=None, metadata={
        "help": 'Minimum token probability, which will be scaled by the probability of the most likely token.'})
    generation_kwargs: dict | str | None = field(default=None, metadata={
        "help": 'Additional keyword arguments to pass to `GenerationConfig` (if using transformers) or '
                '`SamplingParams` (if using vLLM) when sampling completions.'})
    chat_template_kwargs: dict | str | None = field(default=None, metadata={
        "help": 'Additional keyword arguments to pass to the `apply_chat_template` function when generating '
                'completions.'})
    repetition_penalty: float = field(default=1.0, metadata={
        "help": 'Float that penalizes new tokens based on whether they appear in the prompt and the generated text so'
                ' far.'})
    cache_implementation: str | None = field(default=None, metadata={
        "help": 'Implementation of the cache method for faster generation when use_vllm is set to False.'})
    use_vllm: bool = field(default=False, metadata={"help": 'Whether to use vLLM for generating completions.'})
    vllm_mode: str = field(default='colocate', metadata={
        "help": 'Mode to use for vLLM integration when `use_vllm` is set to `True`.'})
    vllm_model_impl: str = field(default='vllm', metadata={"help": 'Model implementation to use for vLLM.'})
    vllm_enable_sleep_mode: bool = field(default=False, metadata={
        "help": 'Enable vLLM sleep mode to offload weights/cache during the optimizer step.'})
    vllm_structured_outputs_regex: str | None = field(default=None, metadata={
        "help": 'Regex for vLLM structured outputs.'})
    vllm_server_base_url: str | None = field(default=None, metadata={
        "help": "Base URL for the vLLM server (e.g., 'http://localhost:8000')."})
    vllm_server_host: str = field(default='0.0.0.0', metadata={"help": 'Host of the vLLM server to connect to.'})
    vllm_server_port: int = field(default=8000, metadata={"help": 'Port of the vLLM server to connect to.'})
    vllm_server_timeout: float = field(default=240.0, metadata={
        "help": 'Total timeout duration in seconds to wait for the vLLM server to be up.'})
    vllm_group_port: int = field(default=51216, metadata={"help": 'Port number for the weight update group.'})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={
        "help": 'Control the GPU memory utilization for vLLM.'})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": 'Context window for vLLM.'})
    vllm_tensor_parallel_size: int = field(default=1, metadata={
        "help": 'Control the tensor parallel size for vLLM.'})
    num_iterations: int = field(default=1, metadata={
        "help": 'Number of iterations per batch (denoted as μ in the algorithm).'})
    epsilon: float = field(default=0.2, metadata={"help": 'Epsilon value for clipping.'})
    epsilon_high: float | None = field(default=None, metadata={"help": 'Upper-bound epsilon value for clipping.'})
    reward_weights: list[float] | None = field(default=None, metadata={"help": 'Weights for each reward function.'})
    mask_truncated_completions: bool = field(default=False, metadata={
        "help": 'When enabled, truncated completions are excluded from the loss calculation, preventing them from '
                'being incorrectly penalized and introducing noise during training.'})
    sync_ref_model: bool = field(default=False, metadata={
        "help": 'Whether to synchronize the reference model with the active model every `ref_model_sync_steps` steps,'
                ' using the `ref_model_mixup_alpha` parameter.'})
    ref_model_mixup_alpha: float = field(default=0.6, metadata={
        "help": 'α parameter from the TR-DPO paper, which controls the mix between the current policy and the '
                'previous reference policy during updates.'})
    ref_model_sync_steps: int = field(default=512, metadata={
        "help": 'τ parameter from the TR-DPO paper, which determines how frequently the current policy is '
                'synchronized with the reference policy.'})
    log_completions: bool = field(default=False, metadata={
        "help": 'Whether to log a sample of (prompt, completion) pairs every `logging_steps` steps.'})
    log_multimodal: bool = field(default=True, metadata={
        "help": 'Whether to log multimodal content (images, videos, etc.) together with completions.'})
    num_completions_to_print: int | None = field(default=None, metadata={
        "help": 'Number of completions to print with `rich`.'})
    log_unique_prompts: bool = field(default=False, metadata={"help": 'Whether to log unique prompts.'})
    use_transformers_continuous_batching: bool = field(default=False, metadata={
        "help": "Whether to use transformers' continuous batching engine for generating completions."})
    transformers_continuous_batching_config: dict | str | None = field(default=None, metadata={
        "help": 'Keyword arguments for `transformers.generation.ContinuousBatchingConfig`.'})
    use_transformers_paged: bool = field(default=False, metadata={"help": 'Deprecated.'})

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":  # the CLI's text
            self.pad_to_multiple_of = (None if self.pad_to_multiple_of.lower() in ("none", "null")
                                       else int(self.pad_to_multiple_of))
        if self.pad_to_multiple_of == "auto":
            self.pad_to_multiple_of = None
        if self.use_transformers_paged:
            self.use_transformers_continuous_batching = True
        if getattr(self, "scale_rewards", None) in (True, False):
            self.scale_rewards = {True: "group", False: "none"}[self.scale_rewards]
        if self.auto_find_batch_size:
            raise ValueError("auto_find_batch_size is not supported by GRPO, because the generation batch must contain "
                             "full prompt groups of num_generations completions; set auto_find_batch_size=False and "
                             "lower per_device_train_batch_size instead.")
        processes = self.world_size
        if self.generation_batch_size is None and self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = self.per_device_train_batch_size * processes * self.steps_per_generation
        elif self.generation_batch_size is not None and self.steps_per_generation is None:
            if self.generation_batch_size % (self.per_device_train_batch_size * processes) != 0:
                raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by the "
                                 f"global batch size ({self.per_device_train_batch_size * processes}).")
            self.steps_per_generation = self.generation_batch_size // (self.per_device_train_batch_size * processes)
        elif self.generation_batch_size is None and self.steps_per_generation is not None:
            self.generation_batch_size = self.per_device_train_batch_size * processes * self.steps_per_generation
        else:
            raise ValueError("'generation_batch_size' and 'steps_per_generation' can not be both configured at the "
                             "same time")
        if self.generation_batch_size % self.num_generations != 0:
            raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by "
                             f"num_generations ({self.num_generations}).")
        if self.num_generations < 2:
            raise ValueError(f"GRPO requires at least 2 generations per prompt to calculate the advantages. You "
                             f"provided {self.num_generations}, which is less than the minimum required.")


@dataclass
class GRPOConfig(OnlineConfig):
    """TRL 1.16's ``GRPOConfig``."""

    cast_lm_head_to_fp32: bool = field(default=False, metadata={
        "help": 'Whether to cast the language modeling head of the policy and reference models to float32.'})
    beta: float = field(default=0.0, metadata={"help": 'KL coefficient.'})
    delta: float | None = field(default=None, metadata={
        "help": 'Enables the upper clipping bound in two-sided GRPO loss when set to a float.'})
    sapo_temperature_neg: float = field(default=1.05, metadata={
        "help": 'Temperature for tokens with non-positive advantage scores used in the `sapo` loss function.'})
    sapo_temperature_pos: float = field(default=1.0, metadata={
        "help": 'Temperature for tokens with positive advantage scores used in the `sapo` loss function.'})
    vespo_k_pos: float = field(default=2.0, metadata={
        "help": 'k parameter for positive advantages, it is the power exponent in the VESPO loss.'})
    vespo_lambda_pos: float = field(default=3.0, metadata={
        "help": 'lambda parameter for positive advantages, it is the decay factor in the VESPO loss.'})
    vespo_k_neg: float = field(default=3.0, metadata={
        "help": 'k parameter for negative advantages, it is the power exponent in the VESPO loss.'})
    vespo_lambda_neg: float = field(default=2.0, metadata={
        "help": 'lambda parameter for negative advantages, it is the exponential decay factor in the VESPO loss.'})
    importance_sampling_level: str = field(default='token', metadata={
        "help": "Controls whether importance sampling ratios are computed at the `'token'` or `'sequence'` level."})
    multi_objective_aggregation: str = field(default='sum_then_normalize', metadata={
        "help": 'Method to aggregate multiple reward functions.'})
    scale_rewards: str = field(default='group', metadata={"help": 'Specifies the scaling strategy for rewards.'})
    loss_type: str = field(default='dapo', metadata={"help": 'Specifies the loss formulation to use.'})
    top_entropy_quantile: float = field(default=1.0, metadata={"help": 'ρ parameter from Beyond the 80/20 Rule.'})
    entropy_coef: float = field(default=0.0, metadata={
        "help": 'Coefficient of the entropy regularization term in the loss.'})
    use_adaptive_entropy: bool = field(default=False, metadata={
        "help": 'Whether to use adaptive entropy control, introduced in Skywork-OR1 '
                '(https://huggingface.co/papers/2505.22312).'})
    entropy_coef_min: float = field(default=0.0, metadata={
        "help": 'Lower bound for the entropy coefficient when using adaptive entropy control.'})
    entropy_coef_max: float = field(default=1.0, metadata={
        "help": 'Upper bound for the entropy coefficient when using adaptive entropy control.'})
    entropy_coef_delta: float = field(default=0.005, metadata={
        "help": 'Step size for adjusting the entropy coefficient during adaptive entropy control.'})
    entropy_target: float = field(default=0.2, metadata={
        "help": 'Target mean per-token entropy (nats) for adaptive entropy control.'})
    max_tool_calling_iterations: int | None = field(default=None, metadata={
        "help": 'Maximum number of tool-calling turns when training an agent.'})
    vllm_importance_sampling_correction: bool = field(default=True, metadata={
        "help": 'Whether to apply Importance Sampling (IS) to correct for the mismatch between vLLM completion '
                'logprobs and recomputed training logprobs.'})
    vllm_importance_sampling_mode: str = field(default='sequence_mask', metadata={
        "help": 'Specifies how Importance Sampling (IS) is performed when vllm_importance_sampling_correction=True.'})
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata={
        "help": 'Importance sampling upper bound C_max used by `vllm_importance_sampling_mode`.'})
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={
        "help": 'Importance sampling lower bound C_min used by `vllm_importance_sampling_mode`.'})
    off_policy_mask_threshold: float | None = field(default=None, metadata={
        "help": 'Threshold for off-policy sequence masking.'})
    use_bias_correction_kl: bool = field(default=True, metadata={
        "help": 'Whether to multiply the KL term by the importance sampling ratio, so that the KL gradient becomes '
                'the unbiased reverse-KL gradient, as described in the [DeepSeek-V3.2 '
                'paper](https://huggingface.co/papers/2512.02556).'})
    log_completions_hub_repo: str | None = field(default=None, metadata={
        "help": 'Hugging Face Hub repository to save the completions.'})
    vllm_importance_sampling_cap: float | None = field(default=None, metadata={
        "help": 'Deprecated, use `vllm_importance_sampling_clip_max` instead.'})

    def __post_init__(self):
        super().__post_init__()
        if self.vllm_importance_sampling_cap is not None:  # TRL's deprecated name
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if low is not None and high is not None and low >= high:
            raise ValueError(f"vllm_importance_sampling_clip_min ({low}) must be less than "
                             f"vllm_importance_sampling_clip_max ({high}).")


@dataclass
class RLOOConfig(OnlineConfig):
    """TRL 1.16's ``RLOOConfig``."""

    num_generations: int | None = field(default=2, metadata={"help": 'Number of generations to sample.'})
    beta: float = field(default=0.05, metadata={"help": 'KL coefficient.'})
    normalize_advantages: bool = field(default=False, metadata={"help": 'Whether to normalize advantages.'})
    reward_clip_range: tuple[float, float] | None = field(default=None, metadata={
        "help": 'Clip range for rewards as (min, max).'})
