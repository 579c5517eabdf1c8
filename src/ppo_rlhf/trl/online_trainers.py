"""TRL 1.16's GRPOTrainer and RLOOTrainer in their signature over this project's PPO
(docs/migrating_from_trl.md): ``model`` as a name, a folder or an object, ``reward_funcs``, data sets
in memory or streamed, ``tools`` and ``environment_factory`` played as this project's episodes.
"""

from __future__ import annotations

from pathlib import Path

import torch

import ppo_rlhf.trl.configs as configs
from ppo_rlhf.config import ConfigError
from ppo_rlhf.data import is_streamed
from ppo_rlhf.distributed import world_size
from ppo_rlhf.trl.datasets import online_prompts, one_split
from ppo_rlhf.trl.trainer_base import TRLTrainer, check_args, lora_settings, refuse_given, wrapped_in_lora
from ppo_rlhf.trl.translate import online_settings


ONLINE_METRICS = {"reward": "score", "reward_std": "score_std", "completions/mean_length": "response_length",
                  "entropy": "entropy", "clip_ratio/region_mean": "clipfrac", "clip_ratio/low_mean": "clipfrac_low",
                  "clip_ratio/high_mean": "clipfrac_high", "frac_reward_zero_std": "groups/zero_std"}
ROLLOUT_FUNC = ("rollout_func: ppo-rlhf's rollouts are its own; give an environment_factory (or tools) for "
                "multi-turn episodes, or a reward function for what you scored in the rollout")


