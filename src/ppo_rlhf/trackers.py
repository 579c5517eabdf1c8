"""Where a run's metrics go besides ``metrics.jsonl``: ``--report-to tensorboard,wandb,mlflow,trackio``
or ``none`` (docs/design.md, "Metrics").

``metrics.jsonl`` is always written: a resume reads it.  The trackers get the same rows from the
same process, the one that writes the run folder (``RunLog`` in the main process).  TensorBoard is
``torch.utils.tensorboard`` (its ``purge_step`` rewinds a resumed run); W&B, MLflow and Trackio go
through accelerate's wrappers (``accelerate.tracking``), each made and started here rather than
through an ``Accelerator``, which would start them in every process.

Each tracker's run is named after the run folder; the ids that let a ``--resume`` continue the
same tracker run are kept in ``RUN/trackers.json``.  A new run (a new folder, or one emptied by
``--overwrite``) is always a new tracker run, even where another run's folder has the same name:
two runs never log into one.

- tensorboard  events in ``RUN/tb``; a resume purges the events of the steps after its checkpoint.
- wandb        the same run (``id``, ``resume="allow"``); W&B keeps the values it already has for
               the steps redone after the checkpoint (a step below its last is dropped).
- mlflow       the same run (``run_id``); steps the run already holds are not sent again.
- trackio      the same run (its name, ``resume="allow"``); steps it already holds are not sent again.
               Trackio knows a run by its name alone, so a new run's name is the folder's with a
               random suffix (``run-3f2a9c1e``): runs/a/run and runs/b/run would otherwise be one.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ppo_rlhf.checkpoint import atomic_write_json
from ppo_rlhf.config import RUN, ConfigError, option

# name -> (the module it needs, the package pip installs it from)
TRACKERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
    "trackio": ("trackio", "trackio"),
}
TRACKER_IDS = "trackers.json"  # in the run folder: {tracker: the id of its run}
PROJECT = "ppo-rlhf"  # the W&B project, MLflow experiment and Trackio project, unless the environment names one


@dataclass
class ReportOptions:
    option_group = RUN  # --help's group of all these options (config.py, GROUPS)

    report_to: str = option("tensorboard", "where metrics go besides metrics.jsonl (always written): "
                                           "tensorboard, wandb, mlflow, trackio, comma-separated, or none")


def tracker_names(report_to: str | list[str] | None) -> list[str]:
    """The trackers ``--report-to`` names, in order, each once; ``none``: no tracker."""
    given = report_to if isinstance(report_to, (list, tuple)) else str(report_to or "").split(",")
    names = [str(name).strip().lower() for name in given if str(name).strip()]
    if names == ["none"]:
        return []
    if "none" in names:
        others = ", ".join(name for name in names if name != "none")
        raise ConfigError(f"--report-to {report_to!r}: none means no tracker, so it goes alone and cannot go with "
                          f"{others}; give --report-to none alone, or the trackers without it")
    unknown = [name for name in names if name not in TRACKERS]
    if unknown or not names:
        raise ConfigError(f"--report-to {report_to!r}: {', '.join(unknown) or 'nothing'} is not a tracker; allowed: "
                          f"{', '.join(TRACKERS)} (comma-separated), or none")
    return list(dict.fromkeys(names))


def check_trackers(report_to: str | list[str] | None) -> list[str]:
    """The named trackers, each of whose packages is installed; a missing one stops the run at its
    start, saying what to install."""
    names = tracker_names(report_to)
    _require_packages(names)
    return names


def _require_packages(names: list[str]) -> None:
    for name in names:
        module, package = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"--report-to {name} needs the {package} package: pip install {package} "
                              f"(or pip install \"ppo-rlhf[trackers]\")")


def open_trackers(names: list[str], out_dir: Path, config: dict[str, Any] | None, resumed: bool) -> list["Tracker"]:
    """Start the trackers named (but TensorBoard, which ``RunLog`` writes itself), each continuing
    its run of ``out_dir`` when ``resumed``; records their ids in ``out_dir/trackers.json``."""
    _require_packages(names)
    names = [name for name in names if name != "tensorboard"]
    if not names:
        return []
    record_path = out_dir / TRACKER_IDS
    saved = json.loads(record_path.read_text()) if resumed and record_path.exists() else {}
    run_name = out_dir.resolve().name
    kinds = {"wandb": _WandB, "mlflow": _MLflow, "trackio": _Trackio}
    trackers = []
    for name in names:
        try:
            trackers.append(kinds[name](run_name, saved.get(name), config or {}))
        except Exception as error:  # noqa: BLE001 -- the tracker's own reason, said once, at the start
            for tracker in trackers:
                tracker.finish()
            raise ConfigError(f"--report-to {name}: the tracker did not start: {str(error).splitlines()[0]}") from error
    atomic_write_json(record_path, {**saved, **{t.name: t.run_id for t in trackers}})
    return trackers


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (strings, None and non-finite values stay in the JSONL)."""
    return {key: value for key, value in metrics.items()
            if isinstance(value, float) and math.isfinite(value)}


