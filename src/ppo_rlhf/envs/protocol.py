"""The one environment protocol inside ppo-rlhf: gymnasium's, with text (docs/agents.md).

An environment plays one episode with the model at a time::

    observation, info = env.reset(seed=None, options=row)
    observation, reward, terminated, truncated, info = env.step(text)

``options`` is the prompt row (its prompt and every other column).  ``text`` is what the model
wrote in its turn, decoded.  An observation is what the environment says next:

- a string: the content of one message in the ``observation_role`` the environment declares
  (default "user"); from ``reset``, it is appended to the row's prompt (its last user message),
  or is the prompt itself when the row has none;
- a message ``{"role": ..., "content": ...}`` or a list of them (a tool's results, ``role:
  "tool"``); from ``reset``, a list of messages is the whole prompt;
- None: nothing to add (from ``reset``: the row's prompt as it is).

``terminated`` ends the episode on the environment's terms (solved, failed, the model answered);
``truncated`` ends it on a limit of the environment's own.  ``reward`` is the step's reward.  An
environment may also carry ``tools`` (JSON schemas, or functions to take them from), which the
chat template renders into the prompt, ``reward()`` (one number for the episode, read when it
ends, as TRL's ``get_reward``) and ``tool_stats`` (counts of calls, errors and timeouts).

Every way of giving an environment -- tools, TRL's ``environment_factory``, a gymnasium
environment that speaks text, a discrete gymnasium environment played through its action names
-- is an adapter to this protocol (envs/tools.py, envs/trl.py, envs/gym_text.py), so the episode
runner (rollout/episodes.py) knows this one shape.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]


@runtime_checkable
class TextEnvironment(Protocol):
    """gymnasium.Env's two calls, with text actions and text (or message) observations."""

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]: ...

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict]: ...


class EnvironmentFailed(RuntimeError):
    """An environment's own method raised, or handed back what no environment may: the run stops,
    naming the environment, the method and the row (a bug in the environment, not something the
    model did; tool errors are the model's and go back to it as the tool's answer, envs/tools.py)."""

    def __init__(self, environment, method: str, row: dict, error: BaseException | None = None,
                 returned: str | None = None):
        where = row.get("_source", "a prompt row") if isinstance(row, dict) else "a prompt row"
        if returned is not None:  # what it handed back is wrong: a bug to fix, not a failure to resume past
            super().__init__(f"environment {describe(environment)}: {method}() {returned} (on {where})")
        else:
            super().__init__(f"environment {describe(environment)}: {method}() raised {type(error).__name__}: "
                             f"{error} (on {where})")  # how to go on once it is fixed: the command's to say (cli.py)


def is_number(value) -> bool:
    """A real number a reward may be: int, float, bool or a numpy scalar of them; never text."""
    import numbers

    return isinstance(value, numbers.Real)


def check_reward(value, environment, method: str, row: dict, optional: bool = False):
    """A reward an environment handed back as a finite float (None where ``optional``: an episode's
    reward() for an episode it does not score, TRL's None); EnvironmentFailed naming it otherwise,
    as reward functions' scores are refused (rollout/reward.py)."""
    import math

    if value is None and optional:
        return None
    if not is_number(value) or not math.isfinite(float(value)):
        raise EnvironmentFailed(environment, method, row, returned=(
            f"returned the reward {value!r:.80} ({type(value).__name__}); a reward is a finite number"
            + (" (or None: no reward for this episode)" if optional else "")))
    return float(value)


def check_observation(observation, environment, method: str, row: dict) -> None:
    try:
        messages = as_messages(observation)
    except TypeError as error:
        raise EnvironmentFailed(environment, method, row, returned=f"returned an observation it cannot: {error}") \
            from None
    if method == "reset" and isinstance(observation, (list, tuple)) and messages and messages[-1]["role"] == "assistant":
        raise EnvironmentFailed(environment, method, row, returned=(
            "returned messages that end with an assistant message as the prompt; a prompt ends before the reply "
            "the model writes: leave that message out"))


def checked_result(result, environment, method: str, row: dict):
    """What ``environment.method`` handed back, checked against the protocol (module docstring):
    reset's (observation, info), step's five values (the old gym API's four named, with the fix),
    rewards that are finite numbers, observations that are text or messages."""
    if method == "reset":
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
            raise EnvironmentFailed(environment, method, row, returned=(
                f"returned {result!r:.80}; gymnasium's reset returns (observation, info), info a dict"))
        check_observation(result[0], environment, method, row)
    elif method == "step":
        if isinstance(result, tuple) and len(result) == 4:
            raise EnvironmentFailed(environment, method, row, returned=(
                "returned 4 values (observation, reward, done, info), the old gym API; gymnasium's step returns 5, "
                "(observation, reward, terminated, truncated, info): split done into terminated (the episode "
                "ended on the environment's terms) and truncated (a limit of its own)"))
        if not (isinstance(result, tuple) and len(result) == 5):
            raise EnvironmentFailed(environment, method, row, returned=(
                f"returned {result!r:.80}; gymnasium's step returns (observation, reward, terminated, truncated, "
                f"info)"))
        observation, reward, terminated, truncated, info = result
        check_observation(observation, environment, method, row)
        return observation, check_reward(reward, environment, method, row), bool(terminated), bool(truncated), info
    elif method == "reward":
        return check_reward(result, environment, getattr(environment, "reward_method", method), row, optional=True)
    return result


class Adapter:
    """ppo-rlhf's own object around what the user gave (TRL's class, a gymnasium id, tools): the
    episode runner plays it; reward functions get ``instance``, the user's own object, as TRL gives
    ``environments=`` (None where there is none: tools alone)."""

    instance = None
    prompt_separator = ""  # between the row's prompt and what reset() adds to it (TRL's classes: none)


def users_object(environment):
    """What reward functions get for an episode's environment: the user's object, not an adapter."""
    return environment.instance if isinstance(environment, Adapter) else environment


def describe(environment) -> str:
    """A name for messages: the environment's own ``name``, else its class."""
    return getattr(environment, "name", None) or type(environment).__qualname__


def as_messages(observation, role: str = "user") -> list[Message]:
    """An observation as the list of messages it adds to the conversation (see the module docstring)."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, dict):
        return [observation]
    if isinstance(observation, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in observation):
        return list(observation)
    raise TypeError(f"an observation must be a string, a message {{role, content}} or a list of messages, got "
                    f"{type(observation).__name__}: {observation!r:.80}")


def takes_keyword(function, name: str) -> bool:
    """Whether ``function`` accepts ``name`` as a keyword (by name, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def check_environment(environment, name: str) -> None:
    """ConfigError at start for an object that cannot play an episode: no ``reset`` or ``step``."""
    from ppo_rlhf.config import ConfigError

    missing = [method for method in ("reset", "step") if not callable(getattr(environment, method, None))]
    if missing:
        raise ConfigError(f"environment {name}: a {type(environment).__name__} has no {' or '.join(missing)}(); an "
                          f"environment is gymnasium's reset(seed=, options=row) -> (observation, info) and "
                          f"step(text) -> (observation, reward, terminated, truncated, info), or a class of TRL's "
                          f"environment_factory shape (reset() and tool methods), see docs/agents.md")
