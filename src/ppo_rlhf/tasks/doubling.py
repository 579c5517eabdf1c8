"""The built-in task: "double it, in the style asked".

    S数字:3320x2=6640E        digits
    S小写:5487x2=一〇九七四E    lower-case Chinese numerals
    S大写:3164x2=陆叁贰捌E      upper-case Chinese numerals
    S__:3320x2=6640E          unprefixed: any style is right

SFT sees only unprefixed rows, so it learns to double but picks a style at random: one third
exact-match on prefixed prompts.  PPO, rewarded for the style asked, must fix that.

This module supplies: the tokenizer, the data rows for each stage, the rule-based reward and
the metric.  Nothing in the trainers knows about it.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

STYLES = ("digits", "lower", "upper")
STYLE_CHARS = {"digits": "0123456789", "lower": "〇一二三四五六七八九", "upper": "零壹贰叁肆伍陆柒捌玖"}
STYLE_PREFIX = {"digits": "数字", "lower": "小写", "upper": "大写"}
UNPREFIXED = "__"
PAD, BOS, EOS = "P", "S", "E"
# Token ids follow this order: 42 tokens, one per character.
VOCAB = [PAD, BOS, EOS, *STYLE_CHARS["digits"], *STYLE_CHARS["lower"], *STYLE_CHARS["upper"],
         "数", "字", "大", "写", "小", ":", "=", "_", "x"]

Q_MIN, Q_MAX = 1000, 9999
PROMPT_RE = re.compile(r"^S?(数字|小写|大写|__):(\d{4})x2=$")
CHAR_TO_DIGIT = {c: (style, d) for style, chars in STYLE_CHARS.items() for d, c in enumerate(chars)}


# ---------------------------------------------------------------- text
def render(number: int, style: str) -> str:
    """Write ``number`` with the characters of ``style`` (digit d -> d-th character)."""
    return "".join(STYLE_CHARS[style][int(d)] for d in str(number))


def prompt_text(q: int, style: str | None) -> str:
    """``S数字:3320x2=`` (or ``S__:3320x2=`` when ``style`` is None)."""
    prefix = STYLE_PREFIX[style] if style else UNPREFIXED
    return f"{BOS}{prefix}:{q}x2="


def parse_prompt(prompt: str) -> tuple[int, str | None]:
    """(q, requested style or None) from a prompt; ValueError if it is not one of this task's."""
    match = PROMPT_RE.match(prompt)
    if not match:
        raise ValueError(f"not a doubling-task prompt: {prompt!r}")
    prefix, q = match.groups()
    style = next((s for s, p in STYLE_PREFIX.items() if p == prefix), None)
    return int(q), style


def read_answer(response: str) -> tuple[int | None, str | None]:
    """(value, style) of a response, or None for each part that cannot be read.

    The style is None when the characters mix styles or are not numerals.
    """
    if not response:
        return None, None
    parsed = [CHAR_TO_DIGIT.get(c) for c in response]
    if any(p is None for p in parsed):
        return None, None
    styles = {p[0] for p in parsed}
    value = int("".join(str(p[1]) for p in parsed))
    return value, (styles.pop() if len(styles) == 1 else None)


