"""Tools: plain Python functions the model calls by writing a tool call (docs/agents.md).

A tool is a function with type hints and a docstring (Google style, an ``Args:`` line per
parameter): its JSON schema is read from them (transformers' ``get_json_schema``, what TRL and
the chat templates use) and rendered into the prompt by the chat template.  ``async def`` tools
are awaited.  Everything that can go wrong with a call is the model's mistake, not the run's: a
call that cannot be read, an unknown tool, wrong arguments, a tool that raises or runs past
``--tool-timeout``, or returns a value that cannot be written as text -- the model gets an error
message naming the tool as its answer and the episode goes on, and each is counted
(``tools/calls``, ``tools/errors``, ``tools/timeouts``).

:class:`ToolEnvironment` is the environment of tools alone (``--tool`` without
``--environment``): each turn's calls are run and their results are the next observation; a turn
without a call is the model's answer and ends the episode, as in TRL.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from ppo_rlhf.config import ConfigError
from ppo_rlhf.envs.calls import CallTimedOut, EnvironmentCalls
from ppo_rlhf.envs.parsers import ToolCall, ToolCallParser, parse_hermes, typed_call
from ppo_rlhf.envs.protocol import Adapter


def tool_schema(function: Callable) -> dict:
    """The JSON schema a chat template renders for ``function``; ConfigError naming the tool and
    what it lacks (type hints, a docstring, a described argument)."""
    from transformers.utils import get_json_schema

    name = getattr(function, "__name__", repr(function))
    try:
        return get_json_schema(function)
    except Exception as error:  # noqa: BLE001 -- transformers' parsing errors have several types
        raise ConfigError(f"tool {name}: {error}; a tool needs a type hint on every argument and a docstring "
                          f"describing it (Args: name: what it is), as TRL's tools do") from None


def tool_result_text(result) -> str:
    """A tool's return value as the text of its message, as TRL writes it: text as it is, a list
    (TRL hands it to the template as it is) as JSON where it can be, anything else ``str()``."""
    if isinstance(result, str):
        return result
    if isinstance(result, list):
        try:
            return json.dumps(result)
        except (TypeError, ValueError):
            pass
    return str(result)


@dataclass
class ToolAnswer:
    message: dict  # {"role": "tool", "name": ..., "content": text}, what the chat template renders
    outcome: str  # ok | error | timeout
    value: object = None  # the content TRL gives reward functions: a list result as it is, else the text

    @property
    def given(self) -> dict:
        """The message as reward functions get it (TRL's ``completions``)."""
        return self.message if self.value is None else {**self.message, "content": self.value}


class ToolBox:
    """Named tools, each call run through the run's environment calls (envs/calls.py) with at most
    ``timeout`` seconds: a plain def on a worker thread, an ``async def`` awaited.

    A call past its time is answered with an error.  An async one is cancelled; a thread cannot be
    stopped from outside, so it is left to finish in the background (a daemon: it holds no lock of
    the run's, nor the process open at exit), and ``abandoned`` says so: the source retires the
    environment it belongs to, whose object that thread may still change, and makes a fresh one
    for the next episode."""

    def __init__(self, functions: list[Callable], timeout: float):
        self.functions = {}
        for function in functions:
            name = getattr(function, "__name__", None)
            if not callable(function) or not name:
                raise ConfigError(f"a tool must be a named function, got {function!r:.80}")
            if name in self.functions:
                raise ConfigError(f"two tools are named {name}: a tool call names the tool, so names must differ")
            self.functions[name] = function
        self.schemas = [tool_schema(function) for function in self.functions.values()]
        self.timeout = timeout
        self.abandoned = False  # a call past its time may still be running

    def __bool__(self) -> bool:
        return bool(self.functions)

    async def answer(self, call: ToolCall, calls: EnvironmentCalls) -> ToolAnswer:
        """Run one parsed call through ``calls``; the tool message the model reads next, and how it went."""
        name = call.name or "unknown"
        if call.error is not None:
            return self.error(name, call.error)
        function = self.functions.get(call.name)
        if function is None:
            return self.error(name, f"there is no tool named {call.name!r}; the tools are {', '.join(self.functions)}")
        try:
            inspect.signature(function).bind(**call.arguments)
        except TypeError as error:
            return self.error(name, f"wrong arguments for {call.name}: {error}")
        try:  # a copy of the arguments: the call's record keeps what the model wrote
            result = await calls.call(function, kwargs=copy.deepcopy(call.arguments), timeout=self.timeout,
                                      name=f"tool {name}")
        except CallTimedOut as timed_out:
            self.abandoned |= timed_out.still_running
            return ToolAnswer(tool_message(name, f"Error: {name} did not answer within {self.timeout:g} seconds"),
                              "timeout")
        except asyncio.CancelledError:  # the rollout stopped: not the tool's answer
            raise
        except BaseException as error:  # noqa: BLE001 -- a tool's exception is its answer to the model
            return self.error(name, f"{name} raised {type(error).__name__}: {error}")
        try:
            text = tool_result_text(result)
        except Exception as error:  # noqa: BLE001 -- a value whose __str__ raises: the tool's failure, as a raise is
            return self.error(name, f"{name} returned a value ({type(result).__name__}) that cannot be written as text "
                                    f"({type(error).__name__}: {error})")
        return ToolAnswer(tool_message(name, text), "ok", result if isinstance(result, list) else None)

    @staticmethod
    def error(name: str, text: str) -> ToolAnswer:
        return ToolAnswer(tool_message(name, f"Error: {text}"), "error")


def tool_message(name: str, content: str) -> dict:
    return {"role": "tool", "name": name, "content": content}


class ToolParserFailed(RuntimeError):
    """The tool-call parser itself raised on a turn (a bug in --tool-parser module:function, not in
    the environment or the model): the run stops, naming the parser."""


# The calls of an environment used on its own, outside a run (its ``step`` called directly): one at a time.
STANDALONE_CALLS = EnvironmentCalls(workers=1)


class ToolUse:
    """The part of an environment that reads a turn's tool calls and answers them: shared by the
    environment of tools alone and by TRL's environment classes (envs/trl.py).  ``parser``: how
    calls are read (envs/parsers.py); the run's source sets the one ``--tool-parser`` resolved to,
    and ``calls``, the run's environment calls (envs/calls.py), through which the tools run."""

    def __init__(self, toolbox: ToolBox, parser: ToolCallParser = parse_hermes):
        self.toolbox, self.parser = toolbox, parser
        self.calls = STANDALONE_CALLS
        self.tool_stats: Counter = Counter()  # calls, errors, timeouts of the current episode
        self.tool_log: list[dict] = []  # each call and its answer, for --save-rollouts

    @property
    def tools(self) -> list[dict]:
        return self.toolbox.schemas

    @property
    def abandoned(self) -> bool:
        """A tool call past its time may still be running on this object (envs/calls.py)."""
        return self.toolbox.abandoned

    def start_episode(self) -> None:
        self.tool_stats, self.tool_log = Counter(), []

    def read_turn(self, text: str, prefix: str = "") -> tuple[str, list[ToolCall]]:
        """(the turn's words without its calls, the calls): what a chat message of the turn holds."""
        try:
            if hasattr(self.parser, "read"):
                return self.parser.read(text, prefix)
            calls = self.parser(text)
        except Exception as error:  # noqa: BLE001 -- the parser's bug, named as the parser's
            name = getattr(self.parser, "__qualname__", type(self.parser).__name__)
            raise ToolParserFailed(f"the tool-call parser {name} raised {type(error).__name__}: {error} on a turn "
                                   f"of {len(text)} characters; a parser returns a list of ToolCall, [] for a "
                                   f"turn without a call (--tool-parser)") from error
        if not isinstance(calls, (list, tuple)) or not all(isinstance(call, ToolCall) for call in calls):
            name = getattr(self.parser, "__qualname__", type(self.parser).__name__)
            raise ToolParserFailed(f"the tool-call parser {name} returned {calls!r:.80}; a parser returns a list of "
                                   f"ppo_rlhf.envs.parsers.ToolCall, [] for a turn without a call (--tool-parser)")
        content = text
        for call in calls:
            content = content.replace(call.text, "", 1) if call.text else content
        # Arguments cast to the tools' schemas, as TRL reads them ("3" for an int parameter is 3).
        return content.strip(), [typed_call(call, self.tools) for call in calls]

    async def answer(self, calls: list[ToolCall]) -> list[ToolAnswer]:
        """Run the turn's calls, one after another in the order written (a later call may read what
        an earlier one did); each one's answer, counted."""
        answers = []
        for call in calls:
            answer = await self.toolbox.answer(call, self.calls)
            self.tool_stats["calls"] += 1
            if answer.outcome != "ok":
                self.tool_stats[answer.outcome + "s"] += 1  # errors, timeouts
            self.tool_log.append({"name": call.name, "arguments": call.arguments, "text": call.text,
                                  "result": answer.message["content"], "outcome": answer.outcome})
            answers.append(answer)
        return answers

    def answer_calls(self, text: str) -> list[dict] | None:
        """The tool messages answering every call in ``text``; None when it makes no call."""
        calls = self.read_turn(text)[1]
        return [answer.message for answer in self.calls.run(self.answer(calls))] if calls else None


class ToolEnvironment(ToolUse, Adapter):
    """``--tool`` alone: the row's prompt, then the model's turns and the tools' answers, until a
    turn calls no tool (the model's answer).  No reward of its own: the run's reward functions
    score the episode."""

    name = "tools"
    pays = False  # the run's reward functions score its episodes
    instance = None  # no object of the user's: TRL passes reward functions no environments here

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[None, dict]:
        self.start_episode()
        return None, {}

    def step(self, action: str) -> tuple[list[dict] | None, float, bool, bool, dict]:
        answers = self.answer_calls(action)
        return answers, 0.0, answers is None, False, {}
