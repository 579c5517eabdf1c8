"""A run folder belongs to one run: a stage refuses one that holds another run unless told to
``--resume`` it or ``--overwrite`` it, and nothing is deleted before the new run has started.

Checked before anything heavy is loaded (``check_run_folder``), so a wrong ``--out`` costs
nothing; the previous run's files go only once the new run is ready to write
(``start_run_folder``), so a start that fails on bad input leaves the user's run as it was.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_rlhf.checkpoint import recover_interrupted_writes
from ppo_rlhf.config import RUN, ConfigError, check_config, flag_name, option
from ppo_rlhf.runlog import read_metrics

# What a stage writes into its run folder; a folder holding any of these holds a run.
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "checkpoints", "tb", "curves.png", "config.yaml", "samples.jsonl",
               "trackers.json")
# What a run writes before its first training step (its settings, the step-0 evaluation, an empty
# TensorBoard log, its trackers' run ids): a folder holding only these holds no work, and a new run
# may take it over.
STARTUP_OUTPUTS = frozenset({"config.yaml", "metrics.jsonl", "tb", "trackers.json"})


@dataclass
class RunFolderOptions:
    option_group = RUN  # --help's group of all these options (config.py, GROUPS)

    overwrite: bool = option(False, "replace the run already in --out (its metrics, checkpoints and summary); "
                                    "without it (or --resume) a stage refuses an --out that holds a run",
                             first=True)

    def __post_init__(self) -> None:
        """A config built in Python is checked as one read from YAML or flags is: each field
        converted to its type and held to its choices and range, then the class's ``validate`` --
        a bad field raises ConfigError naming it at once, not at the first update."""
        check_config(self)


def check_out_spares_inputs(config: Any, extra_inputs: dict[str, str | None] | None = None) -> None:
    """Refuse an ``--out`` that would put a run where it can destroy what it reads: the same path
    as an input, a folder holding one where the run writes (``checkpoints/``, ``config.yaml``, ...:
    ``--overwrite`` deletes them, and the run writes over them), or a folder inside one (a model
    folder, a dataset saved to disk).

    The inputs are the fields the config class names in ``input_paths`` (``--model``,
    ``--data``, ...) and ``extra_inputs`` (``{"--config": file}``); paths compare after
    ``resolve()``, so ``x``, ``./x``, ``x/`` and ``/abs/x`` are one path.  A resume may read its
    settings from a file in its own folder: it deletes nothing.  ``--out ""`` is refused rather
    than read as the current folder.  Checked by the command line for every command (docs/design.md,
    "Resume and divergence")."""
    out_field = next((f for f in dataclasses.fields(config) if flag_name(f) == "--out"), None)
    given = getattr(config, out_field.name) if out_field is not None else None
    if given is None and hasattr(config, "resolved_out_dir"):  # gym: the default folder named after the env
        given = config.resolved_out_dir()
    if given is None:  # no --out: eval prints only, merge refuses it
        return
    given = str(given)
    if not given.strip():
        raise ConfigError("--out is empty: name the run folder (an empty --out would write the run into the "
                          "current folder)")
    out = Path(given).resolve()
    inputs = {flag_name(f): getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name in getattr(type(config), "input_paths", ())}
    for flag, value in {**inputs, **(extra_inputs or {})}.items():
        if value is None or not str(value).strip():
            continue
        path = Path(str(value)).resolve()
        if path == out:
            raise ConfigError(f"--out {given} is {flag} {value}: the run would write over (with --overwrite: "
                              f"delete) what it reads; choose another --out")
        # Inside --out, only what a run writes there is in danger (RUN_OUTPUTS: checkpoints/, ...,
        # which --overwrite deletes); the demo keeps its SFT and reward-model runs in sft/ and rm/.
        if out in path.parents and path.relative_to(out).parts[0] in RUN_OUTPUTS and not getattr(config, "resume", False):
            raise ConfigError(f"--out {given} holds {flag} {value}: the run writes into that folder (with "
                              f"--overwrite it deletes what a run wrote there); choose an --out outside it")
        if path in out.parents:
            raise ConfigError(f"--out {given} lies inside {flag} {value}: a run must not write into its input; "
                              f"choose an --out outside it")


def run_outputs(out: str | Path) -> list[str]:
    """The run files present in ``out`` (empty: a new or empty folder)."""
    out = Path(out)
    return [name for name in RUN_OUTPUTS if (out / name).exists()]


def holds_no_work(out: str | Path) -> bool:
    """Whether ``out`` holds only what a run stopped before its first step wrote: nothing is lost
    if a new run replaces it.  A damaged metrics file counts as work (it is looked at by hand)."""
    present = set(run_outputs(out))
    if not present or not present <= STARTUP_OUTPUTS:
        return False
    try:
        return all(record.get("step") == 0 for record in read_metrics(Path(out) / "metrics.jsonl"))
    except ValueError:
        return False


def check_run_folder(out: str | Path, overwrite: bool, resume: bool = False, resumable: Path | None = None) -> None:
    """Refuse an ``out`` that holds another run, and a resume with nothing to resume from.  A
    folder that holds no work (``holds_no_work``) is free without ``--overwrite``.

    ``resumable``: the checkpoint a resume continues from (stages that can resume)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file, not a folder")
    writable_folder(out, existing)
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: resume continues the run in --out, "
                          "overwrite replaces it")
    if resume:
        recover_interrupted_writes(out / "checkpoints")
        if resumable is None or not resumable.exists():
            how = "drop --resume to start it again" if holds_no_work(out) or not run_outputs(out) else \
                "the run there stopped before its first checkpoint: drop --resume and pass --overwrite to start it again"
            raise ConfigError(f"--resume: nothing to resume in {out} (no {resumable or 'checkpoint'}); {how}")
        return
    present = run_outputs(out)
    if present and not overwrite and not holds_no_work(out):
        options = "--resume to continue it, --overwrite to replace it" if resumable is not None else \
            "--overwrite to replace it"
        raise ConfigError(f"--out {out} already holds a run ({', '.join(present)}): pass {options}, "
                          f"or choose another --out")
    if present and (overwrite or holds_no_work(out)):
        deletable_outputs(out, present)


