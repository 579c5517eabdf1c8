"""Issue 59's measurement: the README's chain_sum GRPO recipe (SmolLM2-135M-Instruct, LoRA) with the
colocated vLLM engine on 2 threads against a generation server and a trainer on 1 thread each,
synchronous and with --max-staleness 1 and 2, seeds 0 and 1 (docs/design.md, "The generation
server" and "Asynchronous rollouts").

    make vllm-venv smollm2                                   # once (or --model /work/main/runs/smollm2-135m-instruct)
    .venv-vllm/bin/python benchmarks/bench_server.py         # the whole measurement: hours on 2 cores
    .venv-vllm/bin/python benchmarks/bench_server.py --quick # 3 iterations an arm, seed 0: checks the script

The ideal-overlap bound is the synchronous server run's, generation and update fully overlapped:
max(generation, update) an iteration instead of their sum.  Writes RESULTS/server.json and
server.md (``--quick``: in the scratch folder, a check, not figures); the figures read and the
target: docs/benchmarks.md, "The generation server and asynchronous rollouts".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, ROOT, SMOLLM2, readme_commands, replaced, require_model, write_results  # noqa: E402

ARMS = {"colocated": None, "server": 0, "staleness 1": 1, "staleness 2": 2}  # arm -> --max-staleness (None: vllm)
ACCURACY = "eval/accuracy"


def recipe(model: Path, out: Path, seed: int, args) -> list[str]:
    """The README's chain_sum ``ppo`` command with this run's model, folder, seed and evaluations."""
    ppo = readme_commands()[0]
    ppo = replaced(replaced(ppo, "--model", str(model)), "--out", str(out))
    if args.iterations:
        ppo = replaced(ppo, "--iterations", str(args.iterations))
    if args.batch_size:
        ppo = replaced(replaced(ppo, "--batch-size", str(args.batch_size)), "--mini-batch-size", str(args.batch_size))
    return ppo + ["--seed", str(seed), "--eval-every", str(args.eval_every), "--eval-size", str(args.eval_size),
                  "--task-eval-size", str(args.eval_size), "--no-eval-sampled", "--save-every", "0",
                  "--sample-every", "0", "--overwrite"]


def option(command: list[str], name: str, default: str) -> str:
    return command[command.index(name) + 1] if name in command else default


def pinned(cores: str) -> list[str]:
    """``taskset -c cores`` where taskset is there and the machine has the cores (else nothing)."""
    if shutil.which("taskset") is None or max(int(c) for c in cores.split(",")) >= os.cpu_count():
        return []
    return ["taskset", "-c", cores]


class Server:
    """``ppo-rlhf serve`` for one run, on one thread (pinned to core 1); stopped after it."""

    def __init__(self, model: Path, max_length: int, rows: int, log: Path):
        command = [*pinned("1"), sys.executable, "-m", "ppo_rlhf.cli", "serve", "--model", str(model), "--port", "0",
                   "--max-model-len", str(max_length), "--max-rows", str(rows), "--memory-utilization", "0.05",
                   "--num-threads", "1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.log = log.open("w")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.url: str | None = None
        self.ready = threading.Event()
        threading.Thread(target=self.read, daemon=True).start()

    def read(self) -> None:
        for line in self.process.stdout:
            self.log.write(line)
            self.log.flush()
            if "ready at " in line:
                self.url = line.rsplit("ready at ", 1)[1].strip()
                self.ready.set()
        self.ready.set()

    def wait(self, timeout: float = 900) -> str:
        self.ready.wait(timeout)
        if self.url is None:
            raise SystemExit(f"the server did not start; see {self.log.name}")
        return self.url

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


def run_arm(arm: str, seed: int, args, scratch: Path) -> dict:
    """One run of ``arm``; its figures."""
    out = scratch / f"{arm.replace(' ', '-')}-seed{seed}"
    command = recipe(Path(args.model), out, seed, args)
    staleness = ARMS[arm]
    server = None
    if staleness is None:
        prefix = pinned("0,1")
        command += ["--rollout-engine", "vllm", "--vllm-memory-utilization", "0.05", "--num-threads", "2"]
    else:
        prefix = pinned("0")
        max_length = int(option(command, "--max-length", "256"))
        server = Server(Path(args.model), max_length, int(option(command, "--batch-size", "32")),
                        scratch / f"{out.name}-serve.log")
        command += ["--rollout-engine", "vllm-server", "--server-url", server.wait(), "--max-staleness", str(staleness),
                    "--num-threads", "1"]
    start = time.perf_counter()
    try:
        with (scratch / f"{out.name}.log").open("w") as log:
            done = subprocess.run([*prefix, sys.executable, "-m", "ppo_rlhf.cli", *command], stdout=log,
                                  stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        if server is not None:
            server.stop()
    if done.returncode != 0:
        raise SystemExit(f"{arm}, seed {seed}: the run failed (exit {done.returncode}); see {scratch / out.name}.log")
    return {"arm": arm, "seed": seed, "command": command, "wall_seconds": time.perf_counter() - start,
            **figures(out, int(option(command, "--batch-size", "32")))}


def figures(out: Path, batch_size: int) -> dict:
    """What a run's metrics say: per-iteration seconds and their split, throughput, staleness, the
    held-out accuracy curve against training seconds."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("step", 0) > 0 and "time/iteration" in r]
    generation = [r.get("time/generate", 0) + r.get("time/weight_sync", 0) + r.get("time/engine_probe", 0)
                  for r in steps]
    update = [r.get("time/score", 0) + r.get("time/forward", 0) + r.get("time/train", 0) for r in steps]
    worker = [r["async/generate_seconds"] for r in steps if "async/generate_seconds" in r]
    iteration = statistics.mean(r["time/iteration"] for r in steps)
    curve = [(0.0, records[0][ACCURACY])] if records and ACCURACY in records[0] else []
    curve += [(r["time/elapsed"], r[ACCURACY]) for r in steps if ACCURACY in r]
    return {"iterations": len(steps), "iteration_s": iteration, "samples_per_s": batch_size / iteration,
            "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in steps),
            "generation_s": statistics.mean(generation), "update_s": statistics.mean(update),
            "worker_generation_s": statistics.mean(worker) if worker else None,
            # generation and update overlapped, each at its measured speed (meaningful for the synchronous runs)
            "ideal_iteration_s": statistics.mean(max(g, u) for g, u in zip(generation, update)),
            "staleness_mean": statistics.mean(r.get("staleness/mean", 0.0) for r in steps),
            "staleness_max": max((r.get("staleness/max", 0.0) for r in steps), default=0.0),
            "dropped": sum(r.get("staleness/dropped", 0.0) for r in steps),
            "probe_gap_max": max((r["rollout/probe_gap"] for r in steps if "rollout/probe_gap" in r), default=None),
            "curve": curve, "final_accuracy": curve[-1][1] if curve else None}


