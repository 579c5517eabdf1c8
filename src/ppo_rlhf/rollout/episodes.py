"""Stage 1, the rollout, as episodes: the model's turns and an environment's answers, token in,
token out (docs/design.md, "Episodes"; docs/agents.md).

:func:`roll_out` is the one rollout of training and of evaluation.  Without an environment an
episode is one turn: the model answers the prompt, exactly the single-turn rollout (the same
calls, the same tensors).  With one, each episode goes on:

    prompt (the row's, with what the environment's reset observed) --chat template--> ids
    repeat:  the model's turn     sampled ids, kept as sampled            loss_mask 1
             env.step(turn text)  observation, reward, terminated, truncated
             the answer           the chat template's continuation ids   loss_mask 0
    until the environment ends it, --max-turns, or the episode's token budget.

The model's tokens are never decoded and re-encoded: what it sampled is what trains.  Only what
the environment adds is tokenized, once, as the chat template continues a conversation after an
assistant turn (envs/chat.py, ``ChatContinuation``).

Each episode of a batch is a coroutine of its own, from its reset to its reward, so one episode's
environment calls never wait for another's: they run at once through the run's environment calls
(envs/calls.py: plain defs on worker threads, async defs awaited on one event loop).  Each model
turn is asked of a turn server on the trainer's thread (rollout/turns.py): with the torch loop,
one ``generator.generate`` call on every episode still running once all have asked; with an
engine taking requests one at a time (vLLM), each as soon as its episode's environment answered.
Each asks for no more than the room its episode has left.  Every episode's tokens, calls and
answers are its own, so what a batch holds never depends on which call finished first.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from ppo_rlhf.envs.calls import CALLS_ON
from ppo_rlhf.envs.chat import ChatContinuation, too_long_for_its_tools
from ppo_rlhf.envs.parsers import assistant_message
from ppo_rlhf.envs.protocol import (EnvironmentFailed, as_messages, checked_result, describe, takes_keyword,
                                    users_object)
from ppo_rlhf.envs.tools import ToolParserFailed, ToolUse
from ppo_rlhf.rollout.generation import Generator
from ppo_rlhf.rollout.reward import ScoringBatch, refuse_unscored, weighted_sum
from ppo_rlhf.rollout.responses import encode_prompts, generate_responses
from ppo_rlhf.rollout.sequences import Sequences, is_stop, pad_columns
from ppo_rlhf.rollout.turns import ContinuousTurns, TurnBatches


@dataclass
class EpisodeLimits:
    max_prompt_length: int  # prompt tokens at most (cut from the left)
    max_length: int  # prompt + episode tokens at most
    max_turns: int = 1
    max_episode_tokens: int | None = None  # model + environment tokens of an episode at most (None: max_length's)
    chat_template: bool = False


@dataclass
class Episodes:
    """A batch of rollouts, (b,) or (b, T) row for row with the prompt rows."""

    sequences: Sequences  # prompt + episode; loss_mask 1 on the model's tokens
    prompts: list  # what each episode's prompt was: the row's, with what reset observed
    texts: list[str]  # each episode's last model turn, decoded (a single turn: the response)
    finished: list[bool]  # the last model turn ended with a stop id
    engine_logprobs: torch.Tensor | None = None  # (b, T) the engine's log-probs of the model's tokens (vllm)
    turns: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)  # ended by a limit, not by the environment
    step_rewards: list[list[float]] = field(default_factory=list)  # the environment's reward after each turn
    turn_ends: list[list[int]] = field(default_factory=list)  # response index of each turn's last model token
    episode_rewards: list[float | None] = field(default_factory=list)  # the environment's reward() at the end
    conversations: list[list[dict]] = field(default_factory=list)  # the messages after the prompt
    environments: list = field(default_factory=list)  # each episode's environment object
    tool_logs: list[list[dict]] = field(default_factory=list)  # each episode's tool calls and results
    seeds: list = field(default_factory=list)  # each episode's environment seed
    logged: list[dict] = field(default_factory=list)  # each episode's columns a reward function logged (log_extra)
    stats: Counter = field(default_factory=Counter)  # tool calls, errors, timeouts, ... summed over the batch

    # The per-episode lists, which select and concat carry along with the tensors.
    LISTS = ("prompts", "texts", "finished", "turns", "truncated", "step_rewards", "turn_ends", "episode_rewards",
             "conversations", "environments", "tool_logs", "seeds", "logged")

    def select(self, index: list[int]) -> "Episodes":
        """These episodes' rows ``index``, in that order (the batch's stats stay the batch's)."""
        tensor_index = torch.tensor(index, dtype=torch.long, device=self.sequences.prompt_ids.device)
        lists = {name: [getattr(self, name)[i] for i in index] if getattr(self, name) else []
                 for name in self.LISTS}
        return Episodes(self.sequences.select(tensor_index), engine_logprobs=None if self.engine_logprobs is None
                        else self.engine_logprobs[tensor_index], stats=self.stats, **lists)

    @staticmethod
    def concat(parts: list["Episodes"], pad_token_id: int) -> "Episodes":
        """The episodes of ``parts`` in order, as one batch (responses padded to the longest)."""
        lists = {name: [x for p in parts for x in getattr(p, name)] for name in Episodes.LISTS}
        engine_logprobs = None
        if all(p.engine_logprobs is not None for p in parts):
            width = max(p.engine_logprobs.shape[1] for p in parts)
            engine_logprobs = torch.cat([pad_columns(p.engine_logprobs, width, 0.0) for p in parts])
        stats = sum((p.stats for p in parts), Counter())
        return Episodes(Sequences.concat([p.sequences for p in parts], pad_token_id), engine_logprobs=engine_logprobs,
                        stats=stats, **lists)


