"""``ppo-rlhf ppo``: load the four roles, run PPO iterations, evaluate, checkpoint, resume.

Run folder:
    OUT/config.yaml, metrics.jsonl, tb/, curves.png, summary.json
    OUT/checkpoints/actor/    the final actor, a standard causal-LM folder (with tokenizer)
    OUT/checkpoints/critic/   the final critic (value head, plus trunk if separate)
    OUT/checkpoints/last/     resumable state, rewritten atomically every --save-every iterations
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ppo_rlhf.checkpoint import atomic_directory, atomic_write_text
from ppo_rlhf.config import ConfigError, to_dict
from ppo_rlhf.data import load_rows
from ppo_rlhf.evaluation import Evaluator
from ppo_rlhf.models import load_causal_lm, save_pretrained_atomic
from ppo_rlhf.models.lora import load_adapter_weights, save_adapter
from ppo_rlhf.models.value import Critic
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.runlog import RunLog, read_metrics
from ppo_rlhf.stages.common import load_task, seed_everything, set_threads
from ppo_rlhf.stages.roles import load_roles
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig

CURVES = ["score", "kl", "eval/exact_match", "eval_sampled/exact_match", "pg_loss", "vf_loss", "entropy", "clipfrac", "explained_variance",
          "kl_coef"]


def prompt_sets(config: PPOConfig, task) -> tuple[list[dict], list[dict]]:
    required = (config.prompt_field,)
    train = load_rows(config.prompts, required) if config.prompts else (task.prompt_rows() if task else None)
    if train is None:
        raise ConfigError("no prompts: give --prompts FILE or --task doubling")
    if config.eval_prompts:
        held_out = load_rows(config.eval_prompts, required)
    else:
        held_out = task.eval_rows() if task else []
    return train, held_out[: config.eval_size]


def save_last(trainer: PPOTrainer, out: Path, rng: torch.Generator) -> None:
    """Everything needed to continue, in one folder replaced atomically."""
    with atomic_directory(out / "checkpoints" / "last") as staging:
        save_actor(trainer.actor, None, staging / "actor")
        if trainer.critic is not None:
            trainer.critic.save(staging / "critic")
        torch.save({"trainer": trainer.state_dict(), "prompt_rng": rng.get_state(), "torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None,
                    "sample_rng": trainer.generator.rng.get_state() if getattr(trainer.generator, "rng", None) else None},
                   staging / "trainer_state.pt")


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config")


def save_actor(actor, tokenizer, path: Path) -> Path:
    """A full causal-LM folder, or with LoRA the policy adapter as a peft folder."""
    if is_peft_model(actor):
        return save_adapter(actor, actor.active_adapter, path, tokenizer)
    return save_pretrained_atomic(actor, tokenizer, path)


def load_last(trainer: PPOTrainer, out: Path, rng: torch.Generator) -> bool:
    last = out / "checkpoints" / "last"
    if not (last / "trainer_state.pt").is_file():
        return False
    if is_peft_model(trainer.actor):
        load_adapter_weights(trainer.actor, trainer.actor.active_adapter, last / "actor")
    else:
        trainer.actor.load_state_dict(load_causal_lm(last / "actor").state_dict())
    if trainer.critic is not None:
        trainer.critic.load_saved(last / "critic")
    state = torch.load(last / "trainer_state.pt", weights_only=False, map_location="cpu")
    trainer.load_state_dict(state["trainer"])
    rng.set_state(state["prompt_rng"])
    torch.set_rng_state(state["torch_rng"])
    if state.get("cuda_rng") is not None and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], trainer.device)
    if state["sample_rng"] is not None and getattr(trainer.generator, "rng", None) is not None:
        trainer.generator.rng.set_state(state["sample_rng"])
    # Drop metrics logged after the checkpoint: they will be logged again.
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] <= trainer.iteration]
    atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    return True


def run_ppo(config: PPOConfig, config_record: dict | None = None, show_samples: int | None = None) -> dict:
    """``show_samples``: overrides ``config.show_samples`` (the demo prints its own)."""
    show_samples = config.show_samples if show_samples is None else show_samples
    set_threads(config.num_threads)
    seed_everything(config.seed)
    task = load_task(config.task, config.seed)
    accelerator = config.accelerator()
    roles = load_roles(config, task)
    actor, tokenizer, reward = roles.actor, roles.tokenizer, roles.reward
    # The trained models are saved in the dtype they came in (adapters and value heads: float32).
    actor_dtype = actor.dtype
    critic_dtype = roles.critic.backbone.dtype if isinstance(roles.critic, Critic) else None
    train_rows, eval_rows = prompt_sets(config, task)
    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, config.max_new_tokens,
                               do_sample=config.do_sample, temperature=config.temperature, seed=config.seed,
                               device=accelerator.device)
    trainer = PPOTrainer(actor, roles.ref, reward, tokenizer, config, generator, critic=roles.critic,
                         accelerator=accelerator)
    out = Path(config.out)
    rng = torch.Generator().manual_seed(config.seed)
    resumed = config.resume and load_last(trainer, out, rng)
    run_log = RunLog(out, config_record or to_dict(config))
    evaluator = None
    if eval_rows:
        evaluator = Evaluator(tokenizer, eval_rows, task.metric if task else None,
                              reward=None if task else reward, prompt_field=config.prompt_field,
                              max_prompt_length=config.max_prompt_length, max_new_tokens=config.max_new_tokens,
                              chat_template=config.chat_template)

    def evaluate() -> tuple[dict, list]:
        """Held-out metrics (greedy, and sampled with one fixed seed so the curve compares like
        with like) and the greedy (prompt, response) pairs."""
        with accelerator.autocast():
            metrics, samples = evaluator(actor)
            if config.eval_sampled:
                metrics.update(evaluator(actor, do_sample=True, seed=config.seed, prefix="eval_sampled/")[0])
        return metrics, samples

    with accelerator.autocast():
        before, samples_before = (evaluator(actor) if evaluator else ({}, []))
    if not resumed and before:
        run_log.log(0, before)
    final_eval = None  # the evaluation of the last iteration, reused as the run's result
    train_seconds = 0.0
    progress = tqdm(range(trainer.iteration, config.iterations), desc="ppo", leave=False, mininterval=1.0)
    for iteration in progress:
        batch_index = torch.randint(len(train_rows), (config.batch_size,), generator=rng)
        start = time.perf_counter()
        metrics = trainer.step([train_rows[i] for i in batch_index])
        train_seconds += time.perf_counter() - start
        metrics["time/elapsed"] = train_seconds  # PPO time so far, evaluation excluded
        done = iteration + 1
        if evaluator and ((config.eval_every and done % config.eval_every == 0) or done == config.iterations):
            eval_metrics, samples = evaluate()
            metrics.update(eval_metrics)
            if done == config.iterations:
                final_eval = eval_metrics, samples
        run_log.log(done, metrics)
        progress.set_postfix(score=f"{metrics['score']:.3f}", kl=f"{metrics['kl']:.3f}")
        if config.save_every and (done % config.save_every == 0 or done == config.iterations):
            save_last(trainer, out, rng)

    if evaluator and final_eval is None:  # resumed at the end: no iteration ran
        final_eval = evaluate()
    actor_dir = save_actor(actor if is_peft_model(actor) else actor.to(actor_dtype), tokenizer,
                           out / "checkpoints" / "actor")
    with atomic_directory(out / "checkpoints" / "critic") as staging:
        if trainer.critic is not None:
            if critic_dtype is not None:
                trainer.critic.backbone.to(critic_dtype)
            trainer.critic.save(staging, tokenizer)
        else:
            from safetensors.torch import save_file

            save_file(trainer.value_head.state_dict(), str(staging / "value_head.safetensors"))
    final_metrics, samples_after = final_eval or ({}, [])
    after = {k: v for k, v in final_metrics.items() if k.startswith("eval/")}
    sampled = {k: v for k, v in final_metrics.items() if k.startswith("eval_sampled/")}
    run_log.plot(CURVES, title="PPO")
    summary = {
        "stage": "ppo",
        "iterations": config.iterations,
        "ppo_seconds": round(train_seconds, 2),
        "before": before,
        "after": after,
        "after_sampled": sampled,
        "samples": [{"prompt": p, "before": b, "after": a}
                    for (p, b), (_, a) in zip(samples_before[:show_samples], samples_after[:show_samples])],
        "checkpoints": {"actor": str(actor_dir), "critic": str(out / "checkpoints" / "critic")},
    }
    run_log.write_summary(summary)
    run_log.close()
    return summary
