"""TRL's PPO script, run through ppo_rlhf.trl, against this project's own PPO on the same settings,
on the built-in task (issue 58, item 3): one SFT model and one-label reward model, then for each
seed TRL 0.23's examples/scripts/ppo/ppo.py (tests/trl_scripts/ppo.py) and ``ppo-rlhf ppo`` with
the settings its command line maps to, judged by one evaluator.

    python benchmarks/bench_trl_ppo_script.py             # seeds 0 and 1, the full budget
    python benchmarks/bench_trl_ppo_script.py --seeds 0 1 2 3 4 5 6 7   # the figure docs/benchmarks.md quotes
    python benchmarks/bench_trl_ppo_script.py --quick     # validation: 1 seed, a few steps of each stage

What the two runs do differently: TRL's value model starts from the reward model's score head
(ppo-rlhf's critic from a fresh head on the same trunk), and the script's prompts come
pre-tokenized (the same ids).  Writes benchmarks/results/trl_ppo_script.{json,md}; see
docs/benchmarks.md, "TRL's PPO script against ppo-rlhf's PPO".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, ROOT, command, processor, write_results

SCRIPT = ROOT / "tests" / "trl_scripts" / "ppo.py"
EVAL_ROWS = 100  # TRL's ppo.py keeps the last 100 rows of its data set for evaluation

FULL = {"sft_steps": 1600, "rm_steps": 300, "total_episodes": 64 * 60, "eval_size": 500, "seeds": [0, 1]}
QUICK = {"sft_steps": 40, "rm_steps": 20, "total_episodes": 64 * 3, "eval_size": 50, "seeds": [0]}


def ppo_arguments(budget: dict, seed: int) -> list[str]:
    """TRL's ppo.py command line for the task: its batch (64 rollouts, 2 minibatches), 4 PPO epochs,
    TRL's KL (0.05, k1), GAE (lam 0.95), temperature (0.7) and clip ranges; a small model's step."""
    return ["--per_device_train_batch_size", "64", "--gradient_accumulation_steps", "1", "--num_mini_batches", "2",
            "--num_ppo_epochs", "4", "--total_episodes", str(budget["total_episodes"]), "--response_length", "7",
            "--stop_token", "eos", "--learning_rate", "3e-4", "--local_rollout_forward_batch_size", "64",
            "--missing_eos_penalty", "1.0", "--seed", str(seed), "--report_to", "none",
            "--gradient_checkpointing", "False", "--num_sample_generations", "0"]


def run(command: list, log: Path, threads: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(log.parent / "hf_cache")}
    start = time.perf_counter()
    with open(log, "w") as handle:
        done = subprocess.run([str(part) for part in command], env=env, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"{command[1]} failed (exit {done.returncode}); its log: {log}")
    return time.perf_counter() - start


def pipeline(out: Path, budget: dict, threads: int) -> tuple[Path, Path, Path]:
    """The SFT model, the pairwise reward model and the data folder (train rows, the held-out last)."""
    from ppo_rlhf.tasks.doubling import STYLES, make_task, prompt_text, render, write_jsonl

    task = make_task(0)
    sft = out / "sft"
    if not (sft / "checkpoints" / "sft" / "config.json").is_file():
        run([sys.executable, "-m", "ppo_rlhf.cli", "sft", "--task", "doubling", "--steps", budget["sft_steps"],
             "--batch-size", 128, "--lr", 3e-3, "--min-lr-ratio", 0.01, "--eval-every", 0, "--num-threads", threads,
             "--out", sft, "--overwrite"], out / "sft.log", threads)
    pairs = []
    for q in task.train_questions[:4000]:
        for i, style in enumerate(STYLES):
            other = STYLES[(i + 1) % len(STYLES)]
            pairs.append({"prompt": prompt_text(q, style), "chosen": render(2 * q, style),
                          "rejected": render(2 * q, other)})
    write_jsonl(pairs, out / "pairs.jsonl")
    rm = out / "rm"
    if not (rm / "checkpoints" / "reward" / "config.json").is_file():
        run([sys.executable, "-m", "ppo_rlhf.cli", "rm", "--mode", "pairwise", "--model", sft / "checkpoints" / "sft",
             "--data", out / "pairs.jsonl", "--steps", budget["rm_steps"], "--batch-size", 64, "--lr", 2e-3,
             "--num-threads", threads, "--out", rm, "--overwrite"], out / "rm.log", threads)
    data = out / "data"
    data.mkdir(exist_ok=True)
    rows = task.prompt_rows() + task.eval_rows()[:EVAL_ROWS]  # the held-out last: the script's eval split
    write_jsonl([{"prompt": row["prompt"]} for row in rows], data / "train.jsonl")
    return sft / "checkpoints" / "sft", rm / "checkpoints" / "reward", data


def own_settings(budget: dict, seed: int, sft: Path, rm: Path, data: Path, out: Path) -> dict:
    """The settings ppo.py's command line maps to (ppo_rlhf.trl), as this project's ppo's own config."""
    from transformers import HfArgumentParser

    from ppo_rlhf.models import load_tokenizer
    from ppo_rlhf.tasks.doubling import write_jsonl
    from ppo_rlhf.trl import ModelConfig, PPOConfig, ScriptArguments
    from ppo_rlhf.trl.translate import ppo_settings

    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    write_jsonl(rows[:-EVAL_ROWS], out / "train_prompts.jsonl")
    write_jsonl(rows[-EVAL_ROWS:], out / "eval_prompts.jsonl")
    _, args, _ = HfArgumentParser((ScriptArguments, PPOConfig, ModelConfig)).parse_args_into_dataclasses(
        ["--output_dir", str(out), *ppo_arguments(budget, seed)])
    settings, notes = ppo_settings(args, len(rows) - EVAL_ROWS)
    tokenizer = load_tokenizer(sft)  # max_length as ppo_rlhf.trl sets it: the longest prompt + response_length
    longest = max(len(tokenizer(row["prompt"])["input_ids"]) for row in rows)
    settings.update(model=str(sft), reward_model=str(rm), critic="separate", critic_model=str(rm),
                    prompts=str(out / "train_prompts.jsonl"), eval_prompts=str(out / "eval_prompts.jsonl"),
                    eval_size=EVAL_ROWS, max_length=longest + args.response_length, overwrite=True)
    return settings


