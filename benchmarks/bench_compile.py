"""Would torch.compile make the PPO update faster on the built-in task?  Written to
benchmarks/results/compile.{json,md}.

    python benchmarks/bench_compile.py [--threads 1] [--repeats 40]

One minibatch step of the update as trainers/ppo.py takes it on the demo's model (GPT-2, 4
layers, width 64, vocabulary 42; 32 rows of 12 prompt + 7 response tokens, a quarter of them
left-padded): the actor's forward over prompt + response (forward_response), the chosen tokens'
log-probs and the clipped policy loss, then the backward pass.  Timed eagerly and compiled by
torch.compile (inductor, on this CPU's C++ backend) with static shapes and with dynamic ones (a
batch's response length varies); the first call's seconds are the compile time.  Then the
optimizer step alone, for each of AdamW's three paths.  Medians of --repeats timed calls after
warm-up, in one process.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from ppo_rlhf.core import policy_loss
from ppo_rlhf.models import build_causal_lm
from ppo_rlhf.rollout.logprobs import forward_response, logprobs_from_logits
from ppo_rlhf.rollout.sequences import Sequences
from ppo_rlhf.tasks.doubling import build_tokenizer

from common import write_results

ROWS, PROMPT, RESPONSE = 32, 12, 7


def minibatch(response: int = RESPONSE, seed: int = 0) -> tuple[Sequences, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(ROWS, PROMPT, dtype=torch.long)
    prompt_mask[: ROWS // 4, :1] = 0  # left padding
    sequences = Sequences(torch.randint(3, 40, (ROWS, PROMPT), generator=generator), prompt_mask,
                          torch.randint(3, 40, (ROWS, response), generator=generator),
                          torch.ones(ROWS, response, dtype=torch.long))
    return sequences, torch.randn(ROWS, response, generator=generator), torch.randn(ROWS, response, generator=generator)


def timed(function, repeats: int) -> float:
    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_loss(mode: str, repeats: int) -> dict:
    model = build_causal_lm(build_tokenizer()).train()

    def loss_of(sequences, old_logprobs, advantages):
        logits = forward_response(model, sequences).logits
        logprobs = logprobs_from_logits(logits, sequences.response_ids)
        return policy_loss(logprobs, old_logprobs, advantages, sequences.response_mask, 0.2, "token-mean",
                           RESPONSE)[0]

    loss_fn = loss_of if mode == "eager" else torch.compile(loss_of, dynamic=(mode == "compiled, dynamic shapes"))
    batch = minibatch()
    start = time.perf_counter()
    loss_fn(*batch).backward()
    first = time.perf_counter() - start
    other_length = minibatch(RESPONSE - 1, seed=1)  # another response length: a recompile with static shapes
    start = time.perf_counter()
    loss_fn(*other_length).backward()
    second_shape = time.perf_counter() - start
    seconds = timed(lambda: loss_fn(*batch).backward(), repeats)
    return {"mode": mode, "first_call_s": round(first, 2), "first_call_other_length_s": round(second_shape, 2),
            "forward_backward_ms": round(1000 * seconds, 2)}


def measure_optimizer(path: str, repeats: int) -> dict:
    model = build_causal_lm(build_tokenizer())
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter)
    kwargs = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[path]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **kwargs)
    return {"path": path, "step_ms": round(1000 * timed(optimizer.step, repeats), 3),
            "tensors": sum(1 for _ in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    losses = [measure_loss(mode, args.repeats)
              for mode in ("eager", "compiled, static shapes", "compiled, dynamic shapes")]
    optimizers = [measure_optimizer(path, args.repeats) for path in ("loop", "foreach", "fused")]
    report = {"machine": f"{platform.machine()}, torch {torch.__version__}, {args.threads} torch thread(s)",
              "load_average": list(os.getloadavg()), "losses": losses, "optimizers": optimizers}
    eager = losses[0]["forward_backward_ms"]
    lines = ["# torch.compile and AdamW's paths on one PPO minibatch step", "",
             f"Command: `python benchmarks/bench_compile.py --threads {args.threads}`  ",
             f"Machine: {report['machine']}; 1-minute load average when measured "
             f"{report['load_average'][0]:.1f}", "",
             f"The demo's actor (GPT-2, 4 layers, width 64), one minibatch of {ROWS} rows x ({PROMPT} prompt + "
             f"{RESPONSE} response) tokens: forward_response, log-probs, clipped policy loss, backward.", "",
             "| | first call (compile) s | first call at another response length s | forward + backward ms | vs eager |",
             "|---|---|---|---|---|"]
    for row in losses:
        lines.append(f"| {row['mode']} | {row['first_call_s']} | {row['first_call_other_length_s']} | "
                     f"{row['forward_backward_ms']} | {row['forward_backward_ms'] / eager:.2f}x |")
    lines += ["", "| AdamW path | step ms (one model's parameters) |", "|---|---|"]
    lines += [f"| {row['path']} | {row['step_ms']} |" for row in optimizers]
    write_results("compile", report, lines)


if __name__ == "__main__":
    main()
