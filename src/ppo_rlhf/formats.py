"""The data shapes people bring, turned into the rows each stage reads (docs/design.md, "Data").

Each stage reads one kind of row, with field names set by flags:

    sft      {prompt, completion}
    rm       {prompt, chosen, rejected}   (pairwise)
    ppo      {prompt, ...}                (every other field reaches the reward)

and also takes the public shapes of the same data, converted here row by row:

    conversational     {messages: [...]} for sft: one row a conversation, rendered whole by the chat
                       template, every assistant message after the first message trained (the
                       user's and the tools' messages are context), an assistant message's
                       ``tool_calls`` (TRL's and transformers' format, content empty or absent)
                       rendered as the template writes a call, and a ``tools`` column listed by the
                       template, as TRL's SFTTrainer does; {prompt, completion} as lists of messages
                       alike, the completion's assistant messages trained; chosen / rejected as
                       lists of messages for rm; a prompt given as messages stays messages
                       (--chat-template formats it)
    implicit prompt    {chosen, rejected} without a prompt (Anthropic's hh-rlhf): the prompt is their
                       longest common prefix, cut back to the end of its last assistant turn marker
                       ("\\n\\nAssistant:"), ppo-rlhf's rule; without a marker, TRL's extract_prompt's
                       (the first differing character, one back where a space precedes it)
    Alpaca             {instruction, input, output} for sft, {instruction, input} as ppo prompts: the
                       Alpaca prompt template, or a user message under --chat-template

A file holds one shape, which its first row decides: a row of another shape is an error naming
its file and line, and a row of none names the field it lacks for the file's shape.  Each shape
checks the fields it reads before converting a row (roles of chat messages, empty contents, null
or mistyped values), so a malformed field is named as the file has it, not as the converted row
would have held it; the stage then checks its own fields.  A first row of no shape that has a
field of one ("nearly Alpaca": input and output, no instruction) is named for what it lacks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from ppo_rlhf.data import DataError, FieldCheck, chat_messages, row_complaint, text

# The ends of an assistant turn's opening, in the text formats people save conversations in.
ASSISTANT_MARKERS = ("\n\nAssistant:", "\nAssistant:", "<|im_start|>assistant\n", "<|assistant|>\n",
                     "<start_of_turn>model\n", "[/INST]", "### Response:\n")
ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
          "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
                     "{instruction}\n\n### Input:\n{input}\n\n### Response:\n")

Converter = Callable[[list[dict]], list[dict]]


def _where(row: dict) -> str:
    return row.get("_source", "a row")


def _a(name: str) -> str:
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _with(row: dict, **fields) -> dict:
    return {**row, **fields}


# ---------------------------------------------------------------- the checks of the fields a shape reads
def instruction_text(value) -> str | None:
    """An Alpaca instruction: text that says something."""
    complaint = text(value)
    if complaint is None and not value.strip():
        return "is empty: an Alpaca row's instruction is its prompt"
    return complaint


def reply_message(value) -> str | None:
    """A reply given as messages: exactly one assistant message (its content may be empty: the
    row is then dropped with a count, as an empty text reply is)."""
    complaint = chat_messages(value, last_may_be_empty=True)
    if complaint is None and (len(value) != 1 or value[0]["role"] != "assistant"):
        complaint = f"must be one assistant message [{{'role': 'assistant', 'content': ...}}], got {str(value)[:80]}"
    return complaint


def conversation_with_reply(value) -> str | None:
    """A conversation that ends with the assistant's reply (which may be empty, as a reply may)."""
    complaint = chat_messages(value, last_may_be_empty=True)
    if complaint is None and value[-1]["role"] != "assistant":
        complaint = f"must end with the assistant's reply, but ends with a {value[-1]['role']!r} message"
    return complaint


def conversation_to_learn(value) -> str | None:
    """sft {messages}: at least one message, then the assistant's reply, the completion to learn;
    assistant messages may carry tool calls."""
    complaint = chat_messages(value, last_may_be_empty=True, tool_calls=True)
    if complaint is None and value[-1]["role"] != "assistant":
        complaint = f"must end with the assistant's reply, but ends with a {value[-1]['role']!r} message"
    if complaint is None and len(value) < 2:
        complaint = "must end with the assistant's reply (the completion to learn), after at least one other message"
    return complaint


