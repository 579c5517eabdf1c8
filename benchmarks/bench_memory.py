"""Peak memory of PPO on SmolLM2-135M-Instruct in float32 on the CPU, three ways, every run in a
fresh process; peak is the resident high-water mark (Linux VmHWM).

    make smollm2                                                # once: runs/smollm2-135m-instruct
    python benchmarks/bench_memory.py lengths --before 19c554c --gradient-checkpointing   # ~40 minutes
    python benchmarks/bench_memory.py lora                      # about 3 minutes on 2 cores
    python benchmarks/bench_memory.py fsdp                      # about 15 minutes on 2 cores

``lengths``: one iteration of four full models (actor and separate critic trained with AdamW, frozen
reference and reward model) against response length and micro-batch size, every response exactly
the length asked (no stop id); the ``--compare-lengths`` also with the whole batch in one pass and
on ``--before COMMIT``'s code.  The peak is reset once the models are loaded, so it is one
iteration's; "above models" is that peak less the resident set before it.  RESULTS/memory.*.

``lora``: one iteration with LoRA on one base (the critic an adapter, or a value head on the policy
adapter) against four separate models, with and without gradient checkpointing.  RESULTS/lora_memory.*.

``fsdp``: ``ppo-rlhf sft`` and one iteration of ``ppo-rlhf ppo`` (full models, separate critic) in one
process, two data parallel (configs/accelerate/gpus_ddp.yaml) and two sharded (fsdp.yaml) on gloo,
the same global batch, each with glibc's default allocator and with it told to hand freed memory
back at once; the peak is each process's over the whole command, and the runs' checkpoints are
compared (they must train alike).  RESULTS/fsdp_memory.*.

The figures: docs/devices.md, docs/lora.md, docs/scaling.md and docs/benchmarks.md, "Memory".
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
import tempfile
import time
from pathlib import Path

from common import (ROOT, SMOLLM2, checkouts, command, json_child, memory_kib, require_model, reset_peak,
                    write_results)

PROMPTS = ROOT / "examples" / "smollm2_vader" / "prompts.jsonl"
CONFIGS = ROOT / "configs" / "accelerate"
BATCH, MINIBATCH = 16, 8  # lengths
LORA_MODES = {"four_models": "separate", "lora": "lora", "lora_shared": "shared"}  # mode: its critic
FSDP_STEPS, FSDP_BATCH, FSDP_LENGTH, FSDP_NEW_TOKENS = 6, 8, 64, 32


def prompts(count: int | None = None) -> list[dict]:
    return [json.loads(line) for line in PROMPTS.read_text().splitlines()][:count]


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


# ---------------------------------------------------------------- one iteration, in a child process
def iteration_memory(settings: dict, stop: bool) -> dict:
    """One PPO iteration on ``settings`` (PPOConfig's fields) in this process, its memory and seconds;
    ``stop`` False: no stop id, every response exactly max_new_tokens long."""
    import torch

    import ppo_rlhf
    from ppo_rlhf.config import build_config
    from ppo_rlhf.rollout.generation import TorchGenerator
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig
    from ppo_rlhf.trainers.roles import load_roles

    torch.set_num_threads(1)  # memory does not depend on it; keeps the runs comparable
    torch.manual_seed(0)
    baseline = memory_kib("VmRSS")
    config = build_config(PPOConfig, settings)
    roles = load_roles(config, None)
    stop_id = roles.tokenizer.eos_token_id if stop else -1  # -1 is no token
    generator = TorchGenerator(stop_id, roles.tokenizer.pad_token_id, config.max_new_tokens, do_sample=True,
                               temperature=0.7, seed=0)
    trainer = PPOTrainer(config, roles.reward, model=roles.actor, ref=roles.ref, tokenizer=roles.tokenizer,
                         generator=generator, critic=roles.critic)
    with torch.no_grad():  # weights may be mapped from their files lazily: make them all resident first
        for role in (roles.actor, roles.ref, roles.critic, roles.reward):
            module = getattr(role, "model", role)
            if isinstance(module, torch.nn.Module):
                for tensor in module.state_dict().values():
                    tensor.float().sum()
    loaded, load_peak = memory_kib("VmRSS"), memory_kib("VmHWM")
    reset_peak()
    start = time.perf_counter()
    metrics = trainer.step(prompts(config.batch_size))
    seconds = time.perf_counter() - start
    peak = memory_kib("VmHWM")
    optimizer = getattr(trainer, "optimizer", None)  # an earlier commit's trainer may name it otherwise
    trained = sum(p.numel() for group in optimizer.param_groups for p in group["params"]) if optimizer else None
    return {"code": str(Path(ppo_rlhf.__file__).resolve().parent.parent.parent),
            "response_length": metrics["response_length"], "baseline_mib": baseline / 1024,
            "loaded_mib": loaded / 1024, "load_peak_mib": load_peak / 1024, "iteration_peak_mib": peak / 1024,
            "above_models_mib": (peak - loaded) / 1024, "iteration_seconds": seconds, "trained_parameters": trained}


def in_child(settings: dict, stop: bool, code: Path = ROOT) -> dict:
    """iteration_memory in a fresh process that imports ppo_rlhf from ``code``'s sources."""
    env = {**os.environ, "PYTHONPATH": str(code / "src")}  # before the editable install on sys.path
    result = json_child([__file__, "--child", json.dumps({"settings": settings, "stop": stop})], env)
    if Path(result["code"]) != code.resolve():
        raise RuntimeError(f"the child imported ppo_rlhf from {result['code']}, not {code}")
    return result


def base_settings(base: Path, reward_model: Path, batch: int, minibatch: int, new_tokens: int) -> dict:
    return {"model": str(base), "reward_model": str(reward_model), "critic": "separate", "batch_size": batch,
            "mini_batch_size": minibatch, "ppo_epochs": 1, "max_new_tokens": new_tokens,
            "max_length": 128 + new_tokens, "do_sample": True, "temperature": 0.7, "chat_template": True,
            "lr": 1e-5, "seed": 0}


# ---------------------------------------------------------------- lengths
def lengths(args, base: Path) -> None:
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
            train_micro = (args.train_micro or min(rollout_micro, MINIBATCH)) if rollout_micro else None
            key = (label, length, rollout_micro, train_micro, checkpointing)
            if any(row_key(r) == key for r in results):
                continue
            settings = base_settings(base, reward_model, BATCH, MINIBATCH, length)
            # Only named when set: the code before micro-batching has no such keys.
            extra = {"rollout_micro_batch_size": rollout_micro, "train_micro_batch_size": train_micro,
                     "gradient_checkpointing": checkpointing}
            settings.update({name: value for name, value in extra.items() if value})
            result = in_child(settings, stop=False, code=code)
            results.append({"label": label, **result, "max_new_tokens": length, **extra,
                            "measured": time.strftime("%Y-%m-%d")})
            print(json.dumps(results[-1]), flush=True)
            lengths_report(results, args)  # after every run: a long run is never lost


def row_key(result: dict) -> tuple:
    return (result["label"], result["max_new_tokens"], result["rollout_micro_batch_size"],
            result["train_micro_batch_size"], result.get("gradient_checkpointing", False))


def lengths_report(results: list[dict], args) -> None:
    now = sorted((r for r in results if r["label"] == "now"),
                 key=lambda r: (r.get("gradient_checkpointing", False), r["rollout_micro_batch_size"] is not None,
                                r["max_new_tokens"]))
    before = {r["max_new_tokens"]: r for r in results if r["label"] != "now"}
    dates = ", ".join(sorted({r.get("measured", "?") for r in results}))
    lines = [
        "# Peak memory of one PPO iteration against response length and micro-batch size", "",
        f"Measured {dates} by `{command()}` ({platform.machine()} CPU, float32, one torch thread; rows of an "
        f"earlier run kept with `--keep`). `{Path(args.model).name}` as four full models, batch {BATCH} chat "
        f"prompts, minibatch {MINIBATCH}, one epoch, every response exactly the length shown; the method: "
        "the docstring of benchmarks/bench_memory.py.", "",
        "| new tokens | rollout micro-batch | train micro-batch | grad. checkpointing | iteration peak MiB "
        "| above models MiB | s/iteration |" + (f" peak at {args.before} MiB | now / {args.before} |" if before else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if before else ""),
    ]
    for r in now:
        row = (f"| {r['max_new_tokens']} | {r['rollout_micro_batch_size'] or BATCH} "
               f"| {r['train_micro_batch_size'] or MINIBATCH} | {'yes' if r.get('gradient_checkpointing') else 'no'} "
               f"| {r['iteration_peak_mib']:,.0f} | {r['above_models_mib']:,.0f} | {r['iteration_seconds']:.1f} |")
        old = before.get(r["max_new_tokens"]) if not r.get("gradient_checkpointing") else None
        if before:
            ratio = r["iteration_peak_mib"] / old["iteration_peak_mib"] if old else None
            row += f" {old['iteration_peak_mib']:,.0f} | {ratio:.2f}x |" if old else " | |"
        lines.append(row)
    lines += ["", f"Baseline (Python, torch and transformers imported, no model): {results[0]['baseline_mib']:.0f} "
              f"MiB; models loaded: {results[0]['loaded_mib']:,.0f} MiB.", ""]
    write_results("memory", {"args": vars(args), "results": results}, lines, args.out, echo=False)


# ---------------------------------------------------------------- lora
def lora(args, base: Path) -> None:
    results = []
    with tempfile.TemporaryDirectory(prefix="lora-memory-") as scratch:
        reward_model, reward_adapter = prepare(base, Path(scratch))
        for checkpointing in (False, True):
            for mode, critic in LORA_MODES.items():
                settings = base_settings(base, reward_model, args.batch_size, args.batch_size // 2,
                                         args.max_new_tokens)
                settings.update({"critic": critic, "lora": mode != "four_models",
                                 "gradient_checkpointing": checkpointing})
                if settings["lora"]:
                    settings["reward_model"] = str(reward_adapter)
                result = in_child(settings, stop=True)
                results.append({"mode": mode, "gradient_checkpointing": checkpointing, **result,
                                "response_tokens": result["response_length"] * args.batch_size})
                print(json.dumps(results[-1]), flush=True)
    lines = [
        "# LoRA on one base: peak memory of one PPO iteration", "",
        f"Measured {time.strftime('%Y-%m-%d')} by `{command()}` ({platform.machine()} CPU, float32, one torch "
        f"thread). Base: `{Path(args.model).name}`; batch of {args.batch_size} chat prompts from "
        f"examples/smollm2_vader, minibatch {args.batch_size // 2}, one PPO epoch, up to {args.max_new_tokens} new "
        "tokens sampled at temperature 0.7, seed 0 (every mode generates the same responses: the adapters start "
        "at zero).", "",
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
    lines += ["", f"Baseline (Python, torch and transformers imported, no model): {results[0]['baseline_mib']:.0f} "
              "MiB. Each ratio compares with four models under the same gradient-checkpointing setting. "
              "Target: LoRA at most 0.4x the four-model peak.", ""]
    write_results("lora_memory", {"args": vars(args), "results": results}, lines, args.out)


# ---------------------------------------------------------------- fsdp
# glibc's allocator keeps freed memory in per-thread arenas (gloo's threads have their own) and
# reuses it late: the resident set then holds far more than the live tensors.  These settings make
# it hand large freed blocks back at once, so the peak follows what the tensors need.
PROMPT_RELEASE = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
LAYOUTS = (("one process", None), ("2 processes, data parallel", "gpus_ddp.yaml"),
           ("2 processes, sharded (FSDP)", "fsdp.yaml"))


def cli_child(peak_file: str, arguments: list[str]) -> None:
    """One process of a run: the ppo-rlhf command, then this process's peak into ``peak_file``."""
    from ppo_rlhf.cli import main

    code = main(arguments)  # takes the process group down at its end: the rank comes from the launcher
    Path(f"{peak_file}.{os.environ.get('RANK', '0')}").write_text(json.dumps({"peak_kib": memory_kib("VmHWM"),
                                                                              "code": code}))
    sys.stdout.flush()
    os._exit(code)  # as the ppo-rlhf command leaves a multi-process launch


def stage_arguments(stage: str, model: Path, work: Path) -> list[str]:
    common = ["--model", str(model), "--batch-size", str(FSDP_BATCH), "--save-every", "0", "--lr", "1e-5",
              "--num-threads", "1"]
    if stage == "sft":
        return ["sft", *common, "--data", str(work / "sft.jsonl"), "--steps", str(FSDP_STEPS), "--max-length",
                str(FSDP_LENGTH), "--eval-fraction", "0"]
    return ["ppo", *common, "--reward-model", str(work / "reward_model"), "--critic", "separate", "--prompts",
            str(PROMPTS), "--chat-template", "--mini-batch-size", str(FSDP_BATCH // 2), "--ppo-epochs", "1",
            "--max-new-tokens", str(FSDP_NEW_TOKENS), "--max-length", str(FSDP_LENGTH + FSDP_NEW_TOKENS),
            "--temperature", "0.7", "--iterations", "1", "--eval-every", "0"]


STAGES = {"sft": ("sft", 1), "ppo": ("actor", 2)}  # stage: the checkpoint compared, the models trained


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp_run(stage: str, layout: str, config: str | None, model: Path, work: Path, malloc: dict) -> dict:
    slug = f"{stage}_{layout.split(',')[-1].strip().split()[0].lower()}" + ("_released" if malloc else "")
    out, peak_file = work / slug, work / f"{slug}.peak"
    inner = [str(Path(__file__).resolve()), "--cli-child", str(peak_file),
             *stage_arguments(stage, model, work), "--overwrite", "--out", str(out)]
    launcher = [] if config is None else ["-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
                                          "--num_processes", "2", "--main_process_port", str(free_port())]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *launcher, *inner], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **malloc})
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{stage}, {layout} failed:\n{done.stderr[-3000:]}")
    peaks = [json.loads(Path(f"{peak_file}.{r}").read_text())["peak_kib"] for r in range(1 if config is None else 2)]
    summary = json.loads((out / "summary.json").read_text())
    allocator = " ".join(f"{k}={v}" for k, v in malloc.items()) or "default"
    return {"stage": stage, "mode": layout, "allocator": f"glibc, {allocator}",
            "peak_mib_by_process": [round(p / 1024) for p in peaks], "command_seconds": round(seconds, 1),
            "stage_seconds": summary.get("seconds", summary.get("ppo_seconds")),
            "checkpoint": str(out / "checkpoints" / STAGES[stage][0])}


