"""The spread of every learning test's outcome over seeds, what a learning test's bar is set from
(DEVELOPERS.md, "Learning tests"): every test marked ``learning``, once per seed
(``pytest --learning-seed S``), at one torch thread, its reported outcomes (``record_outcome``).

    python benchmarks/learning_spread.py                          # seeds 0-4, every learning test
    python benchmarks/learning_spread.py --seeds 5-7 -k estimator # more seeds of some tests
    python benchmarks/learning_spread.py --threads 2 --seeds 0    # the same runs under OMP_NUM_THREADS=2

Results: benchmarks/results/learning_spread.{jsonl,md}; the .jsonl keeps every run, so seeds
measured later add to the table.  ``--jobs 2`` runs two seeds at a time, one thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def seed_list(text: str) -> list[int]:
    """'0-4' -> [0, 1, 2, 3, 4]; '1,3' -> [1, 3]."""
    seeds = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds += list(range(int(low), int(high or low) + 1))
    return seeds


def run_seed(seed: int, threads: str | None, selection: list[str]) -> list[dict]:
    """The learning tests at one seed, in a process of their own; the outcomes they recorded."""
    with tempfile.TemporaryDirectory() as scratch:
        outcomes = Path(scratch) / "outcomes.jsonl"
        env = {**os.environ, "PPO_RLHF_OUTCOMES": str(outcomes)}
        env.pop("OMP_NUM_THREADS", None)
        if threads is not None:
            env["OMP_NUM_THREADS"] = threads
        command = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-m", "learning", "--learning-seed",
                   str(seed), "--basetemp", str(Path(scratch) / "tmp"), "-p", "no:cacheprovider", *selection]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
        print(f"seed {seed}: {summary}", flush=True)
        if not outcomes.is_file():
            return []
        return [json.loads(line) for line in outcomes.read_text().splitlines()]


def table(records: list[dict]) -> str:
    """One row per (test, outcome): the value on each seed, then the lowest and the median."""
    by_outcome: dict[tuple[str, str], dict[tuple, float]] = {}
    for r in records:
        by_outcome.setdefault((r["test"], r["name"]), {})[(r["seed"], r["threads"])] = r["value"]
    lines = ["| test | outcome | runs | lowest | median | highest | each (seed[/threads]: value) |",
             "|---|---|---|---|---|---|---|"]
    for (test, name), runs in sorted(by_outcome.items()):
        values = list(runs.values())
        each = ", ".join(f"{seed}{'' if threads is None else '/' + threads}: {value:.3g}"
                         for (seed, threads), value in sorted(runs.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))))
        lines.append(f"| {test.removeprefix('tests/')} | {name} | {len(values)} | {min(values):.3g} | "
                     f"{statistics.median(values):.3g} | {max(values):.3g} | {each} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0-4", help="seeds to run, e.g. 0-4 or 1,3")
    parser.add_argument("--threads", default=None, help="OMP_NUM_THREADS for the runs (default: unset)")
    parser.add_argument("--jobs", type=int, default=2, help="seeds run at the same time")
    parser.add_argument("-k", default=None, help="only the learning tests whose names match (pytest -k)")
    parser.add_argument("paths", nargs="*", default=["tests"], help="test files (default: all)")
    args = parser.parse_args()
    selection = [*args.paths, *(["-k", args.k] if args.k else [])]
    RESULTS.mkdir(parents=True, exist_ok=True)
    store = RESULTS / "learning_spread.jsonl"
    with ThreadPoolExecutor(args.jobs) as pool:
        for records in pool.map(lambda s: run_seed(s, args.threads, selection), seed_list(args.seeds)):
            with store.open("a") as file:
                file.writelines(json.dumps(r) + "\n" for r in records)
    records = [json.loads(line) for line in store.read_text().splitlines()]
    report = ("# The spread of the learning tests' outcomes over seeds\n\n"
              "`python benchmarks/learning_spread.py` (DEVELOPERS.md, \"Learning tests\"): every test marked "
              "`learning`, once per seed (`pytest --learning-seed S`), each run at one torch thread as the tests "
              "pin it.  A test's bar sits below the lowest value here with a margin.\n\n" + table(records) + "\n")
    (RESULTS / "learning_spread.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
