"""A run folder: the resolved config, ``metrics.jsonl``, TensorBoard events, a PNG of the main
curves and ``summary.json``.  Every trainer writes the same layout; the trackers ``--report-to``
names get the metrics too (trackers.py).

    RUN/
      config.yaml        the resolved configuration (defaults + YAML + flags)
      metrics.jsonl      one JSON object per logged step
      samples.jsonl      training rollouts (prompt, response, score) every few iterations
      tb/                TensorBoard events (``tensorboard --logdir RUN/tb``), with --report-to tensorboard
      trackers.json      the runs of the other trackers (W&B, MLflow, Trackio), continued by --resume
      curves.png         the main curves, redrawn at the end of the run
      summary.json       final evaluation and the paths of the checkpoints
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

import yaml

from ppo_rlhf.checkpoint import atomic_write_json, atomic_write_text, strict_json
from ppo_rlhf.trackers import open_trackers, tracker_names


class RunLog:
    """Appends metrics to ``metrics.jsonl`` and the trackers; draws curves; writes the summary."""

    def __init__(self, out_dir: str | Path, config: dict[str, Any] | None = None, report_to: str | None = None,
                 resume_after: int | None = None):
        """``report_to``: the trackers besides ``metrics.jsonl`` (trackers.py); None: the config's
        ``report_to`` (``--report-to``), TensorBoard if it has none.  ``resume_after``: the step a
        resumed run continues after; TensorBoard events of later steps (written before the kill,
        about to be written again) are purged, and the other trackers continue their runs."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if config is not None:
            atomic_write_text(self.out_dir / "config.yaml", yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
        self.metrics_path = self.out_dir / "metrics.jsonl"
        names = tracker_names((config or {}).get("report_to", "tensorboard") if report_to is None else report_to)
        self._trackers = open_trackers(names, self.out_dir, config, resumed=resume_after is not None)
        self._tb = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter  # heavy import, only when used

            purge_step = None if resume_after is None else resume_after + 1
            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tb"), purge_step=purge_step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": int(step)}
        for key, value in metrics.items():
            value = float(value) if hasattr(value, "__float__") and not isinstance(value, (str, bool)) else value
            record[key] = value
            if self._tb is not None and isinstance(value, float) and math.isfinite(value):
                self._tb.add_scalar(key, value, step)
        with self.metrics_path.open("a") as handle:
            handle.write(json.dumps(strict_json(record), allow_nan=False) + "\n")
        for tracker in self._trackers:
            tracker.log(step, {key: value for key, value in record.items() if key != "step"})

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Training rollouts (prompt, response, score): ``samples.jsonl`` and TensorBoard's text tab."""
        with (self.out_dir / "samples.jsonl").open("a") as handle:
            for sample in samples:
                handle.write(json.dumps(strict_json({"step": int(step), **sample}), ensure_ascii=False) + "\n")
        if self._tb is not None:
            table = "\n".join(f"| {_cell(s['prompt'])} | {_cell(s['response'])} | {s['score']:.4g} |" for s in samples)
            self._tb.add_text("samples", "| prompt | response | score |\n|---|---|---|\n" + table, step)

    def records(self) -> list[dict[str, Any]]:
        return read_metrics(self.metrics_path)

    def plot(self, keys: Iterable[str], filename: str = "curves.png", x: str = "step", title: str = "") -> Path | None:
        """Draw each metric in ``keys`` against ``x`` in its own panel; skips keys never logged."""
        return plot_metrics(self.records(), keys, self.out_dir / filename, x=x, title=title)

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_json(self.out_dir / "summary.json", summary)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for tracker in self._trackers:
            tracker.finish()
        self._trackers = []


class SilentRunLog(RunLog):
    """The run log of a process that does not write the run folder (every rank but 0 of several):
    the same calls, nothing written."""

    def __init__(self, out_dir: str | Path, *args, **kwargs):
        self.out_dir, self.metrics_path = Path(out_dir), Path(out_dir) / "metrics.jsonl"
        self._tb, self._trackers = None, []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        pass

    def plot(self, keys: Iterable[str], filename: str = "curves.png", x: str = "step", title: str = "") -> None:
        return None

    def write_summary(self, summary: dict[str, Any]) -> None:
        pass


def open_run_log(out_dir: str | Path, config: dict[str, Any] | None = None, report_to: str | None = None,
                 resume_after: int | None = None) -> RunLog:
    """The run log of this process: the real one in the main process (the one process that writes
    the run folder and reports to the trackers), a silent one in the others."""
    from ppo_rlhf.distributed import is_main_process

    cls = RunLog if is_main_process() else SilentRunLog
    return cls(out_dir, config, report_to=report_to, resume_after=resume_after)


def _cell(text: Any) -> str:
    """Text as one Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def read_metrics(path: str | Path, notices: list[str] | None = None) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl``.  A torn last line (the run was killed while writing
    it) is dropped, with a notice appended to ``notices``; a bad line anywhere else is an error
    naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not a JSON record; the metrics file is damaged") from None
            if notices is not None:
                notices.append(f"{path}:{number}: dropped a torn last line (the run was killed while writing it)")
    return records


def plot_metrics(records: list[dict], keys: Iterable[str], path: Path, x: str = "step", title: str = "") -> Path | None:
    """One panel per metric in ``keys`` against ``x``, written to ``path``.  Redrawn at every
    evaluation of a run, so kept cheap: matplotlib's Figure API (no pyplot state) and fixed
    margins instead of tight_layout, which cost a third of each redraw."""
    from matplotlib.figure import Figure

    keys = [k for k in keys if any(k in r for r in records)]
    if not keys:
        return None
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, key in zip(axes.flat, keys):
        points = [(r[x], r[key]) for r in records if key in r and x in r and r[key] is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 40 else None)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel(x, fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    top = 1 - (0.8 if title else 0.35) / (3.0 * rows)  # room for the titles, in inches of the figure's height
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.5 / (3.0 * rows), top=top, wspace=0.3, hspace=0.55)
    fig.savefig(path, dpi=90)
    return path
