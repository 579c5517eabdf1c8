"""A multi-turn SFT warm-up, one row per assistant turn (before issue 63) against one row per
conversation (after): rows, tokens per epoch, and the seconds of a fixed number of steps on a tiny
model.  Written to benchmarks/results/sft_rows.{json,md}.

    python benchmarks/bench_sft_rows.py --before a980e0d       # the revision with one row per turn
    python benchmarks/bench_sft_rows.py --before a980e0d --steps 2 --traces 64 --repeats 1   # quicker

The warm-ups are the agents benchmarks' (benchmarks/bench_agents.py): FrozenLake random walks on
the boards that list the safe moves (up to 8 assistant turns a trace: the README's recipe), and
the calculator's traces (2 turns: the call, written as text so that the revision before reads it
too, then the answer), rendered with SmolLM2's tokenizer and ppo-rlhf's ChatML tool template.  The
model is a tiny Llama of SmolLM2's vocabulary (2 layers, width 64), so the seconds are the rows'
tokens -- the logits over 49,152 tokens at every position -- more than the model.

Rows and tokens are counted by the code of this tree for both layouts: one row per turn is each
assistant message with the conversation before it as its prompt, the completion and its EOS
learned (the prompt-completion path, unchanged); one row per conversation is the template's whole
rendering, every assistant turn learned.  The seconds are each revision's own ``ppo-rlhf sft``,
``--steps`` steps of ``--batch-size`` rows, the training loop's time from its metrics (tokenizing
excluded) and the command's wall time: the same steps see every turn of batch-size conversations
after, of batch-size turns before, so the figure to compare is the seconds per epoch (every
assistant turn of the data trained once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from common import HERE, ROOT, command, processor, write_results

OUT = ROOT / "runs" / "bench_sft_rows"
sys.path.insert(0, str(HERE))
BEFORE, AFTER = "one row per turn (before)", "one row per conversation (after)"


def tiny_smollm2(source: Path, folder: Path) -> Path:
    """A 2-layer, 64-wide Llama with SmolLM2's tokenizer and vocabulary, saved with the tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def warm_ups(traces: int) -> dict[str, list[dict]]:
    """The two warm-ups' traces, {messages[, tools]}."""
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    import agents_tools
    from bench_agents import LAKE_INSTRUCTIONS
    from ppo_rlhf.envs.tools import tool_schema

    maps = [generate_random_map(size=4, p=0.8, seed=200_000 + i) for i in range(traces)]
    lake = [agents_tools.lake_trace({"prompt": LAKE_INSTRUCTIONS, "desc": desc}, i, agents_tools.lake_safe_view)
            for i, desc in enumerate(maps)]
    schema = tool_schema(agents_tools.calculator)
    calculator = [agents_tools.trace(a, b, schema) for a, b in agents_tools.problems(traces, seed=2)]
    return {"frozenlake walks": lake, "calculator": calculator}


def per_turn(rows: list[dict]) -> list[dict]:
    """One row per assistant turn, as sft made them before: the conversation before it as the prompt."""
    return [{"prompt": row["messages"][:i], "completion": message["content"], "tools": row.get("tools")}
            for row in rows for i, message in enumerate(row["messages"]) if i > 0 and message["role"] == "assistant"]