def prompt_messages(value) -> str | None:
    """sft {prompt, completion} of messages: the prompt, text or messages before the reply."""
    if isinstance(value, str):
        return None
    complaint = chat_messages(value, tool_calls=True)
    if complaint is None and value[-1]["role"] == "assistant":
        complaint = "ends with an assistant message; the completion holds the replies to learn"
    return complaint


def completion_messages(value) -> str | None:
    """sft {prompt, completion} of messages: the completion, messages that begin with the
    assistant's (a tool's answers and the assistant's next turns may follow, as in TRL)."""
    complaint = chat_messages(value, last_may_be_empty=True, tool_calls=True)
    if complaint is None and value[0]["role"] != "assistant":
        complaint = f"must begin with the assistant's reply, but begins with a {value[0]['role']!r} message"
    return complaint


@dataclass(frozen=True)
class Conversation:
    """An sft row that is a whole conversation (trainers/sft_conversations.py): its messages as the
    chat template takes them, the first one whose assistant messages are trained (those before it
    are the prompt), and the tools the template lists."""

    messages: list
    trained_from: int
    tools: list | None = None


CONVERSATION = "_conversation"  # the key of a converted sft row's Conversation


def as_template_message(message: dict) -> dict:
    """A message as chat templates take it: fields left empty (a Parquet file's None for a field
    another row has) dropped, a call's absent content as "", and a call's arguments given as JSON
    text as the object they hold (templates write an object as JSON, and text as it is)."""
    message = {key: value for key, value in message.items() if value is not None}
    if "tool_calls" in message:
        message.setdefault("content", "")
        calls = []
        for call in message["tool_calls"]:
            function = dict(call["function"])
            if isinstance(function.get("arguments"), str):
                function["arguments"] = json.loads(function["arguments"])
            calls.append({**call, "type": call.get("type", "function"), "function": function})
        message["tool_calls"] = calls
    return message


def conversation_row(row: dict, prompt, completion: list) -> dict:
    """An sft row of a conversation: ``prompt`` (text, a user message, or messages) then
    ``completion``, the messages whose assistant turns are trained."""
    before = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    messages = [as_template_message(message) for message in (*before, *completion)]
    return _with(row, **{CONVERSATION: Conversation(messages, len(before), row.get("tools") or None)})


def conversation_to_answer(value) -> str | None:
    """ppo {messages}: a conversation the policy answers (a final assistant message is dropped, so
    it may be empty; something must come before it)."""
    ends_with_reply = isinstance(value, list) and bool(value) and isinstance(value[-1], dict) \
        and value[-1].get("role") == "assistant"
    complaint = chat_messages(value, last_may_be_empty=ends_with_reply)
    if complaint is None and ends_with_reply and len(value) == 1:
        complaint = "holds only the assistant's reply: there is no prompt before it to answer"
    return complaint


# ---------------------------------------------------------------- one shape of rows, and a file of them
@dataclass(frozen=True)
class Shape:
    """One public shape of a stage's rows: the fields that make a row of it (present, if null), the
    check of each field it reads (``checks``; ``optional``: fields it reads if there), and the
    conversion into the stage's row (None: the stage's own row already).  ``holds`` tells it from
    a shape of the same fields by a value's type (a reply as text or as messages)."""

    name: str
    fields: tuple[str, ...]
    checks: dict[str, FieldCheck] = field(default_factory=dict)
    optional: dict[str, FieldCheck] = field(default_factory=dict)
    convert: Callable[[dict], dict] | None = None
    holds: Callable[[dict], bool] = lambda row: True

    def matches(self, row: dict) -> bool:
        return all(name in row for name in self.fields) and self.holds(row)

    def missing(self, row: dict) -> list[str]:
        return [name for name in self.fields if name not in row]

    def complaint(self, row: dict) -> str | None:
        """What is wrong with a row of this shape, field by field (None: nothing)."""
        return row_complaint(row, self.checks) or row_complaint(
            row, {name: check for name, check in self.optional.items() if row.get(name) is not None})


