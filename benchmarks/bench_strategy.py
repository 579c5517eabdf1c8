"""Learning a strategy across turns from a warm-up that does not know it (issue 62): two games of
benchmarks/agents_strategy.py, each a TRL ``environment_factory`` class with one tool, on
SmolLM2-135M-Instruct with LoRA, on the CPU.

    make smollm2                                                # once: the model as a folder
    python benchmarks/bench_strategy.py warm-up number          # the SFT warm-up on random legal play, evaluated
    python benchmarks/bench_strategy.py train number --recipe grpo --seed 0   # warm-up if missing, then PPO
    python benchmarks/bench_strategy.py train keys --recipe ppo --seed 1 --quick  # 2 iterations, to see it run

``number`` (agents_strategy.GuessNumber): a whole number from 1 to 31, 5 guesses answered "higher"
or "lower"; binary search always wins, random legal guesses win 54%.  Scored greedy on every secret
(31 games: the whole game, nothing left to hold out).  ``keys`` (agents_strategy.DoorKeys): six
keys on a ring, 5 tries; trying each key once wins 83%, random tries 60%.  Scored greedy on 64
rings never trained on.  The episode pays 1 (the class's ``get_reward``) when the goal is reached
within the calls allowed, else 0; nothing else is scored.

``train``: the run the issue's target is read from -- the warm-up's greedy success (PPO's
evaluation at iteration 0), then the recipe's (``RECIPES``) every ``--eval-every`` iterations;
success within ``BUDGET_SECONDS`` of training.  The run's metrics.jsonl holds, per iteration, what
the issue asks to measure of the credit: each turn's advantage (turns/*), the groups without a
spread (groups/*), KL and entropy.  Results: benchmarks/results/strategy_{task}_*.{json,md}; runs in
runs/bench_strategy/.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import sys
import time
from pathlib import Path

import torch

import agents_strategy
from common import timed

HERE = Path(__file__).parent
ROOT = HERE.parent
RESULTS = HERE / "results"
MODEL = ROOT / "runs" / "smollm2-135m-instruct"
OUT = ROOT / "runs" / "bench_strategy"
TEMPLATE = ROOT / "src" / "ppo_rlhf" / "envs" / "chatml_tools.jinja"  # SmolLM2's own template has no tools
BUDGET_SECONDS = 30 * 60

TASKS = {
    "number": {"environment": "GuessNumber", "tool": "guess", "max_turns": agents_strategy.NUMBER_GUESSES + 1},
    "keys": {"environment": "DoorKeys", "tool": "try_key", "max_turns": agents_strategy.KEY_TRIES + 1},
}
# A turn is a call (~25 tokens) or the final answer (~15).
EPISODE = ["--chat-template-file", TEMPLATE, "--max-new-tokens", 40, "--max-length", 1024]

# Each training iteration's figures in the results (4 significant digits).
TRAINING_KEYS = ("step", "score", "kl", "entropy", "approx_kl", "clipfrac", "lr", "episode/turns", "tools/calls",
                 "tools/errors")

# The warm-up: the docs' recipe (`sft --recipe agents-warm-up`: 16 steps of 8 conversations at lr
# 1e-4, the whole model) on traces of random legal play (agents_strategy's), as a user would.
WARM_UP = {"traces": 256}

# The recipes (--recipe), LoRA on the warm-up's model, 32 episodes an iteration: the project's own
# (src/ppo_rlhf/recipes.py, as docs/agents.md gives them), and the docs' tool recipe as the issue
# ran it (GRPO, 8 plays of 4 games, one step a batch, lr 1e-4, temperature 0.7, k3 KL 0.05 in the loss).
RECIPES = {
    "grpo": ["--recipe", "agents-grpo"],
    "ppo": ["--recipe", "agents-ppo"],
    "issue-grpo": ["--estimator", "grpo", "--samples-per-prompt", 8, "--batch-size", 32, "--mini-batch-size", 32,
                   "--ppo-epochs", 1, "--kl-in", "loss", "--kl-estimator", "k3", "--kl-coef", 0.05, "--lr", 1e-4,
                   "--temperature", 0.7, "--lora"],
}


def ppo_rlhf(*args, log: Path, threads: int) -> float:
    """One ``ppo-rlhf`` command, its output in ``log``; the seconds it took."""
    return timed([sys.executable, "-m", "ppo_rlhf.cli", *args, "--num-threads", threads], log)


def environment(task: str) -> str:
    return f"{HERE / 'agents_strategy.py'}:{TASKS[task]['environment']}"


def episode_flags(task: str) -> list:
    return ["--environment", environment(task), "--max-turns", TASKS[task]["max_turns"], *EPISODE]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def data(task: str, traces: int) -> dict[str, Path]:
    """The task's training rows, held-out rows and warm-up traces, written to OUT/task/."""
    from ppo_rlhf.envs.tools import tool_schema

    folder = OUT / task
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    if task == "number":
        top = agents_strategy.NUMBER_TOP
        held_out = agents_strategy.number_rows(range(1, top + 1))  # every secret: the whole game
        train = agents_strategy.number_rows(random.Random(2).choices(range(1, top + 1), k=2000))
        schema = tool_schema(agents_strategy.GuessNumber().guess)
        trace = agents_strategy.number_trace
    else:
        held_out = agents_strategy.keys_rows(64, seed=1)
        train = agents_strategy.keys_rows(2000, seed=2, exclude={tuple(row["keys"]) for row in held_out})
        schema = tool_schema(agents_strategy.DoorKeys().try_key)
        trace = agents_strategy.keys_trace
    return {"train": write_jsonl(folder / "train.jsonl", train),
            "held_out": write_jsonl(folder / "held_out.jsonl", held_out),
            "traces": write_jsonl(folder / "traces.jsonl", [trace(row, rng, schema) for row in train[:traces]])}


