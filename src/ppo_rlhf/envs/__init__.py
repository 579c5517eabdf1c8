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
from ppo_rlhf.envs.calls import ENV_WORKERS, EnvironmentCalls
from ppo_rlhf.envs.parsers import load_parser, parse_hermes
from ppo_rlhf.envs.protocol import (Adapter, EnvironmentFailed, TextEnvironment, as_messages, check_environment,
                                    describe, users_object)
from ppo_rlhf.envs.tools import ToolBox, ToolEnvironment, ToolUse

__all__ = ["EnvironmentSource", "EnvironmentFailed", "TextEnvironment", "as_messages", "environment_source",
           "users_object"]

TOOL_OPTION_DEFAULTS = {"tool_parser": "auto", "tool_timeout": 10.0}
ROUTING_COLUMN = "environment"  # TRL's: with a dict of environments, the column naming each row's


@dataclass
class EnvironmentKind:
    """One way a run makes environments: a class (or any callable making one), gym:ID, textarena:ID,
    or tools alone.  ``answers``: "tools" when tool messages answer its turns (tools, TRL's classes),
    "observations" when its step's observation does (gymnasium's shape)."""

    make: Callable[[], object]
    description: str
    pays: bool = True  # its episodes earn rewards of their own (tools alone: none, a reward function scores them)
    pays_per_turn: bool = True  # its steps return a reward each (gymnasium's shape); tools and TRL's classes: none
    answers: str = "observations"
    note: str | None = None  # what the run does that the user's framework would not, for the plan
    pool: list = field(default_factory=list)  # made once, reset for each episode (TRL's rule)


class EnvironmentSource:
    """Makes the environments of a run's episodes, one per episode of a batch, kept and reset from
    batch to batch (as TRL keeps its instances: one made per concurrent episode, never more).

    ``kinds``: by name, the ways of making them; one unnamed kind (None) for a single environment,
    several (TRL's dict form) chosen per row by its ``environment`` column, each row's prompt listing
    only its environment's tools.  The tool-call parser (``--tool-parser``) and the chat template the
    episodes render with are set once the tokenizer is known (envs/chat.py, ``prepare_episode_chat``).
    ``calls``: the run's environment calls (envs/calls.py), through which every call of its
    environments runs: ``env_workers`` plain-def calls at once, async ones awaited together; an
    async def holding the loop past ``stall_limit`` seconds (--tool-timeout) stops the run."""

    def __init__(self, kinds: dict, tool_parser="auto", env_workers: int = ENV_WORKERS, stall_limit: float = 10.0):
        self.kinds, self.routed = kinds, None not in kinds
        self.calls = EnvironmentCalls(env_workers, stall_limit)
        self.parser = load_parser(tool_parser)  # "auto" until prepared
        self.parser_name = tool_parser if isinstance(tool_parser, str) else getattr(tool_parser, "__name__", "given")
        self.chat_template: str | None = None  # the template episodes render with, where not the tokenizer's own
        self.notes: list[str] = list(dict.fromkeys(kind.note for kind in kinds.values() if kind.note))  # for the plan

    @property
    def description(self) -> str:
        if not self.routed:
            return self.kinds[None].description
        return "per row by its 'environment' column: " + "; ".join(kind.description for kind in self.kinds.values())

    @property
    def pays(self) -> bool:
        return any(kind.pays for kind in self.kinds.values())

    @property
    def pays_per_turn(self) -> bool:
        """Whether any of its environments rewards a turn on its own (a step's reward), which
        --turn-rewards per-turn places on that turn."""
        return any(kind.pays_per_turn for kind in self.kinds.values())

    @property
    def tools(self) -> list[dict]:
        """Every tool schema of the run (the union over its environments, by name)."""
        schemas = {}
        for kind in self.kinds.values():
            for schema in getattr(self.first(kind), "tools", None) or []:
                schemas.setdefault(schema["function"]["name"], schema)
        return list(schemas.values())

    def first(self, kind: EnvironmentKind):
        """The kind's first environment (made now if none is yet)."""
        return self.take(kind, 0)

    def take(self, kind: EnvironmentKind, index: int):
        while len(kind.pool) <= index:
            kind.pool.append(None)
        if kind.pool[index] is None:  # never made, or retired
            environment = kind.make()
            check_environment(environment, kind.description)
            kind.pool[index] = environment
        environment = kind.pool[index]
        if isinstance(environment, ToolUse):
            environment.calls = self.calls
            if not isinstance(self.parser, str):
                environment.parser = self.parser
        return environment

    def retire(self, environments: list) -> None:
        """Take ``environments`` out of the pool: a call that may still be running changes them (a
        tool past --tool-timeout, a rollout stopped midway), so the next episodes get fresh ones."""
        retired = {id(environment) for environment in environments}
        for kind in self.kinds.values():
            kind.pool = [None if id(environment) in retired else environment for environment in kind.pool]

    def kind_name(self, row: dict):
        """The name of the kind that plays ``row`` (None with a single environment); DataError naming the
        row and the names for a row without one of them."""
        if not self.routed:
            return None
        name = row.get(ROUTING_COLUMN) if isinstance(row, dict) else None
        if name not in self.kinds:
            from ppo_rlhf.data import DataError

            where = row.get("_source", "a prompt row") if isinstance(row, dict) else "a prompt row"
            got = f"holds {name!r}" if isinstance(row, dict) and ROUTING_COLUMN in row else "has none"
            raise DataError(f"{where}: with several environments each row names its own in an '{ROUTING_COLUMN}' "
                            f"column (TRL's rule); this row {got}, the environments are "
                            f"{', '.join(map(repr, self.kinds))}")
        return name

    def check_rows(self, rows: list[dict]) -> None:
        """At start: every row names one of the environments (several environments only)."""
        for row in rows:
            self.kind_name(row)

    def environments(self, rows: int | list[dict]) -> list:
        """One environment per row (``rows``: the batch's rows, or a count with a single environment),
        each kind's taken from its pool in turn."""
        rows = [{}] * rows if isinstance(rows, int) else rows
        used: dict = {}
        chosen = []
        for row in rows:
            name = self.kind_name(row)
            chosen.append(self.take(self.kinds[name], used.get(name, 0)))
            used[name] = used.get(name, 0) + 1
        return chosen


