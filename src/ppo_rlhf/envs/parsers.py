"""Tool calls read from the model's own text, in the format its chat template taught it.

A parser is a function ``parse(text) -> list[ToolCall]``: every call the turn makes, in order, or
an empty list when the turn makes none (the model answered).  A call the model wrote but got
wrong -- broken JSON, no name, arguments that are not an object -- comes back as a ToolCall with
its ``error`` set: the model is told what was wrong, as a tool's answer, and the episode goes on
(envs/tools.py).  ``--tool-parser hermes`` (the default) reads Hermes / Qwen's

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

which Qwen 2.5 / 3, Hermes and SmolLM3's templates write; ``--tool-parser module:function`` takes
a parser of one's own with the same signature.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class ToolCall:
    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # the call could not be read: what the model is told
    text: str = ""  # the call as the model wrote it

    def as_message_call(self) -> dict:
        """The call as a chat message's ``tool_calls`` entry (the OpenAI / transformers shape)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


ToolCallParser = Callable[[str], list[ToolCall]]

HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` in ``text`` (an unclosed last one included: a turn cut
    by its token limit, or one whose closing tag the model forgot)."""
    calls = []
    for match in HERMES_CALL.finditer(text):
        body = match.group(1).strip()
        calls.append(read_call(body, match.group(0)))
    return calls


def read_call(body: str, text: str) -> ToolCall:
    """One call's JSON ``{"name": ..., "arguments": {...}}`` (arguments may also come as a JSON string)."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCall(None, error=f"the tool call is not valid JSON ({error.msg} at character {error.pos}): "
                                    f"{body[:200]!r}", text=text)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return ToolCall(None, error=f'a tool call is a JSON object {{"name": ..., "arguments": {{...}}}}, got '
                                    f"{body[:200]!r}", text=text)
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(value["name"], error=f"the arguments of a call to {value['name']} must be a JSON object, got "
                                             f"{arguments!r:.200}", text=text)
    return ToolCall(value["name"], arguments, text=text)


PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes}


def load_parser(name: str) -> ToolCallParser:
    """A parser by name (``hermes``) or ``module:function``; ConfigError for neither."""
    from ppo_rlhf.config import ConfigError
    from ppo_rlhf.user_code import load_function

    if name in PARSERS:
        return PARSERS[name]
    if ":" not in name:
        raise ConfigError(f"invalid value for 'tool_parser': {name!r}; allowed: {', '.join(PARSERS)}, or "
                          f"module:function for a parser of your own (text -> list of ToolCall)")
    return load_function(name, "tool parser")
