"""TRL's ``environment_factory`` classes, played through the gymnasium protocol (docs/agents.md).

TRL's GRPOTrainer takes ``environment_factory=``: a callable (a class, a function, a lambda, a
``functools.partial``) making an object per concurrent episode, with

- ``reset(**columns)``: called before each episode with the row's columns (those it names, or all
  of them through ``**kwargs``); returns None, or a string appended to the prompt's last user
  message;
- every other public method (a name not starting with ``_``; ``get_reward`` aside), each a tool the
  model may call (type hints and a docstring give its schema) -- whatever its name, ``step``,
  ``render`` or ``close`` included (TRL's rule);
- optionally ``get_reward()``: one number for the finished episode (TRL adds it as a reward of
  weight 1 named after the class; here it is the episode's environment reward).

The same class runs here unchanged: :class:`FactoryEnvironment` is that object behind
``reset(seed=, options=row)`` / ``step(text)``, its tool calls read and answered as for plain
tools (envs/tools.py).  The episode ends when a turn calls no tool.

TRL calls ``reset`` without a seed, so a class drawing its task at random (a Wordle drawing its
word) would start the K episodes of a row differently.  Here ``reset`` gets the episode's seed as
``seed=`` where it names that parameter; otherwise Python's ``random`` and numpy's global generator
are seeded around the call and put back after it, so the K episodes of a row start alike and a
resumed run replays them (a generator of the class's own, made without a seed, is beyond reach).
"""

from __future__ import annotations

import contextlib
import inspect
import random
from typing import Callable

from ppo_rlhf.envs.parsers import ToolCallParser, parse_hermes
from ppo_rlhf.envs.protocol import Adapter, EnvironmentFailed, describe
from ppo_rlhf.envs.tools import ToolBox, ToolUse

RESERVED = ("reset", "get_reward")  # TRL's two methods that are not tools


def tool_methods(instance) -> list[Callable]:
    """The public methods of ``instance``'s class but reset and get_reward, bound: its tools (TRL's
    rule, read on the class so that a property is not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if not name.startswith("_") and name not in RESERVED]


def named_parameters(function: Callable) -> tuple[set[str], bool]:
    """(the parameters ``function`` takes by name, whether it takes ``**kwargs``)."""
    parameters = inspect.signature(function).parameters
    named = {name for name, p in parameters.items()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def reset_arguments(reset: Callable, row: dict) -> dict:
    """The row's columns that ``reset`` takes: those it names, or all with ``**kwargs`` (TRL passes
    every column; the ``environment`` column that routes a row among several environments is not
    one, as in TRL)."""
    named, takes_all = named_parameters(reset)
    columns = {key: value for key, value in row.items() if key not in ("_source", "environment")}
    return columns if takes_all else {key: value for key, value in columns.items() if key in named}


@contextlib.contextmanager
def seeded_generators(seed: int):
    """Python's ``random`` and numpy's global generator seeded with ``seed`` inside, as they were after."""
    state = random.getstate()
    try:
        import numpy
    except ImportError:  # numpy is a dependency of torch's wheels, but a user's class need not use it
        numpy = None
    numpy_state = numpy.random.get_state() if numpy is not None else None
    random.seed(seed)
    if numpy is not None:
        numpy.random.seed(seed % 2**32)
    try:
        yield
    finally:
        random.setstate(state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def seeded_reset(reset: Callable, arguments: dict, seed: int | None):
    """``reset(**arguments)``, seeded (module docstring): ``seed=`` where reset names it and the row
    gives none of its own, else the global generators seeded around the call."""
    if seed is None:
        return reset(**arguments)
    if "seed" in named_parameters(reset)[0] and "seed" not in arguments:
        return reset(**arguments, seed=seed)
    with seeded_generators(seed):
        return reset(**arguments)


class FactoryEnvironment(ToolUse, Adapter):
    """One instance of a TRL environment class (made by ``factory``, or given made), reset for each
    episode; ``instance`` is the user's object (what reward functions get as ``environments``)."""

    reward_method = "get_reward"  # what :meth:`reward` calls, for messages

    def __init__(self, factory: Callable | None, tools: list[Callable], timeout: float,
                 parser: ToolCallParser = parse_hermes, instance=None):
        self.instance = factory() if instance is None else instance
        self.name = describe(self.instance)
        self.pays = callable(getattr(self.instance, "get_reward", None))  # TRL: get_reward makes it a reward
        super().__init__(ToolBox(tools + tool_methods(self.instance), timeout), parser)
        self.row: dict = {}

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str | None, dict]:
        self.start_episode()
        self.row = options or {}
        try:
            observation = seeded_reset(self.instance.reset, reset_arguments(self.instance.reset, self.row), seed)
        except Exception as error:  # noqa: BLE001 -- the environment's bug, named
            raise EnvironmentFailed(self.instance, "reset", self.row, error) from error
        if isinstance(observation, tuple) and len(observation) == 2 and isinstance(observation[1], dict):
            raise EnvironmentFailed(self.instance, "reset", self.row, TypeError(
                "it returned a tuple (observation, info), gymnasium's shape, but its reset does not take seed= and "
                "options= (gymnasium.Env.reset's signature), so it plays TRL's shape, whose reset returns None or "
                "a string; give it reset(self, *, seed=None, options=None) to play gymnasium's"))
        if observation is not None and not isinstance(observation, str):
            raise EnvironmentFailed(self.instance, "reset", self.row, TypeError(
                f"it returned a {type(observation).__name__} ({observation!r:.80}); a TRL environment's reset returns "
                f"None or a string (appended to the prompt)"))
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
                from ppo_rlhf.rollout.reward import run_coroutine

                value = run_coroutine(value)
        except Exception as error:  # noqa: BLE001
            raise EnvironmentFailed(self.instance, "get_reward", self.row, error) from error
        return value
