"""Rollouts and whole PPO iterations with each rollout engine: torch (the built-in decoding loop)
against vLLM in the trainer's process (issue 21; docs/design.md, "The vLLM rollout engine"), each
case in a fresh process of .venv-vllm, with the bounds memory bandwidth and arithmetic set.

    make vllm-venv smollm2                                   # once: vLLM's environment, the model folder
    .venv-vllm/bin/python benchmarks/bench_rollout_engines.py     # on an otherwise idle machine
    .venv-vllm/bin/python benchmarks/bench_rollout_engines.py --quick   # a smoke run: 8 x 16 tokens
    .venv-vllm/bin/python benchmarks/bench_rollout_engines.py --precisions float32 --models lora --keep
                                                 # some cases only, merged with those already measured

A CPU without bf16 instructions multiplies bf16 at a fraction of a GFLOP/s: run --precisions
float32 there.  Writes RESULTS/rollout_engines.md and .json; the cases and targets:
docs/benchmarks.md, "Rollout engines".
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, command, json_child, memory_kib, write_results

PROMPTS = ROOT / "examples" / "smollm2_vader" / "prompts.jsonl"
ENGINES = ("torch", "vllm")
PRECISIONS = ("float32", "bf16")


def length_reward(prompts, responses):
    """A reward that needs no model: the rollout, not the scoring, is what is measured."""
    return [min(len(r), 400) / 400 for r in responses]


def child(args) -> dict:
    import torch

    from ppo_rlhf.config import build_config
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    from ppo_rlhf.models import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    chat = getattr(load_tokenizer(args.model), "chat_template", None) is not None  # SmolLM2's has one
    config = build_config(PPOConfig, {
        "model": args.model, "prompts": str(PROMPTS), "chat_template": chat, "lora": args.lora,
        "rollout_engine": args.engine, "vllm_memory_utilization": args.memory_utilization,
        "mixed_precision": "bf16" if args.precision == "bf16" else "no", "estimator": "grpo",
        "samples_per_prompt": 8, "batch_size": args.batch_size, "mini_batch_size": args.batch_size // 4,
        "ppo_epochs": 1, "max_new_tokens": args.max_new_tokens, "max_length": 128 + args.max_new_tokens,
        "temperature": 0.7, "seed": 0, "num_threads": args.threads, "device": args.device,
    })
    start = time.perf_counter()
    trainer = PPOTrainer(config, reward=length_reward)
    built = time.perf_counter() - start
    rows = trainer.run_parts.train_rows
    rng = torch.Generator().manual_seed(0)
    from ppo_rlhf.trainers.ppo_setup import draw_batch

    def rollout() -> dict:
        metrics = {"time/generate": 0.0, "time/score": 0.0}
        with torch.no_grad(), trainer.accelerator.autocast():
            out = trainer.roll_out(draw_batch(rows, config, rng), metrics)
        tokens = int(out.sequences.response_mask.sum())
        return {"tokens": tokens, "generate_s": metrics["time/generate"],
                "weight_sync_s": metrics.get("time/weight_sync", 0.0)}

    rollout()  # warm-up: the first call pays one-off costs (vLLM's first batch, allocator growth)
    measured = rollout()
    steps = [trainer.step(draw_batch(rows, config, rng)) for _ in range(args.iterations)]
    last = steps[-1] if steps else {}
    return {
        "engine": args.engine, "precision": args.precision, "lora": args.lora, "device": str(trainer.device),
        "build_s": built, "rollout_tokens": measured["tokens"], "rollout_s": measured["generate_s"],
        "rollout_tokens_per_s": measured["tokens"] / measured["generate_s"],
        "weight_sync_s": measured["weight_sync_s"],
        "iterations": args.iterations, "iteration_s": last.get("time/iteration"),
        "iteration_generate_s": last.get("time/generate"), "iteration_train_s": last.get("time/train"),
        "iteration_weight_sync_s": last.get("time/weight_sync", 0.0),
        "logprob_diff_max": last.get("rollout/logprob_diff_max"), "peak_mib": memory_kib("VmHWM") / 1024,
        "parameters": sum(p.numel() for p in trainer.actor.parameters()),
    }


def bandwidth_gb_s(threads: int, mib: int = 512) -> float:
    """Memory bandwidth as a large copy sees it: bytes read + written per second, best of 5."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    source = torch.ones(mib * 2**20 // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * 4 / best / 1e9


