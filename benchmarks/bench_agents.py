"""Agents on SmolLM2-135M-Instruct on the CPU: a calculator tool (``tools``), FrozenLake played in
text (``frozenlake``, ``frozenlake-probe``), and the tool work side by side with TRL 1.16's
GRPOTrainer, as a tool (``peers``) and as an ``environment_factory`` class (``peers-env``).

    make smollm2                                        # once: the model as a folder
    python benchmarks/bench_agents.py tools             # SFT warm-up, then 30 minutes of GRPO
    python benchmarks/bench_agents.py frozenlake        # SFT warm-up, then PPO on 4x4 maps
    python benchmarks/bench_agents.py frozenlake-probe  # after frozenlake: each policy's moves at set states
    python benchmarks/bench_agents.py tools --quick     # a few iterations, to see it run

Every step is a ``ppo-rlhf`` command (TRL's Qwen 2.5 chat template; ``peers`` and ``peers-env`` need
``make trl116-venv``), its output in runs/bench_agents/.  Results:
benchmarks/results/agents_{tools,frozenlake,peers,peers_env}.{json,md}; the method:
docs/benchmarks.md, "Agents".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import agents_tools
from common import HERE, ROOT, SMOLLM2, read_jsonl, record, require_model, require_python, timed, write_results

MODEL = SMOLLM2
OUT = ROOT / "runs" / "bench_agents"
WARM = OUT / "sft" / "checkpoints" / "sft"  # the tools benchmark's SFT warm-up, where the others start
TOOL = f"{HERE / 'agents_tools.py'}:calculator"
ENVIRONMENT = f"{HERE / 'agents_tools.py'}:CalculatorEnv"  # the calculator as a TRL environment_factory class
REWARD = f"{HERE / 'agents_tools.py'}:answer_reward"  # ppo_rlhf.rewards:answer_match on the last model turn
TRL_PYTHON = ROOT / ".venv-trl116" / "bin" / "python"
HELD_OUT = 200
BUDGET_SECONDS = 30 * 60
# The README's chain_sum recipe (benchmarks/bench_reasoning.py): LoRA, GRPO with 8 samples of each
# of 4 prompts, one optimizer step a batch, lr 1e-4, temperature 0.7, k3 KL in the loss.  A tool
# call is ~30 tokens and the answer ~10: 48 new tokens a turn, 3 turns at most.
PPO_TOOLS = ["--lora", "--estimator", "grpo", "--samples-per-prompt", 8, "--batch-size", 32, "--mini-batch-size", 32,
             "--ppo-epochs", 1, "--kl-in", "loss", "--lr", 1e-4, "--temperature", 0.7, "--max-new-tokens", 48,
             "--max-length", 512, "--max-turns", 3]
EPISODE_EVAL = ["--max-new-tokens", 48, "--max-length", 512, "--max-turns", 3]


def ppo_rlhf(*args, log: Path) -> float:
    """One ``ppo-rlhf`` command, its output in ``log``; the seconds it took."""
    return timed([sys.executable, "-m", "ppo_rlhf.cli", *args], log)


def warm_up() -> Path:
    """The tools benchmark's SFT warm-up, checked to be there."""
    if not (WARM / "config.json").is_file():
        raise SystemExit(f"no {WARM}: run `python benchmarks/bench_agents.py tools` first (its SFT warm-up)")
    return WARM


def qwen_template() -> str:
    """TRL's Qwen 2.5 chat template, as installed in .venv-trl116 (make trl116-venv)."""
    found = sorted((ROOT / ".venv-trl116").glob("lib/python*/site-packages/trl/chat_templates/qwen2_5.jinja"))
    if not found:
        raise SystemExit("no TRL chat template: run `make trl116-venv` first (the tool benchmarks render with TRL's "
                         "Qwen 2.5 template, the one TRL parses tool calls from)")
    return str(found[0])


