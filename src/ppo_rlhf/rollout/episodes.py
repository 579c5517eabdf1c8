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
assistant turn (:class:`ChatContinuation`).  Episodes of a batch advance turn by turn together:
each turn is one ``generator.generate`` call on the episodes still running.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import Counter
from dataclasses import dataclass, field

import torch

from ppo_rlhf.envs.protocol import EnvironmentFailed, as_messages
from ppo_rlhf.rollout.generation import Generator
from ppo_rlhf.rollout.reward import ScoringBatch
from ppo_rlhf.rollout.responses import encode_prompts, generate_responses
from ppo_rlhf.rollout.sequences import Sequences, is_stop, pad_columns


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
    stats: Counter = field(default_factory=Counter)  # tool calls, errors, timeouts, ... summed over the batch

    # The per-episode lists, which select and concat carry along with the tensors.
    LISTS = ("prompts", "texts", "finished", "turns", "truncated", "step_rewards", "turn_ends", "episode_rewards",
             "conversations", "environments", "tool_logs", "seeds")

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
             source=None, seeds: list[int] | None = None) -> Episodes:
    """The batch's episodes: one turn each without an environment ``source``
    (envs.EnvironmentSource), else as long as each one lasts.  ``seeds``: one per row, for the
    environments' reset (resume and several processes draw the same episodes)."""
    if source is None:
        out = generate_responses(model, tokenizer, generator, prompts, limits.max_prompt_length, limits.chat_template)
        b = len(prompts)
        return Episodes(out.sequences, prompts, out.texts, out.finished, getattr(generator, "last_logprobs", None),
                        turns=[1] * b, truncated=[False] * b, step_rewards=[[] for _ in range(b)],
                        turn_ends=[[int(n) - 1] for n in out.sequences.response_mask.sum(dim=1).tolist()],
                        episode_rewards=[None] * b)
    return EpisodeRunner(model, tokenizer, generator, limits, source).run(rows, prompts, seeds)


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


class ChatContinuation:
    """The tokens that follow a model's turn when the environment answers it, as the chat template
    writes them.

    The template is rendered twice on a stand-in conversation that ends with an assistant turn:
    closed there, and continued with the environment's messages and the next assistant opening.
    What the second adds to the first is the continuation; the end of the assistant turn the
    template writes (``<|im_end|>\\n`` for ChatML) goes before it, less the stop token the model
    wrote itself."""

    STAND_IN = "\x00assistant-turn\x00"

    def __init__(self, tokenizer, tools: list[dict] | None):
        self.tokenizer, self.tools = tokenizer, tools or None
        self.base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": self.STAND_IN}]
        self.closed = self.render(self.base, add_generation_prompt=False)
        self.turn_end = self.closed[self.closed.rindex(self.STAND_IN) + len(self.STAND_IN):]
        self.cache: dict[int | None, str] = {}  # the stop token -> what closes the turn after it

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def ids(self, messages: list[dict], last_token: int | None, stopped: bool) -> list[int]:
        """Token ids continuing a model turn that ended with ``last_token`` (``stopped``: a stop id)."""
        full = self.render(self.base + messages, add_generation_prompt=True)
        if not full.startswith(self.closed):
            raise ValueError("the chat template renders an assistant turn differently once messages follow it, so "
                             "an episode cannot continue from the tokens the model wrote; use another template "
                             "(--chat-template-file)")
        text = self.close_turn(last_token if stopped else None) + full[len(self.closed):]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def close_turn(self, stop_token: int | None) -> str:
        """What the template writes after an assistant turn that the model has not written itself:
        the separator after its stop token, or the whole end of turn after a turn cut short."""
        key = stop_token
        if key not in self.cache:
            written = self.tokenizer.decode([stop_token]) if stop_token is not None else ""
            self.cache[key] = self.turn_end[len(written):] if written and self.turn_end.startswith(written) \
                else self.turn_end
        return self.cache[key]


