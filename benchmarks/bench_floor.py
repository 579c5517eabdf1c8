"""The arithmetic floor of one PPO iteration on the built-in task ("same work as TRL": batch 64,
minibatch 32, 4 epochs, value head), and the model's own calls alone in eager PyTorch, each set
against ppo-rlhf's measured iteration (--seconds-per-iteration, else
benchmarks/results/ppo_profile.json, else the same-work row of benchmarks/results/peers.json).

    python benchmarks/bench_floor.py [--threads 1 2] [--response-length 6] [--seconds-per-iteration S]

Writes benchmarks/results/floor.{json,md}; the method and figures: docs/benchmarks.md, "Against
TRL's PPOTrainer (0.11.4)".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from common import HERE, RESULTS, write_results

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


def eager_model_seconds(model: dict, prompt: int, response: int, batch: int = 64, mini: int = 32, epochs: int = 4,
                        repeats: int = 7, alongside=None, weights: Path | None = None) -> dict[str, float]:
    """Median seconds of one iteration's model calls alone, by stage (point 4 of the docstring).

    ``weights``: an SFT folder whose weights the actor and reference load (the reward model's trunk
    too), as the trainer's do; else random weights of the demo's shape.
    ``alongside``: a callable timed once in every round as well (ppo-rlhf's own iteration), so
    that both are measured under the same machine conditions; its median is "alongside", and the
    medians of the ``time/*`` metrics it returns are "alongside/generate" and so on."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    torch.manual_seed(0)
    # The demo's GELU is torch's own kernel ("gelu"), not GPT2Config's default tanh formula in Python.
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    if weights is not None and (weights / "config.json").is_file():
        config = GPT2Config.from_pretrained(str(weights), **no_dropout)
    else:
        config = GPT2Config(n_layer=model["n_layer"], n_embd=model["n_embd"], n_head=model["n_head"],
                            vocab_size=model["vocab_size"], n_inner=model.get("n_inner"), n_positions=128,
                            activation_function="gelu", pad_token_id=0, **no_dropout)
    actor, ref = GPT2LMHeadModel(config), GPT2LMHeadModel(config).eval()
    reward = GPT2ForSequenceClassification(GPT2Config(**{**config.to_dict(), "num_labels": 3})).eval()
    if weights is not None and (weights / "model.safetensors").is_file():
        from safetensors.torch import load_file

        state = load_file(str(weights / "model.safetensors"))
        for role in (actor, ref):
            role.load_state_dict(state, strict=False)
        reward.transformer.load_state_dict({k.removeprefix("transformer."): v for k, v in state.items()}, strict=False)
    value_head = torch.nn.Linear(config.n_embd, 1)
    optimizer = torch.optim.AdamW([*actor.parameters(), *value_head.parameters()], lr=1e-5, fused=True)
    length = prompt + response
    prompts = torch.randint(3, config.vocab_size, (batch, prompt))
    sequences = torch.randint(3, config.vocab_size, (batch, length))

    def generate():
        with torch.no_grad():
            out = actor(input_ids=prompts, use_cache=True, logits_to_keep=1)
            for step in range(1, response):
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                out = actor(input_ids=token, past_key_values=out.past_key_values, use_cache=True,
                            position_ids=torch.full_like(token, prompt + step - 1))

    def score():
        with torch.no_grad():
            reward(input_ids=sequences, use_cache=False)

    def old_and_reference():
        with torch.no_grad():
            out = actor(input_ids=sequences, output_hidden_states=True, use_cache=False, logits_to_keep=response + 1)
            value_head(out.hidden_states[-1])
            ref(input_ids=sequences, use_cache=False, logits_to_keep=response + 1)

    def update():
        for _ in range(epochs):
            for rows in torch.randperm(batch).split(mini):
                out = actor(input_ids=sequences[rows], output_hidden_states=True, use_cache=False,
                            logits_to_keep=response + 1)
                logprobs = out.logits[:, :-1].log_softmax(-1).gather(-1, sequences[rows, prompt:, None])
                values = value_head(out.hidden_states[-1][:, prompt - 1:-1]).squeeze(-1)
                (values.pow(2).mean() - logprobs.mean()).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    stages = {"generate": generate, "score": score, "old + reference passes": old_and_reference, "update": update}
    if alongside is not None:
        stages["alongside"] = alongside
    samples = defaultdict(list)
    for repeat in range(repeats + 2):  # two warm-up rounds
        for name, run in stages.items():
            start = time.perf_counter()
            metrics = run()
            if repeat >= 2:
                samples[name].append(time.perf_counter() - start)
                for key, value in (metrics or {}).items():
                    if key.startswith("time/") and key != "time/elapsed":
                        samples[f"{name}/{key.removeprefix('time/')}"].append(value)
    return {name: statistics.median(values) for name, values in samples.items()}


def same_work_iteration(pipeline: Path, threads: int):
    """A callable running one ppo-rlhf iteration of the same-work row (bench_peers.py) on the
    pipeline's SFT and reward model, after 3 warm-up iterations; None without a pipeline."""
    if not (pipeline / "sft" / "checkpoints" / "sft").is_dir() or not (pipeline / "rm" / "checkpoints" / "reward").is_dir():
        return None
    sys.path[:0] = [str(HERE), str(HERE / "peers")]
    from bench_peers import PIPELINE_SEED, ppo_rlhf_settings
    from ppo_rlhf_run import build_trainer
    from ppo_rlhf.stages.ppo import draw_batch

    values = ppo_rlhf_settings("ppo-rlhf-same", pipeline, seed=0, iterations=1000, threads=threads)
    trainer, rows, config = build_trainer(values, PIPELINE_SEED)
    rng = torch.Generator().manual_seed(config.seed)
    batches = iter([draw_batch(rows, config, rng) for _ in range(50)])  # drawn outside the timed calls
    for _ in range(3):
        trainer.step(next(batches))
    return lambda: trainer.step(next(batches))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", default="runs/peers/pipeline/sft/checkpoints/sft",
                        help="an SFT folder to read the model's shape from (default: the demo's shape if absent)")
    parser.add_argument("--pipeline", default="runs/peers/pipeline",
                        help="a demo run folder (sft/, rm/): ppo-rlhf's same-work iteration is timed in the same "
                             "rounds as the model alone (point 4); skipped if absent")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt-length", type=int, default=11, help="tokens of a prompt (the task's: 11)")
    parser.add_argument("--response-length", type=int, default=6,
                        help="padded response length of a batch (the task's answers: 4-5 digits + EOS)")
    parser.add_argument("--seconds-per-iteration", type=float, default=None,
                        help="measured s/iteration to compare with (default: ppo_profile.json, else peers.json)")
    parser.add_argument("--measured-threads", type=int, default=1, help="torch threads of that measurement")
    args = parser.parse_args()
    load_before = os.getloadavg()  # before this script's own threads add to it

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

    results = {"command": "python benchmarks/bench_floor.py " + " ".join(
                   f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                   for k, v in vars(args).items() if v is not None and k in ("sft", "pipeline", "threads")),
               "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
               "model": model, "prompt_length": args.prompt_length, "response_length": args.response_length,
               "gflop_per_iteration": total / 1e9, "gflop_by_stage": {k: v / 1e9 for k, v in by_stage.items()},
               "measured_s_per_iteration": measured, "measured_from": measured_from, "measured_split": split,
               "measured_threads": measured_threads,
               "load_average": load_before, "by_threads": {}}
    if peers.is_file():  # both systems' same-work seconds, for point 4
        data = json.loads(peers.read_text())
        results["peers"] = {"threads": data["runs"][0]["threads"], "load_note": data.get("load_note"), "rows": {
            data["rows"][key]["name"]: data["rows"][key]["s_per_iteration"]["median"]
            for key in ("ppo-rlhf-same", "trl-same") if key in data["rows"]}}
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
        eager = eager_model_seconds(model, args.prompt_length, args.response_length, weights=Path(args.sft),
                                    alongside=same_work_iteration(Path(args.pipeline), threads))
        ours = {key.removeprefix("alongside/"): eager.pop(key) for key in list(eager) if key.startswith("alongside")}
        results["by_threads"][str(threads)].update({
            "eager_model_s_by_stage": eager, "eager_model_s_per_iteration": sum(eager.values()),
            "ppo_rlhf_same_work_s_per_iteration": ours.pop("alongside", None), "ppo_rlhf_same_work_split_s": ours})
        here = results["by_threads"][str(threads)]["ppo_rlhf_same_work_s_per_iteration"]
        if here:  # measured in this run at this thread count: the figure to set against the floor
            results["by_threads"][str(threads)]["ratio_measured_to_floor"] = here / floor
    write_results("floor", results, report(results))


def report(r: dict) -> str:
    m = r["model"]
    lines = ["# The arithmetic floor of one PPO iteration", "", f"Command: `{r.get('command', 'python benchmarks/bench_floor.py')}`  ",
             f"Machine: {r['machine']}; 1-minute load average before the script started {r['load_average'][0]:.1f}"
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
        here = t.get("ppo_rlhf_same_work_s_per_iteration")
        shown = "—" if t["ratio_measured_to_floor"] is None else f"{here or measured:.3f} s"
        ratio = "—" if t["ratio_measured_to_floor"] is None else f"{t['ratio_measured_to_floor']:.1f}x"
        lines.append(f"| {threads} | {t['peak_gflops_1024']:.1f} | {1000 * t['floor_s_per_iteration']:.2f} ms | "
                     f"{t['effective_gflops_at_floor']:.1f} | {shown} | {ratio} |")
    if any(t.get("ppo_rlhf_same_work_s_per_iteration") for t in r["by_threads"].values()):
        lines += ["", "Measured s/iteration: ppo-rlhf's same-work iteration timed in this run (section below)."]
    else:
        lines += ["", f"Measured s/iteration ({r['measured_threads']} thread(s)) from {r['measured_from']}."]
    splits = {threads: t["ppo_rlhf_same_work_split_s"] for threads, t in r["by_threads"].items()
              if t.get("ppo_rlhf_same_work_split_s")}
    if not splits and r.get("measured_split") and str(r["measured_threads"]) in r["by_threads"]:
        splits = {str(r["measured_threads"]): r["measured_split"]}
    for threads, split in splits.items():
        floor = r["by_threads"][threads]["floor_s_by_stage"]
        lines += ["", f"Measured split against the floor at {threads} thread(s): " + ", ".join(
            f"{stage} {1000 * split[key]:.0f} ms vs {1000 * floor[stage]:.1f} ms"
            for stage, key in (("generate", "generate"), ("score", "score"), ("old + reference passes", "forward"),
                               ("update", "train")) if key in split) + "."]
    lines += eager_report(r)
    for threads, t in r["by_threads"].items():
        lines += ["", f"Floor by stage at {threads} thread(s): " + ", ".join(
            f"{k} {1000 * v:.2f} ms" for k, v in t["floor_s_by_stage"].items()), "",
            "| product (batch x M x K x N) | GFLOP/s |", "|---|---|"]
        lines += [f"| {s['batch']} x {s['m']} x {s['k']} x {s['n']} | {s['gflops']:.1f} |" for s in t["shapes"]]
    return "\n".join(lines) + "\n"


def eager_report(r: dict) -> list[str]:
    """Point 4: the model alone in eager PyTorch, and the peers' same-work seconds against it."""
    stages = ("generate", "score", "old + reference passes", "update")
    lines = ["", "## The model alone in eager PyTorch", "",
             "The same iteration's model calls with nothing of PPO around them (Hugging Face GPT-2 of this shape, "
             "the kernels both ppo-rlhf and TRL run): generation over the KV cache, the reward model's forward, "
             "the old and reference forwards, and 8 x (forward, a plain loss on the response log-probs and the value "
             "head, backward, fused AdamW step). ppo-rlhf's own same-work iteration (`PPOTrainer.step`, as in "
             "bench_peers.py, on the `--pipeline` checkpoints) is timed in the same rounds, so both see the same "
             "machine. Medians of 7 rounds.", "",
             "| torch threads | " + " | ".join(stages) + " | the model alone | ppo-rlhf's iteration | ratio |",
             "|---|" + "---|" * (len(stages) + 3)]
    for threads, t in r["by_threads"].items():
        eager, ours = t.get("eager_model_s_by_stage"), t.get("ppo_rlhf_same_work_s_per_iteration")
        if eager:
            alone = t["eager_model_s_per_iteration"]
            lines.append(f"| {threads} | " + " | ".join(f"{1000 * eager[s]:.1f} ms" for s in stages)
                         + f" | **{1000 * alone:.1f} ms** | "
                         + (f"{1000 * ours:.1f} ms | {ours / alone:.2f}x |" if ours else "— | — |"))
    split_keys = {"generate": "generate", "score": "score", "old + reference passes": "forward", "update": "train"}
    rows = [(threads, t) for threads, t in r["by_threads"].items() if t.get("ppo_rlhf_same_work_split_s")]
    if rows:
        lines += ["", "ppo-rlhf's iteration by stage (its own `time/*` metrics; its forward stage also computes "
                      "rewards and advantages), as a multiple of the model alone's:", "",
                  "| torch threads | " + " | ".join(stages) + " |", "|---|" + "---|" * len(stages)]
        for threads, t in rows:
            split, eager = t["ppo_rlhf_same_work_split_s"], t["eager_model_s_by_stage"]
            lines.append(f"| {threads} | " + " | ".join(
                f"{1000 * split[split_keys[s]]:.1f} ms ({split[split_keys[s]] / eager[s]:.2f}x)"
                if split_keys[s] in split else "—" for s in stages) + " |")
    peers = r.get("peers")
    at = r["by_threads"].get(str(peers["threads"])) if peers else None
    if at and at.get("eager_model_s_per_iteration"):
        alone, here = at["eager_model_s_per_iteration"], at.get("ppo_rlhf_same_work_s_per_iteration")
        ours = next((s for name, s in peers["rows"].items() if name.startswith("ppo-rlhf")), None)
        lines += ["", f"Same work at {peers['threads']} thread(s) in `benchmarks/bench_peers.py` (benchmarks/results/"
                      f"peers.md, measured at another time: {peers.get('load_note') or 'load not recorded'}). The "
                      "machine's speed drifts between runs, so each system is set against the model alone through "
                      "its ratio to ppo-rlhf's iteration there and ppo-rlhf's ratio to the model alone here:", "",
                  "| system | s/iteration there | / ppo-rlhf's there | / the model alone |", "|---|---|---|---|"]
        for name, seconds in peers["rows"].items():
            to_ours = seconds / ours if ours else None
            estimate = f"{to_ours * here / alone:.2f}x" if to_ours and here else "—"
            lines.append(f"| {name} | {seconds:.3f} | {to_ours:.2f}x | {estimate} |" if to_ours else
                         f"| {name} | {seconds:.3f} | — | — |")
        trl = next((s for name, s in peers["rows"].items() if name.startswith("TRL")), None)
        if trl and ours and here:
            trl_here = here * trl / ours
            verdict = ("no trainer that runs these models on these kernels can get there, however little it adds "
                       "around them; only a faster implementation of the model itself could (torch.compile: "
                       "benchmarks/results/compile.md)." if alone > trl_here / 2 else
                       "so the room is in the trainers' own work.")
            lines += ["", f"Twice TRL's speed on this work is {1000 * trl_here / 2:.0f} ms per iteration at this run's "
                          f"machine speed (TRL's iteration: {1000 * trl_here:.0f} ms). The model's own calls take "
                          f"{1000 * alone:.0f} ms: {verdict}"]
    return lines


if __name__ == "__main__":
    main()
