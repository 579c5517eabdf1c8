"""What TRL's trainers here share (docs/migrating_from_trl.md): :class:`TRLTrainer` -- ``train()``,
``save_model``, ``push_to_hub`` (refused), callbacks, ``state`` and ``model`` -- around this
project's one trainer, :class:`TRLRun`, which reports each iteration to the script's callbacks under
TRL's metric names beside this project's and prints, with the run's plan, where the run differs
from TRL's; and the peft LoRA config read as this project's LoRA options.  No loop of its own.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from ppo_rlhf.config import ConfigError
from ppo_rlhf.distributed import is_main_process
from ppo_rlhf.trainers.ppo import PPOTrainer as ProjectPPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig as ProjectPPOConfig
from ppo_rlhf.trl.translate import refuse_unmatched


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
    return with_adapter(options, model, "CAUSAL_LM")  # TRL's adapter name, "default": saved at a folder's root


def refuse_given(given: dict[str, object]) -> None:
    """ConfigError for the first trainer argument given that has no counterpart here: name -> why."""
    for name, why in given.items():
        if why:
            raise ConfigError(f"{name}: {why} (docs/migrating_from_trl.md)")


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
        self.run.steps_per_iteration = self.steps_per_iteration(args)  # TrainerState's steps, as TRL counts them
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

    @staticmethod
    def steps_per_iteration(args) -> int:
        """TrainerState steps an iteration makes: TRL's PPO counted batches (1)."""
        return 1

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