def parse_config_values(text: str | None) -> dict:
    """``key=value,key=value`` (values read as YAML: numbers, true/false, lists) -> dict; ConfigError
    naming --environment-config and the part at fault (config_yaml.py, ``parse_key_values``)."""
    from ppo_rlhf.config_yaml import parse_key_values

    return parse_key_values(text or "", "environment_config", "is_slippery=false,map_name=4x4")


def check_tool_list(tools) -> None:
    """ConfigError unless ``tools`` is a list (or tuple) of tools, or None: TRL's ``tools=`` takes a
    list, and a single function given alone is named with the list that holds it."""
    if not isinstance(tools, (list, tuple, type(None))):
        raise ConfigError(f"tools must be a list of functions, got a {type(tools).__name__} ({tools!r:.60}); give "
                          f"tools=[{getattr(tools, '__name__', 'f')}]")


def environment_source(environment=None, tools: list | None = None, *, tool_parser="auto",
                       tool_timeout: float = 10.0, environment_config: str | dict | None = None,
                       action_names: list[str] | None = None, observation_text: str | Callable | None = None,
                       env_workers: int = ENV_WORKERS) -> EnvironmentSource | None:
    """What to play episodes with, from the CLI's strings or the Python API's objects; None for
    neither (single-turn rollouts).  ``environment``: a class or any callable making one environment
    (a lambda, a ``functools.partial``), TRL's dict of them (chosen per row by an ``environment``
    column), ``gym:ID``, ``textarena:ID``, or ``module:NAME`` naming any of these.  Checked at start:
    an environment that cannot be made or has no reset / step, a tool without type hints or
    docstring, a gym environment whose actions cannot be named or that draws no text, --tool-parser
    or --tool-timeout where no tool is called -- each a ConfigError naming it."""
    from ppo_rlhf.user_code import load_function

    check_tool_list(tools)
    tools = [load_function(t, "tool") if isinstance(t, str) else t for t in (tools or [])]
    if environment is None and not tools:
        return None
    load_parser(tool_parser)  # a name that is no parser fails now, before anything is made
    make_kwargs = environment_config if isinstance(environment_config, dict) else parse_config_values(environment_config)
    if isinstance(observation_text, str):
        observation_text = load_function(observation_text, "observation text function")
    given_as = environment if isinstance(environment, str) else None  # its name in messages: as the user wrote it
    if isinstance(environment, str) and not environment.startswith(("gym:", "textarena:")):
        environment = load_function(environment, "environment", also=(dict,))
    tool_options = {key: value for key, value in (("tool_parser", tool_parser), ("tool_timeout", tool_timeout))
                    if value != TOOL_OPTION_DEFAULTS[key]}
    if environment is None:
        ToolBox(tools, tool_timeout)  # the schemas checked now, once
        kinds = {None: EnvironmentKind(lambda: ToolEnvironment(ToolBox(tools, tool_timeout), parse_hermes),
                                       "tools alone (a turn without a call is the answer)", pays=False,
                                       pays_per_turn=False, answers="tools")}
    elif isinstance(environment, dict):
        if not environment:
            raise ConfigError("environment: an empty dict; TRL's dict form maps each name a row's 'environment' "
                              "column may hold to a class (or a function making one environment)")
        kinds = {name: environment_kind(factory, None, tools, tool_timeout, make_kwargs, action_names,
                                        observation_text, tool_options, key=name)
                 for name, factory in environment.items()}
    else:
        kinds = {None: environment_kind(environment, given_as, tools, tool_timeout, make_kwargs, action_names,
                                        observation_text, tool_options, key=None)}
    source = EnvironmentSource(kinds, tool_parser, env_workers, stall_limit=tool_timeout)
    for kind in kinds.values():
        source.first(kind)  # made once now: a class that cannot be built, or has no reset, says so at start
    return source


