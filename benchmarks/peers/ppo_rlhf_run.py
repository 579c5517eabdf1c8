"""One ppo-rlhf PPO run for benchmarks/bench_peers.py, laid out as the TRL run is (trl_ppo.py).

    python benchmarks/peers/ppo_rlhf_run.py --settings RUN.json

The trainer and its iteration are ppo-rlhf's own (`PPOTrainer.step`, built as `ppo-rlhf ppo`
builds it: trainers/roles.py, the task's prompts drawn by trainers/ppo_setup.py's draw_batch); what this
script leaves out of `run_ppo` is the run folder's logging (TensorBoard, curves) and the
in-process evaluation: the policy is saved every `save_every` iterations, outside the timed
part, and judged afterwards by the same evaluator as TRL's policies.  Per iteration it writes
wall seconds and the trainer's own split (generate / score / forward: old and reference passes,
rewards, advantages / train: the PPO epochs / other: the rest) to metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ppo_rlhf.config import build_config
from ppo_rlhf.models import save_pretrained_atomic
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.sequences import stop_token_ids
from ppo_rlhf.stages.common import load_task, seed_everything, set_threads
from ppo_rlhf.stages.ppo import draw_batch, prompt_sets
from ppo_rlhf.trainers.roles import load_roles
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig


def build_trainer(values: dict, task_seed: int):
    """(trainer, train rows, config) exactly as PPOTrainer(config) builds them (trainers/ppo_setup.py), except that the
    task (its prompts and held-out split) is that of the SFT pipeline's seed, not the PPO seed's."""
    config = build_config(PPOConfig, values, "bench_peers")
    set_threads(config.num_threads)
    seed_everything(config.seed)
    task = load_task(config.task, task_seed)
    accelerator = config.accelerator()
    roles = load_roles(config, task)
    train_rows, _ = prompt_sets(config, task)
    generator = TorchGenerator(stop_token_ids(roles.tokenizer, roles.actor), roles.tokenizer.pad_token_id,
                               config.max_new_tokens, do_sample=config.do_sample, temperature=config.temperature,
                               seed=config.seed, device=accelerator.device)
    trainer = PPOTrainer(config, roles.reward, model=roles.actor, ref=roles.ref, tokenizer=roles.tokenizer,
                         generator=generator, critic=roles.critic, accelerator=accelerator)
    return trainer, train_rows, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", required=True)
    args = parser.parse_args()
    settings = json.loads(Path(args.settings).read_text())
    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)
    trainer, train_rows, config = build_trainer(settings["ppo"], settings["task_seed"])
    rng = torch.Generator().manual_seed(config.seed)  # as PPOTrainer.train draws its batches
    save_every = settings["save_every"]

    def save(iteration: int) -> None:
        save_pretrained_atomic(trainer.actor, None, out / "policies" / f"{iteration:05d}")

    save(0)
    first_prompts = None
    with open(out / "metrics.jsonl", "w") as log:
        for iteration in range(1, config.iterations + 1):
            start = time.perf_counter()
            batch = draw_batch(train_rows, config, rng)
            metrics = trainer.step(batch)
            wall = time.perf_counter() - start
            split = {f"time/{k}": metrics[f"time/{k}"] for k in ("generate", "score", "forward", "train")}
            record = {"iteration": iteration, "time/iteration": wall, **split,
                      "time/other": wall - sum(split.values()), "score": metrics["score"], "kl": metrics["kl"],
                      "kl_coef": metrics["kl_coef"], "response_length": metrics["response_length"],
                      "update_steps": metrics["update_steps"]}
            log.write(json.dumps(record) + "\n")
            log.flush()
            if first_prompts is None:
                first_prompts = [row[config.prompt_field] for row in batch]
            if iteration % save_every == 0 or iteration == config.iterations:
                save(iteration)
    (out / "result.json").write_text(json.dumps({
        "system": "ppo-rlhf", "first_batch_prompts": first_prompts, "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "ppo_config": {k: v for k, v in vars(config).items()},
    }, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
