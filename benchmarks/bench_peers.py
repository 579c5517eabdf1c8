"""Peer benchmark: ppo-rlhf against TRL 0.11.4's PPOTrainer on the built-in task, same machine,
same checkpoints, same prompts, one evaluator (evaluate_policies below), after a logits check of
both loadings.  Writes benchmarks/results/peers.{json,md,png}.

    make bench-peers                                  # builds .venv-trl, then runs this
    python benchmarks/bench_peers.py                  # 3 seeds x 4 rows x 160 iterations
    python benchmarks/bench_peers.py --quick          # validation: 1 seed, 20 iterations, 200 prompts
    python benchmarks/bench_peers.py --report-only    # redo the tables and plot from the run folders

Each run a fresh process (benchmarks/peers/ppo_rlhf_run.py; benchmarks/peers/trl_ppo.py under
.venv-trl), the order rotated from seed to seed; the method: docs/benchmarks.md, "Against TRL's
PPOTrainer (0.11.4)".
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

from common import (HERE, median_range, peer_arguments, peer_env, pyplot, read_jsonl, right_padded, run_peer,
                    save_figure, seconds_at, versions, write_results)

PIPELINE_SEED = 0  # the SFT / reward-model pipeline, and the task's prompt split, of every run
EVAL_SAMPLING_SEED = 0  # one sampling stream for every sampled evaluation

# The settings both systems have, at the ppo-rlhf preset's values (stages/demo.py PPO_PRESET):
# what "the same work" runs.  Neither system's early stop is kept (their rules differ: ppo-rlhf
# stops a minibatch step on approx_kl, TRL an epoch on the mean log-ratio), so both take exactly
# ppo_epochs x batch / mini-batch optimizer steps per iteration.
SAME_WORK = {"batch_size": 64, "mini_batch_size": 32, "ppo_epochs": 4, "lr": 3e-4, "kl_coef": 0.3, "gamma": 1.0,
             "lam": 0.95, "clip_ratio": 0.2, "vf_coef": 1.0, "score_norm": True, "max_grad_norm": 1.0,
             "cliprange_value": None}

ROWS = {
    "ppo-rlhf-same": {
        "system": "ppo-rlhf", "name": "ppo-rlhf, same work as TRL",
        "work": "64 sequences; 4 epochs x 2 minibatches of 32 = 8 optimizer steps; value head on the actor "
                "(shared); lr 3e-4; fixed KL 0.3 (k1 in the reward); score normalisation; value loss unclipped, "
                "vf_coef 1; grad-norm clip 1; no early stop, no entropy term",
    },
    "trl-same": {
        "system": "trl", "name": "TRL 0.11.4, same settings",
        "work": "the same as the row above, in TRL's PPOTrainer (AutoModelForCausalLMWithValueHead); dropout off "
                "as ppo-rlhf trains; cliprange_value 1e9 (no value clip); scores normalised by the benchmark "
                "before step(), as TRL's use_score_scaling fails in 0.11.4",
    },
    "trl-example": {
        "system": "trl", "name": "TRL 0.11.4, its example's defaults",
        "work": "128 sequences; 4 epochs x 1 minibatch of 128 = 4 optimizer steps; shared value head (dropout 0.1); "
                "lr 1.41e-5; adaptive KL (init 0.2, target 6); vf_coef 0.1, value clip 0.2; no score "
                "normalisation, no grad clip; model dropout as in the checkpoint (0.1)",
    },
    "ppo-rlhf-preset": {
        "system": "ppo-rlhf", "name": "ppo-rlhf demo preset",
        "work": "64 sequences; up to 8 optimizer steps of 32 (stops at approx_kl 0.02); separate critic (a second "
                "4-layer model from the reward model's trunk, its own forward and backward), critic lr 1e-3, "
                "3 critic-only iterations; entropy penalty ramped in linearly to -1.0 over 100 iterations; lr 3e-4; "
                "fixed KL 0.3",
    },
}
ROW_ORDER = list(ROWS)


def ppo_rlhf_settings(row: str, pipeline: Path, seed: int, iterations: int, threads: int) -> dict:
    from ppo_rlhf.stages.demo import PPO_PRESET

    values = {**PPO_PRESET, "model": str(pipeline / "sft" / "checkpoints" / "sft"),
              "reward_model": str(pipeline / "rm" / "checkpoints" / "reward"), "seed": seed,
              "iterations": iterations, "eval_every": 0, "eval_sampled": False, "save_every": 0, "sample_every": 0,
              "num_threads": threads}
    if row == "ppo-rlhf-same":
        values.update(SAME_WORK)
        values.update({"critic": "shared", "critic_lr": None, "critic_warmup": 0, "entropy_coef": 0.0,
                       "max_approx_kl": None})
    return values


def trl_settings(row: str) -> dict:
    if row == "trl-same":
        return {"dropout_off": True, "score_norm": SAME_WORK["score_norm"], "trl": {
            "learning_rate": SAME_WORK["lr"], "batch_size": SAME_WORK["batch_size"],
            "mini_batch_size": SAME_WORK["mini_batch_size"], "ppo_epochs": SAME_WORK["ppo_epochs"],
            "adap_kl_ctrl": False, "init_kl_coef": SAME_WORK["kl_coef"], "kl_penalty": "kl",
            "gamma": SAME_WORK["gamma"], "lam": SAME_WORK["lam"], "cliprange": SAME_WORK["clip_ratio"],
            "cliprange_value": 1e9, "vf_coef": SAME_WORK["vf_coef"], "max_grad_norm": SAME_WORK["max_grad_norm"], "early_stopping": False}}
    # TRL's examples/scripts/ppo.py (0.11): PPOConfig(learning_rate=1.41e-5, mini_batch_size=128,
    # batch_size=128, gradient_accumulation_steps=1, early_stopping=False, target_kl=6.0,
    # kl_penalty="kl", use_score_scaling=False, use_score_norm=False, score_clip=None), the rest
    # PPOConfig's defaults (adaptive KL 0.2 -> target 6, ppo_epochs 4, vf_coef 0.1, ...).
    return {"dropout_off": False, "score_norm": False, "trl": {
        "learning_rate": 1.41e-5, "batch_size": 128, "mini_batch_size": 128, "gradient_accumulation_steps": 1,
        "early_stopping": False, "target_kl": 6.0, "kl_penalty": "kl", "use_score_scaling": False,
        "use_score_norm": False, "score_clip": None}}


# ---------------------------------------------------------------- checkpoints and the task
def task_of_pipeline():
    from ppo_rlhf.tasks.doubling import make_task

    return make_task(seed=PIPELINE_SEED)


def make_pipeline(folder: Path, threads: int) -> Path:
    """SFT and reward model with `ppo-rlhf demo`'s presets (seed 0), unless already there."""
    sft, reward = folder / "sft" / "checkpoints" / "sft", folder / "rm" / "checkpoints" / "reward"
    if (sft / "config.json").is_file() and (reward / "config.json").is_file():
        print(f"SFT and reward model: {folder} (already there)")
        return folder
    from ppo_rlhf.config import build_config
    from ppo_rlhf.stages.demo import DemoConfig, stage_configs
    from ppo_rlhf.stages.reward import run_reward
    from ppo_rlhf.stages.sft import run_sft

    demo = build_config(DemoConfig, {"out": str(folder), "seed": PIPELINE_SEED, "overwrite": True,
                                     "num_threads": threads})
    sft_config, rm_config, _ = stage_configs(demo)
    print(f"SFT ({sft_config.steps} steps) and reward model ({rm_config.steps} steps) -> {folder}")
    run_sft(sft_config)
    run_reward(rm_config)
    return folder


