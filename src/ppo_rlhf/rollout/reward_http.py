"""A reward served over HTTP (``--reward-url``): a judge model, a sandbox that runs code, a
service another team runs (docs/design.md, "Rewards").

One POST per scoring call, JSON both ways::

    request:  {"prompts": [...], "responses": [...], "columns": {"answer": [...], ...}}
    answer:   {"scores": [0.0, 1.0, ...]}          one number per response, in order

Connection errors, timeouts, HTTP 429 and 5xx are retried ``retries`` times with exponential
back-off (``backoff``, 2 x backoff, 4 x backoff ... seconds); any other 4xx means the request
itself is wrong, and fails at once.  Standard library only: the request runs in a worker thread
(``asyncio.to_thread``) so that it waits alongside the batch's other waiting rewards.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.error
import urllib.request

import torch

from ppo_rlhf.config import ConfigError
from ppo_rlhf.rollout.reward_base import (
    RewardError,
    ScoringBatch,
    ScoringReward,
    check_reward_url,
    row_columns,
    run_coroutine,
    validated_scores,
)

BODY_SHOWN = 200  # characters of an answer's body quoted in an error


class UrlReward(ScoringReward):
    short_name, waits = "url", True

    def __init__(self, url: str, prompt_field: str = "prompt", timeout: float = 60.0, retries: int = 3,
                 backoff: float = 1.0):
        check_reward_url(url)  # as the config checks it, for a UrlReward built in Python
        self.url, self.prompt_field = url, prompt_field
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.description = f"URL {url}"

    def check_columns(self, rows: list[dict], source: str) -> None:
        """ConfigError at start naming a column whose values cannot be sent as JSON."""
        for name, values in row_columns(rows, self.prompt_field).items():
            self._require_json(name, values, ConfigError, f" in {source}")

    def _require_json(self, name: str, values: list, error: type, where: str = "") -> None:
        try:
            json.dumps(values, allow_nan=False)
        except (TypeError, ValueError) as problem:
            raise error(f"reward URL {self.url}: column '{name}'{where} cannot be sent as JSON ({problem}); "
                        f"drop the field from the prompt rows or store it as text") from None

    def request_body(self, batch: ScoringBatch) -> bytes:
        columns = row_columns(batch.rows, self.prompt_field)
        for name, values in columns.items():
            self._require_json(name, values, RewardError)
        return json.dumps({"prompts": batch.prompts, "responses": batch.responses, "columns": columns}).encode()

    def post(self, body: bytes) -> bytes:
        """The answer's body, after up to ``retries`` retries of what may pass (see above)."""
        return request_with_retries(self.url, body, self.timeout, self.retries, self.backoff, "reward URL")

    def scores_from(self, answer: bytes, count: int) -> torch.Tensor:
        try:
            scores = json.loads(answer)["scores"]
        except (ValueError, KeyError, TypeError):
            raise RewardError(f"reward URL {self.url} must answer JSON {{\"scores\": [...]}}, got "
                              f"{_start_of(answer)}") from None
        return validated_scores(scores, count, f"reward URL {self.url}")

    async def score_async(self, batch: ScoringBatch) -> torch.Tensor:
        answer = await asyncio.to_thread(self.post, self.request_body(batch))
        return self.scores_from(answer, len(batch.responses))

    def __call__(self, batch: ScoringBatch) -> torch.Tensor:
        return run_coroutine(self.score_async(batch))


def request_with_retries(url: str, body: bytes | None, timeout: float, retries: int, backoff: float, what: str,
                         headers: dict[str, str] | None = None) -> bytes:
    """The body of the answer to a POST of JSON ``body`` to ``url`` (a GET without one), after up
    to ``retries`` retries of what may pass: connection errors, timeouts, HTTP 429 and 5xx, after
    ``backoff`` x 1, 2, 4 ... seconds; another 4xx fails at once.  Errors are RewardErrors naming
    ``what`` and the URL (--reward-url's, and a judge's: rollout/judge.py)."""
    headers = {"Content-Type": "application/json", **(headers or {})}
    for attempt in range(retries + 1):
        try:
            request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET",
                                             headers=headers)
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            status = f"HTTP {error.code} ({_start_of(error.read())})"
            if 400 <= error.code < 500 and error.code != 429:  # the request is wrong: another try will be too
                raise RewardError(f"{what} {url} answered {status}") from None
            problem = status
        except (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException) as error:
            reason = getattr(error, "reason", error)
            problem = "timed out" if isinstance(reason, TimeoutError) else f"{type(reason).__name__}: {reason}"
        if attempt < retries:
            time.sleep(backoff * 2 ** attempt)
    raise RewardError(f"{what} {url} failed {retries + 1} times (timeout {timeout:g} s); the last: {problem}")


def _start_of(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    return repr(text[:BODY_SHOWN] + ("..." if len(text) > BODY_SHOWN else ""))
