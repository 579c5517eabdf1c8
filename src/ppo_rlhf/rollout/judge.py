"""An LLM judge as a reward (``--reward-judge MODEL_OR_URL``; docs/design.md, "Judges").

Each response is shown to a judge model through a Jinja template (``--judge-template FILE``,
given ``prompt``, ``response`` and every column of the prompt row by name; a template that never
names ``response`` is refused at start) and the judge's answer becomes a score (``--judge-score``):

    number:LOW:HIGH   the number its answer gives as the score (the rules: :data:`SCORE_RULES`, or
                      the user's ``--judge-score-pattern``), which must lie in [LOW, HIGH]
    token:TEXT        the probability that its answer's first token is TEXT (e.g. token:Yes)

The judge is a causal LM folder, run here, batched, with greedy decoding (the built-in torch
generator: a run's vLLM engine holds the policy's weights, not a second model), or an
OpenAI-compatible chat-completions endpoint (``http://host:8000/v1``, a ``vllm serve`` of one's
own), asked with the timeouts, retries and errors of ``--reward-url`` (rollout/reward_http.py),
CONCURRENT_REQUESTS at once on a thread pool of its own.

Judged scores are kept by the judge's whole input -- the template rendered with the prompt, the
response and the row -- until the next iteration: the K samples of a prompt that wrote the same
response, ReMax's greedy response, an evaluation, are judged once.  An answer with no score in
it -- none found, one outside the range, one that is not a finite number, a token missing from
the listed log-probs -- is *unparsed*: counted (``judge/unparsed``), marked in ``last_unscored``,
which the trainer reads to give the response advantage 0 and leave it out of every baseline
(trainers/estimators.py, ``advantages_and_returns``), so it teaches nothing; where 0 (or the
range's low end) would punish the policy for the judge's failure and a refusal would stop a run
over one odd answer.  Its score, for the metrics and an evaluation's mean, is the mean of its
batch's judged scores.  A batch with no parseable answer at all stops the run, saying what the
judge answered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ppo_rlhf.config import ConfigError
from ppo_rlhf.rollout.reward_base import RewardError, ScoringBatch, ScoringReward, check_reward_url, row_columns, run_coroutine
from ppo_rlhf.rollout.reward_http import _start_of, request_with_retries

SCORE_KINDS = "number:LOW:HIGH (e.g. number:0:10) or token:TEXT (e.g. token:Yes)"
CONCURRENT_REQUESTS = 16  # chat-completion requests in flight at once (each is one response)
TOP_LOGPROBS = 20  # the most an OpenAI-compatible server lists for the first token
LOCAL_BATCH = 32  # judge inputs per generate call of a local judge
DEFAULT_TEMPLATES = {
    "number": ("Rate the response to the prompt below for how well it answers it, from {low} (worst) to {high} "
               "(best).\n\nPrompt:\n{{{{ prompt }}}}\n\nResponse:\n{{{{ response }}}}\n\nAnswer with the number "
               "only."),
    "token": ("Does the response below answer the prompt well?\n\nPrompt:\n{{{{ prompt }}}}\n\nResponse:\n"
              "{{{{ response }}}}\n\nAnswer {token} or No."),
}


def is_url(judge: str) -> bool:
    return judge.lower().startswith(("http://", "https://"))


# How an answer's score is found by default (``--judge-score number:LOW:HIGH`` without
# ``--judge-score-pattern``; docs/rewards.md).  A judge answers as its template asks -- the number
# alone ("7", "7/10"), a labelled score ("Score: 7", "**Rating:** 8/10", Prometheus' "[RESULT] 4"),
# MT-Bench's "Rating: [[5]]" -- often after or before reasoning that holds other numbers ("3
# errors ... Score: 6"), so "the last number" misreads it ("8 out of 10" is 10).  The rules below
# are tried in order; the first that finds a number gives the score, its last match in the answer
# (a judge that reasons gives its verdict last; a rubric's overall score comes after its parts).
_SCORE = r"(?<![\w.])([-+]?(?:\d+(?:\.\d+)?|\.\d+))(?!\w)"  # group 1: a plain decimal, not inside a word
_LABEL = r"\b(?:scores?|ratings?|grade|verdict)\b(?:\s*\([^)\n]*\))?[\s*_]*(?:[:=]|\bis\b)"  # "**Rating (1-10):"
SCORE_RULES = (
    ("[[N]]", re.compile(rf"\[\[\s*{_SCORE}\s*\]\]")),
    ("a score label: 'Score: N', 'Rating (1-10) = N', 'the grade is N', 'Verdict: N', '[RESULT] N'",
     re.compile(rf"(?:{_LABEL}|\[RESULT\])[\s*_:\[(]*{_SCORE}", re.IGNORECASE)),
    # Group 2: the scale written after the score, which must be the range's top ("8/10" on number:0:10).
    ("N/HIGH or N out of HIGH", re.compile(rf"{_SCORE}[\s*_]*(?:/|\bout\s+of\b)[\s*_]*{_SCORE}", re.IGNORECASE)),
)
ANY_NUMBER = re.compile(_SCORE)
PATTERN_EXAMPLE = r"Score: (\d+)"
# A listed log-prob this far above 0 is a server's round-off of log(1), read as 0; more is no log-prob.
LOGPROB_ROUNDING = 1e-6


@dataclass(frozen=True)
class JudgeScore:
    """How an answer becomes a score (``--judge-score``, ``--judge-score-pattern``)."""

    kind: str  # "number" or "token"
    low: float = 0.0
    high: float = 0.0
    token: str = ""
    pattern: str | None = None  # number: the user's regular expression, its group 1 the score

    @staticmethod
    def parse(spec: str, pattern: str | None = None) -> "JudgeScore":
        def refused(why: str) -> ConfigError:
            return ConfigError(f"invalid value for 'judge_score': {spec!r}: {why}; allowed: {SCORE_KINDS}")

        kind, _, rest = spec.partition(":")
        if kind == "token":
            if not rest:
                raise refused("token: needs the text whose probability is the score")
            if pattern is not None:
                raise ConfigError(f"invalid value for 'judge_score_pattern': {pattern!r}; allowed: left out with "
                                  f"--judge-score {spec} (the score is the probability of a token, not read from "
                                  f"the answer's text)")
            return JudgeScore("token", 0.0, 1.0, token=rest)
        if kind != "number":
            raise refused(f"{kind!r} is neither number nor token")
        low, _, high = rest.partition(":")
        try:
            low_value, high_value = float(low), float(high)
        except ValueError:
            raise refused("number: needs its range as two numbers, LOW:HIGH") from None
        if not (math.isfinite(low_value) and math.isfinite(high_value) and low_value < high_value):
            raise refused("the range needs finite numbers with LOW below HIGH")
        if pattern is not None:
            compiled_pattern(pattern)
        return JudgeScore("number", low_value, high_value, pattern=pattern)

    def describe(self) -> str:
        if self.kind == "token":
            return f"the probability of {self.token!r} as its answer's first token"
        found = f"found by {self.pattern!r}" if self.pattern is not None else "given as the score"
        return f"the number {found}, {self.low:g} to {self.high:g}"

    def checked(self, value: float | None) -> float | None:
        """``value`` if it is a finite number within the range (a token's: [0, 1]), else None: unparsed."""
        if value is None or not math.isfinite(value) or not self.low <= value <= self.high:
            return None
        return value

    def from_answer(self, answer: str) -> float | None:
        """The score a judge's answer gives (see SCORE_RULES, or the user's pattern: its last match's
        group 1), or None when it gives none, or one that is not a finite number in the range."""
        if self.pattern is not None:
            matches = list(compiled_pattern(self.pattern).finditer(answer))
            return self.checked(as_float(matches[-1].group(1))) if matches else None
        for _, rule in SCORE_RULES:
            matches = [m for m in rule.finditer(answer) if rule.groups == 1 or as_float(m.group(2)) == self.high]
            if matches:
                return self.checked(as_float(matches[-1].group(1)))
        numbers = ANY_NUMBER.findall(answer)  # last: the answer's only number ("7", "I'd say 7.")
        return self.checked(as_float(numbers[0])) if len(numbers) == 1 else None


def as_float(text: str | None) -> float | None:
    try:
        return float(text.strip())
    except (AttributeError, ValueError):  # a group that took no part in the match, or no number
        return None


def compiled_pattern(pattern: str) -> re.Pattern:
    """``--judge-score-pattern`` compiled, or ConfigError naming it: not a regular expression, or
    without the group that holds the score."""
    try:
        compiled = re.compile(pattern)
    except re.error as error:
        raise ConfigError(f"invalid value for 'judge_score_pattern': {pattern!r}: not a regular expression "
                          f"({error}); allowed: a Python regular expression whose group 1 is the score, e.g. "
                          f"{PATTERN_EXAMPLE!r}") from None
    if compiled.groups < 1:
        raise ConfigError(f"invalid value for 'judge_score_pattern': {pattern!r}: it has no group to hold the score; "
                          f"allowed: a Python regular expression whose group 1 is the score, e.g. {PATTERN_EXAMPLE!r}")
    return compiled


class JudgeTemplate:
    """The judge's input for each response: a Jinja template (sandboxed, a variable it names and a
    row lacks an error) given ``prompt``, ``response`` and the row's columns by name."""

    def __init__(self, path: str | None, score: JudgeScore):
        from jinja2 import StrictUndefined, meta
        from jinja2.exceptions import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.path = path
        if path is None:
            source = DEFAULT_TEMPLATES[score.kind].format(low=f"{score.low:g}", high=f"{score.high:g}",
                                                          token=score.token)
        else:
            if not Path(path).is_file():
                raise ConfigError(f"--judge-template {path}: no such file")
            source = Path(path).read_text()
        environment = ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)
        try:
            self.variables = meta.find_undeclared_variables(environment.parse(source))
            self.template = environment.from_string(source)
        except TemplateSyntaxError as error:
            raise ConfigError(f"--judge-template {path}: not a Jinja template: {error.message} (line "
                              f"{error.lineno})") from None
        if "response" not in self.variables:
            raise ConfigError(f"--judge-template {path} never names {{{{ response }}}}, so the judge would never see "
                              f"the response it scores (it names: {', '.join(sorted(self.variables)) or 'nothing'}); "
                              f"a judge's template must hold {{{{ response }}}}, and may hold {{{{ prompt }}}} and the "
                              f"prompt row's columns by name")

    @property
    def name(self) -> str:
        return f"--judge-template {self.path}" if self.path else "the judge's default template"

    def check_columns(self, rows: list[dict], source: str) -> None:
        """ConfigError at start naming a variable of the template that a prompt row lacks."""
        columns = self.variables - {"prompt", "response"}
        for row in rows:
            missing = sorted(columns - set(row))
            if missing:
                where = row.get("_source", source)
                raise ConfigError(f"{self.name} names {', '.join(repr(m) for m in missing)}, which the prompt row at "
                                  f"{where} lacks (its fields: {', '.join(k for k in row if k != '_source')}); give "
                                  f"every row the field, or take it out of the template")

    def render(self, prompt, response: str, columns: dict) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render({**columns, "prompt": prompt_text(prompt), "response": response})
        except TemplateError as error:
            raise RewardError(f"{self.name} could not be rendered: {error}") from None


