"""TRL's ``environment_factory`` classes, played through the gymnasium protocol (docs/agents.md).

TRL's GRPOTrainer takes ``environment_factory=Cls``: an object per episode with

- ``reset(**columns)``: called before the episode with the row's columns (those it names, or all
  of them through ``**kwargs``); returns None, or a string appended to the prompt's last user
  message;
- public methods (not starting with ``_``), each a tool the model may call (type hints and a
  docstring give its schema);
- optionally ``get_reward()``: one number for the finished episode (TRL adds it as a reward of
  weight 1 named after the class; here it is the episode's environment reward).

The same class runs here unchanged: :class:`FactoryEnvironment` is that object behind
``reset(seed=, options=row)`` / ``step(text)``, its tool calls read and answered as for plain
tools (envs/tools.py).  The episode ends when a turn calls no tool.
"""

from __future__ import annotations

import inspect
from typing import Callable

from ppo_rlhf.envs.parsers import ToolCallParser
from ppo_rlhf.envs.protocol import EnvironmentFailed, describe
from ppo_rlhf.envs.tools import ToolBox, ToolUse

NOT_TOOLS = ("reset", "get_reward", "step", "close", "render")


def tool_methods(instance) -> list[Callable]:
    """The public methods of ``instance``'s class, bound: its tools (TRL's rule)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if not name.startswith("_") and name not in NOT_TOOLS]


def reset_arguments(reset: Callable, row: dict) -> dict:
    """The row's columns that ``reset`` takes: those it names, or all with ``**kwargs``."""
    parameters = inspect.signature(reset).parameters
    columns = {key: value for key, value in row.items() if key != "_source"}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return columns
    return {key: value for key, value in columns.items() if key in parameters}


class FactoryEnvironment(ToolUse):
    """One instance of a TRL environment class (made by ``factory``), reset for each episode."""

    def __init__(self, factory: Callable, tools: list[Callable], parser: ToolCallParser, timeout: float):
        self.instance = factory()
        self.name = describe(self.instance)
        super().__init__(ToolBox(tools + tool_methods(self.instance), timeout), parser)
        self.row: dict = {}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str | None, dict]:
        self.start_episode()
        self.row = options or {}
        try:
            observation = self.instance.reset(**reset_arguments(self.instance.reset, self.row))
        except Exception as error:  # noqa: BLE001 -- the environment's bug, named
            raise EnvironmentFailed(self.instance, "reset", self.row, error) from error
        return observation, {}

    def step(self, action: str) -> tuple[list[dict] | None, float, bool, bool, dict]:
        answers = self.answer_calls(action)
        return answers, 0.0, answers is None, False, {}

    def reward(self) -> float | None:
        """``get_reward()`` of the finished episode (None for a class without one)."""
        get_reward = getattr(self.instance, "get_reward", None)
        if get_reward is None:
            return None
        try:
            value = get_reward()
            if inspect.isawaitable(value):
                import asyncio

                value = asyncio.run(value)
        except Exception as error:  # noqa: BLE001
            raise EnvironmentFailed(self.instance, "get_reward", self.row, error) from error
        return float(value)
