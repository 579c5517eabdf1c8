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
The global generators are the process's, and episodes' calls run at once (envs/calls.py): such
resets hold a lock and run one at a time, an ``async def`` one with its own generator states
swapped in around each of its steps (``SeededSteps``).
"""

from __future__ import annotations

import contextlib
import inspect
import random
import threading
from typing import Callable

from ppo_rlhf.envs.calls import EnvironmentCalls, is_async
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


# Python's ``random`` and numpy's global generator are the process's: one seeded stretch of code at a time.
GLOBAL_GENERATORS = threading.Lock()


def generator_states() -> tuple:
    """(Python's random state, numpy's global generator's state or None without numpy)."""
    try:
        import numpy
    except ImportError:  # numpy is a dependency of torch's wheels, but a user's class need not use it
        return random.getstate(), None
    return random.getstate(), numpy.random.get_state()


def set_generator_states(states: tuple) -> None:
    random.setstate(states[0])
    if states[1] is not None:
        import numpy

        numpy.random.set_state(states[1])


def seeded_states(seed: int) -> tuple:
    """The generators' states once seeded with ``seed`` (the process's left as they were)."""
    with GLOBAL_GENERATORS:
        outside = generator_states()
        random.seed(seed)
        if outside[1] is not None:
            import numpy

            numpy.random.seed(seed % 2**32)
        states = generator_states()
        set_generator_states(outside)
    return states


@contextlib.contextmanager
def generators_at(states: list):
    """Python's ``random`` and numpy's global generator in ``states[0]`` inside (no other seeded
    stretch meanwhile), their states after it kept in ``states[0]``, and as they were outside."""
    with GLOBAL_GENERATORS:
        outside = generator_states()
        set_generator_states(states[0])
        try:
            yield
        finally:
            states[0] = generator_states()
            set_generator_states(outside)


def seeded_call(reset: Callable, arguments: dict, seed: int):
    """``reset(**arguments)`` with the global generators seeded with ``seed`` around it (a worker thread's call)."""
    with generators_at([seeded_states(seed)]):
        return reset(**arguments)


class SeededSteps:
    """A coroutine awaited with the global generators in states of its own during each of its steps,
    seeded with ``seed`` before the first: other episodes' coroutines run between its steps on the
    same loop, and neither sees the other's draws."""

    def __init__(self, coroutine, seed: int):
        self.coroutine, self.states = coroutine, [seeded_states(seed)]

    def __await__(self):
        send, value = self.coroutine.send, None
        while True:
            with generators_at(self.states):
                try:
                    waiting_on = send(value)
                except StopIteration as done:
                    return done.value
            try:
                value, send = (yield waiting_on), self.coroutine.send
            except BaseException as error:  # noqa: BLE001 -- handed to the coroutine, as an await hands it
                value, send = error, self.coroutine.throw


async def seeded_reset(calls: EnvironmentCalls, reset: Callable, arguments: dict, seed: int | None, name: str):
    """``reset(**arguments)`` through the run's ``calls``, seeded (module docstring): ``seed=`` where
    reset names it and the row gives none of its own, else the global generators seeded around the
    call (an ``async def`` reset: around each of its steps)."""
    if seed is None:
        return await calls.call(reset, kwargs=arguments, name=name)
    if "seed" in named_parameters(reset)[0] and "seed" not in arguments:
        return await calls.call(reset, kwargs={**arguments, "seed": seed}, name=name)
    if is_async(reset):
        async def stepped():
            return await SeededSteps(reset(**arguments), seed)

        return await calls.call(stepped, name=name)
    return await calls.call(seeded_call, (reset, arguments, seed), name=name)


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

    async def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str | None, dict]:
        self.start_episode()
        self.row = options or {}
        try:
            observation = await seeded_reset(self.calls, self.instance.reset,
                                             reset_arguments(self.instance.reset, self.row), seed,
                                             f"environment {self.name}: reset()")
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

    async def reward(self) -> float | None:
        """``get_reward()`` of the finished episode (None for a class without one), awaited if async."""
        get_reward = getattr(self.instance, "get_reward", None)
        if get_reward is None:
            return None
        try:
            return await self.calls.call(get_reward, name=f"environment {self.name}: get_reward()")
        except Exception as error:  # noqa: BLE001
            raise EnvironmentFailed(self.instance, "get_reward", self.row, error) from error