def accuracy_at(curve: list, seconds: float) -> float | None:
    """The held-out accuracy last measured at or before ``seconds`` of training."""
    seen = [accuracy for at, accuracy in curve if at <= seconds]
    return seen[-1] if seen else None


def write(results: list[dict], args, folder: Path) -> None:
    by = {(r["arm"], r["seed"]): r for r in results}
    seeds = sorted({r["seed"] for r in results})
    lines = ["# A generation server and asynchronous rollouts on 2 cores (issue 59)", "",
             f"`benchmarks/bench_server.py{' --quick' if args.quick else ''}`: the README's chain_sum GRPO recipe on "
             f"{args.model} with LoRA; colocated = `--rollout-engine vllm`, 2 threads; the others a server and a "
             f"trainer on 1 thread each (pinned where taskset is there).", "",
             "| arm | seed | s / iteration | samples / s | x colocated | tokens / s | generation s | update s | "
             "staleness mean (max) | dropped | held-out final | at the colocated run's training time |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        base = by.get(("colocated", r["seed"]))
        ratio = r["samples_per_s"] / base["samples_per_s"] if base else None
        equal_time = accuracy_at(r["curve"], base["curve"][-1][0]) if base and base["curve"] else None
        times = "" if ratio is None else f"{ratio:.2f}x"
        lines.append(f"| {r['arm']} | {r['seed']} | {r['iteration_s']:.1f} | {r['samples_per_s']:.2f} | {times} | "
                     f"{r['tokens_per_s']:.0f} | {r['generation_s']:.1f} | {r['update_s']:.1f} | "
                     f"{r['staleness_mean']:.2f} ({r['staleness_max']:.0f}) | {r['dropped']:.0f} | "
                     f"{r['final_accuracy']} | {equal_time} |")
    lines += ["", "The ideal overlap (the synchronous server run's generation and update, each at its one-thread "
              "speed, fully overlapped: max of the two an iteration):", ""]
    for seed in seeds:
        sync = by.get(("server", seed))
        if sync:
            ideal = sync["ideal_iteration_s"]
            base = by.get(("colocated", seed))
            reached = by.get(("staleness 1", seed))
            samples = sync["samples_per_s"] * sync["iteration_s"] / ideal
            lines.append(f"- seed {seed}: {ideal:.1f} s an iteration, {samples:.2f} samples / s"
                         + (f", {base['iteration_s'] / ideal:.2f}x the colocated run" if base else "")
                         + (f"; staleness 1 reached {ideal / reached['iteration_s']:.0%} of it" if reached else ""))
    lines += ["", "Held-out accuracy against training seconds (evaluation excluded):", ""]
    for r in results:
        lines.append(f"- {r['arm']}, seed {r['seed']}: " + ", ".join(f"{at:.0f} s {acc:.3f}" for at, acc in r["curve"]))
    write_results("server", {"args": vars(args), "runs": results}, lines, folder, indent=1, echo=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--iterations", type=int, default=None, help="default: the README's (36)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: the README's (32)")
    parser.add_argument("--eval-every", type=int, default=6)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--scratch", default=str(ROOT / "runs" / "bench_server"))
    parser.add_argument("--quick", action="store_true", help="3 iterations of 16 rows an arm, seed 0, 4 held-out "
                                                             "prompts: checks that the script runs")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.batch_size, args.eval_every, args.eval_size = 3, 16, 3, 4
        args.seeds = "0"
    require_model(args.model)
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for arm in args.arms.split(","):
            print(f"{arm}, seed {seed} ...", flush=True)
            results.append(run_arm(arm, seed, args, scratch))
            print(f"  {results[-1]['iteration_s']:.1f} s an iteration, {results[-1]['samples_per_s']:.2f} samples/s, "
                  f"held-out {results[-1]['final_accuracy']}", flush=True)
            write(results, args, scratch if args.quick else RESULTS)


if __name__ == "__main__":
    main()