def prompt_text(prompt) -> str:
    """A prompt as the judge reads it: its text, or a chat prompt's messages one a line as 'role: content'."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m.get('content', '')}" for m in prompt)


class Judge(ScoringReward):
    """What every judge shares: rendering, the cache, the unparsed answers.  A judge answers a list
    of inputs with (score or None, the answer as text) each (:meth:`judge_all`)."""

    short_name = "judge"

    def __init__(self, template: JudgeTemplate, score: JudgeScore, prompt_field: str = "prompt"):
        self.template, self.score, self.prompt_field = template, score, prompt_field
        self.cache: dict[str, float | None] = {}
        self.counts = {"judge/judged": 0.0, "judge/cached": 0.0, "judge/unparsed": 0.0}
        self.warned = False

    def check_columns(self, rows: list[dict], source: str) -> None:
        self.template.check_columns(rows, source)

    def new_iteration(self) -> None:
        self.cache.clear()
        self.counts = dict.fromkeys(self.counts, 0.0)

    def iteration_counts(self) -> dict[str, float]:
        return dict(self.counts)

    def inputs(self, batch: ScoringBatch) -> list[str]:
        columns = row_columns(batch.rows, self.prompt_field)
        return [self.template.render(prompt, response, {name: values[i] for name, values in columns.items()})
                for i, (prompt, response) in enumerate(zip(batch.prompts, batch.responses))]

    def scores_of(self, texts: list[str], judged: list[tuple[float | None, str]]) -> torch.Tensor:
        """(B,) scores of the batch's inputs ``texts``, the new ones' verdicts ``judged`` cached (in
        order of their first appearance) and held to the score's range (:meth:`JudgeScore.checked`);
        an unparsed answer is marked in ``last_unscored`` and stands at the batch's mean (see above)."""
        new = list(dict.fromkeys(t for t in texts if t not in self.cache))
        answers = dict(zip(new, (answer for _, answer in judged)))
        self.cache.update(zip(new, (self.score.checked(value) for value, _ in judged)))
        self.counts["judge/judged"] += len(new)
        self.counts["judge/cached"] += len(texts) - len(new)
        values = [self.cache[t] for t in texts]
        parsed = [v for v in values if v is not None]
        unparsed = len(values) - len(parsed)
        if not parsed:
            example = next((answers[t] for t in texts if t in answers), "(cached)")
            raise RewardError(f"the judge {self.name} gave no score in any of its {len(values)} answers of "
                              f"this batch (wanted: {self.score.describe()}); its answer to the first: "
                              f"{example[:200]!r}.  Check that --judge-template asks for what --judge-score reads"
                              + ("" if self.score.kind == "token" else
                                 " (or give --judge-score-pattern REGEX, its group 1 the score)"))
        self.counts["judge/unparsed"] += unparsed
        if unparsed and not self.warned:
            self.warned = True
            example = next((answers[t] for t, v in zip(texts, values) if v is None and t in answers), "(cached)")
            from ppo_rlhf.distributed import is_main_process

            if is_main_process():
                print(f"warning: the judge {self.name} gave no score in {unparsed} of {len(values)} answers "
                      f"(wanted: {self.score.describe()}), e.g. {example[:200]!r}; each such response is left out "
                      f"of the update (advantage 0, in no baseline), and judge/unparsed counts them every "
                      f"iteration", flush=True)
        self.last_unscored = torch.tensor([v is None for v in values])
        mean = sum(parsed) / len(parsed)
        return torch.tensor([mean if v is None else v for v in values], dtype=torch.float32)