def counts(tokenizer, rows: list[dict], max_length: int) -> dict:
    """Rows, tokens and learned tokens of a layout, as this tree's sft cuts them at ``max_length``."""
    from ppo_rlhf.config import build_config
    from ppo_rlhf.formats import completion_rows
    from ppo_rlhf.trainers.sft import SFTConfig, sft_token_rows

    config = build_config(SFTConfig, {"chat_template": True, "max_length": max_length})
    converted = completion_rows("prompt", "completion", True)([dict(row) for row in rows])
    token_rows = sft_token_rows(tokenizer, converted, config, [tokenizer.eos_token_id])
    tokens = [min(len(ids), max_length) for ids, _ in token_rows]
    learned = sum(sum(label != -100 for label in labels[:max_length]) for _, labels in token_rows)
    return {"rows": len(token_rows), "tokens": sum(tokens), "learned_tokens": learned,
            "mean_row_tokens": round(sum(tokens) / len(tokens), 1), "longest_row_tokens": max(tokens)}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def source_of(revision: str | None, into: Path) -> Path:
    """The ``src`` folder of ``revision`` (this tree's own for None), exported from git."""
    if revision is None:
        return ROOT / "src"
    archive = into / "source.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), revision, "src"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def timed_sft(src: Path, model: Path, data: Path, out: Path, args) -> dict:
    """One revision's ``ppo-rlhf sft``: the training loop's seconds (metrics) and the command's."""
    command = [sys.executable, "-m", "ppo_rlhf.cli", "sft", "--model", str(model), "--data", str(data),
               "--chat-template", "--chat-template-file", str(ROOT / "src" / "ppo_rlhf" / "envs" / "chatml_tools.jinja"),
               "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--lr", "1e-4", "--warmup-steps", "1",
               "--max-length", str(args.max_length), "--eval-fraction", "0", "--save-every", "0",
               "--num-threads", str(args.threads), "--out", str(out), "--overwrite"]
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"failed: {' '.join(command)}\n{done.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return {"rows_read": summary["rows"], "loop_seconds": round(metrics[-1]["seconds"], 2),
            "command_seconds": round(wall, 1), "final_loss": round(metrics[-1]["loss"], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the git revision with one row per assistant turn")
    parser.add_argument("--tokenizer", default=str(ROOT / "runs" / "smollm2-135m-instruct"),
                        help="SmolLM2-135M-Instruct's folder (make smollm2): its tokenizer and vocabulary")
    parser.add_argument("--traces", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each timing; the fastest is kept")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from ppo_rlhf.envs.options import tool_template_path

    OUT.mkdir(parents=True, exist_ok=True)
    model = tiny_smollm2(Path(args.tokenizer), OUT / "tiny-smollm2")
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = tool_template_path().read_text()
    load_before = os.getloadavg()[1]
    result = {"benchmark": "sft_rows", "date": time.strftime("%Y-%m-%d"), "before": args.before,
              "machine": f"{processor()}, {args.threads} torch threads",
              "settings": {k: getattr(args, k) for k in ("traces", "steps", "batch_size", "max_length", "repeats")},
              "command": command(), "warm_ups": {}}
    with tempfile.TemporaryDirectory() as scratch:
        sources = {BEFORE: source_of(args.before, Path(scratch)), AFTER: source_of(None, Path(scratch))}
        for name, rows in warm_ups(args.traces).items():
            stem = name.replace(" ", "_")
            data = write_jsonl(OUT / f"{stem}.jsonl", rows)
            layouts = {BEFORE: counts(tokenizer, per_turn(rows), args.max_length),
                       AFTER: counts(tokenizer, rows, args.max_length)}
            for layout, src in sources.items():
                # The fastest of --repeats runs: on a machine shared with other work, the least disturbed.
                out = OUT / f"{stem}_{'before' if layout == BEFORE else 'after'}"
                timing = min((timed_sft(src, model, data, out, args) for _ in range(args.repeats)),
                             key=lambda t: t["loop_seconds"])
                layouts[layout].update(timing)
                per_step = timing["loop_seconds"] / args.steps
                layouts[layout]["seconds_per_epoch"] = round(per_step * layouts[layout]["rows"] / args.batch_size, 1)
                print(name, layout, layouts[layout], flush=True)
            result["warm_ups"][name] = layouts
    result["load_average_5min"] = [round(load_before, 2), round(os.getloadavg()[1], 2)]  # at the start, at the end
    report(result)


def report(result: dict) -> None:
    settings = result["settings"]
    lines = ["# SFT warm-up: one row per assistant turn, or one per conversation", "",
             f"`{result['command']}` ({result['machine']}, {result['date']}); a tiny Llama (2 layers, width 64) "
             f"of SmolLM2's vocabulary, {settings['traces']} traces of each warm-up, --max-length "
             f"{settings['max_length']}, {settings['steps']} steps of {settings['batch_size']} rows each "
             f"(before: revision {result['before']}).", "",
             "| warm-up | rows | tokens an epoch | learned tokens an epoch | mean row | "
             f"seconds, {settings['steps']} steps (loop / command) | seconds an epoch |", "|---|---|---|---|---|---|---|"]
    for name, layouts in result["warm_ups"].items():
        for layout, figures in layouts.items():
            lines.append(f"| {name}, {layout} | {figures['rows']} | {figures['tokens']:,} | "
                         f"{figures['learned_tokens']:,} | {figures['mean_row_tokens']} | {figures['loop_seconds']} / "
                         f"{figures['command_seconds']} | {figures['seconds_per_epoch']} |")
    lines += ["", "Rows and tokens counted by this tree's code for both layouts; seconds from each revision's own "
              f"`ppo-rlhf sft` (the loop's time from its metrics, and the whole command's; the fastest of "
              f"{settings['repeats']} runs). An epoch trains every assistant turn of the data once: rows / batch "
              "size steps, at the measured seconds a step.", "",
              f"The machine's 5-minute load average was {result['load_average_5min'][0]} at the start and "
              f"{result['load_average_5min'][1]} at the end, on {os.cpu_count()} cores: other work ran beside "
              "these runs, and a step's seconds varied with it between runs of the same work. The tokens are "
              "exact; the seconds an epoch follow the tokens an epoch."]
    write_results("sft_rows", result, lines)


if __name__ == "__main__":
    main()
