"""What reading the old log-probs off the update saves (docs/design.md, "Old log-probs from the
update"): SmolLM2-135M-Instruct with LoRA on a reasoning-gym task, GRPO with one optimizer step
per batch and the KL in the loss, iterations alternating between the two ways in one process
(this machine's speed drifts; one model load serves both).  Writes
benchmarks/results/old_logprobs.{json,md}.

    make smollm2
    python benchmarks/bench_old_logprobs.py            # 4 rounds: 8 iterations of about 50 s
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ab_iterations import alternate, write_report

HERE = Path(__file__).parent
RESULTS = HERE / "results"
MAX_NEW_TOKENS = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/smollm2-135m-instruct")
    parser.add_argument("--task", default="gcd")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of one iteration each way (plus one warm-up)")
    parser.add_argument("--note", default="idle machine")
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"{args.model} is missing; make it with: make smollm2")

    from ppo_rlhf.config import build_config
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    # The settings it was measured with (bench_reasoning.py's recipe has moved on since; these stay
    # fixed so the figures can be reproduced): 4 prompts x 4 samples, one step of all 16.
    settings = {"model": args.model, "task": f"reasoning-gym:{args.task}", "task_size": 2000, "task_eval_size": 10,
                "lora": True, "estimator": "grpo", "samples_per_prompt": 4, "batch_size": 16, "mini_batch_size": 16,
                "ppo_epochs": 1, "max_new_tokens": MAX_NEW_TOKENS, "max_length": 224, "lr": 1e-3, "temperature": 1.0,
                "kl_in": "loss", "kl_coef": 0.05, "format_reward": 0.1, "out": "runs/bench_old_logprobs",
                "overwrite": True, "share_prompts": False}  # measured before prompts were shared
    trainer = PPOTrainer(build_config(PPOConfig, settings))
    assert trainer.old_logprobs_from_update, "these settings should read the old log-probs off the update"

    def set_way(from_update: bool) -> None:
        trainer.old_logprobs_from_update = from_update

    timings = alternate(trainer, set_way, 4, 4, args.rounds, "from update")

    write_report(RESULTS, "old_logprobs", "Old log-probs: a pass of their own, or read off the update",
                 "python benchmarks/bench_old_logprobs.py " + " ".join(sys.argv[1:]), args.note, settings,
                 (f"SmolLM2-135M-Instruct, LoRA, reasoning-gym:{args.task}, GRPO 4 prompts x 4 samples, "
                  f"{MAX_NEW_TOKENS} new tokens, one optimizer step per batch, k3 KL in the loss; median seconds "
                  f"over {args.rounds} iterations each way, alternating."),
                 timings, {False: "with a pass of their own", True: "read off the update"}, "old log-probs")


if __name__ == "__main__":
    main()
