"""The data shapes people bring, turned into the rows each stage reads (docs/design.md, "Data").

Each stage reads one kind of row, with field names set by flags:

    sft      {prompt, completion}
    rm       {prompt, chosen, rejected}   (pairwise)
    ppo      {prompt, ...}                (every other field reaches the reward)

and also takes the public shapes of the same data, converted here row by row:

    conversational     {messages: [...]} for sft (the last message, the assistant's, is the
                       completion); chosen / rejected as lists of messages for rm; a prompt given as
                       messages stays messages (--chat-template formats it)
    implicit prompt    {chosen, rejected} without a prompt (Anthropic's hh-rlhf): the prompt is their
                       longest common prefix, cut back to the end of its last assistant turn marker
                       ("\\n\\nAssistant:"), ppo-rlhf's rule; without a marker, TRL's extract_prompt's
                       (the first differing character, one back where a space precedes it)
    Alpaca             {instruction, input, output} for sft, {instruction, input} as ppo prompts: the
                       Alpaca prompt template, or a user message under --chat-template

A file holds one shape: a row of another shape is an error naming its file and line.
"""

from __future__ import annotations

from typing import Callable

from ppo_rlhf.data import DataError

# The ends of an assistant turn's opening, in the text formats people save conversations in.
ASSISTANT_MARKERS = ("\n\nAssistant:", "\nAssistant:", "<|im_start|>assistant\n", "<|assistant|>\n",
                     "<start_of_turn>model\n", "[/INST]", "### Response:\n")
ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
          "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
                     "{instruction}\n\n### Input:\n{input}\n\n### Response:\n")

Converter = Callable[[list[dict]], list[dict]]


