"""Benchmark of the built-in pipeline (issue targets), written to benchmarks/results/pipeline.{json,md}.

    python benchmarks/bench_pipeline.py                # seeds 0-4, about 15 minutes on 2 idle CPU cores
    python benchmarks/bench_pipeline.py --seeds 0      # one seed, about 4 minutes

Runs the whole demo (SFT -> reward model -> PPO with the learned reward model) once per seed,
then PPO again from the first seed's SFT model with the rule-based reward, and reads every
figure from the run folders: accuracy before/after (greedy and sampled, 2,000 held-out prompts),
wall time of each stage, PPO seconds to 99% greedy and to 99% sampled exact-match, the
per-iteration time split and tokens/s, and how often the logged KL estimate was negative.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ppo_rlhf.config import build_config
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.stages.demo import DemoConfig, run_demo, stage_configs
from ppo_rlhf.stages.ppo import run_ppo

from common import record, write_results


def first_time_reaching(records: list[dict], key: str, threshold: float) -> tuple[float | None, int | None]:
    for row in records:
        if row.get(key, -1) >= threshold:
            return row.get("time/elapsed", 0.0), row["step"]
    return None, None


def ppo_figures(out: Path) -> dict:
    records = read_metrics(out / "metrics.jsonl")
    iterations = [r for r in records if "time/iteration" in r]
    summary = json.loads((out / "summary.json").read_text())
    greedy_s, greedy_it = first_time_reaching(records, "eval/exact_match", 0.99)
    sampled_s, sampled_it = first_time_reaching(records, "eval_sampled/exact_match", 0.99)
    return {
        "iterations": len(iterations),
        "ppo_seconds": summary["ppo_seconds"],
        "s_per_iteration": statistics.mean(r["time/iteration"] for r in iterations),
        "split_s": {k: statistics.mean(r[f"time/{k}"] for r in iterations) for k in ("generate", "score", "forward", "train")},
        "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in iterations),
        "generated_tokens_per_s": statistics.mean(r["generated_tokens_per_s"] for r in iterations),
        "negative_kl_iterations": sum(r["kl"] < 0 for r in iterations),
        "s_to_99_greedy": greedy_s, "iteration_to_99_greedy": greedy_it,
        "s_to_99_sampled": sampled_s, "iteration_to_99_sampled": sampled_it,
        "before": summary["before"], "after": summary["after"], "after_sampled": summary["after_sampled"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench", help="where the benchmark runs go")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                        help="one whole demo per seed (every stage and the held-out split take it)")
    args = parser.parse_args()
    out = Path(args.out)

    seeds = {}
    for seed in args.seeds:
        start = time.perf_counter()
        demo_config = build_config(DemoConfig, {"out": str(out / f"demo_seed{seed}"), "seed": seed, "overwrite": True})
        demo = run_demo(demo_config)
        seeds[seed] = {"demo_seconds": round(time.perf_counter() - start, 1), "sft_seconds": demo["sft_seconds"],
                       "rm_seconds": demo["rm_seconds"], "rm_eval_accuracy": demo["rm_eval_accuracy"],
                       "ppo": ppo_figures(out / f"demo_seed{seed}")}
        if seed == args.seeds[0]:
            first_config = demo_config

    _, _, ppo_config = stage_configs(first_config)
    rule_values = {**ppo_config.__dict__, "reward_model": None, "out": str(out / "ppo_rule")}
    run_ppo(build_config(type(ppo_config), rule_values))

    first = seeds[args.seeds[0]]
    results = {
        **record(unit="torch threads"),
        "first_seed": args.seeds[0],
        "demo_seconds": first["demo_seconds"], "sft_seconds": first["sft_seconds"], "rm_seconds": first["rm_seconds"],
        "rm_eval_accuracy": first["rm_eval_accuracy"],
        "ppo_learned_reward": first["ppo"],
        "ppo_rule_reward": ppo_figures(out / "ppo_rule"),
        "seeds": seeds,
    }
    write_results("pipeline", results, report(results))


def pct(metrics: dict, key: str) -> str:
    return f"{100 * metrics[key]:.2f}%" if key in metrics else "n/a"


def seconds(value) -> str:
    return "not reached" if value is None else f"{value:.1f} s"


def report(r: dict) -> str:
    lines = ["# Built-in pipeline benchmark", "", f"Command: `{r['command']}`  ", f"Machine: {r['machine']}", "",
             "## The whole demo, one run per seed", "",
             "`ppo-rlhf demo --seed S` as a user runs it (learned reward model); every stage and the held-out split "
             "take the seed. PPO seconds exclude evaluation (every 10 iterations, so a crossing is seen at most 10 "
             "iterations late).", "",
             "| seed | demo s | SFT s | RM s | PPO s | greedy exact-match | sampled (T=1) exact-match | "
             "PPO s to 99% greedy (iteration) | PPO s to 99% sampled (iteration) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for seed, run in r["seeds"].items():
        p = run["ppo"]
        lines.append(f"| {seed} | {run['demo_seconds']:.1f} | {run['sft_seconds']:.1f} | {run['rm_seconds']:.1f} | "
                     f"{p['ppo_seconds']:.1f} | {pct(p['after'], 'eval/exact_match')} | "
                     f"{pct(p['after_sampled'], 'eval_sampled/exact_match')} | {seconds(p['s_to_99_greedy'])} "
                     f"({p['iteration_to_99_greedy']}) | {seconds(p['s_to_99_sampled'])} ({p['iteration_to_99_sampled']}) |")
    lines += ["", f"## Seed {r['first_seed']} in detail", "",
              f"Whole demo (SFT + reward model + PPO + evaluations): **{r['demo_seconds']:.1f} s** "
              f"(SFT {r['sft_seconds']:.1f} s, reward model {r['rm_seconds']:.1f} s, "
              f"RM held-out accuracy {100 * r['rm_eval_accuracy']:.2f}%); the rule-based reward's PPO starts from "
              f"the same SFT model.", ""]
    for name, key in (("learned reward model", "ppo_learned_reward"), ("rule-based reward", "ppo_rule_reward")):
        p = r[key]
        lines += [f"### PPO with the {name}", "",
                  "| | exact-match | value-correct | style-correct |", "|---|---|---|---|",
                  f"| SFT, greedy | {pct(p['before'], 'eval/exact_match')} | {pct(p['before'], 'eval/value_correct')} | {pct(p['before'], 'eval/style_correct')} |",
                  f"| after PPO, greedy | {pct(p['after'], 'eval/exact_match')} | {pct(p['after'], 'eval/value_correct')} | {pct(p['after'], 'eval/style_correct')} |",
                  f"| after PPO, sampled T=1 | {pct(p['after_sampled'], 'eval_sampled/exact_match')} | {pct(p['after_sampled'], 'eval_sampled/value_correct')} | {pct(p['after_sampled'], 'eval_sampled/style_correct')} |",
                  "",
                  f"- {p['iterations']} iterations, {p['ppo_seconds']:.1f} s of PPO ({p['s_per_iteration']:.3f} s/iteration: "
                  + ", ".join(f"{k} {v:.3f}" for k, v in p["split_s"].items()) + ")",
                  f"- PPO time to 99% greedy exact-match: {seconds(p['s_to_99_greedy'])} (iteration {p['iteration_to_99_greedy']}); "
                  f"to 99% sampled: {seconds(p['s_to_99_sampled'])} (iteration {p['iteration_to_99_sampled']})",
                  f"- throughput {p['tokens_per_s']:.0f} tokens/s (prompt + response), generation {p['generated_tokens_per_s']:.0f} tokens/s",
                  f"- iterations with a negative KL estimate: {p['negative_kl_iterations']} of {p['iterations']}", ""]
    lines += ["Against the published walk-through the task comes from, and TRL on the same machine: "
              "docs/benchmarks.md, \"The built-in task: the whole demo\", and [`peers.md`](peers.md)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