# ---------------------------------------------------------------- the logits check
def logits_check(pipeline: Path, trl_python: str, work: Path, n_prompts: int = 16) -> dict:
    """TRL's loading (transformers 4.46) against ppo-rlhf's (transformers 5) on the same ids."""
    from ppo_rlhf.models import load_causal_lm, load_sequence_classifier
    from ppo_rlhf.rollout.generation import TorchGenerator
    from ppo_rlhf.rollout.responses import generate_responses
    from ppo_rlhf.rollout.reward import last_token_scores
    from ppo_rlhf.rollout.sequences import position_ids_from_mask, stop_token_ids

    task = task_of_pipeline()
    tokenizer = task.tokenizer
    sft_dir, rm_dir = pipeline / "sft" / "checkpoints" / "sft", pipeline / "rm" / "checkpoints" / "reward"
    policy, reward = load_causal_lm(sft_dir).eval(), load_sequence_classifier(rm_dir).eval()
    prompts = [row["prompt"] for row in task.eval_rows()[:n_prompts]]
    generator = TorchGenerator(stop_token_ids(tokenizer, policy), tokenizer.pad_token_id, task.max_new_tokens,
                               do_sample=True, seed=0)
    out = generate_responses(policy, tokenizer, generator, prompts, task.max_prompt_length)
    input_ids, mask = right_padded(out, tokenizer.pad_token_id)  # as TRL's step() pads them
    texts = [p + r for p, r in zip(prompts, out.texts)]
    work.mkdir(parents=True, exist_ok=True)
    torch.save({"input_ids": input_ids, "attention_mask": mask, "texts": texts}, work / "check_inputs.pt")
    command = [trl_python, str(HERE / "peers" / "trl_ppo.py"), "check", "--sft", str(sft_dir), "--reward",
               str(rm_dir), "--inputs", str(work / "check_inputs.pt"), "--out", str(work / "check_trl.pt")]
    subprocess.run(command, check=True, env=peer_env(ppo_rlhf=False), stderr=subprocess.DEVNULL)
    theirs = torch.load(work / "check_trl.pt")
    with torch.no_grad():
        ours = policy(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        our_scores = last_token_scores(reward, input_ids, mask)
    attended = mask.bool()
    logits_diff = (ours[attended] - theirs["logits"][attended]).abs().max().item()
    reward_diff = (our_scores - theirs["reward_logits"]).abs().max().item()
    ids_equal = theirs["encoded"] == [tokenizer(t)["input_ids"] for t in texts]
    tolerance = 1e-4
    result = {"sequences": len(input_ids), "positions": int(attended.sum()), "policy_logits_max_abs_diff": logits_diff,
              "reward_logits_max_abs_diff": reward_diff, "tokenizer_ids_equal": ids_equal,
              "tolerance": tolerance, "passed": logits_diff <= tolerance and reward_diff <= tolerance and ids_equal,
              "trl_side": theirs["versions"],
              "ppo_rlhf_side": {"torch": torch.__version__, "transformers": __import__("transformers").__version__}}
    print(f"logits check: policy max |diff| {logits_diff:.2e}, reward {reward_diff:.2e}, tokenizer ids "
          f"{'equal' if ids_equal else 'DIFFER'} -> {'passed' if result['passed'] else 'FAILED'}")
    return result


# ---------------------------------------------------------------- the evaluator
def evaluate_policies(run_dir: Path, eval_size: int) -> list[dict]:
    """Judge every policy a run saved (run_dir/policies/NNNNN, NNNNN = iterations done), greedy
    and sampled at T=1, on the task's first ``eval_size`` held-out prompts with its exact-match
    rule.  The one evaluator of both systems: ppo-rlhf's Evaluator, the pipeline's held-out split
    (never seen in SFT, reward model or PPO), one sampling seed for every policy."""
    from ppo_rlhf.evaluation import Evaluator
    from ppo_rlhf.models import load_causal_lm

    task = task_of_pipeline()
    evaluator = Evaluator(task.tokenizer, task.eval_rows()[:eval_size], task.metric,
                          max_prompt_length=task.max_prompt_length, max_new_tokens=task.max_new_tokens)
    points = []
    for folder in sorted((run_dir / "policies").iterdir()):
        model = load_causal_lm(folder).eval()
        greedy, _ = evaluator(model)
        sampled, _ = evaluator(model, do_sample=True, temperature=1.0, seed=EVAL_SAMPLING_SEED, prefix="sampled/")
        points.append({"iteration": int(folder.name), **{k: v for k, v in {**greedy, **sampled}.items()
                                                         if not k.endswith("seconds")}})
    return points


# ---------------------------------------------------------------- running
def run_one(row: str, seed: int, args, pipeline: Path, prompts_file: Path) -> Path:
    run_dir = Path(args.out) / "runs" / f"{row}-seed{seed}"
    settings = {"out": str(run_dir), "save_every": args.eval_every, "seed": seed}
    if ROWS[row]["system"] == "ppo-rlhf":
        settings["ppo"] = ppo_rlhf_settings(row, pipeline, seed, args.iterations, args.threads)
        settings["task_seed"] = PIPELINE_SEED
        command = [sys.executable, str(HERE / "peers" / "ppo_rlhf_run.py")]
    else:
        settings.update(trl_settings(row))
        settings.update({"sft": str(pipeline / "sft" / "checkpoints" / "sft"),
                         "reward": str(pipeline / "rm" / "checkpoints" / "reward"), "prompts": str(prompts_file),
                         "iterations": args.iterations, "max_new_tokens": task_of_pipeline().max_new_tokens,
                         "threads": args.threads})
        command = [args.trl_python, str(HERE / "peers" / "trl_ppo.py"), "train"]
    process_seconds, evaluations, evaluation_seconds = run_peer(
        run_dir, command, settings, peer_env(ROWS[row]["system"] == "ppo-rlhf"),
        lambda folder: evaluate_policies(folder, args.eval_size), row=row, seed=seed)
    print(f"  {row} seed {seed}: {process_seconds:.0f} s process, evaluated in {evaluation_seconds:.0f} s; "
          f"final greedy {100 * evaluations[-1]['eval/exact_match']:.2f}%, sampled "
          f"{100 * evaluations[-1]['sampled/exact_match']:.2f}%", flush=True)
    return run_dir


# ---------------------------------------------------------------- figures
THRESHOLDS = {"s_to_99_greedy": ("eval/exact_match", 0.99), "s_to_99_5_greedy": ("eval/exact_match", 0.995),
              "s_to_99_sampled": ("sampled/exact_match", 0.99)}
SPLIT = ("generate", "score", "forward", "train", "other")


def run_figures(run_dir: Path) -> dict:
    iterations = read_jsonl(run_dir / "metrics.jsonl")
    evaluations = json.loads((run_dir / "evaluations.json").read_text())
    result = json.loads((run_dir / "result.json").read_text())
    elapsed, at = seconds_at(iterations)
    curve = [{"iteration": p["iteration"], "seconds": at[p["iteration"]],
              "greedy": p["eval/exact_match"], "sampled": p["sampled/exact_match"],
              "greedy_value": p.get("eval/value_correct"), "greedy_style": p.get("eval/style_correct")}
             for p in evaluations]
    figures = {"row": result["row"], "seed": result["seed"], "iterations": len(iterations),
               "threads": result.get("threads"), "load_average_before": result.get("load_average_before"),
               "load_average_after": result.get("load_average_after"),
               "first_batch_prompts": result.get("first_batch_prompts"),
               "train_seconds": elapsed, "s_per_iteration_median": statistics.median(r["time/iteration"] for r in iterations),
               "split_median": {k: statistics.median(r[f"time/{k}"] for r in iterations) for k in SPLIT},
               "update_steps_mean": statistics.mean(r["update_steps"] for r in iterations),
               "final_greedy": curve[-1]["greedy"], "final_sampled": curve[-1]["sampled"], "curve": curve}
    for name, (key, threshold) in THRESHOLDS.items():
        point = next((p for p in evaluations if p[key] >= threshold), None)
        figures[name] = None if point is None else at[point["iteration"]]
        figures[name.replace("s_to", "iteration_to")] = None if point is None else point["iteration"]
    return figures


def loading_check(check: dict) -> str:
    """The report's paragraph on the loading check."""
    same_ids = "the same" if check["tokenizer_ids_equal"] else "DIFFERENT"
    return (f"TRL ({versions(check['trl_side'])}) loads the transformers-{check['ppo_rlhf_side']['transformers']} "
            f"folders ppo-rlhf wrote: on {check['sequences']} sampled prompt + response sequences "
            f"({check['positions']} positions), the largest policy-logit difference is "
            f"{check['policy_logits_max_abs_diff']:.1e} and the largest reward-logit difference "
            f"{check['reward_logits_max_abs_diff']:.1e} (tolerance {check['tolerance']:g}); the two tokenizers give "
            f"{same_ids} ids: **{'passed' if check['passed'] else 'FAILED'}**. config.json and model.safetensors "
            "load as they are; the tokenizer is built from tokenizer.json, because tokenizer_config.json names a "
            "transformers-5 class (`TokenizersBackend`).")


def report(results: dict) -> str:
    n_seeds = len(results["seeds"])
    rows = {row: mine for row in ROW_ORDER if (mine := [r for r in results["runs"] if r["row"] == row])}
    lines = ["# Peer benchmark: ppo-rlhf and TRL 0.11.4 on the built-in task", "",
             f"Command: `{results['command']}`  ",
             f"Machine: {results['machine']}  ",
             f"Load: {results['load_note']}", "",
             f"{results['iterations']} PPO iterations per run, seeds {', '.join(map(str, results['seeds']))}, "
             f"every row from the same SFT and reward-model checkpoints (`ppo-rlhf demo` presets, seed "
             f"{PIPELINE_SEED}), the same training prompts (drawn the same way for the same seed and batch size) and "
             f"one evaluator: ppo-rlhf's, on {results['eval_size']} held-out prompts, greedy and sampled (T=1), "
             f"every {results['eval_every']} iterations. Seconds are training seconds: the sum of the timed "
             f"iterations (rollout, scoring, old/reference passes, update), evaluation and saving excluded. "
             f"Each figure is the median over seeds with the range in parentheses; a time to a threshold is "
             f"the median of the seeds that reached it (\"k/{n_seeds}\" says how many did), read at the "
             f"evaluation points.", "",
             "| row | optimizer steps / iteration | s/iteration | generate / score / forward / train / other (s) "
             "| s to 99% greedy | s to 99.5% greedy | s to 99% sampled | final greedy | final sampled |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row, mine in rows.items():  # median (range) over seeds; a time to a threshold over the seeds reaching it
        split = " / ".join(f"{statistics.median(r['split_median'][k] for r in mine):.3f}" for k in SPLIT)
        cells = []
        for name in THRESHOLDS:
            reached = [r[name] for r in mine if r[name] is not None]
            cells.append(f"{median_range(reached, digits=1)} [{len(reached)}/{len(mine)}]" if reached else
                         f"not reached [0/{len(mine)}]")
        lines.append(f"| {ROWS[row]['name']} | {median_range([r['update_steps_mean'] for r in mine], digits=1)} "
                     f"| {median_range([r['s_per_iteration_median'] for r in mine], digits=3)} | {split} | "
                     + " | ".join(cells) + f" | {median_range([r['final_greedy'] for r in mine], 100, 2, '%')} "
                     f"| {median_range([r['final_sampled'] for r in mine], 100, 2, '%')} |")
    lines += ["", "What each row does per iteration:", ""]
    lines += [f"- **{ROWS[row]['name']}**: {ROWS[row]['work']}." for row in rows]
    lines += ["", "How each system is run, and what \"same settings\" sets in TRL: docs/benchmarks.md, \"Against "
              "TRL's PPOTrainer (0.11.4)\"."]
    if results.get("logits_check"):
        lines += ["", "## Loading check", "", loading_check(results["logits_check"])]
    same = results.get("same_prompts")
    if same:
        lines += ["", f"Same prompts: the first batch of ppo-rlhf's same-work run and of TRL's same-settings run "
                      f"are {'identical' if all(same.values()) else 'NOT identical'} for every seed "
                      f"({', '.join(f'seed {k}: {v}' for k, v in same.items())})."]
    lines += ["", "## Runs", "", "| row | seed | s/iteration | train s | 99% greedy it (s) | 99% sampled it (s) | "
              "final greedy / sampled | load before → after |", "|---|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        def at(name):
            it = r[name.replace("s_to", "iteration_to")]
            return "—" if it is None else f"{it} ({r[name]:.1f})"

        load = f"{r['load_average_before'][0]:.1f} → {r['load_average_after'][0]:.1f}" if r.get("load_average_before") else ""
        lines.append(f"| {ROWS[r['row']]['name']} | {r['seed']} | {r['s_per_iteration_median']:.3f} | "
                     f"{r['train_seconds']:.1f} | {at('s_to_99_greedy')} | {at('s_to_99_sampled')} | "
                     f"{100 * r['final_greedy']:.2f}% / {100 * r['final_sampled']:.2f}% | {load} |")
    lines += ["", "![accuracy against training seconds](peers.png)", ""]
    lines += results.get("notes", [])
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    colours = {"ppo-rlhf-same": "tab:blue", "trl-same": "tab:orange", "trl-example": "tab:red",
               "ppo-rlhf-preset": "tab:green"}
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    for ax, key, title in ((axes[0], "greedy", "greedy exact-match"), (axes[1], "sampled", "sampled (T=1) exact-match")):
        labelled = set()
        for r in results["runs"]:
            xs = [p["seconds"] for p in r["curve"]]
            ys = [100 * p[key] for p in r["curve"]]
            label = None if r["row"] in labelled else ROWS[r["row"]]["name"]
            labelled.add(r["row"])
            ax.plot(xs, ys, color=colours[r["row"]], alpha=0.8, linewidth=1.4, label=label, marker=".", markersize=4)
        ax.axhline(99, color="grey", linewidth=0.6, linestyle="--")
        ax.set_title(title)
        ax.set_xlabel("training seconds (evaluation excluded)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"% of {results['eval_size']} held-out prompts")
    axes[0].legend(loc="lower right", fontsize=8)
    figure.suptitle(f"ppo-rlhf and TRL 0.11.4, one line per run (seeds {', '.join(map(str, results['seeds']))}); "
                    f"{results['machine_short']}", fontsize=10)
    save_figure(figure, path)


# ---------------------------------------------------------------- main
def main() -> None:
    def own(parser) -> None:
        parser.add_argument("--pipeline", default=None, help="a demo run folder holding sft/ and rm/ to start from "
                                                             "(default: OUT/pipeline, made once)")
        parser.add_argument("--rows", nargs="+", default=ROW_ORDER, choices=ROW_ORDER)

    args, results_dir = peer_arguments(
        __doc__, "runs/peers", [0, 1, 2], 160, 10, 2000, 0,
        "torch threads in every run (0: torch's default, one per core); 1 when other jobs run", ".venv-trl",
        "`make bench-peers` builds .venv-trl (torch==2.13.0, then trl==0.11.4 and its pins)", (20, 10, 200),
        "validation: 1 seed, 20 iterations, 200 prompts; runs and results (peers.md/json/png) in OUT-quick", own)
    out = Path(args.out)
    if args.threads:
        torch.set_num_threads(args.threads)
    pipeline = Path(args.pipeline) if args.pipeline else out / "pipeline"
    state_file = out / "bench_state.json"
    if args.report_only:
        state = json.loads(state_file.read_text())
    else:
        start = time.perf_counter()
        make_pipeline(pipeline, args.threads)
        task = task_of_pipeline()
        prompts_file = out / "train_prompts.jsonl"
        from ppo_rlhf.tasks.doubling import write_jsonl

        write_jsonl(task.prompt_rows(), prompts_file)  # the rows ppo-rlhf draws from, for TRL
        state = {"logits_check": logits_check(pipeline, args.trl_python, out / "check"), "order": []}
        state_file.write_text(json.dumps(state, indent=2) + "\n")
        for k, seed in enumerate(args.seeds):
            rows = [r for r in ROW_ORDER if r in args.rows]
            rows = rows[k % len(rows):] + rows[: k % len(rows)]  # rotated: each row runs early and late
            print(f"seed {seed}: {' -> '.join(rows)}", flush=True)
            for row in rows:
                run_dir = run_one(row, seed, args, pipeline, prompts_file)
                state["order"].append(str(run_dir))
                state_file.write_text(json.dumps(state, indent=2) + "\n")
        state["wall_seconds"] = time.perf_counter() - start
        state_file.write_text(json.dumps(state, indent=2) + "\n")

    runs = [run_figures(Path(d)) for d in state["order"]]
    same_prompts = {}
    for seed in args.seeds:
        pair = [r for r in runs if r["seed"] == seed and r["row"] in ("ppo-rlhf-same", "trl-same")]
        if len(pair) == 2:
            same_prompts[str(seed)] = pair[0]["first_batch_prompts"] == pair[1]["first_batch_prompts"]
    for r in runs:
        r.pop("first_batch_prompts", None)
    loads = [r["load_average_before"][0] for r in runs if r.get("load_average_before")]
    threads = sorted({r["threads"] for r in runs})
    machine_short = f"{platform.machine()}, {os.cpu_count()} cores, {'/'.join(map(str, threads))} torch thread(s)"
    results = {
        "command": "python benchmarks/bench_peers.py" + (" --quick" if args.quick else ""),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads per run: "
                   f"{threads}; ppo-rlhf: torch {torch.__version__}, transformers "
                   f"{__import__('transformers').__version__}; TRL side: see the loading check",
        "machine_short": machine_short,
        # The 1-minute average before a run still holds the previous run's own threads: only a load
        # above those says that other jobs shared the machine.
        "load_note": (f"1-minute load average before each run {min(loads):.1f}–{max(loads):.1f} on "
                      f"{os.cpu_count()} cores, the previous run's own {max(threads)} thread(s) included"
                      + (" (other jobs were running: a busy, shared machine; compare rows with each other, not with "
                         "figures taken elsewhere)" if max(loads) > max(threads) + 0.5 else " (no other jobs)"))
        if loads else "unknown",
        "seeds": args.seeds, "iterations": args.iterations, "eval_every": args.eval_every, "eval_size": args.eval_size,
        "wall_seconds": state.get("wall_seconds"),
        "logits_check": state.get("logits_check"), "same_prompts": same_prompts,
        "runs": runs, "notes": args.note,
    }
    write_results("peers", results, report(results), results_dir)
    plot(results, results_dir / "peers.png")


if __name__ == "__main__":
    main()
