"""Resumable checkpoints for every trainer (sft, rm, ppo, gym): ``OUT/checkpoints/last``, rewritten
atomically every ``save_every`` steps, from which ``--resume`` continues to the result a straight
run gives (same weights, same metrics, nothing logged twice).

    OUT/checkpoints/last/
      trained.safetensors   the parameters that train: the whole model, or a LoRA adapter and its
                            score head, or the gym actor-critic; float32 as they train
      trainer_state.pt      step, optimizer, RNG states (python, numpy, torch, CUDA), loss scaler,
                            and what the trainer needs to go on (data order, running statistics,
                            the numbers its summary reports)
      run_config.json       the run's settings: a resume whose settings would make it another run
                            is refused, naming each one

Only the trained parameters are saved: what is frozen (a LoRA base) or never trained is rebuilt
from the run's settings, which a resume may not change.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ppo_rlhf.checkpoint import atomic_directory, atomic_write_json, atomic_write_text, strict_json
from ppo_rlhf.config import ConfigError, read_setting, to_dict
from ppo_rlhf.distributed import gather_objects, on_main_process, rank, world_size
from ppo_rlhf.interrupts import note_checkpoint
from ppo_rlhf.run_folder import MAY_CHANGE_ON_RESUME, changed_settings
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.sharding import (fsdp_launched, load_whole, load_whole_optimizer_state, local_optimizer_state,
                               whole_optimizer_state, whole_tensors)
from ppo_rlhf.trainers.guard import require_finite_in_every_process

TRAINED, TRAINER_STATE, RUN_CONFIG = "trained.safetensors", "trainer_state.pt", "run_config.json"


def last_checkpoint(out: str | Path) -> Path:
    return Path(out) / "checkpoints" / "last"


def resumable(out: str | Path) -> Path:
    """The file whose presence makes a run folder resumable (written last into the checkpoint)."""
    return last_checkpoint(out) / TRAINER_STATE


# ------------------------------------------------------------------ RNG states
def rng_states(device: torch.device) -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def restore_rng_states(states: dict, device: torch.device) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


# ------------------------------------------------------------------ trained parameters
def trained_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train, by name; one shared by two modules (tied embeddings) once."""
    return {name: parameter.detach() for name, parameter in model.named_parameters() if parameter.requires_grad}


