"""A whole PPO run: iterations, held-out evaluation, samples, checkpoints and resume, into a run
folder shaped like every other stage's (docs/design.md, "One PPO iteration" and "Resume and
divergence").  :class:`PPOLoop` is the part of PPOTrainer that :meth:`PPOLoop.train` is.

Run folder:
    OUT/config.yaml, metrics.jsonl, tb/, curves.png, summary.json
    OUT/checkpoints/actor/    the final actor, a standard causal-LM folder (with tokenizer)
    OUT/checkpoints/critic/   the final critic (value head, plus its trunk or adapter); estimator gae only
    OUT/checkpoints/last/     resumable state (trainers/resume.py): trained.safetensors holds the
                              actor's trained parameters (``actor.*``) and the critic's (``critic.*``)
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ppo_rlhf.checkpoint import atomic_directory, atomic_write_text, strict_json
from ppo_rlhf.config import ConfigError, to_dict
from ppo_rlhf.rollout.episodes import rollout_records
from ppo_rlhf.envs.protocol import EnvironmentFailed
from ppo_rlhf.distributed import batch_for_rank, gather_objects, is_main_process, on_main_process, rank, world_size
from ppo_rlhf.evaluation import Evaluator, OutcomeError, fell_below_start
from ppo_rlhf.interrupts import RunInterrupted, stop_after
from ppo_rlhf.models import save_pretrained_atomic
from ppo_rlhf.models.lora import save_adapter
from ppo_rlhf.run_folder import start_run_folder
from ppo_rlhf.rollout.reward import RewardError
from ppo_rlhf.rollout.server_api import ServerRefused, ServerUnavailable
from ppo_rlhf.runlog import open_run_log
from ppo_rlhf.sharding import gathered, local_optimizer_state
from ppo_rlhf.tasks import make_task
from ppo_rlhf.trainers.guard import require_finite, require_finite_in_every_process
from ppo_rlhf.trainers.ppo_async import AsyncRollouts
from ppo_rlhf.trainers.ppo_plan import plan_lines, plan_warnings, score_spread_warning, sharded_roles
from ppo_rlhf.trainers.ppo_setup import PromptCursor, check_run_start, draw_batch, prompt_sets
from ppo_rlhf.trainers.resume import Checkpoints, open_checkpoints

# Each panel drawn when its metric was logged: the built-in task's exact match, a reasoning task's
# accuracy, a reward's held-out score.
CURVES = ["score", "kl", "eval/score", "eval/exact_match", "eval_sampled/exact_match", "eval/accuracy",
          "eval_sampled/accuracy", "pg_loss", "vf_loss", "entropy", "clipfrac", "explained_variance", "kl_coef"]


def reward_curves(reward) -> list[str]:
    """A panel for each reward of several (one reward's is the score's own curve)."""
    names = getattr(reward, "names", [])
    return [f"reward/{name}" for name in names] if len(names) > 1 else []


def eval_line(metrics: dict) -> str:
    """The held-out figures worth a line on the console."""
    keys = [k for k in ("eval/exact_match", "eval_sampled/exact_match", "eval/accuracy", "eval_sampled/accuracy",
                        "eval/score", "eval/response_length") if k in metrics]
    keys += [k for k in metrics if k.startswith("eval_sampled/pass@")][-1:]  # pass@K, the largest k
    return ", ".join(f"{key} {metrics[key]:.4g}" for key in keys)


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


@dataclass
class Progress:
    """What the summary needs, carried over a resume in the checkpoint: the starting evaluation,
    PPO seconds so far, the training score of the first and of the last iteration."""

    before: dict = field(default_factory=dict)
    samples_before: list = field(default_factory=list)
    train_seconds: float = 0.0
    scores: dict = field(default_factory=dict)
    final_eval: tuple | None = None  # the last iteration's evaluation, the run's result (not saved)
    below_start: list = field(default_factory=list)  # [iteration, metric, at the start, then] of each fall

    def saved(self) -> dict:
        return {"before": self.before, "samples_before": self.samples_before, "train_seconds": self.train_seconds,
                "scores": self.scores, "below_start": self.below_start}


def refuse_a_second_train(trainer) -> None:
    """ConfigError if the trainer's ``train()`` has run (got past its start) before: a trainer
    trains once.  A second run into the same folder would replace the first (with ``overwrite``:
    delete its metrics, samples and checkpoints), and the trainer's state is the first run's end,
    not a start; continuing is ``--resume``'s work, from the folder's checkpoint (docs/design.md,
    "Configuration")."""
    if getattr(trainer, "trained_into", None) is not None:
        raise ConfigError(f"train() ran already on this {type(trainer).__name__} (into {trainer.trained_into}): a "
                          f"trainer trains once, and its run is kept; to continue that run, give a new trainer the "
                          f"config with resume=True (and overwrite=False), or another out for a new run")


class PPOLoop:
    """``train()`` for PPOTrainer: the attributes it reads (actor, critic, optimizer, config, ...)
    are the trainer's."""

    def train(self, *, config_record: dict | None = None, show_samples: int | None = None) -> dict:
        """Run ``config.iterations`` iterations into ``config.out`` (resuming with ``config.resume``),
        evaluating every ``eval_every``; save the final actor and critic; return the summary.
        ``config_record``: config.yaml's content (default: the config); ``show_samples``: overrides
        ``config.show_samples`` (the demo prints its own)."""
        config, out = self.config, Path(self.config.out)
        refuse_a_second_train(self)
        check_run_start(config)  # cheap, and a trainer built around in-memory models has not yet
        train_rows, eval_rows = self.prompt_rows()
        prompt_rng = torch.Generator().manual_seed(config.seed)
        self.prompt_cursor = PromptCursor()  # --prompt-order in-order's place in the prompts
        self.trained_into = out  # from here on the folder is this run's (a refused start may be tried again)
        for notice in on_main_process(start_run_folder, out, config.overwrite):
            print(notice)
        # After ``--resume``: the RNG states where a straight run would be now (nothing may draw after).
        checkpoints = open_checkpoints(config, out, config.iterations, "iteration", flag="--iterations")
        progress = self.restore(checkpoints, prompt_rng) if config.resume else Progress()
        run_log = open_run_log(out, config_record or to_dict(config),
                               resume_after=self.iteration if config.resume else None)
        self.evaluator = self.make_evaluator(eval_rows)
        self.print_plan(len(train_rows))
        if not progress.before and not config.resume:
            progress.before, progress.samples_before = self.evaluate(sampled=False)
            if progress.before:
                run_log.log(0, progress.before)
        if self.evaluator and config.eval_samples > 1:  # pass@k's outcomes readable, from the scores just seen
            self.evaluator.check_outcomes()
        try:
            self.run_iterations(train_rows, prompt_rng, checkpoints, run_log, progress)
        except (EnvironmentFailed, RewardError, ServerUnavailable, ServerRefused) as failure:
            # the user's code failed, or a generation server stopped answering: where a resume would go on
            failure.resume_from, failure.resume_unit = checkpoints.saved_step, "iteration"
            raise
        if self.evaluator and progress.final_eval is None:  # resumed at the end: no iteration ran
            progress.final_eval = self.evaluate()
        return self.finish(run_log, progress, config.show_samples if show_samples is None else show_samples)

    def prompt_rows(self) -> tuple[list[dict], list[dict]]:
        """The training and held-out prompts: loaded when the trainer was built from the config,
        else now."""
        if self.run_parts is not None:
            return self.run_parts.train_rows, self.run_parts.eval_rows
        self.task = getattr(self, "task", None) or make_task(self.config, self.config.seed)
        train_rows, eval_rows = prompt_sets(self.config, self.task, self.environments)
        if self.environments is not None:
            self.environments.check_rows(train_rows + eval_rows)
        return train_rows, eval_rows

    def make_evaluator(self, eval_rows: list[dict]) -> Evaluator | None:
        if not eval_rows:
            return None
        config = self.config
        task = self.run_parts.task if self.run_parts is not None else self.task
        return Evaluator(self.tokenizer, eval_rows, task.metric if task else None,
                         reward=None if task else self.reward, outcomes=getattr(task, "outcomes", None),
                         prompt_field=config.prompt_field,
                         max_prompt_length=config.max_prompt_length, max_new_tokens=config.max_new_tokens,
                         chat_template=config.chat_template, environments=self.environments,
                         limits=self.episode_limits, environment_weight=config.environment_reward_weight,
                         seed=config.seed, samples_flag="--eval-samples",
                         show_progress=True)  # episodes: a bar, as `eval` shows one

    def evaluate(self, sampled: bool | None = None) -> tuple[dict, list]:
        """Held-out metrics (greedy, and sampled with one fixed seed so the curve compares like
        with like) and the greedy (prompt, response) pairs.  Sharded: the actor, and a reward model
        that scores the answers, gathered once, so each process may run as many passes as its
        share of the prompts needs."""
        if self.evaluator is None:
            return {}, []
        sampled = self.config.eval_sampled if sampled is None else sampled
        scoring_model = getattr(self.evaluator.reward, "model", None)
        # An asynchronous run's worker holds the environments while it plays a batch: wait for it.
        worker = self.rollouts.lock if self.rollouts is not None else contextlib.nullcontext()
        with worker, self.accelerator.autocast(), gathered(self.actor), gathered(scoring_model):
            metrics, samples = self.evaluator(self.actor, generator=self.decoding(do_sample=False))
            if sampled:
                seed = self.config.seed + rank()  # each process its own draws (evaluation.py's default)
                metrics.update(self.evaluator(self.actor, prefix="eval_sampled/", samples=self.config.eval_samples,
                                              generator=self.decoding(do_sample=True, seed=seed))[0])
        return metrics, samples

    def print_plan(self, n_prompts: int) -> None:
        """The run's plan, printed once by the main process before the first iteration."""
        if not is_main_process():
            return
        config, out = self.config, Path(self.config.out)
        print(f"ppo-rlhf ppo -> {out}")  # a resume has said where it continues from (trainers/resume.py)
        for line in plan_lines(config, self, self, n_prompts):
            print("  " + line)
        if world_size() > 1:
            n = world_size()
            print(f"  processes: {n}, data parallel: each rolls out {config.batch_size // n} of the batch and "
                  f"computes {config.mini_batch_size // n} rows of each minibatch; gradients summed")
            if self.sharding is not None:
                print(f"  sharded (FSDP): {sharded_roles(self)} split over the {n} processes, one unit per "
                      f"decoder layer; the frozen ones gathered a layer at a time for each pass")
        for warning in plan_warnings(config, self.actor):
            print(f"warning: {warning}")

    def run_iterations(self, train_rows: list[dict], prompt_rng: torch.Generator, checkpoints: Checkpoints,
                       run_log, progress: Progress) -> None:
        """The iterations left, each logged; evaluated every ``eval_every`` and at the end; saved
        every ``save_every``, at the end, and at a Ctrl-C (interrupts.py).  An evaluation that
        refuses pass@k (OutcomeError, alike in every process) stops the run with the iteration it
        evaluated logged and saved: its training is not lost to its evaluation."""
        config, main, first = self.config, is_main_process(), self.iteration
        out_folder = Path(config.out)
        curves = CURVES + reward_curves(self.reward)
        bar = tqdm(range(first, config.iterations), desc="ppo", mininterval=1.0, disable=not main)

        def draw() -> list[dict]:  # every process draws the same batch and rolls out its own part of it
            return batch_for_rank(draw_batch(train_rows, config, prompt_rng, self.prompt_cursor))

        # --max-staleness N: a rollout worker generates the next batches while this thread trains
        # (trainers/ppo_async.py); the first batch is this thread's own, the worker starts after it.
        rollouts = self.rollouts = (AsyncRollouts(self, draw, prompt_rng, config.max_staleness, config.iterations,
                                                  self.prompt_cursor)
                                    if config.max_staleness else None)
        try:
            for iteration in bar:
                start = time.perf_counter()
                # The passes over the prompts so far, as a reward function reads them (trainer_state.epoch).
                self.state.epoch = iteration * (config.batch_size // config.samples_per_prompt) / len(train_rows)
                if rollouts is None:
                    rows, more = draw(), draw  # draw_more: --dynamic-sampling's extra prompts
                elif iteration == first:
                    rows, more = rollouts.first(), rollouts.first
                else:
                    rows, more = rollouts.take(), rollouts.take
                metrics = self.step(rows, draw_more=more)
                if rollouts is not None:
                    rollouts.start()
                progress.train_seconds += time.perf_counter() - start
                metrics["time/elapsed"] = progress.train_seconds  # PPO time so far, evaluation excluded
                progress.scores.setdefault("first", metrics["score"])
                progress.scores["last"] = metrics["score"]
                done = iteration + 1
                try:
                    self.evaluate_if_due(done, metrics, progress)
                except OutcomeError:  # pass@k refused, alike in every process: the iteration's work is kept first
                    run_log.log(done, metrics)
                    self.save_checkpoint(checkpoints, done, prompt_rng, progress)
                    raise
                run_log.log(done, metrics)
                self.state.log_history.append({**metrics, "step": done})
                if "eval/response_length" in metrics:
                    run_log.plot(curves, title="PPO")  # redrawn at each evaluation, so a long run can be watched
                self.show_samples_if_due(done, iteration == first, run_log)
                if config.save_rollouts and done % config.save_rollouts == 0:
                    self.save_rollouts(out_folder, done)
                if main and iteration == first and (warning := score_spread_warning(metrics, done)):
                    tqdm.write(f"warning: {warning}")
                bar.set_postfix(score=f"{metrics['score']:.3f}", kl=f"{metrics['kl']:.3f}")
                # Ctrl-C: this iteration's state saved, then the run stops (interrupts.py); not after the last
                stop = stop_after(done, config.iterations, "iteration")
                if checkpoints.due(done, config.iterations) or (stop and checkpoints.every):
                    self.save_checkpoint(checkpoints, done, prompt_rng, progress)
                if stop:
                    raise RunInterrupted(done, "iteration", checkpoints.saved_step)
        finally:
            if rollouts is not None:
                rollouts.stop()
                self.rollouts = None

    def evaluate_if_due(self, done: int, metrics: dict, progress: Progress) -> None:
        config = self.config
        if self.evaluator and ((config.eval_every and done % config.eval_every == 0) or done == config.iterations):
            eval_metrics, samples = self.evaluate()
            metrics.update(eval_metrics)
            if done == config.iterations:
                progress.final_eval = eval_metrics, samples
            if is_main_process():
                tqdm.write(f"iteration {done}: held-out " + eval_line(eval_metrics))
            fell = fell_below_start(progress.before, eval_metrics, len(self.evaluator.prompts))
            if fell:
                progress.below_start.append([done, *fell])
                if is_main_process():
                    key, start, now = fell
                    tqdm.write(f"warning: held-out {key} {start:.4g} at the start, {now:.4g} after iteration {done}: "
                               f"below the start by more than its noise on {len(self.evaluator.prompts)} prompts. "
                               f"This run is unlearning what the model could do (docs/agents.md, \"When a recipe "
                               f"does not learn\")")

    def show_samples_if_due(self, done: int, first: bool, run_log) -> None:
        every = self.config.sample_every
        if is_main_process() and every and (done % every == 0 or first):
            run_log.log_samples(done, self.last_samples)
            for sample in self.last_samples[:2]:
                tqdm.write(f"iteration {done} sample: {sample['prompt']!r} -> {sample['response']!r} "
                           f"(score {sample['score']:.3g})")

    def save_rollouts(self, out: Path, done: int) -> None:
        """--save-rollouts: this iteration's rollouts, every process's, as drawn, to
        rollouts/iteration_NNNN.jsonl (written once, whole or not at all)."""
        rollout = self.last_rollout
        records = gather_objects(rollout_records(rollout.rows, rollout.episodes, rollout.raw_scores))
        text = "".join(json.dumps(strict_json(record), ensure_ascii=False) + "\n" for record in records)
        on_main_process(atomic_write_text, out / "rollouts" / f"iteration_{done:04d}.jsonl", text)

    # ------------------------------------------------------------ checkpoints (trainers/resume.py)
    def trained_modules(self) -> nn.Module:
        """What trains, as one module for the checkpoint: ``actor.*`` (its trainable parameters:
        all of them, or the LoRA adapters) and ``critic.*``.  A tensor both hold (a LoRA base's
        critic adapter, a shared trunk) is saved once, under the actor's name."""
        modules = nn.ModuleDict({"actor": self.actor})
        if self.critic is not None:
            modules["critic"] = self.critic
        return modules

    def save_checkpoint(self, checkpoints: Checkpoints, done: int, prompt_rng: torch.Generator,
                        progress: Progress) -> None:
        """The trained parameters, the optimizer, the RNG states and the trainer's own state:
        the KL controller, score moments, guard, minibatch and prompt RNGs, each process's
        sampling RNG (by rank), and the summary's progress."""
        state = self.state_dict()
        state.pop("optimizer")  # Checkpoints saves it (gathered, when sharded)
        sample_rng = getattr(self.generator, "rng", None)
        sample_state = sample_rng.get_state() if sample_rng is not None else None
        prompt_state, cursor_position = prompt_rng.get_state(), self.prompt_cursor.position
        if self.rollouts is not None:  # asynchronous: where the first batch not yet trained was drawn from
            prompt_state, draws, cursor_position = self.rollouts.resume_state()
            sample_state = torch.tensor([draws], dtype=torch.long)
        sample_rngs = gather_objects([sample_state])
        checkpoints.save(done, self.trained_modules(), self.optimizer, accelerator=self.accelerator, state={
            "trainer": state, "prompt_rng": prompt_state, "sample_rng_by_process": sample_rngs,
            "prompt_cursor": cursor_position, "progress": progress.saved()})

    def restore(self, checkpoints: Checkpoints, prompt_rng: torch.Generator) -> Progress:
        """This run where the checkpoint left it; returns the summary's progress."""
        saved = checkpoints.restore(self.trained_modules(), self.optimizer, self.accelerator)
        self.load_state_dict(saved["trainer"])  # the optimizer's state: restored above, with the weights
        # The learning rates are the ones asked now (a resume may change them), not the saved ones;
        # an adapted lr (--lr-target-kl) goes on from where the update left it.
        actor_group, critic_group = self.optimizer.param_groups
        actor_group["lr"] = self.config.lr if self.lr_control is None else self.lr_control.lr
        critic_group["lr"] = self.config.critic_lr or self.config.lr
        prompt_rng.set_state(saved["prompt_rng"])
        self.prompt_cursor.position = saved.get("prompt_cursor", 0)  # a checkpoint from before --prompt-order: 0
        sample_rng = saved["sample_rng_by_process"][rank()]  # the world size was checked at start
        if sample_rng is not None and getattr(self.generator, "rng", None) is not None:
            self.generator.rng.set_state(sample_rng)
        return Progress(**saved["progress"])

    # ------------------------------------------------------------ the end of the run
    def save_models(self) -> dict:
        """The final actor and critic, in the dtype each came in (bf16 in, bf16 out); trained in
        float32.  Sharded: whole weights in every process meanwhile, written once."""
        out = Path(self.config.out)

        def write() -> dict:
            actor_dir = save_actor(self.actor, self.tokenizer, out / "checkpoints" / "actor", dtype=self.stored_dtype)
            saved = {"actor": str(actor_dir)}
            if self.critic is not None:  # a critic-free estimator has none to save
                saved["critic"] = str(save_critic(self.critic, self.tokenizer, out / "checkpoints" / "critic"))
            return saved

        with gathered(self.actor), gathered(self.critic):
            self.require_trained_finite()
            return on_main_process(write)

    def require_trained_finite(self) -> None:
        """DivergenceError naming the tensor if what PPO trains holds a NaN or an infinity, in
        every process together.  Sharded models: call it with them gathered; the optimizer's
        moments are checked shard by shard where they are."""
        trained = {name: p for name, p in self.actor.named_parameters() if p.requires_grad}
        if self.critic is not None:
            trained.update({f"critic.{name}": p for name, p in self.critic.named_parameters()})
        require_finite(trained, "the PPO actor/critic")
        moments = local_optimizer_state(self.optimizer)["state"]
        require_finite_in_every_process({f"optimizer state {index}.{key}": value for index, state in moments.items()
                                         for key, value in state.items()}, "the PPO optimizer")

    def finish(self, run_log, progress: Progress, show_samples: int) -> dict:
        """Save the final models, draw the curves, write and return the summary."""
        checkpoints = self.save_models()
        final_metrics, samples_after = progress.final_eval or ({}, [])
        run_log.plot(CURVES + reward_curves(self.reward), title="PPO")
        summary = {
            "stage": "ppo",
            "iterations": self.config.iterations,
            "ppo_seconds": round(progress.train_seconds, 2),
            "training_score": progress.scores,
            "before": progress.before,
            "after": {k: v for k, v in final_metrics.items() if k.startswith("eval/")},
            "after_sampled": {k: v for k, v in final_metrics.items() if k.startswith("eval_sampled/")},
            "below_start": progress.below_start,
            "samples": [{"prompt": p, "before": b, "after": a} for (p, b), (_, a)
                        in zip(progress.samples_before[:show_samples], samples_after[:show_samples])],
            "checkpoints": checkpoints,
        }
        run_log.write_summary(summary)
        run_log.close()
        return summary
