"""The GPU check's measurements (benchmarks/gpu_check.sh runs it): the padding-free passes and the
fused output layer against the padded passes on the device, one PPO iteration's seconds and
peak memory, and the generation server (issue 59) -- a server and a trainer sharing one GPU, and
the two-GPU layout (the server on the second) -- synchronous and with --max-staleness 1, the
weights pushed over NCCL, on models built from configs (no downloaded weights).

    python benchmarks/gpu_check.py --device cuda     # on the GPU machine
    python benchmarks/gpu_check.py --device cpu      # the dry run, here (the server's checks need vLLM:
                                                     #   .venv-vllm/bin/python ... --checks server)

Prints one JSON object per check, and writes them all to --out (a JSON file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))  # zoo: tiny models and tokenizers built from configs


def equivalence(device: str) -> dict:
    """Each zoo architecture: the fused and packed passes' log-probs, entropies and gradients against
    the padded pass through the model's own logits, in float32 and under bf16 autocast."""
    from zoo import make_config, make_tokenizer
    from transformers import AutoModelForCausalLM

    from ppo_rlhf.rollout.passes import PassPlan, response_stats
    from ppo_rlhf.rollout.sequences import Sequences

    rows = {}
    for arch in ("gpt2", "llama", "qwen2", "granite", "gemma", "gemma2"):
        tokenizer = make_tokenizer(arch)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_config(arch, tokenizer)).to(device).eval()
        generator = torch.Generator().manual_seed(1)
        lengths = torch.tensor([9, 3, 5, 1, 7, 2])
        response_mask = (torch.arange(9)[None, :] < lengths[:, None]).long()
        prompt_mask = torch.ones(6, 7, dtype=torch.long)
        prompt_mask[1, :2] = prompt_mask[2, :3] = 0
        sequences = Sequences(torch.randint(3, len(tokenizer), (6, 7), generator=generator), prompt_mask,
                              torch.randint(3, len(tokenizer), (6, 9), generator=generator) * response_mask,
                              response_mask)
        sequences = Sequences(*(t.to(device) for t in (sequences.prompt_ids, sequences.prompt_mask,
                                                       sequences.response_ids, sequences.response_mask)))
        own = PassPlan(0.7, tokenizer.pad_token_id)
        for precision in ("float32", "bf16"):
            results = []
            for plan in (own, dataclasses.replace(own, fused=True), dataclasses.replace(own, fused=True, pack=True)):
                model.zero_grad()
                with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    stats = response_stats(model, sequences, plan, entropy=True, entropy_grad=True)
                mask = sequences.response_mask.bool()
                (stats.logprobs[mask].sum() + 0.1 * stats.entropy[mask].sum()).backward()
                grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
                results.append((stats.logprobs[mask].detach(), grads))
            (logprobs, grads), *others = results
            rows[f"{arch}/{precision}"] = {
                name: {"logprob_gap": float((got - logprobs).abs().max()),
                       "grad_gap": float((got_grads - grads).abs().max() / grads.abs().max())}
                for name, (got, got_grads) in zip(("fused", "packed"), others)}
    return {"check": "passes equal the padded pass", "device": device, "results": rows}