def load_trained_parameters(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    parameters = trained_parameters(model)
    if parameters.keys() != tensors.keys():
        missing, unexpected = sorted(parameters.keys() - tensors.keys()), sorted(tensors.keys() - parameters.keys())
        raise ConfigError(f"--resume: the checkpoint's trained parameters do not fit this model "
                          f"(missing: {missing[:3]}, unexpected: {unexpected[:3]})")
    for name, parameter in parameters.items():
        load_whole(parameter, tensors[name])  # a sharded model's parameter takes its shard


# ------------------------------------------------------------------ settings and metrics
PROCESSES = "processes"  # run_config.json's record of the world size; not a setting
SHARDED = "sharded"  # and whether the processes sharded the model (FSDP): its optimizer state is keyed by name


def run_settings(config: Any) -> dict:
    """The config as run_config.json holds it (strict JSON: lists, not tuples; None, not NaN), and
    the number of processes that trained it, and whether they sharded it."""
    return {**json.loads(json.dumps(strict_json(to_dict(config)))), PROCESSES: world_size(), SHARDED: fsdp_launched()}


def field_defaults(config: Any) -> dict:
    """Each setting's default, as run_config.json would hold it."""
    defaults = {}
    for field in dataclasses.fields(config):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
    return json.loads(json.dumps(strict_json(defaults)))


def resolve_input_paths(settings: dict, keys: tuple) -> None:
    """The input paths among ``settings`` made absolute (``data.jsonl`` and ``./data.jsonl`` and
    ``/abs/data.jsonl`` are one file), in place; an unset one, or a hub name, is left alone."""
    for key in keys:
        value = settings.get(key)
        if isinstance(value, str) and value.strip() and Path(value).exists():
            settings[key] = str(Path(value).resolve())


def check_resume_settings(config: Any, out: str | Path) -> None:
    """Refuse a resume whose settings would make it another run, naming each one changed.

    What may change is the config class's ``may_change_on_resume`` (how long, how often it
    saves or evaluates, the learning rate, threads)."""
    saved_path = last_checkpoint(out) / RUN_CONFIG
    if not saved_path.is_file():
        return
    saved = json.loads(saved_path.read_text())
    refuse_another_stage(config, saved, out)
    # A setting renamed or split since the run was saved, read as it is spelled now (the class says how).
    saved = getattr(type(config), "saved_settings_now", lambda settings: settings)(saved)
    saved = {key: read_setting(type(config), key, value) for key, value in saved.items()}
    # Each process holds its own sampling state and part of the batch: another count is another run.
    trained_by = saved.pop(PROCESSES, 1)
    if trained_by != world_size():
        raise ConfigError(f"--resume: the run in {out} was trained by {trained_by} process(es) and this is "
                          f"{world_size()}; resume it with the same number (accelerate launch --num_processes "
                          f"{trained_by} ...), or start a new run")
    sharded = saved.pop(SHARDED, False)
    if sharded != fsdp_launched():
        how = "with an FSDP config (configs/accelerate/fsdp.yaml)" if sharded else "without an FSDP config"
        raise ConfigError(f"--resume: the run in {out} was trained {how}; resume it the same way, or start a new run")
    current = run_settings(config)
    current.pop(PROCESSES)
    current.pop(SHARDED)
    may_change = getattr(type(config), "may_change_on_resume", MAY_CHANGE_ON_RESUME)
    for settings in (saved, current):  # an input named by another spelling of its path is the same input
        resolve_input_paths(settings, getattr(type(config), "input_paths", ()))
    changed = changed_settings(saved, current, may_change, field_defaults(config))
    if changed:
        raise ConfigError(f"--resume: these settings differ from the run in {out}, and changing them would make it "
                          f"another run: {'; '.join(changed)}.  Start a new run (another --out, or --overwrite) "
                          f"to use them")


# The command of each stage that writes resumable checkpoints, by its config class.
STAGE_COMMANDS = {"SFTConfig": ("sft", "ppo_rlhf.trainers.sft"), "RewardConfig": ("rm", "ppo_rlhf.trainers.reward"),
                  "PPOConfig": ("ppo", "ppo_rlhf.trainers.ppo_config"),
                  "GymPPOConfig": ("gym", "ppo_rlhf.trainers.gym_config")}


def refuse_another_stage(config: Any, saved: dict, out: str | Path) -> None:
    """ConfigError when the checkpoint in ``out`` is another stage's (``ppo --resume`` on an sft
    run): its settings hold keys this stage's config has no field for.  Named as the stage whose
    config has a field for every one of them, rather than as a list of every setting that
    differs."""
    import importlib

    known = {field.name for field in dataclasses.fields(config)} | {PROCESSES, SHARDED}
    if set(saved) <= known:
        return
    this = STAGE_COMMANDS.get(type(config).__name__, (type(config).__name__,))[0]
    for name, (command, module) in STAGE_COMMANDS.items():
        fields = {field.name for field in dataclasses.fields(getattr(importlib.import_module(module), name))}
        if command != this and set(saved) <= fields | {PROCESSES, SHARDED}:
            article = "an" if command in ("sft", "rm") else "a"  # as the letters are read: "an ess-eff-tee"
            raise ConfigError(f"--resume: {out} holds {article} {command} run (its checkpoint's settings are those of "
                              f"ppo-rlhf {command}), not a {this} run; continue it with ppo-rlhf {command} --resume, "
                              f"or give this {this} run another --out")


METRICS_ROWS = "metrics_rows"  # a checkpoint's record of the metric rows logged before it was written


def metric_rows(out: str | Path) -> int:
    """How many rows ``OUT/metrics.jsonl`` holds now (each is written whole, then closed)."""
    return len(read_metrics(Path(out) / "metrics.jsonl"))


def drop_metrics_after(out: str | Path, step: int, rows: int | None = None) -> None:
    """Drop the metrics a killed run logged after its checkpoint: the resumed run logs them again.

    ``rows``: how many rows were logged when the checkpoint was written.  A row logged after
    it at the checkpoint's own step (rm's final evaluation, logged at the last step after the
    last checkpoint) is dropped too, or the resumed run would log it a second time.  Older
    checkpoints without the count: by step alone."""
    path = Path(out) / "metrics.jsonl"
    notices: list[str] = []
    records = [r for r in read_metrics(path, notices) if r["step"] <= step]
    if rows is not None:
        records = records[:rows]
    for notice in notices:
        print(notice)
    if path.exists():
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))


def check_resumed_steps(saved: int, total: int, last: Path, unit: str = "step", flag: str = "") -> None:
    """Refuse a resume asking for fewer steps than the checkpoint has done: it would end at once,
    its summary claiming a shorter run than the weights had."""
    if saved > total:
        raise ConfigError(f"--resume: the checkpoint in {last} is after {unit} {saved}, past the {total} "
                          f"asked for; ask for at least {saved}" + (f" ({flag} {saved})" if flag else ""))


