"""``ppo-rlhf eval``: greedy (and optionally sampled) evaluation of a causal LM on held-out prompts."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import torch

from ppo_rlhf.config import (HARDWARE, MODEL_DATA, REWARD, ROLLOUT, RUN, SEEDS, TEMPERATURES, THREADS,
                             ConfigError, above, at_least, check, option, to_dict)
from ppo_rlhf.config_yaml import load_yaml
from ppo_rlhf.data import drop_empty_prompts, load_rows
from ppo_rlhf.evaluation import Evaluator
from ppo_rlhf.hub import resolve_hub_models
from ppo_rlhf.hardware import HardwareOptions
from ppo_rlhf.models import adapter_merge_dtype, load_causal_lm, load_tokenizer
from ppo_rlhf.rollout.engines import RolloutEngineOptions, make_engine, require_engine
from ppo_rlhf.rollout.reward import RewardOptions, check_columns
from ppo_rlhf.rollout.sequences import stop_token_ids
from ppo_rlhf.distributed import rank
from ppo_rlhf.envs import environment_source
from ppo_rlhf.envs.chat import episode_prompt_lengths, prepare_for_config
from ppo_rlhf.envs.options import EnvironmentOptions, check_template_file_used, prepare_template
from ppo_rlhf.rollout.episodes import EpisodeLimits
from ppo_rlhf.run_folder import RunFolderOptions, check_run_folder, start_run_folder
from ppo_rlhf.runlog import RunLog
from ppo_rlhf.stages.common import check_policy, seed_everything, set_threads
from ppo_rlhf.trainers.ppo_setup import prompt_reading
from ppo_rlhf.tasks import TaskOptions, held_out_mismatch, make_task


@dataclass
class EvalConfig(RewardOptions, RunFolderOptions, HardwareOptions, TaskOptions, RolloutEngineOptions,
                 EnvironmentOptions):
    # The fields naming a file or folder the run reads: --out may not be, hold or lie in one (run_folder.py).
    input_paths: ClassVar[tuple] = ("model", "prompts", "reward_model", "chat_template_file", "reward_judge",
                                    "judge_template")

    # --- model and data
    model: str | None = option(None, "causal LM folder to evaluate", group=MODEL_DATA, first=True)
    prompts: str | None = option(None, "prompt rows to evaluate on (default: the task's held-out prompts)",
                                 group=MODEL_DATA, first=True)
    size: int = option(2000, "prompts to evaluate", range=above(0), group=MODEL_DATA, first=True)
    chat_template: bool | None = option(None, "format prompts with the tokenizer's chat template; empty: on where "
                                              "the prompts are chat messages (--environment or --tool episodes, a "
                                              "reasoning-gym --task), else off", group=MODEL_DATA)
    prompt_field: str = option("prompt", "field of the prompt rows holding the prompt", group=MODEL_DATA)
    label_field: str = option("label", "field naming the class to reward, for a multi-class reward model",
                              group=MODEL_DATA)
    data_split: str = option("train", "the split of --prompts when it names a data set in the local Hugging Face cache",
                             group=MODEL_DATA)

    # --- reward
    reward_model: str | None = option(None, "score responses with this reward model (mean reported as 'score')",
                                      group=REWARD, first=True)

    # --- rollout
    max_new_tokens: int = option(128, "longest response in tokens", range=above(0), group=ROLLOUT, first=True)
    max_length: int | None = option(None, "longest prompt + response in tokens (empty: 256, or 1024 with "
                                          "--environment or --tool)", range=above(1), group=ROLLOUT, first=True)
    do_sample: bool = option(False, "sample (temperature) instead of greedy decoding", group=ROLLOUT)
    temperature: float = option(1.0, "sampling temperature (below 0.01 sampling is greedy decoding: leave out "
                                      "--do-sample)", range=TEMPERATURES, group=ROLLOUT)
    samples: int = option(1, "responses sampled for each prompt (needs --do-sample above 1): pass@k for k = 1..K "
                             "(Chen et al.'s unbiased estimator), mean@K and maj@K (majority vote on the parsed "
                             "answer), from the task's checker or a reward that gives 1 for right and 0 for wrong",
                          range=above(0), group=ROLLOUT)

    # --- hardware
    num_threads: int = option(0, "torch CPU threads (0: leave torch's default)", range=THREADS, group=HARDWARE)

    # --- run folder, evaluation, logging, checkpoints
    out: str | None = option(None, "write summary.json here (default: print only)", group=RUN, first=True)
    seed: int = option(0, "random seed (sampling)", range=SEEDS, group=RUN)
    show: int = option(5, "print this many prompts with their responses", range=at_least(0), group=RUN)

    def validate(self) -> None:
        self.resolve_max_length()
        self.validate_hardware()
        self.validate_task()
        self.validate_engine()
        self.validate_rewards()
        check(not self.reward_weights or self.reward_count(), "reward_weights",
              "left out without a reward to weigh (--reward-model, --reward-fn, --reward-url, --reward-judge)", self.reward_weights)
        check(self.do_sample or self.temperature == 1.0, "temperature",
              "left out without --do-sample (greedy decoding has no temperature)", self.temperature)
        check(self.do_sample or self.samples == 1, "samples",
              "1 without --do-sample (greedy decoding gives every sample of a prompt the same response); add "
              "--do-sample for pass@k", self.samples)
        self.validate_pass_at_k()
        check(self.max_length > self.max_new_tokens, "max_length", f"> max_new_tokens ({self.max_new_tokens})", self.max_length)
        self.validate_environment()
        self.chat_template = bool(self.chat_template)  # empty and nothing asked for it: off
        check_template_file_used(self)

    def validate_pass_at_k(self) -> None:
        """--samples K's pass@k needs a right-or-wrong outcome per response: refused here where the
        settings say there is none, not after every sample has been drawn (the scores themselves
        are checked as they come: evaluation.py, ``reward_outcomes``)."""
        from ppo_rlhf.evaluation import pass_at_k_refusal

        if self.samples == 1:
            return
        refusal = ("there is nothing to read one from: no --task with a checker and no reward"
                   if self.task is None and not self.reward_count() and self.environment is None
                   else pass_at_k_refusal(self))
        if refusal is not None:
            raise ConfigError(f"invalid value for 'samples': {self.samples}; pass@k needs a right-or-wrong outcome "
                              f"per response, and {refusal}: give a reward that scores 1 for right and 0 for wrong "
                              f"(e.g. --reward-fn ppo_rlhf.rewards:answer_match), a --task, or --samples 1")


def eval_warnings(config: EvalConfig) -> list[str]:
    """What an evaluation's settings make meaningless, said before it runs."""
    from ppo_rlhf.trainers.ppo_plan import GREEDY_TEMPERATURE

    warnings = []
    if config.samples > 1 and config.temperature < GREEDY_TEMPERATURE:
        warnings.append(f"--temperature {config.temperature:g} samples as greedy decoding does (two tokens one logit "
                        f"apart are drawn {math.exp(1 / config.temperature):.3g} : 1), so the {config.samples} samples "
                        f"of a prompt are nearly all the same response and pass@k says little more than pass@1; "
                        f"sample at 0.6 to 1 for pass@k")
    return warnings


