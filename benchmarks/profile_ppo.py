"""Where one ppo-rlhf PPO iteration spends its time: the same-work row of bench_peers.py
(batch 64, minibatch 32, 4 epochs, value head on the actor) on the built-in task.
Writes benchmarks/results/ppo_profile.json.

    python benchmarks/profile_ppo.py [--pipeline runs/peers/pipeline] [--threads 1] [--iterations 10]
    py-spy record --native -r 200 -f raw -o runs/spy.txt -- python benchmarks/profile_ppo.py --no-torch-profiler \
        --iterations 30 --out runs/spy_profile.json
    python benchmarks/profile_ppo.py --py-spy runs/spy.txt     # adds its summary to ppo_profile.json

1. Timers: the trainer's functions are wrapped (not edited) for the measured iterations: in the
   update, each minibatch step's select, forward, loss math (log-probs, policy/value/entropy
   losses), zero_grad, backward, gradient clip, guard checks, optimizer step; the rest of the
   step (statistics, Python between the calls) is what the wall clock has beyond them.
2. torch.profiler over a few more iterations: operators by self CPU time and the number of
   operator calls per iteration (each costs dispatcher and Python time, whatever its size).
3. --py-spy FILE: a py-spy raw (collapsed-stack) recording of this script, with native frames,
   summarised by where each sample was (its innermost frame): MKL/oneDNN matrix kernels, other
   torch kernels and dispatch, the Python interpreter, OpenMP; and by stage of the iteration.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

from bench_peers import PIPELINE_SEED, ppo_rlhf_settings  # noqa: E402
from ppo_rlhf_run import build_trainer  # noqa: E402

import ppo_rlhf.trainers.ppo as ppo_module  # noqa: E402
from ppo_rlhf.stages.ppo import draw_batch  # noqa: E402


class Timers:
    def __init__(self):
        self.seconds = defaultdict(float)
        self.calls = defaultdict(int)
        self.in_update = False

    def wrap(self, owner, name: str, label: str, update_only: bool = True):
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if update_only and not self.in_update:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)


def instrument(trainer) -> Timers:
    timers = Timers()
    for name, label in (("forward_response", "forward"), ("logprobs_from_logits", "loss math"),
                        ("policy_loss", "loss math"), ("entropy_from_logits", "loss math"),
                        ("masked_mean", "loss math"), ("value_loss", "loss math")):
        timers.wrap(ppo_module, name, label)
    timers.wrap(ppo_module.Experience, "select", "select")
    timers.wrap(trainer.critic.value_head, "forward", "loss math")
    timers.wrap(trainer.accelerator, "backward", "backward")
    timers.wrap(trainer.accelerator, "clip_grad_norm_", "clip grad norm")
    timers.wrap(trainer.optimizer, "zero_grad", "zero_grad")
    timers.wrap(trainer.optimizer, "step", "optimizer step")
    timers.wrap(trainer.guard, "skip", "guard checks")
    original_update = trainer.update

    def update(experience):
        timers.in_update = True
        start = time.perf_counter()
        try:
            return original_update(experience)
        finally:
            timers.seconds["update (wall)"] += time.perf_counter() - start
            timers.in_update = False

    trainer.update = update
    return timers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipeline", default="runs/peers/pipeline", help="a demo run folder with sft/ and rm/")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--profiler-iterations", type=int, default=3)
    parser.add_argument("--no-torch-profiler", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results" / "ppo_profile.json"))
    parser.add_argument("--py-spy", default=None, help="summarise this py-spy raw file into --out and stop")
    args = parser.parse_args()
    if args.py_spy:
        out = Path(args.out)
        result = json.loads(out.read_text()) if out.is_file() else {}
        result["py_spy"] = {"file": args.py_spy, **summarise_py_spy(Path(args.py_spy))}
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["py_spy"], indent=2))
        return
    pipeline = Path(args.pipeline)
    values = ppo_rlhf_settings("ppo-rlhf-same", pipeline, seed=0, iterations=1000, threads=args.threads)
    trainer, rows, config = build_trainer(values, PIPELINE_SEED)
    rng = torch.Generator().manual_seed(config.seed)
    for _ in range(args.warmup):
        trainer.step(draw_batch(rows, config, rng))

    timers = instrument(trainer)
    walls, splits, lengths = [], defaultdict(list), []
    for _ in range(args.iterations):
        batch = draw_batch(rows, config, rng)
        start = time.perf_counter()
        metrics = trainer.step(batch)
        walls.append(time.perf_counter() - start)
        for key in ("generate", "score", "forward", "train"):
            splits[key].append(metrics[f"time/{key}"])
        lengths.append(trainer_response_length(metrics))
    n_steps = timers.calls["backward"]
    per_step = {label: 1000 * seconds / n_steps for label, seconds in timers.seconds.items()}
    accounted = sum(v for k, v in per_step.items() if k != "update (wall)")
    per_step["statistics and Python between the calls"] = per_step["update (wall)"] - accounted
    result = {
        "settings": "ppo-rlhf same work as TRL (benchmarks/bench_peers.py), seed 0, after "
                    f"{args.warmup} warm-up iterations",
        "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "iterations": args.iterations, "minibatch_steps": n_steps,
        "s_per_iteration": {"median": statistics.median(walls), "min": min(walls), "max": max(walls)},
        "split_median_s": {k: statistics.median(v) for k, v in splits.items()},
        "mean_response_length": statistics.mean(lengths),
        "per_minibatch_step_ms": per_step,
    }

    if not args.no_torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
            for _ in range(args.profiler_iterations):
                trainer.step(draw_batch(rows, config, rng))
        events = prof.key_averages()
        total_self = sum(e.self_cpu_time_total for e in events)
        top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
        result["torch_profiler"] = {
            "iterations": args.profiler_iterations,
            "operator_calls_per_iteration": sum(e.count for e in events if e.key.startswith("aten::"))
                                            / args.profiler_iterations,
            "self_cpu_ms_per_iteration": total_self / 1000 / args.profiler_iterations,
            "top_by_self_cpu": [{"op": e.key, "calls_per_iteration": e.count / args.profiler_iterations,
                                 "self_ms_per_iteration": e.self_cpu_time_total / 1000 / args.profiler_iterations}
                                for e in top],
        }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def leaf_kind(frame: str) -> str:
    lowered = frame.lower()
    if any(key in lowered for key in ("gemm", "mkl_blas", "dnnl", "brgemm", "mkl_", "jit_avx", "sgemm")):
        return "matrix kernels (MKL / oneDNN)"
    if "gomp" in lowered or "omp_" in lowered or "kmp" in lowered:
        return "OpenMP"
    if ".py:" in frame or frame.endswith(".py)"):
        return "Python code (interpreter)"
    if "libpython" in lowered or "python3" in lowered or frame.startswith("_Py") or "(python" in lowered:
        return "CPython runtime"
    if "torch" in lowered or "at::" in frame or "c10::" in frame or "aten" in lowered:
        return "other torch kernels, dispatch, autograd"
    return "other native"


STAGES = (("update", "update (minibatch steps)"), ("make_experience", "rollout, scoring, old/reference passes"))


def summarise_py_spy(path: Path) -> dict:
    """Share of samples by innermost frame, overall and within the update."""
    kinds, update_kinds, stages, total = defaultdict(int), defaultdict(int), defaultdict(int), 0
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        count = int(count)
        frames = stack.split(";")
        if not any("trainer" in f and "step" in f or "ppo.py" in f for f in frames):
            continue  # loading, warm-up imports: not the iteration
        total += count
        kind = leaf_kind(frames[-1])
        kinds[kind] += count
        stage = next((label for name, label in STAGES if any(f.startswith(name + " ") for f in frames)), "other")
        stages[stage] += count
        if stage == STAGES[0][1]:
            update_kinds[kind] += count
    share = lambda table: {k: v / max(sum(table.values()), 1) for k, v in sorted(table.items(), key=lambda kv: -kv[1])}
    return {"samples": total, "by_innermost_frame": share(kinds), "by_stage": share(stages),
            "update_by_innermost_frame": share(update_kinds)}


def trainer_response_length(metrics: dict) -> float:
    return metrics["response_length"]


if __name__ == "__main__":
    main()
