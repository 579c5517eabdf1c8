"""TRL's trainers in TRL's signatures, over this project's one trainer (docs/migrating_from_trl.md).

``PPOTrainer`` takes what TRL's PPOTrainer took until TRL deleted it (``args``, ``processing_class``,
``model``, ``ref_model``, ``reward_model``, ``train_dataset``, ``value_model``, ...), ``GRPOTrainer``
and ``RLOOTrainer`` what TRL 1.16's take (``model`` as a name, a folder or a model, ``reward_funcs``,
``args``, ``train_dataset``, ``tools``, ``environment_factory``, ...).  Each reads its TRL config
(ppo_rlhf/trl/translate.py), refuses at construction what has no counterpart here, and builds
this project's ``PPOTrainer`` (trainers/ppo.py) with the settings, models, rewards and
environments it was given: ``train()`` is that trainer's run, into ``output_dir`` as this
project's run folder.  No loop of its own: :class:`TRLRun` only reports each iteration to the
script's callbacks (``on_log``) under TRL's metric names beside this project's, and prints, with
the run's plan, where the run differs from TRL's.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from ppo_rlhf.config import ConfigError
from ppo_rlhf.data import is_streamed
from ppo_rlhf.distributed import is_main_process, world_size
from ppo_rlhf.models.value import ModelCritic, ValueHead
from ppo_rlhf.trainers.ppo import PPOTrainer as ProjectPPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig as ProjectPPOConfig
import ppo_rlhf.trl.configs as configs
from ppo_rlhf.trl.datasets import online_prompts, one_split, ppo_rows
from ppo_rlhf.trl.translate import online_settings, ppo_settings, refuse_unmatched


class TRLRun(ProjectPPOTrainer):
    """This project's PPOTrainer, reporting each iteration to the TRL trainer around it (``owner``):
    TRL's metric names added to its own, the script's callbacks told; the plan followed by where
    the run differs from TRL's."""

    owner = None  # the TRL trainer (set before the run trains)

    def step(self, rows, draw_more=None) -> dict:
        metrics = super().step(rows, draw_more)
        self.owner.report(metrics)
        return metrics

    def print_plan(self, n_prompts: int) -> None:
        super().print_plan(n_prompts)
        if is_main_process() and self.owner.notes:
            print(f"  {type(self.owner).__name__}'s settings (ppo_rlhf.trl), where this run differs from TRL's:")
            for note in self.owner.notes:
                print(f"    - {note}")


# ---------------------------------------------------------------- what the TRL trainers share
LORA_FIELDS = ("r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "peft_type", "auto_mapping",
               "peft_version", "base_model_name_or_path", "revision", "inference_mode", "fan_in_fan_out",
               "runtime_config")


def lora_settings(peft_config, model_type: str | None) -> dict:
    """A peft LoraConfig as this project's LoRA options; any other peft config, or a LoRA field
    beyond rank, alpha, dropout and target modules, refused by name."""
    if peft_config is None:
        return {}
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise ConfigError(f"peft_config is a {type(peft_config).__name__}: ppo-rlhf trains LoRA adapters only; give a "
                          f"peft LoraConfig, or no peft_config to train the whole model")
    default = LoraConfig()
    for field in dataclasses.fields(peft_config):
        value = getattr(peft_config, field.name)
        if field.name not in LORA_FIELDS and value != getattr(default, field.name):
            raise ConfigError(f"peft_config.{field.name}={value!r}: ppo-rlhf's adapters are plain LoRA (r, lora_alpha, "
                              f"lora_dropout, target_modules); leave {field.name} at peft's default")
    targets = peft_config.target_modules
    if targets is None:  # peft's default for the architecture, as get_peft_model reads it
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

        targets = DEFAULTS.get(model_type)
        if targets is None:
            raise ConfigError(f"peft_config.target_modules is empty and peft has no default for a {model_type} model; "
                              f"name the modules to adapt")
    targets = targets if isinstance(targets, str) else ",".join(sorted(targets))
    return {"lora": True, "lora_r": peft_config.r, "lora_alpha": float(peft_config.lora_alpha),
            "lora_dropout": peft_config.lora_dropout, "lora_target_modules": targets}


def wrapped_in_lora(model, settings: dict):
    """``model`` (an object) with the policy adapter ``settings`` describe (a peft model is merged
    first, as TRL's trainers do)."""
    if not settings.get("lora"):
        return model
    from ppo_rlhf.models.lora import LoraOptions, with_adapter

    if hasattr(model, "peft_config"):
        model = model.merge_and_unload()
    options = LoraOptions(**{key: value for key, value in settings.items() if key in
                             {f.name for f in dataclasses.fields(LoraOptions)}})
    return with_adapter(options, model, "CAUSAL_LM", adapter_name="policy")