def training_run_warning(config: EvalConfig) -> str | None:
    """Where --model is a checkpoint a run saved (RUN/checkpoints/NAME) on the reasoning-gym task
    evaluated here, and this evaluation would draw other held-out problems than that run's (its
    RUN/config.yaml): what differs and the flags that score the run's own."""
    folder = Path(config.model)
    saved = folder.parent.parent / "config.yaml"
    if config.prompts or folder.parent.name != "checkpoints" or not saved.is_file():
        return None
    try:
        mismatch = held_out_mismatch(load_yaml(saved), to_dict(config))
    except ConfigError:
        return None  # not a run's config: not a mapping, or task settings no run could have started with
    if mismatch is None:
        return None
    return (f"{config.model} was trained on {config.task} by {folder.parent.parent}; {mismatch}. Give the run's "
            f"flags to score its held-out problems")


def run_eval(config: EvalConfig) -> dict:
    from ppo_rlhf.trainers.roles import build_reward, reward_functions  # the same reward loading as PPO

    set_threads(config.num_threads)
    seed_everything(config.seed)
    if config.model is None:
        raise ConfigError("give --model DIR, the model to evaluate")
    require_engine(config)
    resolve_hub_models(config)  # a model named as on the Hub: its cached snapshot
    if config.out:
        check_run_folder(config.out, config.overwrite)
    if rank() == 0:
        for warning in [training_run_warning(config), *eval_warnings(config)]:
            if warning:
                print(f"warning: {warning}", flush=True)
    task = make_task(config, config.seed)
    config.check_episode_options_used()
    if config.agent is not None:  # an agent plays the episodes itself, on the server's OpenAI endpoint
        from ppo_rlhf.rollout.agents import AgentSource

        environments = AgentSource(config.agent, config.env_workers)
    else:
        environments = environment_source(config.environment, config.tool, tool_parser=config.tool_parser,
                                          tool_timeout=config.tool_timeout, env_workers=config.env_workers,
                                          environment_config=config.environment_config,
                                          action_names=config.action_names or None,
                                          observation_text=config.observation_text)
    if config.prompts:
        required, convert = prompt_reading(config.prompt_field, config.chat_template, environments is not None)
        rows = load_rows(config.prompts, required, convert, config.data_split)
        if environments is None:  # an episode's empty prompt is its environment's to fill
            rows = drop_empty_prompts(rows, config.prompt_field, config.prompts)
    elif task is not None:
        rows = task.eval_rows()
    else:
        raise ConfigError("give --prompts FILE or --task doubling")
    # The rewards that need no model, checked against the rows' columns before any model loads.
    scored = config.reward_count() > 0
    functions = reward_functions(config, None) if scored else []
    check_columns(functions, rows[: config.size], config.prompts or f"the {config.task} task's prompts")
    lengths = None  # an episode's prompts as the model reads them: measured (and checked) before the model loads
    if environments is not None and config.agent is None:  # the chat template checked for episodes before the
        environments.check_rows(rows[: config.size])          # model loads (envs/chat.py)
        early = load_tokenizer(config.model, "--model")
        prepare_for_config(early, environments, config)
        lengths = episode_prompt_lengths(early, environments, rows[: config.size], config.prompt_field,
                                         config.max_length - config.max_new_tokens)
    # The model before its tokenizer: a folder of the wrong kind is then named as such.
    dtype = adapter_merge_dtype(config.model, config.load_dtype)
    if dtype != config.load_dtype and rank() == 0:
        print(f"note: {config.model} is a LoRA adapter on a base stored in 16 bits; it is merged and held in float32, "
              f"where its update is not rounded away (--dtype bfloat16 holds it in bf16, in half the memory, the "
              f"update rounded once)", flush=True)
    model, tokenizer = load_causal_lm(config.model, dtype), load_tokenizer(config.model)
    prepare_template(tokenizer, config)
    accelerator = config.accelerator()
    model.to(accelerator.device)
    reward = build_reward(config, tokenizer, None, functions) if scored else None
    if isinstance(getattr(reward, "model", None), torch.nn.Module):
        reward.model.to(accelerator.device)
    task_limit = getattr(task, "max_new_tokens", None) if not config.prompts else None  # the built-in task's answers are short
    max_new_tokens = min(config.max_new_tokens, task_limit) if task_limit else config.max_new_tokens
    rows = rows[: config.size]
    max_prompt_length = config.max_length - config.max_new_tokens
    check_policy(model, tokenizer, config.model, [row[config.prompt_field] for row in rows], config.chat_template,
                 max_prompt_length, max_new_tokens, config.chat_template_flag(), lengths,
                 None if environments is None else (config.max_episode_tokens or config.max_length))
    evaluator = Evaluator(tokenizer, rows, task.metric if task else None, reward=reward,
                          outcomes=getattr(task, "outcomes", None),
                          prompt_field=config.prompt_field, max_prompt_length=max_prompt_length,
                          max_new_tokens=max_new_tokens, chat_template=config.chat_template,
                          environments=environments, environment_weight=config.environment_reward_weight,
                          limits=EpisodeLimits(max_prompt_length, config.max_length, config.max_turns,
                                               config.max_episode_tokens, config.chat_template), seed=config.seed,
                          show_progress=True)
    generator = None
    if config.rollout_engine != "torch":  # built once, after every check that needs no engine
        generator = make_engine(config, model, stop_token_ids(tokenizer, model), tokenizer.pad_token_id, max_new_tokens,
                                config.do_sample, config.temperature, config.seed, rank(), accelerator.device,
                                config.max_length, max_rows=min(evaluator.batch_size, len(rows) * config.samples),
                                tokenizer=tokenizer, agent=config.agent is not None)
        generator.fixed_weights = True  # the evaluated model never changes: sent once, not per batch
    with accelerator.autocast():
        metrics, samples = evaluator(model.eval(), do_sample=config.do_sample, temperature=config.temperature,
                                     seed=config.seed, prefix="", generator=generator, samples=config.samples)
    # An episode's sample is the whole of it: its messages, the tool calls and their results, turns and score.
    shown = [{"prompt": p, "response": r, **{k: v for k, v in episode.items() if k != "prompt"}}
             for (p, r), episode in zip(samples, evaluator.last_episodes[::config.samples])] \
        if evaluator.last_episodes else [{"prompt": p, "response": r} for p, r in samples]
    summary = {"model": config.model, "decoding": "sampled" if config.do_sample else "greedy", "prompts": len(evaluator.prompts),
               **({"samples_per_prompt": config.samples} if config.samples > 1 else {}), **metrics,
               "samples": shown[: config.show]}
    if config.out:
        start_run_folder(config.out, config.overwrite)
        run_log = RunLog(Path(config.out), to_dict(config), report_to="none")
        run_log.write_summary(summary)
        run_log.close()
    return summary
