"""Peer benchmark: ppo-rlhf's GRPO against TRL 1.16's GRPOTrainer on a reasoning-gym task with
SmolLM2-135M-Instruct and LoRA, same machine, same prompts, same reward code, one evaluator (issue
20, item 6); and TRL's own script (benchmarks/peers/trl_grpo.py) run through ppo_rlhf.trl (issue
58, item 3).

    make smollm2 trl116-venv                              # once: the model folder, TRL's venv
    python benchmarks/bench_peers_grpo.py                 # 2 seeds x 2 systems x 36 iterations
    python benchmarks/bench_peers_grpo.py --seeds 1       # one seed more: the other seeds' runs are kept
    python benchmarks/bench_peers_grpo.py --quick         # validation: 1 seed, 4 iterations, 8 problems
    python benchmarks/bench_peers_grpo.py --report-only   # redo the tables and plot from the run folders

The settings are in SAME_WORK, and the report lists what could not be matched.  Results:
benchmarks/results/peers_grpo.{json,md,png}; the method: docs/benchmarks.md, "Against TRL 1.16's
GRPOTrainer".
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench_reasoning import COMMON, ESTIMATORS, TRAIN_TASKS
from common import (HERE, SMOLLM2, median_range, peer_arguments, peer_env, pyplot, read_jsonl, require_model,
                    right_padded, run_peer, save_figure, seconds_at, versions, write_results)

GRPO = ESTIMATORS["grpo"]
SYSTEMS = ("ppo-rlhf", "trl", "ppo-rlhf.trl")
NAMES = {"ppo-rlhf": "ppo-rlhf grpo", "trl": "TRL 1.16 GRPOTrainer",
         "ppo-rlhf.trl": "TRL's script through ppo_rlhf.trl"}
DEFAULT_TASK = "chain_sum"  # bench_reasoning.py's task on which GRPO gained most in its 30 minutes
GRPO_ITERATIONS = TRAIN_TASKS[DEFAULT_TASK]["iterations"]["grpo"]  # bench_reasoning.py's ~30 minutes (2 threads)
TASK_SEED = 0  # the problem generator's seed: the same problems (and held-out split) for every run

# The work both systems do per iteration: bench_reasoning.py's GRPO recipe (its COMMON and
# ESTIMATORS["grpo"]), the KL placed as TRL places it (k3, in the loss): batch_size / k prompts
# sampled k times; mini_batch_size sequences per optimizer step, ppo_epochs passes:
# (batch_size / mini_batch_size) x ppo_epochs optimizer steps per generation batch.
SAME_WORK = {"k": GRPO["samples_per_prompt"], "batch_size": COMMON["batch_size"],
             "mini_batch_size": COMMON["mini_batch_size"], "ppo_epochs": COMMON["ppo_epochs"],
             "max_new_tokens": COMMON["max_new_tokens"], "temperature": COMMON["temperature"], "lr": COMMON["lr"],
             "beta": COMMON["kl_coef"], "clip_ratio": 0.2, "max_grad_norm": 1.0,
             "format_reward": COMMON["format_reward"], "exact_reward": COMMON["task_reward"] == "exact",
             "max_length": COMMON["max_length"],
             # ppo-rlhf's LoRA defaults (models/lora.py LoraOptions)
             "lora": {"r": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": "all-linear"}}

NOT_MATCHED = [
    "Sampling streams: each system samples with its own generator (ppo-rlhf's TorchGenerator loop, TRL's "
    "`model.generate`), so the responses differ from the first iteration on; the prompts, their order and the "
    "distribution sampled from are the same.",
    "Group std: TRL divides by (std + 1e-4), ppo-rlhf by (std + 1e-6) and sets a group of equal scores to exactly 0 "
    "(TRL gets 0 there too, as the numerator is 0).",
    "LoRA initialisation: both use peft's default (A Kaiming-uniform, B = 0, so both start at the base model), but "
    "the A matrices are drawn from each process's own seeded stream, not the same numbers.",
    "Minibatch order: both shuffle the generation batch before splitting it into optimizer steps, each with its "
    "own generator.",
    "Prompt length: ppo-rlhf cuts prompts to max_length - max_new_tokens (192) tokens from the left; TRL 1.16 does "
    "not cut prompts. The task's prompts are far shorter, so neither cuts.",
    "Old log-probs: with one optimizer step per generation batch both read them off the update's own forward "
    "pass (exact there) and run no pass of their own before it.",
    "TRL's script through ppo_rlhf.trl runs ppo-rlhf's trainer with the settings the script's GRPOConfig maps to "
    "(docs/migrating_from_trl.md; its plan, in the run's log.txt, lists where they differ from TRL's): the same "
    "work as ppo-rlhf's own run but for its model loaded as the script loads it (float32, the LoRA adapter made by "
    "ppo_rlhf.trl from the script's LoraConfig) and its prompts read in order from the file "
    "(shuffle_dataset=False) rather than drawn again from the seed.",
]


def ppo_rlhf_values(task: dict, work: dict, model: str, seed: int, iterations: int, threads: int, out: Path) -> dict:
    lora = work["lora"]
    return {"model": model, "lora": True, "lora_r": lora["r"], "lora_alpha": lora["alpha"],
            "lora_dropout": lora["dropout"], "lora_target_modules": lora["target_modules"],
            "task": f"reasoning-gym:{task['name']}", "task_config": task["config"], "task_size": task["size"],
            "task_eval_size": task["eval_size"], "task_seed": task["seed"], "format_reward": task["format_reward"],
            "task_reward": "exact" if task.get("exact") else "score", "estimator": "grpo",
            "samples_per_prompt": work["k"], "batch_size": work["batch_size"],
            "mini_batch_size": work["mini_batch_size"], "ppo_epochs": work["ppo_epochs"],
            "max_new_tokens": work["max_new_tokens"], "max_length": work["max_length"],
            "temperature": work["temperature"], "lr": work["lr"], "max_grad_norm": work["max_grad_norm"],
            "clip_ratio": work["clip_ratio"], "kl_in": "loss", "kl_estimator": "k3", "kl_coef": work["beta"],
            "loss_aggregation": "sequence-mean", "whiten_advantages": False, "max_approx_kl": None,
            "seed": seed, "iterations": iterations, "num_threads": threads, "out": str(out / "ppo"),
            "overwrite": True, "eval_every": 0, "eval_sampled": False, "save_every": 0, "sample_every": 0}


# ---------------------------------------------------------------- the task and its prompts
def make_task(task: dict):
    from ppo_rlhf.tasks.reasoning_gym import make_task as make_reasoning_gym, parse_task_config

    return make_reasoning_gym(task["name"], task["size"], task["eval_size"], task["seed"],
                              parse_task_config(task["config"]), task["format_reward"], task.get("exact", False))


def write_prompt_files(task_settings: dict, work: dict, model: str, seeds: list[int], iterations: int,
                       folder: Path) -> dict[int, Path]:
    """Per seed, the prompts ppo-rlhf draws (one row per prompt, in draw order): the chat-templated
    string TRL tokenises, the ids ppo-rlhf's rollout encodes, and the task index the reward reads."""
    from types import SimpleNamespace

    from ppo_rlhf.models import load_tokenizer
    from ppo_rlhf.rollout.responses import apply_chat_template
    from ppo_rlhf.trainers.ppo_setup import draw_batch

    task, tokenizer = make_task(task_settings), load_tokenizer(model)
    rows = task.prompt_rows()
    draw = SimpleNamespace(samples_per_prompt=work["k"], batch_size=work["batch_size"])
    files = {}
    folder.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        rng = torch.Generator().manual_seed(seed)  # as PPOTrainer.train and ppo_rlhf_grpo_run.py draw
        drawn = [row for _ in range(iterations) for row in draw_batch(rows, draw, rng)[:: work["k"]]]
        texts = apply_chat_template(tokenizer, [row["prompt"] for row in drawn])
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]  # as ppo-rlhf's rollout encodes them
        files[seed] = folder / f"prompts_seed{seed}.jsonl"
        with open(files[seed], "w") as f:
            for row, text, row_ids in zip(drawn, texts, ids):
                f.write(json.dumps({"prompt": text, "prompt_ids": row_ids, "task_index": row["task_index"],
                                    "answer": row["answer"]}) + "\n")
    return files