def rows_of_one_shape(shapes: list[Shape]) -> Converter:
    """A converter of a file's rows: the shape of the first row (the first of ``shapes`` it
    matches) is the file's; every row is held to it, checked and converted."""

    def shape_of(row: dict) -> Shape | None:
        return next((shape for shape in shapes if shape.matches(row)), None)

    def convert(rows: list[dict]) -> list[dict]:
        first = shape_of(rows[0])
        if first is None:
            refuse_nearly(rows[0], shapes)
            return rows  # a row of no shape: the stage's own check names the fields it lacks
        converted = []
        for row in rows:
            shape = shape_of(row)
            if shape is None:
                lacking = first.missing(row) or list(first.fields)
                fields = ", ".join(sorted(k for k in row if k != "_source")) or "none"
                raise DataError(f"{_where(row)}: missing field '{lacking[0]}' (the row has: {fields}); the file's rows "
                                f"are {first.name} rows, as {_where(rows[0])} shows")
            if shape is not first:
                raise DataError(f"{_where(row)}: {_a(shape.name)} row in a file of {first.name} rows "
                                f"({_where(rows[0])}); a file holds one shape")
            complaint = shape.complaint(row)
            if complaint:
                raise DataError(f"{_where(row)}: {complaint}")
            converted.append(shape.convert(row) if shape.convert else row)
        return converted if first.convert else rows

    return convert


def refuse_nearly(row: dict, shapes: list[Shape]) -> None:
    """DataError for a row that has a field of a shape but not all it needs (Alpaca's input and
    output without an instruction), naming what it lacks for the shape it comes closest to."""
    near = [shape for shape in shapes if any(name in row for name in (*shape.fields, *shape.optional))]
    if not near:
        return
    closest = min(near, key=lambda shape: len(shape.missing(row)))
    fields = ", ".join(sorted(k for k in row if k != "_source")) or "none"
    raise DataError(f"{_where(row)}: missing field '{closest.missing(row)[0]}' for {_a(closest.name)} row, which needs "
                    f"{', '.join(closest.fields)} (the row has: {fields})")


# ---------------------------------------------------------------- Alpaca
def alpaca_prompt(row: dict, chat_template: bool):
    """The prompt of an Alpaca row: its template as text, or the instruction (and input) as one
    user message for a chat template to format."""
    instruction, extra = row["instruction"], row.get("input") or ""
    if chat_template:
        return [{"role": "user", "content": instruction + (f"\n\n{extra}" if extra else "")}]
    return (ALPACA_WITH_INPUT if extra else ALPACA).format(instruction=instruction, input=extra)


ALPACA_INPUT = {"input": text}  # may be absent or null: an instruction without input


# ---------------------------------------------------------------- sft
def completion_rows(prompt_field: str, completion_field: str, chat_template: bool) -> Converter:
    """sft: {prompt, completion} as they are; {messages}, {prompt, completion} of messages and
    Alpaca rows converted: a conversation stays one row, which trains all its assistant turns at
    once (one row per turn repeated the conversation before each turn: about turns x its length)."""

    def of_messages(row: dict) -> bool:  # a completion of chat messages (a list of text is refused as text)
        value = row.get(completion_field)
        return isinstance(value, list) and bool(value) and all(isinstance(item, dict) for item in value)

    return rows_of_one_shape([
        Shape("prompt-completion", (prompt_field, completion_field), holds=lambda row: not of_messages(row)),
        Shape("prompt-completion, conversational", (prompt_field, completion_field),
              {prompt_field: prompt_messages, completion_field: completion_messages},
              convert=lambda row: conversation_row(row, row[prompt_field], row[completion_field]), holds=of_messages),
        Shape("conversational", ("messages",), {"messages": conversation_to_learn},
              convert=lambda row: conversation_row(row, row["messages"][:1], row["messages"][1:])),
        Shape("Alpaca", ("instruction", "output"), {"instruction": instruction_text, "output": text}, ALPACA_INPUT,
              convert=lambda row: _with(row, **{prompt_field: alpaca_prompt(row, chat_template),
                                                completion_field: row["output"]})),
    ])


