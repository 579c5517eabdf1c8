"""Resident memory of the agents' GRPO recipe on SmolLM2-135M-Instruct with LoRA (issue 62; docs/agents.md,
"Memory"): peak RSS of a run shaped like a user's tool task -- a ~455-token prompt (a system message
of rules, the tool's schema as the ChatML tools template lists it, the question), ~195-token turns,
32 episodes a minibatch -- with ``--max-tokens-per-micro-batch auto`` (the default) against one pass
of the whole minibatch (``none``, the default before), and the losses of both on a batch that fits.

    make smollm2                                    # once: the model as a folder
    python benchmarks/bench_agents_memory.py        # about 30 minutes on 2 cores
    python benchmarks/bench_agents_memory.py --quick    # the 8-episode runs alone, 16-token turns

Every run is a process of its own running ``PPOTrainer.step`` as ``ppo-rlhf ppo`` builds it: the tools
benchmark's recipe (bench_agents.py PPO_TOOLS: LoRA, GRPO with 8 samples of 4 prompts, one step a
batch, k3 KL 0.05 in the loss, lr 1e-4, temperature 0.7), the benchmarks' calculator as the tool
(benchmarks/agents_tools.py) and src/ppo_rlhf/envs/chatml_tools.jinja as the template.  The engine is
given no stop id, so every episode is one turn of exactly ``--new-tokens`` tokens and every run trains
on the same shape; the reward is the share of vowels in the turn (any reward with spread does: memory
does not depend on it, the losses need advantages that are not all 0).

``peak`` is the process's resident high-water mark (Linux VmHWM: what ``/usr/bin/time -v`` reports as
"Maximum resident set size"), from its start -- loading included -- to its end.  One pass of 32
episodes (its 4 prompts run once, 8,100 positions: about 19 GiB at 2.4 MiB a position) could take
this shared machine's memory from whatever else runs on it: it runs once under a 12 GiB address-space
limit (a 16 GB laptop with its browser open), where it stops or says what it took.  The losses are
compared on 8 episodes of one prompt (one pass: 2,025 positions, about 5 GiB; auto cuts it in two),
auto against one pass, iteration 1 (the same episodes: generation does not depend on how the passes
are cut).  Results: benchmarks/results/agents_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import HERE, ROOT, SMOLLM2, memory_kib, require_model, write_results

MODEL = SMOLLM2
TEMPLATE = ROOT / "src" / "ppo_rlhf" / "envs" / "chatml_tools.jinja"
GIB = 2**30

# The rules a user's task writes into its system message (about 240 tokens; the template's words, the
# tool's schema and the question make the prompt about 455).
RULES = (
    "You are the clerk of a small hardware shop that keeps its accounts by hand. Customers ask what an "
    "order costs, and you answer with the total in cents, as a number. Follow these rules exactly. "
    "Prices are per unit unless the customer says a box or a pack: a box holds twelve units and a pack "
    "holds five. Screws cost 7 cents, nails 3 cents, hinges 215 cents, brackets 145 cents, hooks 38 "
    "cents, washers 2 cents, bolts 19 cents and nuts 6 cents. An order of more than one hundred units "
    "of a single item gets a tenth off that item, rounded down to a whole cent. A customer who says "
    "they are a member gets a twentieth off the whole order after any other discount, rounded down. "
    "If a customer asks for an item the shop does not sell, say so and "
    "price the rest of the order. Never guess a product of two numbers of more than two digits each: "
    "use the calculator for every multiplication and every sum of more than two numbers, one "
    "expression a call, and read its answer before you go on. When you are sure, write the total on a "
    "line of its own as "
    "'Total: N cents' and nothing after it. If the order is unclear, ask one question and stop."
)
QUESTIONS = ["I need 140 screws and 3 boxes of nails, delivered please.",
             "What do 17 hinges and 2 packs of brackets come to? I am a member.",
             "Price 250 washers, 64 bolts and as many nuts as bolts, please.",
             "How much for 9 boxes of hooks and one pack of hinges?"]


def vowel_share(prompts, responses, **columns) -> list[float]:
    """The share of vowels among a turn's letters: a reward with spread across the samples of a prompt."""
    def share(text: str) -> float:
        letters = [c for c in text.lower() if c.isalpha()]
        return sum(c in "aeiou" for c in letters) / max(len(letters), 1)
    return [share(response) for response in responses]


