"""Environments and tools for multi-turn episodes (docs/agents.md).

    protocol.py   the one protocol inside: gymnasium's reset / step, with text
    tools.py      tools (plain functions), their schemas, calls run with a timeout; tools alone
    parsers.py    tool calls read from the model's text (Hermes / Qwen's <tool_call> by default)
    trl.py        TRL's environment_factory classes
    gym_text.py   discrete gymnasium environments played through their action names
    textarena.py  TextArena's games (optional: pip install textarena)

:func:`environment_source` turns what a user gives -- ``--tool`` functions, ``--environment``
(a class of TRL's shape or of gymnasium's with text, ``gym:ID``, ``textarena:ID``), or the same
as Python objects -- into an :class:`EnvironmentSource`, which makes one environment per episode
for the episode runner (rollout/episodes.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

from ppo_rlhf.config import ConfigError
from ppo_rlhf.envs.parsers import load_parser
from ppo_rlhf.envs.protocol import EnvironmentFailed, TextEnvironment, as_messages, check_environment, describe
from ppo_rlhf.envs.tools import ToolEnvironment, ToolBox

__all__ = ["EnvironmentSource", "EnvironmentFailed", "TextEnvironment", "as_messages", "environment_source"]


@dataclass
class EnvironmentSource:
    """Makes the environments of a run's episodes, one per episode of a batch, kept and reset
    from batch to batch (as TRL keeps its instances: one made per concurrent episode, never more).

    ``description``: for the run's plan; ``tools``: the schemas every episode's prompt lists (from
    the first environment made: TRL's rule, one set of tools per run)."""

    make: Callable[[], object]
    description: str
    pays: bool = True  # its episodes earn rewards of their own (tools alone: none, a reward function scores them)
    pool: list = field(default_factory=list)

    def environments(self, count: int) -> list:
        while len(self.pool) < count:
            environment = self.make()
            check_environment(environment, self.description)
            self.pool.append(environment)
        return self.pool[:count]

    @property
    def tools(self) -> list[dict]:
        return list(getattr(self.environments(1)[0], "tools", None) or [])


def parse_config_values(text: str | None) -> dict:
    """``key=value,key=value`` (values read as YAML scalars: numbers, true/false) -> dict."""
    import yaml

    values = {}
    for part in filter(None, (text or "").split(",")):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"invalid value for 'environment_config': {text!r}; expected key=value pairs separated "
                              f"by commas, e.g. is_slippery=false,map_name=4x4 (the part {part!r} is not one)")
        values[key.strip()] = yaml.safe_load(value)
    return values


def environment_source(environment=None, tools: list | None = None, *, tool_parser: str = "hermes",
                       tool_timeout: float = 10.0, environment_config: str | dict | None = None,
                       action_names: list[str] | None = None, observation_text: str | Callable | None = None
                       ) -> EnvironmentSource | None:
    """What to play episodes with, from the CLI's strings or the Python API's objects; None for
    neither (single-turn rollouts).  Checked at start: an environment that cannot be made or has
    no reset / step, a tool without type hints or docstring, a gym environment whose actions cannot
    be named -- each a ConfigError naming it."""
    from ppo_rlhf.user_code import load_function

    tools = [load_function(t, "tool") if isinstance(t, str) else t for t in (tools or [])]
    if environment is None and not tools:
        return None
    parser = load_parser(tool_parser) if isinstance(tool_parser, str) else tool_parser
    make_kwargs = environment_config if isinstance(environment_config, dict) else parse_config_values(environment_config)
    if isinstance(observation_text, str):
        observation_text = load_function(observation_text, "observation text function")
    if environment is None:
        ToolBox(tools, tool_timeout)  # the schemas checked now, once
        source = EnvironmentSource(lambda: ToolEnvironment(ToolBox(tools, tool_timeout), parser),
                                   "tools alone (a turn without a call is the answer)", pays=False)
    elif isinstance(environment, str) and environment.startswith("gym:"):
        from ppo_rlhf.envs.gym_text import GymActionEnvironment

        env_id = environment.removeprefix("gym:")
        check_gym_id(env_id)
        refuse_tools(tools, environment)
        source = EnvironmentSource(lambda: GymActionEnvironment(env_id, make_kwargs, action_names, observation_text),
                                   environment)
    elif isinstance(environment, str) and environment.startswith("textarena:"):
        from ppo_rlhf.envs.textarena import TextArenaEnvironment, require_textarena

        require_textarena()
        refuse_tools(tools, environment)
        game = environment.removeprefix("textarena:")
        source = EnvironmentSource(lambda: TextArenaEnvironment(game, make_kwargs), environment)
    else:
        name = environment if isinstance(environment, str) else getattr(environment, "__name__", repr(environment))
        factory = load_function(environment, "environment") if isinstance(environment, str) else environment
        if not callable(factory):
            raise ConfigError(f"environment {name}: give a class (or a function making one environment), got a "
                              f"{type(factory).__name__}")
        source = class_source(factory, name, tools, parser, tool_timeout, make_kwargs)
    source.environments(1)  # made once now: a class that cannot be built, or has no reset, says so at start
    return source


def class_source(factory: Callable, name: str, tools: list, parser, tool_timeout: float,
                 make_kwargs: dict) -> EnvironmentSource:
    """A user's class: gymnasium's text protocol when it has ``step`` (made with
    --environment-config's arguments), else TRL's environment_factory shape (reset and tools)."""
    from ppo_rlhf.envs.trl import FactoryEnvironment

    def make():
        try:
            return factory(**make_kwargs)
        except TypeError as error:
            raise ConfigError(f"environment {name}: cannot be made with {make_kwargs or 'no arguments'} ({error}); "
                              f"give a class, or a function making one environment (--environment-config gives "
                              f"the arguments of a gymnasium-style one)") from None

    # A class shows its methods; a function making environments shows them on what it makes.
    has_step = callable(getattr(factory if inspect.isclass(factory) else make(), "step", None))
    if has_step:
        refuse_tools(tools, name)
        return EnvironmentSource(make, f"environment {name} (gymnasium's reset / step, in text)")
    if make_kwargs:
        raise ConfigError(f"environment {name}: --environment-config gives a gymnasium environment's arguments; a "
                          f"class of TRL's environment_factory shape is made without any")
    if not callable(getattr(factory, "reset", None)):
        raise ConfigError(f"environment {name}: a class of TRL's environment_factory shape needs a reset() method "
                          f"(and its public methods are the tools); a gymnasium-style one needs reset() and step()")
    return EnvironmentSource(lambda: FactoryEnvironment(factory, tools, parser, tool_timeout),
                             f"environment {name} (TRL's environment_factory shape: its methods are tools)")


def refuse_tools(tools: list, name: str) -> None:
    if tools:
        raise ConfigError(f"--tool with environment {name}: its steps answer the model's turns themselves; tools go "
                          f"with --tool alone or with a TRL-style environment class (its methods and the tools)")


def check_gym_id(env_id: str) -> None:
    import gymnasium as gym

    try:
        gym.spec(env_id)
    except gym.error.Error as error:
        raise ConfigError(f"environment gym:{env_id}: {error}") from None


__all__ += ["describe", "parse_config_values"]
