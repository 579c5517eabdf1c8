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
from ppo_rlhf.models import (Critic, load_causal_lm, load_sequence_classifier, load_tokenizer, same_vocabulary,
                             save_pretrained_atomic)
from ppo_rlhf.models.loading import TOKENIZER_FILES, require_model_folder
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.reward import FunctionReward, ModelReward
from ppo_rlhf.runlog import RunLog, read_metrics
from ppo_rlhf.stages.common import load_task, seed_everything, set_threads
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig

CURVES = ["score", "kl", "eval/exact_match", "eval_sampled/exact_match", "pg_loss", "vf_loss", "entropy", "clipfrac", "explained_variance",
          "kl_coef"]


def build_reward(config: PPOConfig, tokenizer, task):
    if config.reward_fn:
        return FunctionReward(config.reward_fn)
    if config.reward_model:
        model = load_sequence_classifier(config.reward_model)
        return ModelReward(model, load_tokenizer(config.reward_model), tokenizer, label_field=config.label_field)
    if task is not None:
        return FunctionReward(task.rule_reward, name=f"{task.name}.rule_reward")
    raise ConfigError("no reward: give --reward-model DIR or --reward-fn module:function")


def shares_vocabulary(folder: str, tokenizer, actor) -> bool:
    """Whether the model in ``folder`` reads the actor's token ids as the same tokens: by its
    tokenizer when it has one, else (a critic checkpoint) by its vocabulary size."""
    folder = require_model_folder(folder, "critic initialisation model")
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return same_vocabulary(load_tokenizer(folder), tokenizer)
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(folder), "vocab_size", None) == actor.config.vocab_size


def critic_init_folder(config: PPOConfig, tokenizer, actor) -> str:
    """Where a separate critic starts.  It scores the actor's own token ids, position by
    position, so (unlike the reward model, which can re-encode text) it must share the actor's
    vocabulary: the reward model is the default only when it does, else the actor itself."""
    if config.critic_model:
        if not shares_vocabulary(config.critic_model, tokenizer, actor):
            raise ConfigError(f"--critic-model {config.critic_model} has a different vocabulary from the actor "
                              f"{config.model}; a separate critic reads the actor's token ids, so give a model "
                              f"with the actor's tokenizer (or leave --critic-model empty)")
        return config.critic_model
    if config.reward_model and shares_vocabulary(config.reward_model, tokenizer, actor):
        return config.reward_model
    return config.model


def build_critic(config: PPOConfig, tokenizer, actor):
    if config.critic == "shared":
        return None
    return Critic.from_pretrained_trunk(critic_init_folder(config, tokenizer, actor))


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
        trainer.actor.save_pretrained(staging / "actor")
        if trainer.critic is not None:
            trainer.critic.save(staging / "critic")
        torch.save({"trainer": trainer.state_dict(), "prompt_rng": rng.get_state(), "torch_rng": torch.get_rng_state(),
                    "sample_rng": trainer.generator.rng.get_state() if getattr(trainer.generator, "rng", None) else None},
                   staging / "trainer_state.pt")


def load_last(trainer: PPOTrainer, out: Path, rng: torch.Generator) -> bool:
    last = out / "checkpoints" / "last"
    if not (last / "trainer_state.pt").is_file():
        return False
    trainer.actor.load_state_dict(load_causal_lm(last / "actor").state_dict())
    if trainer.critic is not None:
        trainer.critic.load_state_dict(Critic.load(last / "critic").state_dict())
    state = torch.load(last / "trainer_state.pt", weights_only=False)
    trainer.load_state_dict(state["trainer"])
    rng.set_state(state["prompt_rng"])
    torch.set_rng_state(state["torch_rng"])
    if state["sample_rng"] is not None and getattr(trainer.generator, "rng", None) is not None:
        trainer.generator.rng.set_state(state["sample_rng"])
    # Drop metrics logged after the checkpoint: they will be logged again.
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] <= trainer.iteration]
    atomic_write_text(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    return True


def run_ppo(config: PPOConfig, config_record: dict | None = None, show_samples: int = 0) -> dict:
    set_threads(config.num_threads)
    seed_everything(config.seed)
    task = load_task(config.task, config.seed)
    if config.model is None:
        raise ConfigError("no actor: give --model DIR (the SFT checkpoint)")
    # The model before its tokenizer: a folder of the wrong kind is then named as such.
    actor, ref = load_causal_lm(config.model), load_causal_lm(config.model)
    tokenizer = load_tokenizer(config.model)
    reward = build_reward(config, tokenizer, task)
    train_rows, eval_rows = prompt_sets(config, task)
    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, config.max_new_tokens,
                               do_sample=config.do_sample, temperature=config.temperature, seed=config.seed)
    critic = build_critic(config, tokenizer, actor)
    trainer = PPOTrainer(actor, ref, reward, tokenizer, config, generator, critic=critic)
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
        metrics, samples = evaluator(actor)
        if config.eval_sampled:
            metrics.update(evaluator(actor, do_sample=True, seed=config.seed, prefix="eval_sampled/")[0])
        return metrics, samples

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

    actor_dir = save_pretrained_atomic(actor, tokenizer, out / "checkpoints" / "actor")
    with atomic_directory(out / "checkpoints" / "critic") as staging:
        if trainer.critic is not None:
            trainer.critic.save(staging)
            tokenizer.save_pretrained(staging)  # says which token ids the critic reads
        else:
            from safetensors.torch import save_file

            save_file(trainer.value_head.state_dict(), str(staging / "value_head.safetensors"))
    if evaluator and final_eval is None:  # resumed at the end: no iteration ran
        final_eval = evaluate()
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
