"""On-policy distillation against GRPO (issue 49): held-out accuracy against training seconds for a
student distilled from an RL-trained teacher (the README's chain_sum run) and for the same student
trained by GRPO, from the same start, with the same batch.

    make smollm2                                      # once: the base SmolLM2-135M-Instruct as a folder
    python benchmarks/bench_distill.py                # teacher (the README's chain_sum run), then both students
    python benchmarks/bench_distill.py --teacher runs/chain_sum/checkpoints/actor   # a teacher already trained
    python benchmarks/bench_distill.py --report-only  # the tables and plot from finished runs
    python benchmarks/bench_distill.py --smoke        # the whole script on a tiny model of the built-in task (~1 min;
                                                      # its figures stay in --out: they test the script, not the method)

Results: benchmarks/results/distill.{json,md,png} (``--distill-gamma 1``: distill_gamma1.*); the
recipes and the target: docs/benchmarks.md, "On-policy distillation against GRPO (issue 49)".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import RESULTS, header, pyplot, record, require_model, run_in_child, save_figure, write_results

TARGET_SHARE, TARGET_RATIO = 0.9, 0.25
# The README's chain_sum command ("Real reasoning tasks"), as PPOConfig fields.
CHAIN_SUM = {"lora": True, "task": "reasoning-gym:chain_sum",
             "task_config": "min_terms=2,max_terms=2,min_digits=1,max_digits=2", "task_size": 2000,
             "task_reward": "exact", "estimator": "grpo", "samples_per_prompt": 8, "batch_size": 32,
             "mini_batch_size": 32, "ppo_epochs": 1, "kl_in": "loss", "lr": 1e-4, "temperature": 0.7,
             "max_new_tokens": 32, "iterations": 36, "eval_sampled": False, "save_every": 0, "sample_every": 0}
# The tiny version for --smoke: the built-in task's TINY model after a few SFT steps, the same shape of run.
SMOKE = {"task": "doubling", "estimator": "grpo", "samples_per_prompt": 4, "batch_size": 16, "mini_batch_size": 16,
         "ppo_epochs": 1, "kl_in": "loss", "lr": 3e-3, "max_new_tokens": 7, "max_length": 20, "iterations": 6,
         "eval_size": 100, "eval_sampled": False, "save_every": 0, "sample_every": 0}
# What turns the GRPO recipe into distillation (module docstring).
DISTILL = {"estimator": "reinforce++", "reward_weights": [0.0], "kl_coef": 0.0, "kl_in": "reward"}


def distill_settings(gamma: float) -> tuple[dict, str, str]:
    """DISTILL with its discount, the run folder's prefix and the results' stem: gamma 0 (the
    reference's) is ``distill``; another gamma names itself."""
    name = "distill" if gamma == 0 else f"distill-gamma{gamma:g}"
    return {**DISTILL, "gamma": gamma}, name, name.replace("-", "_")


def accuracy_key(task: str) -> str:
    return "eval/exact_match" if task == "doubling" else "eval/accuracy"


def figures(out: Path, key: str) -> dict:
    """(PPO seconds, held-out accuracy) at each evaluation of a finished run, and its summary's numbers."""
    from ppo_rlhf.runlog import read_metrics

    records = read_metrics(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    return {"curve": [(r.get("time/elapsed", 0.0), r[key]) for r in records if key in r],
            "after": summary["after"].get(key), "ppo_seconds": summary["ppo_seconds"],
            "reverse_kl": [r["teacher/reverse_kl"] for r in records if "teacher/reverse_kl" in r]}


def seconds_to_reach(curve: list, threshold: float) -> float | None:
    return next((seconds for seconds, accuracy in curve if accuracy >= threshold), None)


def smoke_model(out: Path) -> str:
    """A tiny model of the built-in task: 30 SFT steps of tests' TINY shape."""
    from ppo_rlhf.cli import main as cli

    folder = out / "sft" / "checkpoints" / "sft"
    if not (folder / "config.json").is_file():
        code = cli(["sft", "--task", "doubling", "--steps", "30", "--batch-size", "32", "--eval-every", "0",
                    "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--num-threads", "1", "--overwrite",
                    "--out", str(out / "sft")])
        if code != 0:
            raise SystemExit("the smoke test's SFT model failed")
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/smollm2-135m-instruct", help="the student's start (and the teacher's)")
    parser.add_argument("--teacher", help="a teacher already trained (default: train the README's chain_sum run)")
    parser.add_argument("--out", default="runs/bench_distill")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--iterations", type=int, default=None, help="student iterations (default: the recipe's)")
    parser.add_argument("--eval-every", type=int, default=4, help="student iterations between held-out evaluations")
    parser.add_argument("--distill-iterations", type=int, default=None,
                        help="the distilled student's iterations (default: the recipe's; fewer where it reaches "
                             "the target early)")
    parser.add_argument("--distill-gamma", type=float, default=0.0,
                        help="the distilled student's discount: 0 each token its own teacher reward (the reference's), "
                             "1 the sum of those to come")
    parser.add_argument("--smoke", action="store_true", help="a tiny model of the built-in task, a few iterations")
    parser.add_argument("--report-only", action="store_true", help="the results from the finished runs only")
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument("--note", default="idle machine")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.log"
    recipe = dict(SMOKE if args.smoke else CHAIN_SUM)
    model = smoke_model(out) if args.smoke else args.model
    require_model(model)
    key = accuracy_key(recipe["task"])

    teacher_run = out / "teacher"
    teacher = args.teacher or str(teacher_run / "checkpoints" / "actor")
    if not args.teacher and not args.report_only and not (teacher_run / "summary.json").is_file():
        # The README's recipe from the students' start with seed 0 is also GRPO's seed-0 student: one
        # run serves as both, evaluated as the students are.
        print("teacher: the README's recipe (also GRPO's seed-0 student)", flush=True)
        run_in_child({**recipe, "model": model, "seed": 0, "out": str(teacher_run), "eval_every": args.eval_every,
                      "overwrite": True}, log, args.num_threads)
    teacher_accuracy = teacher_accuracy_of(args.teacher, teacher_run, recipe, key, args.num_threads)
    runs: dict[str, list] = {"grpo": [], "distill": []}
    distilled, distill_folder, _ = distill_settings(args.distill_gamma)
    for seed in args.seeds:
        for name, extra in (("grpo", {}), ("distill", {**distilled, "teacher": teacher})):
            run_out = out / f"{name if name == 'grpo' else distill_folder}-{seed}"
            if name == "grpo" and seed == 0 and not args.teacher and not args.iterations:
                run_out = teacher_run  # the same run: the README's recipe, seed 0, from the same start
            elif not args.report_only:
                print(f"{name}, seed {seed}", flush=True)
                iterations = (args.distill_iterations if name == "distill" else None) or args.iterations \
                    or recipe["iterations"]
                run_in_child({**recipe, **extra, "model": model, "seed": seed, "out": str(run_out),
                              "iterations": iterations, "eval_every": args.eval_every,
                              "overwrite": True}, log, args.num_threads)
            if (run_out / "summary.json").is_file():
                runs[name].append({"seed": seed, **figures(run_out, key)})
    report(args, recipe, teacher, teacher_accuracy, runs, out)


def teacher_accuracy_of(teacher: str | None, teacher_run: Path, recipe: dict, key: str, num_threads: int) -> float:
    """The teacher's held-out greedy accuracy: its own run's final evaluation, or (a teacher given)
    ``ppo-rlhf eval`` of it on the students' held-out problems."""
    if teacher is None:
        return json.loads((teacher_run / "summary.json").read_text())["after"][key]
    from ppo_rlhf.config import build_config
    from ppo_rlhf.stages.evaluate import EvalConfig, run_eval

    settings = {k: recipe[k] for k in ("task", "task_config", "task_size") if k in recipe}
    summary = run_eval(build_config(EvalConfig, {"model": teacher, **settings, "max_new_tokens": recipe["max_new_tokens"],
                                                 "size": recipe.get("eval_size", 200), "show": 0,
                                                 "num_threads": num_threads}))
    return summary[key.split("/", 1)[1]]


def report(args, recipe: dict, teacher: str, teacher_accuracy: float, runs: dict, out: Path) -> None:
    threshold = TARGET_SHARE * teacher_accuracy
    rows = []
    for seed in args.seeds:
        grpo = next((r for r in runs["grpo"] if r["seed"] == seed), None)
        distill = next((r for r in runs["distill"] if r["seed"] == seed), None)
        if grpo is None or distill is None:
            continue
        t_grpo, t_distill = seconds_to_reach(grpo["curve"], threshold), seconds_to_reach(distill["curve"], threshold)
        ratio = t_distill / t_grpo if t_grpo and t_distill is not None else None  # (GRPO at 0 s: no ratio)
        rows.append({"seed": seed, "grpo_seconds": t_grpo, "distill_seconds": t_distill, "ratio": ratio,
                     "grpo_after": grpo["after"], "distill_after": distill["after"],
                     "met": ratio is not None and ratio <= TARGET_RATIO})
    distilled, _, stem = distill_settings(args.distill_gamma)
    results = {**record(args.note, args.num_threads), "recipe": recipe, "distill": distilled,
               "teacher": teacher, "teacher_accuracy": teacher_accuracy, "threshold": threshold, "rows": rows,
               "runs": runs}
    # A smoke test's figures say nothing of the method: they stay in its run folder.
    results_folder, stem = (out, f"{stem}_smoke") if args.smoke else (RESULTS, stem)
    lines = [*header(f"On-policy distillation against GRPO{' (smoke test)' if args.smoke else ''}", results),
             f"Teacher {teacher}: held-out greedy accuracy {teacher_accuracy:.1%}; the target is "
             f"{TARGET_SHARE:.0%} of it, {threshold:.1%}, reached by the distilled student in at most "
             f"{TARGET_RATIO:g}x the PPO seconds GRPO takes.", "",
             "Distillation: " + ", ".join(f"{k} {v}" for k, v in results["distill"].items()) + "; GRPO: the recipe's "
             f"{recipe['estimator']} with the task's reward.", "",
             "| seed | GRPO s to target | distillation s to target | ratio | met | GRPO final | distillation final |",
             "|---|---|---|---|---|---|---|"]

    def seconds(value):
        return "not reached" if value is None else f"{value:.0f}"

    for row in rows:
        lines.append(f"| {row['seed']} | {seconds(row['grpo_seconds'])} | {seconds(row['distill_seconds'])} | "
                     f"{'n/a' if row['ratio'] is None else format(row['ratio'], '.2f')} | {'yes' if row['met'] else 'no'} "
                     f"| {row['grpo_after']:.1%} | {row['distill_after']:.1%} |")
    lines += ["", f"![held-out accuracy against PPO seconds]({stem}.png)", ""]
    write_results(stem, results, "\n".join(lines), results_folder, indent=1)
    plot(runs, threshold, results_folder / f"{stem}.png")


def plot(runs: dict, threshold: float, path: Path) -> None:
    plt = pyplot()

    figure, axis = plt.subplots(figsize=(6.5, 4.2))
    for name, colour in (("grpo", "tab:orange"), ("distill", "tab:blue")):
        for i, r in enumerate(runs[name]):
            axis.plot([s for s, _ in r["curve"]], [100 * a for _, a in r["curve"]], ("-", "--", ":")[i % 3],
                      marker="o", markersize=3, color=colour, label=f"{name}, seed {r['seed']}")
    axis.axhline(100 * threshold, color="grey", linewidth=0.8, linestyle=":")
    axis.set_xlabel("PPO seconds (evaluation excluded); dotted: 90% of the teacher")
    axis.set_ylabel("held-out greedy accuracy (%)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    save_figure(figure, path)


if __name__ == "__main__":
    main()