def first_messages(prompt, observation, role: str) -> list[dict]:
    """The episode's prompt as messages: the row's prompt with the reset's observation -- a string
    appended to the last user message (TRL's rule), messages replacing it all."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
    if isinstance(observation, str):
        if messages and messages[-1]["role"] == "user" and isinstance(messages[-1]["content"], str):
            return messages[:-1] + [{**messages[-1], "content": messages[-1]["content"] + observation}]
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
    tokens: list[list[int]] = field(default_factory=list)  # ids after the prompt
    owned: list[list[int]] = field(default_factory=list)  # 1: the model wrote it
    engine: list[list[float]] = field(default_factory=list)  # the engine's log-prob of each model token (else 0)
    turn_ends: list[list[int]] = field(default_factory=list)
    step_rewards: list[list[float]] = field(default_factory=list)
    conversations: list[list[dict]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        b = len(self.rows)
        for name in ("tokens", "owned", "engine", "turn_ends", "step_rewards", "conversations"):
            setattr(self, name, [[] for _ in range(b)])
        self.finished, self.truncated, self.texts = [False] * b, [False] * b, [""] * b

    def room(self, row: int) -> int:
        return self.budgets[row] - len(self.tokens[row])

    def add(self, row: int, ids: list[int], model: bool, logprobs: list[float] | None = None) -> None:
        self.tokens[row] += ids
        self.owned[row] += [int(model)] * len(ids)
        self.engine[row] += logprobs if logprobs is not None else [0.0] * len(ids)


class EpisodeRunner:
    """Episodes of one batch, run turn by turn (module docstring)."""

    def __init__(self, model, tokenizer, generator: Generator, limits: EpisodeLimits, source):
        self.model, self.tokenizer, self.generator, self.limits, self.source = model, tokenizer, generator, limits, source
        self.stop_ids = torch.as_tensor(generator.stop_token_ids)
        self.pad = tokenizer.pad_token_id
        self.device = next(model.parameters()).device
        self.has_engine_logprobs = False

    def call(self, environment, method: str, row: dict, *args, **kwargs):
        """``environment.method(...)``, its exception turned into EnvironmentFailed naming it and the row."""
        try:
            return getattr(environment, method)(*args, **kwargs)
        except EnvironmentFailed:
            raise
        except Exception as error:  # noqa: BLE001 -- the environment's bug: named, and the run stops
            raise EnvironmentFailed(environment, method, row, error) from error

    def run(self, rows: list[dict], prompts: list, seeds: list[int] | None) -> Episodes:
        environments = self.source.environments(len(rows))
        seeds = seeds if seeds is not None else [None] * len(rows)
        episode_prompts = []
        for row, prompt, environment, seed in zip(rows, prompts, environments, seeds):
            observation, _ = self.call(environment, "reset", row, seed=seed, options=row)
            episode_prompts.append(first_messages(prompt, observation, getattr(environment, "observation_role", "user")))
        self.continuation = ChatContinuation(self.tokenizer, getattr(environments[0], "tools", None))
        rendered = [self.continuation.render(messages, add_generation_prompt=True) for messages in episode_prompts]
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, rendered, self.limits.max_prompt_length, self.device,
                                                 add_special_tokens=False)
        contexts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        budgets = [self.limits.max_length - len(c) for c in contexts]
        if self.limits.max_episode_tokens is not None:
            budgets = [min(budget, self.limits.max_episode_tokens) for budget in budgets]
        play = Play(rows, environments, episode_prompts, contexts, budgets, seeds)
        # An engine holding weights of its own (vLLM) receives the actor's once for all the turns.
        with getattr(self.generator, "holding_weights", lambda model: contextlib.nullcontext())(self.model):
            active = list(range(len(rows)))
            for turn in range(self.limits.max_turns):
                if not active:
                    break
                active = self.turn(play, active, last=turn == self.limits.max_turns - 1)
        return self.episodes(play, prompt_ids, prompt_mask)

    def turn(self, play: Play, active: list[int], last: bool) -> list[int]:
        """One turn of the episodes still running: the model writes, each environment answers;
        returns the episodes that go on."""
        batch = [play.contexts[r] + play.tokens[r] for r in active]
        width = max(len(ids) for ids in batch)
        ids = torch.tensor([[self.pad] * (width - len(x)) + x for x in batch], device=self.device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=self.device)
        response_ids, response_mask = self.generator.generate(self.model, ids, mask)
        logprobs = getattr(self.generator, "last_logprobs", None)
        self.has_engine_logprobs = logprobs is not None
        going_on = []
        for j, r in enumerate(active):
            new = response_ids[j][response_mask[j].bool()].tolist()
            cut = len(new) > play.room(r)  # the episode's budget ends inside this turn
            new = new[:play.room(r)]
            play.add(r, new, model=True, logprobs=logprobs[j][:len(new)].tolist() if logprobs is not None else None)
            play.turn_ends[r].append(len(play.tokens[r]) - 1)
            stopped = bool(new) and bool(is_stop(torch.tensor(new[-1:]), self.stop_ids).item())
            play.finished[r] = stopped
            play.texts[r] = self.tokenizer.decode(new, skip_special_tokens=True)
            play.conversations[r].append({"role": "assistant", "content": play.texts[r]})
            environment = play.environments[r]
            observation, reward, terminated, truncated, _ = self.call(environment, "step", play.rows[r], play.texts[r])
            play.step_rewards[r].append(float(reward))
            if terminated or truncated or cut or last:
                play.truncated[r] = cut or bool(truncated) or (last and not terminated)
                continue
            answer = as_messages(observation, getattr(environment, "observation_role", "user"))
            following = self.continuation.ids(answer, new[-1] if new else None, stopped) if answer else []
            if len(following) + 1 > play.room(r):  # no room left for the model to answer
                play.truncated[r] = True
                continue
            play.conversations[r] += answer
            play.add(r, following, model=False)
            going_on.append(r)
        return going_on

    def episodes(self, play: Play, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Episodes:
        """The played batch as tensors: responses right-padded, the loss mask on the model's tokens."""
        width = max(1, max(len(t) for t in play.tokens))

        def padded(lists: list[list], fill, dtype=None) -> torch.Tensor:
            return torch.tensor([x + [fill] * (width - len(x)) for x in lists], dtype=dtype, device=self.device)

        sequences = Sequences(prompt_ids, prompt_mask, padded(play.tokens, self.pad),
                              padded([[1] * len(t) for t in play.tokens], 0), padded(play.owned, 0))
        stats, tool_logs, episode_rewards = Counter(), [], []
        for environment, row in zip(play.environments, play.rows):
            stats.update(getattr(environment, "tool_stats", None) or {})
            tool_logs.append(list(getattr(environment, "tool_log", [])))
            reward = getattr(environment, "reward", None)
            episode_rewards.append(self.call(environment, "reward", row) if callable(reward) else None)
        return Episodes(sequences, play.prompts, play.texts, play.finished,
                        padded(play.engine, 0.0, torch.float32) if self.has_engine_logprobs else None,
                        turns=[len(ends) for ends in play.turn_ends], truncated=play.truncated,
                        step_rewards=play.step_rewards, turn_ends=play.turn_ends, episode_rewards=episode_rewards,
                        conversations=play.conversations, environments=list(play.environments), tool_logs=tool_logs,
                        seeds=list(play.seeds), stats=stats)