class Tracker:
    """One tracker run: ``log`` a step's scalars, ``finish``.  ``last_step``: the last step the
    run already held when it was continued (steps up to it are not sent again)."""

    name = ""

    def __init__(self, run_name: str, run_id: str | None, config: dict[str, Any]):
        self.last_step: int | None = None
        self.run_id = run_id
        self.tracker = self.start(run_name, run_id, config)

    def start(self, run_name: str, run_id: str | None, config: dict[str, Any]):
        raise NotImplementedError

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        scalars = _scalars(metrics)
        if scalars and (self.last_step is None or step > self.last_step):
            self.tracker.log(scalars, step=step)

    def finish(self) -> None:
        self.tracker.finish()


class _WandB(Tracker):
    name = "wandb"

    def start(self, run_name, run_id, config):
        from accelerate.tracking import WandBTracker

        # accelerate passes its run_name to wandb.init as the project; the run itself is named here.
        tracker = WandBTracker(os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, id=run_id, resume="allow")
        tracker.start()
        self.run_id = tracker.run.id
        if run_id is None:
            tracker.store_init_configuration(config)
        return tracker


class _MLflow(Tracker):
    name = "mlflow"

    def start(self, run_name, run_id, config):
        from accelerate.tracking import MLflowTracker

        tracker = MLflowTracker(experiment_name=os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT), run_id=run_id,
                                run_name=run_name)
        tracker.start()
        self.run_id = tracker.active_run.info.run_id
        if run_id is None:
            # MLflow keeps parameters as strings, and refuses to change one: recorded once, at the start.
            tracker.store_init_configuration({key: json.dumps(value) if isinstance(value, (dict, list)) else value
                                              for key, value in config.items()})
        else:
            self.last_step = _mlflow_last_step(self.run_id)
        return tracker

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        # MLflow refuses a metric name with '@' (letters, digits, _ - . / : and spaces only):
        # pass@k is sent as pass_at_k there, and as pass@k everywhere else.
        super().log(step, {key.replace("@", "_at_"): value for key, value in metrics.items()})


def _mlflow_last_step(run_id: str) -> int | None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    steps = [point.step for key in client.get_run(run_id).data.metrics
             for point in client.get_metric_history(run_id, key)]
    return max(steps, default=None)


class _Trackio(Tracker):
    name = "trackio"

    def start(self, run_name, run_id, config):
        from accelerate.tracking import TrackioTracker

        project = os.environ.get("TRACKIO_PROJECT", PROJECT)
        # Trackio knows a run by its name in the project: a new run's is made unique, so that two
        # run folders of one name (or a folder started again with --overwrite) are two runs.
        self.run_id = run_id or f"{run_name}-{secrets.token_hex(4)}"
        tracker = TrackioTracker(project, name=self.run_id, resume="allow", config=config if run_id is None else None)
        tracker.start()
        if run_id is not None:
            self.last_step = _trackio_last_step(project, self.run_id)
        return tracker


def _trackio_last_step(project: str, run: str) -> int | None:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_max_step_for_run(project, run)
