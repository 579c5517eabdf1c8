"""What the benchmark scripts share: paths and SmolLM2's folder, the README's commands, a command run
and timed, earlier commits checked out beside this one, the record of a result (JSON and
Markdown), the spread over seeds, PPO runs each in a process of their own and their figures, the
loop that alternates two ways of one trainer's iteration, and the peer benchmarks' plumbing.

A script imports what it needs (``from common import ...``; a script's own folder is first on
sys.path).  Run as a script, it is the child process of ``run_in_child``.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
SMOLLM2 = ROOT / "runs" / "smollm2-135m-instruct"  # `make smollm2` converts it there


# ---------------------------------------------------------------- models, commands and results
def require_model(folder) -> None:
    """Stop, saying how to make it, where ``folder`` holds no model."""
    if not (Path(folder) / "config.json").is_file():
        raise SystemExit(f"{folder} is not a model folder; make it with: make smollm2 "
                         f"(or ppo-rlhf convert-gguf --out {folder})")


def require_python(python: Path, target: str) -> None:
    """Stop, saying how to make it, where a virtual environment's Python is missing."""
    if not Path(python).is_file():
        raise SystemExit(f"no {python}: run `make {target}` first")


def timed(command_line: list, log: Path, env: dict | None = None) -> float:
    """One command, run from the repository's root with its output in ``log``; the seconds it took.
    Stops, naming the command and its log, where it fails."""
    start = time.perf_counter()
    with open(log, "w") as file:
        done = subprocess.run([str(part) for part in command_line], stdout=file, stderr=subprocess.STDOUT, cwd=ROOT,
                              env=env)
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(map(str, command_line))}; see {log}")
    return time.perf_counter() - start


def json_child(arguments: list, env: dict | None = None, **run) -> dict:
    """This Python on ``arguments`` (a script and its own arguments) in a fresh process: the JSON
    object its last line of output holds.  Stops with the process's error output where it fails;
    ``run``: subprocess.run's other arguments (a timeout)."""
    done = subprocess.run([sys.executable, *map(str, arguments)], capture_output=True, text=True, env=env, **run)
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(map(str, arguments))}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def checkouts(commits, folder: Path):
    """Each earlier commit checked out in a git worktree of its own (folder/code-COMMIT), as a dict
    from commit to folder; the worktrees removed on leaving."""
    trees = {}
    try:
        for commit in commits:
            trees[commit] = Path(folder) / f"code-{commit}"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees[commit]), commit],
                           check=True, capture_output=True)
        yield trees
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False,
                           capture_output=True)


def readme_commands(heading: str = "**Real reasoning tasks.**") -> list[list[str]]:
    """The ``ppo-rlhf`` commands of the first bash block after the README's ``heading``."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(heading):], re.S).group(1).replace("\\\n", " ")
    return [shlex.split(line.split("#")[0])[1:] for line in block.splitlines()
            if line.split("#")[0].strip().startswith("ppo-rlhf ")]


def replaced(command_line: list[str], option: str, value: str) -> list[str]:
    """``command_line`` with ``option``'s value set to ``value``."""
    command_line = list(command_line)
    command_line[command_line.index(option) + 1] = value
    return command_line


def command() -> str:
    """The command line that runs this benchmark again, as a report quotes it."""
    return f"python benchmarks/{Path(sys.argv[0]).name} " + " ".join(sys.argv[1:])


def processor() -> str:
    return platform.processor() or platform.machine()


def machine(threads: int | None = None, unit: str = "thread(s)") -> str:
    """The processor, torch's version and its threads (``threads`` 0 or None: torch's own count)."""
    import torch

    return f"{processor()}, torch {torch.__version__}, {threads or torch.get_num_threads()} {unit}"


def record(note: str = "", threads: int | None = None, unit: str = "thread(s)") -> dict:
    """What a result is kept with: the command, the machine, the date and what else ran."""
    return {"command": command(), "machine": machine(threads, unit), "date": time.strftime("%Y-%m-%d"), "note": note}


def header(title: str, results: dict) -> list[str]:
    """A report's first lines: its title, the command, the machine, the date and the note."""
    return [f"# {title}", "", f"Command: `{results['command']}`  ", f"Machine: {results['machine']}  ",
            f"Measured: {results['date']}; {results['note']}", ""]