# ------------------------------------------------------------------ the checkpoint
@dataclass
class Checkpoints:
    """Where a trainer saves its resumable state and how often; with ``--resume``, the state it
    continues from (``saved``, read by :meth:`load`)."""

    out: Path
    every: int  # save after every N steps and after the last (0: never)
    settings: dict  # the run's config, written as run_config.json
    saved: dict | None = None
    written: int | None = None  # the step of the last checkpoint this run wrote
    unit: str = "step"  # what a step is called in messages (ppo, gym: iteration)

    @property
    def step(self) -> int:
        """The step the run continues after (0: a new run)."""
        return self.saved["step"] if self.saved else 0

    @property
    def saved_step(self) -> int | None:
        """The step of the checkpoint on disk, the one a resume would continue after (None: none)."""
        return self.written if self.written is not None else (self.step or None)

    def due(self, done: int, total: int) -> bool:
        return self.every > 0 and (done % self.every == 0 or done == total)

    def load(self, total: int, unit: str = "step", flag: str | None = None) -> dict:
        """Read ``OUT/checkpoints/last`` (a resumed run); prints where the run resumes."""
        last = last_checkpoint(self.out)
        self.saved = torch.load(last / TRAINER_STATE, weights_only=False, map_location="cpu")
        check_resumed_steps(self.step, total, last, unit, flag if flag is not None else ("--steps" if unit == "step" else ""))
        print(f"resumed from {last} after {unit} {self.step} of {total}")
        note_checkpoint(self.step, unit)  # on disk, whole: an abort at once names it
        return self.saved

    def save(self, done: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict,
             accelerator=None) -> None:
        """Write the checkpoint after step ``done``; ``state``: the trainer's own (picklable) state.
        Refuses non-finite weights or optimizer moments: the last good checkpoint stays."""
        from safetensors.torch import save_file

        # A sharded model: whole tensors, gathered by every process and kept by the main one.
        # Checked in every process together: sharded, each holds other parts.
        tensors = whole_tensors(trained_parameters(model))
        require_finite_in_every_process(tensors, f"the weights after {done} steps")
        require_finite_in_every_process({f"{index}.{key}": value for index, moments in
                                         local_optimizer_state(optimizer)["state"].items()
                                         for key, value in moments.items()}, f"the optimizer state after {done} steps")
        optimizer_state = whole_optimizer_state(optimizer)
        device = accelerator.device if accelerator is not None else torch.device("cpu")
        scaler = getattr(accelerator, "scaler", None)
        # Several processes: the same weights in each, written once by the main process; the random
        # states are each process's own (dropout, sampling), kept by rank.
        random_states = gather_objects([rng_states(device)])

        def write() -> None:
            with atomic_directory(last_checkpoint(self.out)) as staging:
                save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(staging / TRAINED))
                atomic_write_json(staging / RUN_CONFIG, self.settings)
                torch.save({"step": done, "optimizer": optimizer_state, "rng_by_process": random_states,
                            "scaler": scaler.state_dict() if scaler is not None else None,
                            METRICS_ROWS: metric_rows(self.out), **state},
                           staging / TRAINER_STATE)

        on_main_process(write)
        self.written = done
        note_checkpoint(done, self.unit)

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, accelerator=None) -> dict:
        """Put the saved weights, optimizer moments, loss scale and RNG states into this run;
        returns the saved state (the trainer reads its own parts from it).  Call it where a
        straight run would start its first step, so that nothing consumes RNG after it."""
        from safetensors.torch import load_file

        saved = self.saved
        load_trained_parameters(model, load_file(str(last_checkpoint(self.out) / TRAINED)))
        load_whole_optimizer_state(optimizer, saved["optimizer"])
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None and saved["scaler"] is not None:
            scaler.load_state_dict(saved["scaler"])
        mine = saved["rng_by_process"][rank()]  # the world size was checked at start
        restore_rng_states(mine, accelerator.device if accelerator is not None else torch.device("cpu"))
        return saved


def open_checkpoints(config: Any, out: str | Path, total: int, unit: str = "step", logged_step_scale: int = 1,
                     flag: str | None = None) -> Checkpoints:
    """The run's checkpoints (``config.save_every``, ``config.resume``); with ``--resume`` the
    state it continues from is read, where it resumes printed, and the metrics logged after it
    dropped.  ``logged_step_scale``: metrics are logged at step * this (gym: env steps); ``flag``:
    the option that sets ``total``, named when a resume asks for fewer steps than were done."""
    checkpoints = Checkpoints(Path(out), config.save_every, run_settings(config), unit=unit)
    note_checkpoint(None)  # a new run has written none yet (a resume reads its own, below)
    if config.resume:
        checkpoints.load(total, unit, flag)
        on_main_process(drop_metrics_after, out, checkpoints.step * logged_step_scale,
                        checkpoints.saved.get(METRICS_ROWS))
    return checkpoints