# ---------------------------------------------------------------- the loading check
def logits_check(task_settings: dict, work: dict, model_dir: str, trl_python: str, work_dir: Path,
                 n_prompts: int = 8) -> dict:
    from ppo_rlhf.models import load_causal_lm, load_tokenizer
    from ppo_rlhf.rollout.generation import TorchGenerator
    from ppo_rlhf.rollout.responses import apply_chat_template, generate_responses
    from ppo_rlhf.rollout.sequences import position_ids_from_mask, stop_token_ids

    task, tokenizer = make_task(task_settings), load_tokenizer(model_dir)
    policy = load_causal_lm(model_dir).eval()
    rows = task.prompt_rows()[:n_prompts]
    texts = apply_chat_template(tokenizer, [row["prompt"] for row in rows])
    our_prompt_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    generator = TorchGenerator(stop_token_ids(tokenizer, policy), tokenizer.pad_token_id, work["max_new_tokens"],
                               do_sample=True, seed=0)
    out = generate_responses(policy, tokenizer, generator, [row["prompt"] for row in rows],
                             work["max_length"] - work["max_new_tokens"], chat_template=True)
    input_ids, mask = right_padded(out, tokenizer.pad_token_id)
    task_index = [row["task_index"] for row in rows]
    our_rewards = task.rule_reward(texts, out.texts, task_index)
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"input_ids": input_ids, "attention_mask": mask, "prompts": texts, "responses": out.texts,
                "task_index": task_index}, work_dir / "check_inputs.pt")
    settings = {"model": model_dir, "inputs": str(work_dir / "check_inputs.pt"), "out": str(work_dir / "check_trl.pt"),
                "task": task_settings}
    (work_dir / "check.json").write_text(json.dumps(settings, indent=2) + "\n")
    subprocess.run([trl_python, str(HERE / "peers" / "trl_grpo.py"), "check", "--settings", str(work_dir / "check.json")],
                   check=True, env=peer_env(ppo_rlhf=False, threads=1))
    theirs = torch.load(work_dir / "check_trl.pt")
    with torch.no_grad():
        ours = policy(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    attended = mask.bool()
    diff = (ours[attended] - theirs["logits"][attended]).abs().max().item()
    ids_equal = theirs["prompt_ids"] == our_prompt_ids
    rewards_equal = list(theirs["rewards"]) == list(our_rewards)
    tolerance = 1e-4
    result = {"sequences": len(input_ids), "positions": int(attended.sum()), "logits_max_abs_diff": diff,
              "logits_bitwise_equal": bool(torch.equal(ours[attended], theirs["logits"][attended])),
              "prompt_ids_equal": ids_equal, "rewards_equal": rewards_equal, "rewards": our_rewards,
              "tolerance": tolerance, "passed": diff <= tolerance and ids_equal and rewards_equal,
              "trl_side": theirs["versions"],
              "ppo_rlhf_side": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                                "peft": __import__("peft").__version__}}
    print(f"loading check: logits max |diff| {diff:.2e}, prompt ids {'equal' if ids_equal else 'DIFFER'}, rewards "
          f"{'equal' if rewards_equal else 'DIFFER'} -> {'passed' if result['passed'] else 'FAILED'}", flush=True)
    return result