def write_results(stem: str, results, text, folder: Path = RESULTS, indent: int = 2, echo: bool = True,
                  **dump) -> None:
    """folder/stem.json (``results``) and folder/stem.md (``text``: a string, or lines joined), printed too."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(results, indent=indent, **dump) + "\n")
    text = text if isinstance(text, str) else "\n".join(text) + "\n"
    (folder / f"{stem}.md").write_text(text)
    if echo:
        print(text)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def memory_kib(field: str) -> int:
    """VmRSS (resident now) or VmHWM (its peak since the start or the last ``reset_peak``) of this
    process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak RSS (VmHWM) to the current RSS


def pyplot():
    """matplotlib's pyplot, drawing to files only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot().close(figure)


# ---------------------------------------------------------------- spread over seeds
def spread(values: list[float], scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
    """mean (min-max) over seeds; 'n/a' when a value is missing."""
    if not values or any(v is None for v in values):
        reached = [v for v in values if v is not None]
        return f"{len(reached)}/{len(values)} seeds" + (f" ({min(reached) * scale:.{digits}f}-{max(reached) * scale:.{digits}f}{unit})" if reached else "")
    mean = statistics.mean(values) * scale
    if len(values) == 1:
        return f"{mean:.{digits}f}{unit}"
    return f"{mean:.{digits}f}{unit} ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"


def median_range(values, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    """median (min–max) of the values given, '—' where there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    m = statistics.median(values)
    if min(values) == max(values):
        return f"{scale * m:.{digits}f}{unit}"
    return f"{scale * m:.{digits}f}{unit} ({scale * min(values):.{digits}f}–{scale * max(values):.{digits}f})"


def mean_points(runs: list[dict], key: str) -> list[tuple[float, float]]:
    """The seeds' (x, y) lists under ``key`` averaged point by point (they are taken at the same
    iterations)."""
    curves = [r[key] for r in runs if key in r]
    length = min(len(c) for c in curves)
    return [(statistics.mean(c[i][0] for c in curves), statistics.mean(c[i][1] for c in curves)) for i in range(length)]


def mean_curve(runs: list[dict], key: str) -> list[tuple[float, float]]:
    """The seeds' evaluation curves of metric ``key`` averaged point by point."""
    return mean_points(runs, f"curve:{key}")


# ---------------------------------------------------------------- PPO runs, each in a process of its own
def child(config_path: str) -> None:
    """Run PPO from a JSON config; write its peak resident memory next to its summary."""
    from ppo_rlhf.config import build_config
    from ppo_rlhf.stages.ppo import run_ppo
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    values = json.loads(Path(config_path).read_text())
    run_ppo(build_config(PPOConfig, values))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    (Path(values["out"]) / "peak_memory.json").write_text(json.dumps({"peak_rss_mib": peak_mib}))


def run_in_child(values: dict, log: Path, num_threads: int = 0, report_only: bool = False) -> dict | None:
    """The figures of one PPO run, run in a child process (``report_only``: read from a finished
    run folder, None if there is none)."""
    values = {**values, "num_threads": num_threads}
    out = Path(values["out"])
    if report_only:
        return run_figures(out) if (out / "peak_memory.json").exists() else None
    out.mkdir(parents=True, exist_ok=True)
    config_path = out.parent / f"{out.name}.json"
    config_path.write_text(json.dumps(values))
    with log.open("a") as handle:
        subprocess.run([sys.executable, __file__, "--child", str(config_path)], check=True, stdout=handle,
                       stderr=subprocess.STDOUT)
    return run_figures(out)


def first_reaching(records: list[dict], key: str, threshold: float) -> float | None:
    """PPO seconds (evaluation excluded) at the first evaluation where ``key`` >= threshold."""
    return next((r["time/elapsed"] for r in records if r.get(key, -1.0) >= threshold), None)


def curve(records: list[dict], key: str) -> list[tuple[float, float]]:
    """(PPO seconds, value) at each evaluation; the evaluation before PPO at 0 s."""
    return [(r.get("time/elapsed", 0.0), r[key]) for r in records if key in r]


