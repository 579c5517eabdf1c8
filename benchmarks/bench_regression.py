"""No-regression check: the built-in demo's PPO seconds per iteration, this code against earlier commits.

    python benchmarks/bench_regression.py --before 6587571 19c554c     # about 6 minutes on 2 cores
    python benchmarks/bench_regression.py --before 19c554c --no-early-stop   # every version does 8 steps

Trains the demo's SFT model and reward model once (this code), then runs the demo's PPO stage
(its preset: separate critic, learned reward, batch 64) from those same checkpoints with each
version of the code in turn -- this one, then each ``--before`` commit, checked out in a temporary
git worktree and imported through PYTHONPATH -- for ``--rounds`` rounds, the order rotated each
round so that a drift of the machine's speed falls on every version alike.  A run's figure is
the median of its iterations' ``time/iteration`` (generation, scoring, the rollout passes and
the update; evaluation excluded); each version's figure is the median over its rounds, and the
ratio to this code is taken round by round.  Writes RESULTS/regression.md and .json.

The preset stops an iteration's update once approx_kl passes 0.02, and approx_kl itself was
corrected after 19c554c (it is now the unbiased (r - 1) - log r), so the versions do different
numbers of minibatch steps per iteration.  ``--no-early-stop`` turns the stop off in every
version: each then does the same 8 steps per iteration, and the per-iteration figures compare
the same work (RESULTS/regression_no_early_stop.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, checkouts, command, write_results


def child(sft: str, reward: str, out: str, iterations: int, threads: int, seed: int, early_stop: bool) -> dict:
    """One PPO stage of the demo with the code on sys.path (this checkout or a worktree)."""
    import ppo_rlhf
    from ppo_rlhf.runlog import read_metrics
    from ppo_rlhf.stages.demo import DemoConfig, stage_configs
    from ppo_rlhf.stages.ppo import run_ppo

    _, _, config = stage_configs(DemoConfig(out=out, ppo_iterations=iterations, num_threads=threads, seed=seed))
    config.model, config.reward_model = sft, reward
    if not early_stop:
        config.max_approx_kl = None
    config.eval_size = 100  # evaluation is not timed in time/iteration; a small one keeps the run short
    run_ppo(config)
    rows = [r for r in read_metrics(Path(out) / "metrics.jsonl") if "time/iteration" in r]
    # The demo stops an update early once approx_kl passes max_approx_kl: the number of minibatch
    # steps differs between runs, so the update is also given per step.
    trained = [r for r in rows if r.get("update_steps")]
    return {"code": str(Path(ppo_rlhf.__file__).resolve().parent.parent.parent), "iterations": len(rows),
            "seconds_per_iteration": statistics.median(r["time/iteration"] for r in rows),
            **{f"{key}_seconds": statistics.median(r[f"time/{key}"] for r in rows)
               for key in ("generate", "score", "forward", "train")},
            "update_steps": statistics.fmean(r.get("update_steps", 0) for r in rows),
            "train_seconds_per_step": statistics.median(r["time/train"] / r["update_steps"] for r in trained)}


def run_child(code: Path, sft: Path, reward: Path, out: Path, args) -> dict:
    command = [sys.executable, __file__, "--child", "--sft", str(sft), "--reward", str(reward), "--run-out", str(out),
               "--iterations", str(args.iterations), "--num-threads", str(args.num_threads), "--seed", str(args.seed)]
    command += ["--no-early-stop"] if args.no_early_stop else []
    env = {**os.environ, "PYTHONPATH": str(code / "src")}  # before the editable install on sys.path
    done = subprocess.run(command, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["code"]) != code.resolve():
        raise RuntimeError(f"the child imported ppo_rlhf from {result['code']}, not {code}")
    return result


def train_base(scratch: Path, args) -> tuple[Path, Path]:
    """The demo's SFT model and reward model, trained once with this code."""
    from ppo_rlhf.stages.demo import DemoConfig, stage_configs
    from ppo_rlhf.stages.reward import run_reward
    from ppo_rlhf.stages.sft import run_sft

    sft_config, rm_config, _ = stage_configs(DemoConfig(out=str(scratch / "base"), num_threads=args.num_threads,
                                                        seed=args.seed))
    run_sft(sft_config)
    run_reward(rm_config)
    return (scratch / "base" / "sft" / "checkpoints" / "sft", scratch / "base" / "rm" / "checkpoints" / "reward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", nargs="+", required=False, default=[], help="earlier commits to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iterations", type=int, default=40, help="PPO iterations per run")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads (1: the demo model is tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-early-stop", action="store_true",
                        help="no max_approx_kl stop: every version does every minibatch step")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sft", help=argparse.SUPPRESS)
    parser.add_argument("--reward", help=argparse.SUPPRESS)
    parser.add_argument("--run-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.sft, args.reward, args.run_out, args.iterations, args.num_threads, args.seed,
                               early_stop=not args.no_early_stop)))
        return
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"], capture_output=True,
                                text=True, check=True).stdout.strip())
    now = f"{head}{' + uncommitted src' if dirty else ''} (this code)"
    with tempfile.TemporaryDirectory(prefix="regression-") as scratch_name:
        scratch = Path(scratch_name)
        sft, reward = train_base(scratch, args)
        with checkouts(args.before, scratch) as earlier:
            versions = {now: ROOT, **earlier}
            rounds = []
            names = list(versions)
            for index in range(args.rounds):
                order = names[index % len(names):] + names[:index % len(names)]
                measured = {}
                for name in order:
                    result = run_child(versions[name], sft, reward, scratch / f"run-{index}-{len(measured)}", args)
                    measured[name] = result
                    print(f"round {index + 1}: {name}: " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()
                                                                      if k != "code"), flush=True)
                rounds.append(measured)
                write_report(rounds, now, args, Path(args.out))


def write_report(rounds: list[dict], now: str, args, out: Path) -> None:
    lines = [
        "# The demo's PPO seconds per iteration, this code against earlier commits",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `{command()}` ({platform.machine()} CPU, {args.num_threads} torch thread(s), {os.cpu_count()} cores). The demo's "
        f"PPO preset ({args.iterations} iterations, separate critic, learned reward"
        + (", its approx_kl early stop off: 8 minibatch steps per iteration in every version" if args.no_early_stop else "")
        + ") from one SFT and reward model, "
        f"each version in turn, {len(rounds)} rounds with the order rotated. A run's figure is the median of its "
        "iterations' time/iteration; the table gives each version's median over the rounds and the ratio to this "
        "code, round by round (median, min-max).",
        "",
        "| code | s/iteration | this code / it (min-max) | generate | score | old+ref passes | update "
        "| minibatch steps per iteration | update s per step | this code / it per step (min-max) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def median(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rounds)

    def ratios(name: str, key: str) -> str:
        values = [r[now][key] / r[name][key] for r in rounds]
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    for name in rounds[0]:
        lines.append(f"| {name} | {median(name, 'seconds_per_iteration'):.4f} | {ratios(name, 'seconds_per_iteration')} | "
                     + " | ".join(f"{median(name, f'{k}_seconds'):.4f}" for k in ("generate", "score", "forward", "train"))
                     + f" | {statistics.fmean(r[name]['update_steps'] for r in rounds):.2f} "
                     f"| {median(name, 'train_seconds_per_step'):.4f} | {ratios(name, 'train_seconds_per_step')} |")
    lines.append("")
    write_results("regression_no_early_stop" if args.no_early_stop else "regression",
                  {"args": vars(args), "this_code": now, "rounds": rounds}, lines, out, echo=False)


if __name__ == "__main__":
    main()