def environment_kind(environment, given_as: str | None, tools: list, tool_timeout: float, make_kwargs: dict,
                     action_names, observation_text, tool_options: dict, key=None) -> EnvironmentKind:
    """How to make one of the run's environments (``given_as``: the string it was named by; ``key``:
    its name in TRL's dict form)."""
    if isinstance(environment, str) and environment.startswith("gym:"):
        from ppo_rlhf.envs.gym_text import GymActionEnvironment, check_gym_id

        env_id = environment.removeprefix("gym:")
        check_gym_id(env_id)
        refuse_tools(tools, environment, tool_options)
        return EnvironmentKind(lambda: GymActionEnvironment(env_id, make_kwargs, action_names, observation_text),
                               environment)
    if isinstance(environment, str) and environment.startswith("textarena:"):
        from ppo_rlhf.envs.textarena import TextArenaEnvironment, require_textarena

        require_textarena()
        refuse_tools(tools, environment, tool_options)
        game = environment.removeprefix("textarena:")
        return EnvironmentKind(lambda: TextArenaEnvironment(game, make_kwargs), environment)
    name = given_as or factory_name(environment)
    if key is not None:
        name = f"{key!r} ({name})"
    if not callable(environment):
        raise ConfigError(f"environment {name}: give a class, or a function making one environment (TRL's "
                          f"environment_factory: a lambda or functools.partial too), got a "
                          f"{type(environment).__name__}")
    return class_kind(environment, name, tools, tool_timeout, make_kwargs, tool_options)


def factory_name(factory) -> str:
    """A name for messages: a class's or function's own, a partial's function, else its repr."""
    if isinstance(factory, str):
        return factory
    inner = getattr(factory, "func", factory)  # functools.partial
    return getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None) or repr(factory)


