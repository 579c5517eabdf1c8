"""One ppo-rlhf GRPO run for benchmarks/bench_peers_grpo.py, laid out as the TRL run is (trl_grpo.py).

    python benchmarks/peers/ppo_rlhf_grpo_run.py --settings RUN.json

The trainer is built as `ppo-rlhf ppo` builds it (`PPOTrainer(config)`: LoRA actor, the base with
the adapter disabled as the reference, the task's rule reward) and its iteration is its own
`PPOTrainer.step`, on the batches `PPOTrainer.train` would draw for the seed (draw_batch with a
generator seeded by it).  Left out of `train()`: the run folder's logging and the in-process
evaluation: the policy adapter is saved every `save_every` iterations, outside the timed part, and
judged afterwards by the same evaluator as TRL's.  metrics.jsonl gets the wall (and process CPU) seconds of each
iteration and the trainer's own split (generate / score / forward: old and reference passes /
train: the optimizer steps / other).
"""

from __future__ import annotations

import json

import torch

from ppo_rlhf.config import build_config
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf_run import run_settings, timed_iterations  # this folder: the script's own, first on sys.path


def main() -> None:
    settings, out = run_settings(__doc__)
    config = build_config(PPOConfig, settings["ppo"], "bench_peers_grpo")
    trainer = PPOTrainer(config)
    batches = timed_iterations(trainer, trainer.run_parts.train_rows, config, out, settings["save_every"],
                               ("score", "kl", "response_length", "update_steps"), cpu=True)
    drawn = [[row["task_index"] for row in batch] for batch in batches]
    (out / "result.json").write_text(json.dumps({
        "system": "ppo-rlhf", "first_batch_task_indices": drawn[0], "task_indices": drawn, "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "peft": __import__("peft").__version__},
        "ppo_config": dict(vars(config)),
    }, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
