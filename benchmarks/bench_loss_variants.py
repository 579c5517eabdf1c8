"""The policy-loss variants side by side: GRPO, DAPO, GSPO, CISPO, SAPO and PPO on one rollout budget,
the built-in task with its rule reward, from one SFT model; only the variant changes (VARIANTS).

    python benchmarks/bench_loss_variants.py                  # 6 variants x 3 seeds, ~25 min on 2 cores
    python benchmarks/bench_loss_variants.py --quick          # a few iterations of each, to try the script

Each run its own process (common.py's runner).  Results: benchmarks/results/loss_variants.{json,md,png};
the settings and figures: docs/benchmarks.md, "Policy-loss variants, issue 37", and docs/estimators.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_estimators import GAE_CRITIC
from common import (RESULTS, header, mean_points, pyplot, record, run_in_child, save_figure, spread, train_sft_and_rm,
                    write_results)

COMMON = {"task": "doubling", "do_sample": True, "max_new_tokens": 7, "max_length": 19, "batch_size": 64,
          "mini_batch_size": 32, "ppo_epochs": 4, "lr": 3e-4, "kl_coef": 0.05, "iterations": 100,
          "eval_every": 10, "eval_size": 500, "save_every": 0, "sample_every": 0}
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


def variant_figures(out: Path, figures: dict) -> dict:
    """The figures of common.run_figures, plus what the variants change: entropy, and tokens generated
    per sequence that reached the update."""
    from ppo_rlhf.runlog import read_metrics

    iterations = [r for r in read_metrics(out / "metrics.jsonl") if "time/iteration" in r]
    per_kept = [r.get("dynamic_sampling/generated_tokens_per_kept_sample", r["response_length"]) for r in iterations]
    return {**figures,
            "entropy": [(r["step"], r["entropy"]) for r in iterations if "entropy" in r],
            "greedy_by_iteration": [(r["step"], r["eval/exact_match"]) for r in read_metrics(out / "metrics.jsonl")
                                    if "eval/exact_match" in r],
            # NaN (None in metrics.jsonl): an iteration that kept no group
            "tokens_per_kept_sample": statistics.mean(v for v in per_kept if v is not None and v == v),
            "dropped_groups": sum(r.get("dynamic_sampling/dropped_groups", 0) for r in iterations),
            "filled_groups": sum(r.get("dynamic_sampling/filled_groups", 0) for r in iterations)}


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    panels = [("greedy_by_iteration", "held-out greedy exact-match", "iteration"),
              ("curve:eval/exact_match", "held-out greedy exact-match", "PPO seconds (evaluation excluded)"),
              ("entropy", "policy entropy (nats per token)", "iteration")]
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for axis, (key, title, xlabel) in zip(axes[0], panels):
        for variant, runs in results["runs"].items():
            points = mean_points(runs, key)
            axis.plot([p[0] for p in points], [p[1] for p in points], marker="o" if len(points) < 20 else None,
                      markersize=3, label=variant)
        axis.set_title(f"{title}, mean of {len(results['seeds'])} seeds", fontsize=10)
        axis.set_xlabel(xlabel)
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    save_figure(figure, path)


def report(results: dict) -> str:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_loss_variants")
    parser.add_argument("--from-demo", help="reuse the SFT model of this `ppo-rlhf demo` run folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="3 iterations each, 100 held-out prompts")
    parser.add_argument("--note", default="idle machine", help="what else ran on the machine")
    parser.add_argument("--report-only", action="store_true", help="redo the table and plot from results/loss_variants.json")
    parser.add_argument("--num-threads", type=int, default=0,
                        help="torch threads per run (0: torch's default); 1 when other work shares the cores")
    args = parser.parse_args()
    if args.report_only:
        return write(json.loads((RESULTS / "loss_variants.json").read_text()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.log"
    iterations, eval_size = (3, 100) if args.quick else (COMMON["iterations"], COMMON["eval_size"])
    if args.from_demo:
        sft = str(Path(args.from_demo) / "sft" / "checkpoints" / "sft")
        source = f"that of the `ppo-rlhf demo` run in {args.from_demo}"
    else:
        sft, _, figures = train_sft_and_rm(out / "demo", 0)
        source = f"trained here (the demo's SFT stage, seed 0, {figures['sft_seconds']:.0f} s)"
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for seed in args.seeds:  # seeds outermost: a slow drift of the machine touches every variant alike
        for variant in args.variants:
            print(f"{variant}, seed {seed}", flush=True)
            run_out = out / f"{variant}-{seed}"
            values = {**COMMON, **VARIANTS[variant], "seed": seed, "model": sft, "out": str(run_out),
                      "iterations": iterations, "eval_size": eval_size, "overwrite": True}
            runs[variant].append(variant_figures(run_out, run_in_child(values, log, args.num_threads)))
    results = {**record(args.note + (f"; {args.num_threads} torch thread(s) per run" if args.num_threads else ""),
                        unit="threads"),
               "source": source, "seeds": args.seeds, "iterations": iterations, "eval_size": eval_size,
               "sft_exact_match": runs[args.variants[0]][0]["before"]["eval/exact_match"], "runs": runs}
    write(results)


def write(results: dict) -> None:
    write_results("loss_variants", results, report(results), indent=1)
    plot(results, RESULTS / "loss_variants.png")


if __name__ == "__main__":
    main()
