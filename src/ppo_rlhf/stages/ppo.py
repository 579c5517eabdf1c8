"""``ppo-rlhf ppo``: load the four roles, run PPO iterations, evaluate, checkpoint, resume.

Run folder:
    OUT/config.yaml, metrics.jsonl, tb/, curves.png, summary.json
    OUT/checkpoints/actor/    the final actor, a standard causal-LM folder (with tokenizer)
    OUT/checkpoints/critic/   the final critic (value head, plus its trunk or adapter); estimator gae only
    OUT/checkpoints/last/     resumable state, rewritten atomically every --save-every iterations
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ppo_rlhf.checkpoint import atomic_directory, atomic_write_json
from ppo_rlhf.config import ConfigError, to_dict
from ppo_rlhf.data import drop_empty_prompts, load_rows, prompt_check
from ppo_rlhf.distributed import batch_for_rank, gather_objects, is_main_process, on_main_process, rank, world_size
from ppo_rlhf.evaluation import Evaluator
from ppo_rlhf.formats import prompt_rows
from ppo_rlhf.hub import resolve_hub_models
from ppo_rlhf.interrupts import RunInterrupted, stop_requested
from ppo_rlhf.models import load_causal_lm, save_pretrained_atomic
from ppo_rlhf.models.lora import load_adapter_weights, save_adapter
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.reward import check_columns
from ppo_rlhf.rollout.sequences import stop_token_ids
from ppo_rlhf.sharding import gathered, load_whole_state, local_optimizer_state
from ppo_rlhf.run_folder import check_run_folder, start_run_folder
from ppo_rlhf.runlog import open_run_log
from ppo_rlhf.stages.common import check_policy, seed_everything, set_threads
from ppo_rlhf.tasks import make_task
from ppo_rlhf.stages.ppo_plan import plan_lines, plan_warnings, score_spread_warning, sharded_roles
from ppo_rlhf.stages.roles import load_roles, reward_functions
from ppo_rlhf.trainers.guard import require_finite, require_finite_in_every_process
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.resume import (METRICS_ROWS, RUN_CONFIG, check_resume_settings, check_resumed_steps,
                                     drop_metrics_after, metric_rows, run_settings)
from ppo_rlhf.trainers.ppo_config import PPOConfig

CURVES = ["score", "kl", "eval/score", "eval/exact_match", "eval_sampled/exact_match", "pg_loss", "vf_loss", "entropy", "clipfrac", "explained_variance",
          "kl_coef"]


def reward_curves(reward) -> list[str]:
    """A panel for each reward of several (one reward's is the score's own curve)."""
    names = getattr(reward, "names", [])
    return [f"reward/{name}" for name in names] if len(names) > 1 else []


def eval_line(metrics: dict) -> str:
    """The held-out figures worth a line on the console."""
    keys = [k for k in ("eval/exact_match", "eval_sampled/exact_match", "eval/score", "eval/response_length")
            if k in metrics]
    return ", ".join(f"{key} {metrics[key]:.4g}" for key in keys)


def prompt_sets(config: PPOConfig, task) -> tuple[list[dict], list[dict]]:
    required = {config.prompt_field: prompt_check(config.chat_template)}
    convert = prompt_rows(config.prompt_field, config.chat_template)
    train = load_rows(config.prompts, required, convert, config.data_split) if config.prompts else (task.prompt_rows() if task else None)
    if train is None:
        raise ConfigError("no prompts: give --prompts FILE or --task doubling")
    if config.prompts:
        train = drop_empty_prompts(train, config.prompt_field, config.prompts)
    if config.eval_prompts:
        held_out = drop_empty_prompts(load_rows(config.eval_prompts, required, convert, config.eval_split), config.prompt_field, config.eval_prompts)
    else:
        held_out = task.eval_rows() if task else []
    return train, held_out[: config.eval_size]


def draw_batch(train_rows: list[dict], config: PPOConfig, rng: torch.Generator) -> list[dict]:
    """batch_size rows: batch_size / samples_per_prompt prompts drawn with replacement, each
    repeated samples_per_prompt times in adjacent rows (the group baselines read them so)."""
    k = config.samples_per_prompt
    prompt_index = torch.randint(len(train_rows), (config.batch_size // k,), generator=rng)
    return [train_rows[i] for i in prompt_index.tolist() for _ in range(k)]


def save_last(trainer: PPOTrainer, out: Path, rng: torch.Generator, config: PPOConfig, progress: dict) -> None:
    """Everything needed to continue, in one folder replaced atomically.  ``progress``: what the
    summary needs from before a kill (the starting evaluation, PPO seconds so far).  A weight or
    optimizer state that is not finite is never written over the last good checkpoint.

    Several processes: each one's random state is gathered (each samples its own rollouts), and
    the main process writes the folder once while the others wait for it."""
    trainer_state = trainer.state_dict()  # every process: sharded optimizer moments gathered to the main one
    random_states = gather_objects([{
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None,
        "sample_rng": trainer.generator.rng.get_state() if getattr(trainer.generator, "rng", None) else None,
    }])

    def write() -> None:
        with atomic_directory(out / "checkpoints" / "last") as staging:
            save_actor(trainer.actor, None, staging / "actor")
            if trainer.critic is not None:
                trainer.critic.save(staging / "critic")
            torch.save({"trainer": trainer_state, "prompt_rng": rng.get_state(), **random_states[0],
                        "random_states": random_states, "progress": progress, METRICS_ROWS: metric_rows(out)},
                       staging / "trainer_state.pt")
            atomic_write_json(staging / RUN_CONFIG, run_settings(config))

    with gathered(trainer.actor), gathered(trainer.critic):  # sharded: whole weights in every process meanwhile
        require_trained_finite(trainer)
        on_main_process(write)


def require_trained_finite(trainer: PPOTrainer) -> None:
    """DivergenceError naming the tensor if what PPO trains holds a NaN or an infinity, in every
    process together.  Sharded models: call it with them gathered; the optimizer's moments are
    checked shard by shard where they are."""
    trained = {name: p for name, p in trainer.actor.named_parameters() if p.requires_grad}
    if trainer.critic is not None:
        trained.update({f"critic.{name}": p for name, p in trainer.critic.named_parameters()})
    require_finite(trained, "the PPO actor/critic")
    moments = local_optimizer_state(trainer.optimizer)["state"]
    require_finite_in_every_process({f"optimizer state {index}.{key}": value for index, state in moments.items()
                                     for key, value in state.items()}, "the PPO optimizer")


def is_peft_model(model) -> bool:
    return hasattr(model, "peft_config")


def save_actor(actor, tokenizer, path: Path, dtype: torch.dtype | None = None) -> Path:
    """A full causal-LM folder (in ``dtype``; default: as trained), or with LoRA the policy
    adapter as a peft folder (float32 as trained)."""
    if is_peft_model(actor):
        return save_adapter(actor, actor.active_adapter, path, tokenizer)
    return save_pretrained_atomic(actor, tokenizer, path, dtype=dtype)


def save_critic(critic, tokenizer, path: Path) -> Path:
    """The final critic, in the dtype its trunk came in (bf16 in, bf16 out)."""
    with atomic_directory(path) as staging:
        critic.save(staging, tokenizer, dtype=critic.stored_dtype)
    return path


def load_last(trainer: PPOTrainer, out: Path, rng: torch.Generator, config: PPOConfig) -> dict:
    """Restore the state saved by :func:`save_last`; returns its ``progress``."""
    last = out / "checkpoints" / "last"
    if is_peft_model(trainer.actor):
        load_adapter_weights(trainer.actor, trainer.actor.active_adapter, last / "actor")
    else:
        load_whole_state(trainer.actor, load_causal_lm(last / "actor").state_dict())  # the actor may be sharded
    # (A shared head from before critics had folders of their own is in the trainer state.)
    if trainer.critic is not None and (last / "critic").is_dir():
        trainer.critic.load_saved(last / "critic")
    state = torch.load(last / "trainer_state.pt", weights_only=False, map_location="cpu")
    trainer.load_state_dict(state["trainer"])
    check_resumed_steps(trainer.iteration, config.iterations, last, "iteration", "--iterations")
    # The learning rates are the ones asked now (a resume may change them), not the saved ones.
    actor_group, critic_group = trainer.optimizer.param_groups
    actor_group["lr"], critic_group["lr"] = config.lr, config.critic_lr or config.lr
    rng.set_state(state["prompt_rng"])
    # This process's own random state (one process: the only one); the world size was checked at start.
    mine = state.get("random_states", [state])[rank()]
    torch.set_rng_state(mine["torch_rng"])
    if mine.get("cuda_rng") is not None and trainer.device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda_rng"], trainer.device)
    if mine["sample_rng"] is not None and getattr(trainer.generator, "rng", None) is not None:
        trainer.generator.rng.set_state(mine["sample_rng"])
    # Logged after the checkpoint: they will be logged again.
    on_main_process(drop_metrics_after, out, trainer.iteration, state.get(METRICS_ROWS))
    return state.get("progress", {})


def check_processes(config: PPOConfig) -> None:
    """Several processes split each batch of rollouts, and each minibatch, evenly, and keep the K
    samples of a prompt in one process (the group baselines read them together)."""
    processes = world_size()
    if processes == 1:
        return
    unit = processes * config.samples_per_prompt
    if config.batch_size % unit:
        raise ConfigError(f"invalid value for 'batch_size': {config.batch_size}; with {processes} processes it must be "
                          f"a multiple of {unit} (processes x samples_per_prompt), so each process rolls out whole "
                          f"prompt groups")
    if config.mini_batch_size % processes:
        raise ConfigError(f"invalid value for 'mini_batch_size': {config.mini_batch_size}; with {processes} processes "
                          f"it must be a multiple of {processes}, each process computing an equal slice of it")
    micro = config.train_micro_batch_size
    if micro is not None and (config.mini_batch_size // processes) % micro:
        raise ConfigError(f"invalid value for 'train_micro_batch_size': {micro}; with {processes} processes each "
                          f"computes {config.mini_batch_size // processes} rows of a minibatch, which it must divide")


def run_ppo(config: PPOConfig, config_record: dict | None = None, show_samples: int | None = None) -> dict:
    """``show_samples``: overrides ``config.show_samples`` (the demo prints its own)."""
    show_samples = config.show_samples if show_samples is None else show_samples
    set_threads(config.num_threads)
    seed_everything(config.seed)
    out = Path(config.out)
    resolve_hub_models(config)  # a model named as on the Hub: its cached snapshot
    accelerator = config.accelerator(shards=True)  # under accelerate launch / torchrun: joins the process group
    check_processes(config)
    on_main_process(check_run_folder, out, config.overwrite, config.resume,
                    resumable=out / "checkpoints" / "last" / "trainer_state.pt")
    if config.resume:
        check_resume_settings(config, out)
    task = make_task(config, config.seed)
    main = is_main_process()
    # The data and the rewards that need no model first: a column a reward needs and the data
    # lacks stops the run before any model is loaded.
    train_rows, eval_rows = prompt_sets(config, task)
    functions = reward_functions(config, task)
    check_columns(functions, train_rows, config.prompts or f"the {config.task} task's prompts")
    if task is None:  # held-out rows are scored by the reward only without a task (a task has its metric)
        check_columns(functions, eval_rows, config.eval_prompts)
    roles = load_roles(config, task, functions)
    actor, tokenizer, reward = roles.actor, roles.tokenizer, roles.reward
    # The trained models are saved in the dtype they came in (adapters and value heads: float32).
    actor_dtype = actor.dtype
    curves = CURVES + reward_curves(reward)
    check_policy(actor, tokenizer, config.model, [r[config.prompt_field] for r in train_rows + eval_rows],
                 config.chat_template, config.max_prompt_length, config.max_new_tokens)
    generator = TorchGenerator(stop_token_ids(tokenizer, actor), tokenizer.pad_token_id, config.max_new_tokens,
                               do_sample=config.do_sample, temperature=config.temperature,
                               seed=config.seed + rank(),  # each process samples its own rollouts
                               device=accelerator.device)
    trainer = PPOTrainer(actor, roles.ref, reward, tokenizer, config, generator, critic=roles.critic,
                         accelerator=accelerator)
    rng = torch.Generator().manual_seed(config.seed)
    for notice in on_main_process(start_run_folder, out, config.overwrite):
        print(notice)
    # What the summary needs from before a resume: the true starting evaluation, PPO seconds so far.
    carried = load_last(trainer, out, rng, config) if config.resume else {}
    resumed = config.resume
    run_log = open_run_log(out, config_record or to_dict(config), resume_after=trainer.iteration if resumed else None)
    evaluator = None
    if eval_rows:
        evaluator = Evaluator(tokenizer, eval_rows, task.metric if task else None,
                              reward=None if task else reward, prompt_field=config.prompt_field,
                              max_prompt_length=config.max_prompt_length, max_new_tokens=config.max_new_tokens,
                              chat_template=config.chat_template)

    # Sharded: the actor, and a reward model that scores the held-out answers, gathered once for an
    # evaluation, so that each process may run as many passes as its share of the prompts needs.
    scoring_model = getattr(evaluator.reward, "model", None) if evaluator else None

    def evaluate() -> tuple[dict, list]:
        """Held-out metrics (greedy, and sampled with one fixed seed so the curve compares like
        with like) and the greedy (prompt, response) pairs."""
        with accelerator.autocast(), gathered(actor), gathered(scoring_model):
            metrics, samples = evaluator(actor)
            if config.eval_sampled:
                metrics.update(evaluator(actor, do_sample=True, seed=config.seed, prefix="eval_sampled/")[0])
        return metrics, samples

    if main:
        print(f"ppo-rlhf ppo -> {out}" + (f" (resumed from {out / 'checkpoints' / 'last'}, after iteration "
                                          f"{trainer.iteration} of {config.iterations})" if resumed else ""))
        for line in plan_lines(config, roles, trainer, len(train_rows)):
            print("  " + line)
        if world_size() > 1:
            n = world_size()
            print(f"  processes: {n}, data parallel: each rolls out {config.batch_size // n} of the batch and "
                  f"computes {config.mini_batch_size // n} rows of each minibatch; gradients summed")
            if trainer.sharding is not None:
                print(f"  sharded (FSDP): {sharded_roles(trainer)} split over the {n} processes, one unit per "
                      f"decoder layer; the frozen ones gathered a layer at a time for each pass")
        for warning in plan_warnings(config):
            print(f"warning: {warning}")
    if "before" in carried:
        before, samples_before = carried["before"], carried["samples_before"]
    else:
        with accelerator.autocast(), gathered(actor), gathered(scoring_model):
            before, samples_before = (evaluator(actor) if evaluator else ({}, []))
        if before:
            run_log.log(0, before)
    final_eval = None  # the evaluation of the last iteration, reused as the run's result
    train_seconds = carried.get("train_seconds", 0.0)
    scores = dict(carried.get("scores", {}))  # the training score of the first and of the last iteration
    first_iteration = trainer.iteration
    progress = tqdm(range(first_iteration, config.iterations), desc="ppo", mininterval=1.0, disable=not main)
    for iteration in progress:
        start = time.perf_counter()
        # Every process draws the same batch and rolls out its own part of it.
        def draw() -> list[dict]:
            return batch_for_rank(draw_batch(train_rows, config, rng))

        metrics = trainer.step(draw(), draw_more=draw)  # draw_more: --dynamic-sampling's extra prompts
        train_seconds += time.perf_counter() - start
        metrics["time/elapsed"] = train_seconds  # PPO time so far, evaluation excluded
        done = iteration + 1
        if evaluator and ((config.eval_every and done % config.eval_every == 0) or done == config.iterations):
            eval_metrics, samples = evaluate()
            metrics.update(eval_metrics)
            if done == config.iterations:
                final_eval = eval_metrics, samples
            if main:
                tqdm.write(f"iteration {done}: held-out " + eval_line(eval_metrics))
        run_log.log(done, metrics)
        if "eval/response_length" in metrics:
            run_log.plot(curves, title="PPO")  # redrawn at each evaluation, so a long run can be watched
        if main and config.sample_every and (done % config.sample_every == 0 or iteration == first_iteration):
            run_log.log_samples(done, trainer.last_samples)
            for sample in trainer.last_samples[:2]:
                tqdm.write(f"iteration {done} sample: {sample['prompt']!r} -> {sample['response']!r} "
                           f"(score {sample['score']:.3g})")
        scores.setdefault("first", metrics["score"])
        scores["last"] = metrics["score"]
        if main and iteration == first_iteration and (warning := score_spread_warning(metrics, done)):
            tqdm.write(f"warning: {warning}")
        progress.set_postfix(score=f"{metrics['score']:.3f}", kl=f"{metrics['kl']:.3f}")
        stop = stop_requested()  # Ctrl-C: this iteration's state saved, then the run stops (interrupts.py)
        if config.save_every and (done % config.save_every == 0 or done == config.iterations or stop):
            save_last(trainer, out, rng, config, {"before": before, "samples_before": samples_before,
                                                  "train_seconds": train_seconds, "scores": scores})
        if stop:
            raise RunInterrupted(done, "iteration", done if config.save_every else None)

    if evaluator and final_eval is None:  # resumed at the end: no iteration ran
        final_eval = evaluate()
    def save_models() -> dict:
        """Saved in the dtype each model came in (bf16 in, bf16 out); trained in float32."""
        actor_dir = save_actor(actor, tokenizer, out / "checkpoints" / "actor", dtype=actor_dtype)
        saved = {"actor": str(actor_dir)}
        if trainer.critic is not None:  # a critic-free estimator has none to save
            saved["critic"] = str(save_critic(trainer.critic, tokenizer, out / "checkpoints" / "critic"))
        return saved

    with gathered(actor), gathered(trainer.critic):  # sharded: whole weights in every process meanwhile
        require_trained_finite(trainer)
        checkpoints = on_main_process(save_models)  # the processes hold the same weights: written once
    final_metrics, samples_after = final_eval or ({}, [])
    after = {k: v for k, v in final_metrics.items() if k.startswith("eval/")}
    sampled = {k: v for k, v in final_metrics.items() if k.startswith("eval_sampled/")}
    run_log.plot(curves, title="PPO")
    summary = {
        "stage": "ppo",
        "iterations": config.iterations,
        "ppo_seconds": round(train_seconds, 2),
        "training_score": scores,
        "before": before,
        "after": after,
        "after_sampled": sampled,
        "samples": [{"prompt": p, "before": b, "after": a}
                    for (p, b), (_, a) in zip(samples_before[:show_samples], samples_after[:show_samples])],
        "checkpoints": checkpoints,
    }
    run_log.write_summary(summary)
    run_log.close()
    return summary
