"""Rewards: one score per finished response, from a reward model, Python functions or an HTTP
endpoint (rollout/reward_http.py), several of them summed with weights (docs/design.md, "Rewards").

Every reward is called as ``reward(batch) -> (B,) tensor`` with a :class:`ScoringBatch`: the
prompt rows as given in the data, the decoded responses, which of them ended with EOS, and
the token sequences (for a reward model that shares the policy's tokenizer).  Each also has a
``short_name`` (its metrics' name), a ``description`` (the run's plan) and ``waits`` (True: it
also has ``score_async(batch)``, awaited with the other waiting rewards of the batch).

What every reward stands on is rollout/reward_base.py; a reward model, rollout/reward_model.py.
Here: Python functions (TRL's convention), their weighted sum, and the options that choose them.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import traceback
from dataclasses import dataclass

import torch

from ppo_rlhf.config import REWARD, ConfigError, above, any_number, at_least, check, option
from ppo_rlhf.rollout.reward_base import (  # noqa: F401 -- the base's names, where callers find them
    RewardError, ScoringBatch, ScoringReward, check_reward_url, refuse_unscored, row_columns, run_coroutine,
    unscored_rows, validated_scores, weighted_sum)
from ppo_rlhf.rollout.reward_model import (  # noqa: F401 -- where callers find them
    REWARD_PADDING_SIDE, ModelReward, last_attended, last_token_scores, token_scores)
from ppo_rlhf.user_code import load_function  # noqa: F401 -- also ppo_rlhf.rollout.reward.load_function


def check_columns(rewards, rows: list[dict], source: str) -> None:
    """ConfigError, before any model is loaded, if a reward needs a field the rows lack (or one it
    cannot send); ``source`` names the data (a row's own ``_source`` is preferred)."""
    for reward in rewards:
        if hasattr(reward, "check_columns"):
            reward.check_columns(rows, source)


# Keywords a reward function may name besides its data columns; they win over a column of the same name.
RESPONSES, TRL_RESPONSES = "responses", "completions"


# TRL's keywords of the run around a reward: its transformers.TrainerState, and the two loggers.
RUN_KEYWORDS = ("trainer_state", "log_extra", "log_metric")


PASSED_BY_PPO_RLHF = ("prompts", RESPONSES, TRL_RESPONSES, "finished", "completion_ids", "conversations",
                      "environments", *RUN_KEYWORDS)


# A function whose first two positional parameters include one of these is called TRL's way, every
# argument by keyword: TRL's own names, which no function called (prompts, responses) puts there.
KEYWORD_ONLY_NAMES = (TRL_RESPONSES, "environments", "completion_ids", "conversations", "finished", *RUN_KEYWORDS)


def fresh_trainer_state():
    """A TrainerState at step 0, for a reward scored outside a training run (``ppo-rlhf eval``)."""
    from transformers import TrainerState

    return TrainerState()


def is_conversational(prompt) -> bool:
    """A prompt given as chat messages: a list of {role, content} dicts (TRL tells them by the same shape)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "role" in m for m in prompt)


def trl_completions(prompts: list, responses: list[str]) -> list:
    """The responses as TRL's GRPOTrainer hands them to a reward function: after a conversational
    prompt, a list holding one assistant message (``completion[0]["content"]`` is the text); after
    a plain prompt, the text itself."""
    return [[{"role": "assistant", "content": response}] if is_conversational(prompt) else response
            for prompt, response in zip(prompts, responses)]


# What a reward function may raise and be reported for: any error, and SystemExit (sys.exit in
# the function would otherwise end the run with the function's exit code and no word of why).
# KeyboardInterrupt is left alone: Ctrl-C stops the run at its next safe point.
USER_ERRORS = (Exception, SystemExit)


class FunctionReward(ScoringReward):
    """A Python function as the reward (docs/design.md, "Rewards").

    Called as ``f(prompts, responses, **columns) -> list[float]``, one score per response:

    - ``prompts``, ``responses``: the first two positional parameters, whatever their names.
      A function with a parameter named ``completions``, or one of TRL's keywords (``environments``,
      ``completion_ids``) among its first two, or fewer than two positional parameters and
      ``**kwargs`` (``def reward(environments, **kwargs)``, ``def reward(**kwargs)``), is called the way TRL's
      GRPOTrainer calls its reward functions instead, every argument by keyword: ``prompts=``,
      ``completions=`` (the responses: text after a plain prompt, ``[{"role": "assistant",
      "content": text}]`` after a conversational one, an episode's messages after its prompt --
      assistant messages carrying the ``tool_calls`` they made -- as TRL passes them), and
      ``responses=`` too, so reward functions written for TRL run unchanged.
    - ``environments``: with episodes, each one's environment -- the user's own object (a TRL
      class's instance, a gymnasium environment), as TRL passes it.
    - ``columns``: every field of the prompt row other than the prompt (``answer``, ``label``,
      ...), each as a list with one value per response: its own prompt row's value.
    - ``finished``: list of bools, which responses ended with EOS.
    - ``completion_ids``: list of lists of token ids, each response's tokens in the policy's
      tokenizer (TRL's name).
    - ``trainer_state`` (TRL's; a TRL-style function's ``**kwargs`` get these three, one called
      ``(prompts, responses, **columns)`` only those it names): the run's ``transformers.TrainerState`` -- ``global_step`` the
      iterations done, ``max_steps`` the run's iterations, ``epoch`` the passes over the prompts
      so far -- moved on by the trainer each iteration (:meth:`follow_run`); outside a run, one at
      step 0.
    - ``log_metric(name, value)`` (TRL's): a number logged under ``name`` in the iteration's
      metrics (metrics.jsonl, the trackers), the values of an iteration averaged over every call
      and process; during a held-out evaluation, under ``eval/name``.
    - ``log_extra(column, values)`` (TRL's): one value per response, kept beside each in
      samples.jsonl and ``--save-rollouts``' records (``logged``), as TRL adds a column to its
      completions table.

    A score may be None for a response the function does not apply to (TRL's convention): the
    row is left to the run's other rewards (:func:`weighted_sum`), and one that none scores stops
    the run, naming it.

    A function carrying a ``check_requirements()`` attribute has it called here, at start (a
    missing optional package is then a ConfigError before any model loads).

    The function gets the keywords it names, or all of them if it takes ``**kwargs``.  A column it
    names without a default and the data lacks stops the run at start (:meth:`check_columns`).
    An ``async def`` function is awaited; several waiting rewards of one batch run concurrently
    (:class:`CombinedReward`).  Each call gets its own copies of the lists.
    """

    def __init__(self, function, name: str | None = None, prompt_field: str = "prompt", description: str | None = None):
        self.function = load_function(function) if isinstance(function, str) else function
        self.name = name or (function if isinstance(function, str) else getattr(function, "__name__", "reward"))
        self.short_name = getattr(self.function, "__name__", self.name)  # its metrics' name, reward/<short_name>
        self.description = description or f"function {self.name}"  # for the run's plan
        self.prompt_field = prompt_field
        # A function that needs an optional package says so at start (ppo_rlhf.rewards:math_equal).
        check_requirements = getattr(self.function, "check_requirements", None)
        if callable(check_requirements):
            check_requirements()
        # An async function, or an object whose __call__ is one.
        self.waits = (inspect.iscoroutinefunction(self.function)
                      or inspect.iscoroutinefunction(getattr(self.function, "__call__", None)))
        signature = inspect.signature(self.function)
        parameters = signature.parameters
        positional_names = [name for name, p in parameters.items()
                            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        self.takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        self.trl_style = (TRL_RESPONSES in parameters
                          or any(name in KEYWORD_ONLY_NAMES for name in positional_names[:2])
                          or (len(positional_names) < 2 and self.takes_all))
        by_name = [name for name, p in parameters.items()
                   if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
        # Positional call: the first two positional parameters take prompts and responses.
        positional = [] if self.trl_style else [
            name for name, p in parameters.items()
            if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)][:2]
        self.named = [name for name in by_name if name not in positional]
        self.required_columns = [name for name in self.named if parameters[name].default is inspect.Parameter.empty
                                 and name not in PASSED_BY_PPO_RLHF]
        self.trainer_state = None  # the run's, once a trainer gives it (follow_run)
        self.logged: dict[str, tuple[float, int]] = {}  # log_metric's (sum, count) since new_iteration
        self.last_extra: dict[str, list] = {}  # log_extra's columns of the last call
        try:
            args, kwargs = self._arguments([], [], {name: [] for name in self.required_columns}, [], [], None, [])
            signature.bind(*args, **kwargs)
        except TypeError:
            raise ConfigError(f"reward function {self.name} must take (prompts, responses), or TRL's keywords "
                              f"(completions=, environments=, ...), and optionally finished and data columns by "
                              f"name (or **kwargs); its signature is {signature}") from None

    def check_columns(self, rows: list[dict], source: str) -> None:
        """ConfigError naming the function, the column and the data if a column it requires is missing."""
        for column in self.required_columns:
            lacking = next((row for row in rows if column not in row or column == self.prompt_field), None)
            if lacking is None:
                continue
            if column == self.prompt_field:
                raise ConfigError(f"reward function {self.name} takes '{column}', the prompt field of {source}: "
                                  f"prompts come as the first argument, not as a column")
            fields = sorted(k for k in lacking if k not in ("_source", self.prompt_field))
            raise ConfigError(f"reward function {self.name} takes a column '{column}', but {lacking.get('_source', source)} "
                              f"has no field '{column}' (its columns: {', '.join(fields) or 'none'}); add the field "
                              f"to the prompt rows or give the parameter a default")

    def _arguments(self, prompts: list, responses: list, columns: dict, finished: list,
                   completion_ids, conversations: list | None = None, environments: list | None = None
                   ) -> tuple[list, dict]:
        """(positional, keyword) arguments of one call: the keywords the function names, or all.
        Episodes add ``conversations`` (each one's messages after the prompt) and ``environments``
        (TRL's name); TRL-style functions get the conversations as their ``completions``, as TRL
        passes a multi-turn completion."""
        offered = {**columns, "finished": finished, "completion_ids": completion_ids,
                   "trainer_state": self.trainer_state if self.trainer_state is not None else fresh_trainer_state(),
                   "log_metric": self.log_metric, "log_extra": self.log_extra}
        episode = {"environments": environments,  # a single turn: an episode of one message, with no environment
                   "conversations": conversations or [[{"role": "assistant", "content": r}] for r in responses]}
        if self.trl_style:
            # An episode's completion is its conversation (TRL's multi-turn completions); a single
            # turn's is messages after a chat prompt, text after a text prompt.
            offered.update(prompts=prompts, responses=responses, completions=conversations if conversations is not None
                           else trl_completions(prompts, responses))
            args = []
        else:
            args = [prompts, responses]
        if self.takes_all:  # **kwargs: the episode's keywords where there are episodes (TRL's rule for environments)
            named = {key: value for key, value in episode.items() if key in self.named}
            if not self.trl_style:  # f(prompts, responses, **columns): the run's keywords only by name
                offered = {key: value for key, value in offered.items() if key not in RUN_KEYWORDS or key in self.named}
            return args, {**offered, **(episode if conversations is not None else named)}
        return args, {k: v for k, v in {**offered, **episode}.items() if k in self.named}

    def follow_run(self, state) -> None:
        self.trainer_state = state

    def new_iteration(self) -> None:
        self.logged = {}

    def logged_metrics(self) -> dict[str, tuple[float, int]]:
        return dict(self.logged)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: ``value`` logged under ``name``, averaged over the iteration's calls."""
        if not isinstance(name, str) or not name:
            raise RewardError(f"reward function {self.name} called log_metric with the name {name!r}; a metric's "
                              f"name is a non-empty string")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardError(f"reward function {self.name} called log_metric({name!r}, {value!r}); the value is "
                              f"one finite number")
        total, count = self.logged.get(name, (0.0, 0))
        self.logged[name] = (total + float(value), count + 1)

    def log_extra(self, column: str, values: list) -> None:
        """TRL's ``log_extra``: a column of ``values``, one per response of this call, kept beside each."""
        if not isinstance(column, str) or not column:
            raise RewardError(f"reward function {self.name} called log_extra with the column {column!r}; a column's "
                              f"name is a non-empty string")
        self.last_extra.setdefault(column, []).extend(list(values))

    def _call(self, batch: ScoringBatch):
        """The function's result for ``batch`` (a coroutine for an async function)."""
        self.last_extra = {}
        wants_ids = self.takes_all or "completion_ids" in self.named
        completion_ids = ([ids[mask.bool()].tolist() for ids, mask in
                           zip(batch.sequences.response_ids, batch.sequences.response_mask)] if wants_ids else None)
        conversations = copy.deepcopy(batch.conversations) if batch.conversations is not None else None
        environments = batch.environments if batch.environments is not None else [None] * len(batch.responses)
        args, kwargs = self._arguments(copy.deepcopy(batch.prompts), list(batch.responses),
                                       row_columns(batch.rows, self.prompt_field), list(batch.finished), completion_ids,
                                       conversations, environments)
        return self.function(*args, **kwargs)

    def _raised(self, error: Exception) -> RewardError:
        frame = traceback.extract_tb(error.__traceback__)[-1]
        return RewardError(f"reward function {self.name} raised {type(error).__name__}: {error} "
                           f"({frame.filename}, line {frame.lineno}, in {frame.name})")

    async def score_async(self, batch: ScoringBatch) -> torch.Tensor:
        try:
            scores = self._call(batch)
            if inspect.isawaitable(scores):
                scores = await scores
        except USER_ERRORS as error:  # the user's function, named with where it raised
            raise self._raised(error) from None
        return validated_scores(scores, len(batch.prompts), f"reward function {self.name}", allow_none=True)

    def __call__(self, batch: ScoringBatch) -> torch.Tensor:
        if self.waits:
            return run_coroutine(self.score_async(batch))
        try:
            scores = self._call(batch)
        except USER_ERRORS as error:  # the user's function, named with where it raised
            raise self._raised(error) from None
        return validated_scores(scores, len(batch.prompts), f"reward function {self.name}", allow_none=True)


def unique_names(names: list[str]) -> list[str]:
    """``names`` with repeats numbered (f, f -> f, f_2), so each reward has a metric of its own."""
    seen: dict[str, int] = {}
    unique = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        unique.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return unique


class CombinedReward(ScoringReward):
    """Every reward of a run as one: the score is ``sum(weight * reward)`` (docs/design.md, "Rewards"),
    over the rewards that score each row (a function's None leaves it to the others: NaN here,
    :func:`weighted_sum`; a row none scores is NaN, refused by the caller once every reward of the
    episode is in).

    ``last_components`` holds each reward's own (B,) scores of the last call, by name, for the
    trainer's ``reward/<name>`` metrics.  Rewards that wait (async functions, an HTTP endpoint)
    are awaited together, concurrently; the others run one after another in the caller's thread,
    where the trainer's no-grad and autocast settings hold (torch keeps them per thread), and
    where a user's function needs no thread safety.
    """

    def __init__(self, parts: list, weights: list[float] | None = None):
        if not parts:
            raise ConfigError("no reward: give --reward-model DIR, --reward-fn module:function or --reward-url URL")
        weights = [1.0] * len(parts) if not weights else [float(w) for w in weights]
        if len(weights) != len(parts):
            raise ConfigError(f"{len(weights)} reward weights for {len(parts)} rewards "
                              f"({', '.join(p.description for p in parts)})")
        self.parts, self.weights = parts, weights
        self.names = unique_names([part.short_name for part in parts])
        self.last_components: dict[str, torch.Tensor] = {}
        self.none_counts = dict.fromkeys(self.names, 0.0)  # this iteration's None (NaN) scores of each reward
        self.warned_none: set[str] = set()

    @property
    def model(self):
        """The reward model's network, if a reward model is one of the rewards: the trainer moves,
        freezes and shards it with the other frozen roles."""
        return next((part.model for part in self.parts if isinstance(part, ModelReward)), None)

    def check_columns(self, rows: list[dict], source: str) -> None:
        check_columns(self.parts, rows, source)

    def new_iteration(self) -> None:
        for part in self.parts:
            part.new_iteration()
        self.none_counts = dict.fromkeys(self.names, 0.0)

    def follow_run(self, state) -> None:
        for part in self.parts:
            part.follow_run(state)

    def logged_metrics(self) -> dict[str, tuple[float, int]]:
        """The parts' log_metric values, a name logged by several summed together."""
        logged: dict[str, tuple[float, int]] = {}
        for part in self.parts:
            for name, (total, count) in part.logged_metrics().items():
                before = logged.get(name, (0.0, 0))
                logged[name] = (before[0] + total, before[1] + count)
        return logged

    @property
    def last_extra(self) -> dict[str, list]:
        """The columns the parts logged in their last call (log_extra), a later part's winning a name."""
        return {column: values for part in self.parts for column, values in getattr(part, "last_extra", {}).items()}

    def iteration_counts(self) -> dict[str, float]:
        """The parts' counts (a judge's judge/unparsed), and with several rewards each one's
        ``reward/<name>_none``: the responses it gave None (NaN) for, scored by the others alone."""
        counts: dict[str, float] = {}
        for part in self.parts:
            for name, count in part.iteration_counts().items():
                counts[name] = counts.get(name, 0.0) + count
        if len(self.parts) > 1:
            counts.update({f"reward/{name}_none": count for name, count in self.none_counts.items()})
        return counts

    def plan(self) -> str:
        """The rewards and their weights, for the run's plan."""
        if len(self.parts) == 1 and self.weights[0] == 1.0:
            return self.parts[0].description
        return " + ".join(f"{w:g} x {part.description}" for part, w in zip(self.parts, self.weights))

    def __call__(self, batch: ScoringBatch) -> torch.Tensor:
        scores = {name: part(batch) for name, part in zip(self.names, self.parts) if not part.waits}
        waiting = [(name, part) for name, part in zip(self.names, self.parts) if part.waits]
        if waiting:
            async def all_waiting():
                return await asyncio.gather(*(part.score_async(batch) for _, part in waiting))
            scores.update(zip([name for name, _ in waiting], run_coroutine(all_waiting())))
        self.last_components = {name: scores[name] for name in self.names}
        self.last_unscored = self.unscored_by_parts(len(batch.responses))
        if len(self.parts) == 1 and self.weights[0] == 1.0:
            return self.last_components[self.names[0]]  # one reward: its scores as they came
        if len(self.parts) > 1:
            self.count_nones()
        device = self.last_components[self.names[0]].device
        return weighted_sum([self.last_components[name].to(device) for name in self.names], self.weights)

    def unscored_by_parts(self, count: int) -> torch.Tensor | None:
        """(B,) the rows a reward of non-zero weight could not score in the last call (a judge's
        unparsed answers): their sum is unknown, and scoring them by the other rewards alone would
        put them on another scale than their group's, so the whole row is left out of the update;
        None when there is none."""
        unscored = torch.zeros(count, dtype=torch.bool)
        for part, weight in zip(self.parts, self.weights):
            rows = getattr(part, "last_unscored", None)
            if rows is not None and weight != 0:
                unscored |= rows.cpu().bool()
        return unscored if unscored.any() else None

    def count_nones(self) -> None:
        """Beside other rewards, a reward's None (NaN) leaves its rows to them (TRL's rule):
        counted in ``reward/<name>_none``, and said once per reward."""
        from ppo_rlhf.distributed import is_main_process

        for name, part in zip(self.names, self.parts):
            nones = int(torch.isnan(self.last_components[name]).sum())
            self.none_counts[name] += nones
            if nones and name not in self.warned_none:
                self.warned_none.add(name)
                if is_main_process():
                    print(f"warning: the reward {part.description} gave no score (None, or NaN) for {nones} of "
                          f"{self.last_components[name].numel()} responses; each is scored by the other rewards "
                          f"alone (TRL's rule for None), and reward/{name}_none counts them every iteration",
                          flush=True)


JUDGE_SCORE = "number:0:10"  # --judge-score's default: a 0-10 rating, the commonest judge prompt's


JUDGE_MAX_NEW_TOKENS = 32  # a rating, with room for a few words before it


@dataclass
class RewardOptions:
    """The reward fields shared by ``ppo`` and ``eval`` besides ``reward_model``, which each
    stage declares with its own help (docs/design.md, "Rewards")."""

    option_group = REWARD  # --help's group of all these options (config.py, GROUPS)

    reward_fn: list[str] = option([], "reward functions 'package.module:function' (or file.py:function), called as "
                                      "f(prompts, responses, **columns) -> scores, each prompt row's other fields "
                                      "as columns; several: repeat the flag or separate with commas", first=True)
    reward_url: str | None = option(None, "score through an HTTP endpoint: POST {prompts, responses, columns} -> "
                                          "{scores}; one more reward, named 'url'", first=True)
    reward_judge: str | None = option(None, "score with an LLM judge: a causal LM folder (run here, batched, greedy) "
                                            "or an OpenAI-compatible chat-completions URL (e.g. http://host:8000/v1); "
                                            "one more reward, named 'judge' (docs/rewards.md)")
    judge_template: str | None = option(None, "Jinja template of the judge's input, given prompt, response and the "
                                              "prompt row's columns by name (empty: a built-in one for --judge-score)")
    judge_score: str = option(JUDGE_SCORE, "how the judge's answer becomes a score: number:LOW:HIGH (the number "
                                             "it gives as the score, 'Score: 7', '7/10', '[[7]]' or the answer's only "
                                             "number, which must lie in [LOW, HIGH]; docs/rewards.md) or token:TEXT "
                                             "(the probability of TEXT as its first token, e.g. token:Yes); an answer "
                                             "without a score is left out of the update and counted as judge/unparsed")
    judge_score_pattern: str | None = option(None, "a Python regular expression that finds the score in the judge's "
                                                   "answer (number: scores), its group 1 the number; its last match "
                                                   "counts (empty: the built-in rules, docs/rewards.md)")
    judge_model: str | None = option(None, "the model name sent to a judge URL (empty: the first the server lists "
                                           "at /models)")
    judge_max_new_tokens: int = option(JUDGE_MAX_NEW_TOKENS, "longest answer of the judge in tokens (number scores)", range=above(0))
    reward_weights: list[float] = option([], "weight of each reward in the score, in the order reward model, "
                                             "functions, URL, judge (empty: 1 each); the score is the weighted sum",
                                             range=any_number(), first=True)
    reward_timeout: float = option(60.0, "seconds to wait for the reward URL's answer to one request", range=above(0))
    reward_retries: int = option(3, "retries of a reward URL request that timed out, could not connect, or got "
                                    "HTTP 429 / 5xx (another 4xx fails at once)", range=at_least(0))
    reward_backoff: float = option(1.0, "seconds before the first retry of a reward URL request, doubled at each",
                                   range=at_least(0))

    def reward_count(self) -> int:
        """How many rewards were asked for (a task's rule, used when none is, not counted)."""
        return (bool(getattr(self, "reward_model", None)) + len(self.reward_fn) + bool(self.reward_url)
                + bool(self.reward_judge))

    def validate_rewards(self) -> None:
        """The reward URL's form, and the weights: not all 0, and one per reward where the config
        names the rewards (a task's rule counts as one).  A config that names none, and no task,
        leaves the count to the rewards a trainer is given in Python (``PPOTrainer(config,
        reward=[f, g])``), which CombinedReward holds to it."""
        if self.reward_url is not None:
            check_reward_url(self.reward_url)
        self.validate_judge()
        rewards = self.reward_count() or (1 if getattr(self, "task", None) is not None else 0)
        if self.reward_weights and rewards and len(self.reward_weights) != rewards:
            raise ConfigError(f"invalid value for 'reward_weights': {len(self.reward_weights)} weights "
                              f"{self.reward_weights} for {rewards} reward(s); give one weight per reward, in the "
                              f"order reward model, functions, URL, judge")
        # With a teacher (ppo --teacher) its per-token reward is a signal of its own: every other reward
        # weighted 0 is pure distillation.
        if self.reward_weights and not any(self.reward_weights) and not getattr(self, "teacher", None):
            raise ConfigError(f"invalid value for 'reward_weights': {self.reward_weights}; with every reward weighted "
                              f"0 every response scores 0 and there is nothing to learn: give at least one weight "
                              f"that is not 0")


    def validate_judge(self) -> None:
        """--reward-judge's form, its score's spec and pattern (a regular expression with a group, for
        number: scores), and the judge options refused without a judge (or, --judge-model, without a
        judge URL: a local judge is the folder it names)."""
        from ppo_rlhf.rollout.judge import JudgeScore, is_url

        judge = self.reward_judge
        if judge is None:
            for key, default in (("judge_template", None), ("judge_score", JUDGE_SCORE), ("judge_model", None),
                                 ("judge_max_new_tokens", JUDGE_MAX_NEW_TOKENS), ("judge_score_pattern", None)):
                check(getattr(self, key) == default, key, "left out without --reward-judge", getattr(self, key))
            return
        JudgeScore.parse(self.judge_score, self.judge_score_pattern)
        if is_url(judge):
            check_reward_url(judge, "reward_judge")
        else:
            check(self.judge_model is None, "judge_model", f"left out with a local judge (--reward-judge {judge} is "
                                                           f"the model): it names the model a judge URL serves",
                  self.judge_model)
