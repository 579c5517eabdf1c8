"""What every reward stands on (docs/design.md, "Rewards"): the batch a reward scores
(:class:`ScoringBatch`), the reward's contract (:class:`ScoringReward`), the checks of what a
reward hands back (one finite number per response, or None: not this reward's row), the
weighted sum of several, and the columns of the prompt rows a reward function is given.  Reward
models (rollout/reward_model.py), functions and their sums (rollout/reward.py), URLs
(rollout/reward_http.py) and judges (rollout/judge.py) are built on it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import math
import numbers
import re
from dataclasses import dataclass

import torch

from ppo_rlhf.config import ConfigError
from ppo_rlhf.rollout.sequences import Sequences


@dataclass
class ScoringBatch:
    rows: list[dict]  # the prompt rows, as read from the data
    prompts: list[str]  # (B) prompt texts (an episode's: the row's, with what its environment's reset observed)
    responses: list[str]  # (B) decoded responses, special tokens removed (an episode's: its last model turn)
    finished: list[bool]  # (B) the response ended with EOS
    sequences: Sequences  # token ids of prompt + response in the policy's tokenizer
    conversations: list[list[dict]] | None = None  # (B) an episode's messages after the prompt; None: single turn
    environments: list | None = None  # (B) each episode's environment object (TRL's ``environments=``)


class ScoringReward:
    """The base of every reward that scores a :class:`ScoringBatch` itself: ``reward(batch) -> (B,)``
    scores.  How the trainer tells a reward object from a plain Python function: an instance of this
    class is used as it is, any other callable is a function ``f(prompts, responses, **columns)``
    and gets wrapped in a :class:`FunctionReward` (docs/design.md, "Rewards").

    What a :class:`CombinedReward` reads of its parts, with defaults a subclass may override."""

    short_name = "reward"  # its metrics' name, reward/<short_name>
    description = "a reward object"  # for the run's plan
    waits = False  # True: scored by ``await score_async(batch)``, concurrently with the other waiting rewards
    # (B,) bool of the last call: the responses it was asked to score and could not (a judge's
    # unparsed answers), whose scores are stand-ins; the trainer gives them advantage 0 and leaves
    # them out of every baseline (trainers/estimators.py).  None: every score is real.  Not the
    # same as a None score (NaN), which says the response is not this reward's to score.
    last_unscored: torch.Tensor | None = None

    def __call__(self, batch: ScoringBatch) -> torch.Tensor:
        raise NotImplementedError

    def new_iteration(self) -> None:
        """A PPO iteration (or an evaluation) starts: forget what was kept for the last one (a judge's
        cached scores and counts)."""

    def iteration_counts(self) -> dict[str, float]:
        """Counts since :meth:`new_iteration`, logged as they are named (a judge's ``judge/unparsed``)."""
        return {}

    def logged_metrics(self) -> dict[str, tuple[float, int]]:
        """What the reward logged since :meth:`new_iteration` (TRL's ``log_metric``): each name's
        (sum, count) of values, averaged over every process's calls when logged."""
        return {}

    def follow_run(self, state) -> None:
        """The run's ``transformers.TrainerState`` (TRL's ``trainer_state=``), which the trainer
        moves on each iteration: given to what reads it (reward functions)."""


class RewardError(ValueError):
    """A reward that returned something unusable; the message names the reward."""


def _real(score) -> bool:
    """A real number: int, float, bool (True is 1, False 0) or a numpy scalar of them; never text."""
    return isinstance(score, numbers.Real)


def validated_scores(scores, count: int, what: str, allow_none: bool = False) -> torch.Tensor:
    """``scores`` as a (count,) float32 tensor, or RewardError naming ``what`` gave them (e.g.
    "reward function mod:f"): one finite real number per response, whichever reward it came from;
    with ``allow_none``, None for a response the reward does not apply to (TRL's convention for
    rewards of one task in a mixed data set), as NaN.

    A list or tuple of real numbers, or a 1-D numpy array or tensor; booleans count as 1 and 0 (a
    check's pass or fail).  Refused (docs/design.md, "Rewards"): anything else -- a dict, a string,
    a set (no order), a generator (no length until consumed), one number -- and items that are
    not real numbers: numbers as text, nested lists, complex numbers, and NaN or an infinity."""
    if isinstance(scores, torch.Tensor) or type(scores).__module__ == "numpy":
        scores = scores.tolist() if getattr(scores, "ndim", 0) == 1 else scores
    if not isinstance(scores, (list, tuple)):
        raise RewardError(f"{what} must return a list of numbers, one per response, got {type(scores).__name__}")
    bad = [s for s in scores if not (_real(s) or (allow_none and s is None))]
    if bad:
        raise RewardError(f"{what} must return a list of numbers, one per response, got a {type(scores).__name__} "
                          f"holding {bad[0]!r} ({type(bad[0]).__name__})"
                          + (" (None marks a response it does not score)" if allow_none else ""))
    if len(scores) != count:
        raise RewardError(f"{what} returned {len(scores)} scores for {count} responses")
    bad = [i for i, s in enumerate(scores) if s is not None and not math.isfinite(float(s))]
    if bad:
        raise RewardError(f"{what} returned a non-finite score ({scores[bad[0]]}) at index {bad[0]}"
                          + ("; None marks a response it does not score" if allow_none else ""))
    return torch.tensor([math.nan if s is None else float(s) for s in scores], dtype=torch.float32)


def weighted_sum(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """(B,) sum of ``weight * part`` over the parts that score each row (NaN: does not apply), NaN
    where none does (TRL's NaN-aware sum: a reward's None leaves the row to the others)."""
    stacked = torch.stack([w * part.float() for part, w in zip(parts, weights)])  # (R, B)
    total = stacked.nansum(dim=0)
    return torch.where(torch.isnan(stacked).all(dim=0), torch.full_like(total, math.nan), total)


def refuse_unscored(scores: torch.Tensor, rows: list[dict], names: list[str]) -> None:
    """RewardError naming the first row no reward scored (every one gave None): TRL warns and trains
    it with no advantage; here it is a bug in the rewards, said at its row."""
    unscored = torch.isnan(scores).nonzero().flatten().tolist()
    if unscored:
        row = rows[unscored[0]] if unscored[0] < len(rows) else {}
        where = row.get("_source", f"row {unscored[0]}") if isinstance(row, dict) else f"row {unscored[0]}"
        raise RewardError(f"no reward scored {where} ({len(unscored)} response(s) in this batch): "
                          f"{', '.join(names)} each returned None for it; a None leaves a response to the other "
                          f"rewards, and at least one must score it")


def unscored_rows(reward, count: int) -> torch.Tensor:
    """(count,) bool: the responses the last call of ``reward`` (None: no reward) could not score,
    its ``last_unscored`` (a judge's unparsed answers); all False when it scored them all."""
    rows = getattr(reward, "last_unscored", None)
    if rows is None:
        return torch.zeros(count, dtype=torch.bool)
    if tuple(rows.shape) != (count,):
        raise RewardError(f"{getattr(reward, 'description', 'a reward')}'s last_unscored holds {tuple(rows.shape)} "
                          f"for {count} responses; it must be one bool a response of its last call, or None")
    return rows.bool()


def averaged_logs(gathered: list[dict[str, tuple[float, int]]]) -> dict[str, float]:
    """Each name's mean over the (sum, count) pairs ``logged_metrics`` gave in every process
    (TRL's rule for ``log_metric``: the values of a step averaged across processes)."""
    totals: dict[str, list[float]] = {}
    for logged in gathered:
        for name, (total, count) in logged.items():
            running = totals.setdefault(name, [0.0, 0])
            running[0], running[1] = running[0] + total, running[1] + count
    return {name: total / count for name, (total, count) in totals.items() if count}


def run_coroutine(coroutine):
    """Run a coroutine to its end from synchronous code.  Called where an event loop already runs
    (a notebook), it runs on a loop of its own in a helper thread: asyncio allows one loop per thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def row_columns(rows: list[dict], prompt_field: str) -> dict[str, list]:
    """Each field of the prompt rows but the prompt (and the loader's ``_source``), as one list
    with a value per row (None where a row lacks the field).  Rows repeated for K samples per
    prompt are adjacent, so each response's value is its own prompt row's.  Deep copies: a
    reward that changes what it is given cannot change the trainer's data."""
    names = dict.fromkeys(key for row in rows for key in row if key not in (prompt_field, "_source"))
    return {name: copy.deepcopy([row.get(name) for row in rows]) for name in names}


URL_ALLOWED = "an http:// or https:// URL with a host and, if it names one, a port from 1 to 65535 " \
              "(e.g. http://localhost:8000/score)"


def check_reward_url(url: str, key: str = "reward_url") -> None:
    """ConfigError unless ``url`` could be requested: http or https, a host name (or address)
    without spaces, a port from 1 to 65535.  Checked when the config is built, so a URL that
    can never answer stops the run before any model loads, not after its first rollout and
    every retry (docs/design.md, "Rewards").  ``key``: the setting that holds it."""
    from urllib.parse import urlsplit

    def refused(why: str) -> ConfigError:
        return ConfigError(f"invalid value for '{key}': {url!r}: {why}; allowed: {URL_ALLOWED}")

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not url.lower().startswith(("http://", "https://")):
        raise refused("not an http:// or https:// URL")
    try:
        port = parts.port
    except ValueError:
        raise refused(f"the port in {parts.netloc!r} is not a number from 1 to 65535") from None
    if port == 0:
        raise refused(f"port 0 in {parts.netloc!r} is no port a server listens on")
    host = parts.hostname or ""
    if not host:
        raise refused(f"it names no host (before the port or path: {parts.netloc!r})")
    if not re.fullmatch(r"[\w.-]+|[0-9a-f:.]*:[0-9a-f:.]*", host, flags=re.IGNORECASE):
        raise refused(f"the host {host!r} holds characters no host name has")
