"""Peak memory per process, data parallel against sharded (FSDP), on SmolLM2-135M-Instruct:
``ppo-rlhf sft`` and one iteration of ``ppo-rlhf ppo`` (full models, separate critic) in one process,
two data parallel (configs/accelerate/gpus_ddp.yaml) and two sharded (configs/accelerate/fsdp.yaml),
on the CPU (gloo), the same global batch; and the largest weight difference between the runs'
checkpoints (they must train alike).

    make smollm2                              # once: runs/smollm2-135m-instruct
    python benchmarks/bench_fsdp_memory.py    # about 15 minutes on 2 cores

"peak" is each process's resident high-water mark (Linux VmHWM) over the whole command; "trained
state" is the trained weights, gradients and AdamW moments in float32 by arithmetic, whole or 1/N.
Each configuration runs with glibc's default allocator and with it told to hand freed memory back
at once.  Writes RESULTS/fsdp_memory.md and .json; the figures: docs/scaling.md.
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

from common import ROOT, SMOLLM2, require_model, write_results

CONFIGS = ROOT / "configs" / "accelerate"
EXAMPLE = ROOT / "examples" / "smollm2_vader"
STEPS, BATCH, MAX_LENGTH, NEW_TOKENS = 6, 8, 64, 32


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


def sft_args(model: Path, work: Path) -> list[str]:
    return ["sft", "--model", str(model), "--data", str(work / "sft.jsonl"), "--steps", str(STEPS), "--batch-size",
            str(BATCH), "--max-length", str(MAX_LENGTH), "--eval-fraction", "0", "--save-every", "0", "--lr", "1e-5",
            "--num-threads", "1"]


def ppo_args(model: Path, work: Path) -> list[str]:
    return ["ppo", "--model", str(model), "--reward-model", str(work / "reward_model"), "--critic", "separate",
            "--prompts", str(EXAMPLE / "prompts.jsonl"), "--chat-template", "--batch-size", str(BATCH),
            "--mini-batch-size", str(BATCH // 2), "--ppo-epochs", "1", "--max-new-tokens", str(NEW_TOKENS),
            "--max-length", str(MAX_LENGTH + NEW_TOKENS), "--temperature", "0.7", "--iterations", "1",
            "--save-every", "0", "--eval-every", "0", "--lr", "1e-5", "--num-threads", "1"]


STAGES = {"sft": (sft_args, "sft", 1), "ppo": (ppo_args, "actor", 2)}  # args, checkpoint compared, models trained

# glibc's allocator keeps freed memory in per-thread arenas (gloo's threads have their own) and
# reuses it late: the resident set then holds far more than the live tensors.  These settings make
# it hand large freed blocks back at once, so the peak follows what the tensors need.
PROMPT_RELEASE = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
MODES = (("one process", None), ("2 processes, data parallel", "gpus_ddp.yaml"), ("2 processes, sharded (FSDP)", "fsdp.yaml"))


def run(stage: str, mode: str, config: str | None, model: Path, work: Path, malloc: dict) -> dict:
    slug = f"{stage}_{mode.split(',')[-1].strip().split()[0].lower()}" + ("_released" if malloc else "")
    out, peak_file = work / slug, work / f"{slug}.peak"
    arguments, compared, _ = STAGES[stage]
    inner = [str(Path(__file__).resolve()), "--child", str(peak_file), "--",
             *arguments(model, work), "--overwrite", "--out", str(out)]
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
        raise SystemExit(f"{stage}, {mode} failed:\n{result.stderr[-3000:]}")
    peaks = [json.loads(Path(f"{peak_file}.{r}").read_text())["peak_kib"] for r in range(1 if config is None else 2)]
    summary = json.loads((out / "summary.json").read_text())
    return {"stage": stage, "mode": mode, "allocator": "glibc, " + (" ".join(f"{k}={v}" for k, v in malloc.items())
                                                                     or "default"),
            "peak_mib_by_process": [round(p / 1024) for p in peaks], "command_seconds": round(seconds, 1),
            "stage_seconds": summary.get("seconds", summary.get("ppo_seconds")),
            "checkpoint": str(out / "checkpoints" / compared)}


def largest_difference(one: str, two: str) -> float:
    from safetensors.torch import load_file

    a, b = load_file(f"{one}/model.safetensors"), load_file(f"{two}/model.safetensors")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--work", default=str(ROOT / "runs" / "bench_fsdp_memory"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rest)
        return
    import torch
    from safetensors import safe_open

    from bench_lora_memory import prepare

    model, work = Path(args.model), Path(args.work)
    require_model(model)
    work.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(line)["prompt"] for line in (EXAMPLE / "prompts.jsonl").open()]
    (work / "sft.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": " It was a lovely day, and I "
                                                         "enjoyed it."}) + "\n" for p in prompts))
    prepare(model, work)  # work/reward_model: an (untrained) reward model on the base; memory does not care
    with safe_open(str(model / "model.safetensors"), "pt") as weights:
        parameters = sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys())
    copy_mib = parameters * 4 / 2**20  # one float32 copy of the model
    runs = [run(stage, mode, config, model, work, malloc) for stage in STAGES for malloc in ({}, PROMPT_RELEASE)
            for mode, config in MODES]
    for r in runs:
        trained = 4 * copy_mib * STAGES[r["stage"]][2]
        r["trained_state_mib"] = round(trained / 2 if "sharded" in r["mode"] else trained)
        reference = next(x for x in runs if x["stage"] == r["stage"] and x["allocator"] == r["allocator"]
                         and "data parallel" in x["mode"])
        r["largest_difference_to_data_parallel"] = largest_difference(reference["checkpoint"], r["checkpoint"])
    report = {"model": str(model), "parameters": parameters, "sft_steps": STEPS, "batch_size": BATCH,
              "max_length": MAX_LENGTH, "ppo_new_tokens": NEW_TOKENS, "torch": torch.__version__,
              "machine": platform.machine(), "cpus": os.cpu_count(), "runs": runs}
    lines = ["# Peak memory per process: data parallel against sharded (FSDP)", "",
             "Command: `python benchmarks/bench_fsdp_memory.py`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, one torch thread per "
             f"process, gloo", "",
             f"SmolLM2-135M-Instruct ({parameters / 1e6:.1f} M parameters, float32; one copy {copy_mib:,.0f} MiB). "
             f"`sft`: full fine-tuning, {STEPS} steps of a global batch of {BATCH} rows of at most {MAX_LENGTH} tokens. "
             f"`ppo`: one iteration, full models (actor, separate critic, reference, reward model), {BATCH} chat "
             f"prompts, {NEW_TOKENS} new tokens, 2 minibatches. Peak: each process's resident high-water mark over the "
             f"whole command (loading, training, writing the checkpoint). Trained state: weights, gradients and AdamW "
             f"moments of what trains, float32, by arithmetic; PPO's frozen reference and reward model (another "
             f"{2 * copy_mib:,.0f} MiB whole) are whole in every process in the first two modes and sharded for "
             f"inference under FSDP. Weight difference: the checkpoint (SFT model, PPO actor) against the "
             f"data-parallel run's.", "",
             "The allocator column: glibc's defaults keep memory freed by gloo's threads and by the gathered-then-freed "
             "layers in the process, so the peak says more about the allocator than about the tensors; "
             "`MALLOC_ARENA_MAX=1 MALLOC_MMAP_THRESHOLD_=65536` has it hand large freed blocks back at once.", "",
             "| stage | run | allocator | peak per process (MiB) | trained state per process (MiB) | seconds | largest weight difference |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['stage']} | {r['mode']} | {r['allocator']} | {' / '.join(f'{p:,}' for p in r['peak_mib_by_process'])} "
                     f"| {r['trained_state_mib']:,} | {r['stage_seconds']} | {r['largest_difference_to_data_parallel']:.2g} |")
    write_results("fsdp_memory", report, lines)


if __name__ == "__main__":
    main()
