"""``--agent module:function``: episodes played by an agent of one's own through the generation
server's OpenAI-compatible endpoint (docs/design.md, "Agents on the OpenAI endpoint").

The function is called once per prompt row as ``function(client, model, row)`` and returns the
episode's reward (a number): ``client`` is an ``openai.OpenAI`` (an ``openai.AsyncOpenAI`` for an
``async def``) whose base URL is the episode's own on a server, ``model`` the name to call it with.
Whatever the agent does between its calls -- its own tool loop, retrieval, another model -- is its
own; every call it makes is answered from the run's current policy with the run's decoding and a
seed of the episode's own (so what it samples never depends on timing), and kept by the server.
Once every agent of a batch has returned, the trainer reads each episode's calls back and trains
on exactly the tokens sampled: the calls that extend each other form one sequence, the model's
tokens in the loss, what came between its calls (tool results, the agent's messages, as the chat
template writes them) out of it (server/episodes.py).  TRL 1.16's ``rollout_func`` is the nearest
relative: it hands back token ids and log-probs itself; here the server records them.

Agents run as environments' calls do (envs/calls.py): a plain def on a thread of its own, at most
``--env-workers`` at once; an async def awaited on the run's event loop, all at once."""

from __future__ import annotations

import asyncio
import math
from collections import Counter

import torch

from ppo_rlhf.config import ConfigError
from ppo_rlhf.envs.calls import CALLS_ON, EnvironmentCalls, is_async
from ppo_rlhf.envs.protocol import EnvironmentFailed, is_number
from ppo_rlhf.rollout.episodes import Episodes, every_episode, where
from ppo_rlhf.rollout.server_api import EPISODES
from ppo_rlhf.rollout.sequences import Sequences

API_KEY = "ppo-rlhf"  # the OpenAI client wants one; the server reads none


class AgentFailed(EnvironmentFailed):
    """An agent raised, or returned no reward: the run stops, naming the agent and the row."""

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)


class AgentRun:
    """One episode an agent played, as reward functions and the episode metrics see it: what it
    returned (its reward), and how many of its calls were trained on."""

    pays = True

    def __init__(self, agent: str, reward: float, calls: int, trained: int):
        self.agent, self.reward, self.calls, self.trained = agent, reward, calls, trained
        self.tool_stats = Counter({"agent_calls": calls, "agent_calls_not_trained": calls - trained})