def refuse_given(given: dict[str, object]) -> None:
    """ConfigError for the first trainer argument given that has no counterpart here: name -> why."""
    for name, why in given.items():
        if why:
            raise ConfigError(f"{name}: {why} (docs/migrating_from_trl.md)")


def value_critic(value_model) -> ModelCritic:
    """TRL's value model (a sequence classifier, often the reward model's copy) as this project's
    critic: its trunk, and a value head starting from its score head, as TRL's starts."""
    trunk = getattr(value_model, value_model.base_model_prefix, None)
    score = getattr(value_model, "score", None)
    if trunk is None or not isinstance(score, torch.nn.Linear) or score.out_features != 1:
        raise ConfigError(f"value_model is a {type(value_model).__name__}; TRL's PPOTrainer takes a sequence "
                          f"classifier with one label (AutoModelForSequenceClassification(..., num_labels=1))")
    head = ValueHead(score.in_features)
    with torch.no_grad():
        head.summary.weight.copy_(score.weight.float())
        head.summary.bias.zero_() if score.bias is None else head.summary.bias.copy_(score.bias.float())
    return ModelCritic(trunk, head)


class TRLTrainer:
    """What every TRL trainer here has: ``train()``, ``save_model``, ``push_to_hub`` (refused),
    callbacks, ``state`` and ``model``; ``self.run`` is this project's trainer."""

    config_class = None
    metric_names: dict[str, str] = {}  # TRL's name -> this project's

    def start(self, args, callbacks, settings: dict, notes: list[str], **parts) -> None:
        """This project's PPOConfig from ``settings`` and the trainer around ``parts``."""
        self.args, self.notes = args, notes
        self.callbacks = [callback() if isinstance(callback, type) else callback for callback in callbacks or []]
        from transformers.trainer_callback import TrainerControl

        self.control = TrainerControl()
        self.config = ProjectPPOConfig(**settings)
        self.run = TRLRun(self.config, **parts)
        self.run.owner = self
        self.call_event("on_init_end")

    @property
    def model(self):
        return self.run.actor

    @property
    def processing_class(self):
        return self.run.tokenizer

    @property
    def state(self):
        """The run's transformers.TrainerState (global_step: iterations done)."""
        return self.run.state

    def add_callback(self, callback) -> None:
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def call_event(self, event: str, **kwargs) -> None:
        for callback in self.callbacks:
            handler = getattr(callback, event, None)
            if handler is not None:
                handler(self.args, self.state, self.control, model=self.model, processing_class=self.processing_class,
                        optimizer=getattr(self.run, "optimizer", None), **kwargs)

    def report(self, metrics: dict) -> None:
        """An iteration's metrics: TRL's names beside this project's, the callbacks told."""
        metrics.update({trl: metrics[own] for trl, own in self.metric_names.items() if own in metrics})
        metrics.update(self.extra_metrics(metrics))
        self.call_event("on_step_end")
        self.call_event("on_log", logs=dict(metrics))

    def extra_metrics(self, metrics: dict) -> dict:
        return {}

    def train(self, resume_from_checkpoint=None, **kwargs):
        """This project's run into ``output_dir``; ``resume_from_checkpoint`` (or the config's
        field) True or the run folder: it continues from its last checkpoint.  Returns
        transformers' TrainOutput, the run's summary as its metrics."""
        from transformers.trainer_utils import TrainOutput

        if kwargs:
            raise ConfigError(f"train() takes resume_from_checkpoint only; got {', '.join(kwargs)}")
        resume = resume_from_checkpoint if resume_from_checkpoint is not None else self.args.resume_from_checkpoint
        if resume:
            if resume is not True and Path(str(resume)).resolve() not in (
                    Path(self.config.out).resolve(), (Path(self.config.out) / "checkpoints" / "last").resolve()):
                raise ConfigError(f"resume_from_checkpoint={resume!r}: ppo-rlhf resumes the run in output_dir "
                                  f"({self.config.out}) from its checkpoints/last; give True, or that folder")
            self.config.resume, self.config.overwrite = True, False
        self.call_event("on_train_begin")
        self.summary = self.run.train()
        self.call_event("on_train_end")
        last = self.state.log_history[-1] if self.state.log_history else {}
        return TrainOutput(self.state.global_step, float(last.get("pg_loss", math.nan)), self.summary)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The trained policy (with LoRA: its adapter) and the tokenizer, into ``output_dir``
        (default: args.output_dir), as TRL saves them; the run folder's checkpoints/actor holds
        the same model already."""
        output_dir = Path(output_dir or self.args.output_dir)
        if not is_main_process():
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        if hasattr(self.model, "peft_config"):  # the policy adapter as a peft folder at output_dir, as TRL's "default"
            import shutil

            from ppo_rlhf.models.lora import save_adapter

            staging = save_adapter(self.model, self.model.active_adapter, output_dir / ".adapter-staging")
            for file in staging.iterdir():
                shutil.move(str(file), str(output_dir / file.name))
            staging.rmdir()
        else:
            self.model.save_pretrained(output_dir)
        self.processing_class.save_pretrained(output_dir)

    def push_to_hub(self, *args, **kwargs):
        raise ConfigError("push_to_hub: ppo-rlhf runs offline and uploads nothing; the trained model is in "
                          f"{self.args.output_dir} (and its checkpoints/actor): upload it with `hf upload REPO "
                          f"{self.args.output_dir}` on a machine with a network")


def check_args(args, config_class, trainer: str):
    if not isinstance(args, config_class):
        raise ConfigError(f"{trainer} takes args={config_class.__name__}(...) of ppo_rlhf.trl, got a "
                          f"{type(args).__name__}; build it from ppo_rlhf.trl (from ppo_rlhf.trl import "
                          f"{config_class.__name__})")
    refuse_unmatched(args)


# ---------------------------------------------------------------- TRL's PPOTrainer
class PPOTrainer(TRLTrainer):
    """TRL's PPOTrainer (0.2x; ``trl.experimental.ppo`` in 0.27-0.29) over this project's PPO: a
    policy, a frozen reference (a copy, or the LoRA base), a reward model and a value model, on
    pre-tokenized prompts (``input_ids``)."""

    config_class = configs.PPOConfig
    metric_names = {"objective/kl": "kl", "objective/non_score_reward": "non_score_reward",
                    "objective/scores": "score", "policy/approxkl_avg": "approx_kl", "policy/clipfrac_avg": "clipfrac",
                    "loss/policy_avg": "pg_loss", "loss/value_avg": "vf_loss", "val/clipfrac_avg": "vf_clipfrac",
                    "policy/entropy_avg": "entropy"}

    def __init__(self, args, processing_class, model, ref_model, reward_model, train_dataset, value_model,
                 data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None, peft_config=None):
        if ref_model is model:  # TRL's rule
            raise ValueError("`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the "
                             "same as `model`, you must make a copy of it, or `None` if you use peft.")
        check_args(args, configs.PPOConfig, "PPOTrainer")
        refuse_given({"optimizers": tuple(optimizers) != (None, None) and
                      "ppo-rlhf builds one AdamW over the policy and the value model (learning_rate, weight_decay, "
                      "adam_epsilon); leave optimizers out",
                      "data_collator": data_collator is not None and
                      type(data_collator).__name__ != "DataCollatorWithPadding" and
                      "ppo-rlhf pads the prompts itself (left, as TRL's DataCollatorWithPadding did for generation); "
                      "leave data_collator out"})
        if processing_class is None or not hasattr(processing_class, "decode"):
            raise ConfigError(f"processing_class must be the policy's tokenizer, got {type(processing_class).__name__}")
        rows = ppo_rows(train_dataset, processing_class, "train_dataset")
        eval_rows = (ppo_rows(one_split(eval_dataset, "eval_dataset"), processing_class, "eval_dataset")
                     if eval_dataset is not None else [])
        settings, notes = ppo_settings(args, len(rows), world_size())
        lora = lora_settings(peft_config, getattr(model.config, "model_type", None))
        if args.stop_token == "eos":  # what TRL did to the policy
            model.generation_config.eos_token_id = processing_class.eos_token_id
        elif args.stop_token_id is not None:
            model.generation_config.eos_token_id = args.stop_token_id
        policy = wrapped_in_lora(model, lora)
        longest = max(len(processing_class(row["prompt"], add_special_tokens=True)["input_ids"])
                      for row in rows + eval_rows)
        folder = getattr(model.config, "_name_or_path", None)  # recorded as the run's model where it is a folder
        settings.update(lora, prompts=rows, prompt_field="prompt", chat_template=False, critic="separate",
                        model=folder if folder and Path(folder).is_dir() else None,
                        max_length=longest + args.response_length,
                        **({"eval_prompts": eval_rows, "eval_size": len(eval_rows)} if eval_rows else {}))
        args.world_size = world_size()  # the sizes TRL's trainer wrote into its config, for the script to read
        args.batch_size, args.mini_batch_size = settings["batch_size"], settings["mini_batch_size"]
        args.local_batch_size, args.num_total_batches = settings["batch_size"] // args.world_size, settings["iterations"]
        args.local_mini_batch_size = settings["mini_batch_size"] // args.world_size
        args.micro_batch_size = args.per_device_train_batch_size * args.world_size
        self.eval_rows = eval_rows
        self.start(args, callbacks, settings, notes, reward=reward_model, model=policy,
                   ref=None if lora else ref_model, tokenizer=processing_class, critic=value_critic(value_model))

    def extra_metrics(self, metrics: dict) -> dict:
        extra = {"episode": self.state.global_step * self.config.batch_size, "lr": self.config.lr}
        if "score" in metrics and "non_score_reward" in metrics:
            extra["objective/rlhf_reward"] = metrics.get("score_used", metrics["score"]) + metrics["non_score_reward"]
        if "score_used" in metrics:  # TRL's scores carry the missing-EOS penalty
            extra["objective/scores"] = metrics["score_used"]
        return extra

    def generate_completions(self, sampling: bool = False) -> list[dict]:
        """The held-out prompts answered greedily and scored by the reward model, the first five
        printed (TRL's table); returns every row."""
        if not self.eval_rows:
            return []
        run = self.run
        if getattr(run, "evaluator", None) is None:
            run.evaluator = run.make_evaluator(self.eval_rows[:run.config.batch_size] if sampling else self.eval_rows)
        metrics, samples = run.evaluate(sampled=False)
        table = [{"query": prompt, "model response": response} for prompt, response in samples]
        if is_main_process():
            print(f"held-out completions (greedy), mean score {metrics.get('eval/score', math.nan):.4g}:")
            for row in table[:5]:
                print(f"  {row['query']!r} -> {row['model response']!r}")
        return table


# ---------------------------------------------------------------- TRL's GRPOTrainer and RLOOTrainer
ONLINE_METRICS = {"reward": "score", "reward_std": "score_std", "completions/mean_length": "response_length",
                  "entropy": "entropy", "clip_ratio/region_mean": "clipfrac", "clip_ratio/low_mean": "clipfrac_low",
                  "clip_ratio/high_mean": "clipfrac_high"}
ROLLOUT_FUNC = ("rollout_func: ppo-rlhf's rollouts are its own; give an environment_factory (or tools) for "
                "multi-turn episodes, or a reward function for what you scored in the rollout")


class OnlineTrainer(TRLTrainer):
    """TRL 1.16's GRPOTrainer and RLOOTrainer (``kind``), which share their signature and data."""

    kind = "grpo"
    metric_names = ONLINE_METRICS

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
        model_type, parts = self.policy(model, processing_class, settings)
        settings.update(lora_settings(peft_config, model_type) if isinstance(model, (str, Path)) else {})
        if "model" in parts and peft_config is not None:
            parts["model"] = wrapped_in_lora(parts["model"], lora_settings(peft_config, model_type))
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
        self.start(args, callbacks, settings, notes, reward=rewards, environment=environment_factory,
                   tools=list(tools) if tools else None, **parts)

    @staticmethod
    def turns(args) -> dict:
        calls = getattr(args, "max_tool_calling_iterations", None)
        return {} if calls is None else {"max_turns": calls + 1}

    @staticmethod
    def policy(model, processing_class, settings: dict) -> tuple[str | None, dict]:
        """The model argument: a name or folder for this project to load (settings' ``model``), or
        an object (with its tokenizer: processing_class, else its folder's).  Returns (its
        architecture's model_type, the trainer's model parts)."""
        if isinstance(model, (str, Path)):
            from ppo_rlhf.hub import local_model

            folder = local_model(str(model), "model")
            settings["model"] = folder
            config_file = Path(folder) / "config.json"
            model_type = None
            if config_file.is_file():
                import json

                model_type = json.loads(config_file.read_text()).get("model_type")
            if processing_class is None:
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
        rendered = [tokenizer.apply_chat_template([{"role": "user", "content": text}] if isinstance(text, str) else text,
                                                  tools=tools or None, tokenize=False, add_generation_prompt=True)
                    for text in texts or [""] for tools in schemas]
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
