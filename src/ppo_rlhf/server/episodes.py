"""An agent's episode on the generation server (docs/design.md, "Agents on the OpenAI endpoint"):
the calls an agent makes through its episode's OpenAI base URL, each answered from the run's
policy with the run's decoding and a seed of its own, and kept so that the trainer trains on the
tokens sampled.

Several calls become one sequence by **extension**: a call whose prompt continues the previous
call's prompt and answer is given, as its prompt, the previous call's token ids as they were --
the model's own answer kept as sampled, never decoded and encoded again -- followed by the
tokens of what came after it (the tool results or user messages, as the chat template continues
a conversation after an assistant turn: envs/chat.py, ``ChatContinuation``).  So the model reads
exactly what the trainer will train on.  A chat call extends the previous one when its messages
are the previous call's, then the answer it was given (its content and tool calls), then new
messages; a completion call when its prompt starts with the previous prompt and answer (as text,
or as token ids).  A call that does not -- the agent edited, dropped or summarised the history --
starts a new sequence; the trainer trains on the episode's last sequence (the one its reward
follows) and counts the calls before it.  A template that would render an earlier turn
differently once more follows it (Qwen3 drops earlier think blocks) therefore does not matter
here: earlier turns are never rendered again; the model sees them as it sampled them."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

from ppo_rlhf.rollout.vllm_requests import response_seed


@dataclass
class EpisodeCall:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    extends: bool  # continues the previous call's prompt and answer
    version: dict | None = None
    messages: list | None = None  # a chat call's messages, as normalised for comparison
    answer: dict | None = None  # the assistant message it was answered with, normalised
    prompt_text: str | None = None  # a completion call's prompt and answer text
    text: str | None = None

    def record(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids, "logprobs": self.logprobs,
                "finish_reason": self.finish_reason, "extends": self.extends, "version": self.version,
                "messages": self.messages, "answer": self.answer, "text": self.text}


@dataclass
class Episode:
    """One agent episode's settings (from the trainer) and its calls so far."""

    key: str
    lease: str
    seed: dict  # {"seed", "process", "draw", "row"}: each call's seed is response_seed(..., turn=call)
    do_sample: bool
    temperature: float
    max_new_tokens: int
    max_length: int
    max_calls: int
    stop_ids: list[int]
    calls: list[EpisodeCall] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def call_seed(self, index: int) -> int:
        return response_seed(self.seed["seed"], self.seed["process"], self.seed["draw"], self.seed["row"], index)

    def last(self) -> EpisodeCall | None:
        return self.calls[-1] if self.calls else None

    def record(self) -> dict:
        return {"key": self.key, "calls": [call.record() for call in self.calls]}


def normal_message(message: dict) -> dict:
    """A chat message as compared between calls: its role, its words ("" for none), its tool calls
    (name and arguments, read from JSON where given as text), and a tool message's call id."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else {}
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        calls.append({"name": function.get("name"), "arguments": arguments})
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    normal = {"role": message.get("role"), "content": content or ""}
    if calls:
        normal["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            normal[key] = message[key]
    return normal


def renderable(messages: list[dict]) -> list[dict]:
    """Messages as a Hugging Face chat template takes them: a tool call's arguments as an object,
    no empty content left None."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("content") is None:
            message["content"] = ""
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {"type": "function", "id": call.get("id"),
                 "function": {"name": call["function"]["name"],
                              "arguments": _as_object(call["function"].get("arguments", {}))}}
                for call in message["tool_calls"]]
        out.append(message)
    return out


def _as_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def chat_extension(previous: EpisodeCall | None, messages: list[dict]) -> list[dict] | None:
    """The messages after the previous call's answer, where ``messages`` extend the previous
    call's messages and that answer; None where they do not (or there is no previous chat call)."""
    if previous is None or previous.messages is None or previous.answer is None:  # (an answer still to come)
        return None
    normal = [normal_message(message) for message in messages]
    before = len(previous.messages)
    if normal[:before] != previous.messages or len(normal) <= before + 1:
        return None
    answer = normal[before]
    expected = previous.answer
    if answer.get("role") != "assistant" or answer.get("content", "").strip() != expected.get("content", "").strip():
        return None
    if answer.get("tool_calls", []) != expected.get("tool_calls", []):
        return None
    return messages[before + 1:]


def named_tool_messages(messages: list[dict], answer_calls: list[dict]) -> list[dict]:
    """Tool messages given their tool's name where the OpenAI shape gives only the call's id (a chat
    template may name the tool a result comes from)."""
    names = {call.get("id"): call["function"]["name"] for call in answer_calls if call.get("id")}
    named = []
    for message in messages:
        if message.get("role") == "tool" and not message.get("name") and message.get("tool_call_id") in names:
            message = {**message, "name": names[message["tool_call_id"]]}
        named.append(message)
    return named