def largest_difference(one: str, two: str) -> float:
    from safetensors.torch import load_file

    a, b = load_file(f"{one}/model.safetensors"), load_file(f"{two}/model.safetensors")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def fsdp(args, model: Path) -> None:
    import torch
    from safetensors import safe_open

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "sft.jsonl").write_text("".join(json.dumps({"prompt": row["prompt"], "completion": " It was a lovely "
                                                        "day, and I enjoyed it."}) + "\n" for row in prompts()))
    prepare(model, work)  # work/reward_model: an (untrained) reward model on the base
    with safe_open(str(model / "model.safetensors"), "pt") as weights:
        parameters = sum(math.prod(weights.get_slice(k).get_shape()) for k in weights.keys())
    copy_mib = parameters * 4 / 2**20  # one float32 copy of the model
    runs = [fsdp_run(stage, layout, config, model, work, malloc) for stage in STAGES
            for malloc in ({}, PROMPT_RELEASE) for layout, config in LAYOUTS]
    for r in runs:
        trained = 4 * copy_mib * STAGES[r["stage"]][1]  # weights, gradients and AdamW's two moments
        r["trained_state_mib"] = round(trained / 2 if "sharded" in r["mode"] else trained)
        reference = next(x for x in runs if x["stage"] == r["stage"] and x["allocator"] == r["allocator"]
                         and "data parallel" in x["mode"])
        r["largest_difference_to_data_parallel"] = largest_difference(reference["checkpoint"], r["checkpoint"])
    report = {"model": str(model), "parameters": parameters, "sft_steps": FSDP_STEPS, "batch_size": FSDP_BATCH,
              "max_length": FSDP_LENGTH, "ppo_new_tokens": FSDP_NEW_TOKENS, "torch": torch.__version__,
              "machine": platform.machine(), "cpus": os.cpu_count(), "runs": runs}
    lines = ["# Peak memory per process: data parallel against sharded (FSDP)", "",
             f"Command: `{command()}`  ",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, one torch thread per "
             "process, gloo", "",
             f"SmolLM2-135M-Instruct ({parameters / 1e6:.1f} M parameters, float32; one copy {copy_mib:,.0f} MiB). "
             f"`sft`: {FSDP_STEPS} steps of a global batch of {FSDP_BATCH} rows of at most {FSDP_LENGTH} tokens. "
             f"`ppo`: one iteration, full models, {FSDP_BATCH} chat prompts, {FSDP_NEW_TOKENS} new tokens, 2 "
             "minibatches. Trained state: weights, gradients and AdamW moments of what trains, float32, by "
             "arithmetic. Weight difference: the checkpoint against the data-parallel run's. The method and the "
             "allocator settings: the docstring of benchmarks/bench_memory.py.", "",
             "| stage | run | allocator | peak per process (MiB) | trained state per process (MiB) | seconds "
             "| largest weight difference |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        peaks = " / ".join(f"{p:,}" for p in r["peak_mib_by_process"])
        lines.append(f"| {r['stage']} | {r['mode']} | {r['allocator']} | {peaks} | {r['trained_state_mib']:,} "
                     f"| {r['stage_seconds']} | {r['largest_difference_to_data_parallel']:.2g} |")
    write_results("fsdp_memory", report, lines, args.out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("lengths", "lora", "fsdp"))
    parser.add_argument("--model", default=str(SMOLLM2), help="base causal LM folder")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    lengths_options = parser.add_argument_group("lengths")
    lengths_options.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512],
                                 help="response lengths of the micro-batched sweep")
    lengths_options.add_argument("--micro-batch", type=int, default=4, help="rollout micro-batch size of the sweep")
    lengths_options.add_argument("--compare-lengths", type=int, nargs="*", default=[128, 512],
                                 help="lengths also measured with the whole batch in one pass (and with --before)")
    lengths_options.add_argument("--train-micro", type=int, default=None,
                                 help="gradient-accumulation micro-batch of the micro-batched rows (default: the "
                                      "rollout's, at most the minibatch)")
    lengths_options.add_argument("--before", help="also measure this commit's code (in a git worktree, removed after)")
    lengths_options.add_argument("--gradient-checkpointing", action="store_true",
                                 help="also run the micro-batched sweep with gradient checkpointing")
    lengths_options.add_argument("--keep", action="store_true",
                                 help="keep the rows already in OUT/memory.json and measure only the missing ones")
    lora_options = parser.add_argument_group("lora")
    lora_options.add_argument("--batch-size", type=int, default=8)
    lora_options.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument_group("fsdp").add_argument("--work", default=str(ROOT / "runs" / "bench_fsdp_memory"),
                                                   help="the runs' folders")
    args = parser.parse_args()
    base = Path(args.model).resolve()
    require_model(base)
    {"lengths": lengths, "lora": lora, "fsdp": fsdp}[args.what](args, base)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        request = json.loads(sys.argv[2])
        print(json.dumps(iteration_memory(request["settings"], request["stop"])))
    elif sys.argv[1:2] == ["--cli-child"]:
        cli_child(sys.argv[2], sys.argv[3:])
    else:
        main()