def recipe(model: str, budget: str, episodes: int, samples: int, new_tokens: int) -> dict:
    """The PPO config of a run: bench_agents.py's PPO_TOOLS, the tool's template, ``budget`` for
    --max-tokens-per-micro-batch, ``episodes`` a batch (= a minibatch), ``samples`` of each prompt."""
    return {"model": model, "lora": True, "estimator": "grpo", "samples_per_prompt": samples,
            "batch_size": episodes, "mini_batch_size": episodes, "ppo_epochs": 1, "kl_in": "loss", "lr": 1e-4,
            "temperature": 0.7, "max_new_tokens": new_tokens, "max_turns": 3, "chat_template": True,
            "chat_template_file": str(TEMPLATE), "reward_fn": [f"{Path(__file__).resolve()}:vowel_share"],
            "seed": 0, "max_tokens_per_micro_batch": budget}


def child(model: str, budget: str, episodes: int, samples: int, new_tokens: int, iterations: int, threads: int) -> dict:
    """One run: the trainer built as the command line builds it, ``iterations`` steps; its peak RSS,
    seconds, plan line and each iteration's update statistics."""
    import torch

    sys.path.insert(0, str(HERE))
    import agents_tools

    from ppo_rlhf.config import build_config
    from ppo_rlhf.rollout.generation import TorchGenerator
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig
    from ppo_rlhf.trainers.ppo_plan import micro_batch_line
    from ppo_rlhf.trainers.roles import load_roles

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = build_config(PPOConfig, recipe(model, budget, episodes, samples, new_tokens))
    roles = load_roles(config, None)
    # No stop id (-1 is no token): every turn runs to exactly new_tokens, every run trains on one shape.
    generator = TorchGenerator(-1, roles.tokenizer.pad_token_id, new_tokens, do_sample=True, temperature=0.7, seed=0)
    trainer = PPOTrainer(config, roles.reward, model=roles.actor, tokenizer=roles.tokenizer, generator=generator,
                         tools=[agents_tools.calculator])
    plan = micro_batch_line(config, trainer.token_budget, trainer.wanted_pass_plan.fused)
    loaded = memory_kib("VmRSS")
    prompts = [[{"role": "system", "content": RULES}, {"role": "user", "content": question}]
               for question in QUESTIONS]
    rows = [{"prompt": prompts[i // samples % len(prompts)]} for i in range(episodes)]
    steps = []
    for _ in range(iterations):
        start = time.perf_counter()
        metrics = trainer.step(rows)
        steps.append({"seconds": round(time.perf_counter() - start, 1),
                      **{key: metrics[key] for key in ("pg_loss", "kl_loss", "entropy", "approx_kl", "grad_norm",
                                                       "score") if key in metrics}})
    sequences = trainer.last_rollout.sequences
    # the update's micro-batches of the last batch (one minibatch), cut as it cut them
    passes = len(trainer.cut(sequences, torch.arange(len(sequences.response_ids)), config.train_micro_batch_size))
    return {"budget": budget, "episodes": episodes, "plan": plan, "loaded_gib": loaded / 2**20,
            "peak_gib": memory_kib("VmHWM") / 2**20, "prompt_tokens": round(sequences.prompt_mask.sum(dim=1).float().mean().item()),
            "episode_tokens": round(sequences.attention_mask.sum(dim=1).float().mean().item(), 1),
            "update_passes": passes, "iterations": steps}


def run_child(model: str, budget: str, episodes: int, samples: int, new_tokens: int, iterations: int, threads: int,
              limit_gib: int | None = None) -> dict:
    """A run in a process of its own (under an address-space limit of ``limit_gib``); its result, or
    how it stopped."""
    command = [sys.executable, __file__, "--child", budget, "--model", model, "--episodes", str(episodes), "--samples", str(samples),
               "--new-tokens", str(new_tokens), "--iterations", str(iterations), "--threads", str(threads)]
    limit = None if limit_gib is None else (lambda: resource.setrlimit(resource.RLIMIT_AS, (limit_gib * GIB,) * 2))
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, preexec_fn=limit)
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1])
    error = [line for line in done.stderr.strip().splitlines() if "Error" in line or "memory" in line.lower()]
    return {"budget": budget, "episodes": episodes, "limit_gib": limit_gib, "returncode": done.returncode,
            "seconds": round(time.perf_counter() - start, 1), "stopped": (error or done.stderr.splitlines() or [""])[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(MODEL), help="SmolLM2-135M-Instruct's folder (make smollm2)")
    parser.add_argument("--new-tokens", type=int, default=195, help="each episode's one turn, exactly")
    parser.add_argument("--iterations", type=int, default=2, help="iterations of the 32-episode auto run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the 8-episode runs alone, 16-token turns: to see it run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--episodes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.child, args.episodes, args.samples, args.new_tokens, args.iterations,
                               args.threads)))
        return
    require_model(args.model)
    new_tokens, iterations = (16, 1) if args.quick else (args.new_tokens, args.iterations)
    model, threads = args.model, args.threads
    runs = {} if args.quick else {
        "auto_32": run_child(model, "auto", 32, 8, new_tokens, iterations, threads),
        "one_pass_32_limited": run_child(model, "none", 32, 8, new_tokens, 1, threads, limit_gib=12)}
    runs["auto_8"] = run_child(model, "auto", 8, 8, new_tokens, 1, threads)
    runs["one_pass_8"] = run_child(model, "none", 8, 8, new_tokens, 1, threads)
    for name, result in runs.items():
        print(name, json.dumps(result), flush=True)
    report(runs, args, new_tokens, iterations)