def environment_rewards(episodes: Episodes) -> torch.Tensor | None:
    """(b,) what each episode's environment paid: its step rewards and its end-of-episode reward();
    None without an environment."""
    if not episodes.environments:
        return None
    return torch.tensor([sum(steps) + (end or 0.0) for steps, end in zip(episodes.step_rewards,
                                                                          episodes.episode_rewards)])


def score_episodes(reward, rows: list[dict], episodes: Episodes, environment_weight: float = 1.0
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(b,) each episode's score -- the run's rewards (models, functions, URL: ``reward``, None for
    none) plus ``environment_weight`` x what its environment paid -- and each part by name, as it
    came (the ``reward/<name>`` metrics; the environment's is ``reward/environment``)."""
    parts: dict[str, torch.Tensor] = {}
    total = None
    if reward is not None:
        batch = ScoringBatch(rows, episodes.prompts, episodes.texts, episodes.finished, episodes.sequences,
                             episodes.conversations or None, episodes.environments or None)
        total = reward(batch).float()
        parts = {name: part.float() for name, part in getattr(reward, "last_components", {}).items()}
    paid = environment_rewards(episodes)
    if paid is not None:
        paid = paid.to(total.device if total is not None else "cpu")
        if total is not None and not parts:  # a reward object of one's own: its scores under its name
            parts[getattr(reward, "short_name", "reward")] = total
        parts["environment"] = paid
        total = environment_weight * paid if total is None else total + environment_weight * paid
    return total, parts


def samples_of(episodes: Episodes, scores: torch.Tensor, count: int) -> list[dict]:
    """The first ``count`` rollouts for people to read (console, samples.jsonl, TensorBoard): the
    prompt and the response -- an episode's whole conversation after the prompt, each message on
    its own line -- and the score."""
    samples = []
    for i in range(min(count, len(episodes.texts))):
        response = episodes.texts[i]
        if episodes.conversations:
            response = "\n".join(f"[{m['role']}] {m['content']}" for m in episodes.conversations[i])
        samples.append({"prompt": episodes.prompts[i], "response": response, "score": float(scores[i])})
    return samples


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
        })
    return records
