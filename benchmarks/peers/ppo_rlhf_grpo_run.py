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

import argparse
import json
import time
from pathlib import Path

import torch

from ppo_rlhf.config import build_config
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.ppo_loop import save_actor
from ppo_rlhf.trainers.ppo_setup import draw_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", required=True)
    args = parser.parse_args()
    settings = json.loads(Path(args.settings).read_text())
    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(PPOConfig, settings["ppo"], "bench_peers_grpo")
    trainer = PPOTrainer(config)
    train_rows = trainer.run_parts.train_rows
    rng = torch.Generator().manual_seed(config.seed)  # as PPOTrainer.train draws its batches
    save_every = settings["save_every"]

    def save(iteration: int) -> None:
        save_actor(trainer.actor, None, out / "policies" / f"{iteration:05d}")

    save(0)
    drawn = []
    with open(out / "metrics.jsonl", "w") as log:
        for iteration in range(1, config.iterations + 1):
            start, start_cpu = time.perf_counter(), time.process_time()
            batch = draw_batch(train_rows, config, rng)
            metrics = trainer.step(batch)
            wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            split = {f"time/{k}": metrics.get(f"time/{k}", 0.0) for k in ("generate", "score", "forward", "train")}
            record = {"iteration": iteration, "time/iteration": wall, "cpu/iteration": cpu, **split,
                      "time/other": wall - sum(split.values()), "score": metrics.get("score"),
                      "kl": metrics.get("kl"), "response_length": metrics.get("response_length"),
                      "update_steps": metrics.get("update_steps")}
            log.write(json.dumps(record) + "\n")
            log.flush()
            drawn.append([row["task_index"] for row in batch])
            if iteration % save_every == 0 or iteration == config.iterations:
                save(iteration)
    (out / "result.json").write_text(json.dumps({
        "system": "ppo-rlhf", "first_batch_task_indices": drawn[0], "task_indices": drawn, "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "peft": __import__("peft").__version__},
        "ppo_config": dict(vars(config)),
    }, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