def roll_out(model, tokenizer, generator: Generator, rows: list[dict], prompts: list, limits: EpisodeLimits,
             source=None, seeds: list[int] | None = None, progress=None) -> Episodes:
    """The batch's episodes: one turn each without an environment ``source``
    (envs.EnvironmentSource), else as long as each one lasts.  ``seeds``: one per row, for the
    environments' reset (resume and several processes draw the same episodes).  ``progress``:
    called after each turn with (turns played, episodes still going).  A source that plays its
    episodes itself (an agent's: rollout/agents.py) is handed the batch."""
    if source is not None and hasattr(source, "play"):
        return source.play(model, tokenizer, generator, rows, prompts, limits)
    if source is None:
        out = generate_responses(model, tokenizer, generator, prompts, limits.max_prompt_length, limits.chat_template)
        b = len(prompts)
        return Episodes(out.sequences, prompts, out.texts, out.finished, getattr(generator, "last_logprobs", None),
                        turns=[1] * b, truncated=[False] * b, step_rewards=[[] for _ in range(b)],
                        turn_ends=[[int(n) - 1] for n in out.sequences.response_mask.sum(dim=1).tolist()],
                        episode_rewards=[None] * b)
    runner = EpisodeRunner(model, tokenizer, generator, limits, source)
    runner.progress = progress
    return runner.run(rows, prompts, seeds)


def episode_seeds(seed: int, iteration: int, draw: int, first_group: int, groups: int, samples_per_prompt: int
                  ) -> list[int]:
    """The environment seed of each episode of a batch: one per prompt group, from the run seed,
    the iteration, the draw within it (dynamic sampling draws again) and the group's place in the
    whole batch -- so the K episodes of a row start alike (their group baseline compares like with
    like), a resumed run plays the episodes a straight run would, and two processes those of one."""
    def one(group: int) -> int:
        digest = hashlib.blake2b(f"{seed}/{iteration}/{draw}/{group}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little")

    return [one(first_group + g) for g in range(groups) for _ in range(samples_per_prompt)]