def warm_up_folder(task: str, args, name: str = "sft") -> Path:
    """OUT/task/NAME, or NAME_WARMUP for a warm-up named by --warm-up (other --sft-flags)."""
    return OUT / task / (name + (f"_{args.warm_up}" if args.warm_up else ""))


def warm_up(task: str, args) -> Path:
    """The SFT warm-up's model (OUT/task/sft, or sft_NAME with --warm-up NAME), trained unless an
    earlier one with the same traces and settings is there."""
    files = data(task, args.traces)
    sft = warm_up_folder(task, args)
    settings = {"traces": files["traces"].read_text(), "extra": args.sft_flags}
    stamp = sft / "warm_up.json"
    if not (stamp.is_file() and json.loads(stamp.read_text()) == settings):
        ppo_rlhf("sft", "--recipe", "agents-warm-up", "--model", MODEL, "--data", files["traces"],
                 "--chat-template-file", TEMPLATE, *args.sft_flags, "--eval-fraction", 0, "--save-every", 0,
                 "--out", sft, "--overwrite", log=sft.with_suffix(".log"), threads=args.threads)
        stamp.write_text(json.dumps(settings))
    return sft / "checkpoints" / "sft"


def evaluate(task: str, model: Path, out: Path, args, sampled: bool = False) -> dict:
    """``ppo-rlhf eval`` of ``model`` on the held-out games: greedy, or sampled at temperature 0.7;
    with each game's faults (agents_strategy.faults) over all of them."""
    files = data(task, args.traces)
    extra = ["--do-sample", "--temperature", 0.7, "--seed", args.seed] if sampled else []
    rows = [json.loads(line) for line in files["held_out"].read_text().splitlines()][:args.eval_size or None]
    seconds = ppo_rlhf("eval", "--model", model, "--prompts", files["held_out"], "--size", len(rows),
                       *episode_flags(task), *extra, "--show", len(rows), "--out", out, "--overwrite",
                       log=out.with_suffix(".log"), threads=args.threads)
    summary = json.loads((out / "summary.json").read_text())
    metrics = summary.get("metrics", summary)
    games = [agents_strategy.faults(row, game["tool_calls"], game["score"] > 0, game["truncated"])
             for row, game in zip(rows, summary["samples"])]
    return {"success": metrics.get("episode/success", summary.get("score")), "seconds": round(seconds, 1),
            **{key: metrics[key] for key in ("episode/turns", "tools/calls", "tools/errors") if key in metrics},
            "faults": rounded(agents_strategy.fault_shares(games))}


def rounded(shares: dict) -> dict:
    return {key: round(value, 3) for key, value in shares.items()}


def rollout_faults(task: str, run: Path) -> list[dict]:
    """Each iteration's training games (the run's rollouts/iteration_N.jsonl): their faults, by
    the training row each game was played on."""
    rows = [json.loads(line) for line in (OUT / task / "train.jsonl").read_text().splitlines()]
    shares = []
    for path in sorted((run / "rollouts").glob("iteration_*.jsonl")):
        games = []
        for line in path.read_text().splitlines():
            game = json.loads(line)
            row = rows[int(game["source"].rsplit(":", 1)[1]) - 1]  # the rollout's source: FILE:LINE
            games.append(agents_strategy.faults(row, game["tool_calls"], game["episode_reward"] > 0,
                                                game["truncated"]))
        shares.append({"iteration": int(path.stem.rsplit("_", 1)[1]), **rounded(agents_strategy.fault_shares(games))})
    return shares