class AgentSource:
    """The source of an agent run's episodes (module docstring): it plays a batch on the run's
    generation servers (``play``), standing where an environment source stands."""

    pays = True
    tools: list = []
    notes: list = []
    chat_template = None

    def __init__(self, name: str, env_workers: int, stall_limit: float = 10.0):
        from ppo_rlhf.user_code import load_function

        try:
            import openai  # noqa: F401 -- an agent is written against it
        except ImportError:
            raise ConfigError(f"--agent {name}: an agent calls the server through the openai package, which is not "
                              f"installed: pip install openai") from None
        self.name, self.function = name, load_function(name, "agent")
        self.calls = EnvironmentCalls(env_workers, stall_limit)
        self.parser_name = "the agent's own"

    @property
    def description(self) -> str:
        return f"the agent {self.name}, calling the generation server's OpenAI endpoint"

    def check_rows(self, rows: list[dict]) -> None:
        """Any row: the agent reads what it needs."""

    def retire(self, environments: list) -> None:
        """Nothing to retire: every episode makes its own client."""

    def play(self, model, tokenizer, generator, rows: list[dict], prompts: list, limits) -> Episodes:
        """The batch's episodes, one agent call per row, on ``generator``'s servers (a
        ServerGenerator's: its leases keep the batch on one policy version)."""
        if not hasattr(generator, "servers"):
            raise ConfigError(f"--agent {self.name}: an agent calls a generation server's OpenAI endpoint; use "
                              f"--rollout-engine vllm-server --server-url URL")
        budget = limits.max_length
        with generator.holding_weights(model):
            session = generator.requests(model)  # its close: the draw counted, a push's probe checked
            draw = session.draw
            keys, bases = [], []
            for row in range(len(rows)):
                index = row % len(generator.servers)
                key = f"{generator.run_tag}-{generator.process}-{draw}-{row}"
                generator.servers[index].call("POST", EPISODES, {
                    "key": key, "lease": generator.leases[index]["lease"],
                    "seed": {"seed": generator.seed, "process": generator.process, "draw": draw, "row": row},
                    "do_sample": generator.do_sample, "temperature": generator.temperature,
                    "max_new_tokens": generator.max_new_tokens, "max_length": budget,
                    "max_calls": limits.max_turns, "stop_ids": generator.stop_token_ids}, what="an episode's start")
                keys.append((index, key))
                bases.append(f"{generator.servers[index].url}{EPISODES}/{key}/v1")
            model_name = generator.infos[0]["name"]
            rewards = self.calls.run(every_episode([self.episode(base, model_name, row, generator.timeout)
                                                    for base, row in zip(bases, rows)], rows))
            records = []
            for index, key in keys:
                server = generator.servers[index]
                records.append(server.call("GET", f"{EPISODES}/{key}", what="an episode's calls"))
                server.call("DELETE", f"{EPISODES}/{key}", what="an episode's end")
            for record in records:
                if record["calls"]:
                    generator.keep_probe_prompt(record["calls"][0]["prompt_ids"])
            session.close()
            versions = [generator.leases[index]["version"]["version"] for index, _ in keys]
        if session.decoding is generator:
            generator.last_versions = versions
        return self.episodes(tokenizer, rows, prompts, records, rewards, next(model.parameters()).device)

    async def episode(self, base_url: str, model: str, row: dict, timeout: float) -> float:
        """One agent run; its reward, checked."""
        import openai

        CALLS_ON.set(where(row))
        kind = openai.AsyncOpenAI if is_async(self.function) else openai.OpenAI
        client = kind(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=timeout)
        try:
            reward = await self.calls.call(self.function, (client, model, row), name=f"agent {self.name}")
        except asyncio.CancelledError:
            raise  # another episode failed: a plain def still running on its thread keeps its client
        except EnvironmentFailed:
            await closed(client)
            raise
        except Exception as error:  # noqa: BLE001 -- the agent's bug, or a call the server refused: named
            await closed(client)
            raise AgentFailed(f"agent {self.name} raised {type(error).__name__}: {error} (on {where(row)})") from error
        await closed(client)
        if not is_number(reward) or not math.isfinite(float(reward)):
            raise AgentFailed(f"agent {self.name} returned {reward!r:.80} on {where(row)}; an agent returns the "
                              f"episode's reward, a finite number")
        return float(reward)

    def episodes(self, tokenizer, rows: list[dict], prompts: list, records: list[dict], rewards: list[float],
                 device: torch.device) -> Episodes:
        """The batch as the trainer trains it: each episode's last sequence of calls that extend
        each other, its prompt the first of them, the model's tokens in the loss with the engine's
        log-probs, the tokens between its calls out of it."""
        firsts, tokens, owned, engine, ends, texts, finished, turns, runs = [], [], [], [], [], [], [], [], []
        for row, record, reward in zip(rows, records, rewards):
            calls = record["calls"]
            if not calls or not any(call["completion_ids"] for call in calls):
                raise AgentFailed(f"agent {self.name} made no call to the model on {where(row)} that it answered (an "
                                  f"episode trains on what the model sampled): call client.chat.completions.create "
                                  f"or client.completions.create with the model it is given")
            first = max(i for i, call in enumerate(calls) if not call["extends"])
            trained = calls[first:]
            prompt = trained[0]["prompt_ids"]
            ids, model_owned, logprobs, turn_ends = [], [], [], []
            for call in trained:
                between = call["prompt_ids"][len(prompt) + len(ids):]  # what came after the previous answer
                ids += between + call["completion_ids"]
                model_owned += [0] * len(between) + [1] * len(call["completion_ids"])
                logprobs += [0.0] * len(between) + list(call["logprobs"])
                turn_ends.append(len(ids) - 1 if call["completion_ids"] else None)
            last = trained[-1]
            firsts.append(prompt)
            tokens.append(ids)
            owned.append(model_owned)
            engine.append(logprobs)
            ends.append(turn_ends)
            texts.append(last.get("text") or "")
            finished.append(last["finish_reason"] in ("stop", "tool_calls"))
            turns.append(len(trained))
            runs.append(AgentRun(self.name, reward, len(calls), len(trained)))
        return assemble(tokenizer.pad_token_id, firsts, tokens, owned, engine, ends, texts, finished, turns, runs,
                        prompts, [[{"role": "assistant", "content": text}] for text in texts], device)


async def closed(client) -> None:
    """An OpenAI client closed (an AsyncOpenAI's close is awaited)."""
    closing = client.close()
    if hasattr(closing, "__await__"):
        await closing


def assemble(pad: int, firsts, tokens, owned, engine, ends, texts, finished, turns, runs, prompts, conversations,
             device: torch.device) -> Episodes:
    """Episodes from each episode's first prompt ids (left-padded here) and its ids after them."""
    width = max(len(p) for p in firsts)
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in firsts], device=device)
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in firsts], device=device)
    span = max(1, max(len(t) for t in tokens))

    def padded(lists, fill, dtype=None):
        return torch.tensor([x + [fill] * (span - len(x)) for x in lists], dtype=dtype, device=device)

    sequences = Sequences(prompt_ids, prompt_mask, padded(tokens, pad), padded([[1] * len(t) for t in tokens], 0),
                          padded(owned, 0))
    stats = Counter()
    for run in runs:
        stats.update(run.tool_stats)
    b = len(prompts)
    return Episodes(sequences, list(prompts), texts, finished,
                    padded(engine, 0.0, torch.float32), turns=turns, truncated=[not f for f in finished],
                    step_rewards=[[] for _ in range(b)], turn_ends=ends,
                    episode_rewards=[run.reward for run in runs], conversations=conversations, environments=runs,
                    tool_logs=[[] for _ in range(b)], seeds=[None] * b, stats=stats)

