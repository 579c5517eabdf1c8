"""The arithmetic floor of one PPO iteration on the built-in task, and this CPU's speed on it.
Writes benchmarks/results/floor.{json,md}.

    python benchmarks/bench_floor.py [--threads 1 2] [--response-length 6] [--seconds-per-iteration S]

1. Counts the floating-point operations of one iteration of the "same work as TRL" settings
   (benchmarks/bench_peers.py: batch 64, minibatch 32, 4 epochs, value head on the actor) on the
   demo's model (GPT-2 shape read from an SFT folder, or the demo's: 4 layers, width 64, 4 heads,
   42-token vocabulary): generation with the KV cache, reward-model scoring, the old and
   reference passes, and 8 minibatch steps (forward + backward = 3x the forward's matrix work).
   Only matrix products count (2 x M x N x K each); layer norms, softmax, GELU, the optimizer
   and the loss math are left out, so the floor is a lower bound.
2. Times torch.mm / torch.bmm on every product shape of that iteration, one thread count at a
   time, and adds up flops / measured rate: the seconds that iteration's products take when each
   runs as one plain call with nothing around it.
3. Compares with a measured seconds-per-iteration at the same thread count: --seconds-per-iteration
   (with --measured-threads), else benchmarks/results/ppo_profile.json (profile_ppo.py), else the
   ppo-rlhf same-work row of benchmarks/results/peers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DEMO_MODEL = {"n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 42, "n_inner": None}


def products(model: dict, rows: int, prompt: int, response: int, reward_model: dict, batch: int = 64, mini: int = 32,
             epochs: int = 4) -> list[tuple[str, int, int, int, int, int]]:
    """Every matrix product of one iteration: (stage, count, batch_of_products, M, K, N).

    A forward of ``rows`` sequences of ``length`` tokens, ``kept`` of them projected on the
    vocabulary.  Backward of a product (M, K) x (K, N): the input's gradient (M, N) x (N, K) and
    the weight's (K, M) x (M, N): each the forward's flops.
    """
    d, layers, heads, vocab = model["n_embd"], model["n_layer"], model["n_head"], model["vocab_size"]
    ff = model.get("n_inner") or 4 * d
    head_dim = d // heads
    out = []

    def forward(stage, n_rows, length, kept, layers_=layers, d_=d, ff_=ff, lm_head=True, backward=False, count=1,
                attention_length=None):
        m = n_rows * length
        attention_length = attention_length or length
        shapes = [(1, m, d_, 3 * d_), (1, m, d_, d_), (1, m, d_, ff_), (1, m, ff_, d_)]
        # scores q k^T and the weighted sum, per row and head
        shapes_attention = [(n_rows * heads, length, head_dim, attention_length),
                            (n_rows * heads, length, attention_length, head_dim)]
        for b, mm, k, n in shapes:
            out.append((stage, count * layers_, b, mm, k, n))
            if backward:
                out.append((stage + " (backward)", count * layers_, b, mm, n, k))
                out.append((stage + " (backward)", count * layers_, b, k, mm, n))
        for b, mm, k, n in shapes_attention:
            out.append((stage, count * layers_, b, mm, k, n))
            if backward:
                out.append((stage + " (backward)", count * layers_, b, mm, n, k))
                out.append((stage + " (backward)", count * layers_, b, k, mm, n))
        if lm_head:
            out.append((stage, count, 1, n_rows * kept, d_, vocab))
            if backward:
                out.append((stage + " (backward)", count, 1, n_rows * kept, vocab, d_))
                out.append((stage + " (backward)", count, 1, d_, n_rows * kept, vocab))

    # 1. generation: the prompt, then one token at a time over the cache (last position projected)
    forward("generate", rows, prompt, 1)
    for step in range(1, response):
        forward("generate", rows, 1, 1, attention_length=prompt + step)
    # 2. reward model: the whole sequence, no vocabulary projection
    forward("score", rows, prompt + response, 0, layers_=reward_model["n_layer"], d_=reward_model["n_embd"],
            ff_=reward_model.get("n_inner") or 4 * reward_model["n_embd"], lm_head=False)
    # 3-4. old pass (actor, value head on its trunk) and reference pass: response + 1 positions kept
    forward("old + reference passes", rows, prompt + response, response + 1, count=2)
    # 7. the update: epochs x batch / mini steps of forward + backward
    forward("update", mini, prompt + response, response + 1, backward=True, count=epochs * (batch // mini))
    return out


def flops(entry) -> int:
    _, count, b, m, k, n = entry
    return 2 * count * b * m * k * n


def time_product(b: int, m: int, k: int, n: int, min_seconds: float = 0.2) -> float:
    """Seconds of one plain torch.mm (b == 1) or torch.bmm of these shapes, median of repeats."""
    x = torch.randn(b, m, k) if b > 1 else torch.randn(m, k)
    y = torch.randn(b, k, n) if b > 1 else torch.randn(k, n)
    op = torch.bmm if b > 1 else torch.mm
    for _ in range(10):
        op(x, y)
    repeats, samples = 20, []
    deadline = time.perf_counter() + min_seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        start = time.perf_counter()
        for _ in range(repeats):
            op(x, y)
        samples.append((time.perf_counter() - start) / repeats)
    samples.sort()
    return samples[len(samples) // 2]


def peak(size: int = 1024) -> float:
    """GFLOP/s of one large square product: what the cores do when a product is big enough."""
    seconds = time_product(1, size, size, size, min_seconds=0.5)
    return 2 * size ** 3 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", default="runs/peers/pipeline/sft/checkpoints/sft",
                        help="an SFT folder to read the model's shape from (default: the demo's shape if absent)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt-length", type=int, default=11, help="tokens of a prompt (the task's: 11)")
    parser.add_argument("--response-length", type=int, default=6,
                        help="padded response length of a batch (the task's answers: 4-5 digits + EOS)")
    parser.add_argument("--seconds-per-iteration", type=float, default=None,
                        help="measured s/iteration to compare with (default: ppo_profile.json, else peers.json)")
    parser.add_argument("--measured-threads", type=int, default=1, help="torch threads of that measurement")
    args = parser.parse_args()

    model = dict(DEMO_MODEL)
    config_path = Path(args.sft) / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        model.update({k: config[k] for k in DEMO_MODEL if k in config})
    entries = products(model, 64, args.prompt_length, args.response_length, reward_model=model)
    by_stage = defaultdict(int)
    for entry in entries:
        by_stage[entry[0].replace(" (backward)", "")] += flops(entry)
    total = sum(by_stage.values())

    measured, measured_from, measured_threads = args.seconds_per_iteration, "--seconds-per-iteration", args.measured_threads
    split = None
    profile, peers = RESULTS / "ppo_profile.json", RESULTS / "peers.json"
    if measured is None and profile.is_file():
        data = json.loads(profile.read_text())
        measured, measured_threads = data["s_per_iteration"]["median"], data["threads"]
        measured_from = (f"benchmarks/results/ppo_profile.json (profile_ppo.py: ppo-rlhf same work, median of "
                         f"{data['iterations']} iterations, load average {data['load_average'][0]:.1f})")
        split = data["split_median_s"]
    elif measured is None and peers.is_file():
        data = json.loads(peers.read_text())
        row = data["rows"].get("ppo-rlhf-same")
        if row:
            measured, measured_from = row["s_per_iteration"]["median"], "benchmarks/results/peers.json (ppo-rlhf, same work)"
            measured_threads = data["runs"][0]["threads"]
            split = {k: v["median"] for k, v in row["split"].items()}

    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
               "model": model, "prompt_length": args.prompt_length, "response_length": args.response_length,
               "gflop_per_iteration": total / 1e9, "gflop_by_stage": {k: v / 1e9 for k, v in by_stage.items()},
               "measured_s_per_iteration": measured, "measured_from": measured_from, "measured_split": split,
               "measured_threads": measured_threads,
               "load_average": os.getloadavg(), "by_threads": {}}
    shapes = sorted({entry[2:] for entry in entries})
    for threads in args.threads:
        torch.set_num_threads(threads)
        rate = {}
        for shape in shapes:
            b, m, k, n = shape
            rate[shape] = 2 * b * m * k * n / time_product(*shape) / 1e9  # GFLOP/s
        floor_by_stage = defaultdict(float)
        for entry in entries:
            floor_by_stage[entry[0].replace(" (backward)", "")] += flops(entry) / 1e9 / rate[entry[2:]]
        floor = sum(floor_by_stage.values())
        results["by_threads"][str(threads)] = {
            "peak_gflops_1024": peak(),
            "floor_s_per_iteration": floor,
            "floor_s_by_stage": dict(floor_by_stage),
            "effective_gflops_at_floor": total / 1e9 / floor,
            "shapes": [{"batch": b, "m": m, "k": k, "n": n, "gflops": rate[(b, m, k, n)]} for b, m, k, n in shapes],
            "ratio_measured_to_floor": measured / floor if measured and threads == measured_threads else None,
        }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "floor.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "floor.md").write_text(report(results))
    print(report(results))


def report(r: dict) -> str:
    m = r["model"]
    lines = ["# The arithmetic floor of one PPO iteration", "", "Command: `python benchmarks/bench_floor.py`  ",
             f"Machine: {r['machine']}; 1-minute load average when measured {r['load_average'][0]:.1f}"
             + (" (other jobs shared this machine: rates are lower than on an idle one)"
                if r["load_average"][0] > 0.75 else " (idle)"), "",
             f"Model: GPT-2 shape, {m['n_layer']} layers, width {m['n_embd']}, {m['n_head']} heads, vocabulary "
             f"{m['vocab_size']} (reward model the same shape). One iteration of the same-work settings: 64 prompts of "
             f"{r['prompt_length']} tokens, responses padded to {r['response_length']}, generation with the KV cache, "
             f"reward-model scoring, old and reference passes, 4 epochs x 2 minibatches of 32 (forward + backward). "
             f"Matrix products only (2·M·N·K each): a lower bound.", "",
             f"**{r['gflop_per_iteration']:.3f} GFLOP per iteration**: " + ", ".join(
                 f"{k} {v:.3f}" for k, v in r["gflop_by_stage"].items()), "",
             "| torch threads | large product (1024³) GFLOP/s | this iteration's products: floor s | effective GFLOP/s "
             "| measured s/iteration | measured / floor |", "|---|---|---|---|---|---|"]
    measured = r["measured_s_per_iteration"]
    for threads, t in r["by_threads"].items():
        shown = "—" if t["ratio_measured_to_floor"] is None else f"{measured:.3f} s"
        ratio = "—" if t["ratio_measured_to_floor"] is None else f"{t['ratio_measured_to_floor']:.0f}x"
        lines.append(f"| {threads} | {t['peak_gflops_1024']:.1f} | {1000 * t['floor_s_per_iteration']:.2f} ms | "
                     f"{t['effective_gflops_at_floor']:.1f} | {shown} | {ratio} |")
    lines += ["", f"Measured s/iteration ({r['measured_threads']} thread(s)) from {r['measured_from']}."]
    if r.get("measured_split"):
        lines += ["", "Measured split against the floor, at that thread count: " + ", ".join(
            f"{stage} {1000 * r['measured_split'][key]:.0f} ms vs {1000 * r['by_threads'][str(r['measured_threads'])]['floor_s_by_stage'][name]:.1f} ms"
            for stage, key, name in (("generate", "generate", "generate"), ("score", "score", "score"),
                                     ("old + reference passes", "forward", "old + reference passes"),
                                     ("update", "train", "update"))
            if key in r["measured_split"] and str(r["measured_threads"]) in r["by_threads"]) + "."]
    for threads, t in r["by_threads"].items():
        lines += ["", f"Floor by stage at {threads} thread(s): " + ", ".join(
            f"{k} {1000 * v:.2f} ms" for k, v in t["floor_s_by_stage"].items()), "",
            "| product (batch x M x K x N) | GFLOP/s |", "|---|---|"]
        lines += [f"| {s['batch']} x {s['m']} x {s['k']} x {s['n']} | {s['gflops']:.1f} |" for s in t["shapes"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
