"""What running each distinct prompt once per forward pass saves (docs/design.md, "Shared
prompts"): SmolLM2-135M-Instruct with LoRA on a reasoning-gym task, GRPO with the reasoning
benchmark's shape (4 prompts x 8 samples of up to 32 tokens, one optimizer step of all 32, the KL
in the loss), iterations alternating between shared and unshared prompts in one process.
Writes benchmarks/results/shared_prompts.{json,md}.

    make smollm2
    python benchmarks/bench_shared_prompts.py            # 3 rounds: 8 iterations of 40-75 s
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ab_iterations import alternate, write_report

HERE = Path(__file__).parent
RESULTS = HERE / "results"
PROMPTS, K, MAX_NEW_TOKENS = 4, 8, 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/smollm2-135m-instruct")
    parser.add_argument("--task", default="gcd")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one iteration each way (plus one warm-up)")
    parser.add_argument("--note", default="idle machine")
    args = parser.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"{args.model} is missing; make it with: make smollm2")

    from ppo_rlhf.config import build_config
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    # bench_reasoning.py's recipe as measured here, fixed so the figures can be reproduced.
    settings = {"model": args.model, "task": f"reasoning-gym:{args.task}", "task_size": 2000, "task_eval_size": 10,
                "lora": True, "estimator": "grpo", "samples_per_prompt": K, "batch_size": PROMPTS * K,
                "mini_batch_size": PROMPTS * K, "ppo_epochs": 1, "max_new_tokens": MAX_NEW_TOKENS, "max_length": 224,
                "lr": 1e-4, "temperature": 0.7, "task_reward": "exact", "kl_in": "loss", "kl_coef": 0.05,
                "format_reward": 0.1, "out": "runs/bench_shared_prompts", "overwrite": True}
    trainer = PPOTrainer(build_config(PPOConfig, settings))

    def set_way(share: bool) -> None:
        # The first batch checks sharing against the full pass (and leaves it on where it agrees).
        if trainer.share_prompts is not None:
            trainer.share_prompts = share

    timings = alternate(trainer, set_way, PROMPTS, K, args.rounds, "shared prompts")
    assert trainer.share_prompts is not None

    write_report(RESULTS, "shared_prompts", "Shared prompts: each distinct prompt once per forward pass, or once per row",
                 "python benchmarks/bench_shared_prompts.py " + " ".join(sys.argv[1:]), args.note, settings,
                 (f"SmolLM2-135M-Instruct, LoRA, reasoning-gym:{args.task} (chat prompts of ~84 tokens), GRPO {PROMPTS} "
                  f"prompts x {K} samples, {MAX_NEW_TOKENS} new tokens, one optimizer step per batch (old log-probs read "
                  f"off the update), k3 KL in the loss; median seconds over {args.rounds} iterations each way, "
                  f"alternating (the first round, which also checks sharing against the full pass, is a warm-up)."),
                 timings, {False: "once per row", True: "shared"}, "prompts")


if __name__ == "__main__":
    main()
