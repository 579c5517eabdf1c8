"""A run folder belongs to one run: a stage refuses one that holds another run unless told to
``--resume`` it or ``--overwrite`` it, and nothing is deleted before the new run has started.

Checked before anything heavy is loaded (``check_run_folder``), so a wrong ``--out`` costs
nothing; the previous run's files go only once the new run is ready to write
(``start_run_folder``), so a start that fails on bad input leaves the user's run as it was.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ppo_rlhf.checkpoint import recover_interrupted_writes
from ppo_rlhf.config import ConfigError, option

# What a stage writes into its run folder; a folder holding any of these holds a run.
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "checkpoints", "tb", "curves.png", "config.yaml", "samples.jsonl")


@dataclass
class RunFolderOptions:
    overwrite: bool = option(False, "replace the run already in --out (its metrics, checkpoints and summary); "
                                    "without it (or --resume) a stage refuses an --out that holds a run")


def run_outputs(out: str | Path) -> list[str]:
    """The run files present in ``out`` (empty: a new or empty folder)."""
    out = Path(out)
    return [name for name in RUN_OUTPUTS if (out / name).exists()]


def check_run_folder(out: str | Path, overwrite: bool, resume: bool = False, resumable: Path | None = None) -> None:
    """Refuse an ``out`` that holds another run, and a resume with nothing to resume from.

    ``resumable``: the checkpoint a resume continues from (stages that can resume)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {existing} is not writable")
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: resume continues the run in --out, "
                          "overwrite replaces it")
    if resume:
        recover_interrupted_writes(out / "checkpoints")
        if resumable is None or not resumable.exists():
            raise ConfigError(f"--resume: nothing to resume in {out} (no {resumable or 'checkpoint'}); "
                              f"drop --resume to start a new run")
        return
    present = run_outputs(out)
    if present and not overwrite:
        options = "--resume to continue it, --overwrite to replace it" if resumable is not None else \
            "--overwrite to replace it"
        raise ConfigError(f"--out {out} already holds a run ({', '.join(present)}): pass {options}, "
                          f"or choose another --out")


def start_run_folder(out: str | Path, overwrite: bool) -> list[str]:
    """Make ``out`` ready for writing: the previous run's files removed (with ``overwrite``) and
    what killed runs left unfinished cleaned up.  Returns notices to print."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    notices = []
    if overwrite:
        for name in run_outputs(out):
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            notices.append(f"removed the previous run's {name} (--overwrite)")
    notices += recover_interrupted_writes(out) + recover_interrupted_writes(out / "checkpoints")
    return notices


# PPO settings a resume may change: how long, how often it evaluates and saves, the learning
# rates (applied to the resumed optimizer).  Any other change would make the resumed run a
# different run (another model, reference, reward, critic, LoRA, batch or objective).
MAY_CHANGE_ON_RESUME = frozenset({
    "iterations", "eval_every", "eval_size", "eval_sampled", "eval_prompts", "eval_split", "show_samples", "save_every",
    "resume", "overwrite", "num_threads", "lr", "critic_lr", "sample_every", "max_bad_steps",
    "rollout_micro_batch_size", "train_micro_batch_size",  # how the same sums are split into passes
    "reward_timeout", "reward_retries", "reward_backoff",  # how patiently the same scores are fetched
})


def changed_settings(saved: dict, current: dict, may_change=MAY_CHANGE_ON_RESUME, defaults: dict | None = None
                     ) -> list[str]:
    """'key: saved -> current' for each setting that differs and may not change on resume.

    A setting the saved run does not record (it came in a later version) counts as its default
    there (``defaults``): a run from before it existed resumes as long as it is left at it."""
    saved = {**(defaults or {}), **saved}
    return [f"{key}: {saved.get(key)!r} -> {current.get(key)!r}" for key in sorted(set(saved) | set(current))
            if key not in may_change and saved.get(key) != current.get(key)]
