"""What reading the old log-probs off the update saves (docs/design.md, "Old log-probs from the
update"): SmolLM2-135M-Instruct with LoRA on a reasoning-gym task, GRPO with one optimizer step
per batch and the KL in the loss, iterations alternating between the two ways in one process
(this machine's speed drifts; one model load serves both).  Writes
benchmarks/results/old_logprobs.{json,md}.

    make smollm2
    python benchmarks/bench_old_logprobs.py            # 4 rounds: 8 iterations of about 50 s
"""

from __future__ import annotations

from common import ab_arguments, ab_report, ab_settings, ab_trainer, alternate

MAX_NEW_TOKENS = 32


def main() -> None:
    args = ab_arguments(__doc__, rounds=4)
    # The settings it was measured with (bench_reasoning.py's recipe has moved on since; these stay
    # fixed so the figures can be reproduced): 4 prompts x 4 samples, one step of all 16.
    settings = ab_settings(args, samples_per_prompt=4, batch_size=16, mini_batch_size=16, max_new_tokens=MAX_NEW_TOKENS,
                           lr=1e-3, temperature=1.0, out="runs/bench_old_logprobs",
                           share_prompts=False)  # measured before prompts were shared
    trainer = ab_trainer(settings)
    assert trainer.old_logprobs_from_update, "these settings should read the old log-probs off the update"

    def set_way(from_update: bool) -> None:
        trainer.old_logprobs_from_update = from_update

    timings = alternate(trainer, set_way, 4, 4, args.rounds, "from update")
    ab_report("old_logprobs", "Old log-probs: a pass of their own, or read off the update", args, settings,
              (f"SmolLM2-135M-Instruct, LoRA, reasoning-gym:{args.task}, GRPO 4 prompts x 4 samples, "
               f"{MAX_NEW_TOKENS} new tokens, one optimizer step per batch, k3 KL in the loss; median seconds "
               f"over {args.rounds} iterations each way, alternating."),
              timings, {False: "with a pass of their own", True: "read off the update"}, "old log-probs")


if __name__ == "__main__":
    main()