class OnlineTrainer(TRLTrainer):
    """TRL 1.16's GRPOTrainer and RLOOTrainer (``kind``), which share their signature and data."""

    kind = "grpo"
    metric_names = ONLINE_METRICS

    @staticmethod
    def steps_per_iteration(args) -> int:
        """TRL's GRPO and RLOO count optimizer steps: steps_per_generation x num_iterations a generation."""
        return args.steps_per_generation * args.num_iterations

    def extra_metrics(self, metrics: dict) -> dict:
        """Each reward's mean and std under TRL's names (rewards/<name>/mean and /std)."""
        extra = {}
        for key, value in metrics.items():
            if key.startswith("reward/") and not key.endswith(("_none",)):
                name = key[len("reward/"):]
                extra[f"rewards/{name[:-4]}/std" if name.endswith("_std") else f"rewards/{name}/mean"] = value
        return extra

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        name = type(self).__name__
        if args is None:  # TRL's default config, named after the model
            model_name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = self.config_class(output_dir=f"{str(model_name).split('/')[-1]}-{self.kind.upper()}")
        check_args(args, self.config_class, name)
        refuse_given({
            "optimizers": tuple(optimizers) != (None, None) and "ppo-rlhf builds its AdamW (learning_rate, "
                                                                "weight_decay, adam_epsilon); leave optimizers out",
            "quantization_config": quantization_config is not None and "ppo-rlhf trains unquantized models; give "
                                                                       "model_init_kwargs={'dtype': ...} instead",
            "reward_processing_classes": reward_processing_classes is not None and
            "a reward model given by its folder reads with its own tokenizer, one given as a model with the "
            "policy's; leave reward_processing_classes out",
            "rollout_func": rollout_func is not None and ROLLOUT_FUNC})
        episodes = environment_factory is not None or bool(tools)
        if reward_funcs is None and environment_factory is None:
            raise ConfigError(f"{name} needs reward_funcs, or an environment_factory whose get_reward pays")
        prompts = online_prompts(train_dataset, "train_dataset", environment_factory is not None,
                                 args.generation_batch_size // args.num_generations)
        eval_prompts = (online_prompts(one_split(eval_dataset, "eval_dataset"), "eval_dataset",
                                       environment_factory is not None, 0) if eval_dataset is not None else None)
        count = None if is_streamed(prompts) else len(prompts)
        settings, notes = online_settings(args, self.kind, count, world_size())
        # With a peft_config the model is loaded here, its adapter TRL's ("default": trainer.model.save_pretrained
        # writes it at a folder's root, as TRL's does); without one, a name is this project's to load.
        model_type, parts = self.policy(model, processing_class, settings, load=peft_config is not None)
        if peft_config is not None:
            lora = lora_settings(peft_config, model_type)
            settings.update(lora)
            parts["model"] = wrapped_in_lora(parts["model"], lora)
        chat = episodes or conversational(prompts)
        tokenizer = parts.get("tokenizer") or self.tokenizer_of(settings["model"])
        schemas = episode_schemas(environment_factory, tools) if episodes else None
        settings.update(prompts=prompts, chat_template=chat, prompt_order=(
            "in-order" if is_streamed(prompts) else settings["prompt_order"]),
            max_length=self.longest_prompt(prompts, tokenizer, chat, schemas, notes) + args.max_completion_length)
        if eval_prompts is not None:
            settings.update(eval_prompts=eval_prompts, eval_size=len(eval_prompts) if not is_streamed(eval_prompts)
                            else args.per_device_eval_batch_size)
        if episodes:
            settings.update(max_episode_tokens=args.max_completion_length, **self.turns(args))
        if is_streamed(prompts):
            notes.append("train_dataset is streamed: its rows are read in order, as many as the run draws")
        rewards = (list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
                   if reward_funcs is not None else None)
        if rewards:  # TRL's string is a reward model's name or folder: a Hub name read from the local cache
            from ppo_rlhf.hub import local_model

            rewards = [local_model(r, "reward_funcs") if isinstance(r, str) and ":" not in r else r for r in rewards]
        self.start(args, callbacks, settings, notes, reward=rewards, environment=environment_factory,
                   tools=list(tools) if tools else None, **parts)

    @staticmethod
    def turns(args) -> dict:
        calls = getattr(args, "max_tool_calling_iterations", None)
        return {} if calls is None else {"max_turns": calls + 1}

    @staticmethod
    def policy(model, processing_class, settings: dict, load: bool = False) -> tuple[str | None, dict]:
        """The model argument: a name or folder for this project to load (settings' ``model``), or
        an object (with its tokenizer: processing_class, else its folder's); a name is loaded here
        where ``load`` or a processing_class asks.  Returns (its architecture's model_type, the
        trainer's model parts)."""
        if isinstance(model, (str, Path)):
            from ppo_rlhf.hub import local_model

            folder = local_model(str(model), "model")
            settings["model"] = folder
            config_file = Path(folder) / "config.json"
            model_type = None
            if config_file.is_file():
                import json

                model_type = json.loads(config_file.read_text()).get("model_type")
            if processing_class is None and not load:
                return model_type, {}
            from ppo_rlhf.models import load_causal_lm

            model = load_causal_lm(folder, settings.get("dtype"))
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a model's name, its folder, or a causal LM; got a {type(model).__name__}")
        folder = getattr(getattr(model, "config", None), "_name_or_path", None)
        settings.setdefault("model", folder if folder and Path(folder).is_dir() else None)
        from ppo_rlhf.models import load_tokenizer

        tokenizer = processing_class if processing_class is not None else load_tokenizer(folder)
        return getattr(model.config, "model_type", None), {"model": model, "tokenizer": tokenizer}

    @staticmethod
    def tokenizer_of(folder):
        from ppo_rlhf.models import load_tokenizer

        return load_tokenizer(folder)

    @staticmethod
    def longest_prompt(prompts, tokenizer, chat: bool, schemas: list[list[dict]] | None, notes: list[str]) -> int:
        """The longest prompt in tokens as the rollout renders it (TRL 1.16 never cuts a prompt:
        max_length is that plus max_completion_length), of a stream's first rows, a large data
        set's first 20000.  With tools (``schemas``: each environment's, or the tools'), the prompt
        listing the most of them, and RESET_ROOM tokens for what an environment's reset() adds."""
        import itertools

        from ppo_rlhf.rollout.responses import prompt_lengths

        rows = list(itertools.islice(iter(prompts), 20000))
        texts = [row.get("prompt") for row in rows if isinstance(row, dict) and row.get("prompt")]
        if schemas is None:
            return max(prompt_lengths(tokenizer, texts, chat), default=0)
        messages = [[{"role": "user", "content": text}] if isinstance(text, str) else text for text in texts or [""]]
        rendered = [tokenizer.apply_chat_template(conversation, tools=tools or None, tokenize=False,
                                                  add_generation_prompt=True)
                    for conversation in messages for tools in schemas]
        longest = max(len(ids) for ids in tokenizer(rendered, add_special_tokens=False)["input_ids"])
        notes.append(f"prompts: room for the longest prompt with its tools listed and {RESET_ROOM} tokens of what "
                     f"reset() adds, besides max_completion_length; TRL never cuts a prompt")
        return longest + RESET_ROOM


RESET_ROOM = 256  # tokens of room for what an environment's reset() appends to a prompt


def episode_schemas(environment_factory, tools) -> list[list[dict]]:
    """Each environment's tools (with ``tools``) as JSON schemas, as the chat template lists them;
    one list of ``tools``' alone without an environment."""
    from ppo_rlhf.envs.tools import tool_schema
    from ppo_rlhf.envs.trl import tool_methods

    given = [tool_schema(tool) for tool in tools or []]
    if environment_factory is None:
        return [given]
    factories = environment_factory.values() if isinstance(environment_factory, dict) else [environment_factory]
    return [given + [tool_schema(method) for method in tool_methods(factory())] for factory in factories]


def conversational(prompts) -> bool:
    """TRL's test: the first row's prompt is chat messages."""
    from ppo_rlhf.rollout.reward import is_conversational

    first = next(iter(prompts), {})
    return is_conversational(first.get("prompt") if isinstance(first, dict) else None)


class GRPOTrainer(OnlineTrainer):
    """TRL 1.16's GRPOTrainer over this project's PPO with estimator grpo (scale_rewards none:
    dr-grpo), the KL k3 in the loss with weight beta (0 by default, as TRL's)."""

    kind = "grpo"
    config_class = configs.GRPOConfig


class RLOOTrainer(OnlineTrainer):
    """TRL 1.16's RLOOTrainer over this project's PPO with estimator rloo, the KL k1 in the reward
    with weight beta (0.05, TRL's)."""

    kind = "rloo"
    config_class = configs.RLOOConfig

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None, processing_class=None,
                 reward_processing_classes=None, callbacks=None, optimizers=(None, None), quantization_config=None,
                 peft_config=None):
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         reward_processing_classes, callbacks, optimizers, quantization_config, peft_config)
