"""Agents for tests/test_vllm_server.py, written against the ``openai`` package as a user would
write one (``--agent tests/toy_agents.py:NAME``): each is given an OpenAI client on its episode's
base URL, the served model's name and the prompt row, and returns the episode's reward.  Each
call's answer (its prompt ids, sampled ids and log-probs) is appended to the JSONL file
$PPO_RLHF_AGENT_LOG names, for the tests to compare with what the trainer trained on."""

from __future__ import annotations

import json
import os

from ppo_rlhf.envs.parsers import ToolCall

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def log(client, kind: str, answer) -> None:
    path = os.environ.get("PPO_RLHF_AGENT_LOG")
    if not path:
        return
    choice = answer.choices[0]
    logprobs = ([entry.logprob for entry in choice.logprobs.content] if kind == "chat"
                else list(choice.logprobs.token_logprobs))
    with open(path, "a") as file:
        file.write(json.dumps({"episode": str(client.base_url), "prompt_ids": answer.prompt_token_ids,
                               "token_ids": choice.token_ids, "logprobs": logprobs,
                               "finish_reason": choice.finish_reason}) + "\n")


def tool_loop(client, model, row) -> float:
    """Its own tool loop: the model's tool calls run here (an adder), their results sent back as
    tool messages, three calls; the reward is the length of the last answer."""
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        answer = client.chat.completions.create(model=model, messages=messages, tools=[ADD], max_tokens=5)
        log(client, "chat", answer)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True, exclude={"token_ids"}))
        for call in message.tool_calls or []:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "go on"})
    return len(message.content or "") / 10


def every_turn_calls_add(text: str) -> list[ToolCall]:
    """A tool parser for the server (--tool-parser): every turn calls add(1, 2), whatever the tiny
    random model wrote, so that the agent's tool loop always runs."""
    return [ToolCall("add", {"a": 1, "b": 2}, text="")]


async def completions(client, model, row) -> float:
    """An async agent on /v1/completions: its second prompt is its first, the answer and more text
    (so the two are one sequence)."""
    first = await client.completions.create(model=model, prompt=row["prompt"], max_tokens=4)
    log(client, "completion", first)
    second = await client.completions.create(model=model, prompt=row["prompt"] + first.choices[0].text + " then",
                                             max_tokens=4)
    log(client, "completion", second)
    return float(second.choices[0].finish_reason == "stop")


def asks_another_model(client, model, row) -> float:
    client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": row["prompt"]}])
    return 1.0


def returns_nothing(client, model, row):
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": row["prompt"]}], max_tokens=2)
    return None


def restarts(client, model, row) -> float:
    """Two calls, the second with a history of its own (not the first's extended)."""
    for prompt in (row["prompt"], "start again"):
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=3)
        log(client, "chat", answer)
    return 0.5
