"""One trainer, two ways of running its iteration, alternated round by round (this machine's
speed drifts; one model load serves both): the A/B loop of bench_old_logprobs.py and
bench_shared_prompts.py."""

from __future__ import annotations

import statistics
from collections.abc import Callable

TIMES = ("time/generate", "time/forward", "time/train", "time/iteration")


def alternate(trainer, set_way: Callable[[bool], None], prompts_per_batch: int, samples_per_prompt: int,
              rounds: int, label: str) -> dict[bool, list[dict]]:
    """``rounds`` iterations each way (True, False), plus a first round that warms up both;
    the order flips every round.  Returns each way's timings."""
    rows = trainer.run_parts.train_rows
    timings: dict[bool, list[dict]] = {True: [], False: []}
    for round_index in range(rounds + 1):
        for way in ((True, False) if round_index % 2 == 0 else (False, True)):
            set_way(way)
            batch = rows[(trainer.iteration * prompts_per_batch) % len(rows):][:prompts_per_batch]
            metrics = trainer.step([row for row in batch for _ in range(samples_per_prompt)])
            if round_index:
                timings[way].append({key: metrics[key] for key in TIMES})
            print(f"round {round_index}, {label} {way}: forward {metrics['time/forward']:.1f} s, "
                  f"train {metrics['time/train']:.1f} s, iteration {metrics['time/iteration']:.1f} s", flush=True)
    return timings


def median(timings: dict[bool, list[dict]], way: bool, key: str) -> float:
    return statistics.median(t[key] for t in timings[way])


def table(timings: dict[bool, list[dict]], names: dict[bool, str], first_column: str) -> list[str]:
    """A markdown table of each way's median seconds (False's row first), and the iteration ratio."""
    lines = [f"| {first_column} | forward passes before the update | update | whole iteration |", "|---|---|---|---|"]
    for way in (False, True):
        lines.append(f"| {names[way]} | {median(timings, way, 'time/forward'):.1f} | "
                     f"{median(timings, way, 'time/train'):.1f} | {median(timings, way, 'time/iteration'):.1f} |")
    ratio = median(timings, True, "time/iteration") / median(timings, False, "time/iteration")
    return lines + ["", f"Whole iteration: {ratio:.2f} of the time {names[False]}.", ""]


def write_report(folder, stem: str, title: str, command: str, note: str, settings: dict, description: str,
                 timings: dict[bool, list[dict]], names: dict[bool, str], first_column: str) -> None:
    """folder/stem.json (settings and every timing) and folder/stem.md (the table), printed too."""
    import json
    import platform
    import time
    from pathlib import Path

    import torch

    results = {"command": command, "date": time.strftime("%Y-%m-%d"), "note": note, "settings": settings,
               "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
                          f"{torch.get_num_threads()} thread(s)"}
    folder = Path(folder)
    folder.mkdir(exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps({**results, "timings": {str(k): v for k, v in timings.items()}},
                                                    indent=1) + "\n")
    lines = [f"# {title}", "", f"Command: `{command}`  ", f"Machine: {results['machine']}  ",
             f"Measured: {results['date']}; {note}", "", description, "", *table(timings, names, first_column)]
    (folder / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))