# ---------------------------------------------------------------- the evaluator
class Judge:
    """ppo-rlhf's Evaluator with the task's metric, greedy, on the first eval_size held-out problems;
    the same object judges every adapter of every run.  Iteration 0 (LoRA's B = 0: the base model,
    the same for every run) is judged once."""

    def __init__(self, task_settings: dict, work: dict, model_dir: str, eval_size: int):
        from ppo_rlhf.evaluation import Evaluator
        from ppo_rlhf.models import load_tokenizer

        task = make_task(task_settings)
        self.evaluator = Evaluator(load_tokenizer(model_dir), task.eval_rows()[:eval_size], task.metric,
                                   max_prompt_length=work["max_length"] - work["max_new_tokens"],
                                   max_new_tokens=work["max_new_tokens"], chat_template=True)
        self.base = None

    def __call__(self, run_dir: Path) -> list[dict]:
        from ppo_rlhf.models import load_causal_lm

        points = []
        for folder in sorted((run_dir / "policies").iterdir()):
            iteration = int(folder.name)
            if iteration == 0 and self.base is not None:
                points.append({"iteration": 0, **self.base})
                continue
            metrics, _ = self.evaluator(load_causal_lm(folder).eval())
            metrics = {k: v for k, v in metrics.items() if not k.endswith("seconds")}
            if iteration == 0:
                self.base = metrics
            points.append({"iteration": iteration, **metrics})
        return points


# ---------------------------------------------------------------- running
def runs_of_other_seeds(state_file: Path, plan: dict, seeds: list[int]) -> list[str]:
    """The finished runs of an earlier invocation into the same folder, for seeds not run again now,
    where it ran the same plan (task, work, iterations, evaluations): a seed per sitting adds up to
    the full benchmark (one seed takes ~1.5 h here).  A different plan starts the report afresh."""
    if not state_file.is_file():
        return []
    earlier = json.loads(state_file.read_text())
    if any(earlier.get(key) != value for key, value in plan.items()):
        print(f"{state_file}: an earlier run of another plan; its runs are left out of this report", flush=True)
        return []
    kept = [d for d in earlier["order"] if (Path(d) / "evaluations.json").is_file()
            and json.loads((Path(d) / "result.json").read_text())["seed"] not in seeds]
    if kept:
        print(f"kept from the earlier invocation: {', '.join(Path(d).name for d in kept)}", flush=True)
    return kept