def evaluate(model: Path, prompts: str, out: Path, tool: bool, threads: int, template: str,
             environment: str | None = None) -> dict:
    """Held-out greedy accuracy (the mean 0/1 score) with the calculator or without it; with
    ``environment``, playing that class (``--environment``) instead of the plain tool."""
    episode = ["--environment", environment] if environment else ["--tool", TOOL]
    extra = ([*episode, "--chat-template-file", template, *EPISODE_EVAL] if tool else
             ["--chat-template", "--max-new-tokens", 48, "--max-length", 512])
    seconds = ppo_rlhf("eval", "--model", model, "--prompts", prompts, "--reward-fn", REWARD, "--size", HELD_OUT,
                       "--out", out, "--overwrite", "--num-threads", threads, *extra, log=out.with_suffix(".log"))
    summary = json.loads((out / "summary.json").read_text())
    return {"accuracy": summary["score"], "seconds": round(seconds, 1), "samples": summary["samples"][:3]}


def tools_warm_up(args, traces, template: str) -> float:
    """The tools benchmark's SFT warm-up on its calculator traces (OUT/sft); its seconds."""
    return round(ppo_rlhf(
        "sft", "--model", MODEL, "--data", traces, "--chat-template", "--chat-template-file", template,
        "--steps", args.sft_steps, "--batch-size", 8, "--lr", args.sft_lr, "--warmup-steps", 2, "--max-length", 512,
        "--eval-fraction", 0.05, "--eval-every", 0, "--save-every", 0, "--out", OUT / "sft", "--overwrite",
        "--num-threads", args.threads, log=OUT / "sft.log"), 1)


def tools(args) -> dict:
    OUT.mkdir(parents=True, exist_ok=True)
    template = qwen_template()
    held_out = agents_tools.problems(HELD_OUT, seed=1)
    train = agents_tools.problems(4000, seed=2, exclude=set(held_out))
    prompts = agents_tools.write_jsonl(OUT / "train.jsonl", agents_tools.prompt_rows(train))
    eval_prompts = agents_tools.write_jsonl(OUT / "held_out.jsonl", agents_tools.prompt_rows(held_out))
    schema = __import__("ppo_rlhf.envs.tools", fromlist=["x"]).tool_schema(agents_tools.calculator)
    traces = agents_tools.write_jsonl(OUT / "traces.jsonl", [agents_tools.trace(a, b, schema)
                                                             for a, b in train[: args.traces]])
    result = {"traces": args.traces, "sft_steps": args.sft_steps}
    if args.warm_up_only:  # the SFT warm-up the side-by-side and latency benchmarks start from, alone
        tools_warm_up(args, traces, template)
        raise SystemExit(f"warm-up only: {OUT / 'sft' / 'checkpoints' / 'sft'}")
    result["base"] = {"tool": evaluate(MODEL, eval_prompts, OUT / "eval_base_tool", True, args.threads, template),
                      "no_tool": evaluate(MODEL, eval_prompts, OUT / "eval_base", False, args.threads, template)}
    print("base:", {k: v["accuracy"] for k, v in result["base"].items()}, flush=True)
    sft = OUT / "sft"
    result["sft_seconds"] = tools_warm_up(args, traces, template)
    warm = sft / "checkpoints" / "sft"
    result["sft"] = {"tool": evaluate(warm, eval_prompts, OUT / "eval_sft_tool", True, args.threads, template),
                     "no_tool": evaluate(warm, eval_prompts, OUT / "eval_sft", False, args.threads, template)}
    print("after SFT:", {k: v["accuracy"] for k, v in result["sft"].items()}, flush=True)
    ppo = OUT / "ppo_tools"
    result["ppo_seconds"] = round(ppo_rlhf(
        "ppo", "--model", warm, "--prompts", prompts, "--eval-prompts", eval_prompts, "--eval-size", HELD_OUT,
        "--tool", TOOL, "--chat-template-file", template, "--reward-fn", REWARD, *PPO_TOOLS, "--iterations", args.iterations,
        "--eval-every", args.eval_every, "--no-eval-sampled", "--save-every", 0, "--save-rollouts", args.iterations,
        "--seed", args.seed, "--out", ppo, "--overwrite", "--num-threads", args.threads, log=OUT / "ppo_tools.log"), 1)
    metrics = read_jsonl(ppo / "metrics.jsonl")
    result["curve"] = [{"iteration": m["step"], "seconds": round(m.get("time/elapsed", 0.0), 1),
                        "accuracy": m["eval/score"]} for m in metrics if "eval/score" in m]
    trained = metrics[-1]
    result["iteration_seconds"] = round(sum(m["time/iteration"] for m in metrics if "time/iteration" in m)
                                        / args.iterations, 2)
    result["training"] = {key: trained.get(key) for key in ("score", "episode/turns", "tools/calls", "tools/errors",
                                                             "episode/tokens", "kl")}
    actor = ppo / "checkpoints" / "actor"
    merged = OUT / "ppo_tools_merged"
    ppo_rlhf("merge", "--adapter", actor, "--out", merged, "--overwrite", log=OUT / "merge.log")
    result["ppo"] = {"tool": evaluate(merged, eval_prompts, OUT / "eval_ppo_tool", True, args.threads, template),
                     "no_tool": evaluate(merged, eval_prompts, OUT / "eval_ppo", False, args.threads, template)}
    print("after PPO:", {k: v["accuracy"] for k, v in result["ppo"].items()}, flush=True)
    return result


