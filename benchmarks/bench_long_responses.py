"""Long, uneven responses on SmolLM2-135M-Instruct, float32, on the CPU (docs/design.md, "Long
responses"): the trainer's passes on one batch of 64 responses of 32-1,024 tokens, padding-free
with the fused output layer (the defaults) against the padded passes
(``--no-padding-free --no-fused-output-layer``), each way in a process of its own.

    make smollm2                                         # once: the model as a folder
    python benchmarks/bench_long_responses.py            # the 64-response batch, both ways
    python benchmarks/bench_long_responses.py --longest  # then: the longest batch each way fits in 16 GiB

Results: benchmarks/results/long_responses.{json,md}; the batch and what is measured:
docs/benchmarks.md, "Long responses".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from common import HERE, RESULTS, SMOLLM2, json_child, write_results

MODEL = SMOLLM2
WAYS = {"before": {"padding_free": False, "fused_output_layer": False},
        "after": {"padding_free": True, "fused_output_layer": True}}


class PeakMemory:
    """The resident set's peak above its level at the start, sampled every few milliseconds."""

    def __init__(self, every: float = 0.005):
        self.every, self.peak, self.running = every, 0, False

    @staticmethod
    def resident() -> int:
        with open("/proc/self/statm") as file:
            return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self):
        self.start, self.peak, self.running = self.resident(), 0, True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.resident() - self.start)
            time.sleep(self.every)

    def __exit__(self, *args) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.resident() - self.start)


def lengths(rows: int, shortest: int, longest: int) -> list[int]:
    """``rows`` response lengths from ``shortest`` to ``longest``, geometrically spaced."""
    return [round(shortest * (longest / shortest) ** (i / (rows - 1))) for i in range(rows)]


def batch(tokenizer, response_lengths: list[int], prompt_length: int, seed: int = 0):
    """Rows of random token ids (the passes' cost does not depend on which), each response ending
    at its length with EOS."""
    from ppo_rlhf.rollout.sequences import Sequences

    generator = torch.Generator().manual_seed(seed)
    rows, width = len(response_lengths), max(response_lengths)
    vocabulary = len(tokenizer)
    prompt_ids = torch.randint(10, vocabulary, (rows, prompt_length), generator=generator)
    response_ids = torch.randint(10, vocabulary, (rows, width), generator=generator)
    mask = (torch.arange(width)[None, :] < torch.tensor(response_lengths)[:, None]).long()
    rows_index = torch.arange(rows)
    response_ids[rows_index, torch.tensor(response_lengths) - 1] = tokenizer.eos_token_id
    response_ids = torch.where(mask.bool(), response_ids, tokenizer.pad_token_id)
    return Sequences(prompt_ids, torch.ones_like(prompt_ids), response_ids, mask)


def trainer_for(way: str, micro_batch: int, threads: int):
    from ppo_rlhf.config import build_config
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    torch.set_num_threads(threads)
    config = build_config(PPOConfig, {
        "model": str(MODEL), "reward_fn": "ppo_rlhf.rewards:answer_match", "estimator": "grpo", "samples_per_prompt": 2,
        "kl_in": "reward", "batch_size": 64, "mini_batch_size": 16, "ppo_epochs": 1, "lr": 1e-6,
        "max_new_tokens": 1024, "max_length": 1024 + 64 + 1, "rollout_micro_batch_size": micro_batch,
        "train_micro_batch_size": micro_batch, "share_prompts": False, "num_threads": threads, "out": "unused",
        **WAYS[way]})
    from ppo_rlhf.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(str(MODEL))
    torch.manual_seed(0)
    trainer = PPOTrainer(config, model=load_causal_lm(str(MODEL), "float32"), tokenizer=tokenizer)
    return trainer, tokenizer


def passes(way: str, threads: int) -> dict:
    """Old + reference passes, then one epoch of the update, on the 64-response batch."""
    from ppo_rlhf.trainers.ppo import Experience

    trainer, tokenizer = trainer_for(way, micro_batch=4, threads=threads)
    sequences = batch(tokenizer, lengths(64, 32, 1024), prompt_length=64)
    real = int(sequences.attention_mask.sum())
    with torch.no_grad(), PeakMemory() as forward_memory:
        start = time.perf_counter()
        logprobs, ref_logprobs, kl, _ = trainer.old_and_reference_passes(sequences)
        forward_seconds = time.perf_counter() - start
    mask = sequences.loss_mask
    advantages = torch.where(mask.bool(), torch.linspace(-1, 1, 64)[:, None].expand_as(logprobs), 0.0)
    scores = torch.zeros(64)
    experience = Experience(sequences, logprobs, ref_logprobs, None, kl, torch.zeros_like(kl), advantages,
                            advantages, scores, scores)
    trainer.minibatch_rng.manual_seed(0)
    with PeakMemory() as update_memory:
        start = time.perf_counter()
        stats = trainer.update(experience)
        update_seconds = time.perf_counter() - start
    return {"way": way, "plan": trainer.pass_plan.describe(), "rows": 64, "real_tokens": real,
            "padded_positions": int(sequences.prompt_ids.numel() + sequences.response_ids.numel()),
            "forward_seconds": round(forward_seconds, 1), "update_seconds": round(update_seconds, 1),
            "tokens_per_s": round(real * 3 / (forward_seconds + update_seconds), 1),  # old, reference, update
            "forward_peak_mib": round(forward_memory.peak / 2**20), "update_peak_mib": round(update_memory.peak / 2**20),
            "pg_loss": stats["pg_loss"], "old_logprob_sum": float(logprobs[mask.bool()].double().sum()),
            "kl_sum": float(kl[mask.bool()].double().sum())}