def recorded_runs(results_file: Path, plan: dict, seeds: set[int]) -> list[dict]:
    """The figures of runs recorded in results/peers_grpo.json by an earlier invocation of the same
    plan, for the seeds not in ``seeds`` (run now, or kept from run folders): a fresh clone has the
    record but not the run folders, and a seed run later joins the recorded ones."""
    if not results_file.is_file():
        return []
    earlier = json.loads(results_file.read_text())
    same_plan = (all(earlier.get(key) == plan[key] for key in ("task", "work", "iterations", "eval_every", "eval_size"))
                 and all(r.get("threads") == plan["threads"] for r in earlier["runs"]))
    if not same_plan:
        print(f"{results_file}: recorded with another plan; its runs are left out of this report", flush=True)
        return []
    recorded = [r for r in earlier["runs"] if r["seed"] not in seeds]
    if recorded:
        print("kept from the record: " + ", ".join(f"{r['system']} seed {r['seed']}" for r in recorded), flush=True)
    return recorded


def run_one(system: str, seed: int, args, task_settings: dict, prompts_file: Path, judge: Judge) -> Path:
    run_dir = Path(args.out) / "runs" / f"{system}-seed{seed}"
    settings = {"out": str(run_dir), "save_every": args.eval_every, "seed": seed, "iterations": args.iterations,
                "threads": args.threads, "prompts_file": str(prompts_file)}
    if system == "ppo-rlhf":
        settings["ppo"] = ppo_rlhf_values(task_settings, SAME_WORK, args.model, seed, args.iterations, args.threads,
                                          run_dir)
        command = [sys.executable, str(HERE / "peers" / "ppo_rlhf_grpo_run.py")]
    else:  # TRL's script: under TRL 1.16, or with its import changed to ppo_rlhf.trl under ppo-rlhf's environment
        settings.update({"model": args.model, "prompts": str(prompts_file), "task": task_settings, "work": SAME_WORK})
        command = ([args.trl_python, str(HERE / "peers" / "trl_grpo.py"), "train"] if system == "trl" else
                   [sys.executable, str(HERE / "peers" / "trl_grpo.py"), "train", "--trainer", "ppo_rlhf.trl"])
    process_seconds, evaluations, evaluation_seconds = run_peer(
        run_dir, command, settings, peer_env(system != "trl", args.threads), judge, system=system, seed=seed)
    seconds = [r["time/iteration"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    print(f"  {system} seed {seed}: {statistics.median(seconds):.2f} s/iteration (median), train "
          f"{sum(seconds):.0f} s, process {process_seconds:.0f} s, evaluation {evaluation_seconds:.0f} s; "
          f"greedy accuracy {100 * evaluations[0]['eval/accuracy']:.1f}% -> {100 * evaluations[-1]['eval/accuracy']:.1f}%",
          flush=True)
    return run_dir


# ---------------------------------------------------------------- figures
def run_figures(run_dir: Path) -> dict:
    iterations = read_jsonl(run_dir / "metrics.jsonl")
    evaluations = json.loads((run_dir / "evaluations.json").read_text())
    result = json.loads((run_dir / "result.json").read_text())
    elapsed, at = seconds_at(iterations)
    curve = [{"iteration": p["iteration"], "seconds": at[p["iteration"]], "accuracy": p["eval/accuracy"],
              "task_score": p.get("eval/task_score"), "answer_format": p.get("eval/answer_format")} for p in evaluations]
    same_prompts = None  # every iteration's prompts (task indices, K copies each) those of the prompt file
    settings = json.loads((run_dir / "settings.json").read_text())
    prompts_file = settings.get("prompts_file") or settings.get("prompts")
    if result.get("task_indices") and prompts_file:
        k = settings["work"]["k"] if "work" in settings else settings["ppo"]["samples_per_prompt"]
        expected = [row["task_index"] for row in read_jsonl(Path(prompts_file)) for _ in range(k)]
        got = [i for batch in result["task_indices"] for i in batch]
        same_prompts = got == expected[: len(got)] and len(got) == len(iterations) * len(result["task_indices"][0])
    split = {}
    if "time/generate" in iterations[0]:
        split = {k: statistics.median(r[f"time/{k}"] for r in iterations)
                 for k in ("generate", "score", "forward", "train", "other")}
    return {"system": result["system"], "seed": result["seed"], "iterations": len(iterations),
            "threads": result.get("threads"), "load_average_before": result.get("load_average_before"),
            "load_average_after": result.get("load_average_after"),
            "first_batch_task_indices": result.get("first_batch_task_indices"), "versions": result.get("versions"),
            "same_prompts_as_file": same_prompts,
            "trl_config": result.get("trl_config"), "train_seconds": elapsed,
            "s_per_iteration_median": statistics.median(r["time/iteration"] for r in iterations),
            "s_per_iteration_all": [r["time/iteration"] for r in iterations], "split_median": split,
            "cpu_s_per_iteration_median": (statistics.median(r["cpu/iteration"] for r in iterations)
                                           if "cpu/iteration" in iterations[0] else None),
            "update_steps": statistics.mean(r["update_steps"] for r in iterations),
            "start_accuracy": curve[0]["accuracy"], "final_accuracy": curve[-1]["accuracy"], "curve": curve}


def seconds_to_reach(curve: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation (after iteration 0) at or above ``target``."""
    point = next((p for p in curve if p["iteration"] > 0 and p["accuracy"] >= target), None)
    return None if point is None else point["seconds"]


def targets(runs: list[dict]) -> list[dict]:
    """Per seed: ppo-rlhf's median s/iteration over TRL's, and the training seconds ppo-rlhf took to
    reach TRL's final held-out accuracy, over TRL's total."""
    rows = []
    for seed in sorted({r["seed"] for r in runs}):
        pair = {r["system"]: r for r in runs if r["seed"] == seed}
        if not {"ppo-rlhf", "trl"} <= set(pair):
            continue
        ours, theirs = pair["ppo-rlhf"], pair["trl"]
        reach = seconds_to_reach(ours["curve"], theirs["final_accuracy"])
        rows.append({"seed": seed, "iteration_ratio": ours["s_per_iteration_median"] / theirs["s_per_iteration_median"],
                     "trl_final_accuracy": theirs["final_accuracy"], "trl_seconds": theirs["train_seconds"],
                     "ppo_rlhf_seconds_to_trl_final": reach,
                     "time_ratio": None if reach is None else reach / theirs["train_seconds"],
                     "same_prompts": ours["first_batch_task_indices"] == theirs["first_batch_task_indices"]
                     and ours["same_prompts_as_file"] is not False and theirs["same_prompts_as_file"] is not False})
    return rows


def facade_rows(runs: list[dict]) -> list[dict]:
    """Per seed: TRL's script through ppo_rlhf.trl against ppo-rlhf's own API (the facade should cost
    nothing: ratio ~1) and against TRL running the same script (issue 58, item 3)."""
    rows = []
    for seed in sorted({r["seed"] for r in runs}):
        pair = {r["system"]: r for r in runs if r["seed"] == seed}
        facade = pair.get("ppo-rlhf.trl")
        if facade is None:
            continue
        own, trl = pair.get("ppo-rlhf"), pair.get("trl")
        rows.append({"seed": seed, "s_per_iteration": facade["s_per_iteration_median"],
                     "over_own_api": own and facade["s_per_iteration_median"] / own["s_per_iteration_median"],
                     "over_trl": trl and facade["s_per_iteration_median"] / trl["s_per_iteration_median"],
                     "final_accuracy": facade["final_accuracy"],
                     "own_api_final_accuracy": own and own["final_accuracy"],
                     "trl_final_accuracy": trl and trl["final_accuracy"],
                     "same_prompts_as_file": facade["same_prompts_as_file"]})
    return rows


def threads_text(runs: list[dict]) -> str:
    """The torch threads the runs used, for the report's prose ("2 torch threads")."""
    counts = sorted({r["threads"] for r in runs if r.get("threads")})
    if not counts:
        return "? torch threads"
    return " or ".join(map(str, counts)) + (" torch thread" if counts == [1] else " torch threads")


def report(results: dict) -> str:
    runs, task, work = results["runs"], results["task"], results["work"]
    steps = work["batch_size"] // work["mini_batch_size"] * work["ppo_epochs"]
    lines = ["# Peer benchmark: ppo-rlhf's GRPO and TRL 1.16's GRPOTrainer on a reasoning-gym task", "",
             f"Command: `{results['command']}`  ", f"Machine: {results['machine']}  ", f"Load: {results['load_note']}  ",
             *[f"Note: {note}  " for note in results.get("notes", [])],
             "", f"SmolLM2-135M-Instruct with LoRA, reasoning-gym `{task['name']}` (`{task['config'] or 'defaults'}`; "
                 f"{task['why']}), {results['iterations']} iterations per run, seeds {', '.join(map(str, results['seeds']))}; "
                 f"{threads_text(runs)} per run, one run at a time. Each iteration: "
                 f"{work['batch_size'] // work['k']} prompts x K={work['k']} samples ({work['batch_size']} sequences, "
                 f"at most {work['max_new_tokens']} new tokens, T={work['temperature']:g}), "
                 + ("1 for a right answer, else 0 (`--task-reward exact`; the task's own checker on the extracted answer)"
                    if task.get("exact") else "the task's own checker (`score_answer` on the extracted answer)")
                 + f" + {task['format_reward']:g} for an answer in <answer> tags, "
                 f"group-normalised advantages, {steps} optimizer steps of {work['mini_batch_size']} sequences "
                 f"(lr {work['lr']:g}, clip {work['clip_ratio']:g}, grad-norm clip {work['max_grad_norm']:g}), k3 KL to "
                 f"the base model in the loss at beta {work['beta']:g}, per-token loss averaged over each response then "
                 f"over responses (TRL `loss_type=grpo`, ppo-rlhf `sequence-mean`). LoRA r={work['lora']['r']}, "
                 f"alpha={work['lora']['alpha']:g}, dropout {work['lora']['dropout']:g}, {work['lora']['target_modules']}.",
             "", f"Held-out accuracy: one evaluator (ppo-rlhf's, greedy, {results['eval_size']} held-out problems never "
                 f"trained on, every {results['eval_every']} iterations) for every saved adapter of both systems. "
                 f"Seconds are training seconds: the sum of the timed iterations, evaluation and saving excluded. "
                 f"Figures: median over seeds (range).", "",
             "| system | s/iteration | CPU s/iteration | train s | accuracy before | final accuracy |",
             "|---|---|---|---|---|---|"]
    for system in SYSTEMS:
        mine = [r for r in runs if r["system"] == system]
        if mine:
            lines.append(f"| {NAMES[system]} | {median_range([r['s_per_iteration_median'] for r in mine], digits=3)} | "
                         f"{median_range([r.get('cpu_s_per_iteration_median') for r in mine], digits=3)} | "
                         f"{median_range([r['train_seconds'] for r in mine], digits=0)} | "
                         f"{median_range([r['start_accuracy'] for r in mine], 100, 1, '%')} | "
                         f"{median_range([r['final_accuracy'] for r in mine], 100, 1, '%')} |")
    lines += ["", "CPU s/iteration: the run process's CPU seconds (all its threads) per iteration, median.",
              "", "## The issue's targets", "",
              "1. ppo-rlhf's iteration no slower than TRL's on the same work; 2. TRL's final held-out accuracy "
              "reached by ppo-rlhf in at most half TRL's training time, read at ppo-rlhf's evaluations.", "",
              "| seed | ppo-rlhf / TRL s/iteration | TRL final accuracy | TRL train s | ppo-rlhf s to reach it | "
              "ratio | same prompts (every iteration) |", "|---|---|---|---|---|---|---|"]
    for t in results["targets"]:
        reach = "not reached" if t["ppo_rlhf_seconds_to_trl_final"] is None else f"{t['ppo_rlhf_seconds_to_trl_final']:.0f}"
        ratio = "—" if t["time_ratio"] is None else f"{t['time_ratio']:.2f}"
        lines.append(f"| {t['seed']} | {t['iteration_ratio']:.3f} | {100 * t['trl_final_accuracy']:.1f}% | "
                     f"{t['trl_seconds']:.0f} | {reach} | {ratio} | {'yes' if t['same_prompts'] else 'NO'} |")
    if results["targets"]:
        ratios = [t["iteration_ratio"] for t in results["targets"]]
        reached = [t["time_ratio"] for t in results["targets"] if t["time_ratio"] is not None]
        lines += ["", f"Target 1 (iteration <= TRL's): **{'met' if max(ratios) <= 1 else 'not met'}** (ratios "
                      f"{', '.join(f'{r:.3f}' for r in ratios)}). Target 2 (TRL's final accuracy in <= half its time): "
                      f"**{'met' if len(reached) == len(ratios) and max(reached) <= 0.5 else 'not met'}** "
                      f"({len(reached)}/{len(ratios)} seeds reached TRL's final accuracy"
                      + (f", time ratios {', '.join(f'{r:.2f}' for r in reached)}" if reached else "") + ")."]
    facade = results.get("facade") or []
    if facade:
        def ratio(value):
            return "—" if value is None else f"{value:.3f}"

        def percent(value):
            return "—" if value is None else f"{100 * value:.1f}%"

        lines += ["", "## TRL's script through ppo_rlhf.trl", "",
                  "The TRL run's own script (benchmarks/peers/trl_grpo.py) with its import changed to ppo_rlhf.trl "
                  "and nothing else, under ppo-rlhf's environment. Targets: no slower than ppo-rlhf's own API on the "
                  "same work (the facade costs nothing; ratio about 1), and TRL's 0.55x kept.", "",
                  "| seed | s/iteration | / ppo-rlhf's own API | / TRL 1.16 | final accuracy (own API, TRL) | same "
                  "prompts as the file |", "|---|---|---|---|---|---|"]
        for row in facade:
            lines.append(f"| {row['seed']} | {row['s_per_iteration']:.3f} | {ratio(row['over_own_api'])} | "
                         f"{ratio(row['over_trl'])} | {percent(row['final_accuracy'])} "
                         f"({percent(row['own_api_final_accuracy'])}, {percent(row['trl_final_accuracy'])}) | "
                         f"{'yes' if row['same_prompts_as_file'] else 'NO'} |")
    ours = [r for r in runs if r["system"] == "ppo-rlhf" and r["split_median"]]
    if ours:
        lines += ["", "ppo-rlhf's iteration split (median s): " + ", ".join(
            f"{k} {statistics.median(r['split_median'][k] for r in ours):.2f}"
            for k in ("generate", "score", "forward", "train", "other")) + "."]
    check = results.get("logits_check")
    if check:
        lines += ["", "## Loading check", "",
                  f"The base model loaded in each environment (ppo-rlhf: {versions(check['ppo_rlhf_side'])}; TRL side: "
                  f"{versions(check['trl_side'])}) on the same {check['sequences']} "
                  f"sampled prompt + response sequences ({check['positions']} positions): largest logit difference "
                  f"{check['logits_max_abs_diff']:.1e} ({'bitwise equal' if check['logits_bitwise_equal'] else 'not bitwise equal'}); "
                  f"TRL's tokenisation of the prompt strings gives {'the same' if check['prompt_ids_equal'] else 'DIFFERENT'} "
                  f"ids as ppo-rlhf's rollout; TRL's reward function gives {'the same' if check['rewards_equal'] else 'DIFFERENT'} "
                  f"rewards on those responses: **{'passed' if check['passed'] else 'FAILED'}**."]
    lines += ["", "The settings matched (the same model, LoRA, problems, prompts in the same order, reward code and "
              "update): docs/benchmarks.md, \"Against TRL 1.16's GRPOTrainer\".", "",
              "## Settings not matched", ""]
    lines += [f"- {note}" for note in NOT_MATCHED]
    lines += ["", "## Runs (in the order run)", "",
              "| system | seed | s/iteration | train s | accuracy (iteration: %) | load before → after |",
              "|---|---|---|---|---|---|"]
    for r in runs:
        load = (f"{r['load_average_before'][0]:.1f} → {r['load_average_after'][0]:.1f}"
                if r.get("load_average_before") else "")
        curve = ", ".join(f"{p['iteration']}: {100 * p['accuracy']:.1f}" for p in r["curve"])
        lines.append(f"| {NAMES[r['system']]} | {r['seed']} | {r['s_per_iteration_median']:.3f} | "
                     f"{r['train_seconds']:.0f} | {curve} | {load} |")
    lines += ["", "![held-out accuracy against training seconds](peers_grpo.png)", ""]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    colours = {"ppo-rlhf": "tab:blue", "trl": "tab:orange", "ppo-rlhf.trl": "tab:green"}
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labelled = set()
    for r in results["runs"]:
        label = None if r["system"] in labelled else NAMES[r["system"]]
        labelled.add(r["system"])
        axes[0].plot([p["seconds"] for p in r["curve"]], [100 * p["accuracy"] for p in r["curve"]],
                     color=colours[r["system"]], marker=".", label=label, alpha=0.85)
        axes[1].plot(range(1, len(r["s_per_iteration_all"]) + 1), r["s_per_iteration_all"],
                     color=colours[r["system"]], alpha=0.6, linewidth=0.8, label=label)
    axes[0].set_xlabel("training seconds (evaluation excluded)")
    axes[0].set_ylabel(f"greedy accuracy, % of {results['eval_size']} held-out problems")
    axes[1].set_xlabel("iteration")
    axes[1].set_ylabel("seconds per iteration")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle(f"ppo-rlhf grpo and TRL 1.16 GRPOTrainer, {results['task']['name']}, one line per run; "
                    f"{results['machine_short']}", fontsize=10)
    save_figure(figure, path)


# ---------------------------------------------------------------- main
def main() -> None:
    def own(parser) -> None:
        parser.add_argument("--model", default=str(SMOLLM2), help="the model folder (make smollm2)")
        parser.add_argument("--task", default=None, help=f"reasoning-gym task name (default {DEFAULT_TASK}, with "
                                                         f"bench_reasoning.py's generator settings)")
        parser.add_argument("--task-config", default=None, help="the generator's settings, key=value,... (default: "
                                                                "the task's in bench_reasoning.py)")
        parser.add_argument("--task-size", type=int, default=None, help="training problems generated (default: "
                                                                        "bench_reasoning.py's for the task)")

    args, results_dir = peer_arguments(
        __doc__, "runs/peers_grpo", [0, 1], GRPO_ITERATIONS, GRPO_ITERATIONS // 4, 200, os.cpu_count(),
        "torch threads in every run (default: every core; the runs take turns, one at a time)", ".venv-trl116",
        "make trl116-venv builds .venv-trl116 (torch==2.13.0, then trl==1.16.0, peft and reasoning-gym)", (4, 2, 8),
        "validation: 1 seed, 4 iterations, 8 held-out problems; runs and results in OUT-quick", own)
    args.model = str(Path(args.model).resolve())
    out = Path(args.out)
    torch.set_num_threads(args.threads)
    require_model(args.model)
    state_file = out / "bench_state.json"
    if args.report_only:
        state = json.loads(state_file.read_text())
    else:
        name = args.task or DEFAULT_TASK
        recipe = TRAIN_TASKS.get(name, {"task_config": "", "task_size": 10000})
        why = ("bench_reasoning.py's settings for it" if name in TRAIN_TASKS else "given by --task")
        config = recipe["task_config"] if args.task_config is None else args.task_config
        task_settings = {"name": name, "config": config, "why": why,
                         "size": args.task_size or recipe["task_size"], "eval_size": args.eval_size, "seed": TASK_SEED,
                         "format_reward": SAME_WORK["format_reward"], "exact": SAME_WORK["exact_reward"]}
        start = time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        print(f"task {name} ({config or 'defaults'}): {why}", flush=True)
        files = write_prompt_files(task_settings, SAME_WORK, args.model, args.seeds, args.iterations, out / "prompts")
        same_plan = {"task": task_settings, "work": SAME_WORK, "iterations": args.iterations, "threads": args.threads,
                     "eval_every": args.eval_every, "eval_size": args.eval_size}
        kept = runs_of_other_seeds(state_file, same_plan, args.seeds)
        kept_seeds = {json.loads((Path(d) / "result.json").read_text())["seed"] for d in kept}
        state = {**same_plan, "order": kept,
                 "recorded": recorded_runs(results_dir / "peers_grpo.json", same_plan, set(args.seeds) | kept_seeds),
                 "logits_check": logits_check(task_settings, SAME_WORK, args.model, args.trl_python, out / "check")}
        state_file.write_text(json.dumps(state, indent=2) + "\n")
        judge = Judge(task_settings, SAME_WORK, args.model, args.eval_size)
        for seed in args.seeds:
            order = SYSTEMS if seed % 2 == 0 else SYSTEMS[::-1]  # alternated: each system runs first and second
            print(f"seed {seed}: {' -> '.join(order)}", flush=True)
            for system in order:
                state["order"].append(str(run_one(system, seed, args, task_settings, files[seed], judge)))
                state_file.write_text(json.dumps(state, indent=2) + "\n")
        state["wall_seconds"] = time.perf_counter() - start
        state_file.write_text(json.dumps(state, indent=2) + "\n")

    runs = state.get("recorded", []) + [run_figures(Path(d)) for d in state["order"]]  # in the order run
    loads = [r["load_average_before"][0] for r in runs if r.get("load_average_before")]
    threads = sorted({r["threads"] for r in runs if r.get("threads")})
    results = {
        "command": "python benchmarks/bench_peers_grpo.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads per run: "
                   f"{threads}",
        "machine_short": f"{platform.machine()}, {os.cpu_count()} cores, {'/'.join(map(str, threads))} thread(s)",
        "load_note": (f"1-minute load average before each run {min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} "
                      f"cores (the previous run's own threads included)" if loads else "unknown"),
        "task": state["task"], "work": SAME_WORK, "seeds": sorted({r["seed"] for r in runs}),
        "iterations": max((r["iterations"] for r in runs), default=0), "eval_every": state["eval_every"],
        "eval_size": state["eval_size"], "wall_seconds": state.get("wall_seconds"),
        "logits_check": state.get("logits_check"), "targets": targets(runs), "facade": facade_rows(runs),
        "runs": runs, "notes": args.note,
    }
    write_results("peers_grpo", results, report(results), results_dir)
    plot(results, results_dir / "peers_grpo.png")


if __name__ == "__main__":
    main()