class LocalJudge(Judge):
    """A causal LM folder as the judge, run in this process, batched, greedy (module docstring).
    Built without loading (the template is checked against the rows first); :meth:`load` loads it."""

    waits = False

    def __init__(self, folder: str, template: JudgeTemplate, score: JudgeScore, max_new_tokens: int,
                 prompt_field: str = "prompt", dtype=None):
        super().__init__(template, score, prompt_field)
        self.folder, self.max_new_tokens, self.dtype = folder, max_new_tokens, dtype
        self.name = folder
        self.description = f"judge {folder} ({score.describe()})"
        self.model = self.tokenizer = None
        self.token_id: int | None = None

    def load(self) -> None:
        from ppo_rlhf.models import load_causal_lm, load_tokenizer

        if self.model is not None:
            return
        self.model = load_causal_lm(self.folder, self.dtype).eval().requires_grad_(False)
        self.tokenizer = load_tokenizer(self.folder, "--reward-judge")
        if self.score.kind == "token":
            ids = self.tokenizer.encode(self.score.token, add_special_tokens=False)
            if len(ids) != 1:
                raise ConfigError(f"invalid value for 'judge_score': 'token:{self.score.token}': the judge "
                                  f"{self.folder} reads {self.score.token!r} as {len(ids)} tokens ({ids}); give the "
                                  f"text of one token of its tokenizer (e.g. token:Yes)")
            self.token_id = ids[0]
        self.check_context()

    def answer_tokens(self) -> int:
        """The positions the judge's answer takes after its input: a number's up to
        --judge-max-new-tokens; a token's probability is read at the input's last position."""
        return self.max_new_tokens if self.score.kind == "number" else 0

    def check_context(self) -> None:
        """ConfigError at start when the judge's positions cannot hold its template's own text (the
        template with every variable empty, as the judge reads it) and its answer: no response could
        be judged.  How long a prompt and a response make an input is known only as they come, and
        an input that does not fit is refused then (:meth:`check_fits`)."""
        from ppo_rlhf.models.loading import max_positions

        positions = max_positions(self.model.config)
        if positions is None:
            return
        try:
            text = self.template.template.render(dict.fromkeys(self.template.variables, ""))
        except Exception:  # noqa: BLE001 -- a template that computes with a column: measured as inputs come
            return
        fixed = self.encoded([text], "cpu")[0].shape[1]
        if fixed + self.answer_tokens() > positions:
            answer, shorter = ((f", and its answer up to {self.answer_tokens()} more (--judge-max-new-tokens)",
                                " or --judge-max-new-tokens") if self.answer_tokens() else ("", ""))
            raise ConfigError(f"--reward-judge {self.folder} has {positions} positions, but {self.template.name} alone "
                              f"is {fixed} tokens as the judge reads it{answer}, before any prompt or response; "
                              f"shorten the template{shorter}, or give a judge with a longer context")

    def check_fits(self, ids: torch.Tensor) -> None:
        """RewardError naming the judge when a batch's longest input (``ids``, left-padded (b, T))
        and its answer would run past the judge's positions (its position embeddings would be
        indexed past their end)."""
        from ppo_rlhf.models.loading import max_positions

        positions = max_positions(self.model.config)
        if positions is not None and ids.shape[1] + self.answer_tokens() > positions:
            answer = f" and its answer up to {self.answer_tokens()} more" if self.answer_tokens() else ""
            raise RewardError(f"the judge {self.folder} has {positions} positions, but its input for a response "
                              f"here is {ids.shape[1]} tokens{answer}; shorten what it reads (--max-length, "
                              f"--max-new-tokens, --judge-template) or its answer (--judge-max-new-tokens), or give "
                              f"a judge with a longer context")

    def encoded(self, texts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs as the judge reads them, left-padded: each as a user message through its chat
        template when it has one."""
        from ppo_rlhf.rollout.responses import apply_chat_template

        templated = getattr(self.tokenizer, "chat_template", None) is not None
        if templated:
            texts = apply_chat_template(self.tokenizer, texts)
        encoded = self.tokenizer(texts, padding=True, return_tensors="pt", padding_side="left",
                                 add_special_tokens=not templated)
        return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)

    @torch.no_grad()
    def judge_all(self, texts: list[str]) -> list[tuple[float | None, str]]:
        from ppo_rlhf.rollout.generation import TorchGenerator
        from ppo_rlhf.rollout.sequences import position_ids_from_mask, stop_token_ids

        self.load()
        device = next(self.model.parameters()).device
        verdicts = []
        for start in range(0, len(texts), LOCAL_BATCH):
            ids, mask = self.encoded(texts[start:start + LOCAL_BATCH], device)
            self.check_fits(ids)
            if self.score.kind == "token":
                logits = self.model(input_ids=ids, attention_mask=mask,
                                    position_ids=position_ids_from_mask(mask)).logits[:, -1].float()  # (b, V)
                probabilities = torch.softmax(logits, dim=-1)[:, self.token_id]
                verdicts += [(p, f"p({self.score.token!r}) = {p:.4g}") for p in probabilities.tolist()]
                continue
            generator = TorchGenerator(stop_token_ids(self.tokenizer, self.model), self.tokenizer.pad_token_id,
                                       self.max_new_tokens, do_sample=False)
            answer_ids, answer_mask = generator.generate(self.model, ids, mask)
            for row, row_mask in zip(answer_ids, answer_mask):
                answer = self.tokenizer.decode(row[row_mask.bool()], skip_special_tokens=True)
                verdicts.append((self.score.from_answer(answer), answer))
        return verdicts

    def __call__(self, batch: ScoringBatch) -> torch.Tensor:
        self.load()
        self.model.to(batch.sequences.input_ids.device)  # the trainer's device (once: a no-op after)
        texts = self.inputs(batch)
        return self.scores_of(texts, self.judge_all(list(dict.fromkeys(t for t in texts if t not in self.cache))))


class UrlJudge(Judge):
    """An OpenAI-compatible chat-completions endpoint as the judge (module docstring): one request
    a distinct input, up to CONCURRENT_REQUESTS at once, greedy; an ``OPENAI_API_KEY`` in the
    environment is sent as its bearer token."""

    waits = True

    def __init__(self, url: str, template: JudgeTemplate, score: JudgeScore, max_new_tokens: int,
                 model: str | None = None, prompt_field: str = "prompt", timeout: float = 60.0, retries: int = 3,
                 backoff: float = 1.0):
        check_reward_url(url, "reward_judge")
        super().__init__(template, score, prompt_field)
        url = url.rstrip("/")
        self.base = url[: -len("/chat/completions")] if url.endswith("/chat/completions") else url
        self.url = self.base + "/chat/completions"
        self.model_name, self.max_new_tokens = model, max_new_tokens
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.name = self.url
        self.description = f"judge {self.url} ({score.describe()})"

    def headers(self) -> dict[str, str]:
        key = os.environ.get("OPENAI_API_KEY")
        return {"Authorization": f"Bearer {key}"} if key else {}

    def answer(self, answer: bytes, what: str = "") -> dict:
        try:
            return json.loads(answer)
        except ValueError:
            raise RewardError(f"the judge {self.url} must answer JSON, got {_start_of(answer)}") from None

    def served_model(self) -> str:
        """--judge-model, else the first model the server lists (GET /models), asked once."""
        if self.model_name is None:
            listed = self.answer(request_with_retries(self.base + "/models", None, self.timeout, self.retries,
                                                      self.backoff, "judge", self.headers()))
            try:
                self.model_name = listed["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise RewardError(f"the judge {self.base}/models lists no model to ask ({str(listed)[:200]}); give "
                                  f"--judge-model NAME") from None
        return self.model_name

    def request_body(self, text: str) -> bytes:
        """One chat completion, greedy: the number's answer, or (token) one token and its top log-probs."""
        body = {"model": self.served_model(), "messages": [{"role": "user", "content": text}], "temperature": 0,
                "max_tokens": 1 if self.score.kind == "token" else self.max_new_tokens}
        if self.score.kind == "token":
            body.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
        return json.dumps(body).encode()

    def verdict(self, answer: dict) -> tuple[float | None, str]:
        """(score or None, the answer's text) of one chat completion."""
        try:
            choice = answer["choices"][0]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RewardError(f"the judge {self.url} must answer a chat completion ({{\"choices\": [{{\"message\": "
                              f"...}}]}}), got {str(answer)[:200]!r}") from None
        text = answer_text(content, self.url)
        if self.score.kind == "number":
            return self.score.from_answer(text), text
        try:  # the first position's top log-probs
            top = choice["logprobs"]["content"][0]["top_logprobs"]
            listed = [t["logprob"] for t in top if t["token"] == self.score.token]
        except (KeyError, IndexError, TypeError):
            return None, f"{text} (no log-probs in the answer: does the server take logprobs / top_logprobs?)"
        return token_probability(listed, self.score.token, len(top), text)

    async def judge_all(self, texts: list[str]) -> list[tuple[float | None, str]]:
        """Each input's verdict, CONCURRENT_REQUESTS requests in flight on a thread pool of the
        judge's own (asyncio's default pool holds min(32, CPUs + 4) threads: 6 on 2 cores)."""
        if not texts:
            return []
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=min(CONCURRENT_REQUESTS, len(texts)),
                                                     thread_name_prefix="judge")
        try:
            await loop.run_in_executor(pool, self.served_model)

            async def one(text: str) -> tuple[float | None, str]:
                answer = await loop.run_in_executor(pool, request_with_retries, self.url, self.request_body(text),
                                                    self.timeout, self.retries, self.backoff, "judge", self.headers())
                return self.verdict(self.answer(answer))

            return list(await asyncio.gather(*(one(text) for text in texts)))
        finally:  # a request that failed: the ones not yet started never start
            pool.shutdown(wait=False, cancel_futures=True)

    async def score_async(self, batch: ScoringBatch) -> torch.Tensor:
        texts = self.inputs(batch)
        return self.scores_of(texts, await self.judge_all(list(dict.fromkeys(t for t in texts if t not in self.cache))))

    def __call__(self, batch: ScoringBatch) -> torch.Tensor:
        return run_coroutine(self.score_async(batch))


