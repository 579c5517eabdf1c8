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
    """An environment's own method raised: the run stops, naming the environment, the method and
    the row (a bug in the environment, not something the model did; tool errors are the model's
    and go back to it as the tool's answer, envs/tools.py)."""

    def __init__(self, environment, method: str, row: dict, error: BaseException):
        where = row.get("_source", "a prompt row") if isinstance(row, dict) else "a prompt row"
        super().__init__(f"environment {describe(environment)}: {method}() raised {type(error).__name__}: {error} "
                         f"(on {where})")  # how to go on once it is fixed: the command's to say (cli.py)


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
