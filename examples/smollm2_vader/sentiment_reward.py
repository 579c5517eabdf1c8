"""Reward for the SmolLM2 example: how positive a reply sounds, by the VADER sentiment lexicon.

VADER (PyPI ``vaderSentiment``, MIT licence) scores text with a fixed word list and rules, offline
and in microseconds; its ``compound`` score runs from -1 (most negative) to +1 (most positive).
Use it as ``--reward-fn examples/smollm2_vader/sentiment_reward.py:positive_sentiment``.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def analyzer():
    try:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
    except ImportError:
        raise ImportError("this reward needs the VADER lexicon: pip install vaderSentiment") from None
    return SentimentIntensityAnalyzer()


def positive_sentiment(prompts: list[str], responses: list[str]) -> list[float]:
    """VADER compound score of each reply, in [-1, 1]; an empty reply scores 0."""
    return [analyzer().polarity_scores(response)["compound"] for response in responses]
