"""Advantage estimators (``estimators``) or policy-loss variants (``losses``) side by side: one
trainer, one rollout budget, only the estimator or the loss changes; each PPO run a process of its own.

    python benchmarks/bench_estimators.py                       # built-in task + SmolLM2, ~40 min on 2 cores
    python benchmarks/bench_estimators.py --smollm2-seeds       # the built-in task only
    python benchmarks/bench_estimators.py losses                # 6 variants x 3 seeds, ~25 min on 2 cores
    python benchmarks/bench_estimators.py losses --quick        # a few iterations of each, to try the script

``estimators``: the six estimators on the built-in task (SFT and reward model once, then PPO from
them) and on SmolLM2 with examples/smollm2_vader/ppo.yaml; results/estimators.{json,md,png}, the
figures in docs/estimators.md.  ``losses``: GRPO, DAPO, GSPO, CISPO, SAPO and PPO (VARIANTS) on the
built-in task with its rule reward, from one SFT model; results/loss_variants.{json,md,png}, the
figures in docs/estimators.md and docs/benchmarks.md, "Policy-loss variants, issue 37".
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

from common import (HERE, RESULTS, header, mean_points, pyplot, record, run_in_child, save_figure, spread,
                    train_sft_and_rm, write_results)

SAMPLES = {"gae": 1, "grpo": 4, "dr-grpo": 4, "rloo": 4, "reinforce++": 4, "remax": 1}  # the estimators' K
# The shared budget and update of the built-in task's runs (tests/test_learning.py uses the same).
TASK_COMMON = {"task": "doubling", "do_sample": True, "max_new_tokens": 7, "max_length": 19, "batch_size": 64,
               "mini_batch_size": 32, "ppo_epochs": 4, "lr": 3e-4, "kl_coef": 0.05, "iterations": 60,
               "eval_every": 10, "eval_size": 1000, "save_every": 0, "sample_every": 0}
LOSSES_COMMON = {**TASK_COMMON, "iterations": 100, "eval_size": 500}
# gae's critic, as the demo preset trains it (stages/demo.py).
GAE_CRITIC = {"critic": "separate", "critic_lr": 1e-3, "critic_warmup": 3, "vf_coef": 1.0, "cliprange_value": None}
SMOLLM2_OVERRIDES = {"iterations": 10, "eval_every": 5, "save_every": 0, "sample_every": 0, "show_samples": 0}
GROUP = {"estimator": "grpo", "samples_per_prompt": 4}
VARIANTS = {
    "grpo": GROUP,
    "dapo": {**GROUP, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "dynamic_sampling": True,
             "overlong_buffer": 1, "loss_aggregation": "token-mean"},
    "gspo": {**GROUP, "ratio_level": "sequence", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4},
    "cispo": {**GROUP, "policy_loss": "cispo", "clip_ratio_high": 0.2, "loss_aggregation": "token-mean"},
    "sapo": {**GROUP, "policy_loss": "sapo"},
    "ppo": {"estimator": "gae", "samples_per_prompt": 1, **GAE_CRITIC},
}
X_SECONDS = "PPO seconds (evaluation excluded), mean over seeds"


# ---------------------------------------------------------------- the settings of one run
def estimator_values(estimator: str) -> dict:
    values = {"estimator": estimator, "samples_per_prompt": SAMPLES[estimator]}
    return {**values, **GAE_CRITIC} if estimator == "gae" else values


def smollm2_values(estimator: str, seed: int, out: Path, iterations: int, model: str) -> dict:
    values = yaml.safe_load((HERE.parent / "examples" / "smollm2_vader" / "ppo.yaml").read_text())
    values.update(SMOLLM2_OVERRIDES, estimator=estimator, samples_per_prompt=SAMPLES[estimator], seed=seed,
                  out=str(out), iterations=iterations, eval_every=max(1, iterations // 2), overwrite=True, model=model)
    if estimator != "gae":  # the example's critic settings belong to gae alone
        for key in ("critic", "critic_lr", "critic_warmup", "cliprange_value", "vf_coef"):
            values.pop(key, None)
    return values


def run_each(names: list[str], seeds: list[int], values_of, args, label: str) -> dict[str, list[dict]]:
    """Every name on every seed, seeds outermost (a slow drift of the machine touches every name
    alike); each name's figures, runs that left none (with --report-only) dropped."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for seed in seeds:
        for name in names:
            print(f"{label}: {name}, seed {seed}", flush=True)
            out = Path(args.out) / label / f"{name}-{seed}"
            figures = run_in_child(values_of(name, seed, out), Path(args.out) / "runs.log", args.num_threads,
                                   args.report_only)
            if figures is not None:
                runs[name].append(figures)
    return {name: done for name, done in runs.items() if done}


