"""The generation server's OpenAI-compatible routes (docs/design.md, "Agents on the OpenAI
endpoint"): ``/v1/completions`` and ``/v1/chat/completions``, and the same under an agent
episode's own base URL, ``/ppo-rlhf/episodes/<key>/v1``, where each call is answered from the run's
policy with the run's decoding and kept for the trainer (server/episodes.py).

Every answer carries, beside the OpenAI fields, the token ids it sampled (``token_ids``, vLLM's
name) and those of its prompt (``prompt_token_ids``), and the log-prob of each sampled token
(``logprobs``, always).  A chat answer's tool calls are read from the model's text with the
server's ``--tool-parser`` when the request lists tools.  Not supported, and refused with a
message saying so: streaming, ``n`` above 1, stop strings; in an episode, any setting that would
sample from another distribution than the one the trainer trains (a temperature other than the
run's, top_p, top_k, penalties, logit biases)."""

from __future__ import annotations

import json
import time
import uuid

from ppo_rlhf.rollout import server_api as api
from ppo_rlhf.rollout.vllm_requests import sampling_params
from ppo_rlhf.server.engine import Refusal
from ppo_rlhf.server.episodes import (Episode, EpisodeCall, chat_extension, named_tool_messages, normal_message,
                                      renderable)

# Settings that would change the distribution an episode samples from (neutral values allowed).
DISTRIBUTION = {"top_p": 1.0, "top_k": (0, -1), "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "repetition_penalty": 1.0, "logit_bias": None}
PLAIN_WAIT = 600.0  # seconds a call outside an episode waits for a lease (a push in progress)


def add_openai_routes(app, served) -> None:
    """/v1/completions and /v1/chat/completions, the agents' episodes, and each episode's own."""
    episodes: dict[str, Episode] = served.extra.setdefault("episodes", {})

    @app.post(api.COMPLETIONS)
    async def completions(body: dict):
        return await complete(served, body, None)

    @app.post(api.CHAT)
    async def chat(body: dict):
        return await chat_complete(served, body, None)

    @app.post(api.EPISODES)
    async def register(body: dict):
        """An agent episode, registered by the trainer before the agent plays it."""
        key = str(body["key"])
        episodes[key] = Episode(key, body["lease"], body["seed"], bool(body.get("do_sample", True)),
                                float(body.get("temperature", 1.0)), int(body["max_new_tokens"]),
                                int(body["max_length"]), int(body["max_calls"]),
                                [int(i) for i in body.get("stop_ids") or served.stop_ids])
        return {"key": key, "base_url": f"{api.EPISODES}/{key}/v1"}

    @app.get(api.EPISODES + "/{key}")
    async def record(key: str):
        return episode_of(episodes, key).record()

    @app.delete(api.EPISODES + "/{key}")
    async def forget(key: str):
        episodes.pop(key, None)
        return {"forgotten": key}

    @app.post(api.EPISODES + "/{key}/v1/completions")
    async def episode_completions(key: str, body: dict):
        return await complete(served, body, episode_of(episodes, key))

    @app.post(api.EPISODES + "/{key}/v1/chat/completions")
    async def episode_chat(key: str, body: dict):
        return await chat_complete(served, body, episode_of(episodes, key))

    @app.get(api.EPISODES + "/{key}/v1/models")
    async def episode_models(key: str):
        episode_of(episodes, key)
        return {"object": "list", "data": [{"id": served.name, "object": "model", "owned_by": "ppo-rlhf",
                                            "max_model_len": served.max_model_len}]}


def episode_of(episodes: dict, key: str) -> Episode:
    episode = episodes.get(key)
    if episode is None:
        raise Refusal(f"no episode {key} on this server (it ended, or was registered on another server)", 404)
    return episode


def check_request(served, body: dict, episode: Episode | None) -> None:
    """The model asked for is the one served; what this server does not do is refused, saying so."""
    model = body.get("model")
    if model != served.name:
        raise Refusal(f"The model `{model}` does not exist: this server serves `{served.name}` (an agent is given "
                      f"that name as its `model` argument; pass it to create(model=...))", 404)
    if body.get("stream"):
        raise Refusal("stream: streamed answers are not supported by ppo-rlhf serve; leave stream out")
    if int(body.get("n") or 1) != 1:
        raise Refusal("n: one answer per call (n = 1); call again for another")
    if body.get("stop"):
        raise Refusal("stop: stop strings are not supported; a response ends at the model's stop tokens")
    if episode is None:
        return
    temperature = body.get("temperature")
    if temperature is not None and episode.do_sample and float(temperature) != episode.temperature:
        raise Refusal(f"temperature {temperature}: this episode samples at the run's temperature "
                      f"{episode.temperature:g}, the distribution the trainer trains; leave temperature out")
    for key, neutral in DISTRIBUTION.items():
        value = body.get(key)
        if value is not None and value != neutral and not (isinstance(neutral, tuple) and value in neutral):
            raise Refusal(f"{key} {value!r}: an episode samples from the run's distribution (softmax at its "
                          f"temperature, nothing filtered), which the trainer trains; leave {key} out")


async def answer(served, body: dict, episode: Episode | None, prompt_ids: list[int], extends: bool
                 ) -> tuple[list[int], list[float], str, dict | None, int]:
    """The call's sampled ids and log-probs, its finish reason, the version that sampled it and its
    index in its episode: an episode's call with the run's decoding, seed and limits (an empty
    answer, finish reason length, once the episode's tokens or calls are used up); another call
    with what it asks for."""
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    if episode is None:
        limit = int(asked or 256)
        room = served.max_model_len - len(prompt_ids)
        if room < 1:
            raise Refusal(f"the prompt is {len(prompt_ids)} tokens and the server takes {served.max_model_len}")
        params = sampling_params(served.engine.vllm, served.stop_ids, float(body.get("temperature", 1.0)) > 0,
                                 float(body.get("temperature", 1.0)), min(limit, room), body.get("seed"))
        if body.get("top_p") is not None:
            params.top_p = float(body["top_p"])
        request = {"ids": prompt_ids, "params": params, "stop_ids": served.stop_ids, "max_tokens": min(limit, room)}
        result = await served.engine.generate([request], None, None, PLAIN_WAIT)
        ids, logprobs = result["responses"][0]
        return ids, logprobs, finish(ids, served.stop_ids), result["version"], 0
    with episode.lock:
        index = len(episode.calls)
        room = min(episode.max_length, served.max_model_len) - len(prompt_ids)
        limit = min(int(asked or episode.max_new_tokens), episode.max_new_tokens, room)
        # A placeholder keeps the call's place (and its seed) whatever order the calls end in.
        call = EpisodeCall(prompt_ids, [], [], "length", extends)
        episode.calls.append(call)
    if limit < 1 or index >= episode.max_calls:
        return [], [], "length", None, index
    params = sampling_params(served.engine.vllm, episode.stop_ids, episode.do_sample, episode.temperature, limit,
                             episode.call_seed(index))
    request = {"ids": prompt_ids, "params": params, "stop_ids": episode.stop_ids, "max_tokens": limit}
    result = await served.engine.generate([request], episode.lease, None, PLAIN_WAIT)
    ids, logprobs = result["responses"][0]
    call.completion_ids, call.logprobs = ids, logprobs
    call.finish_reason, call.version = finish(ids, episode.stop_ids), result["version"]
    return ids, logprobs, call.finish_reason, call.version, index


def finish(ids: list[int], stop_ids: list[int]) -> str:
    return "stop" if ids and ids[-1] in stop_ids else "length"


async def complete(served, body: dict, episode: Episode | None) -> dict:
    """/v1/completions: a text (or token ids) continued."""
    check_request(served, body, episode)
    tokenizer = served.tokenizer
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    previous = episode.last() if episode is not None else None
    if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt) and prompt:
        ids, extends = list(prompt), False
        if previous is not None:
            before = previous.prompt_ids + previous.completion_ids
            extends = ids[:len(before)] == before
    elif isinstance(prompt, str):
        extends = False
        if previous is not None and previous.prompt_text is not None and prompt.startswith(previous.prompt_text):
            # The previous call's prompt and answer, then new text: the ids as they were, the rest encoded.
            rest = prompt[len(previous.prompt_text):]
            ids = previous.prompt_ids + previous.completion_ids + (
                tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else [])
            extends = True
        else:
            ids = tokenizer(prompt)["input_ids"]
    else:
        raise Refusal("prompt: a text, or a list of token ids")
    if not ids:
        raise Refusal("prompt: empty")
    sampled, logprobs, reason, version, index = await answer(served, body, episode, ids, extends)
    text = tokenizer.decode(sampled, skip_special_tokens=True)
    if episode is not None:
        call = episode.calls[index]
        call.text = text
        call.prompt_text = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) + text
    choice = {"index": 0, "text": text, "finish_reason": reason, "token_ids": sampled, "prompt_token_ids": ids,
              "logprobs": {"tokens": [tokenizer.decode([i]) for i in sampled], "token_logprobs": logprobs,
                           "top_logprobs": None, "text_offset": offsets(tokenizer, sampled)}}
    return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": served.name, "choices": [choice], "prompt_token_ids": ids, "policy_version": version,
            "usage": usage(ids, sampled)}