def iteration(device: str, size: str) -> dict:
    """One PPO iteration's passes (old, reference, update) on a SmolLM2-135M-shaped Llama built from
    its config (random weights), 32 responses of 64-1,024 tokens: seconds and peak device memory,
    padded against packed + fused."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from zoo import make_tokenizer

    from ppo_rlhf.config import build_config
    from ppo_rlhf.trainers.ppo import Experience, PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig
    from bench_long_responses import batch, lengths

    tokenizer = make_tokenizer("llama")
    shape = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152) if size == "smollm2" else \
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=len(tokenizer))
    config = LlamaConfig(max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, **shape)
    rows, longest = (32, 1024) if size == "smollm2" else (8, 64)
    results = {}
    for way, faster in (("padded", False), ("packed + fused", True)):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        ppo = build_config(PPOConfig, {
            "model": "config", "reward_fn": "ppo_rlhf.rewards:answer_match", "estimator": "grpo", "samples_per_prompt": 2,
            "batch_size": rows, "mini_batch_size": rows // 4, "ppo_epochs": 1, "lr": 1e-6, "max_new_tokens": longest,
            "max_length": longest + 65, "device": device, "mixed_precision": "bf16" if device == "cuda" else "no",
            "padding_free": faster, "fused_output_layer": faster, "share_prompts": False, "out": "unused"})
        trainer = PPOTrainer(ppo, model=model, tokenizer=tokenizer)
        sequences = batch(tokenizer, lengths(rows, max(longest // 16, 2), longest), prompt_length=64)
        sequences = dataclasses.replace(sequences, prompt_ids=sequences.prompt_ids.to(device),
                                        prompt_mask=sequences.prompt_mask.to(device),
                                        response_ids=sequences.response_ids.to(device),
                                        response_mask=sequences.response_mask.to(device), loss_mask=None)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.no_grad():
            logprobs, ref_logprobs, kl, _ = trainer.old_and_reference_passes(sequences)
        advantages = torch.where(sequences.loss_mask.bool(), 1.0, 0.0)
        scores = torch.zeros(rows, device=device)
        stats = trainer.update(Experience(sequences, logprobs, ref_logprobs, None, kl, torch.zeros_like(kl), advantages,
                                          advantages, scores, scores))
        if device == "cuda":
            torch.cuda.synchronize()
        results[way] = {"seconds": round(time.perf_counter() - start, 3), "pg_loss": stats["pg_loss"],
                        "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20) if device == "cuda" else None,
                        "plan": trainer.pass_plan.describe()}
    return {"check": "one iteration's passes", "device": device, "model": size, "rows": rows, "results": results}


def server_runs(device: str, layout: str, scratch: Path) -> dict:
    """A generation server (ppo-rlhf serve) and a trainer on the built-in task with a tiny Llama built
    from its config: ``one-gpu``, both on GPU 0 (the server's memory share 0.3); ``two-gpus``, the
    server alone on GPU 1.  Each: a synchronous run and one at --max-staleness 1, the weights pushed
    over NCCL on a GPU (shared memory on the CPU dry run).  Per run: the probe's largest gap after
    the pushes, seconds an iteration, the push's seconds, the staleness reached, the trainer's peak
    memory where CUDA tells it."""
    import importlib.util
    import os
    import subprocess

    check = {"check": f"generation server, {layout}", "device": device}
    if importlib.util.find_spec("vllm") is None:
        return {**check, "skipped": "vLLM is not installed in this Python (pip install vllm)"}
    if layout == "two-gpus" and (device != "cuda" or torch.cuda.device_count() < 2):
        count = torch.cuda.device_count() if device == "cuda" else 0
        return {**check, "skipped": f"{count} GPU(s) here; the layout needs two"}
    from transformers import AutoModelForCausalLM, LlamaConfig
    from zoo import make_tokenizer

    folder = scratch / "server-model"
    tokenizer = make_tokenizer("llama")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    on_gpu = device == "cuda"
    visible = {"one-gpu": "0", "two-gpus": "1"}[layout]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"CUDA_VISIBLE_DEVICES": visible} if on_gpu else {})}
    serve = [sys.executable, "-m", "ppo_rlhf.cli", "serve", "--model", str(folder), "--port", "0", "--max-model-len",
             "64", "--device", device, "--memory-utilization", "0.3" if on_gpu else "0.01"]
    if on_gpu:
        serve.append("--nccl-weight-transfer")
    process = subprocess.Popen(serve, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url, output = None, []
    try:
        for line in process.stdout:
            output.append(line)
            if "ready at " in line:
                url = line.rsplit("ready at ", 1)[1].strip()
                break
        if url is None:
            return {**check, "failed": "the server did not start", "log": "".join(output[-20:])}
        runs = {}
        for staleness in (0, 1):
            out = scratch / f"server-{layout}-staleness{staleness}"
            trainer = [sys.executable, "-m", "ppo_rlhf.cli", "ppo", "--task", "doubling", "--model", str(folder),
                       "--out", str(out), "--overwrite", "--rollout-engine", "vllm-server", "--server-url", url,
                       "--weight-transfer", "nccl" if on_gpu else "shared-memory", "--max-staleness", str(staleness),
                       "--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward", "--batch-size", "32",
                       "--mini-batch-size", "32", "--ppo-epochs", "1", "--max-new-tokens", "7", "--max-length", "19",
                       "--iterations", "6", "--eval-every", "0", "--eval-size", "16", "--no-eval-sampled",
                       "--device", device]
            done = subprocess.run(trainer, capture_output=True, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1",
                                       **({"CUDA_VISIBLE_DEVICES": "0"} if on_gpu else {})})
            if done.returncode != 0:
                runs[staleness] = {"failed": done.stderr[-2000:]}
                continue
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in records if r.get("step", 0) > 0]
            runs[staleness] = {
                "probe_gap_max": max(r.get("rollout/probe_gap", 0.0) for r in steps),
                "iteration_s": sum(r["time/iteration"] for r in steps[1:]) / max(len(steps) - 1, 1),
                "push_s": sum(r.get("time/weight_sync", 0.0) for r in steps[1:]) / max(len(steps) - 1, 1),
                "staleness_max": max(r.get("staleness/max", 0.0) for r in steps),
                "logprob_diff_max": max(r.get("rollout/logprob_diff_max", 0.0) for r in steps)}
        return {**check, "runs": runs}
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="smollm2", choices=("smollm2", "tiny"))
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--checks", default="passes,iteration,server",
                        help="comma-separated: passes, iteration, server (the generation server's two layouts)")
    parser.add_argument("--scratch", default="runs/gpu_check_server")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    wanted = args.checks.split(",")
    checks = []
    if "passes" in wanted:
        checks.append(equivalence(args.device))
    if "iteration" in wanted:
        checks.append(iteration(args.device, args.size))
    if "server" in wanted:
        scratch = Path(args.scratch)
        scratch.mkdir(parents=True, exist_ok=True)
        checks += [server_runs(args.device, layout, scratch) for layout in ("one-gpu", "two-gpus")]
    for check in checks:
        print(json.dumps(check), flush=True)
    Path(args.out).write_text(json.dumps(checks, indent=2) + "\n")


if __name__ == "__main__":
    main()