# ---------------------------------------------------------------- rm (pairwise)
def preference_rows(prompt_field: str, chosen_field: str, rejected_field: str) -> Converter:
    """Pairwise rm: {prompt, chosen, rejected} with text or message responses; {chosen, rejected}
    with an implicit prompt, as text or as conversations."""

    def as_text(row: dict) -> bool:
        return not isinstance(row.get(chosen_field), list)

    def as_messages(row: dict) -> bool:
        return isinstance(row.get(chosen_field), list)

    def replies(row: dict) -> dict:  # responses as messages after a given prompt
        return _with(row, **{chosen_field: row[chosen_field][0]["content"],
                             rejected_field: row[rejected_field][0]["content"]})

    def split_conversations(row: dict) -> dict:
        prompt, chosen, rejected = _split_conversations(row, chosen_field, rejected_field)
        return _with(row, **{prompt_field: prompt, chosen_field: chosen, rejected_field: rejected})

    def split_texts(row: dict) -> dict:
        prompt, chosen, rejected = _split_texts(row, row[chosen_field], row[rejected_field])
        return _with(row, **{prompt_field: prompt, chosen_field: chosen, rejected_field: rejected})

    pair = (chosen_field, rejected_field)
    return rows_of_one_shape([
        Shape("explicit prompt, text", (prompt_field, *pair), holds=as_text),
        Shape("explicit prompt, conversational", (prompt_field, *pair), dict.fromkeys(pair, reply_message),
              convert=replies, holds=as_messages),
        Shape("implicit prompt, text", pair, dict.fromkeys(pair, text), convert=split_texts, holds=as_text),
        Shape("implicit prompt, conversational", pair, dict.fromkeys(pair, conversation_with_reply),
              convert=split_conversations, holds=as_messages),
    ])


def _split_conversations(row: dict, chosen_field: str, rejected_field: str) -> tuple[list, str, str]:
    """(prompt messages, chosen reply, rejected reply) of two conversations that differ only in
    their last turn."""
    chosen, rejected = row[chosen_field], row[rejected_field]
    # The prompt stops before each conversation's last message, its reply: two equal conversations
    # are a pair of equal replies (the stage drops it with a count), not a prompt without replies.
    shared, most = 0, min(len(chosen), len(rejected)) - 1
    while shared < most and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise DataError(f"{_where(row)}: chosen and rejected share no prefix, so there is no prompt to find; give a "
                        f"'prompt' field")
    for name, conversation in ((chosen_field, chosen), (rejected_field, rejected)):
        if len(conversation) - shared != 1:
            after = len(conversation) - shared
            raise DataError(f"{_where(row)}: field '{name}' goes on for {after} messages after the {shared} the two "
                            f"conversations share; after the prompt a response given as messages must be one "
                            f"assistant message")
    return chosen[:shared], chosen[shared]["content"], rejected[shared]["content"]


def implicit_prompt(chosen: str, rejected: str) -> str:
    """The prompt of two texts that continue it differently: their longest common prefix, cut back
    to the end of its last assistant turn marker; without a marker, cut back to before the space
    the two replies may share ("The sky is| blue" / "The sky is| green").  "" if none is shared.

    The marker is ppo-rlhf's rule (docs/design.md, "Data"): TRL's ``extract_prompt`` always cuts at
    the first character where the two differ (one back where a space precedes it), which is this
    function's rule without a marker, and on hh-rlhf moves replies' shared first words ("I'm
    sorry,") into the prompt."""
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    prefix = chosen[:shared]
    ends = [prefix.rfind(marker) + len(marker) for marker in ASSISTANT_MARKERS if marker in prefix]
    if ends:
        return prefix[:max(ends)]
    return prefix[:-1] if prefix.endswith(" ") and shared < min(len(chosen), len(rejected)) else prefix


def _split_texts(row: dict, chosen: str, rejected: str) -> tuple[str, str, str]:
    prompt = implicit_prompt(chosen, rejected)
    if not prompt:
        raise DataError(f"{_where(row)}: chosen and rejected share no prefix, so there is no prompt to find; give a "
                        f"'prompt' field, or pairs that continue one conversation (as Anthropic's hh-rlhf)")
    return prompt, chosen[len(prompt):], rejected[len(prompt):]


# ---------------------------------------------------------------- ppo / eval prompts
def prompt_rows(prompt_field: str, chat_template: bool) -> Converter:
    """ppo / eval prompts: {prompt} as it is; {messages} (a final assistant message dropped: the
    policy writes that one) and Alpaca {instruction, input} converted."""

    def before_the_reply(row: dict) -> dict:
        messages = row["messages"]
        return _with(row, **{prompt_field: messages[:-1] if messages[-1]["role"] == "assistant" else messages})

    return rows_of_one_shape([
        Shape("prompt", (prompt_field,)),
        Shape("conversational", ("messages",), {"messages": conversation_to_answer}, convert=before_the_reply),
        Shape("Alpaca", ("instruction",), {"instruction": instruction_text}, ALPACA_INPUT,
              convert=lambda row: _with(row, **{prompt_field: alpaca_prompt(row, chat_template)})),
    ])
