"""Built-in tasks.  A task supplies data, a reward and a metric; the trainers never special-case it."""

from __future__ import annotations

from ppo_rlhf.config import ConfigError

TASKS = ("doubling",)


def get_task(name: str):
    if name == "doubling":
        from ppo_rlhf.tasks import doubling

        return doubling
    raise ConfigError(f"unknown task {name!r}; allowed: {', '.join(TASKS)}")
