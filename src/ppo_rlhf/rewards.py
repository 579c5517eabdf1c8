"""Reusable reward functions for data that carries its answers (docs/design.md, "Rewards").

Each takes the prompt rows' ``answer`` column, so prompt rows like
``{"prompt": "What is 2 + 3?", "answer": "5"}`` train with::

    ppo-rlhf ppo --model DIR --prompts rows.jsonl --reward-fn ppo_rlhf.rewards:answer_match

- :func:`answer_match`: 1.0 when the response's answer equals the row's, as numbers when both
  read as numbers, else as text; no dependency.
- :func:`math_equal`: the same, judged by Hugging Face's ``math-verify`` (LaTeX, fractions,
  sets, ...); needs ``pip install math-verify`` (or ``pip install -e ".[tasks]"``).
- :func:`extract_answer`: the text inside a response's last ``<answer>...</answer>``.
"""

from __future__ import annotations

import math
import re

from ppo_rlhf.config import ConfigError

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
# A decimal number: optional sign, digits with optional thousands commas (1,234,567), an optional
# fraction part and exponent; or a fraction of two of them (1/2, -3/4).
_DECIMAL = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+"
NUMBER = re.compile(rf"(?:{_DECIMAL})(?:\s*/\s*(?:{_DECIMAL}))?")
RELATIVE_TOLERANCE, ABSOLUTE_TOLERANCE = 1e-6, 1e-9


def extract_answer(text: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>`` in ``text`` (tags in any case),
    or None if there is none."""
    found = ANSWER_TAG.findall(text)
    return found[-1].strip() if found else None


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (see NUMBER), as written, or None."""
    found = NUMBER.findall(text)
    return found[-1] if found else None


def as_number(text) -> float | None:
    """``text`` as a number if the whole of it is one: "1,234", "-3.5", "1e-3", "1/2", "$5", "50%"
    (a currency sign before and a percent sign or full stop after are dropped; 50% reads as 50),
    an int or float as given; else None."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    text = str(text).strip().lstrip("$").rstrip(".%").strip()
    if not NUMBER.fullmatch(text):
        return None
    numerator, _, denominator = text.replace(",", "").partition("/")
    if not denominator:
        return float(numerator)
    return float(numerator) / float(denominator) if float(denominator) != 0 else None


def normalised_text(text) -> str:
    """Case and runs of whitespace do not count: "New  York" equals "new york"."""
    return " ".join(str(text).split()).casefold()


def response_answer(response: str) -> str | None:
    """What a response answers: its last ``<answer>`` content, else the last number it writes."""
    tagged = extract_answer(response)
    return tagged if tagged is not None else last_number(response)


def voted_answer(text: str | None):
    """A parsed answer as pass@k's majority vote counts it (evaluation.py): a number by its value
    ("12", "12.0" and "1.2e1" alike), else the text with case and runs of whitespace ignored."""
    if text is None:
        return None
    number = as_number(text)
    return number if number is not None else normalised_text(text)


def same_answer(given: str | None, expected) -> bool:
    """Numerically within a relative 1e-6 (absolute 1e-9 near 0) when both read as numbers, else
    equal as normalised text."""
    if given is None or expected is None:
        return False
    given_number, expected_number = as_number(given), as_number(expected)
    if given_number is not None and expected_number is not None:
        return math.isclose(given_number, expected_number, rel_tol=RELATIVE_TOLERANCE, abs_tol=ABSOLUTE_TOLERANCE)
    return normalised_text(given) == normalised_text(expected)


def answer_match(prompts: list, responses: list[str], answer: list, **kwargs) -> list[float]:
    """1.0 for each response whose answer (:func:`response_answer`) is its prompt row's ``answer``
    (:func:`same_answer`), else 0.0."""
    return [float(same_answer(response_answer(response), expected)) for response, expected in zip(responses, answer)]


def _require_math_verify() -> None:
    try:
        import math_verify  # noqa: F401 -- only whether it is installed
    except ImportError:
        raise ConfigError("reward function ppo_rlhf.rewards:math_equal needs the math-verify package: "
                          "pip install math-verify (or pip install -e \".[tasks]\")") from None


def math_equal(prompts: list, responses: list[str], answer: list, **kwargs) -> list[float]:
    """1.0 for each response that math-verify judges equal to its row's ``answer``, else 0.0.

    The response's ``<answer>`` content if it has one, else the whole response, is parsed (the
    last LaTeX or plain expression, a ``\\boxed{}`` first); the row's answer is parsed as gold.
    math-verify bounds its parsing time with signals, which work only in a program's main thread:
    ppo-rlhf calls a plain (not async) reward function there."""
    _require_math_verify()
    from math_verify import parse, verify

    scores = []
    for response, expected in zip(responses, answer):
        tagged = extract_answer(response)
        gold, given = parse(str(expected)), parse(tagged if tagged is not None else response)
        scores.append(float(bool(gold) and bool(given) and verify(gold, given)))
    return scores


# Checked when the run starts (FunctionReward), not at the first scoring after the models load.
math_equal.check_requirements = _require_math_verify