def warm_up_command(args) -> dict:
    model = warm_up(args.task, args)
    result = {"warm_up": {"traces": args.traces, "recipe": "agents-warm-up", "flags": args.sft_flags},
              "greedy": evaluate(args.task, model, warm_up_folder(args.task, args, "eval_sft"), args),
              "sampled_0.7": evaluate(args.task, model, warm_up_folder(args.task, args, "eval_sft_sampled"), args,
                                      sampled=True)}
    print(result, flush=True)
    return result


def run_name(args) -> str:
    """ppo_RECIPE[_WARMUP][_LABEL]_seedN: a run's folder under OUT/task/."""
    return "_".join(part for part in ("ppo", args.recipe, args.warm_up, args.label, f"seed{args.seed}") if part)


def train_command(args) -> dict:
    """The warm-up, then PPO with the recipe; held-out greedy success at iteration 0 (the warm-up)
    and every --eval-every iterations, with the training seconds so far."""
    model = warm_up(args.task, args)
    files = data(args.task, args.traces)
    run = OUT / args.task / run_name(args)
    flags = [str(x) for x in RECIPES[args.recipe]] + [str(x) for x in args.extra]
    if args.report_only:  # the run in its folder, as far as it went (a stopped one included)
        seconds = None
    else:
        seconds = ppo_rlhf("ppo", "--model", model, "--prompts", files["train"], "--eval-prompts", files["held_out"],
                           "--eval-size", args.eval_size or 10_000, *episode_flags(args.task), "--lora", *flags,
                           "--iterations", args.iterations, "--eval-every", args.eval_every, "--no-eval-sampled",
                           "--save-every", 0, "--save-rollouts", 1, "--seed", args.seed, "--out", run, "--overwrite",
                           log=run.with_suffix(".log"), threads=args.threads)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "time/iteration" in m]
    elapsed = {m["step"]: m.get("time/elapsed", 0.0) for m in trained}
    curve = [{"iteration": m["step"], "seconds": round(elapsed.get(m["step"], 0.0), 1),
              "success": m.get("eval/episode/success", m.get("eval/score"))} for m in metrics if "eval/score" in m]
    within = [c for c in curve if c["seconds"] <= BUDGET_SECONDS]
    # The run's peak resident memory: the largest child this process waited for is the ppo run.
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20 if seconds else None
    result = {"recipe": args.recipe, "flags": flags, "run_seconds": seconds and round(seconds, 1), "curve": curve,
              "peak_rss_gib": peak_gib and round(peak_gib, 2),
              "warm_up": curve[0]["success"], "last_within_budget": within[-1], "last": curve[-1],
              "iteration_seconds": round(sum(m["time/iteration"] for m in trained) / max(len(trained), 1), 1),
              "training": [{key: m[key] if key == "step" else float(f"{m[key]:.4g}")
                            for key in TRAINING_KEYS if key in m} for m in trained],
              "faults": rollout_faults(args.task, run)}
    result["gain_points"] = round(100 * (result["last_within_budget"]["success"] - result["warm_up"]), 1)
    print({k: result[k] for k in ("warm_up", "last_within_budget", "gain_points", "iteration_seconds")}, flush=True)
    return result


def result_name(args) -> str:
    name = f"strategy_{args.task}_{args.command.replace('-', '_')}"
    if args.command == "warm-up" and args.warm_up:
        name += f"_{args.warm_up.replace('-', '_')}"
    if args.command != "warm-up":
        name += "_" + run_name(args).removeprefix("ppo_").replace("-", "_")
    if args.quick:
        name += "_quick"
    return name