def first_messages(prompt, observation, role: str, separator: str = "") -> list[dict]:
    """The episode's prompt as messages: the row's prompt with the reset's observation -- a string
    appended to the last user message (TRL's rule; ``separator`` between them where that message
    has words of its own: an adapter's instructions are a paragraph of their own), messages
    replacing it all."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
    if isinstance(observation, str):
        if messages and messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], str):
            content = messages[-1]["content"]
            joined = content + (separator if content.strip() else "") + observation
            return messages[:-1] + [{**messages[-1], "content": joined}]
        return messages + [{"role": role, "content": observation}]
    return as_messages(observation) or messages


@dataclass
class Play:
    """The episodes of one batch while they run: what each holds after its prompt so far."""

    rows: list[dict]
    environments: list
    prompts: list[list[dict]]  # each episode's prompt messages
    contexts: list[list[int]]  # each episode's prompt ids
    budgets: list[int]  # tokens each episode may hold after its prompt
    seeds: list
    prompt_ids: torch.Tensor  # (b, P) the prompts, left-padded
    prompt_mask: torch.Tensor  # (b, P)
    tokens: list[list[int]] = field(default_factory=list)  # ids after the prompt
    owned: list[list[int]] = field(default_factory=list)  # 1: the model wrote it
    engine: list[list[float]] = field(default_factory=list)  # the engine's log-prob of each model token (else 0)
    turn_ends: list[list[int | None]] = field(default_factory=list)
    step_rewards: list[list[float]] = field(default_factory=list)
    conversations: list[list[dict]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    episode_rewards: list = field(default_factory=list)  # the environment's reward() at the end (None: none)

    def __post_init__(self) -> None:
        b = len(self.rows)
        for name in ("tokens", "owned", "engine", "turn_ends", "step_rewards", "conversations"):
            setattr(self, name, [[] for _ in range(b)])
        self.finished, self.truncated, self.texts, self.episode_rewards = [False] * b, [False] * b, [""] * b, [None] * b

    def room(self, row: int) -> int:
        return self.budgets[row] - len(self.tokens[row])

    def add(self, row: int, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.tokens[row] += ids
        self.owned[row] += [int(model)] * len(ids)
        self.engine[row] += logprobs if logprobs is not None else [0.0] * len(ids)

    def last_model_token(self, row: int) -> int | None:
        """The response index of the episode's last model token so far (None before any): where a
        turn's reward lands (an empty turn's on the turn before it)."""
        owned = self.owned[row]
        return next((i for i in range(len(owned) - 1, -1, -1) if owned[i]), None)


class EpisodeRunner:
    """Episodes of one batch (module docstring): each a coroutine of its own on the run's event loop
    (envs/calls.py), from its reset to its reward, its model turns served on this thread
    (rollout/turns.py).  Every call of an environment goes through :meth:`call`."""

    def __init__(self, model, tokenizer, generator: Generator, limits: EpisodeLimits, source):
        self.model, self.tokenizer, self.generator, self.limits, self.source = model, tokenizer, generator, limits, source
        self.calls = source.calls
        self.stop_ids = torch.as_tensor(generator.stop_token_ids)
        self.pad = tokenizer.pad_token_id
        self.device = next(model.parameters()).device
        self.has_engine_logprobs = False
        self.continuations: dict[tuple, ChatContinuation] = {}  # by the tools an episode's prompt lists
        # Generation asks each row for at most the room its episode has left, where the engine takes that.
        self.row_limits = takes_keyword(generator.generate, "max_new_tokens")

    progress = None  # called with (turns played, episodes still going): eval's progress bar

    async def call(self, environment, method: str, row: dict, *args, **kwargs):
        """``environment.method(...)`` through the run's calls (a worker thread, or awaited); its
        exception turned into EnvironmentFailed naming it and the row, what it handed back checked."""
        try:
            result = await self.calls.call(getattr(environment, method), args, kwargs,
                                           name=f"environment {describe(environment)}: {method}()")
        except (EnvironmentFailed, ToolParserFailed):
            raise
        except Exception as error:  # noqa: BLE001 -- the environment's bug: named, and the run stops
            raise EnvironmentFailed(environment, method, row, error) from error
        return checked_result(result, environment, method, row)

    def continuation(self, environment) -> ChatContinuation:
        """The chat template's continuation for an episode of ``environment`` (its own tools listed)."""
        tools = list(getattr(environment, "tools", None) or [])
        key = tuple(tool["function"]["name"] for tool in tools)
        if key not in self.continuations:
            self.continuations[key] = ChatContinuation(self.tokenizer, tools, self.source.chat_template)
        return self.continuations[key]

    def run(self, rows: list[dict], prompts: list, seeds: list[int] | None) -> Episodes:
        environments = self.source.environments(rows)
        seeds = seeds if seeds is not None else [None] * len(rows)
        try:
            play = self.start(rows, prompts, environments, seeds)
            # An engine holding weights of its own (vLLM) receives the actor's once for all the turns.
            with getattr(self.generator, "holding_weights", lambda model: contextlib.nullcontext())(self.model):
                turns = self.turn_server(len(rows))
                self.calls.run(every_episode([self.play(play, r, turns) for r in range(len(rows))], rows), turns)
                turns.close()
        except BaseException:
            self.source.retire(environments)  # a call of the stopped rollout may still be running on any of them
            raise
        self.source.retire([environment for environment in environments if getattr(environment, "abandoned", False)])
        return self.episodes(play)

    def start(self, rows: list[dict], prompts: list, environments: list, seeds: list) -> "Play":
        """Each episode's environment reset (all at once), and its prompt: the row's with what reset
        observed, rendered by the chat template and encoded."""
        async def reset(environment, row, seed):
            CALLS_ON.set(where(row))
            return await self.call(environment, "reset", row, seed=seed, options=row)

        observations = self.calls.run(every_episode([reset(environment, row, seed) for row, environment, seed
                                                     in zip(rows, environments, seeds)], rows))
        episode_prompts = [first_messages(prompt, observation, getattr(environment, "observation_role", "user"),
                                          getattr(environment, "prompt_separator", ""))
                           for prompt, (observation, _), environment in zip(prompts, observations, environments)]
        rendered = [self.continuation(environment).render(messages, add_generation_prompt=True)
                    for messages, environment in zip(episode_prompts, environments)]
        self.refuse_cutting_tools(rows, rendered, environments)
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, rendered, self.limits.max_prompt_length, self.device,
                                                 add_special_tokens=False)
        contexts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        budgets = [self.limits.max_length - len(c) for c in contexts]
        if self.limits.max_episode_tokens is not None:
            budgets = [min(budget, self.limits.max_episode_tokens) for budget in budgets]
        return Play(rows, environments, episode_prompts, contexts, budgets, seeds, prompt_ids, prompt_mask)

    def refuse_cutting_tools(self, rows: list[dict], rendered: list[str], environments: list) -> None:
        """DataError for an episode's prompt that lists tools and is too long to keep them whole (a
        cut from its start would take them away): checked at start on the rows (envs/chat.py), here
        again with what reset() added."""
        lengths = [len(ids) for ids in self.tokenizer(rendered, add_special_tokens=False)["input_ids"]]
        for row, length, environment in zip(rows, lengths, environments):
            if length > self.limits.max_prompt_length and getattr(environment, "tools", None):
                from ppo_rlhf.data import DataError

                where = f"the prompt of {row.get('_source', 'a row')}, with what its environment's reset() added,"
                raise DataError(too_long_for_its_tools(where, length, self.limits.max_prompt_length))

    def turn_server(self, episodes: int):
        """What serves the model's turns (rollout/turns.py): an engine that takes requests one at a
        time serves each as it comes; any other generator, every episode's turn in one call."""
        if hasattr(self.generator, "requests"):
            self.has_engine_logprobs = True
            return ContinuousTurns(self.generator.requests(self.model), episodes, self.progress)
        return TurnBatches(self.generate, episodes, self.progress)

    def generate(self, contexts: list[list[int]], limits: list[int] | None) -> list[tuple[list[int], list | None]]:
        """One turn of several episodes in one ``generate`` call, left-padded, each row's ids so far
        ``contexts``, each asking for at most its ``limits`` (None: the generator's own); each row's
        new ids up to its first stop id, and the engine's log-probs of them (None without)."""
        width = max(len(ids) for ids in contexts)
        ids = torch.tensor([[self.pad] * (width - len(x)) + x for x in contexts], device=self.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in contexts], device=self.device)
        if limits is None:
            response_ids, response_mask = self.generator.generate(self.model, ids, mask)
        else:
            response_ids, response_mask = self.generator.generate(self.model, ids, mask, max_new_tokens=limits)
        logprobs = getattr(self.generator, "last_logprobs", None)
        self.has_engine_logprobs = logprobs is not None
        responses = []
        for j in range(len(contexts)):
            new = response_ids[j][response_mask[j].bool()].tolist()
            responses.append((new, logprobs[j][:len(new)].tolist() if logprobs is not None else None))
        return responses

    def turn_limit(self, play: "Play", r: int) -> int | None:
        """The most tokens episode ``r``'s next turn may ask for: the room its episode has left (a
        later turn never runs past --max-length: a model with learned positions has no more), no more
        than the engine's own limit; None where the engine takes no limit per row."""
        if not self.row_limits:
            return None
        ceiling = getattr(self.generator, "max_new_tokens", None)
        return play.room(r) if ceiling is None else min(ceiling, play.room(r))

    async def play(self, play: "Play", r: int, turns) -> None:
        """Episode ``r`` from its first model turn to its reward: each turn asked of ``turns`` as soon
        as its environment has answered the one before."""
        environment, row = play.environments[r], play.rows[r]
        CALLS_ON.set(where(row))
        try:
            for turn in range(self.limits.max_turns):
                new, logprobs = await turns.ask(r, play.contexts[r] + play.tokens[r], self.turn_limit(play, r))
                if not await self.answer(play, r, new, logprobs, last=turn == self.limits.max_turns - 1):
                    break
        finally:
            turns.ended(r)
        reward = getattr(environment, "reward", None)
        play.episode_rewards[r] = await self.call(environment, "reward", row) if callable(reward) else None

    async def answer(self, play: "Play", r: int, new: list[int], logprobs: list[float] | None, last: bool) -> bool:
        """Episode ``r``'s model turn ``new`` kept, and its environment's answer; whether it goes on.
        The calls of a turn that ends its episode (the last turn, or one that used up the episode's
        tokens) are not run, as TRL runs none: the model would never read their answers, and their
        side effects would reach get_reward()."""
        room = play.room(r)
        new = new[:room]
        play.add(r, new, model=True, logprobs=logprobs[:len(new)] if logprobs is not None else None)
        play.turn_ends[r].append(play.last_model_token(r))
        stopped = bool(new) and bool(is_stop(torch.tensor(new[-1:]), self.stop_ids).item())
        play.finished[r] = stopped
        # What the model wrote, less its stop token, special tokens kept (a template's tool-call tags may be ones).
        text = self.tokenizer.decode(new[:-1] if stopped else new, skip_special_tokens=False)
        play.texts[r] = text
        environment, row = play.environments[r], play.rows[r]
        cut = len(new) >= room and not stopped  # the episode's budget ends inside this turn
        final = last or len(new) >= room
        if isinstance(environment, ToolUse):
            said, answer, reward, terminated, truncated = await self.tool_turn(play, r, new, text, final)
        else:
            play.conversations[r].append({"role": "assistant", "content": text})
            observation, reward, terminated, truncated, _ = await self.call(environment, "step", row, text)
            said = answer = as_messages(observation, getattr(environment, "observation_role", "user"))
        play.step_rewards[r].append(float(reward))
        if terminated or truncated or final:
            play.truncated[r] = cut or bool(truncated) or (final and not terminated)
            return False
        following = self.continuation(environment).ids(answer, new[-1] if new else None, stopped) if answer else []
        if len(following) + 1 > play.room(r):  # no room left for the model to answer
            play.truncated[r] = True
            return False
        play.conversations[r] += said
        play.add(r, following, model=False)
        return True

    async def tool_turn(self, play: "Play", r: int, new: list[int], text: str, final: bool) -> tuple:
        """A turn of an environment whose tools answer it: the calls read (the assistant message
        carries them, as TRL's completions do), then run unless the turn is ``final``.  Returns (the
        messages for the conversation, the messages for the template, reward, terminated, truncated)."""
        environment, row = play.environments[r], play.rows[r]
        prefix = ""
        if hasattr(environment.parser, "read"):  # a response template reads the turn with the prompt before it
            prefix = self.tokenizer.decode(play.contexts[r] + play.tokens[r][:len(play.tokens[r]) - len(new)])
        content, calls = await self.call(environment, "read_turn", row, text, prefix)
        play.conversations[r].append(assistant_message(content, calls))  # a think block as reasoning_content
        if not calls or final:
            return [], [], 0.0, not calls, False
        answers = await self.call(environment, "answer", row, calls)
        return [answer.given for answer in answers], [answer.message for answer in answers], 0.0, False, False

    def episodes(self, play: "Play") -> Episodes:
        """The played batch as tensors: responses right-padded, the loss mask on the model's tokens."""
        width = max(1, max(len(t) for t in play.tokens))

        def padded(lists: list[list], fill, dtype=None) -> torch.Tensor:
            return torch.tensor([x + [fill] * (width - len(x)) for x in lists], dtype=dtype, device=self.device)

        sequences = Sequences(play.prompt_ids, play.prompt_mask, padded(play.tokens, self.pad),
                              padded([[1] * len(t) for t in play.tokens], 0), padded(play.owned, 0))
        stats = Counter()
        for environment in play.environments:
            stats.update(getattr(environment, "tool_stats", None) or {})
        return Episodes(sequences, play.prompts, play.texts, play.finished,
                        padded(play.engine, 0.0, torch.float32) if self.has_engine_logprobs else None,
                        turns=[len(ends) for ends in play.turn_ends], truncated=play.truncated,
                        step_rewards=play.step_rewards, turn_ends=play.turn_ends,
                        episode_rewards=play.episode_rewards, conversations=play.conversations,
                        environments=list(play.environments),
                        tool_logs=[list(getattr(environment, "tool_log", [])) for environment in play.environments],
                        seeds=list(play.seeds), stats=stats)


