"""--report-to: metrics.jsonl always, and the trackers named, offline: W&B in offline mode, MLflow
with a file store, Trackio in a local folder.  A resumed run continues each tracker's run without
sending a step twice (docs/usage.md, "Trackers")."""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import pytest

import ppo_rlhf.trackers as trackers
import ppo_rlhf.trainers.sft as sft_trainer
from ppo_rlhf.cli import main
from ppo_rlhf.config import ConfigError
from ppo_rlhf.runlog import read_metrics
from zoo import TINY, run, run_failing


def installed(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install \"ppo-rlhf[trackers]\")")


def sft_args(out, report_to, *extra):
    # logs steps 1, 3 and 6, checkpoints after 2, 4 and 6
    return ["sft", "--task", "doubling", "--steps", 6, "--batch-size", 16, "--eval-every", 3, "--save-every", 2,
            "--out", out, "--report-to", report_to, *TINY, *extra]


class Crash(Exception):
    """Stands for whatever stops a run midway."""


def crash_in_step_4_then_resume(out: Path, report_to: str, monkeypatch, after_crash=lambda: None) -> None:
    """Step 3 is logged after the checkpoint of step 2, then the run stops: the resumed run logs
    step 3 again, which a tracker already holds."""
    real, calls = sft_trainer.completion_loss, itertools.count(1)

    def crashing(*args, **kwargs):
        if next(calls) == 4:
            raise Crash
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(sft_trainer, "completion_loss", crashing)
        with pytest.raises(Crash):
            main([str(a) for a in sft_args(out, report_to)])
    after_crash()  # what the end of the crashed process would do
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 3]
    run(sft_args(out, report_to, "--resume"))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 3, 6]


def test_report_to_names_trackers_in_order_once_and_refuses_others():
    assert trackers.tracker_names("tensorboard") == ["tensorboard"]
    assert trackers.tracker_names("wandb, MLflow,wandb") == ["wandb", "mlflow"]
    assert trackers.tracker_names("none") == []
    for bad in ("comet", ""):
        with pytest.raises(ConfigError, match="allowed: tensorboard, wandb, mlflow, trackio"):
            trackers.tracker_names(bad)
    with pytest.raises(ConfigError, match="none means no tracker, so it goes alone and cannot go with wandb"):
        trackers.tracker_names("none,wandb")


def test_a_tracker_not_installed_stops_the_run_at_its_start_saying_what_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(trackers.TRACKERS, "wandb", ("ppo_rlhf_test_no_such_module", "wandb"))
    err = run_failing(sft_args(tmp_path / "run", "tensorboard,wandb"), capsys)
    assert "--report-to wandb needs the wandb package: pip install wandb" in err
    assert not (tmp_path / "run").exists()
    err = run_failing(sft_args(tmp_path / "run", "tensorboard,comet"), capsys)
    assert "comet is not a tracker" in err


def test_report_to_none_writes_the_metrics_file_alone(tmp_path):
    out = tmp_path / "run"
    run(sft_args(out, "none"))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 3, 6]
    assert not (out / "tb").exists() and not (out / trackers.TRACKER_IDS).exists()


