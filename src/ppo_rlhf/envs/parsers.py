"""Tool calls read from the model's own text, in the format its chat template taught it.

A parser is a function ``parse(text) -> list[ToolCall]``: every call the turn makes, in order, or
an empty list when the turn makes none (the model answered).  ``text`` is the turn as the model
wrote it, decoded with its special tokens (a template whose tags are special tokens keeps them),
less the stop token that ended it.  A call the model wrote but got wrong -- broken JSON, no name,
arguments that are not an object -- comes back as a ToolCall with its ``error`` set: the model is
told what was wrong, as a tool's answer, and the episode goes on (envs/tools.py).

``--tool-parser auto`` (the default) reads calls the way the model's chat template writes them:
with transformers' ``parse_response`` where the tokenizer carries a ``response_template`` (as TRL
does), else with the parser of the template's family, told apart by what the template writes:

    hermes       <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>
                 (Qwen 2.5 / 3, Hermes, SmolLM3, ppo-rlhf's ChatML template)
    llama3-json  {"name": "add", "parameters": {"a": 1}}, the whole turn, after an optional
                 <|python_tag|> (Llama 3.1 / 3.2 / 3.3)
    gpt-oss      <|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 1}<|call|>

A template of none of these is refused at start, naming it; ``--tool-parser NAME`` picks one of
them, ``--tool-parser module:function`` takes a parser of one's own.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable

from ppo_rlhf.config import ConfigError


@dataclass
class ToolCall:
    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # the call could not be read: what the model is told
    text: str = ""  # the call as the model wrote it

    def as_message_call(self) -> dict:
        """The call as a chat message's ``tool_calls`` entry (the OpenAI / transformers shape TRL gives
        reward functions: ``{"type": "function", "function": {"name", "arguments"}}``)."""
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


def parse_llama3_json(text: str) -> list[ToolCall]:
    """Llama 3.x's JSON calls: the turn (after an optional ``<|python_tag|>``) is one JSON object
    ``{"name": ..., "parameters": {...}}``, or several separated by ``;`` or new lines.  A turn
    that does not start with ``{`` is an answer; one that does but is not such JSON is a call the
    model got wrong."""
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    body = body.removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return [read_call(body, text)] if tagged and body else []
    calls, decoder, position = [], json.JSONDecoder(), 0
    while position < len(body):
        try:
            _, end = decoder.raw_decode(body, position)
        except json.JSONDecodeError:
            calls.append(read_call(body[position:], body[position:]))
            break
        calls.append(read_call(body[position:end], body[position:end]))
        position = end
        while position < len(body) and body[position] in " \t\r\n;":
            position += 1
        if position < len(body) and body[position] != "{":
            break  # text after the calls: the model's words, not another call
    return calls


GPT_OSS_CALL = re.compile(r"to=functions\.([^\s<]+)[^<]*(?:<\|channel\|>[^<]*)?(?:<\|constrain\|>[^<]*)?"
                          r"<\|message\|>(.*?)(?=<\|call\|>|<\|end\|>|<\|start\|>|$)", re.DOTALL)


def parse_gpt_oss(text: str) -> list[ToolCall]:
    """GPT-OSS's harmony calls: a message addressed ``to=functions.NAME`` whose body is the
    arguments' JSON, ended by ``<|call|>`` (the turn's stop token, left out of ``text``)."""
    calls = []
    for match in GPT_OSS_CALL.finditer(text):
        name, body = match.group(1), match.group(2).strip()
        try:
            arguments = json.loads(body) if body else {}
        except json.JSONDecodeError as error:
            calls.append(ToolCall(name, error=f"the arguments of a call to {name} are not valid JSON ({error.msg} at "
                                              f"character {error.pos}): {body[:200]!r}", text=match.group(0)))
            continue
        if not isinstance(arguments, dict):
            calls.append(ToolCall(name, error=f"the arguments of a call to {name} must be a JSON object, got "
                                              f"{body[:200]!r}", text=match.group(0)))
            continue
        calls.append(ToolCall(name, arguments, text=match.group(0)))
    return calls


def read_call(body: str, text: str) -> ToolCall:
    """One call's JSON ``{"name": ..., "arguments": {...}}`` (Llama's ``parameters`` too; arguments
    may also come as a JSON string)."""
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


# --------------------------------------------------------------- what a call and a turn mean
def schema_types(schema) -> tuple[str, ...]:
    """The JSON types a parameter's schema admits: its ``type`` (one or a list), those of its
    ``anyOf`` / ``oneOf`` choices, and null for a ``nullable`` one (how get_json_schema marks an
    Optional)."""
    if not isinstance(schema, dict):
        return ()
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else [t for t in declared or [] if isinstance(t, str)]
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or []:
            types.extend(schema_types(choice))
    if schema.get("nullable") and "null" not in types:
        types.append("null")
    return tuple(types)


def cast_text(raw: str, types: tuple[str, ...]):
    """``raw`` as the first of ``types`` it reads as: "7" is 7 for an integer (and "3.0" is 3), 0.5
    for a number, true / 1 / false / 0 a boolean, "null" None, JSON of the right kind an object or
    a list; otherwise the text as written (a string parameter keeps "7")."""
    for kind in types:
        try:
            if kind == "integer":
                try:
                    return int(raw)
                except ValueError:
                    number = float(raw)
                    if number.is_integer():
                        return int(number)
            elif kind == "number":
                number = float(raw)
                if math.isfinite(number):
                    return int(number) if number.is_integer() and "." not in raw else number
            elif kind == "boolean" and raw.strip().lower() in ("true", "1", "false", "0"):
                return raw.strip().lower() in ("true", "1")
            elif kind == "null" and raw.strip() in ("null", "None"):
                return None
            elif kind in ("object", "array"):
                decoded = json.loads(raw)
                if isinstance(decoded, dict if kind == "object" else list):
                    return decoded
        except ValueError:
            continue
    return raw


def typed_call(call: ToolCall, schemas: list[dict]) -> ToolCall:
    """``call`` with each argument the model wrote as text cast to the type its tool's JSON schema
    gives the parameter, as TRL's GRPOTrainer reads calls (transformers' ``parse_response(tools=)``):
    ``{"step": "3"}`` for ``step: int`` is ``{"step": 3}``, for the tool and for the reward
    functions that read the call.  A call that could not be read, of an unknown tool, or whose
    arguments already have their types, is returned as it is."""
    if call.error is not None:
        return call
    schema = next((s.get("function", s) for s in schemas if s.get("function", s).get("name") == call.name), None)
    properties = ((schema or {}).get("parameters") or {}).get("properties") or {}
    if not properties:
        return call
    arguments = dict(call.arguments)
    for key, value in arguments.items():
        types = schema_types(properties.get(key))
        if isinstance(value, str) and types:
            arguments[key] = cast_text(value, types)
    return ToolCall(call.name, arguments, text=call.text)


THINK_BLOCK = re.compile(r"^<think>\n?(?:(?P<reasoning>.*?\S.*?)\n?|\s*)</think>\s*", re.DOTALL)


def split_reasoning(content: str) -> tuple[str | None, str]:
    """(the think block's text, the rest) of a turn that opens with ``<think>...</think>`` (Qwen3's
    and DeepSeek-R1's reasoning), as TRL's response templates read it into ``reasoning_content``:
    an empty think block (Qwen3 with enable_thinking=False) is dropped, with no reasoning."""
    match = THINK_BLOCK.match(content)
    if match is None:
        return None, content
    return match.group("reasoning"), content[match.end():]


def assistant_message(content: str, calls: list[ToolCall]) -> dict:
    """A model turn as TRL's completions hold it: its words, the think block apart as
    ``reasoning_content``, and the ``tool_calls`` it made that could be read."""
    reasoning, content = split_reasoning(content)
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    read = [call.as_message_call() for call in calls if call.error is None]
    if read:
        message["tool_calls"] = read
    return message


class ResponseTemplateParser:
    """transformers' ``tokenizer.parse_response`` with the tokenizer's own ``response_template``
    (TRL's parser, where the tokenizer carries one): the template says where the calls are."""

    name = "the tokenizer's response_template (transformers' parse_response)"

    def __init__(self, tokenizer, tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools

    def read(self, text: str, prefix: str = "") -> tuple[str, list[ToolCall]]:
        """(the turn's content without its calls, the calls)."""
        try:
            parsed = self.tokenizer.parse_response(text, prefix=prefix, tools=self.tools)
        except Exception as error:  # noqa: BLE001 -- a turn the template cannot parse: the model is told
            return text, [ToolCall(None, error=f"the tool call could not be read ({type(error).__name__}: {error})",
                                   text=text)]
        calls = []
        for call in parsed.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else {}
            arguments = function.get("arguments", {})
            if isinstance(arguments, str):
                calls.append(read_call(json.dumps({"name": function.get("name"), "arguments": arguments}), ""))
            elif not isinstance(function.get("name"), str) or not isinstance(arguments, dict):
                calls.append(ToolCall(None, error=f"a tool call needs a name and arguments, got {call!r:.200}"))
            else:
                calls.append(ToolCall(function["name"], arguments))
        content = str(parsed.get("content") or "")
        if parsed.get("reasoning_content"):  # the think block back in front: assistant_message splits all alike
            content = f"<think>\n{parsed['reasoning_content']}\n</think>\n\n{content}"
        return content, calls

    def __call__(self, text: str, prefix: str = "") -> list[ToolCall]:
        return self.read(text, prefix)[1]


PARSERS: dict[str, ToolCallParser] = {"hermes": parse_hermes, "llama3-json": parse_llama3_json,
                                      "gpt-oss": parse_gpt_oss}
TOOL_PARSERS = ("auto", *PARSERS)

# What a chat template writes that tells its family's tool calls (checked in this order).
TEMPLATE_FAMILIES = (("gpt-oss", ("<|call|>", "<|channel|>")), ("hermes", ("<tool_call>",)),
                     ("llama3-json", ("<|python_tag|>",)), ("llama3-json", ('"parameters"', "<|eot_id|>")))


def load_parser(name) -> ToolCallParser | str:
    """A parser by name (``auto`` stays a name until the tokenizer is known), ``module:function``, or
    a function given in Python; ConfigError for none of these."""
    from ppo_rlhf.user_code import load_function

    if not isinstance(name, str):
        return name
    if name == "auto" or name in PARSERS:
        return name if name == "auto" else PARSERS[name]
    if ":" not in name:
        raise ConfigError(f"invalid value for 'tool_parser': {name!r}; allowed: {', '.join(TOOL_PARSERS)}, or "
                          f"module:function for a parser of your own (text -> list of ToolCall)")
    return load_function(name, "tool parser")


def template_family(template: str | None) -> str | None:
    """The tool-call family a chat template writes, by its text; None when none is recognised."""
    for family, markers in TEMPLATE_FAMILIES:
        if template and all(marker in template for marker in markers):
            return family
    return None


def check_parser_fits(parser, template: str | None, where: str) -> None:
    """ConfigError at start when ``parser`` is one of ppo-rlhf's (``--tool-parser NAME``) and the
    template teaches another family's calls (as ``--tool-parser auto`` tells them apart): every
    call the model learns to write would be read as a plain answer.  A parser of one's own, or a
    template of no family known here, is taken as given."""
    name = next((name for name, known in PARSERS.items() if known is parser), None)
    family = template_family(template)
    if name is None or family is None or family == name:
        return
    raise ConfigError(f"invalid value for 'tool_parser': {name!r}; {where} teaches {family} tool calls "
                      f"({FAMILY_CALLS[family]}), which the {name} parser does not read ({FAMILY_CALLS[name]}), so "
                      f"every call the model writes would be taken for its answer; give --tool-parser {family}, or "
                      f"auto (the default: the template's own family)")


# How each family writes a call, for messages.
FAMILY_CALLS = {"hermes": '<tool_call>{"name": ..., "arguments": ...}</tool_call>',
                "llama3-json": '{"name": ..., "parameters": ...} as the whole turn',
                "gpt-oss": "to=functions.NAME ... <|call|>"}


def resolve_parser(parser, tokenizer, template: str | None, tools: list[dict], where: str
                   ) -> tuple[ToolCallParser, str]:
    """(the parser, its name for the run's plan) for ``--tool-parser auto`` or a parser already
    chosen; ConfigError naming the template when auto finds none that fits, or when a parser named
    (--tool-parser NAME) reads another family's calls than the template teaches."""
    if parser != "auto":
        check_parser_fits(parser, template, where)
        return parser, getattr(parser, "__name__", type(parser).__name__)
    if getattr(tokenizer, "response_template", None) is not None:
        resolved = ResponseTemplateParser(tokenizer, tools or None)
        return resolved, resolved.name
    family = template_family(template)
    if family is None:
        raise ConfigError(f"{where}: --tool-parser auto cannot tell how this chat template writes tool calls (it "
                          f"writes none of <tool_call>, Llama 3's JSON calls or GPT-OSS's to=functions.); give "
                          f"--tool-parser {' / '.join(PARSERS)} or module:function, or a template that writes tool "
                          f"calls with --chat-template-file")
    return PARSERS[family], family