def report(runs: dict, args, new_tokens: int, iterations: int) -> None:
    import torch

    command = "python benchmarks/bench_agents_memory.py" + (" --quick" if args.quick else "")
    machine = f"{platform.machine()}, {args.threads} torch threads, torch {torch.__version__}"
    result = {"benchmark": "agents_memory", "command": command, "machine": machine, "date": time.strftime("%Y-%m-%d"),
              "new_tokens": new_tokens, "runs": runs}
    stem = "agents_memory_quick" if args.quick else "agents_memory"
    auto = runs.get("auto_32", {})
    lines = ["# Agents: resident memory of the GRPO recipe (SmolLM2-135M-Instruct, LoRA)", "",
             f"`{command}` ({machine}, {result['date']}). The tools recipe (LoRA, GRPO with 8 samples of 4 prompts, "
             f"one step a batch, k3 KL 0.05 in the loss), the calculator listed by the ChatML tools template under a "
             f"system message of rules; every episode one turn of exactly {new_tokens} tokens. Peak: the process's "
             f"resident high-water mark from start to end (VmHWM, as `/usr/bin/time -v` reports it).", "",
             "| run | episodes a minibatch | tokens an episode (prompt) | update passes | peak RSS | s / iteration |",
             "|---|---|---|---|---|---|"]
    for name, run in runs.items():
        if "peak_gib" in run:
            seconds = ", ".join(str(step["seconds"]) for step in run["iterations"])
            lines.append(f"| --max-tokens-per-micro-batch {run['budget']} | {run['episodes']} | {run['episode_tokens']} "
                         f"({run['prompt_tokens']}) | {run['update_passes']} | {run['peak_gib']:.2f} GiB | {seconds} |")
        else:
            lines.append(f"| --max-tokens-per-micro-batch {run['budget']}, address space limited to "
                         f"{run['limit_gib']} GiB | {run['episodes']} | | 1 | stopped after {run['seconds']} s: "
                         f"`{run['stopped'][:160]}` | |")
    if "plan" in auto:
        lines += ["", f"The plan's line (32 episodes, auto): {auto['plan']}"]
    one, cut = runs["one_pass_8"], runs["auto_8"]
    if "iterations" in one and "iterations" in cut:
        lines += ["", "Iteration 1 on 8 episodes of one prompt (the same episodes), one pass against auto's "
                  "micro-batches:", "",
                  "| statistic | one pass | auto | difference |", "|---|---|---|---|"]
        for key, value in one["iterations"][0].items():
            if key != "seconds" and key in cut["iterations"][0]:
                other = cut["iterations"][0][key]
                lines.append(f"| {key} | {value:.8g} | {other:.8g} | {abs(value - other):.2g} |")
    write_results(stem, result, lines)


if __name__ == "__main__":
    main()
