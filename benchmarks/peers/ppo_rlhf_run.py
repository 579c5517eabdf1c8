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
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.sequences import stop_token_ids
from ppo_rlhf.stages.common import load_task, seed_everything, set_threads
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.ppo_loop import save_actor
from ppo_rlhf.trainers.ppo_setup import draw_batch, prompt_sets
from ppo_rlhf.trainers.roles import load_roles


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


def timed_iterations(trainer, train_rows: list[dict], config, out: Path, save_every: int, keys: tuple[str, ...],
                     cpu: bool = False) -> list[list[dict]]:
    """``config.iterations`` of ``trainer.step`` on the batches PPOTrainer.train would draw for the seed,
    each timed (wall seconds, and with ``cpu`` the process's CPU seconds) into out/metrics.jsonl with
    the trainer's own split and its metrics ``keys``; the policy saved outside the timing, at
    iteration 0, every ``save_every`` and at the end, into out/policies/NNNNN.  Returns the batches."""
    rng = torch.Generator().manual_seed(config.seed)  # as PPOTrainer.train draws its batches

    def save(iteration: int) -> None:
        save_actor(trainer.actor, None, out / "policies" / f"{iteration:05d}")

    save(0)
    batches = []
    with open(out / "metrics.jsonl", "w") as log:
        for iteration in range(1, config.iterations + 1):
            start, start_cpu = time.perf_counter(), time.process_time()
            batch = draw_batch(train_rows, config, rng)
            metrics = trainer.step(batch)
            wall, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
            split = {f"time/{k}": metrics.get(f"time/{k}", 0.0) for k in ("generate", "score", "forward", "train")}
            record = {"iteration": iteration, "time/iteration": wall, **({"cpu/iteration": cpu_seconds} if cpu else {}),
                      **split, "time/other": wall - sum(split.values()), **{k: metrics.get(k) for k in keys}}
            log.write(json.dumps(record) + "\n")
            log.flush()
            batches.append(batch)
            if iteration % save_every == 0 or iteration == config.iterations:
                save(iteration)
    return batches


def run_settings(doc: str) -> tuple[dict, Path]:
    """The run's settings (``--settings RUN.json``) and its folder, made."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", required=True)
    settings = json.loads(Path(parser.parse_args().settings).read_text())
    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)
    return settings, out


def main() -> None:
    settings, out = run_settings(__doc__)
    trainer, train_rows, config = build_trainer(settings["ppo"], settings["task_seed"])
    batches = timed_iterations(trainer, train_rows, config, out, settings["save_every"],
                               ("score", "kl", "kl_coef", "response_length", "update_steps"))
    (out / "result.json").write_text(json.dumps({
        "system": "ppo-rlhf", "first_batch_prompts": [row[config.prompt_field] for row in batches[0]],
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "ppo_config": {k: v for k, v in vars(config).items()},
    }, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