def run_figures(out: Path) -> dict:
    from ppo_rlhf.runlog import read_metrics

    records = read_metrics(out / "metrics.jsonl")
    iterations = [r for r in records if "time/iteration" in r]
    summary = json.loads((out / "summary.json").read_text())
    figures = {
        "s_per_iteration": statistics.median(r["time/iteration"] for r in iterations),
        "split_s": {k: statistics.median(r[f"time/{k}"] for r in iterations)
                    for k in ("generate", "score", "forward", "train")},
        "ppo_seconds": summary["ppo_seconds"],
        "peak_rss_mib": json.loads((out / "peak_memory.json").read_text())["peak_rss_mib"],
        "kl_last": statistics.mean(r["kl"] for r in iterations[-3:]),
        "before": summary["before"], "after": summary["after"], "after_sampled": summary["after_sampled"],
    }
    for key in ("eval/exact_match", "eval_sampled/exact_match", "eval/score"):
        if any(key in r for r in records):
            figures[f"curve:{key}"] = curve(records, key)
    if any("eval/exact_match" in r for r in records):
        for threshold in (0.95, 0.99):
            figures[f"s_to_{threshold:.0%}_greedy"] = first_reaching(records, "eval/exact_match", threshold)
            figures[f"s_to_{threshold:.0%}_sampled"] = first_reaching(records, "eval_sampled/exact_match", threshold)
    return figures


def train_sft_and_rm(out: Path, seed: int) -> tuple[str, str, dict]:
    """The demo's SFT and reward-model stages (its presets) into ``out``: their checkpoints and seconds."""
    from ppo_rlhf.config import build_config
    from ppo_rlhf.stages.demo import DemoConfig, stage_configs
    from ppo_rlhf.stages.reward import run_reward
    from ppo_rlhf.stages.sft import run_sft

    sft_config, rm_config, _ = stage_configs(build_config(DemoConfig, {"out": str(out), "seed": seed,
                                                                       "overwrite": True}))
    sft_config.overwrite = rm_config.overwrite = True
    sft, rm = run_sft(sft_config), run_reward(rm_config)
    return sft["checkpoints"]["sft"], rm["checkpoints"]["reward"], {"sft_seconds": sft["seconds"],
                                                                  "rm_seconds": rm["seconds"],
                                                                  "rm_eval_accuracy": rm["eval_accuracy"]}


# ---------------------------------------------------------------- one trainer, two ways, alternated
TIMES = ("time/generate", "time/forward", "time/train", "time/iteration")


def ab_arguments(doc: str, rounds: int):
    """The A/B benchmarks' command line (SmolLM2's folder, a reasoning-gym task, the rounds), checked."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/smollm2-135m-instruct")
    parser.add_argument("--task", default="gcd")
    parser.add_argument("--rounds", type=int, default=rounds,
                        help="rounds of one iteration each way (plus one warm-up)")
    parser.add_argument("--note", default="idle machine")
    args = parser.parse_args()
    require_model(args.model)
    return args


def ab_settings(args, **settings) -> dict:
    """The measured settings: GRPO with LoRA on SmolLM2 and a reasoning-gym task, one optimizer epoch,
    k3 KL in the loss; ``settings`` what the benchmark sets beside them."""
    return {"model": args.model, "task": f"reasoning-gym:{args.task}", "task_size": 2000, "task_eval_size": 10,
            "lora": True, "estimator": "grpo", "ppo_epochs": 1, "max_length": 224, "kl_in": "loss", "kl_coef": 0.05,
            "format_reward": 0.1, "overwrite": True, **settings}


def ab_trainer(settings: dict):
    from ppo_rlhf.config import build_config
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    return PPOTrainer(build_config(PPOConfig, settings))


def alternate(trainer, set_way: Callable[[bool], None], prompts_per_batch: int, samples_per_prompt: int,
              rounds: int, label: str) -> dict[bool, list[dict]]:
    """``rounds`` iterations each way (True, False), plus a first round that warms up both;
    the order flips every round.  Returns each way's timings."""
    rows = trainer.run_parts.train_rows
    timings: dict[bool, list[dict]] = {True: [], False: []}
    for round_index in range(rounds + 1):
        for way in ((True, False) if round_index % 2 == 0 else (False, True)):
            set_way(way)
            batch = rows[(trainer.iteration * prompts_per_batch) % len(rows):][:prompts_per_batch]
            metrics = trainer.step([row for row in batch for _ in range(samples_per_prompt)])
            if round_index:
                timings[way].append({key: metrics[key] for key in TIMES})
            print(f"round {round_index}, {label} {way}: forward {metrics['time/forward']:.1f} s, "
                  f"train {metrics['time/train']:.1f} s, iteration {metrics['time/iteration']:.1f} s", flush=True)
    return timings


