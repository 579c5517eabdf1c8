"""What running each distinct prompt once per forward pass saves (docs/design.md, "Shared
prompts"): SmolLM2-135M-Instruct with LoRA on a reasoning-gym task, GRPO with the reasoning
benchmark's shape (4 prompts x 8 samples of up to 32 tokens, one optimizer step of all 32, the KL
in the loss), iterations alternating between shared and unshared prompts in one process.
Writes benchmarks/results/shared_prompts.{json,md}.

    make smollm2
    python benchmarks/bench_shared_prompts.py            # 3 rounds: 8 iterations of 40-75 s
"""

from __future__ import annotations

from common import ab_arguments, ab_report, ab_settings, ab_trainer, alternate

PROMPTS, K, MAX_NEW_TOKENS = 4, 8, 32


def main() -> None:
    args = ab_arguments(__doc__, rounds=3)
    # bench_reasoning.py's recipe as measured here, fixed so the figures can be reproduced.
    settings = ab_settings(args, samples_per_prompt=K, batch_size=PROMPTS * K, mini_batch_size=PROMPTS * K,
                           max_new_tokens=MAX_NEW_TOKENS, lr=1e-4, temperature=0.7, task_reward="exact",
                           out="runs/bench_shared_prompts")
    trainer = ab_trainer(settings)

    def set_way(share: bool) -> None:
        # The first batch checks sharing against the full pass (and leaves it on where it agrees).
        if trainer.share_prompts is not None:
            trainer.share_prompts = share

    timings = alternate(trainer, set_way, PROMPTS, K, args.rounds, "shared prompts")
    assert trainer.share_prompts is not None
    ab_report("shared_prompts", "Shared prompts: each distinct prompt once per forward pass, or once per row", args,
              settings,
              (f"SmolLM2-135M-Instruct, LoRA, reasoning-gym:{args.task} (chat prompts of ~84 tokens), GRPO {PROMPTS} "
               f"prompts x {K} samples, {MAX_NEW_TOKENS} new tokens, one optimizer step per batch (old log-probs read "
               f"off the update), k3 KL in the loss; median seconds over {args.rounds} iterations each way, "
               f"alternating (the first round, which also checks sharing against the full pass, is a warm-up)."),
              timings, {False: "once per row", True: "shared"}, "prompts")


if __name__ == "__main__":
    main()