def deletable_outputs(out: Path, present: list[str]) -> None:
    """ConfigError naming the first folder whose entries the run's start could not delete (a
    read-only or immutable ``checkpoints/``, a read-only mount), before anything is deleted: a
    start that failed half-way through the deletion would leave neither run whole.  Each folder
    that deletion empties is tried for real, as ``writable_folder`` tries --out."""
    folders = [out]
    for name in present:
        if (out / name).is_dir():
            folders += [out / name, *(p for p in (out / name).rglob("*") if p.is_dir() and not p.is_symlink())]
    for folder in folders:
        try:
            tempfile.TemporaryDirectory(dir=folder, prefix=".ppo-rlhf-probe-").cleanup()
        except OSError as error:
            raise ConfigError(f"--out {out}: {folder} cannot be changed ({error.strerror or error}), so the previous "
                              f"run's files there cannot be deleted to start this one (--overwrite); make it writable "
                              f"(chmod -R u+w, or chattr -R -i), or choose another --out") from None


def writable_folder(out: Path, existing: Path) -> None:
    """ConfigError naming --out unless a folder can be made in ``existing`` (``out`` or the
    nearest folder above it that exists).  Tried for real: permission bits say nothing of a
    read-only file system, or of /proc, to root."""
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {existing} is not writable")
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".ppo-rlhf-probe-").cleanup()
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot write in {existing} ({error.strerror or error})") from None


def start_run_folder(out: str | Path, overwrite: bool) -> list[str]:
    """Make ``out`` ready for writing: the previous run's files removed (with ``overwrite``) and
    what killed runs left unfinished cleaned up.  Returns notices to print."""
    out = Path(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--out {out}: cannot create the folder ({error.strerror or error})") from None
    notices = []
    if overwrite or holds_no_work(out):
        why = "--overwrite" if overwrite else "it stopped before its first step"
        for name in run_outputs(out):
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            notices.append(f"removed the previous run's {name} ({why})")
    notices += recover_interrupted_writes(out) + recover_interrupted_writes(out / "checkpoints")
    return notices


# PPO settings a resume may change: how long, how often it evaluates and saves, the learning
# rates (applied to the resumed optimizer), and where the folder is (the same run given as x/,
# or moved).  Any other change would make the resumed run a different run (another model,
# reference, reward, critic, LoRA, batch or objective).
MAY_CHANGE_ON_RESUME = frozenset({
    "out", "iterations", "eval_every", "eval_size", "eval_sampled", "eval_samples", "eval_prompts", "eval_split", "show_samples", "save_every",
    "resume", "overwrite", "num_threads", "lr", "critic_lr", "sample_every", "max_bad_steps",
    "report_to",  # where the metrics also go (trackers.py): the same run continued
    "rollout_micro_batch_size", "train_micro_batch_size", "max_tokens_per_micro_batch", "share_prompts",  # how the
    # same sums are split into passes
    "reward_timeout", "reward_retries", "reward_backoff",  # how patiently the same scores are fetched
    "vllm_probe_tolerance",  # the bound of a check on the engine's weights: a run stopped by it may go on with another
    "server_url", "server_timeout", "weight_transfer",  # where the same rollouts are generated, how the weights get there
})


def changed_settings(saved: dict, current: dict, may_change=MAY_CHANGE_ON_RESUME, defaults: dict | None = None
                     ) -> list[str]:
    """'key: saved -> current' for each setting that differs and may not change on resume.

    A setting the saved run does not record (it came in a later version) counts as its default
    there (``defaults``): a run from before it existed resumes as long as it is left at it.  The
    ``lora_*`` settings do nothing in a run without ``lora``, so they are not compared there (a
    full-model run keeps resuming when one of their defaults changes, as the targets' did)."""
    saved = {**(defaults or {}), **saved}
    inert = {key for key in set(saved) | set(current)
             if key.startswith("lora_") and not saved.get("lora") and not current.get("lora")}
    return [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in sorted(set(saved) | set(current))
            if key not in may_change and key not in inert and saved.get(key) != current.get(key)]