def matmul_gflop_s(threads: int, dtype: str, size: int = 2048) -> float:
    """Arithmetic throughput as a large matrix product sees it (2 n^3 FLOPs), best of 5."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    kind = torch.bfloat16 if dtype == "bf16" else torch.float32
    a, b = torch.randn(size, size, dtype=kind), torch.randn(size, size, dtype=kind)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "runs" / "smollm2-135m-instruct"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, one per core)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--memory-utilization", type=float, default=0.1, help="--vllm-memory-utilization")
    parser.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens, float32 only: checks the script")
    parser.add_argument("--iterations", type=int, default=2, choices=(0, 1, 2),
                        help="whole PPO iterations per case after the rollouts; the last is timed (0: rollouts only)")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--case-timeout", type=int, default=3600, help="seconds one case may take before it is left out")
    parser.add_argument("--models", nargs="+", choices=("full", "lora"), default=["full", "lora"])
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from RESULTS/rollout_engines.json "
                        "(the bandwidth and FLOP/s measured again)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the cases already in RESULTS/rollout_engines.json that this call does not run")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--precision", choices=PRECISIONS, default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    if not (Path(args.model) / "config.json").is_file():
        sys.exit(f"{args.model} is not a model folder; make it with: make smollm2")
    if args.quick:
        args.batch_size, args.max_new_tokens = 8, 16
    precisions = ("float32",) if args.quick else args.precisions
    out = Path(args.out)
    saved = out / "rollout_engines.json"
    kept = json.loads(saved.read_text())["results"] if (args.keep or args.report_only) and saved.is_file() else []
    results = []
    for precision in ([] if args.report_only else precisions):
        for lora in [model == "lora" for model in args.models]:
            for engine in ENGINES:
                case = [__file__, "--child", "--engine", engine, "--precision", precision, "--model", args.model,
                        "--batch-size", args.batch_size, "--max-new-tokens", args.max_new_tokens, "--threads",
                        args.threads, "--device", args.device, "--memory-utilization", args.memory_utilization,
                        "--iterations", args.iterations] + (["--lora"] if lora else [])
                try:
                    results.append(json_child(case, timeout=args.case_timeout))
                except subprocess.TimeoutExpired:
                    print(f"{engine} {precision} lora={lora}: over {args.case_timeout} s, left out", flush=True)
                    continue
                print(json.dumps(results[-1]), flush=True)
    ran = {(r["precision"], r["lora"], r["engine"]) for r in results}
    results = [r for r in kept if (r["precision"], r["lora"], r["engine"]) not in ran] + results
    results.sort(key=lambda r: (PRECISIONS.index(r["precision"]), r["lora"], ENGINES.index(r["engine"])))
    bandwidth = bandwidth_gb_s(args.threads)
    gflop_s = {precision: matmul_gflop_s(args.threads, precision) for precision in PRECISIONS}
    write_report(results, bandwidth, gflop_s, args, out)


def write_report(results: list[dict], bandwidth: float, gflop_s: dict[str, float], args, out: Path) -> None:
    lines = [
        "# Rollout engines: torch against vLLM in the trainer's process",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `{command()}` ({platform.machine()}, "
        f"device {results[0]['device']}, threads {args.threads or 'torch default'}).",
        f"Model `{Path(args.model).name}`, {args.batch_size} chat prompts x up to {args.max_new_tokens} new tokens, "
        f"temperature 0.7; grpo, 8 samples per prompt, one PPO epoch. Measured memory bandwidth (copy): "
        f"{bandwidth:.1f} GB/s; matrix-product throughput (2048 x 2048): "
        + ", ".join(f"{precision} {value:.1f} GFLOP/s" for precision, value in gflop_s.items()) + ".",
        "",
        "| precision | model | engine | rollout tokens/s | bandwidth bound | compute bound | of the lower | "
        "weight sync s | iteration s (generate, train) | peak MiB | vllm / torch tokens/s | vllm / torch iteration |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        model_bytes = r["parameters"] * (2 if r["precision"] == "bf16" else 4)
        bandwidth_bound = args.batch_size * bandwidth * 1e9 / model_bytes
        compute_bound = gflop_s[r["precision"]] * 1e9 / (2 * r["parameters"])  # 2 FLOPs per weight per token
        bound = min(bandwidth_bound, compute_bound)
        torch_run = next(t for t in results if t["engine"] == "torch" and t["precision"] == r["precision"]
                         and t["lora"] == r["lora"])
        speedup = r["rollout_tokens_per_s"] / torch_run["rollout_tokens_per_s"]
        if r["iteration_s"] and torch_run["iteration_s"]:
            iteration = (f"{r['iteration_s']:.1f} ({r['iteration_generate_s']:.1f}, {r['iteration_train_s']:.1f}; "
                         f"{'2nd of 2' if r.get('iterations', 2) == 2 else 'the 1st'})")
            faster = f"{torch_run['iteration_s'] / r['iteration_s']:.2f}x"
        else:
            iteration = faster = "not run"
        lines.append(f"| {r['precision']} | {'lora' if r['lora'] else 'full'} | {r['engine']} "
                     f"| {r['rollout_tokens_per_s']:.0f} | {bandwidth_bound:.0f} | {compute_bound:.0f} "
                     f"| {r['rollout_tokens_per_s'] / bound:.0%} "
                     f"| {r['weight_sync_s']:.3f} | {iteration} | {r['peak_mib']:.0f} "
                     f"| {speedup:.2f}x | {faster} |")
    lines += ["", "Targets on the CPU: vLLM's rollout at least 3x the torch engine's tokens/s, the whole iteration "
              "at least 1.5x faster. Bounds on decoding: every weight is read once per decode step for the whole "
              "batch (bandwidth: batch x bandwidth / model bytes; the KV cache not counted), and every weight takes "
              "part in 2 FLOPs per generated token (compute: matrix-product FLOP/s / (2 x parameters); attention "
              "not counted). The iteration's other seconds (old, reference and update passes) are the trainer's, "
              "the same for both engines.", ""]
    write_results("rollout_engines", {"args": vars(args), "bandwidth_gb_s": bandwidth, "results": results}, lines, out)


if __name__ == "__main__":
    main()
