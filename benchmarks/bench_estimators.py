"""Advantage estimators side by side: one trainer, one rollout budget, only the estimator changes;
on the built-in task (SFT and reward model once, then PPO from them) and on SmolLM2 with
examples/smollm2_vader/ppo.yaml.

    python benchmarks/bench_estimators.py                       # built-in task + SmolLM2, ~40 min on 2 cores
    python benchmarks/bench_estimators.py --smollm2-seeds 0     # built-in task only
    python benchmarks/bench_estimators.py --quick               # a few iterations of each, to try the script

Each PPO run its own process.  Results: benchmarks/results/estimators.{json,md,png}; the settings
and figures: docs/estimators.md.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import yaml

from common import (HERE, RESULTS, child, header, mean_curve, pyplot, record, run_in_child, save_figure, spread,
                    train_sft_and_rm, write_results)

ESTIMATORS = ("gae", "grpo", "dr-grpo", "rloo", "reinforce++", "remax")
SAMPLES = {"gae": 1, "grpo": 4, "dr-grpo": 4, "rloo": 4, "reinforce++": 4, "remax": 1}
# The shared budget and update of the built-in task's runs (tests/test_learning.py uses the same).
TASK_COMMON = {"task": "doubling", "do_sample": True, "max_new_tokens": 7, "max_length": 19, "batch_size": 64,
               "mini_batch_size": 32, "ppo_epochs": 4, "lr": 3e-4, "kl_coef": 0.05, "iterations": 60,
               "eval_every": 10, "eval_size": 1000, "save_every": 0, "sample_every": 0}
# gae's critic, as the demo preset trains it (stages/demo.py).
GAE_CRITIC = {"critic": "separate", "critic_lr": 1e-3, "critic_warmup": 3, "vf_coef": 1.0, "cliprange_value": None}
SMOLLM2_OVERRIDES = {"iterations": 10, "eval_every": 5, "save_every": 0, "sample_every": 0, "show_samples": 0}


# ---------------------------------------------------------------- the two settings
def task_values(estimator: str, seed: int, sft: str, reward: str, out: Path, iterations: int, eval_size: int) -> dict:
    values = {**TASK_COMMON, "estimator": estimator, "samples_per_prompt": SAMPLES[estimator], "seed": seed,
              "model": sft, "reward_model": reward, "out": str(out), "iterations": iterations, "eval_size": eval_size,
              "overwrite": True}
    return {**values, **GAE_CRITIC} if estimator == "gae" else values


def smollm2_values(estimator: str, seed: int, out: Path, iterations: int) -> dict:
    values = yaml.safe_load((HERE.parent / "examples" / "smollm2_vader" / "ppo.yaml").read_text())
    values.update(SMOLLM2_OVERRIDES, estimator=estimator, samples_per_prompt=SAMPLES[estimator], seed=seed,
                  out=str(out), iterations=iterations, eval_every=max(1, iterations // 2), overwrite=True)
    if estimator != "gae":  # the example's critic settings belong to gae alone
        for key in ("critic", "critic_lr", "critic_warmup", "cliprange_value", "vf_coef"):
            values.pop(key, None)
    return values


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    panels = [("task", "eval/exact_match", "built-in task: held-out greedy exact-match"),
              ("task", "eval_sampled/exact_match", "built-in task: sampled (T=1) exact-match"),
              ("smollm2", "eval/score", "SmolLM2 + VADER: held-out greedy score")]
    panels = [p for p in panels if results.get(p[0])]
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for axis, (setting, key, title) in zip(axes[0], panels):
        for estimator, runs in results[setting]["runs"].items():
            points = mean_curve(runs, key)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=estimator)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("PPO seconds (evaluation excluded), mean over seeds")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    save_figure(figure, path)


def report(results: dict) -> str:
    lines = header("Advantage estimators side by side", results)
    task = results.get("task")
    if task:
        lines += ["## Built-in task (learned reward model)", "",
                  f"SFT and reward model: {task['source']}. Every run: 64 sequences per iteration, minibatch 32, "
                  f"4 epochs, lr 3e-4, k1 KL in the reward at 0.05, no entropy term, {task['iterations']} "
                  f"iterations, each estimator's paper defaults for whitening and loss aggregation; gae with the "
                  f"demo's separate critic. Seeds {task['seeds']}; mean (min-max) over seeds. Held-out: "
                  f"{task['eval_size']} prompts. SFT greedy exact-match before PPO: {task['sft_exact_match']:.2%}.",
                  "", "| estimator | K | s/iteration (gen / score / fwd / train) | peak RSS MiB | greedy exact-match | "
                  "sampled exact-match | s to 95% greedy | s to 99% greedy | s to 99% sampled |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for estimator, runs in task["runs"].items():
            split = " / ".join(f"{statistics.mean(r['split_s'][k] for r in runs):.3f}"
                               for k in ("generate", "score", "forward", "train"))
            lines.append(
                f"| {estimator} | {SAMPLES[estimator]} | {spread([r['s_per_iteration'] for r in runs], digits=3)} ({split}) "
                f"| {spread([r['peak_rss_mib'] for r in runs], digits=0)} "
                f"| {spread([r['after']['eval/exact_match'] for r in runs], 100, 1, '%')} "
                f"| {spread([r['after_sampled']['eval_sampled/exact_match'] for r in runs], 100, 1, '%')} "
                f"| {spread([r['s_to_95%_greedy'] for r in runs])} | {spread([r['s_to_99%_greedy'] for r in runs])} "
                f"| {spread([r['s_to_99%_sampled'] for r in runs])} |")
        lines.append("")
    smol = results.get("smollm2")
    if smol:
        lines += ["## SmolLM2-135M-Instruct + LoRA, VADER sentiment reward", "",
                  f"examples/smollm2_vader/ppo.yaml, {smol['iterations']} iterations of 16 sequences (group "
                  f"estimators: 4 prompts x 4 samples), held-out greedy score on 8 prompts. Seeds {smol['seeds']}.",
                  "", "| estimator | K | s/iteration | peak RSS MiB | held-out score before -> after | KL (last 3 its) |",
                  "|---|---|---|---|---|---|"]
        for estimator, runs in smol["runs"].items():
            lines.append(
                f"| {estimator} | {SAMPLES[estimator]} | {spread([r['s_per_iteration'] for r in runs], digits=2)} "
                f"| {spread([r['peak_rss_mib'] for r in runs], digits=0)} "
                f"| {spread([r['before']['eval/score'] for r in runs], digits=3)} -> "
                f"{spread([r['after']['eval/score'] for r in runs], digits=3)} "
                f"| {spread([r['kl_last'] for r in runs], digits=2)} |")
        lines.append("")
    lines += ["![estimators](estimators.png)", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="runs/bench_estimators")
    parser.add_argument("--from-demo", help="reuse the SFT and reward model of this `ppo-rlhf demo` run folder")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="built-in task seeds (none: skip it)")
    parser.add_argument("--smollm2-seeds", type=int, nargs="*", default=[0], help="SmolLM2 seeds (none: skip it)")
    parser.add_argument("--smollm2-iterations", type=int, default=SMOLLM2_OVERRIDES["iterations"])
    parser.add_argument("--smollm2-model", default="runs/smollm2-135m-instruct")
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS)
    parser.add_argument("--quick", action="store_true", help="3 iterations each, 100 held-out prompts")
    parser.add_argument("--note", default="idle machine", help="what else ran on the machine")
    parser.add_argument("--note-source", default="", help="with --report-only: where the SFT and reward model came from")
    parser.add_argument("--report-only", action="store_true",
                        help="write the results from the finished runs under --out, running nothing")
    parser.add_argument("--num-threads", type=int, default=0,
                        help="torch threads per run (0: torch's default); 1 when other work shares the cores")
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.log"
    iterations, eval_size = (3, 100) if args.quick else (TASK_COMMON["iterations"], TASK_COMMON["eval_size"])
    results = record(args.note + (f"; {args.num_threads} torch thread(s) per run" if args.num_threads else ""),
                     unit="threads")

    if args.seeds:
        if args.report_only:
            sft = reward = ""
            source = args.note_source
        elif args.from_demo:
            demo = Path(args.from_demo)
            sft, reward = str(demo / "sft" / "checkpoints" / "sft"), str(demo / "rm" / "checkpoints" / "reward")
            source = f"those of the `ppo-rlhf demo` run in {demo}"
        else:
            sft, reward, figures = train_sft_and_rm(out / "demo", 0)
            source = (f"trained once here (demo stages, seed 0: SFT {figures['sft_seconds']:.0f} s, reward model "
                      f"{figures['rm_seconds']:.0f} s, held-out accuracy {figures['rm_eval_accuracy']:.2%})")
        runs: dict[str, list[dict]] = {e: [] for e in args.estimators}
        for seed in args.seeds:  # seeds outermost: a slow drift of the machine touches every estimator alike
            for estimator in args.estimators:
                print(f"built-in task: {estimator}, seed {seed}", flush=True)
                values = task_values(estimator, seed, sft, reward, out / "task" / f"{estimator}-{seed}", iterations,
                                     eval_size)
                figures = run_in_child(values, log, args.num_threads, args.report_only)
                if figures is not None:
                    runs[estimator].append(figures)
        runs = {estimator: done for estimator, done in runs.items() if done}
        first = next(iter(runs.values()))[0]
        results["task"] = {"source": source, "seeds": args.seeds, "iterations": iterations, "eval_size": eval_size,
                           "sft_exact_match": first["before"]["eval/exact_match"], "runs": runs}

    if args.smollm2_seeds:
        runs = {e: [] for e in args.estimators}
        smol_iterations = 2 if args.quick else args.smollm2_iterations
        for seed in args.smollm2_seeds:
            for estimator in args.estimators:
                print(f"SmolLM2: {estimator}, seed {seed}", flush=True)
                values = smollm2_values(estimator, seed, out / "smollm2" / f"{estimator}-{seed}", smol_iterations)
                values["model"] = args.smollm2_model
                figures = run_in_child(values, log, args.num_threads, args.report_only)
                if figures is not None:
                    runs[estimator].append(figures)
        runs = {estimator: done for estimator, done in runs.items() if done}
        if runs:
            results["smollm2"] = {"seeds": args.smollm2_seeds, "iterations": smol_iterations, "runs": runs}

    write_results("estimators", results, report(results), indent=1)
    plot(results, RESULTS / "estimators.png")


if __name__ == "__main__":
    main()