def gymnasium_shaped(instance) -> bool:
    """Whether an environment plays gymnasium's shape: a ``reset`` taking ``seed=`` and ``options=``
    (gymnasium.Env.reset's signature) and a ``step``.  Anything else with a reset plays TRL's shape,
    whatever its methods are named (a tool named ``step`` included)."""
    reset, step = getattr(instance, "reset", None), getattr(instance, "step", None)
    if not callable(reset) or not callable(step):
        return False
    try:
        parameters = inspect.signature(reset).parameters
    except (TypeError, ValueError):
        return False
    return "seed" in parameters and "options" in parameters


def class_kind(factory: Callable, name: str, tools: list, tool_timeout: float, make_kwargs: dict,
               tool_options: dict) -> EnvironmentKind:
    """A user's class (or any callable making an environment): gymnasium's text protocol when what
    it makes has gymnasium's reset (made with --environment-config's arguments), else TRL's
    environment_factory shape (reset and tools).  Decided on an instance made now, kept in the pool."""
    from ppo_rlhf.envs.trl import FactoryEnvironment

    def make():
        try:
            return factory(**make_kwargs)
        except TypeError as error:
            raise ConfigError(f"environment {name}: cannot be made with {make_kwargs or 'no arguments'} ({error}); "
                              f"give a class, or a function making one environment (--environment-config gives "
                              f"the arguments of a gymnasium-style one)") from None
        except Exception as error:  # noqa: BLE001 -- the user's constructor, named
            raise ConfigError(f"environment {name}: making it raised {type(error).__name__}: {error}") from None

    first = make()
    if gymnasium_shaped(first):
        refuse_tools(tools, name, tool_options)
        made = [first]
        return EnvironmentKind(lambda: made.pop() if made else make(),
                               f"environment {name} (gymnasium's reset / step, in text)")
    if make_kwargs:
        raise ConfigError(f"environment {name}: --environment-config gives a gymnasium environment's arguments; a "
                          f"class of TRL's environment_factory shape is made without any")
    if not callable(getattr(first, "reset", None)):
        raise ConfigError(f"environment {name}: a {type(first).__name__} has no reset() method; a class of TRL's "
                          f"environment_factory shape needs reset() (and its public methods are the tools), a "
                          f"gymnasium-style one reset(seed=, options=) and step()")
    from ppo_rlhf.envs.trl import tool_methods

    if not tools and not tool_methods(first):
        raise ConfigError(f"environment {name}: a class of TRL's environment_factory shape with no tools (no public "
                          f"method but reset and get_reward) and no --tool: the model could call nothing, so every "
                          f"episode would end at its first turn; give it tool methods (type hints and a docstring), "
                          f"or --tool functions, or, for an environment that answers each turn itself, gymnasium's "
                          f"shape: reset(self, *, seed=None, options=None) -> (observation, info) and step(self, text) "
                          f"-> (observation, reward, terminated, truncated, info)")
    made = [first]

    def make_factory_environment():
        instance = made.pop() if made else factory()
        return FactoryEnvironment(None, tools, tool_timeout, instance=instance)

    return EnvironmentKind(make_factory_environment,
                           f"environment {name} (TRL's environment_factory shape: its methods are tools)",
                           pays=callable(getattr(first, "get_reward", None)), pays_per_turn=False, answers="tools",
                           note="reset() seeded per prompt group (seed= where it takes one, else Python's and numpy's "
                                "generators around the call), which TRL does not do: the K episodes of a row start "
                                "alike")


def refuse_tools(tools: list, name: str, tool_options: dict) -> None:
    """Tools and their options refused where nothing calls a tool: the environment's steps answer
    the model's turns themselves."""
    if tools:
        raise ConfigError(f"--tool with environment {name}: its steps answer the model's turns themselves; tools go "
                          f"with --tool alone or with a TRL-style environment class (its methods and the tools)")
    for option, value in tool_options.items():
        raise ConfigError(f"invalid value for '{option}': {value!r} with environment {name}, which calls no tool "
                          f"(its steps answer the model's turns); leave --{option.replace('_', '-')} out")


__all__ += ["Adapter", "describe", "parse_config_values"]