def evaluate(folder: Path, budget: dict) -> dict:
    """Greedy exact match (the task's rule) on the task's held-out prompts."""
    from ppo_rlhf.evaluation import Evaluator
    from ppo_rlhf.models import load_causal_lm, load_tokenizer
    from ppo_rlhf.tasks.doubling import make_task

    task = make_task(0)
    evaluator = Evaluator(load_tokenizer(folder), task.eval_rows()[EVAL_ROWS:EVAL_ROWS + budget["eval_size"]],
                          task.metric, max_prompt_length=12, max_new_tokens=7)
    metrics, _ = evaluator(load_causal_lm(folder).eval())
    return {k: v for k, v in metrics.items() if k.startswith("eval/") and not k.endswith("seconds")}


def figures(run_dir: Path, seconds: float) -> dict:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    training = [m for m in metrics if "score" in m and m.get("step", 0) > 0]
    return {"iterations": len(training), "process_seconds": seconds,
            "s_per_iteration_median": statistics.median(m["time/iteration"] for m in training),
            "score_first": training[0]["score"], "score_last": training[-1]["score"],
            "score_curve": [round(m["score"], 4) for m in training]}


def report(results: dict) -> str:
    lines = ["# TRL's PPO script through ppo_rlhf.trl against ppo-rlhf's own PPO, the built-in task", "",
             f"Command: `{results['command']}`  ", f"Machine: {results['machine']}  ", "",
             "TRL 0.23's examples/scripts/ppo/ppo.py (its import changed to ppo_rlhf.trl) and `ppo-rlhf ppo` with the "
             "settings its command line maps to, from the same SFT model and pairwise reward model of the built-in "
             f"task. Command line: `{' '.join(results['ppo_arguments'])}`. Held-out: greedy exact match on "
             f"{results['eval_size']} held-out prompts of the task.", "",
             "| run | seed | iterations | s/iteration | training score first -> last | held-out exact match |",
             "|---|---|---|---|---|---|",
             f"| SFT model | — | — | — | — | {100 * results['sft']['eval/exact_match']:.1f}% |"]
    for r in results["runs"]:
        lines.append(f"| {r['system']} | {r['seed']} | {r['iterations']} | {r['s_per_iteration_median']:.3f} | "
                     f"{r['score_first']:.3f} -> {r['score_last']:.3f} | {100 * r['eval']['eval/exact_match']:.1f}% |")
    lines += ["", "| run | seeds | held-out exact match, median (range) | seeds that learned (held-out >= SFT + 10 points) |",
              "|---|---|---|---|"]
    sft = results["sft"]["eval/exact_match"]
    for system in dict.fromkeys(r["system"] for r in results["runs"]):
        held_out = [r["eval"]["eval/exact_match"] for r in results["runs"] if r["system"] == system]
        learned = sum(value >= sft + 0.1 for value in held_out)
        lines.append(f"| {system} | {len(held_out)} | {100 * statistics.median(held_out):.1f}% "
                     f"({100 * min(held_out):.1f}-{100 * max(held_out):.1f}%) | {learned} of {len(held_out)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/trl_ppo_script")
    parser.add_argument("--quick", action="store_true", help="validation: 1 seed, a few steps of each stage; "
                                                             "results in OUT-quick")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seeds", type=int, nargs="+", help="the seeds to run (default: 0 1; --quick: 0)")
    args = parser.parse_args()
    budget = dict(QUICK if args.quick else FULL)
    budget["seeds"] = args.seeds or budget["seeds"]
    out = Path(args.out.rstrip("/") + ("-quick" if args.quick else "")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "src"))
    sft, rm, data = pipeline(out, budget, args.threads)
    runs = []
    for seed in budget["seeds"]:
        script_out = out / f"script-seed{seed}"
        seconds = run([sys.executable, SCRIPT, "--dataset_name", data, "--dataset_train_split", "train",
                       "--output_dir", script_out, "--model_name_or_path", sft, "--sft_model_path", sft,
                       "--reward_model_path", rm, *ppo_arguments(budget, seed)], out / f"script-seed{seed}.log",
                      args.threads)
        runs.append({"system": "TRL's ppo.py through ppo_rlhf.trl", "seed": seed, **figures(script_out, seconds),
                     "eval": evaluate(script_out / "checkpoints" / "actor", budget)})
        own_out = out / f"own-seed{seed}"
        settings = own_settings(budget, seed, sft, rm, data, own_out)
        (out / f"own-seed{seed}.json").write_text(json.dumps(settings, indent=2) + "\n")
        seconds = run([sys.executable, "-m", "ppo_rlhf.cli", "ppo", "--config", out / f"own-seed{seed}.json",
                       "--num-threads", args.threads], out / f"own-seed{seed}.log", args.threads)
        runs.append({"system": "ppo-rlhf ppo, the same settings", "seed": seed, **figures(own_out, seconds),
                     "eval": evaluate(own_out / "checkpoints" / "actor", budget)})
        for r in runs[-2:]:
            print(f"{r['system']} seed {seed}: {r['s_per_iteration_median']:.3f} s/iteration, score "
                  f"{r['score_first']:.3f} -> {r['score_last']:.3f}, held-out exact match "
                  f"{100 * r['eval']['eval/exact_match']:.1f}%", flush=True)
    results = {"command": command(), "machine": f"{processor()}, {os.cpu_count()} cores, {args.threads} torch threads",
               "ppo_arguments": ppo_arguments(budget, 0), "budget": budget,
               "eval_size": budget["eval_size"], "sft": evaluate(sft, budget), "runs": runs}
    write_results("trl_ppo_script", results, report(results), out if args.quick else RESULTS)


if __name__ == "__main__":
    main()
