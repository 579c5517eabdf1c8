"""On-policy distillation against GRPO, and against SFT on the teacher's samples (issues 49 and 61):
held-out accuracy against training seconds for students that start from the same base, with the
same LoRA adapter, batch and learning rate (the README's chain_sum recipe), each way:

    grpo              the task's reward (the recipe itself)
    distill           on-policy distillation: -(log pi - log teacher) on each token, no task reward
    distill-loss      the same, the teacher's exact reverse KL over the vocabulary in the loss (--teacher-in
                      loss: GKD's divergence), no task reward
    distill+reward    both: the teacher's reward on each token and the task's at the end (gamma 1)
    sft-samples       off-policy distillation: the LoRA student fine-tuned on the teacher's own samples
                      (K each) for the prompts the RL students draw, one optimizer step a batch

The teacher (``--teacher-from``): ``worked`` (issue 61) SmolLM2 fine-tuned in full on worked
solutions of chain_sum problems the students never see (distill_teacher.py), or ``grpo`` (issue
49) the README's chain_sum GRPO run.

    make smollm2                                      # once: the base SmolLM2-135M-Instruct as a folder
    python benchmarks/bench_distill.py --seeds 0 1    # the worked-solution teacher, then every arm, both seeds
                                                      # (a finished arm is kept: run it again to go on; --rerun redoes)
    python benchmarks/bench_distill.py --teacher-only # the worked-solution teacher alone, and its held-out accuracy
    python benchmarks/bench_distill.py --teacher-from grpo --arms grpo distill   # issue 49's comparison
    python benchmarks/bench_distill.py --teacher runs/chain_sum/checkpoints/actor   # a teacher already trained
    python benchmarks/bench_distill.py --report-only  # the tables and plot from finished runs
    python benchmarks/bench_distill.py --smoke        # the whole script on a tiny model of the built-in task (minutes;
                                                      # its figures stay in --out: they test the script, not the method)

Results: benchmarks/results/distill_worked.{json,md,png} (``--teacher-from grpo``: distill.*; ``--distill-gamma 1``:
distill_gamma1.*); the recipes and the targets: docs/benchmarks.md, "On-policy distillation against GRPO".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import RESULTS, header, pyplot, record, require_model, run_in_child, save_figure, write_results
from distill_teacher import build_teacher, sft_student, teacher_samples

TARGET_SHARE, TARGET_RATIO = 0.9, 0.25
# The README's chain_sum command ("Real reasoning tasks"), as PPOConfig fields.
CHAIN_SUM = {"lora": True, "task": "reasoning-gym:chain_sum",
             "task_config": "min_terms=2,max_terms=2,min_digits=1,max_digits=2", "task_size": 2000,
             "task_seed": 0,  # one problem set for every student seed: the teacher's problems avoid its questions
             "task_reward": "exact", "estimator": "grpo", "samples_per_prompt": 8, "batch_size": 32,
             "mini_batch_size": 32, "ppo_epochs": 1, "kl_in": "loss", "lr": 1e-4, "temperature": 0.7,
             "max_new_tokens": 32, "iterations": 36, "eval_sampled": False, "save_every": 0, "sample_every": 0}
# The tiny version for --smoke: the built-in task's TINY model after a few SFT steps, the same shape of run.
SMOKE = {"task": "doubling", "estimator": "grpo", "samples_per_prompt": 4, "batch_size": 16, "mini_batch_size": 16,
         "ppo_epochs": 1, "kl_in": "loss", "lr": 3e-3, "max_new_tokens": 7, "max_length": 20, "iterations": 6,
         "eval_size": 100, "eval_sampled": False, "save_every": 0, "sample_every": 0}
# What turns the GRPO recipe into distillation (module docstring).
DISTILL = {"estimator": "reinforce++", "reward_weights": [0.0], "kl_coef": 0.0, "kl_in": "reward"}
# Distillation and the task's reward together: the task's reward counts, and each token's return is the
# teacher's rewards to come and the task's at the end.
DISTILL_AND_REWARD = {**DISTILL, "reward_weights": [1.0], "gamma": 1.0}
# The worked-solution teacher writes ~42 tokens (27-46) before its answer's end: the README recipe's 32
# cut 97% of them short, and the teacher measured 18.5% held-out so.  With that teacher every arm,
# the teacher's own evaluation and its samples get this budget, so a student can write what it writes.
WORKED_MAX_NEW_TOKENS = 64
ARMS = ("grpo", "distill", "distill-loss", "distill+reward", "sft-samples")
COLOURS = {"grpo": "tab:orange", "distill": "tab:blue", "distill-loss": "tab:cyan", "distill+reward": "tab:green",
           "sft-samples": "tab:purple"}
# The distilling arms, each measured against GRPO's time to the target.
DISTILLING = ("distill", "distill-loss", "distill+reward")


def distill_settings(gamma: float, teacher_from: str = "grpo") -> tuple[dict, str, str]:
    """DISTILL with its discount, the run folder's prefix and the results' stem: gamma 0 (the
    reference's) is ``distill``; another gamma names itself; the worked-solution teacher's results
    are ``distill_worked``."""
    name = "distill" if gamma == 0 else f"distill-gamma{gamma:g}"
    stem = name.replace("-", "_") + ("_worked" if teacher_from == "worked" else "")
    return {**DISTILL, "gamma": gamma}, name, stem


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


def smoke_model(out: Path, steps: int = 30, name: str = "sft") -> str:
    """A tiny model of the built-in task: ``steps`` SFT steps of tests' TINY shape."""
    from ppo_rlhf.cli import main as cli

    folder = out / name / "checkpoints" / "sft"
    if not (folder / "config.json").is_file():
        code = cli(["sft", "--task", "doubling", "--steps", str(steps), "--batch-size", "32", "--eval-every", "0",
                    "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--num-threads", "1", "--overwrite",
                    "--out", str(out / name)])
        if code != 0:
            raise SystemExit("the smoke test's SFT model failed")
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/smollm2-135m-instruct", help="the student's start (and the teacher's)")
    parser.add_argument("--teacher", help="a teacher already trained (default: made by --teacher-from)")
    parser.add_argument("--teacher-from", choices=("worked", "grpo"), default="worked",
                        help="worked: full fine-tuning on worked solutions (issue 61); grpo: the README's chain_sum "
                             "GRPO run (issue 49)")
    parser.add_argument("--teacher-steps", type=int, default=300, help="the worked-solution teacher's SFT steps of 32")
    parser.add_argument("--teacher-size", type=int, default=3000, help="the worked-solution teacher's problems")
    parser.add_argument("--teacher-lr", type=float, default=1e-4, help="the worked-solution teacher's peak lr")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--teacher-only", action="store_true", help="make the teacher, print its held-out accuracy "
                                                                    "and stop (results/distill_teacher.json)")
    parser.add_argument("--out", default="runs/bench_distill")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--iterations", type=int, default=None, help="student iterations (default: the recipe's)")
    parser.add_argument("--eval-every", type=int, default=4, help="student iterations between held-out evaluations")
    parser.add_argument("--distill-iterations", type=int, default=None,
                        help="the distilled students' iterations (default: the recipe's; fewer where they reach "
                             "the target early)")
    parser.add_argument("--distill-gamma", type=float, default=0.0,
                        help="the distilled student's discount: 0 each token its own teacher reward (the reference's), "
                             "1 the sum of those to come")
    parser.add_argument("--smoke", action="store_true", help="a tiny model of the built-in task, a few iterations")
    parser.add_argument("--report-only", action="store_true", help="the results from the finished runs only")
    parser.add_argument("--rerun", action="store_true", help="run again the arms that have finished (by default "
                        "a finished arm is kept, so a stopped comparison goes on where it stopped)")
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument("--note", default="idle machine")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.log"
    recipe = dict(SMOKE if args.smoke else CHAIN_SUM)
    if args.teacher_from == "worked" and not args.smoke:
        recipe["max_new_tokens"] = WORKED_MAX_NEW_TOKENS
    model = smoke_model(out) if args.smoke else args.model
    require_model(model)
    key = accuracy_key(recipe["task"])
    iterations = args.iterations or recipe["iterations"]

    teacher_run = out / "teacher"
    teacher = args.teacher or make_teacher(args, recipe, model, teacher_run, out, log)
    given = args.teacher is not None or args.teacher_from == "worked"
    teacher_accuracy = teacher_accuracy_of(teacher if given else None, teacher_run, recipe, key, args.num_threads)
    print(f"teacher {teacher}: held-out greedy accuracy {teacher_accuracy:.1%}", flush=True)
    if args.teacher_only:
        results = {**record(args.note, args.num_threads), "teacher": teacher, "teacher_from": args.teacher_from,
                   "teacher_steps": args.teacher_steps, "teacher_size": args.teacher_size, "teacher_lr": args.teacher_lr,
                   "held_out_accuracy": teacher_accuracy}
        lines = [*header("The distillation teacher", results),
                 f"Teacher {teacher} ({args.teacher_from}): held-out greedy accuracy **{teacher_accuracy:.1%}** on the "
                 f"students' {recipe.get('eval_size', 200)} held-out problems, at most {recipe['max_new_tokens']} new "
                 f"tokens.", ""]
        write_results("distill_teacher", results, "\n".join(lines), out if args.smoke else RESULTS, indent=1)
        return
    distilled, distill_folder, _ = distill_settings(args.distill_gamma, args.teacher_from)
    settings = {"grpo": {}, "distill": {**distilled, "teacher": teacher},
                "distill-loss": {**distilled, "teacher": teacher, "teacher_in": "loss"},
                "distill+reward": {**DISTILL_AND_REWARD, "teacher": teacher}}
    runs: dict[str, list] = {arm: [] for arm in args.arms}
    for seed in args.seeds:
        for arm in args.arms:
            folder = {"grpo": "grpo", "distill": distill_folder, "distill-loss": distill_folder + "-loss",
                      "distill+reward": "distill-reward", "sft-samples": "sft-samples"}[arm]
            run_out = out / f"{folder}-{seed}"
            if arm == "grpo" and seed == 0 and args.teacher_from == "grpo" and not args.teacher and not args.iterations:
                run_out = teacher_run  # the same run: the README's recipe, seed 0, from the same start
            elif arm == "sft-samples":
                if not args.report_only and (args.rerun or not (run_out.parent / f"{run_out.name}.json").is_file()):
                    print(f"{arm}, seed {seed}", flush=True)
                    sampling = off_policy_student(teacher, recipe, model, run_out, seed, iterations, args, log)
                    (run_out.parent / f"{run_out.name}.json").write_text(json.dumps(sampling) + "\n")
                record_file = run_out.parent / f"{run_out.name}.json"
                if record_file.is_file():
                    runs[arm].append({"seed": seed, **json.loads(record_file.read_text())})
                continue
            elif not args.report_only and (args.rerun or not (run_out / "summary.json").is_file()):
                print(f"{arm}, seed {seed}", flush=True)
                arm_iterations = (args.distill_iterations if arm != "grpo" else None) or iterations
                run_in_child({**recipe, **settings[arm], "model": model, "seed": seed, "out": str(run_out),
                              "iterations": arm_iterations, "eval_every": args.eval_every,
                              "overwrite": True}, log, args.num_threads)
            if (run_out / "summary.json").is_file():
                runs[arm].append({"seed": seed, **figures(run_out, key)})
    report(args, recipe, teacher, teacher_accuracy, runs, out)


def make_teacher(args, recipe: dict, model: str, teacher_run: Path, out: Path, log: Path) -> str:
    """The teacher --teacher-from asks for (a finished one is kept): the worked-solution SFT
    (the smoke test's: the built-in task's SFT run five times longer), or the README's GRPO run."""
    if args.teacher_from == "worked":
        if args.smoke:
            return smoke_model(out, steps=150, name="teacher-sft")
        return build_teacher(out, model, recipe, args.teacher_size, args.teacher_steps, args.teacher_lr, log,
                             args.num_threads)
    if not args.report_only and not (teacher_run / "summary.json").is_file():
        # The README's recipe from the students' start with seed 0 is also GRPO's seed-0 student: one
        # run serves as both, evaluated as the students are.
        print("teacher: the README's recipe (also GRPO's seed-0 student)", flush=True)
        run_in_child({**recipe, "model": model, "seed": 0, "out": str(teacher_run), "eval_every": args.eval_every,
                      "overwrite": True}, log, args.num_threads)
    return str(teacher_run / "checkpoints" / "actor")


def off_policy_student(teacher: str, recipe: dict, model: str, out: Path, seed: int, iterations: int, args,
                       log: Path) -> dict:
    """SFT on the teacher's samples: K samples of each prompt the RL students draw in ``iterations``
    iterations, then the LoRA student fine-tuned on them one batch a step (distill_teacher.py).
    The curve's seconds are the student's training seconds; the teacher's sampling seconds beside."""
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts = iterations * recipe["batch_size"] // recipe["samples_per_prompt"]
    data = out.parent / f"{out.name}-samples.jsonl"
    sampling_seconds = teacher_samples(teacher, recipe, prompts, seed, data)
    settings = {k: recipe[k] for k in ("task", "task_config", "task_size", "task_seed") if k in recipe}

    def evaluate(folder: str) -> float:
        return teacher_accuracy_of(folder, out, {**recipe, **settings}, accuracy_key(recipe["task"]), args.num_threads)

    curve = sft_student(out, model, data, recipe, iterations, args.eval_every, evaluate, log, args.num_threads)
    return {"curve": curve, "after": curve[-1][1], "ppo_seconds": curve[-1][0], "reverse_kl": [],
            "sampling_seconds": sampling_seconds}


def teacher_accuracy_of(teacher: str | None, teacher_run: Path, recipe: dict, key: str, num_threads: int) -> float:
    """The teacher's held-out greedy accuracy: its own run's final evaluation, or (a teacher given)
    ``ppo-rlhf eval`` of it on the students' held-out problems."""
    if teacher is None:
        return json.loads((teacher_run / "summary.json").read_text())["after"][key]
    from ppo_rlhf.config import build_config
    from ppo_rlhf.stages.evaluate import EvalConfig, run_eval

    settings = {k: recipe[k] for k in ("task", "task_config", "task_size", "task_seed") if k in recipe}
    summary = run_eval(build_config(EvalConfig, {"model": teacher, **settings, "max_new_tokens": recipe["max_new_tokens"],
                                                 "size": recipe.get("eval_size", 200), "show": 0,
                                                 "num_threads": num_threads}))
    return summary[key.split("/", 1)[1]]


def report(args, recipe: dict, teacher: str, teacher_accuracy: float, runs: dict, out: Path) -> None:
    threshold = TARGET_SHARE * teacher_accuracy
    rows = []
    for seed in args.seeds:
        arms = {arm: next((r for r in runs[arm] if r["seed"] == seed), None) for arm in runs}
        seconds = {arm: None if r is None else seconds_to_reach(r["curve"], threshold) for arm, r in arms.items()}
        grpo = seconds.get("grpo")
        ratios = {arm: seconds[arm] / grpo for arm in DISTILLING  # (GRPO at 0 s, or never there: no ratio)
                  if grpo and seconds.get(arm) is not None}
        rows.append({"seed": seed, "seconds": seconds, "ratios": ratios,
                     "met": any(ratio <= TARGET_RATIO for ratio in ratios.values()),
                     "after": {arm: None if r is None else r["after"] for arm, r in arms.items()}})
    distilled, _, stem = distill_settings(args.distill_gamma, args.teacher_from)
    results = {**record(args.note, args.num_threads), "recipe": recipe, "distill": distilled,
               "teacher": teacher, "teacher_accuracy": teacher_accuracy, "threshold": threshold, "rows": rows,
               "runs": runs}
    # A smoke test's figures say nothing of the method: they stay in its run folder.
    results_folder, stem = (out, f"{stem}_smoke") if args.smoke else (RESULTS, stem)
    lines = [*header(f"On-policy distillation against GRPO{' (smoke test)' if args.smoke else ''}", results),
             f"Teacher {teacher}: held-out greedy accuracy {teacher_accuracy:.1%}; the target is "
             f"{TARGET_SHARE:.0%} of it, {threshold:.1%}, reached by the distilled student in at most "
             f"{TARGET_RATIO:g}x the seconds GRPO takes.", "",
             "Distillation: " + ", ".join(f"{k} {v}" for k, v in results["distill"].items()) + "; GRPO: the recipe's "
             f"{recipe['estimator']} with the task's reward. Seconds: training seconds (evaluation excluded); "
             f"SFT on samples: the student's, the teacher's sampling beside.", "",
             "| seed | " + " | ".join(f"{arm}: s to target (final)" for arm in runs) + " | "
             + " | ".join(f"{arm} / grpo" for arm in DISTILLING if arm in runs) + " | met |",
             "|---" * (len(runs) + sum(arm in runs for arm in DISTILLING) + 2) + "|"]

    def cell(row, arm) -> str:
        after = row["after"][arm]
        reached = row["seconds"][arm]
        return ("no run" if after is None else
                f"{'not reached' if reached is None else format(reached, '.0f')} ({after:.1%})")

    for row in rows:
        ratios = [format(row["ratios"][arm], ".2f") if arm in row["ratios"] else "n/a" for arm in DISTILLING
                  if arm in runs]
        lines.append(f"| {row['seed']} | " + " | ".join(cell(row, arm) for arm in runs) + " | " + " | ".join(ratios)
                     + f" | {'yes' if row['met'] else 'no'} |")
    for r in runs.get("sft-samples", []):
        lines.append(f"\nSFT on samples, seed {r['seed']}: the teacher sampled its data in {r['sampling_seconds']:.0f} s.")
    lines += ["", f"![held-out accuracy against training seconds]({stem}.png)", ""]
    write_results(stem, results, "\n".join(lines), results_folder, indent=1)
    plot(runs, threshold, results_folder / f"{stem}.png")


def plot(runs: dict, threshold: float, path: Path) -> None:
    plt = pyplot()

    figure, axis = plt.subplots(figsize=(6.5, 4.2))
    for name, arm_runs in runs.items():
        for i, r in enumerate(arm_runs):
            axis.plot([s for s, _ in r["curve"]], [100 * a for _, a in r["curve"]], ("-", "--", ":")[i % 3],
                      marker="o", markersize=3, color=COLOURS[name], label=f"{name}, seed {r['seed']}")
    axis.axhline(100 * threshold, color="grey", linewidth=0.8, linestyle=":")
    axis.set_xlabel("training seconds (evaluation excluded); dotted: 90% of the teacher")
    axis.set_ylabel("held-out greedy accuracy (%)")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    save_figure(figure, path)


if __name__ == "__main__":
    main()