async def chat_complete(served, body: dict, episode: Episode | None) -> dict:
    """/v1/chat/completions: the model's next turn after ``messages`` (with ``tools`` listed)."""
    check_request(served, body, episode)
    messages, tools = body.get("messages"), body.get("tools") or None
    if not isinstance(messages, list) or not messages:
        raise Refusal("messages: a non-empty list of chat messages")
    tokenizer = served.tokenizer
    previous = episode.last() if episode is not None else None
    after = chat_extension(previous, messages)
    if after is not None:
        from ppo_rlhf.envs.chat import ChatContinuation, TemplateProblem

        after = named_tool_messages(renderable(after), previous.answer.get("raw_calls", []))
        try:
            following = ChatContinuation(tokenizer, tools).ids(
                after, previous.completion_ids[-1] if previous.completion_ids else None,
                previous.finish_reason == "stop")
        except TemplateProblem as problem:
            raise Refusal(str(problem)) from None
        ids = previous.prompt_ids + previous.completion_ids + following
    else:
        try:
            text = tokenizer.apply_chat_template(renderable(messages), tools=tools, tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as error:  # noqa: BLE001 -- the template's own complaint, said to the caller
            raise Refusal(f"the chat template could not render these messages ({type(error).__name__}: {error})")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sampled, logprobs, reason, version, index = await answer(served, body, episode, ids, after is not None)
    stopped = reason == "stop"
    text = tokenizer.decode(sampled[:-1] if stopped else sampled, skip_special_tokens=False)
    content, calls = read_calls(served, text, tools, tokenizer.decode(ids))
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
        reason = "tool_calls" if stopped else reason
    if episode is not None:
        call = episode.calls[index]
        call.messages = [normal_message(m) for m in messages]
        call.answer = {**normal_message(message), "raw_calls": calls}
        call.text = text
    choice = {"index": 0, "message": message, "finish_reason": reason, "token_ids": sampled,
              "logprobs": {"content": [{"token": tokenizer.decode([i]), "logprob": value,
                                        "bytes": list(tokenizer.decode([i]).encode()), "top_logprobs": []}
                                       for i, value in zip(sampled, logprobs)], "refusal": None}}
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
            "model": served.name, "choices": [choice], "prompt_token_ids": ids, "policy_version": version,
            "usage": usage(ids, sampled)}


