"""The helpers TRL's example scripts import beside the trainers: ``ScriptArguments``,
``ModelConfig``, ``get_peft_config``, ``get_quantization_config``, ``get_kbit_device_map`` (and,
in ppo_rlhf/trl/utils.py, ``SIMPLE_CHAT_TEMPLATE``), as TRL 0.23 defines them -- TRL is not
installed here, so they are this project's copies (Apache-2.0, (c) the HuggingFace team; from
trl/scripts/utils.py, trl/trainer/model_config.py and trl/trainer/utils.py of the 0.23.0 wheel,
help texts cut to their first sentence).  They only read a script's command line and build peft
and bitsandbytes configs; the trainers of ppo_rlhf.trl decide what a config may ask.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class ScriptArguments:
    """TRL's arguments of a script's data set (``load_dataset``'s name, config and splits)."""

    dataset_name: str | None = field(default=None, metadata={"help": 'Path or name of the dataset to load.'})
    dataset_config: str | None = field(default=None, metadata={"help": 'Dataset configuration name.'})
    dataset_train_split: str = field(default='train', metadata={"help": 'Dataset split to use for training.'})
    dataset_test_split: str = field(default='test', metadata={"help": 'Dataset split to use for evaluation.'})
    dataset_streaming: bool = field(default=False, metadata={"help": 'Whether to stream the dataset.'})
    gradient_checkpointing_use_reentrant: bool = field(default=False, metadata={
        "help": 'Whether to apply `use_reentrant` for gradient checkpointing.'})
    ignore_bias_buffers: bool = field(default=False, metadata={"help": 'Debug argument for distributed training.'})



@dataclass
class ModelConfig:
    """TRL's arguments of a script's model: its name, dtype, and LoRA / quantization settings."""

    model_name_or_path: str | None = field(default=None, metadata={
        "help": 'Model checkpoint for weights initialization.'})
    model_revision: str = field(default='main', metadata={"help": 'Specific model version to use.'})
    dtype: str | None = field(default=None, metadata={
        "help": 'Override the default `torch.dtype` and load the model under this dtype.',
        "choices": ['auto', 'bfloat16', 'float16', 'float32']})
    trust_remote_code: bool = field(default=False, metadata={
        "help": 'Whether to allow for custom models defined on the Hub in their own modeling files.'})
    attn_implementation: str | None = field(default=None, metadata={
        "help": 'Which attention implementation to use.'})
    use_peft: bool = field(default=False, metadata={"help": 'Whether to use PEFT for training.'})
    lora_r: int = field(default=16, metadata={"help": 'LoRA R value.'})
    lora_alpha: int = field(default=32, metadata={"help": 'LoRA alpha.'})
    lora_dropout: float = field(default=0.05, metadata={"help": 'LoRA dropout.'})
    lora_target_modules: list[str] | None = field(default=None, metadata={"help": 'LoRA target modules.'})
    lora_target_parameters: list[str] | None = field(default=None, metadata={
        "help": 'List of target parameters for LoRA.'})
    lora_modules_to_save: list[str] | None = field(default=None, metadata={
        "help": 'Model layers to unfreeze & train.'})
    lora_task_type: str = field(default='CAUSAL_LM', metadata={
        "help": "Task type to pass for LoRA (use 'SEQ_CLS' for reward modeling)."})
    use_rslora: bool = field(default=False, metadata={
        "help": 'Whether to use Rank-Stabilized LoRA, which sets the adapter scaling factor to `lora_alpha/√r`, '
                'instead of the original default value of `lora_alpha/r`.'})
    use_dora: bool = field(default=False, metadata={"help": 'Enable Weight-Decomposed Low-Rank Adaptation (DoRA).'})
    load_in_8bit: bool = field(default=False, metadata={
        "help": 'Whether to use 8 bit precision for the base model.'})
    load_in_4bit: bool = field(default=False, metadata={
        "help": 'Whether to use 4 bit precision for the base model.'})
    bnb_4bit_quant_type: str = field(default='nf4', metadata={
        "help": 'Quantization type.', "choices": ['fp4', 'nf4']})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": 'Whether to use nested quantization.'})
    torch_dtype: str | None = field(default=None, metadata={
        "help": 'Override the default `torch.dtype` and load the model under this dtype.',
        "choices": ['auto', 'bfloat16', 'float16', 'float32']})


    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("You can't use 8 bit and 4 bit precision at the same time")
        if self.torch_dtype and not self.dtype:  # TRL's deprecated name
            self.dtype = self.torch_dtype
        if hasattr(self.lora_target_modules, "__len__") and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]


def get_quantization_config(model_args: ModelConfig):
    """A bitsandbytes config for --load_in_4bit / --load_in_8bit, else None (TRL's)."""
    from transformers import BitsAndBytesConfig

    if model_args.load_in_4bit:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=model_args.dtype,
                                  bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
                                  bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
                                  bnb_4bit_quant_storage=model_args.dtype)
    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def get_kbit_device_map() -> dict[str, int] | None:
    """The device map a quantized model loads with: this process's GPU, else None (TRL's)."""
    if torch.cuda.is_available():
        from accelerate import PartialState

        return {"": PartialState().local_process_index}
    return None


def get_peft_config(model_args: ModelConfig):
    """A peft LoraConfig from --use_peft and the --lora_* arguments, else None (TRL's)."""
    if model_args.use_peft is False:
        return None
    from peft import LoraConfig

    return LoraConfig(task_type=model_args.lora_task_type, r=model_args.lora_r,
                      target_modules=model_args.lora_target_modules, lora_alpha=model_args.lora_alpha,
                      lora_dropout=model_args.lora_dropout, bias="none", use_rslora=model_args.use_rslora,
                      use_dora=model_args.use_dora, modules_to_save=model_args.lora_modules_to_save)
