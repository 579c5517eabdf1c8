"""Pieces every stage runner uses: seeding, threads, the task lookup."""

from __future__ import annotations

from pathlib import Path

from ppo_rlhf.distributed import check_batch_split, on_main_process
from ppo_rlhf.hub import resolve_hub_models
from ppo_rlhf.run_folder import check_run_folder
from ppo_rlhf.tasks import get_task
from ppo_rlhf.trainers.common import check_policy, seed_everything, set_threads  # noqa: F401 (used by the stages)
from ppo_rlhf.trainers.resume import check_resume_settings, resumable


def load_task(name: str | None, seed: int = 0):
    return get_task(name).make_task(seed=seed) if name else None


def open_resumable_stage(config, out: Path) -> None:
    """The start of a stage with resumable checkpoints (sft, rm): join the process group under
    accelerate launch / torchrun, check that the batch splits over the processes, and that
    ``out`` may be written (or resumed, with the same settings).  A model named as on the Hub is
    read from the local cache."""
    resolve_hub_models(config)
    config.accelerator(shards=True)  # sft and rm shard what they train under an FSDP launch
    check_batch_split(config.batch_size)
    on_main_process(check_run_folder, out, config.overwrite, config.resume, resumable=resumable(out))
    if config.resume:
        check_resume_settings(config, out)
