"""Does a run learn as well with the vLLM rollout engine as with the torch one?  (issue 21; the
on-demand test in tests/test_vllm_engine.py runs one seed of this.)  The built-in task's
critic-free learning recipe for each seed and engine, from one SFT model with 2 heads of 32
(vLLM's CPU attention refuses a head size of 16).

    make vllm-venv
    .venv-vllm/bin/python benchmarks/bench_engine_learning.py --seeds 0 1 2 --jobs 2   # ~13 min on 2 cores
    .venv-vllm/bin/python benchmarks/bench_engine_learning.py --report-only

``--jobs 2`` runs two PPO runs at once, one thread each, so only accuracy is reported, against
iterations.  Writes benchmarks/results/engine_learning.{json,md}; see docs/benchmarks.md,
"Rollout engines" ("Learning with each engine").
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_estimators import TASK_COMMON
from common import command, mean_points, run_in_child, spread, write_results

ENGINES = ("torch", "vllm")
RECIPE = {**TASK_COMMON, "estimator": "grpo", "samples_per_prompt": 4, "iterations": 80, "eval_every": 20,
          "eval_size": 500, "eval_sampled": False, "vllm_memory_utilization": 0.01, "overwrite": True}


def train_sft(out: Path) -> str:
    from ppo_rlhf.config import build_config
    from ppo_rlhf.stages.demo import SFT_PRESET
    from ppo_rlhf.stages.sft import run_sft
    from ppo_rlhf.trainers.sft import SFTConfig

    folder = out / "sft"
    if not (folder / "checkpoints" / "sft" / "config.json").is_file():
        run_sft(build_config(SFTConfig, {**SFT_PRESET, "n_head": 2, "eval_every": 0, "out": str(folder),
                                         "overwrite": True}))
    return str(folder / "checkpoints" / "sft")


def accuracy_curve(out: Path) -> list[tuple[int, float]]:
    from ppo_rlhf.runlog import read_metrics

    return [(r["step"], r["eval/exact_match"]) for r in read_metrics(out / "metrics.jsonl")
            if "eval/exact_match" in r]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1, choices=(1, 2), help="PPO runs at once (2: one thread each)")
    parser.add_argument("--out", default="runs/bench_engine_learning")
    parser.add_argument("--report-only", action="store_true", help="report the finished runs under --out")
    args = parser.parse_args()
    out = Path(args.out)
    cases = [(seed, engine) for seed in args.seeds for engine in ENGINES]
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        sft = train_sft(out)

        def one(case):
            seed, engine = case
            values = {**RECIPE, "seed": seed, "rollout_engine": engine, "model": sft,
                      "out": str(out / f"{engine}-{seed}")}
            run_in_child(values, out / "runs.log", num_threads=1 if args.jobs == 2 else 0)
            print(f"{engine} seed {seed}: done", flush=True)

        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(one, cases))
    runs = {}
    for seed, engine in cases:
        folder = out / f"{engine}-{seed}"
        if (folder / "summary.json").is_file():
            summary = json.loads((folder / "summary.json").read_text())
            runs.setdefault(engine, []).append({"seed": seed, "before": summary["before"]["eval/exact_match"],
                                                "after": summary["after"]["eval/exact_match"],
                                                "curve": accuracy_curve(folder)})
    write_report(args, runs)


def write_report(args, runs: dict) -> None:
    results = {"command": command(), "machine": f"{platform.machine()}, jobs {args.jobs}",
               "date": time.strftime("%Y-%m-%d"), "recipe": RECIPE, "runs": runs}
    lines = ["# The built-in task with each rollout engine", "", f"Command: `{results['command']}`  ",
             f"Measured: {results['date']} ({results['machine']})", "",
             "grpo, 16 prompts x 4 samples, 80 iterations, the task's rule reward; held-out greedy exact match "
             "on 500 prompts.", "",
             "| engine | seeds | before | after, mean (min-max) | after, per seed | curve (iteration: exact match), mean |",
             "|---|---|---|---|---|---|"]
    for engine, done in runs.items():
        mean_curve = ", ".join(f"{step:.0f}: {value:.3f}" for step, value in mean_points(done, "curve"))
        per_seed = ", ".join(f"{r['seed']}: {r['after']:.3f}" for r in done)
        lines.append(f"| {engine} | {len(done)} | {spread([r['before'] for r in done], digits=3)} "
                     f"| {spread([r['after'] for r in done], digits=3)} | {per_seed} | {mean_curve} |")
    write_results("engine_learning", results, lines, indent=1)


if __name__ == "__main__":
    main()