def answer_text(content, url: str) -> str:
    """A chat completion's ``content`` as text: a server may send a number as a JSON number, or
    null (nothing said, e.g. cut off while thinking); RewardError for anything else."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (int, float)) and not isinstance(content, bool):
        return json.dumps(content)
    raise RewardError(f"the judge {url} must answer its message's content as text, got "
                      f"{type(content).__name__} {str(content)[:200]!r}")


def token_probability(listed: list, token: str, count: int, text: str) -> tuple[float | None, str]:
    """(the probability of ``token``, the answer's text) from its log-probs ``listed`` among the first
    position's top ``count``; None (unparsed) where it is not listed -- it is then below the last one
    listed, or the judge did not answer at its first token (a thinking model's ``<think>``) -- or a
    listed value is no log-probability (not a number, or above 0 by more than round-off)."""
    if not listed:
        return None, f"{text} ({token!r} is not among the first token's {count} top log-probs)"
    bad = [lp for lp in listed
           if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not lp <= LOGPROB_ROUNDING]  # NaN too
    if bad:
        return None, f"{text} (the log-prob of {token!r} is {bad[0]!r}: no log-probability, which is a number <= 0)"
    return sum(math.exp(min(lp, 0.0)) for lp in listed), text


def make_judge(config) -> Judge:
    """The judge ``--reward-judge`` names (a ``ppo`` or ``eval`` config), not yet loaded."""
    score = JudgeScore.parse(config.judge_score, config.judge_score_pattern)
    template = JudgeTemplate(config.judge_template, score)
    if is_url(config.reward_judge):
        return UrlJudge(config.reward_judge, template, score, config.judge_max_new_tokens, config.judge_model,
                        config.prompt_field, config.reward_timeout, config.reward_retries, config.reward_backoff)
    return LocalJudge(config.reward_judge, template, score, config.judge_max_new_tokens, config.prompt_field,
                      config.load_dtype)