def drawn_order(rows: list[dict], iterations: int, prompts_per_batch: int, seed: int) -> list[dict]:
    """The prompt rows in the order a ppo-rlhf run with ``seed`` draws them (trainers/ppo_setup.py,
    draw_batch: its prompt generator), for TRL to take them in turn."""
    generator = torch.Generator().manual_seed(seed)
    return [rows[i] for _ in range(iterations)
            for i in torch.randint(len(rows), (prompts_per_batch,), generator=generator).tolist()]


# The comparisons with TRL 1.16 (``peers``, ``peers-env``): GRPO with K samples of B/K prompts, one
# optimizer step a batch, k3 KL in the loss; a completion's budget holds the model's and the tool's
# tokens together, as TRL counts them.
PEERS_WORK = {"k": 8, "batch_size": 32, "lr": 1e-4, "beta": 0.05, "temperature": 0.7, "max_episode_tokens": 144,
              "max_turns": 3}


def peers_recipe(work: dict) -> list:
    """ppo-rlhf's arguments for TRL's work: LoRA, GRPO, one optimizer step a batch, k3 KL in the loss."""
    return ["--lora", "--estimator", "grpo", "--samples-per-prompt", work["k"], "--batch-size", work["batch_size"],
            "--mini-batch-size", work["batch_size"], "--ppo-epochs", 1, "--kl-in", "loss", "--kl-coef", work["beta"],
            "--lr", work["lr"], "--temperature", work["temperature"], "--max-new-tokens", work["max_episode_tokens"],
            "--max-episode-tokens", work["max_episode_tokens"], "--max-length", 512, "--max-turns", work["max_turns"]]


