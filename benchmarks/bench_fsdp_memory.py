"""Peak memory per process of ``ppo-rlhf sft`` on SmolLM2-135M-Instruct (full fine-tuning):
one process, two processes data parallel (configs/accelerate/gpus_ddp.yaml) and two processes
sharded (configs/accelerate/fsdp.yaml), all on the CPU (gloo), with the same global batch; and
the largest weight difference between the checkpoints (the runs must train alike).

    make smollm2                              # once: runs/smollm2-135m-instruct
    python benchmarks/bench_fsdp_memory.py    # a few minutes on 2 cores

"peak" is each process's resident high-water mark (Linux VmHWM) over the whole command: loading
the model (every process loads it whole before sharding it), training, gathering the checkpoint.
"training state" is what the trained model's weights, gradients and AdamW moments take in float32
by arithmetic (4 copies of the parameters), whole or 1/N of it.  Writes RESULTS/fsdp_memory.md and .json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = ROOT / "configs" / "accelerate"
STEPS, BATCH, MAX_LENGTH = 6, 8, 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(peak_file: str, args: list[str]) -> None:
    """One process of a run: the sft command, then this process's peak into ``peak_file``."""
    from ppo_rlhf.cli import main

    code = main(args)  # takes the process group down at its end: the rank comes from the launcher

    peak = next(int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmHWM:"))
    Path(f"{peak_file}.{os.environ.get('RANK', '0')}").write_text(json.dumps({"peak_kib": peak, "code": code}))
    sys.stdout.flush()
    os._exit(code)  # as the ppo-rlhf command leaves a multi-process launch


def sft_args(model: Path, data: Path, out: Path) -> list[str]:
    return ["sft", "--model", str(model), "--data", str(data), "--steps", str(STEPS), "--batch-size", str(BATCH),
            "--max-length", str(MAX_LENGTH), "--eval-fraction", "0", "--save-every", "0", "--lr", "1e-5",
            "--num-threads", "1", "--overwrite", "--out", str(out)]


# glibc's allocator keeps freed memory in per-thread arenas (gloo's threads have their own) and
# reuses it late: the resident set then holds far more than the live tensors.  These settings make
# it hand large freed blocks back at once, so the peak follows what the tensors need.
PROMPT_RELEASE = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}


def run(name: str, config: str | None, model: Path, data: Path, work: Path, malloc: dict) -> dict:
    slug = name.split(",")[-1].strip().split()[0].lower() + ("_released" if malloc else "")
    out, peak_file = work / slug, work / f"{slug}.peak"
    inner = [str(Path(__file__).resolve()), "--child", str(peak_file), "--", *sft_args(model, data, out)]
    if config is None:
        command = [sys.executable, *inner]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
                   "--num_processes", "2", "--main_process_port", str(free_port()), *inner]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **malloc}
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    peaks = [json.loads(Path(f"{peak_file}.{r}").read_text())["peak_kib"] for r in range(1 if config is None else 2)]
    summary = json.loads((out / "summary.json").read_text())
    return {"name": name, "allocator": "glibc, " + (" ".join(f"{k}={v}" for k, v in malloc.items()) or "default"),
            "processes": len(peaks), "peak_mib_by_process": [round(p / 1024) for p in peaks],
            "command_seconds": round(seconds, 1), "sft_seconds": summary["seconds"],
            "checkpoint": str(out / "checkpoints" / "sft")}


def largest_difference(one: str, two: str) -> float:
    from safetensors.torch import load_file

    a, b = load_file(f"{one}/model.safetensors"), load_file(f"{two}/model.safetensors")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "runs" / "smollm2-135m-instruct"))
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench_fsdp_memory"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rest)
        return
    import torch
    from safetensors import safe_open

    model, work = Path(args.model), Path(args.work)
    if not (model / "config.json").is_file():
        raise SystemExit(f"{model}: no model folder; run `make smollm2` first")
    work.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(line)["prompt"] for line in (ROOT / "examples" / "smollm2_vader" / "prompts.jsonl").open()]
    data = work / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": " It was a lovely day, and I enjoyed it."}) + "\n"
                            for p in prompts))
    with safe_open(str(model / "model.safetensors"), "pt") as weights:
        parameters = sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys())
    state_mib = parameters * 4 * 4 / 2**20  # float32 weights, gradients, two AdamW moments
    runs = [run(name, config, model, data, work, malloc) for malloc in ({}, PROMPT_RELEASE)
            for name, config in (("one process", None), ("2 processes, data parallel", "gpus_ddp.yaml"),
                                 ("2 processes, sharded (FSDP)", "fsdp.yaml"))]
    for r in runs:
        r["training_state_mib"] = round(state_mib if "sharded" not in r["name"] else state_mib / 2)
        r["largest_difference_to_one_process"] = largest_difference(runs[0]["checkpoint"], r["checkpoint"])
    report = {"model": str(model), "parameters": parameters, "steps": STEPS, "batch_size": BATCH,
              "max_length": MAX_LENGTH, "torch": torch.__version__, "machine": platform.machine(),
              "cpus": os.cpu_count(), "runs": runs}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fsdp_memory.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# Peak memory per process: sft data parallel against sharded (FSDP)", "",
             "Command: `python benchmarks/bench_fsdp_memory.py`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, one torch thread per "
             f"process, gloo", "",
             f"`ppo-rlhf sft` on SmolLM2-135M-Instruct ({parameters / 1e6:.1f} M parameters, float32), full fine-tuning, "
             f"{STEPS} steps of a global batch of {BATCH} rows, at most {MAX_LENGTH} tokens. Peak: each process's "
             f"resident high-water mark over the whole command (loading, training, writing the checkpoint). "
             f"Training state: weights, gradients and AdamW moments of the trained model in float32, by arithmetic.", "",
             "The second set of rows runs with glibc told to hand freed memory back at once (`MALLOC_ARENA_MAX=1 "
             "MALLOC_MMAP_THRESHOLD_=65536`): with its defaults, memory freed by gloo's threads and by the "
             "gathered-then-freed layers stays in the process, and the peak says more about the allocator than "
             "about the tensors.", "",
             "| run | allocator | peak per process (MiB) | training state per process (MiB) | sft seconds | largest weight difference to one process |",
             "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['name']} | {r['allocator']} | {' / '.join(map(str, r['peak_mib_by_process']))} | {r['training_state_mib']:,} "
                     f"| {r['sft_seconds']} | {r['largest_difference_to_one_process']:.2g} |")
    (RESULTS / "fsdp_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
