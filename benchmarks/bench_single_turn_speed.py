"""The single-turn path no slower than before episodes and the new passes (issues 36 and 39): the
built-in demo and the README's chain_sum GRPO iteration (SmolLM2-135M-Instruct with LoRA), this
checkout against an earlier commit, run in turn, on the same machine.

    python benchmarks/bench_single_turn_speed.py --before 113a6b8 [--rounds 2]

The earlier commit is checked out once into a scratch work tree (git worktree) and run with the
same virtual environment, its src/ first on the path.  Each round runs both, in alternating order
(this machine's speed drifts): the whole demo (its total seconds and PPO's), then the chain_sum
command for 3 iterations (the median seconds of an iteration, evaluation excluded).

Results: benchmarks/results/single_turn_speed.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, SMOLLM2, checkouts, write_results

CHAIN_SUM = ["--lora", "--task", "reasoning-gym:chain_sum", "--task-config",
             "min_terms=2,max_terms=2,min_digits=1,max_digits=2", "--task-size", 2000, "--task-reward", "exact",
             "--estimator", "grpo", "--samples-per-prompt", 8, "--batch-size", 32, "--mini-batch-size", 32,
             "--ppo-epochs", 1, "--kl-in", "loss", "--lr", 1e-4, "--temperature", 0.7, "--max-new-tokens", 32,
             "--task-eval-size", 8, "--eval-size", 8, "--eval-every", 0, "--no-eval-sampled", "--save-every", 0]


def ppo_rlhf(src: Path, args: list, threads: int) -> None:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, "-m", "ppo_rlhf.cli", *map(str, args)], env=env, capture_output=True,
                          text=True, cwd=tempfile.gettempdir())
    if done.returncode:
        raise SystemExit(f"failed: {' '.join(map(str, args))}\n{done.stderr[-2000:]}")


def demo(src: Path, out: Path, threads: int) -> dict:
    start = time.perf_counter()
    ppo_rlhf(src, ["demo", "--out", out, "--overwrite", "--num-threads", threads], threads)
    summary = json.loads((out / "summary.json").read_text())
    return {"seconds": round(time.perf_counter() - start, 1), "ppo_seconds": summary["ppo_seconds"],
            "exact_match": summary["after"]["eval/exact_match"]}


def chain_sum(src: Path, out: Path, threads: int) -> dict:
    ppo_rlhf(src, ["ppo", "--model", SMOLLM2, *CHAIN_SUM, "--iterations", 3, "--out", out, "--overwrite",
                   "--num-threads", threads], threads)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"iteration_seconds": round(statistics.median(r["time/iteration"] for r in rows if "time/iteration" in r), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--name", default="single_turn_speed", help="the results files' name in benchmarks/results")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="ppo-rlhf-before-"))
    with checkouts([args.before], scratch) as trees:
        sources = {"before": trees[args.before] / "src", "after": ROOT / "src"}
        runs = {way: {"demo": [], "chain_sum": []} for way in sources}
        for round_index in range(args.rounds):
            order = ("before", "after") if round_index % 2 == 0 else ("after", "before")
            for way in order:
                runs[way]["demo"].append(demo(sources[way], scratch / f"demo_{way}", args.threads))
                print(way, "demo", runs[way]["demo"][-1], flush=True)
            for way in order:
                runs[way]["chain_sum"].append(chain_sum(sources[way], scratch / f"chain_{way}", args.threads))
                print(way, "chain_sum", runs[way]["chain_sum"][-1], flush=True)

    def median(way: str, kind: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[way][kind]), 2)

    summary = {"before": args.before, "after": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                             capture_output=True, text=True).stdout.strip(),
               "threads": args.threads, "date": time.strftime("%Y-%m-%d"), "runs": runs}
    lines = ["# The single-turn path, before and after", "",
             f"`python benchmarks/bench_single_turn_speed.py --before {args.before} --name {args.name}` "
             f"({args.rounds} rounds, alternating; "
             f"{args.threads} threads; {summary['date']}): commit {args.before} against {summary['after']}.", "",
             "| | demo, whole (s) | demo, PPO (s) | demo exact match | chain_sum GRPO iteration (s) |",
             "|---|---|---|---|---|"]
    for way in ("before", "after"):
        lines.append(f"| {way} | {median(way, 'demo', 'seconds')} | {median(way, 'demo', 'ppo_seconds')} | "
                     f"{median(way, 'demo', 'exact_match')} | {median(way, 'chain_sum', 'iteration_seconds')} |")
    write_results(args.name, summary, lines)


if __name__ == "__main__":
    main()