def trl_settings(folder: Path, args, template: str, work: dict, **more) -> Path:
    """folder/settings.json of a TRL run from the warm-up: the training prompts in the order ppo-rlhf
    draws them for the seed (folder/prompts.jsonl), the chat template, the work and ``more``."""
    folder.mkdir(exist_ok=True)
    rows = read_jsonl(OUT / "train.jsonl")
    ordered = agents_tools.write_jsonl(folder / "prompts.jsonl", drawn_order(rows, args.iterations,
                                                                             work["batch_size"] // work["k"], args.seed))
    settings = {"model": str(WARM), "prompts": ordered, "chat_template": template, "out": str(folder),
                "seed": args.seed, "threads": args.threads, "iterations": args.iterations, "work": work, **more}
    (folder / "settings.json").write_text(json.dumps(settings, indent=2))
    return folder / "settings.json"


def peers(args) -> dict:
    """ppo-rlhf's ``--tool`` against TRL's ``tools=[calculator]``."""
    return side_by_side(args, "peers", environment=False)


def peers_env(args) -> dict:
    """ppo-rlhf's ``--environment`` against TRL's ``environment_factory=``, both playing CalculatorEnv."""
    return side_by_side(args, "peers_env", environment=True)


def side_by_side(args, stem: str, environment: bool) -> dict:
    """ppo-rlhf and TRL 1.16 from the ``tools`` SFT warm-up with PEERS_WORK's settings, the
    calculator given as a tool or (``environment``) as the CalculatorEnv class; seconds per
    iteration of each, then each adapter merged and scored by ``ppo-rlhf eval`` alike.  Outputs in
    OUT/{stem}_*."""
    warm = warm_up()
    require_python(TRL_PYTHON, "trl116-venv")
    template = qwen_template()
    eval_prompts = str(OUT / "held_out.jsonl")
    work = dict(PEERS_WORK)
    result = {"work": work}
    episode = ["--environment", ENVIRONMENT] if environment else ["--tool", TOOL]
    ours = OUT / f"{stem}_ppo_rlhf"
    ppo_rlhf("ppo", "--model", warm, "--prompts", OUT / "train.jsonl", *episode, "--chat-template-file", template,
             "--reward-fn", REWARD, *peers_recipe(work), "--iterations", args.iterations,
             "--eval-every", 0, "--save-every", 0, "--seed", args.seed, "--out", ours, "--overwrite",
             "--num-threads", args.threads, log=OUT / f"{stem}_ppo_rlhf.log")
    seconds = [m["time/iteration"] for m in read_jsonl(ours / "metrics.jsonl") if "time/iteration" in m]
    result["ppo_rlhf"] = {"seconds_per_iteration": round(sum(seconds) / len(seconds), 2)}
    trl = OUT / f"{stem}_trl"
    # with ``environment``, the class trl_env.py takes from agents_tools
    more = {"environment": ENVIRONMENT.rpartition(":")[2]} if environment else {}
    runner = HERE / "peers" / ("trl_env.py" if environment else "trl_tools.py")
    timed([TRL_PYTHON, runner, "--settings", trl_settings(trl, args, template, work, **more)], OUT / f"{stem}_trl.log")
    seconds = [m["time/iteration"] for m in read_jsonl(trl / "metrics.jsonl")]
    result["trl"] = {"seconds_per_iteration": round(sum(seconds) / len(seconds), 2),
                     "train_log": json.loads((trl / "result.json").read_text())["train_log"]}
    for name, adapter in (("ppo_rlhf", ours / "checkpoints" / "actor"), ("trl", trl / "adapter")):
        merged = OUT / f"{stem}_{name}_merged"
        ppo_rlhf("merge", "--adapter", adapter, "--out", merged, "--overwrite", log=OUT / "merge.log")
        result[name]["held_out"] = evaluate(merged, eval_prompts, OUT / f"eval_{stem}_{name}", True, args.threads,
                                            template, ENVIRONMENT if environment else None)["accuracy"]
    result["iteration_ratio"] = round(result["ppo_rlhf"]["seconds_per_iteration"] / result["trl"]["seconds_per_iteration"], 3)
    print(result, flush=True)
    return result


# FrozenLake's recipes (--recipe), on the SFT warm-up's model, LoRA, temperature 1, 32 episodes an
# iteration: GRPO with the episode's reward (8 plays of each of 4 maps), or PPO with a critic (GAE,
# lam 0.95) crediting each move by the environment's per-turn rewards, the value head at 1e-3.  The
# recipes of the first six rounds are retired (docs/benchmarks.md, "Retired scripts").
LAKE_RECIPES = {
    "grpo": ["--estimator", "grpo", "--samples-per-prompt", 8, "--batch-size", 32, "--mini-batch-size", 16,
             "--ppo-epochs", 1, "--kl-in", "loss", "--lr", 2e-4],
    "ppo-lambda": ["--estimator", "gae", "--turn-rewards", "per-turn", "--batch-size", 32, "--mini-batch-size", 16,
                   "--ppo-epochs", 2, "--lr", 3e-4, "--lam", 0.95, "--critic-lr", 1e-3, "--critic-warmup", 1],
}


LAKE_INSTRUCTIONS = ("You are on a frozen lake. Reach the goal without stepping into a hole. Answer with one move: "
                     "left, down, right or up.\n")


def lake_temperature(flags: list[str]) -> str:
    """The sampling temperature a recipe's flags set (the last --temperature), 1 where none."""
    return next((flags[i + 1] for i in range(len(flags) - 1, -1, -1) if flags[i] == "--temperature"), "1")


# The warm-up's traces (--warm-up) and how a board reads (--view, agents_tools' observation functions);
# the first of each names folders and results without a suffix.  The recipe that learns is walks on
# lake_safe_view's boards (docs/benchmarks.md, "FrozenLake in text").
LAKE_WARM_UPS = {"paths": "shortest-path traces", "walks": "random walks that keep the rules (lake_walk)"}
LAKE_VIEWS = {"sides": "lake_view", "safe": "lake_safe_view"}


def lake_variant(warm_up: str, view: str) -> str:
    """The part of a FrozenLake run's folder and result names that says its warm-up and view."""
    return "".join(f"_{name}" for name, first in ((warm_up, "paths"), (view, "sides")) if name != first)


def lake_flags(warm_up: str, view: str) -> str:
    return "".join(f" --{flag} {name}" for flag, name, first in (("warm-up", warm_up, "paths"), ("view", view, "sides"))
                   if name != first)


def lake_sft_folder(warm_up: str, view: str) -> str:
    return "lake_sft" + lake_variant(warm_up, view)


def lake_ppo_folder(warm_up: str, view: str, recipe: str) -> str:
    return "ppo_lake" + lake_variant(warm_up, view) + "_" + recipe


def frozenlake(args) -> dict:
    import gymnasium as gym
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    OUT.mkdir(parents=True, exist_ok=True)

    def maps(count: int, seed: int, exclude=()) -> list[list[str]]:
        chosen, index = [], 0
        while len(chosen) < count:
            desc = generate_random_map(size=4, p=0.8, seed=seed * 100_000 + index)
            index += 1
            if desc not in chosen and desc not in exclude:
                chosen.append(desc)
        return chosen

    held_out = maps(100, seed=1)
    train = maps(2000, seed=2, exclude=held_out)
    rows = lambda descs: [{"prompt": LAKE_INSTRUCTIONS, "desc": desc} for desc in descs]  # noqa: E731
    prompts = agents_tools.write_jsonl(OUT / "lake_train.jsonl", rows(train))
    eval_prompts = OUT / "lake_held_out.jsonl"
    agents_tools.write_jsonl(eval_prompts, rows(held_out))
    # The warm-up's traces: each map's shortest path, or (--warm-up walks) a random walk that keeps the
    # rules (never a hole, never an edge) and does not seek the goal, so what PPO adds is the way there.
    walks, view = args.warm_up == "walks", getattr(agents_tools, LAKE_VIEWS[args.view])
    traces = agents_tools.write_jsonl(OUT / f"lake_traces{lake_variant(args.warm_up, args.view)}.jsonl", [
        agents_tools.lake_trace(row, index if walks else None, view) for index, row in enumerate(rows(train[: args.traces]))])
    del gym
    common = ["--environment", "gym:FrozenLake-v1", "--environment-config", "is_slippery=false", "--max-turns", 8,
              "--observation-text", f"{HERE / 'agents_tools.py'}:{LAKE_VIEWS[args.view]}", "--max-new-tokens", 8, "--max-length", 512]
    result = {}
    # The SFT warm-up, kept from an earlier run with the same traces and settings (the recipes start from it).
    sft = OUT / lake_sft_folder(args.warm_up, args.view)
    settings = {"traces": Path(traces).read_text(), "steps": args.sft_steps, "lr": args.sft_lr}
    stamp = sft / "warm_up.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == settings:
        result["sft_seconds"] = json.loads((sft / "summary.json").read_text()).get("seconds")
    else:
        result["sft_seconds"] = round(ppo_rlhf(
            "sft", "--model", MODEL, "--data", traces, "--chat-template", "--steps", args.sft_steps, "--batch-size", 8,
            "--lr", args.sft_lr, "--warmup-steps", 1, "--max-length", 512, "--eval-fraction", 0.05, "--eval-every", 0,
            "--save-every", 0, "--out", sft, "--overwrite", "--num-threads", args.threads, log=OUT / f"{sft.name}.log"), 1)
        stamp.write_text(json.dumps(settings))
    if args.warm_up_only:  # the warm-up alone (frozenlake-probe reads it)
        raise SystemExit(f"warm-up only: {sft / 'checkpoints' / 'sft'}")
    result.update(warm_up=args.warm_up, view=args.view, traces=args.traces, sft_steps=args.sft_steps, sft_lr=args.sft_lr, recipe=args.recipe,
                  recipe_flags=[str(x) for x in LAKE_RECIPES[args.recipe]])
    # PPO on the warm-up's model; its own evaluations (greedy, the same 100 maps with the same seeds) at
    # iteration 0 -- the warm-up's success -- and every --eval-every iterations.
    ppo = OUT / lake_ppo_folder(args.warm_up, args.view, args.recipe)
    result["ppo_seconds"] = round(ppo_rlhf(
        "ppo", "--model", sft / "checkpoints" / "sft", "--prompts", prompts, "--eval-prompts", eval_prompts,
        "--eval-size", 100, *common, "--lora", "--temperature", 1.0, *LAKE_RECIPES[args.recipe],
        "--iterations", args.iterations, "--eval-every", args.eval_every or args.iterations, "--no-eval-sampled",
        "--save-every", 0, "--save-rollouts", args.iterations, "--seed", args.seed, "--out", ppo, "--overwrite",
        "--num-threads", args.threads, log=OUT / f"{ppo.name}.log"), 1)
    metrics = read_jsonl(ppo / "metrics.jsonl")
    trained = [m for m in metrics if "time/iteration" in m]
    training_seconds = {m["step"]: sum(t["time/iteration"] for t in trained if t["step"] <= m["step"]) for m in trained}
    result["curve"] = [{"iteration": m["step"], "seconds": round(training_seconds.get(m["step"], 0.0), 1),
                        "success": m["eval/episode/success"]} for m in metrics if "eval/score" in m]
    result["sft"] = {"success": result["curve"][0]["success"]}
    within = [c for c in result["curve"] if c["seconds"] <= BUDGET_SECONDS]
    result["after"] = {"success": result["curve"][-1]["success"], "iteration": result["curve"][-1]["iteration"]}
    result["best_within_budget"] = max(within, key=lambda c: c["success"])
    result["iteration_seconds"] = round(sum(m["time/iteration"] for m in trained) / len(trained), 2)
    # Success is the environment's reward (1 at the goal): a recipe's own reward function
    # changes the score, not whether the goal was reached.
    result["training"] = [{"success" if key == "reward/environment" else key: round(m[key], 3)
                           for key in ("step", "reward/environment", "score", "episode/turns", "env/invalid_actions",
                                       "explained_variance") if key in m} for m in trained]
    print("after:", result["after"], flush=True)
    return result


# frozenlake-probe's states: (map, the moves that lead there, the move that wins from there).  Each
# asks whether the policy reads what the observation says a move steps onto: the same square with a
# hole on one side or the other, holes beside the bottom row, a dead end to back out of.
LAKE_PROBES = [(["SFFF", "FFFF", "FFFF", "FFFG"], [], "down"),
               (["SHFF", "FFFF", "FFFF", "FFFG"], [], "down"),
               (["SFFF", "HFFF", "FFFF", "FFFG"], [], "right"),
               (["SFFF", "FFFF", "FHFF", "FFFG"], ["down", "down"], "down"),
               (["SFFF", "FFHF", "FFFF", "FFFG"], ["right", "down"], "down"),
               (["SFFF", "FFFF", "FFFF", "FHFG"], ["down", "down", "down"], "up"),
               (["SFFF", "FFFF", "FFFH", "FFFG"], ["right", "right", "right", "down"], "left")]


def lake_probe(folder: Path, view) -> list[dict]:
    """The policy in ``folder`` (a model, or a LoRA adapter on one) at each LAKE_PROBES state: the
    probability of each move's first token after the chat template's generation prompt, the
    conversation written as the episode runner writes it (the warm-up's traces alike)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_rlhf.models.loading import adapter_base_path, is_adapter_folder

    adapter = is_adapter_folder(folder)
    model = AutoModelForCausalLM.from_pretrained(adapter_base_path(folder) if adapter else folder)
    model = (PeftModel.from_pretrained(model, folder) if adapter else model).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    first_token = {move: tokenizer(move, add_special_tokens=False).input_ids[0] for move in agents_tools.LAKE_MOVES}
    rows = []
    for desc, moves, best in LAKE_PROBES:
        messages = agents_tools.lake_conversation(LAKE_INSTRUCTIONS, desc, moves, view)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with torch.no_grad():
            logits = model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, -1]
        probabilities = logits.float().softmax(-1)
        rows.append({"state": messages[-1]["content"].splitlines()[-1], "best": best,
                     "p": {move: round(probabilities[token].item(), 3) for move, token in first_token.items()}})
    return rows


def frozenlake_probe(args) -> dict:
    """The warm-up's and each recipe's trained policy at the LAKE_PROBES states (after their runs)."""
    torch.set_num_threads(args.threads)
    policies = {}
    for warm_up in LAKE_WARM_UPS:
        for view in LAKE_VIEWS:
            named = lake_flags(warm_up, view)
            folders = {f"SFT warm-up{named}": OUT / lake_sft_folder(warm_up, view) / "checkpoints" / "sft"}
            folders.update({f"PPO{named} --recipe {recipe}": OUT / lake_ppo_folder(warm_up, view, recipe) / "checkpoints"
                            / "actor" for recipe in LAKE_RECIPES})
            policies.update({name: lake_probe(folder, getattr(agents_tools, LAKE_VIEWS[view]))
                             for name, folder in folders.items() if folder.is_dir()})
    return {"policies": policies}


def report(name: str, result: dict, args) -> None:
    result = {"benchmark": name, **record(threads=args.threads, unit="torch threads"),
              **({"seed": args.seed, "iterations": args.iterations} if name != "frozenlake-probe" else {}), **result}
    lake_run = f"{lake_variant(args.warm_up, args.view)}_{args.recipe}".replace("-", "_")
    stem = f"agents_{name.replace('-', '_')}" + (lake_run if name == "frozenlake" else "")
    trained = f"seed {args.seed}, {args.iterations} iterations, " if name != "frozenlake-probe" else ""
    lines = [f"# Agents: {name}", "", f"`{result['command']}` ({trained}{result['machine']}, {result['date']})", ""]
    if name == "tools":
        lines += ["| model | held-out accuracy with the calculator | without it |", "|---|---|---|"]
        for stage, label in (("base", "SmolLM2-135M-Instruct as it comes"),
                             ("sft", f"after the SFT warm-up ({result['sft_steps']} steps, {result['traces']} traces)"),
                             ("ppo", f"after GRPO ({args.iterations} iterations, {result['ppo_seconds'] / 60:.1f} min)")):
            lines.append(f"| {label} | {result[stage]['tool']['accuracy']:.3f} | {result[stage]['no_tool']['accuracy']:.3f} |")
        lines += ["", f"Seconds per PPO iteration: {result['iteration_seconds']}; last iteration: {result['training']}",
                  "", "Held-out accuracy with the tool during PPO: "
                  + ", ".join(f"{c['iteration']}: {c['accuracy']:.3f} ({c['seconds']:.0f} s)" for c in result["curve"])]
    elif name in ("peers", "peers-env"):
        work, ours, trl = result["work"], result["ppo_rlhf"], result["trl"]
        played = ("", "held-out accuracy with the tool") if name == "peers" else (
            " The calculator played as a TRL environment_factory class (agents_tools.CalculatorEnv: ppo-rlhf's "
            "`--environment`, TRL's `environment_factory=`), scored by the same reward.",
            "held-out success playing the class")
        lines += [f"Both from the SFT warm-up, LoRA, GRPO with {work['k']} samples of {work['batch_size'] // work['k']} "
                  f"prompts an iteration, lr {work['lr']:g}, k3 KL {work['beta']:g} in the loss, temperature "
                  f"{work['temperature']}, {work['max_episode_tokens']} tokens a completion (the tool's included), "
                  f"{work['max_turns']} turns at most.{played[0]}", "",
                  f"| system | seconds per iteration | {played[1]} |", "|---|---|---|",
                  f"| ppo-rlhf | {ours['seconds_per_iteration']} | {ours['held_out']:.3f} |",
                  f"| TRL 1.16 GRPOTrainer | {trl['seconds_per_iteration']} | {trl['held_out']:.3f} |", "",
                  f"ppo-rlhf's iteration: {result['iteration_ratio']}x TRL's."]
    elif name == "frozenlake-probe":
        lines += ["The probability of each move's first token at hand-made states (greedy plays the likeliest). "
                  "The best move is the one that wins from there.", ""]
        for policy, rows in result["policies"].items():
            lines += [f"**{policy}**", "", "| state | best | left | down | right | up |", "|---|---|---|---|---|---|"]
            lines += [f"| {row['state']} | {row['best']} | " + " | ".join(f"{row['p'][m]:.3f}" for m in
                                                                         agents_tools.LAKE_MOVES) + " |"
                      for row in rows] + [""]
    else:
        best = result["best_within_budget"]
        lines += [f"Recipe {result['recipe']}: `{' '.join(result['recipe_flags'])}`, LoRA, temperature "
                  f"{lake_temperature(result['recipe_flags'])}; boards as agents_tools.{LAKE_VIEWS[args.view]} writes them.", "",
                  "| model | success on 100 held-out maps (greedy, 8 moves at most) |", "|---|---|",
                  f"| after the SFT warm-up ({result['sft_steps']} steps of 8, {result['traces']} {LAKE_WARM_UPS[args.warm_up]}, "
                  f"lr {result['sft_lr']:g}) | {result['sft']['success']:.3f} |",
                  f"| after PPO, best within {BUDGET_SECONDS // 60} minutes of training (iteration {best['iteration']}, "
                  f"{best['seconds'] / 60:.1f} min) | {best['success']:.3f} |",
                  f"| after PPO, the last evaluation (iteration {result['after']['iteration']}) | "
                  f"{result['after']['success']:.3f} |", "",
                  f"Seconds per PPO iteration: {result['iteration_seconds']} (the run, evaluations included: "
                  f"{result['ppo_seconds'] / 60:.1f} min).", "",
                  "During PPO (iteration: held-out success, training seconds so far): "
                  + ", ".join(f"{c['iteration']}: {c['success']:.3f} ({c['seconds']:.0f} s)" for c in result["curve"]),
                  "", "Training episodes, iteration by iteration: "
                  + "; ".join(f"{m['step']}: success {m.get('success', m.get('score', 0)):.2f}, {m.get('episode/turns', 0):.1f} turns, "
                              f"{m.get('env/invalid_actions', 0):.2f} invalid" for m in result["training"])]
    write_results(stem, result, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("benchmark", choices=("tools", "frozenlake", "frozenlake-probe", "peers", "peers-env"))
    parser.add_argument("--iterations", type=int, default=None, help="PPO iterations (default: ~30 minutes' worth)")
    parser.add_argument("--eval-every", type=int, default=None, help="(tools 10, frozenlake: at the end only)")
    parser.add_argument("--traces", type=int, default=64, help="SFT warm-up traces")
    parser.add_argument("--warm-up", choices=sorted(LAKE_WARM_UPS), default="paths",
                        help="frozenlake: the warm-up's traces: " + "; ".join(f"{k}: {v}" for k, v in LAKE_WARM_UPS.items()))
    parser.add_argument("--view", choices=sorted(LAKE_VIEWS), default="sides",
                        help="frozenlake: how a board reads: " + "; ".join(f"{k}: agents_tools.{v}" for k, v in LAKE_VIEWS.items()))
    parser.add_argument("--sft-steps", type=int, default=None, help="SFT warm-up steps of 8 rows (tools 3, frozenlake 8)")
    parser.add_argument("--sft-lr", type=float, default=None,
                        help="SFT warm-up learning rate (tools 2.5e-5, frozenlake 5e-5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--recipe", choices=sorted(LAKE_RECIPES), default="grpo", help="frozenlake: the PPO recipe")
    parser.add_argument("--warm-up-only", action="store_true",
                        help="tools, frozenlake: write the prompts and the SFT warm-up (what peers, peers-env and the "
                             "latency benchmark start from; what frozenlake-probe reads), nothing else")
    parser.add_argument("--quick", action="store_true", help="a few iterations, to see it run")
    args = parser.parse_args()
    require_model(MODEL)
    if args.iterations is None:
        args.iterations = 2 if args.quick else {"tools": 24, "frozenlake": 16, "peers": 10,
                                                "peers-env": 10}.get(args.benchmark, 0)
    if args.eval_every is None:
        args.eval_every = 4 if args.benchmark == "frozenlake" else 10
    if args.sft_steps is None:
        args.sft_steps = {"frozenlake": 8}.get(args.benchmark, 3)
    if args.sft_lr is None:
        args.sft_lr = {"frozenlake": 5e-5}.get(args.benchmark, 2.5e-5)
    if args.quick:
        global HELD_OUT
        HELD_OUT, args.eval_every, args.sft_steps, args.traces = 8, 0, 2, 16
    result = {"tools": tools, "frozenlake": frozenlake, "frozenlake-probe": frozenlake_probe, "peers": peers,
              "peers-env": peers_env}[args.benchmark](args)
    report(args.benchmark, result, args)


if __name__ == "__main__":
    main()