def variant_figures(out: Path, figures: dict) -> dict:
    """The figures of common.run_figures, plus what the variants change: entropy, and tokens generated
    per sequence that reached the update."""
    from ppo_rlhf.runlog import read_metrics

    records = read_metrics(out / "metrics.jsonl")
    iterations = [r for r in records if "time/iteration" in r]
    per_kept = [r.get("dynamic_sampling/generated_tokens_per_kept_sample", r["response_length"]) for r in iterations]
    return {**figures,
            "entropy": [(r["step"], r["entropy"]) for r in iterations if "entropy" in r],
            "greedy_by_iteration": [(r["step"], r["eval/exact_match"]) for r in records if "eval/exact_match" in r],
            # NaN (None in metrics.jsonl): an iteration that kept no group
            "tokens_per_kept_sample": statistics.mean(v for v in per_kept if v is not None and v == v),
            "dropped_groups": sum(r.get("dynamic_sampling/dropped_groups", 0) for r in iterations),
            "filled_groups": sum(r.get("dynamic_sampling/filled_groups", 0) for r in iterations)}


def plot(panels: list[tuple[dict, str, str, str]], path: Path) -> None:
    """One panel per (runs by name, figure key, title, x label): each name's mean over its seeds."""
    plt = pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for axis, (runs_by_name, key, title, xlabel) in zip(axes[0], panels):
        for name, runs in runs_by_name.items():
            points = mean_points(runs, key)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o" if len(points) < 20 else None,
                      markersize=3, label=name)
        axis.set_title(title, fontsize=10)
        axis.set_xlabel(xlabel)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    save_figure(figure, path)


# ---------------------------------------------------------------- estimators
def estimators_report(results: dict) -> str:
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


def estimators(args, results: dict) -> None:
    names = args.only or list(SAMPLES)
    iterations, eval_size = (3, 100) if args.quick else (TASK_COMMON["iterations"], TASK_COMMON["eval_size"])
    if args.seeds:
        sft, reward, source = models(args, reward_too=True)

        def task_values(estimator: str, seed: int, out: Path) -> dict:
            return {**TASK_COMMON, **estimator_values(estimator), "seed": seed, "model": sft, "reward_model": reward,
                    "out": str(out), "iterations": iterations, "eval_size": eval_size, "overwrite": True}

        runs = run_each(names, args.seeds, task_values, args, "task")
        results["task"] = {"source": source, "seeds": args.seeds, "iterations": iterations, "eval_size": eval_size,
                           "sft_exact_match": next(iter(runs.values()))[0]["before"]["eval/exact_match"], "runs": runs}
    if args.smollm2_seeds:
        smol_iterations = 2 if args.quick else args.smollm2_iterations

        def values(estimator: str, seed: int, out: Path) -> dict:
            return smollm2_values(estimator, seed, out, smol_iterations, args.smollm2_model)

        runs = run_each(names, args.smollm2_seeds, values, args, "smollm2")
        if runs:
            results["smollm2"] = {"seeds": args.smollm2_seeds, "iterations": smol_iterations, "runs": runs}
    write_results("estimators", results, estimators_report(results), indent=1)
    panels = [("task", "curve:eval/exact_match", "built-in task: held-out greedy exact-match"),
              ("task", "curve:eval_sampled/exact_match", "built-in task: sampled (T=1) exact-match"),
              ("smollm2", "curve:eval/score", "SmolLM2 + VADER: held-out greedy score")]
    plot([(results[setting]["runs"], key, title, X_SECONDS) for setting, key, title in panels if results.get(setting)],
         RESULTS / "estimators.png")


# ---------------------------------------------------------------- losses
def losses_report(results: dict) -> str:
    lines = [*header("Policy-loss variants side by side", results),
             f"Built-in task, rule reward. SFT model: {results['source']}; greedy exact-match before PPO "
             f"{results['sft_exact_match']:.2%}. Every run: 64 sequences per iteration, minibatch 32, 4 epochs, "
             f"lr 3e-4, k1 KL in the reward at 0.05, {results['iterations']} iterations; held-out "
             f"{results['eval_size']} prompts every 10 iterations. Seeds {results['seeds']}; mean (min-max) over "
             f"seeds. Variants: " + "; ".join(f"**{name}** `{json.dumps(values)}`"
                                              for name, values in VARIANTS.items()) + ".", "",
             "| variant | greedy exact-match | sampled exact-match | greedy at iteration 30 / 60 | s to 95% greedy "
             "| s to 99% greedy | s/iteration | entropy, first -> last 10 iterations | generated tokens per "
             "sequence trained on |",
             "|---|---|---|---|---|---|---|---|---|"]
    for variant, runs in results["runs"].items():
        def at(iteration: int) -> list[float | None]:
            return [dict(r["greedy_by_iteration"]).get(iteration) for r in runs]

        first_entropy = [r["entropy"][0][1] for r in runs]
        last_entropy = [statistics.mean(e for _, e in r["entropy"][-10:]) for r in runs]
        dropped = sum(r["dropped_groups"] for r in runs)
        lines.append(
            f"| {variant} | {spread([r['after']['eval/exact_match'] for r in runs], 100, 1, '%')} "
            f"| {spread([r['after_sampled']['eval_sampled/exact_match'] for r in runs], 100, 1, '%')} "
            f"| {spread(at(30), 100, 1, '%')} / {spread(at(60), 100, 1, '%')} "
            f"| {spread([r['s_to_95%_greedy'] for r in runs])} | {spread([r['s_to_99%_greedy'] for r in runs])} "
            f"| {spread([r['s_per_iteration'] for r in runs], digits=3)} "
            f"| {spread(first_entropy, digits=3)} -> {spread(last_entropy, digits=3)} "
            f"| {spread([r['tokens_per_kept_sample'] for r in runs], digits=2)}"
            + (f" ({dropped:.0f} groups dropped over the seeds, {sum(r['filled_groups'] for r in runs):.0f} refilled)"
               if dropped else "") + " |")
    lines += ["", "![loss variants](loss_variants.png)", ""]
    return "\n".join(lines)