# ---------------------------------------------------------------- peer benchmarks: ppo-rlhf and TRL side by side
def peer_arguments(doc: str, out: str, seeds: list[int], iterations: int, eval_every: int, eval_size: int,
                   threads: int, threads_help: str, trl_venv: str, build: str, quick: tuple[int, int, int],
                   quick_help: str, own: Callable | None = None):
    """A peer benchmark's command line, parsed: the run folders, its own flags (``own(parser)``), seeds,
    iterations, evaluations, threads, TRL's Python (checked: ``build`` says how to make it) and
    ``--quick`` (1 seed and the ``quick`` iterations, evaluation interval and size; its runs and
    results in OUT-quick).  Returns the arguments and the folder the results go to."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=out, help=f"run folders (default {out})")
    if own:
        own(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=seeds)
    parser.add_argument("--iterations", type=int, default=iterations)
    parser.add_argument("--eval-every", type=int, default=eval_every)
    parser.add_argument("--eval-size", type=int, default=eval_size)
    parser.add_argument("--threads", type=int, default=threads, help=threads_help)
    parser.add_argument("--trl-python", default=str(ROOT / trl_venv / "bin" / "python"))
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--report-only", action="store_true", help="redo the tables and the plot from the run folders")
    parser.add_argument("--note", action="append", default=[],
                        help="a line added to the report (e.g. the machine's load)")
    args = parser.parse_args()
    results_dir = RESULTS
    if args.quick:  # a check that everything runs, not figures: its results stay in its run folder
        args.seeds, (args.iterations, args.eval_every, args.eval_size) = args.seeds[:1], quick
        args.out = args.out.rstrip("/") + "-quick"
        results_dir = Path(args.out)
    if not Path(args.trl_python).exists():
        sys.exit(f"{args.trl_python} not found: {build}")
    return args, results_dir


def peer_env(ppo_rlhf: bool = True, threads: int | None = None) -> dict:
    """The environment of a run: ppo-rlhf's sources on the path of its own runs only (TRL's
    virtual environment must not see them); ``threads``: OMP threads as torch's."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT / "src"]
    env["PYTHONPATH"] = os.pathsep.join(([str(ROOT / "src")] if ppo_rlhf else []) + paths)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_peer(run_dir: Path, command_line: list, settings: dict, env: dict, judge: Callable[[Path], list[dict]],
             **fields) -> tuple[float, list[dict], float]:
    """One system's run in a fresh process, on ``settings`` (run_dir/settings.json), its output in
    run_dir/log.txt; its result.json given ``fields``, the process seconds and the load average
    before and after; then every policy it saved judged into run_dir/evaluations.json.  Returns
    the process seconds, the evaluations and the seconds they took."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
    load_before = os.getloadavg()
    start = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        done = subprocess.run(command_line + ["--settings", str(run_dir / "settings.json")], env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"{run_dir.name} failed (exit {done.returncode}); its log: {run_dir / 'log.txt'}")
    process_seconds = time.perf_counter() - start
    result = json.loads((run_dir / "result.json").read_text())
    result.update({**fields, "process_seconds": process_seconds, "load_average_before": load_before,
                   "load_average_after": os.getloadavg()})
    (run_dir / "result.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    start = time.perf_counter()
    evaluations = judge(run_dir)
    (run_dir / "evaluations.json").write_text(json.dumps(evaluations, indent=2) + "\n")
    return process_seconds, evaluations, time.perf_counter() - start


def seconds_at(iterations: list[dict]) -> tuple[float, dict[int, float]]:
    """Training seconds in all, and after each iteration (0 before the first)."""
    elapsed, at = 0.0, {0: 0.0}
    for record in iterations:
        elapsed += record["time/iteration"]
        at[record["iteration"]] = elapsed
    return elapsed, at


def right_padded(out, pad_token_id: int):
    """The prompt + response ids of a rollout (``generate_responses``' output), right-padded as TRL's
    forward passes take them, and their attention mask."""
    import torch

    sequences = out.sequences
    rows = [torch.cat([sequences.prompt_ids[i][sequences.prompt_mask[i].bool()],
                       sequences.response_ids[i][sequences.response_mask[i].bool()]])
            for i in range(len(sequences.prompt_ids))]
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return input_ids, mask


def versions(side: dict) -> str:
    """One side's package versions, as a report lists them: "torch 2.13.0, transformers 5.24.0"."""
    return ", ".join(f"{name} {version}" for name, version in side.items())


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    child(sys.argv[2])