def report(args, result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    name = result_name(args)
    command = " ".join(sys.argv[1:])
    result = {"command": f"python benchmarks/bench_strategy.py {command}", "date": time.strftime("%Y-%m-%d"),
              "machine": f"{platform.machine()}, {args.threads} torch threads, torch {torch.__version__}", **result}
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Strategy across turns: {args.task} {args.command}", "", f"`{result['command']}` ({result['machine']}, "
             f"{result['date']})", ""]
    if args.command == "warm-up":
        recipe = " ".join(["sft --recipe agents-warm-up", *args.sft_flags])
        lines += [f"Warm-up: {args.traces} traces of random legal play, `{recipe}`.", "",
                  "| held-out play | success | turns | calls | seconds (the eval command) |", "|---|---|---|---|---|"]
        plays = (("greedy", result["greedy"]), ("sampled at 0.7", result["sampled_0.7"]))
        lines += [f"| {k} | {v['success']:.3f} | {v.get('episode/turns', 0):.2f} | {v.get('tools/calls', 0):.2f} | "
                  f"{v['seconds']:.1f} |" for k, v in plays]
        lines += ["", *fault_table("held-out play", [("greedy", result["greedy"]["faults"]),
                                                     ("sampled at 0.7", result["sampled_0.7"]["faults"])])]
    else:
        within = result["last_within_budget"]
        lines += [f"Recipe `{args.recipe}`: `{' '.join(result['flags'])}`, LoRA.", "",
                  "| | held-out greedy success | iteration | training seconds |", "|---|---|---|---|",
                  f"| the warm-up | {result['warm_up']:.3f} | 0 | 0 |",
                  f"| last evaluation within {BUDGET_SECONDS // 60} min | {within['success']:.3f} "
                  f"| {within['iteration']} | {within['seconds']:.0f} |",
                  f"| last evaluation | {result['last']['success']:.3f} | {result['last']['iteration']} | "
                  f"{result['last']['seconds']:.0f} |", "",
                  gain_line(args, result), "", "Training, iteration by iteration: " + "; ".join(
                      f"{m['step']}: success {m.get('score', 0):.2f}, KL {m.get('kl', 0):.3f}, entropy "
                      f"{m.get('entropy', 0):.3f}, approx_kl {m.get('approx_kl', 0):.1e}"
                      + (f", lr {m['lr']:.1e}" if "lr" in m else "") + f", {m.get('tools/calls', 0):.1f} calls"
                      for m in result["training"])]
        if result.get("faults"):
            lines += ["", *fault_table("training iteration", [(str(f["iteration"]), f) for f in result["faults"]])]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def gain_line(args, result: dict) -> str:
    line = (f"Gain within the budget: {result['gain_points']:+.1f} points; {result['iteration_seconds']} s an "
            f"iteration" + (f"; peak RSS {result['peak_rss_gib']} GiB." if result.get("peak_rss_gib") else "."))
    if args.report_only:
        line += (f" Reported from the run's folder as far as it went: {len(result['training'])} of --iterations "
                 f"{args.iterations} trained.")
    return line


def fault_table(what: str, rows: list[tuple[str, dict]]) -> list[str]:
    """Where games were lost (agents_strategy.faults): the rules the warm-up's traces keep (refused
    calls, cut by the turn limit, stopped with moves left) against the strategy (wasted moves)."""
    columns = ("won", "lost: cut", "lost: stopped", "lost: played out", "refused", "wasted", "after_over")
    return ["Where the games were lost (shares of all games; refused, wasted and after-over calls per game):", "",
            f"| {what} | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|",
            *[f"| {name} | " + " | ".join(f"{shares[c]:.2f}" for c in columns) + " |" for name, shares in rows]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("warm-up", "train"))
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--recipe", choices=sorted(RECIPES), default="grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=None, help="PPO iterations (default 14)")
    parser.add_argument("--eval-every", type=int, default=None, help="train: held-out evaluation every N (default 4)")
    parser.add_argument("--eval-size", type=int, default=None, help="held-out games (default: all)")
    parser.add_argument("--traces", type=int, default=WARM_UP["traces"])
    parser.add_argument("--sft-flags", default="", help="sft flags over the warm-up recipe's, as one string")
    parser.add_argument("--warm-up", default="", help="a name for the warm-up these --sft-flags make: its model, "
                                                      "evaluations and runs in folders of its own")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", default="", help="a word added to the result's file name")
    parser.add_argument("--quick", action="store_true", help="2 iterations, 8 held-out games: to see it run")
    parser.add_argument("--report-only", action="store_true",
                        help="train: report the run already in its folder, as far as it went, without training; "
                             "warm-up: its table again from its results")
    args, extra = parser.parse_known_args()
    args.extra = extra  # train: ppo-rlhf flags after the recipe's (a later flag wins)
    args.sft_flags = args.sft_flags.split()
    if not (MODEL / "config.json").is_file():
        raise SystemExit(f"no {MODEL}: run `make smollm2` first")
    if args.iterations is None:
        args.iterations = 2 if args.quick else 14
    if args.eval_every is None:
        args.eval_every = 1 if args.quick else 4
    if args.quick:
        args.eval_size = args.eval_size or 8
    if args.command == "warm-up" and args.report_only:  # the table again from the results' JSON
        recorded = json.loads((RESULTS / f"{result_name(args)}.json").read_text())
        sys.argv = recorded["command"].split()[1:]  # the command that measured it, in the report
        result = {key: recorded[key] for key in ("warm_up", "greedy", "sampled_0.7")}
    else:
        result = {"warm-up": warm_up_command, "train": train_command}[args.command](args)
    report(args, result)


if __name__ == "__main__":
    main()
