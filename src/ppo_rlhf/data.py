"""Reading data rows from JSONL, Parquet or a ``datasets`` folder, with errors that say where.

A row is a dict.  A malformed row names the file and line; a missing field names the field,
the file and the fields the row does have; a field holding the wrong kind of value (a number
where text is expected, chat messages without ``--chat-template``) names the field, the row
and what is allowed.  Each kind of value has one checker here (:func:`text`,
:func:`text_or_messages`, :func:`class_index`), which returns a complaint or None.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ppo_rlhf.hub import hub_dataset_rows, looks_like_hub_id

# A field checker: the complaint about a value ("must be a string, got int 5"), or None if it is fine.
FieldCheck = Callable[[Any], "str | None"]


class DataError(ValueError):
    """Data that cannot be used; the message names the file (and line, for JSONL)."""


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def text(value: Any) -> str | None:
    """A string (a prompt without --chat-template, a completion, a response, a text)."""
    if isinstance(value, str):
        return None
    if _is_chat(value):
        return "holds chat messages: add --chat-template to format them with the tokenizer's chat template"
    return f"must be a string, got {_shown(value)}"


# The roles chat templates format; a message of another role is rendered by some templates as
# nothing at all, by others as an error, and would be trained on or not without a word.
ROLES = ("system", "user", "assistant", "tool")


def chat_messages(value: Any, last_may_be_empty: bool = False, tool_calls: bool = False) -> str | None:
    """A non-empty list of chat messages, each ``{role, content}`` with a role of ``ROLES`` and
    text content that is not empty.  ``last_may_be_empty``: the last message is a reply, which a
    stage may take empty (and drop the row with a count) rather than refuse.  ``tool_calls``: an
    assistant message may carry TRL's and transformers' ``tool_calls`` (:func:`tool_call_list`),
    and its content may then be empty or absent: the calls are what it says (sft's conversations,
    which the chat template renders whole)."""
    if not isinstance(value, list):
        return f"must be a list of chat messages {{role, content}}, got {_shown(value)}"
    if not value:
        return "is an empty list of chat messages; give at least one {role, content} message"
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"message {i} must be {{'role': string, 'content': string}}, got {_shown(message)}"
        if message["role"] not in ROLES:
            return f"message {i} has role {message['role']!r}; allowed roles: {', '.join(ROLES)}"
        calls = message.get("tool_calls")
        if tool_calls and calls is not None:
            complaint = tool_call_list(calls) if message["role"] == "assistant" else \
                "is only an assistant message's (the model's calls; a tool's answer is a 'tool' message)"
            if complaint:
                return f"message {i} (role {message['role']!r}) field 'tool_calls' {complaint}"
            if message.get("content") is None:  # TRL's and transformers': a call's content may be left out
                continue
        elif "content" not in message:
            return f"message {i} (role {message['role']!r}) has no 'content'"
        if not isinstance(message["content"], str):
            return f"message {i} (role {message['role']!r}) must have text content, got {_shown(message['content'])}"
        if not message["content"].strip() and not (last_may_be_empty and i == len(value) - 1) \
                and not (tool_calls and calls is not None):
            hint = (" (its tool_calls are read from an sft conversation, {messages} or a prompt and completion of "
                    "messages)" if calls is not None else "")
            return f"message {i} (role {message['role']!r}) has empty content{hint}"
    return None


def tool_call_list(value: Any) -> str | None:
    """An assistant message's ``tool_calls`` as TRL and transformers' chat templates take them:
    ``[{"type": "function", "function": {"name": ..., "arguments": {...}}}]``, the arguments an
    object or the JSON text of one (OpenAI's)."""
    shape = "[{'type': 'function', 'function': {'name': ..., 'arguments': {...}}}]"
    if not isinstance(value, list) or not value:
        return f"must be a non-empty list of calls {shape}, got {_shown(value)}"
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            return f"call {j} must be {{'type': 'function', 'function': {{'name': ..., 'arguments': {{...}}}}}}, " \
                   f"got {_shown(call)}"
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return f"call {j} ({function['name']}) has arguments that are text but not JSON: {_shown(arguments)}"
        if not isinstance(arguments, dict):
            return f"call {j} ({function['name']}) must have arguments that are an object, got {_shown(arguments)}"
    return None


def text_or_messages(value: Any) -> str | None:
    """A prompt under --chat-template: a string, or chat messages (:func:`chat_messages`) that end
    before the assistant's reply -- the reply is what the model writes (a completion, a response)."""
    if isinstance(value, str):
        return None
    if not isinstance(value, list):
        return f"must be a string or a list of chat messages {{role, content}}, got {_shown(value)}"
    complaint = chat_messages(value)
    if complaint is None and value[-1]["role"] == "assistant":
        return ("ends with an assistant message, but a prompt ends before the reply the model writes; drop that "
                "message from the prompt (a conversation with its reply: a {messages} row)")
    return complaint


def prompt_check(chat_template: bool) -> FieldCheck:
    """The checker of a prompt field: chat messages are allowed only with --chat-template."""
    return text_or_messages if chat_template else text


# TRL's prompt for a row an environment owns (reset() returns the task, appended to it).
ENVIRONMENT_PLACEHOLDER = [{"role": "user", "content": ""}]


def environment_prompt(value: Any) -> str | None:
    """A prompt an environment plays (episodes are chat): text or chat messages, the last of which may
    be empty -- the environment's reset() says the task (TRL's environments that own their data)."""
    if isinstance(value, str):
        return None
    complaint = chat_messages(value, last_may_be_empty=True)
    if complaint is None and value[-1]["role"] == "assistant":
        return text_or_messages(value)
    return complaint


def with_environment_placeholders(rows: list[dict], field: str) -> list[dict]:
    """Rows played with an environment: one without a prompt gets TRL's placeholder, an empty user
    message (a row that only routes among several environments: TRL's dict form)."""
    return [row if field in row or "messages" in row or "instruction" in row
            else {**row, field: [dict(message) for message in ENVIRONMENT_PLACEHOLDER]} for row in rows]


def class_index(num_labels: int) -> FieldCheck:
    """An integer class index in 0..num_labels-1 (1.0 is taken as 1; True, 1.5 and "1" are not)."""

    def check(value: Any) -> str | None:
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not integral:
            return f"must be an integer class index in 0..{num_labels - 1}, got {_shown(value)}"
        if not 0 <= value < num_labels:
            return f"holds label {int(value)}, outside 0..{num_labels - 1} (--num-labels {num_labels})"
        return None

    return check


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{path}:{line_number}: not UTF-8 text (byte 0x{raw[error.start]:02x} at column "
                                f"{error.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            if not rows and line.lstrip().startswith("["):
                raise DataError(f"{path}:{line_number}: the file holds a JSON array; write JSONL instead: "
                                f"one JSON object per line")
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{line_number}: not valid JSON ({error.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{line_number}: each line must be a JSON object, got {type(row).__name__}")
            row["_source"] = f"{path}:{line_number}"
            rows.append(row)
    return rows


def _read_folder(path: Path) -> list[dict]:
    if (path / "config.json").is_file() or (path / "adapter_config.json").is_file():
        raise DataError(f"{path} is a model folder, not data: give it as --model, and the data as a JSONL or "
                        f"Parquet file or a save_to_disk folder")
    from datasets import load_from_disk

    try:
        dataset = load_from_disk(str(path))
    except FileNotFoundError as error:
        raise DataError(f"{path} is not a dataset folder saved with save_to_disk ({error}); give a JSONL or "
                        f"Parquet file or such a folder") from None
    if hasattr(dataset, "keys"):  # a DatasetDict: take "train"
        if "train" not in dataset:
            raise DataError(f"{path} holds splits {list(dataset.keys())}; point to one split or add 'train'")
        dataset = dataset["train"]
    return [dict(r, _source=f"{path}[{i}]") for i, r in enumerate(dataset)]


def _read_parquet(path: Path) -> list[dict]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pyarrow.ArrowException, OSError) as error:
        raise DataError(f"{path}: cannot read it as Parquet ({error})") from None
    return [dict(r, _source=f"{path}[row {i}]") for i, r in enumerate(table.to_pylist())]


# --------------------------------------------------------------- data sets given in memory
IN_MEMORY = "<in-memory "  # how a config records a data set given as an object (it has no path)


def is_data_object(value: Any) -> bool:
    """A data set given in memory rather than named by a path: a ``datasets`` Dataset,
    IterableDataset or DatasetDict (or IterableDatasetDict), a dict of such splits, or a list of
    row dicts."""
    if value is None or isinstance(value, (str, Path)):
        return False
    if type(value).__module__.startswith("datasets"):
        return True
    if isinstance(value, dict):
        return bool(value) and all(type(split).__module__.startswith("datasets") for split in value.values())
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(row, dict) for row in value)


def is_streamed(value: Any) -> bool:
    """A data set read as a stream (an IterableDataset, or a dict of them): its rows come in order,
    and only as many as a run draws are read."""
    splits = list(value.values()) if isinstance(value, dict) else [value]
    return bool(splits) and all(type(split).__name__ == "IterableDataset" for split in splits)


def describe_data(value: Any) -> str:
    """How a config records a data set given in memory: its kind, size and columns."""
    if isinstance(value, dict):
        return f"{IN_MEMORY}{type(value).__name__}: splits {', '.join(map(str, value))}>"
    columns = getattr(value, "column_names", None) or (sorted(value[0]) if isinstance(value, (list, tuple)) else None)
    size = "streamed" if is_streamed(value) else f"{len(value)} rows"
    return f"{IN_MEMORY}{type(value).__name__}: {size}, columns {', '.join(columns or ['unknown'])}>"


def hold_data_objects(config: Any, fields: tuple[str, ...]) -> None:
    """Data sets given in memory for ``fields`` of ``config`` (``PPOConfig(prompts=dataset)``): each
    kept on the config as it is, and the field given its description, which config.yaml records
    (an object has no path to write down, and a resume is given it again)."""
    held = config.__dict__.setdefault("data_objects", {})
    for name in fields:
        value = getattr(config, name)
        if is_data_object(value):
            held[name] = value
            setattr(config, name, describe_data(value))


def data_source(config: Any, name: str) -> Any:
    """What ``config``'s field ``name`` reads: the data set object given in memory while the field
    still holds its description, else the field (a path or a data set's name)."""
    value, held = getattr(config, name), config.__dict__.get("data_objects", {}).get(name)
    return held if held is not None and value == describe_data(held) else value


def object_rows(data: Any, split: str, limit: int | None) -> list[dict]:
    """The rows of a data set given in memory, each with a ``_source`` naming it and its index:
    split ``split`` of a DatasetDict (or a dict of splits); of an IterableDataset, the first
    ``limit`` (TRL reads a stream in order, and as far as it trains)."""
    name = f"the {type(data).__name__} given"
    if isinstance(data, dict):  # DatasetDict and IterableDatasetDict are dicts of their splits
        if split not in data:
            raise DataError(f"{name} has no split '{split}' (its splits: {', '.join(map(str, data.keys()))}); give "
                            f"the split's name (data_split / eval_split), or the split itself")
        data, name = data[split], f"{name}, split {split}"
    if is_streamed(data):
        import itertools

        data = itertools.islice(iter(data), limit)
    return [dict(row, _source=f"{name}, row {i}") for i, row in enumerate(data)]


def load_rows(path: str | Path, required: tuple[str, ...] | dict[str, FieldCheck | None] = (),
              convert: Callable[[list[dict]], list[dict]] | None = None, split: str = "train",
              limit: int | None = None) -> list[dict]:
    """All rows of a JSONL / Parquet file, a ``save_to_disk`` folder or split ``split`` of a Hub data
    set in the local cache (hub.py), or of a data set given in memory (:func:`is_data_object`; a
    stream's first ``limit``), checked for ``required`` fields: a tuple of names, or a dict of name
    -> checker of the value (None: any value).  ``convert``: turns the shapes people bring into the
    stage's own rows first (formats.py)."""
    if is_data_object(path):
        rows = object_rows(path, split, limit)
        if not rows:
            raise DataError(f"{describe_data(path)} holds no rows")
        return checked_rows(rows, required, convert)
    name, path = str(path), Path(path)
    rows = None
    if not path.exists():
        try:
            rows = hub_dataset_rows(name, split) if looks_like_hub_id(name) else None
        except ValueError as error:  # a split it does not have
            raise DataError(str(error)) from None
        if rows is None:
            raise FileNotFoundError(f"data not found: {path} is not a file or folder here"
                                    + (f", nor a data set in the local Hugging Face cache (HF_HOME); ppo-rlhf reads "
                                       f"data offline: on a machine with a network run `huggingface-cli download "
                                       f"--repo-type dataset {name}` and copy its cache here, or give a file"
                                       if looks_like_hub_id(name) else ""))
    elif path.is_dir():
        rows = _read_folder(path)
    elif path.suffix == ".parquet":
        rows = _read_parquet(path)
    elif path.suffix in (".jsonl", ".json"):
        rows = _read_jsonl(path)
    else:
        raise DataError(f"{path}: unsupported data format '{path.suffix}'; use .jsonl, .parquet or a save_to_disk folder")
    if not rows:
        raise DataError(f"{path} holds no rows")
    return checked_rows(rows, required, convert)


def checked_rows(rows: list[dict], required: tuple[str, ...] | dict[str, FieldCheck | None],
                 convert: Callable[[list[dict]], list[dict]] | None) -> list[dict]:
    """``rows`` converted (``convert``) and checked for ``required`` fields, a row at fault named."""
    if convert is not None:
        rows = convert(rows)
    checks = required if isinstance(required, dict) else dict.fromkeys(required)
    for row in rows:
        complaint = row_complaint(row, checks)
        if complaint:
            raise DataError(f"{row['_source']}: {complaint}")
    return rows


def row_complaint(row: dict, checks: dict[str, FieldCheck | None]) -> str | None:
    """What is wrong with ``row`` for ``checks`` (field -> checker, None: any value), or None: a
    missing field, named with the fields the row has (a null one is missing, and said to be
    null), or a field's own complaint."""
    for field, check in checks.items():
        if row.get(field) is None:
            fields = ", ".join(sorted(k for k in row if k != "_source")) or "none"
            null = ": it is null" if field in row else ""
            return f"missing field '{field}'{null} (the row has: {fields})"
    for field, check in checks.items():
        complaint = check(row[field]) if check is not None else None
        if complaint:
            return f"field '{field}' {complaint}"
    return None


def drop_rows(rows: list[dict], useless: Callable[[dict], bool], why: str, source: str | Path) -> list[dict]:
    """``rows`` without those ``useless`` says carry nothing to learn from; says how many went,
    and stops when none is left."""
    kept = [row for row in rows if not useless(row)]
    if not kept:
        raise DataError(f"{source}: all {len(rows)} rows {why}: nothing left to learn from")
    if len(kept) < len(rows):
        first = next(row for row in rows if useless(row))
        print(f"{source}: dropped {len(rows) - len(kept)} of {len(rows)} rows that {why} "
              f"(the first: {first.get('_source', '?')})")
    return kept


def drop_empty_prompts(rows: list[dict], field: str, source: str | Path) -> list[dict]:
    """Prompt rows without the empty ones (nothing to respond to); stops when all are empty."""
    return drop_rows(rows, lambda row: isinstance(row[field], str) and not row[field].strip(),
                     f"have an empty prompt in '{field}'", source)