def losses(args, results: dict) -> None:
    if args.report_only:  # the figures as they were recorded, the tables and plot drawn again
        results = json.loads((RESULTS / "loss_variants.json").read_text())
    else:
        iterations, eval_size = (3, 100) if args.quick else (LOSSES_COMMON["iterations"], LOSSES_COMMON["eval_size"])
        sft, _, source = models(args, reward_too=False)

        def values(variant: str, seed: int, out: Path) -> dict:
            return {**LOSSES_COMMON, **VARIANTS[variant], "seed": seed, "model": sft, "out": str(out),
                    "iterations": iterations, "eval_size": eval_size, "overwrite": True}

        runs = run_each(args.only or list(VARIANTS), args.seeds, values, args, "losses")
        runs = {variant: [variant_figures(Path(args.out) / "losses" / f"{variant}-{seed}", figures)
                          for seed, figures in zip(args.seeds, done)] for variant, done in runs.items()}
        results.update(source=source, seeds=args.seeds, iterations=iterations, eval_size=eval_size,
                       sft_exact_match=next(iter(runs.values()))[0]["before"]["eval/exact_match"], runs=runs)
    write_results("loss_variants", results, losses_report(results), indent=1)
    seeds = f"mean of {len(results['seeds'])} seeds"
    plot([(results["runs"], "greedy_by_iteration", f"held-out greedy exact-match, {seeds}", "iteration"),
          (results["runs"], "curve:eval/exact_match", f"held-out greedy exact-match, {seeds}", X_SECONDS),
          (results["runs"], "entropy", f"policy entropy (nats per token), {seeds}", "iteration")],
         RESULTS / "loss_variants.png")


def models(args, reward_too: bool) -> tuple[str, str, str]:
    """The SFT model (and reward model) the runs start from, and where they came from: --from-demo's
    run folder, or the demo's stages trained here once."""
    if args.report_only:
        return "", "", args.note_source
    if args.from_demo:
        demo = Path(args.from_demo)
        return (str(demo / "sft" / "checkpoints" / "sft"), str(demo / "rm" / "checkpoints" / "reward"),
                f"those of the `ppo-rlhf demo` run in {demo}")
    sft, reward, figures = train_sft_and_rm(Path(args.out) / "demo", 0)
    reward_note = (f", reward model {figures['rm_seconds']:.0f} s, held-out accuracy {figures['rm_eval_accuracy']:.2%}"
                   if reward_too else "")
    return sft, reward, f"trained once here (demo stages, seed 0: SFT {figures['sft_seconds']:.0f} s{reward_note})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", nargs="?", choices=("estimators", "losses"), default="estimators")
    parser.add_argument("--out", help="run folders (default runs/bench_estimators or runs/bench_loss_variants)")
    parser.add_argument("--from-demo", help="reuse the SFT and reward model of this `ppo-rlhf demo` run folder")
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2], help="built-in task seeds (none: skip it)")
    parser.add_argument("--only", nargs="+", choices=sorted({*SAMPLES, *VARIANTS}),
                        help="these estimators or variants alone (default: every one)")
    parser.add_argument("--smollm2-seeds", type=int, nargs="*", default=[0],
                        help="estimators: SmolLM2 seeds (none: skip it)")
    parser.add_argument("--smollm2-iterations", type=int, default=SMOLLM2_OVERRIDES["iterations"])
    parser.add_argument("--smollm2-model", default="runs/smollm2-135m-instruct")
    parser.add_argument("--quick", action="store_true", help="3 iterations each, 100 held-out prompts")
    parser.add_argument("--note", default="idle machine", help="what else ran on the machine")
    parser.add_argument("--note-source", default="", help="with --report-only: where the SFT and reward model came from")
    parser.add_argument("--report-only", action="store_true",
                        help="write the results again from what the runs left, running nothing")
    parser.add_argument("--num-threads", type=int, default=0,
                        help="torch threads per run (0: torch's default); 1 when other work shares the cores")
    args = parser.parse_args()
    if set(args.only or []) - set(SAMPLES if args.what == "estimators" else VARIANTS):
        parser.error(f"--only: {args.what} are {', '.join(SAMPLES if args.what == 'estimators' else VARIANTS)}")
    args.out = args.out or {"estimators": "runs/bench_estimators", "losses": "runs/bench_loss_variants"}[args.what]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    results = record(args.note + (f"; {args.num_threads} torch thread(s) per run" if args.num_threads else ""),
                     unit="threads")
    {"estimators": estimators, "losses": losses}[args.what](args, results)


if __name__ == "__main__":
    main()