def _is_messages(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def _where(row: dict) -> str:
    return row.get("_source", "a row")


def _one_shape(rows: list[dict], shape_of: Callable[[dict], str | None]) -> str | None:
    """The shape every row has (None: the first row has none, and the stage's field check will
    name what it lacks); DataError naming the first row of another shape."""
    first = shape_of(rows[0])
    if first is None:
        return None
    for row in rows:
        shape = shape_of(row)
        if shape != first:
            what = f"a {shape} row" if shape else f"a row of none of the shapes (fields {sorted(k for k in row if k != '_source')})"
            raise DataError(f"{_where(row)}: {what} in a file of {first} rows ({_where(rows[0])}); a file holds one "
                            f"shape")
    return first


def _with(row: dict, **fields) -> dict:
    return {**row, **fields}


# ---------------------------------------------------------------- Alpaca
def alpaca_prompt(row: dict, chat_template: bool):
    """The prompt of an Alpaca row: its template as text, or the instruction (and input) as one
    user message for a chat template to format."""
    instruction, extra = str(row["instruction"]), str(row.get("input") or "")
    if chat_template:
        return [{"role": "user", "content": instruction + (f"\n\n{extra}" if extra else "")}]
    return (ALPACA_WITH_INPUT if extra else ALPACA).format(instruction=instruction, input=extra)


# ---------------------------------------------------------------- sft
def completion_rows(prompt_field: str, completion_field: str, chat_template: bool) -> Converter:
    """sft: {prompt, completion} as they are; {messages} and Alpaca rows converted."""

    def shape_of(row: dict) -> str | None:
        if prompt_field in row and completion_field in row:
            return "prompt-completion"
        if "messages" in row:
            return "conversational"
        if "instruction" in row and "output" in row:
            return "Alpaca"
        return None

    def convert(rows: list[dict]) -> list[dict]:
        shape = _one_shape(rows, shape_of)
        if shape == "conversational":
            return [_from_messages(row, prompt_field, completion_field) for row in rows]
        if shape == "Alpaca":
            return [_with(row, **{prompt_field: alpaca_prompt(row, chat_template), completion_field: str(row["output"])})
                    for row in rows]
        return rows

    return convert


def _from_messages(row: dict, prompt_field: str, completion_field: str) -> dict:
    messages = row["messages"]
    if not _is_messages(messages) or len(messages) < 2 or messages[-1].get("role") != "assistant":
        raise DataError(f"{_where(row)}: 'messages' must be a list of {{role, content}} messages ending with the "
                        f"assistant's (the completion to learn), after at least one other")
    return _with(row, **{prompt_field: messages[:-1], completion_field: str(messages[-1]["content"])})


# ---------------------------------------------------------------- rm (pairwise)
def preference_rows(prompt_field: str, chosen_field: str, rejected_field: str) -> Converter:
    """Pairwise rm: {prompt, chosen, rejected} with text or message responses; {chosen, rejected}
    with an implicit prompt, as text or as conversations."""

    def shape_of(row: dict) -> str | None:
        if chosen_field not in row or rejected_field not in row:
            return None
        explicit = "explicit prompt" if prompt_field in row else "implicit prompt"
        return f"{explicit}, {'conversational' if _is_messages(row[chosen_field]) else 'text'}"

    def convert(rows: list[dict]) -> list[dict]:
        shape = _one_shape(rows, shape_of)
        if shape in (None, "explicit prompt, text"):
            return rows
        converted = []
        for row in rows:
            chosen, rejected = row[chosen_field], row[rejected_field]
            if shape.startswith("explicit"):  # responses as messages after a given prompt
                prompt, chosen, rejected = row[prompt_field], _reply(row, chosen), _reply(row, rejected)
            elif shape.endswith("conversational"):
                prompt, chosen, rejected = _split_conversations(row, chosen, rejected)
            else:
                prompt, chosen, rejected = _split_texts(row, chosen, rejected)
            converted.append(_with(row, **{prompt_field: prompt, chosen_field: chosen, rejected_field: rejected}))
        return converted

    return convert


def _reply(row: dict, messages) -> str:
    """The content of a response given as messages: exactly one assistant message."""
    if not _is_messages(messages) or len(messages) != 1 or messages[0].get("role") != "assistant":
        raise DataError(f"{_where(row)}: a response given as messages must be one assistant message "
                        f"[{{'role': 'assistant', 'content': ...}}], got {str(messages)[:80]}")
    return str(messages[0]["content"])


def _split_conversations(row: dict, chosen: list, rejected) -> tuple[list, str, str]:
    """(prompt messages, chosen reply, rejected reply) of two conversations that differ only in
    their last turn."""
    if not _is_messages(rejected):
        raise DataError(f"{_where(row)}: chosen is a conversation but rejected is not")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise DataError(f"{_where(row)}: chosen and rejected share no prefix, so there is no prompt to find; give a "
                        f"'prompt' field")
    return chosen[:shared], _reply(row, chosen[shared:]), _reply(row, rejected[shared:])


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


def _split_texts(row: dict, chosen, rejected) -> tuple[str, str, str]:
    if not isinstance(chosen, str) or not isinstance(rejected, str):
        raise DataError(f"{_where(row)}: chosen and rejected must both be text (or both conversations)")
    prompt = implicit_prompt(chosen, rejected)
    if not prompt:
        raise DataError(f"{_where(row)}: chosen and rejected share no prefix, so there is no prompt to find; give a "
                        f"'prompt' field, or pairs that continue one conversation (as Anthropic's hh-rlhf)")
    return prompt, chosen[len(prompt):], rejected[len(prompt):]


# ---------------------------------------------------------------- ppo / eval prompts
def prompt_rows(prompt_field: str, chat_template: bool) -> Converter:
    """ppo / eval prompts: {prompt} as it is; {messages} (a final assistant message dropped: the
    policy writes that one) and Alpaca {instruction, input} converted."""

    def shape_of(row: dict) -> str | None:
        if prompt_field in row:
            return "prompt"
        if "messages" in row:
            return "conversational"
        if "instruction" in row:
            return "Alpaca"
        return None

    def convert(rows: list[dict]) -> list[dict]:
        shape = _one_shape(rows, shape_of)
        if shape == "conversational":
            converted = []
            for row in rows:
                messages = row["messages"]
                if _is_messages(messages) and messages[-1].get("role") == "assistant":
                    messages = messages[:-1]
                if not _is_messages(messages):
                    raise DataError(f"{_where(row)}: 'messages' must hold {{role, content}} messages before the "
                                    f"assistant's reply")
                converted.append(_with(row, **{prompt_field: messages}))
            return converted
        if shape == "Alpaca":
            return [_with(row, **{prompt_field: alpaca_prompt(row, chat_template)}) for row in rows]
        return rows

    return convert