# ---------------------------------------------------------------- tokenizer
def build_tokenizer():
    """A real ``transformers`` fast tokenizer: one token per character, ids in VOCAB order."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({c: i for i, c in enumerate(VOCAB)}, unk_token=PAD))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # characters join without spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD,
        padding_side="left", model_max_length=128,
    )
    return tokenizer


# ---------------------------------------------------------------- data
def split_questions(n_eval: int, seed: int) -> tuple[list[int], list[int]]:
    """Disjoint train / held-out question sets: no held-out q is ever seen in training."""
    questions = list(range(Q_MIN, Q_MAX + 1))
    random.Random(seed).shuffle(questions)
    return questions[n_eval:], questions[:n_eval]


def sft_rows(questions: list[int]) -> list[dict]:
    """Unprefixed ``{prompt, completion}`` rows, every style of every question."""
    return [{"prompt": prompt_text(q, None), "completion": render(2 * q, s)} for q in questions for s in STYLES]


def rm_rows(questions: list[int]) -> list[dict]:
    """Unprefixed ``{text, label}`` rows for the style classifier (label = index in STYLES)."""
    return [
        {"text": prompt_text(q, None) + render(2 * q, s) + EOS, "label": i}
        for q in questions for i, s in enumerate(STYLES)
    ]


def prompt_rows(questions: list[int], seed: int) -> list[dict]:
    """Prefixed ``{prompt, label}`` rows: each question with a random requested style."""
    rng = random.Random(seed)
    rows = []
    for q in questions:
        style_index = rng.randrange(len(STYLES))
        rows.append({"prompt": prompt_text(q, STYLES[style_index]), "label": style_index})
    return rows


# ---------------------------------------------------------------- reward and metric
def judge(prompt: str, response: str, finished: bool) -> tuple[bool, bool, bool]:
    """(exact, value_correct, style_correct) of one response.

    ``exact`` needs the right value, in the requested style, followed by EOS (``finished``).
    For an unprefixed prompt any single style is right.
    """
    q, wanted_style = parse_prompt(prompt)
    value, style = read_answer(response)
    value_ok = value == 2 * q
    style_ok = style is not None and (wanted_style is None or style == wanted_style)
    return (value_ok and style_ok and finished), value_ok, style_ok


def rule_reward(prompts: list[str], responses: list[str], finished: list[bool] | None = None) -> list[float]:
    """Rule-based reward: 1 for exact; otherwise graded credit, 0.4 for the right value and
    0.4 for the right style, so the signal still points the way from a wrong answer."""
    finished = finished if finished is not None else [True] * len(prompts)
    scores = []
    for prompt, response, done in zip(prompts, responses, finished):
        exact, value_ok, style_ok = judge(prompt, response, done)
        scores.append(1.0 if exact else 0.4 * value_ok + 0.4 * style_ok)
    return scores


def evaluate(prompts: list[str], responses: list[str], finished: list[bool], rows: list[dict] | None = None
             ) -> dict[str, float]:
    """Exact-match, value-correct and style-correct rates (the prompts say all; ``rows`` unused)."""
    verdicts = [judge(p, r, f) for p, r, f in zip(prompts, responses, finished)]
    n = max(len(verdicts), 1)
    return {
        "exact_match": sum(v[0] for v in verdicts) / n,
        "value_correct": sum(v[1] for v in verdicts) / n,
        "style_correct": sum(v[2] for v in verdicts) / n,
    }


def outcomes(prompts: list[str], responses: list[str], finished: list[bool], rows: list[dict] | None = None
             ) -> tuple[list[bool], list]:
    """Each response's exact match (pass@k's outcome) and its answer as a vote counts it: the value
    and style read from it, None for an unreadable or unfinished one."""
    right = [judge(p, r, f)[0] for p, r, f in zip(prompts, responses, finished)]
    answers = [read_answer(r) if f and None not in read_answer(r) else None for r, f in zip(responses, finished)]
    return right, answers


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- everything the stages need
class DoublingTask:
    """The task as the stages see it: tokenizer, rows for each stage, reward and metric.

    The held-out questions (``n_eval``) never appear in SFT, reward-model or PPO rows.
    """

    name = "doubling"
    num_labels = len(STYLES)  # classes of the style classifier used as reward model
    max_new_tokens = 7  # 5 answer digits + EOS, with one token to spare
    max_prompt_length = 12  # "S数字:3320x2=" is 11 tokens

    def __init__(self, seed: int = 0, n_eval: int = 2000):
        self.seed = seed
        self.train_questions, self.eval_questions = split_questions(n_eval, seed)
        self.tokenizer = build_tokenizer()

    def sft_rows(self) -> list[dict]:
        return sft_rows(self.train_questions)

    def rm_rows(self) -> list[dict]:
        return rm_rows(self.train_questions)

    def prompt_rows(self) -> list[dict]:
        return prompt_rows(self.train_questions, self.seed + 1)

    def eval_rows(self) -> list[dict]:
        return prompt_rows(self.eval_questions, self.seed + 2)

    metric = staticmethod(evaluate)
    outcomes = staticmethod(outcomes)
    rule_reward = staticmethod(rule_reward)


def make_task(seed: int = 0, n_eval: int = 2000) -> DoublingTask:
    return DoublingTask(seed, n_eval)