def where(row: dict) -> str:
    """A row as messages name it."""
    return row.get("_source", "a prompt row") if isinstance(row, dict) else "a prompt row"


async def every_episode(coroutines: list, rows: list[dict]) -> list:
    """Each episode's coroutine run at once; their results in row order.  One that raises stops the
    others (cancelled: a call on a thread is left to finish, its environment retired by the caller)
    and is raised -- of several, the first row's."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # a no-op for a finished one
        await asyncio.gather(*tasks, return_exceptions=True)
    failed = [task for task in tasks if not task.cancelled() and task.exception() is not None]
    if failed:
        raise failed[0].exception()
    return [task.result() for task in tasks]


def environment_rewards(episodes: Episodes) -> torch.Tensor | None:
    """(b,) what each episode's environment paid: its step rewards and its end-of-episode reward()
    -- NaN for an environment that pays nothing (tools alone, a TRL class without get_reward) or
    whose reward() gave None, as TRL leaves such a row to the other rewards; None without an
    environment."""
    if not episodes.environments:
        return None
    paid = []
    for environment, steps, end in zip(episodes.environments, episodes.step_rewards, episodes.episode_rewards):
        # A TRL class's get_reward() of None: this episode is not its to score (TRL's None).
        scored = getattr(environment, "pays", True) and not (end is None and hasattr(environment, "reward_method"))
        paid.append(sum(steps) + (end or 0.0) if scored else math.nan)
    return torch.tensor(paid)


def score_episodes(reward, rows: list[dict], episodes: Episodes, environment_weight: float = 1.0
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(b,) each episode's score -- the run's rewards (models, functions, URL: ``reward``, None for
    none) plus ``environment_weight`` x what its environment paid, each over the rows it scores
    (NaN-aware, TRL's rule for None scores) -- and each part by name, as it came (the
    ``reward/<name>`` metrics; the environment's is ``reward/environment``).  A row nothing scores
    stops the run, naming it."""
    parts: dict[str, torch.Tensor] = {}
    total = None
    names = []
    if reward is not None:
        environments = [users_object(environment) for environment in episodes.environments] or None
        batch = ScoringBatch(rows, episodes.prompts, episodes.texts, episodes.finished, episodes.sequences,
                             episodes.conversations or None, environments)
        total = reward(batch).float()
        parts = {name: part.float() for name, part in getattr(reward, "last_components", {}).items()}
        extra = getattr(reward, "last_extra", None) or {}  # TRL's log_extra: columns beside each completion
        episodes.logged = [{column: values[i] for column, values in extra.items() if i < len(values)}
                           for i in range(len(rows))] if extra else []
        names = list(parts) or [getattr(reward, "short_name", "reward")]
    paid = environment_rewards(episodes)
    if paid is not None:
        paid = paid.to(total.device if total is not None else "cpu")
        if total is not None and not parts:  # a reward object of one's own: its scores under its name
            parts[getattr(reward, "short_name", "reward")] = total
        parts["environment"] = paid
        names.append("the environment")
        total = environment_weight * paid if total is None else weighted_sum([total, paid], [1.0, environment_weight])
    if total is not None:  # None: nothing scores the episodes (a teacher's reward alone, --teacher)
        refuse_unscored(total, rows, names)
    return total, parts