def read_calls(served, text: str, tools: list | None, prefix: str) -> tuple[str, list[dict]]:
    """(the turn's words without its tool calls, the calls in the OpenAI shape) where the request
    lists tools; the server's --tool-parser reads them (auto: by the chat template's family)."""
    if not tools:
        return text, []
    from ppo_rlhf.config import ConfigError
    from ppo_rlhf.envs.chat import template_text
    from ppo_rlhf.envs.parsers import load_parser, resolve_parser

    try:
        parser, _ = resolve_parser(load_parser(served.tool_parser), served.tokenizer, template_text(served.tokenizer),
                                   tools, "ppo-rlhf serve's chat template")
    except ConfigError as error:
        raise Refusal(f"{error} (ppo-rlhf serve --tool-parser)") from None
    if hasattr(parser, "read"):
        content, found = parser.read(text, prefix)
    else:
        found = parser(text)
        content = text
        for call in found:
            content = content.replace(call.text, "", 1) if call.text else content
    calls = [{"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
              "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
             for call in found if call.error is None]
    return content.strip(), calls


def offsets(tokenizer, ids: list[int]) -> list[int]:
    spans, position = [], 0
    for i in ids:
        spans.append(position)
        position += len(tokenizer.decode([i], skip_special_tokens=True))
    return spans


def usage(prompt: list[int], completion: list[int]) -> dict:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(completion),
            "total_tokens": len(prompt) + len(completion)}
