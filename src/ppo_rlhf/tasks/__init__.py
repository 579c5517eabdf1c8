"""Tasks.  A task supplies data, a reward and a metric; the trainers never special-case it.

    doubling            the built-in "double it, in the style asked" (tasks/doubling.py)
    reasoning-gym:NAME  a reasoning-gym dataset, scored by its own checker (tasks/reasoning_gym.py)
"""

from __future__ import annotations

from dataclasses import dataclass

from ppo_rlhf.config import MODEL_DATA, SEEDS, ConfigError, above, at_least, check, option
from ppo_rlhf.distributed import rank

TASKS = ("doubling", "reasoning-gym:NAME")
REASONING_GYM = "reasoning-gym:"
TASK_REWARDS = ("score", "exact")


def check_task_name(name: str | None) -> None:
    """ConfigError unless ``name`` is empty, doubling, or reasoning-gym:NAME (NAME is checked
    against the package when the task is made)."""
    valid = name is None or name == "doubling" or (name.startswith(REASONING_GYM) and name != REASONING_GYM)
    check(valid, "task", "doubling or reasoning-gym:NAME (e.g. reasoning-gym:chain_sum)", name)


@dataclass
class TaskOptions:
    """The task fields of the stages that take prompts from a task (ppo, eval)."""

    option_group = MODEL_DATA  # --help's group of all these options (config.py, GROUPS)

    task: str | None = option(None, "task supplying prompts, reward and metric when --prompts is empty: doubling "
                                    "(built in), or reasoning-gym:NAME (pip install -e '.[tasks]'), whose prompts go "
                                    "through the model's chat template and whose answers its own checker scores",
                              first=True)
    task_size: int = option(10000, "reasoning-gym: training problems generated", range=above(0))
    task_eval_size: int = option(200, "reasoning-gym: held-out problems, none of them a training one", range=above(0))
    task_seed: int | None = option(None, "reasoning-gym: seed of the problem generator (empty: --seed)", range=SEEDS)
    task_config: str = option("", "reasoning-gym: the generator's settings, 'key=value,...' (values read as YAML)")
    format_reward: float = option(0.0, "reasoning-gym: added to the score of a response that puts its answer in "
                                       "<answer>...</answer>", range=at_least(0))
    task_reward: str = option("score", "reasoning-gym: the reward of an answer: score (the task's own checker, with "
                                       "its partial credit) or exact (1 for a right answer, else 0; a checker that "
                                       "credits an answer containing the right one, as reasoning-gym's default does, "
                                       "can pay a policy for writing longer numbers)", choices=TASK_REWARDS)

    def validate_task(self) -> None:
        check_task_name(self.task)
        # A task supplies its prompts, and its reward and metric read its own rows (a reasoning-gym
        # problem's index): prompts of one's own beside it would be scored by a rule not theirs.
        check(self.task is None or not getattr(self, "prompts", None), "prompts",
              f"left out with --task {self.task}, which supplies the prompts (its reward and metric read its own "
              f"rows); give --prompts with a reward of your own (--reward-fn, --reward-model), or --task alone",
              getattr(self, "prompts", None))
        if self.task is not None and self.task.startswith(REASONING_GYM):
            from ppo_rlhf.tasks.reasoning_gym import parse_task_config

            parse_task_config(self.task_config)  # a malformed one fails here, at start
            from ppo_rlhf.envs.options import require_chat_template

            require_chat_template(self, f"--task {self.task} (its prompts are chat messages)")
        else:
            # the reasoning-gym fields mean nothing here
            for key, default in (("task_seed", None), ("format_reward", 0.0), ("task_reward", "score")):
                check(getattr(self, key) == default, key, "left out without --task reasoning-gym:NAME",
                      getattr(self, key))
            check(not self.task_config, "task_config", "left out without --task reasoning-gym:NAME", self.task_config)

    def chat_template_flag(self) -> str:
        """What asks for the chat template, as a refusal names it: the task that formats its
        prompts with it (reasoning-gym's are chat messages), else --chat-template."""
        if self.task is not None and self.task.startswith(REASONING_GYM):
            return f"--task {self.task} (its prompts are chat messages)"
        if getattr(self, "environment", None) or getattr(self, "tool", None):
            return "--environment / --tool (an episode's turns are chat messages)"
        return "--chat-template"


def problem_draw(values: dict) -> dict:
    """What picks a reasoning-gym task's problems, from a stage's settings (a config or a run's
    config.yaml): the generator's seed (--task-seed, else --seed) and settings, and --task-size,
    the training problems, after which the held-out ones are drawn."""
    from ppo_rlhf.tasks.reasoning_gym import parse_task_config

    seed = values.get("task_seed")
    return {"task_size": values.get("task_size"), "task_seed": values.get("seed", 0) if seed is None else seed,
            "task_config": parse_task_config(values.get("task_config") or "")}


def held_out_mismatch(run_values: dict, values: dict) -> str | None:
    """Why ``values`` (an evaluation) does not score the problems a run with ``run_values`` held
    out on the same reasoning-gym task, or None when it does.  A different --task-size or seed
    moves the held-out draw; a smaller --task-size under the same generator holds out problems the
    run trained on."""
    if values.get("task") != run_values.get("task") or not str(values.get("task")).startswith(REASONING_GYM):
        return None
    theirs, ours = problem_draw(run_values), problem_draw(values)
    differ = [key for key in theirs if theirs[key] != ours[key]]
    if not differ:
        return None

    def as_flags(draw: dict) -> str:
        shown = {**draw, "task_config": repr(",".join(f"{k}={v}" for k, v in draw["task_config"].items()))}
        return " ".join(f"--{key.replace('_', '-')} {shown[key]}" for key in differ)

    why = "its held-out problems are not the ones that run held out"
    if differ == ["task_size"] and ours["task_size"] < theirs["task_size"]:
        why += f", and some are problems it trained on (the generator's first {theirs['task_size']})"
    return f"the run trained with {as_flags(theirs)}, this evaluation uses {as_flags(ours)}: {why}"


def get_task(name: str):
    if name == "doubling":
        from ppo_rlhf.tasks import doubling

        return doubling
    raise ConfigError(f"unknown task {name!r}; allowed: {', '.join(TASKS)}")


def make_task(options: TaskOptions, seed: int):
    """The task ``options.task`` names, or None."""
    name = options.task
    if name is None:
        return None
    if name.startswith(REASONING_GYM):
        from ppo_rlhf.tasks.reasoning_gym import make_task as make_reasoning_gym, parse_task_config

        task = make_reasoning_gym(name[len(REASONING_GYM):], options.task_size, options.task_eval_size,
                                  seed if options.task_seed is None else options.task_seed,
                                  parse_task_config(options.task_config), options.format_reward,
                                  exact=options.task_reward == "exact")
        if task.held_out_short and rank() == 0:
            print(f"note: {name} gave {len(task.eval_indices)} held-out problems, not {options.task_eval_size}: its "
                  f"generator has no more that differ from the training ones (a smaller --task-size leaves more)",
                  flush=True)
        return task
    return get_task(name).make_task(seed=seed)
