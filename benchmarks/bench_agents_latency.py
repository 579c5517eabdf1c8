"""Agents at the speed of their tools (issue 48): seconds per PPO iteration with a calculator that
answers over HTTP after a wait (agents_http.py: a sync and an async client) against the same tool
answering at once, from the SFT warm-up of ``bench_agents.py tools``.

    python benchmarks/bench_agents.py tools                       # once: the SFT warm-up (and make smollm2)
    python benchmarks/bench_agents_latency.py torch               # ppo-rlhf, torch engine
    python benchmarks/bench_agents_latency.py vllm                # ppo-rlhf, vLLM engine (make vllm-venv)
    python benchmarks/bench_agents_latency.py trl                 # ppo-rlhf and TRL 1.16 (make trl116-venv)
    python benchmarks/bench_agents_latency.py torch --smoke       # a minute, to see it run (SmolLM2 as it comes)

Every run a process of its own, on an otherwise idle machine.  Results:
benchmarks/results/agents_latency_{torch,vllm,trl}.{json,md}; the arms and targets:
docs/benchmarks.md, "Agents at the speed of their tools (issue 48)".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import agents_tools  # noqa: E402
from agents_http import URL_VARIABLE, LatencyServer  # noqa: E402
from bench_agents import OUT, PPO_TOOLS, REWARD, TRL_PYTHON, WARM  # noqa: E402
from common import (HERE, RESULTS, ROOT, SMOLLM2, read_jsonl, record, require_model, require_python,  # noqa: E402
                    timed, write_results)

MODEL = SMOLLM2
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CLIENTS = {"sync": f"{HERE / 'agents_http.py'}:calculator", "async": f"{HERE / 'agents_http_async.py'}:calculator"}
RECIPE = PPO_TOOLS  # the tools benchmark's GRPO recipe: 32 episodes of up to 3 turns of 48 tokens
SMOKE = ["--lora", "--estimator", "grpo", "--samples-per-prompt", 2, "--batch-size", 4, "--mini-batch-size", 4,
         "--ppo-epochs", 1, "--max-new-tokens", 8, "--max-length", 512, "--max-turns", 2]
HALF_SECOND, RANDOM = 0.5, (0.1, 2.0)


def child_env(server: LatencyServer) -> dict:
    """The environment of a run: the server's address for the tool's client, this folder importable
    (the clients import agents_tools), one OpenMP thread pool as the runs ask."""
    paths = [str(HERE), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, URL_VARIABLE: server.url, "PYTHONPATH": os.pathsep.join(p for p in paths if p),
            "TOKENIZERS_PARALLELISM": "false"}


def iteration_figures(folder: Path) -> dict:
    """Seconds per iteration (mean and median of ``time/iteration``) and what the episodes did."""
    metrics = read_jsonl(folder / "metrics.jsonl")
    trained = [m for m in metrics if "time/iteration" in m]
    seconds = [m["time/iteration"] for m in trained]
    figures = {"seconds_per_iteration": round(statistics.mean(seconds), 2),
               "median_seconds": round(statistics.median(seconds), 2), "iterations": len(seconds),
               "seconds_each": [round(value, 2) for value in seconds]}
    if len(seconds) > 1:  # the first iteration also holds the run's one-time checks (the first batch's pass check)
        figures["seconds_after_first"] = round(statistics.mean(seconds[1:]), 2)
    for key in ("time/generate", "episode/turns", "tools/calls", "tools/errors", "tools/timeouts", "score"):
        values = [m[key] for m in trained if key in m]
        if values:
            figures[key] = round(statistics.mean(values), 3)
    return figures


def setup(args) -> tuple[Path, Path, str, list]:
    """(model, prompts, chat template, the run's extra arguments): the warm-up's model, or in a
    smoke run SmolLM2 as it comes with a parser that reads a calculator call in every turn."""
    from ppo_rlhf.envs.options import tool_template_path

    OUT.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        require_model(MODEL)
        prompts = agents_tools.write_jsonl(OUT / "latency_smoke.jsonl",
                                           agents_tools.prompt_rows(agents_tools.problems(16, seed=2)))
        return MODEL, Path(prompts), str(tool_template_path()), [
            *SMOKE, "--tool-parser", f"{HERE / 'agents_http.py'}:calls_calculator"]
    import bench_agents

    bench_agents.warm_up()
    # --calls every-turn: the warm-up's model calls its tool in 9-31% of the episodes of its first
    # iterations, which would leave the waits mostly out of what is measured; the load measured is
    # every turn calling the tool (3 turns, 96 calls an iteration), the model's text kept as written.
    every_turn = ["--tool-parser", f"{HERE / 'agents_http.py'}:calls_calculator"] if args.calls == "every-turn" else []
    return WARM, OUT / "train.jsonl", bench_agents.qwen_template(), RECIPE + every_turn


def ppo_rlhf_run(name: str, args, latency, client: str, extra: list, python: str = sys.executable) -> dict:
    """One ``ppo-rlhf ppo`` run with the HTTP calculator at ``latency``; its figures."""
    model, prompts, template, recipe = setup(args)
    out = OUT / f"latency_{name}"
    command = [python, "-m", "ppo_rlhf.cli", "ppo", "--model", model, "--prompts", prompts, "--tool", CLIENTS[client],
               "--chat-template-file", template, "--reward-fn", REWARD, *recipe, "--iterations", args.iterations,
               "--eval-every", 0, "--save-every", 0, "--save-rollouts", 1,
               "--seed", args.seed, "--num-threads", args.threads, "--out", out, "--overwrite", *extra]
    with LatencyServer(latency, seed=args.seed) as server:
        wall = timed(command, OUT / f"latency_{name}.log", child_env(server))
        calls, waiting = server.requests, server.waiting_seconds()
    print(f"{name}: {wall:.0f} s, {calls} calls", flush=True)
    return {"latency": latency, "client": client, "extra": [str(e) for e in extra], "calls": calls,
            "waiting_seconds": round(waiting, 2), **iteration_figures(out)}


def first_episodes(name: str) -> list:
    path = OUT / f"latency_{name}" / "rollouts" / "iteration_0001.jsonl"
    return [json.loads(line)["response_ids"] for line in path.read_text().splitlines()]


def steady(run: dict) -> float:
    """Seconds per iteration without the first's one-time checks, where the run has more than one."""
    return run.get("seconds_after_first", run["seconds_per_iteration"])


def torch_engine(args) -> dict:
    runs = {}
    for client in args.clients:
        runs[f"{client}_none"] = ppo_rlhf_run(f"{client}_none", args, 0.0, client, [])
        runs[f"{client}_half_second"] = ppo_rlhf_run(f"{client}_half_second", args, HALF_SECOND, client, [])
    if args.serial_iterations:
        serial = argparse.Namespace(**{**vars(args), "iterations": args.serial_iterations})
        runs["sync_half_second_one_worker"] = ppo_rlhf_run("sync_half_second_one_worker", serial, HALF_SECOND, "sync",
                                                           ["--env-workers", 1])
    for client in args.clients:
        runs[f"{client}_ratio"] = round(steady(runs[f"{client}_half_second"]) / steady(runs[f"{client}_none"]), 3)
        runs[f"{client}_added_seconds"] = round(steady(runs[f"{client}_half_second"]) - steady(runs[f"{client}_none"]), 2)
        runs[f"{client}_same_episodes"] = first_episodes(f"{client}_none") == first_episodes(f"{client}_half_second")
    if args.serial_iterations and "sync" in args.clients:  # the first iteration of each, alike in its one-time checks
        runs["one_worker_added_seconds_first_iteration"] = round(
            runs["sync_half_second_one_worker"]["seconds_each"][0] - runs["sync_none"]["seconds_each"][0], 2)
        runs["workers_added_seconds_first_iteration"] = round(
            runs["sync_half_second"]["seconds_each"][0] - runs["sync_none"]["seconds_each"][0], 2)
    return runs


def vllm_engine(args) -> dict:
    require_python(VLLM_PYTHON, "vllm-venv")
    runs = {}
    for latency, label in ((0.0, "none"), (RANDOM, "random")):
        for mode in ("turn_by_turn", "independent"):
            name = f"vllm_{label}_{mode}"
            runs[name] = ppo_rlhf_vllm_run(name, args, latency, mode)
    runs["random_ratio"] = round(runs["vllm_random_independent"]["seconds_per_iteration"]
                                 / runs["vllm_random_turn_by_turn"]["seconds_per_iteration"], 3)
    runs["random_after_first_ratio"] = round(steady(runs["vllm_random_independent"])
                                             / steady(runs["vllm_random_turn_by_turn"]), 3)
    for mode in ("turn_by_turn", "independent"):  # what the random waits add to each way of playing
        runs[f"{mode}_added_seconds_after_first"] = round(
            steady(runs[f"vllm_random_{mode}"]) - steady(runs[f"vllm_none_{mode}"]), 2)
    return runs


def ppo_rlhf_vllm_run(name: str, args, latency, mode: str) -> dict:
    """A run on the vLLM engine through the Python API (so that turn by turn can be asked for: the
    engine without its ``requests``), in .venv-vllm."""
    model, prompts, template, recipe = setup(args)
    out = OUT / f"latency_{name}"
    settings = {"argv": [str(a) for a in [
        "--model", model, "--prompts", prompts, "--tool", CLIENTS["sync"], "--chat-template-file", template,
        "--reward-fn", REWARD, *recipe, "--rollout-engine", "vllm",
        "--iterations", args.iterations, "--eval-every", 0, "--save-every", 0, "--seed", args.seed,
        "--num-threads", args.threads, "--out", out, "--overwrite"]], "turn_by_turn": mode == "turn_by_turn"}
    settings_file = OUT / f"latency_{name}.json"
    settings_file.write_text(json.dumps(settings))
    with LatencyServer(latency, seed=args.seed) as server:
        wall = timed([VLLM_PYTHON, Path(__file__), "vllm-run", "--settings", settings_file],
                     OUT / f"latency_{name}.log", child_env(server))
        calls, waiting = server.requests, server.waiting_seconds()
    print(f"{name}: {wall:.0f} s, {calls} calls", flush=True)
    return {"latency": latency, "mode": mode, "calls": calls, "waiting_seconds": round(waiting, 2),
            **iteration_figures(out)}


class TurnByTurn:
    """The run's vLLM engine without ``requests``: an episode's turns batched, one ``generate`` call
    per turn on every episode still going (rollout/turns.py, TurnBatches), as before issue 48."""

    def __init__(self, engine):
        self.__dict__["engine"] = engine

    def __getattr__(self, name):
        if name == "requests":
            raise AttributeError(name)
        return getattr(self.__dict__["engine"], name)

    def __setattr__(self, name, value):
        setattr(self.__dict__["engine"], name, value)


def vllm_run(settings_file: str) -> None:
    """In .venv-vllm: ``ppo-rlhf ppo`` with the settings' arguments, its engine turn by turn if asked
    (the engine the trainer builds, wrapped as it is made)."""
    from ppo_rlhf import cli
    from ppo_rlhf.trainers import ppo_setup

    settings = json.loads(Path(settings_file).read_text())
    if settings["turn_by_turn"]:
        make_engine = ppo_setup.make_engine
        ppo_setup.make_engine = lambda *a, **k: TurnByTurn(make_engine(*a, **k))
    raise SystemExit(cli.main(["ppo", *settings["argv"]]))


def trl_side_by_side(args) -> dict:
    import bench_agents

    require_python(TRL_PYTHON, "trl116-venv")
    bench_agents.warm_up()
    template = bench_agents.qwen_template()
    work = dict(bench_agents.PEERS_WORK)  # bench_agents.py peers' settings
    ours = bench_agents.peers_recipe(work)
    # --calls every-turn: one calculator call read in every turn on both sides (ppo-rlhf's parser,
    # TRL's response parser wrapped alike): the warm-up's model calls its tool in 9-19% of these
    # episodes, a few calls an iteration, which leaves the waits out of what is compared.
    every_turn = args.calls == "every-turn"
    if every_turn:
        ours += ["--tool-parser", f"{HERE / 'agents_http.py'}:calls_calculator"]
    runs = {"work": work, "calls": args.calls}
    # With no latency the client makes no difference (a call answered at once either way): one
    # baseline a system, run with the first client, serves both.
    plan = [(args.clients[0], 0.0, "none")] + [(client, HALF_SECOND, "half_second") for client in args.clients]
    if args.waits_only:  # the 0.5 s runs again, for the seconds with a call waiting (saved beside the runs before)
        plan, runs = [(client, HALF_SECOND, "waits") for client in args.clients], {}
    for client, latency, label in plan:
        name = f"peers_{client}_{label}"
        trl = OUT / f"latency_trl_{client}_{label}"
        settings = bench_agents.trl_settings(trl, args, template, work, every_turn_calls=every_turn,
                                             tool={"sync": "http", "async": "http-async"}[client])
        with LatencyServer(latency, seed=args.seed) as server:
            timed([TRL_PYTHON, HERE / "peers" / "trl_tools.py", "--settings", settings],
                  OUT / f"latency_trl_{client}_{label}.log", child_env(server))
            runs[f"trl_{client}_{label}"] = {"latency": latency, "calls": server.requests,
                                             "waiting_seconds": round(server.waiting_seconds(), 2),
                                             **iteration_figures(trl)}
        out = OUT / f"latency_{name}"
        command = [sys.executable, "-m", "ppo_rlhf.cli", "ppo", "--model", WARM, "--prompts", OUT / "train.jsonl",
                   "--tool", CLIENTS[client], "--chat-template-file", template, "--reward-fn", REWARD, *ours,
                   "--iterations", args.iterations,
                   "--eval-every", 0, "--save-every", 0, "--seed", args.seed, "--num-threads", args.threads,
                   "--out", out, "--overwrite"]
        with LatencyServer(latency, seed=args.seed) as server:
            timed(command, OUT / f"latency_{name}.log", child_env(server))
            runs[f"ppo_rlhf_{client}_{label}"] = {"latency": latency, "calls": server.requests,
                                                  "waiting_seconds": round(server.waiting_seconds(), 2),
                                                  **iteration_figures(out)}
        print(name, runs[f"ppo_rlhf_{client}_{label}"], runs[f"trl_{client}_{label}"], flush=True)
    if args.waits_only:
        for client in args.clients:
            runs[f"{client}_waiting_ratio"] = waiting_ratio(runs, f"{client}_waits")
        return runs
    baseline = args.clients[0]
    for client in args.clients:
        for figure, of in (("", lambda run: run["seconds_per_iteration"]), ("_after_first", steady)):
            added = {system: of(runs[f"{system}_{client}_half_second"]) - of(runs[f"{system}_{baseline}_none"])
                     for system in ("ppo_rlhf", "trl")}
            runs[f"{client}_added_seconds{figure}"] = {system: round(value, 2) for system, value in added.items()}
            runs[f"{client}_added{figure}_ratio"] = round(added["ppo_rlhf"] / added["trl"], 3) if added["trl"] > 0 else None
            runs[f"{client}_iteration{figure}_ratio"] = round(  # ppo-rlhf's whole iteration over TRL's, with the wait
                of(runs[f"ppo_rlhf_{client}_half_second"]) / of(runs[f"trl_{client}_half_second"]), 3)
        runs[f"{client}_waiting_ratio"] = waiting_ratio(runs, f"{client}_half_second")
        runs[f"{client}_ppo_rlhf_latency_ratio"] = round(  # the 1.15x target, on these settings
            steady(runs[f"ppo_rlhf_{client}_half_second"]) / steady(runs[f"ppo_rlhf_{baseline}_none"]), 3)
    return runs


def waiting_ratio(runs: dict, run: str) -> float | None:
    """ppo-rlhf's seconds with a call waiting over TRL's, in the two systems' runs named ``run``."""
    waits = [runs[f"{system}_{run}"]["waiting_seconds"] for system in ("ppo_rlhf", "trl")]
    return round(waits[0] / waits[1], 3) if waits[1] else None


def report(name: str, result: dict, args) -> None:
    result = {"benchmark": f"agents_latency_{name}", **record(f"{os.cpu_count()} cores", args.threads, "torch threads"),
              "seed": args.seed, "iterations": args.iterations, "smoke": args.smoke, **result}
    stem = f"agents_latency_{name}" + ("_smoke" if args.smoke else "")
    if args.append and (RESULTS / f"{stem}.json").is_file():  # the runs measured before, kept beside these
        result = {**json.loads((RESULTS / f"{stem}.json").read_text()), **result}
    lines = [f"# Agents at the speed of their tools: {name}", "",
             f"`{result['command']}` (seed {args.seed}, {args.iterations} iterations a run, {result['machine']}, "
             f"{result['note']}, {result['date']})", "",
             "| run | latency a call | seconds per iteration (mean / median) | each iteration | tool calls an episode | turns "
             "| calls | seconds with a call waiting |",
             "|---|---|---|---|---|---|---|---|"]
    for key, run in result.items():
        if isinstance(run, dict) and "seconds_per_iteration" in run:
            latency = run.get("latency")
            shown = ("0.1-2 s" if isinstance(latency, (list, tuple)) else f"{latency:g} s") if latency is not None \
                else ("0.5 s" if key.endswith("half_second") else "0 s")
            lines.append(f"| {key} | {shown} | {run['seconds_per_iteration']} / {run['median_seconds']} | "
                         f"{', '.join(map(str, run.get('seconds_each', [])))} | "
                         f"{run.get('tools/calls', '-')} | {run.get('episode/turns', '-')} | {run.get('calls', '-')} "
                         f"| {run.get('waiting_seconds', '-')} |")
    lines.append("")
    for key, value in result.items():
        if key.endswith(("_ratio", "_same_episodes", "_added_seconds", "_after_first", "_first_iteration")):
            lines.append(f"- {key}: {value}")
    write_results(stem, result, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=("torch", "vllm", "trl", "vllm-run"))
    parser.add_argument("--iterations", type=int, default=None, help="PPO iterations a run (torch 5, vllm 4, trl 3)")
    parser.add_argument("--serial-iterations", type=int, default=2,
                        help="torch: iterations of the 0.5 s tool with --env-workers 1 (0: leave that run out)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="SmolLM2 as it comes, 4 episodes, 1 iteration: to see it run")
    parser.add_argument("--calls", choices=("every-turn", "model"), default="every-turn",
                        help="a calculator call read in every turn (the waits measured; trl: TRL's parser wrapped "
                             "alike), or only the calls the warm-up's model writes")
    parser.add_argument("--clients", default="sync,async", type=lambda text: text.split(","),
                        help="torch: the clients run, each with no latency and with 0.5 s")
    parser.add_argument("--waits-only", action="store_true",
                        help="trl: only the 0.5 s runs, for the seconds with a call waiting (with --append)")
    parser.add_argument("--append", action="store_true", help="keep the runs of the results file that these do not measure again")
    parser.add_argument("--settings", help=argparse.SUPPRESS)  # vllm-run: the run's settings
    args = parser.parse_args()
    if args.benchmark == "vllm-run":
        vllm_run(args.settings)
        return
    if args.iterations is None:
        args.iterations = 1 if args.smoke else {"torch": 5, "vllm": 4, "trl": 3}[args.benchmark]
    if args.smoke:
        args.serial_iterations = min(args.serial_iterations, 1)
    result = {"torch": torch_engine, "vllm": vllm_engine, "trl": trl_side_by_side}[args.benchmark](args)
    report(args.benchmark, result, args)


if __name__ == "__main__":
    main()