def samples_of(episodes: Episodes, scores: torch.Tensor, count: int) -> list[dict]:
    """The first ``count`` rollouts for people to read (console, samples.jsonl, TensorBoard): the
    prompt and the response -- an episode's whole conversation after the prompt, each message on
    its own line -- and the score, beside the columns a reward function logged (TRL's ``log_extra``)."""
    samples = []
    for i in range(min(count, len(episodes.texts))):
        response = episodes.texts[i]
        if episodes.conversations:
            response = "\n".join(message_line(m) for m in episodes.conversations[i])
        logged = episodes.logged[i] if episodes.logged else {}  # a reward's log_extra columns, beside them
        samples.append({**logged, "prompt": episodes.prompts[i], "response": response, "score": float(scores[i])})
    return samples


def message_line(message: dict) -> str:
    """One message of an episode for people to read: its role, its words, the calls it makes."""
    calls = "".join(f" -> {call['function']['name']}({json.dumps(call['function']['arguments'])})"
                    for call in message.get("tool_calls") or [])
    return f"[{message['role']}] {message['content']}{calls}"


def rollout_records(rows: list[dict], episodes: Episodes, scores: torch.Tensor) -> list[dict]:
    """Each episode as one JSON-ready record (--save-rollouts): its prompt and messages, the token
    ids the model saw and wrote and the loss mask over them, each turn's reward, the tool calls
    with their results, and the score."""
    sequences, records = episodes.sequences, []
    for i, row in enumerate(rows):
        response = sequences.response_mask[i].bool()
        messages = episodes.conversations[i] if episodes.conversations else [
            {"role": "assistant", "content": episodes.texts[i]}]
        records.append({
            "source": row.get("_source"), "prompt": episodes.prompts[i], "messages": messages,
            "prompt_ids": sequences.prompt_ids[i][sequences.prompt_mask[i].bool()].tolist(),
            "response_ids": sequences.response_ids[i][response].tolist(),
            "loss_mask": sequences.loss_mask[i][response].tolist(),
            "turns": episodes.turns[i], "truncated": episodes.truncated[i], "finished": episodes.finished[i],
            "turn_rewards": episodes.step_rewards[i], "episode_reward": episodes.episode_rewards[i],
            "tool_calls": episodes.tool_logs[i] if episodes.tool_logs else [], "score": float(scores[i]),
            **({"logged": episodes.logged[i]} if episodes.logged else {}),
        })
    return records
