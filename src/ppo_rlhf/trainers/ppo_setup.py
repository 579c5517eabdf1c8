"""What a PPO run needs before its first iteration, built from a PPOConfig: the checks of the run
folder and the process count, the prompts, the four roles and the rollout engine (docs/design.md,
"One PPO iteration").  ``PPOTrainer(config)`` builds here whatever it was not given.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import torch

from ppo_rlhf.config import ConfigError, field_value
from ppo_rlhf.data import (data_source, drop_empty_prompts, environment_prompt, hold_data_objects, load_rows,
                           prompt_check, with_environment_placeholders)
from ppo_rlhf.distributed import on_main_process, rank, world_size
from ppo_rlhf.envs import check_tool_list
from ppo_rlhf.envs.chat import episode_prompt_lengths, prepare_for_config
from ppo_rlhf.envs.options import prepare_template
from ppo_rlhf.formats import prompt_rows
from ppo_rlhf.hub import resolve_hub_models
from ppo_rlhf.models import ModelError, load_tokenizer
from ppo_rlhf.models.loading import check_tokenizer, check_vocabulary
from ppo_rlhf.rollout.engines import make_engine, refuse_weights_without_engine, require_engine
from ppo_rlhf.rollout.generation import Generator
from ppo_rlhf.rollout.reward import check_columns
from ppo_rlhf.rollout.sequences import stop_token_ids
from ppo_rlhf.run_folder import check_out_spares_inputs, check_run_folder
from ppo_rlhf.tasks import make_task
from ppo_rlhf.trainers.common import check_policy, seed_everything, set_threads
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.resume import RUN_CONFIG, TRAINED, check_resume_settings, last_checkpoint, resumable
from ppo_rlhf.trainers.roles import as_reward, load_roles, reward_functions
from ppo_rlhf.trainers.teacher import Teacher, check_teacher, check_teacher_fits, load_teacher
from ppo_rlhf.user_code import is_unnamed, recorded_name

PPO_FIELDS = {field.name: field for field in dataclasses.fields(PPOConfig)}


def prompt_sets(config: PPOConfig, task, environments=None) -> tuple[list[dict], list[dict]]:
    """The training prompts and the held-out ones (at most ``eval_size``).  Played with
    ``environments``, a row may hold no prompt, or an empty one: the environment's reset() says the
    task (data.py, ``with_environment_placeholders``)."""
    required, convert = prompt_reading(config.prompt_field, config.chat_template, environments is not None)
    keep = (lambda rows, source: rows) if environments is not None else (
        lambda rows, source: drop_empty_prompts(rows, config.prompt_field, source))
    drawn = config.iterations * config.batch_size // config.samples_per_prompt  # what a streamed data set gives
    train = (load_rows(data_source(config, "prompts"), required, convert, config.data_split, limit=drawn)
             if config.prompts else (task.prompt_rows() if task else None))
    if train is None:
        raise ConfigError("no prompts: give --prompts FILE or --task doubling")
    if config.prompts:
        train = keep(train, config.prompts)
    if config.eval_prompts:
        held_out = keep(load_rows(data_source(config, "eval_prompts"), required, convert, config.eval_split,
                                  limit=config.eval_size), config.eval_prompts)
    else:
        held_out = task.eval_rows() if task else []
    return train, held_out[: config.eval_size]


def prompt_reading(field: str, chat_template: bool, episodes: bool) -> tuple[dict, Callable]:
    """(the prompt field's check, the rows' converter) of ppo's and eval's prompt rows."""
    convert = prompt_rows(field, chat_template)
    if not episodes:
        return {field: prompt_check(chat_template)}, convert
    return {field: environment_prompt}, lambda rows: convert(with_environment_placeholders(rows, field))


@dataclass
class PromptCursor:
    """Where --prompt-order in-order takes the next prompt from (saved in a checkpoint)."""

    position: int = 0


def draw_batch(train_rows: list[dict], config: PPOConfig, rng: torch.Generator,
               cursor: PromptCursor | None = None) -> list[dict]:
    """batch_size rows: batch_size / samples_per_prompt prompts, each repeated samples_per_prompt
    times in adjacent rows (the group baselines read them so).  The prompts are drawn with
    replacement from ``rng``, or with --prompt-order in-order taken in turn from ``cursor``."""
    k, count = config.samples_per_prompt, config.batch_size // config.samples_per_prompt
    if getattr(config, "prompt_order", "random") == "in-order":
        cursor = cursor if cursor is not None else PromptCursor()
        index = [(cursor.position + i) % len(train_rows) for i in range(count)]
        cursor.position += count
    else:
        index = torch.randint(len(train_rows), (count,), generator=rng).tolist()
    return [train_rows[i] for i in index for _ in range(k)]


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


def record_given_episodes(config: PPOConfig, environment=None, tools: list | None = None) -> None:
    """PPOTrainer(config, environment=..., tools=...): what was given, recorded in ``config`` as the
    flags would name it (``module:Class``; user_code.py, ``recorded_name``), so that config.yaml and
    the checkpoint say what the run played and a resume can check it; the config is then checked
    with its episodes on.  An environment given both here and in the config is refused unless both
    name the same one: the run would play one and record the other."""
    if not isinstance(config, PPOConfig):
        return  # checked_config names the wrong class
    check_tool_list(tools)  # before they are named: a single function is no list of them
    hold_data_objects(config, ("prompts", "eval_prompts"))  # a data set set on the config after it was built
    if environment is not None:
        given = environment if isinstance(environment, str) else recorded_name(environment)
        if config.environment is not None and config.environment != given:
            raise ConfigError(f"two environments: config.environment is {config.environment!r} and "
                              f"PPOTrainer(environment=...) is {given!r}; give one of them (the run plays one "
                              f"environment, and its config records it)")
        config.environment = given
    if tools:
        recorded = field_value(PPOConfig, PPO_FIELDS["tool"], config.tool)
        config.tool = recorded + [name for name in given_tool_names(tools) if name not in recorded]


def given_tool_names(tools: list) -> list[str]:
    return [tool if isinstance(tool, str) else recorded_name(tool) for tool in tools]


def episode_objects(config: PPOConfig, environment=None, tools: list | None = None) -> tuple[object, list]:
    """The environment and tools a run plays with: those given in Python, and the config's others,
    loaded by name; an object recorded without an import path (a run's config.yaml given again)
    cannot be loaded, and is refused with the reason."""
    given = set(given_tool_names(tools or []))
    named = [name for name in config.tool if name not in given]
    if environment is None:
        environment = config.environment
    for name, value in [("environment", environment)] + [("tool", name) for name in named]:
        if is_unnamed(value):
            raise ConfigError(f"{name} {value} was given in Python to the run this config records, and nothing "
                              f"names it for this one: give it again (PPOTrainer(config, {name}=...)), or define it "
                              f"at the top level of a module and name it module:Name")
    return environment, list(tools or []) + named


def refuse_unnamed_resume(config: PPOConfig, out: Path) -> None:
    """--resume of a run that played an environment or tools given in Python without an import path:
    its record cannot name them, so nothing can check that this run plays the same ones."""
    saved_path = last_checkpoint(out) / RUN_CONFIG
    if not saved_path.is_file():
        return
    saved = json.loads(saved_path.read_text())
    unnamed = [value for value in [saved.get("environment"), *(saved.get("tool") or [])] if is_unnamed(value)]
    if unnamed:
        raise ConfigError(f"--resume: the run in {out} played {', '.join(unnamed)}, given in Python without an import "
                          f"path, so its record cannot say which; a resume cannot check that it plays the same one. "
                          f"Define it at the top level of a module (named module:Name), and start a new run")


def check_run_start(config: PPOConfig) -> None:
    """Before anything loads: the processes split the batch, ``--out`` may be written (or resumed,
    with the same settings, from a checkpoint of the one format; docs/design.md, "Resume and
    divergence").  Only reads: a second call changes nothing."""
    check_out_spares_inputs(config)  # the command line checks it too, with its --config file
    check_processes(config)
    out = Path(config.out)
    on_main_process(check_run_folder, out, config.overwrite, config.resume, resumable=resumable(out))
    if config.resume:
        refuse_old_checkpoint(out)
        refuse_unnamed_resume(config, out)
        check_resume_settings(config, out)


def refuse_old_checkpoint(out: Path) -> None:
    """PPO checkpoints used to hold an ``actor/`` model folder; they are now the format of every
    stage (trainers/resume.py), and an old one is refused by name rather than misread."""
    last = last_checkpoint(out)
    if (last / "actor").is_dir() and not (last / TRAINED).is_file():
        raise ConfigError(f"--resume: {last} is a checkpoint of the old PPO format ({last / 'actor'}/, no {TRAINED}), "
                          f"which this version cannot resume; start a new run (another --out, or --overwrite), or "
                          f"resume it with the ppo-rlhf version that wrote it")


@dataclass
class RunParts:
    """What ``PPOTrainer(config)`` builds from the config."""

    model: object
    ref: object | None
    reward: object
    tokenizer: object
    critic: object | None
    generator: Generator
    accelerator: object
    task: object | None
    train_rows: list[dict]
    eval_rows: list[dict]
    teacher: Teacher | None = None


def build_run(config: PPOConfig, reward=None, environments=None) -> RunParts:
    """Every role from the config, in the order the command line always used: seeded first (a
    fresh value head draws its weights), the data and the rewards that need no model checked
    before any model loads.  ``environments``: the episodes' (envs.EnvironmentSource), whose
    rewards may be the run's only ones."""
    if reward is None:
        config.require_a_reward(environments is not None and environments.pays)
    set_threads(config.num_threads)
    seed_everything(config.seed)
    require_engine(config)  # vLLM asked for and absent: said before anything loads
    refuse_weights_without_engine(config)
    resolve_hub_models(config)  # a model named as on the Hub: its cached snapshot
    accelerator = config.accelerator(shards=True)  # under accelerate launch / torchrun: joins the process group
    check_run_start(config)
    task = make_task(config, config.seed)
    train_rows, eval_rows = prompt_sets(config, task, environments)
    if config.teacher:  # a causal LM other than the student, reading its token ids: checked before any model loads
        check_teacher(config.teacher, config.model, load_tokenizer(config.model, "--model"), config.model)
    lengths = None  # an episode's prompts as the model reads them: measured (and checked) before any model loads
    if environments is not None:  # the chat template checked for episodes before any model loads (envs/chat.py)
        environments.check_rows(train_rows + eval_rows)
        if config.model is not None and not hasattr(environments, "play"):  # (an agent renders its own prompts)
            early = load_tokenizer(config.model, "--model")
            prepare_for_config(early, environments, config)
            lengths = episode_prompt_lengths(early, environments, train_rows + eval_rows, config.prompt_field,
                                             config.max_prompt_length)
    if reward is None:
        functions = reward_functions(config, task)
        check_columns(functions, train_rows, config.prompts or f"the {config.task} task's prompts")
        if task is None:  # held-out rows are scored by the reward only without a task (a task has its metric)
            check_columns(functions, eval_rows, config.eval_prompts)
        roles = load_roles(config, task, functions)
    else:
        roles = load_roles(config, task, reward=reward)  # the given reward instead of the config's
        check_columns([roles.reward], train_rows, config.prompts or f"the {config.task} task's prompts")
    prepare_template(roles.tokenizer, config)
    # An episode may fill what --max-length leaves after its prompt (or --max-episode-tokens).
    episode_tokens = None if environments is None else (config.max_episode_tokens or config.max_length)
    check_policy(roles.actor, roles.tokenizer, config.model, [r[config.prompt_field] for r in train_rows + eval_rows],
                 config.chat_template, config.max_prompt_length, config.max_new_tokens, config.chat_template_flag(),
                 lengths, episode_tokens)
    check_teacher_fits(roles.teacher, config.max_length)
    generator = make_generator(config, roles.tokenizer, roles.actor, accelerator)
    return RunParts(roles.actor, roles.ref, roles.reward, roles.tokenizer, roles.critic, generator, accelerator,
                    task, train_rows, eval_rows, roles.teacher)


def make_generator(config: PPOConfig, tokenizer, actor, accelerator) -> Generator:
    """The rollout engine --rollout-engine asks for; each process samples its own rollouts.  A
    distilling run's built-in loop keeps the log-probs it samples with (the teacher's reward reads them)."""
    return make_engine(config, actor, stop_token_ids(tokenizer, actor), tokenizer.pad_token_id, config.max_new_tokens,
                       config.do_sample, config.temperature, config.seed, rank(), accelerator.device,
                       config.max_length, max_rows=config.batch_size, tokenizer=tokenizer,
                       agent=config.agent is not None, keep_logprobs=config.teacher is not None)


def complete_parts(config: PPOConfig, model, ref, reward, tokenizer, generator, accelerator,
                   environment_pays: bool = False) -> tuple:
    """An in-memory model given: the missing pieces around it.  The reference is a frozen copy of
    the model (None for a peft model: its base with adapters disabled), the tokenizer is
    ``config.model``'s, the reward the config's unless given, and the teacher (``config.teacher``)
    a model of its own."""
    if not isinstance(model, torch.nn.Module) or getattr(model, "get_output_embeddings", lambda: None)() is None:
        raise ModelError(f"model= must be a causal language model (an AutoModelForCausalLM, or a peft model around "
                         f"one) or its folder; got a {type(model).__name__}, which has no output layer to sample "
                         f"tokens from")
    if generator is None:  # the config's engine, made below
        refuse_weights_without_engine(config)
    if tokenizer is None:
        if config.model is None:
            raise ConfigError("no tokenizer: give tokenizer= with an in-memory model, or config.model")
        tokenizer = load_tokenizer(config.model)
    prepare_template(tokenizer, config)
    # What check_policy asks of a model loaded from its folder (the prompts are read at train()).
    check_tokenizer(tokenizer, "tokenizer=", config.chat_template, template_flag=config.chat_template_flag())
    check_vocabulary(model, tokenizer, "model=")
    if ref is None and not hasattr(model, "peft_config"):
        ref = copy.deepcopy(model)
    accelerator = accelerator or config.accelerator(shards=True)
    reward = as_reward(reward, config, tokenizer, make_task(config, config.seed) if reward is None else None,
                       environment_pays)
    generator = generator or make_generator(config, tokenizer, model, accelerator)
    teacher = None
    if config.teacher:
        check_teacher(config.teacher, None, tokenizer, "the tokenizer given")  # the student is in memory
        teacher = load_teacher(config.teacher, tokenizer, config.load_dtype)
        check_teacher_fits(teacher, config.max_length)
    return ref, reward, tokenizer, generator, accelerator, teacher