def fits(way: str, rows: int, threads: int) -> bool:
    """Whether one update micro-batch of ``rows`` 1,024-token responses runs in 16 GiB (a child process)."""
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench_long_responses as b; "
            f"b.one_update({way!r}, {rows}, {threads})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return done.returncode == 0


def one_update(way: str, rows: int, threads: int) -> None:
    """In a child: cap the data segment (heap and private mappings) at 16 GiB, then one update of
    ``rows`` long responses in one micro-batch."""
    from ppo_rlhf.trainers.ppo import Experience

    trainer, tokenizer = trainer_for(way, micro_batch=rows, threads=threads)
    trainer.config.mini_batch_size = rows
    trainer.config.batch_size = rows
    sequences = batch(tokenizer, [1024] * rows, prompt_length=64)
    cap = 16 * 2**30
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))  # heap and private mappings: what tensors take
    logprobs = torch.zeros(sequences.response_ids.shape)
    experience = Experience(sequences, logprobs, logprobs, None, logprobs, logprobs, logprobs + 1, logprobs,
                            torch.zeros(rows), torch.zeros(rows))
    trainer.update(experience)


def longest(way: str, threads: int) -> int:
    """The most 1,024-token responses one update micro-batch takes in 16 GiB (doubling, then halving)."""
    low, high = 0, 1
    while fits(way, high, threads):
        low, high = high, high * 2
        if high > 256:
            return low
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(way, middle, threads) else (low, middle)
    return low


def report(summary: dict) -> str:
    """The results file's text, from the summary the JSON file holds."""
    before = summary["before"]
    lines = ["# Long, uneven responses", "", f"`python benchmarks/bench_long_responses.py` "
             f"({summary['machine']}, {summary['date']}): SmolLM2-135M-Instruct in float32, 64 responses of 32-1,024 "
             f"tokens (log-uniform, {before['real_tokens']:,} real tokens, {before['padded_positions']:,} padded "
             f"positions), old + reference passes, then one epoch of 4 minibatches of 16, 4 rows a micro-batch.", "",
             "| | passes | tokens/s | old + reference (s) | update (s) | peak memory, passes / update (MiB) |",
             "|---|---|---|---|---|---|"]
    for way in ("before", "after"):
        r = summary[way]
        lines.append(f"| {way} | {r['plan']} | {r['tokens_per_s']} | {r['forward_seconds']} | {r['update_seconds']} | "
                     f"{r['forward_peak_mib']:,} / {r['update_peak_mib']:,} |")
    lines += ["", f"Tokens/s {summary['tokens_per_s_ratio']}x; the update's peak memory {summary['update_peak_ratio']}x; "
              f"the policy loss differs by {summary['pg_loss_difference']:.2g}."]
    if "longest_in_16_gib" in summary:
        longest_run = summary["longest_in_16_gib"]
        lines += ["", f"`python benchmarks/bench_long_responses.py --longest` ({longest_run['machine']}, "
                      f"{longest_run['date']}): the most 1,024-token responses (64-token prompts) one update "
                      f"micro-batch takes with the data segment capped at 16 GiB: before {longest_run['before']}, "
                      f"after {longest_run['after']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--longest", action="store_true",
                        help="only the longest batch each way fits in 16 GiB, added to the results file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(passes(args.child, args.threads)))
        return
    if not (MODEL / "config.json").is_file():
        raise SystemExit(f"no {MODEL}: run `make smollm2` first")
    results_file = RESULTS / "long_responses.json"
    machine = f"{platform.processor() or platform.machine()}, {args.threads} torch threads, torch {torch.__version__}"
    if args.longest:  # slow on its own (a search of full updates): kept apart from the batch's figures
        if not results_file.is_file():
            raise SystemExit(f"no {results_file}: run `python {Path(__file__).name}` first")
        summary = json.loads(results_file.read_text())
        summary["longest_in_16_gib"] = {"machine": machine, "date": time.strftime("%Y-%m-%d")}
        for way in ("before", "after"):
            summary["longest_in_16_gib"][way] = longest(way, args.threads)
            print(way, summary["longest_in_16_gib"][way], flush=True)
    else:
        results = {}
        for way in ("before", "after"):  # each in a process of its own: its peak memory its own
            results[way] = json_child([__file__, "--child", way, "--threads", args.threads])
            print(results[way], flush=True)
        before, after = results["before"], results["after"]
        summary = {"machine": machine, "date": time.strftime("%Y-%m-%d"), **results,
                   "tokens_per_s_ratio": round(after["tokens_per_s"] / before["tokens_per_s"], 2),
                   "update_peak_ratio": round(after["update_peak_mib"] / before["update_peak_mib"], 2),
                   "pg_loss_difference": abs(after["pg_loss"] - before["pg_loss"])}
    write_results("long_responses", summary, report(summary))


if __name__ == "__main__":
    main()