@installed("wandb")
def test_wandb_offline_writes_its_run_and_a_resume_continues_it(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    crash_in_step_4_then_resume(out, "tensorboard,wandb", monkeypatch, after_crash=wandb.finish)
    run_id = json.loads((out / trackers.TRACKER_IDS).read_text())["wandb"]
    runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2, runs  # the run, then its resumed part: one W&B run id
    assert all(list(folder.glob(f"run-{run_id}.wandb")) for folder in runs)
    assert (out / "tb").is_dir()  # TensorBoard too


@installed("mlflow")
def test_mlflow_file_store_holds_each_step_once_after_a_resume(tmp_path, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out = tmp_path / "run"
    crash_in_step_4_then_resume(out, "mlflow", monkeypatch, after_crash=mlflow.end_run)
    run_id = json.loads((out / trackers.TRACKER_IDS).read_text())["mlflow"]
    client = MlflowClient()
    mlflow_run = client.get_run(run_id)
    assert mlflow_run.info.run_name == "run"  # named after the run folder
    assert mlflow_run.data.params["steps"] == "6"
    assert [point.step for point in client.get_metric_history(run_id, "loss")] == [1, 3, 6]
    assert not (out / "tb").exists()  # only what --report-to names


@installed("trackio")
def test_trackio_local_holds_each_step_once_after_a_resume(tmp_path, monkeypatch):
    import trackio
    import trackio.sqlite_storage as storage
    import trackio.utils

    # Trackio reads TRACKIO_DIR once, when it is first imported: its folder is moved here instead.
    for module in (trackio.utils, storage):
        monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    monkeypatch.setenv("TRACKIO_PROJECT", "ppo-rlhf-test")
    out = tmp_path / "run"
    crash_in_step_4_then_resume(out, "trackio", monkeypatch, after_crash=trackio.finish)
    name = json.loads((out / trackers.TRACKER_IDS).read_text())["trackio"]
    assert name.startswith("run-")  # the folder's name, made unique
    assert list((tmp_path / "trackio").glob("ppo-rlhf-test*.db"))
    logged = [row["step"] for row in storage.SQLiteStorage.get_logs("ppo-rlhf-test", name) if "loss" in row]
    assert logged == [1, 3, 6]


# ---------------------------------------------------------------- one run, one identity in every tracker
def three_runs(tmp_path: Path, report_to: str) -> list[Path]:
    """Two runs in folders of one name (a/run, b/run), then a/run again with --overwrite: three
    runs, each of which must be a tracker run of its own holding its steps once."""
    first, second = tmp_path / "a" / "run", tmp_path / "b" / "run"
    run(sft_args(first, report_to))
    run(sft_args(second, report_to))
    first_ids = json.loads((first / trackers.TRACKER_IDS).read_text()) if report_to != "tensorboard" else None
    run(sft_args(first, report_to, "--overwrite"))
    return [first_ids, second, first]


def tracker_ids(runs: list, name: str) -> list[str]:
    first_ids, second, first = runs
    return [first_ids[name], *(json.loads((folder / trackers.TRACKER_IDS).read_text())[name] for folder in (second, first))]


def test_tensorboard_runs_of_one_folder_name_keep_their_own_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, second, first = three_runs(tmp_path, "tensorboard")
    for folder in (first, second):
        events = EventAccumulator(str(folder / "tb"))
        events.Reload()
        assert [event.step for event in events.Scalars("loss")] == [1, 3, 6], folder


@installed("wandb")
def test_wandb_runs_of_one_folder_name_are_three_runs(tmp_path, monkeypatch):
    import wandb

    wandb.teardown()  # W&B keeps the settings (WANDB_DIR) of the first run in the process: read them afresh
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    ids = tracker_ids(three_runs(tmp_path, "wandb"), "wandb")
    assert len(set(ids)) == 3, ids
    for run_id in ids:
        assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))) == 1, run_id


@installed("mlflow")
def test_mlflow_runs_of_one_folder_name_are_three_runs(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    ids = tracker_ids(three_runs(tmp_path, "mlflow"), "mlflow")
    assert len(set(ids)) == 3, ids
    for run_id in ids:
        assert [point.step for point in MlflowClient().get_metric_history(run_id, "loss")] == [1, 3, 6], run_id


@installed("trackio")
def test_trackio_runs_of_one_folder_name_are_three_runs(tmp_path, monkeypatch):
    import trackio.sqlite_storage as storage
    import trackio.utils

    for module in (trackio.utils, storage):
        monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    monkeypatch.setenv("TRACKIO_PROJECT", "ppo-rlhf-identity")
    ids = tracker_ids(three_runs(tmp_path, "trackio"), "trackio")
    assert len(set(ids)) == 3, ids
    for name in ids:
        logged = [row["step"] for row in storage.SQLiteStorage.get_logs("ppo-rlhf-identity", name) if "loss" in row]
        assert logged == [1, 3, 6], (name, logged)
