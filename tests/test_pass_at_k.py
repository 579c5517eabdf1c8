"""pass@k, mean@k and maj@k in evaluation (core/pass_at_k.py, evaluation.py): the estimator worked
by hand, and `eval --samples K` / `ppo --eval-samples K` writing them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ppo_rlhf.core import pass_at_k
from ppo_rlhf.evaluation import majority_correct, sampled_metrics


def outcomes(*rows: str) -> torch.Tensor:
    """'1010' -> one problem's samples, right (1) or wrong (0)."""
    return torch.tensor([[int(ch) for ch in row] for row in rows])


def test_pass_at_k_by_hand():
    # n = 2, c = 1, k = 1: 1 - C(1, 1) / C(2, 1) = 1 - 1/2 = 0.5
    # n = 4, c = 1, k = 2: 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5
    # n = 5, c = 2, k = 2: 1 - C(3, 2) / C(5, 2) = 1 - 3/10 = 0.7
    #   (the product form: (1 - 2/4)(1 - 2/5) = 0.5 x 0.6 = 0.3 of draws all wrong)
    # n = 3, c = 1, k = 3: only 2 wrong, so any 3 hold the right one: 1
    # n = 3, c = 0, k = 2: no right sample: 0
    assert pass_at_k(outcomes("10"), 1).tolist() == [0.5]
    assert pass_at_k(outcomes("0100"), 2).tolist() == [pytest.approx(0.5)]
    assert pass_at_k(outcomes("01010"), 2).tolist() == [pytest.approx(0.7)]
    assert pass_at_k(outcomes("010"), 3).tolist() == [1.0]
    assert pass_at_k(outcomes("000"), 2).tolist() == [0.0]
    # Several problems at once, each its own count: pass@1 is each problem's share of right samples.
    assert pass_at_k(outcomes("1100", "0001", "1111"), 1).tolist() == [0.5, 0.25, 1.0]


def test_pass_at_k_stays_exact_where_the_binomials_overflow():
    # n = 2000, c = 1, k = 1000: 1 - C(1999, 1000) / C(2000, 1000) = 1 - (2000 - 1000) / 2000 = 0.5,
    # though C(2000, 1000) ~ 2e600 is far past a float.
    correct = torch.zeros(1, 2000)
    correct[0, 7] = 1
    assert pass_at_k(correct, 1000).item() == pytest.approx(0.5, abs=1e-12)
    with pytest.raises(OverflowError):
        float(math.comb(2000, 1000))


def test_pass_at_k_needs_k_within_the_samples():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(outcomes("10"), 3)


def test_majority_vote_by_hand():
    # Problem 1: answers 4, 4, 5 -> 4 wins (2 of 3), and 4 was right.
    # Problem 2: answers 7, 9, 9 -> 9 wins, and 9 was wrong (7 was right): a miss though one was right.
    # Problem 3: a tie 1 / 2 goes to the answer given first (1), which was wrong.
    # Problem 4: no answer parsed at all: a miss.
    answers = [["4", "4", "5"], ["7", "9", "9"], ["1", "2", None], [None, None, None]]
    right = [[1, 1, 0], [1, 0, 0], [0, 1, 0], [0, 0, 0]]
    assert [majority_correct(a, r) for a, r in zip(answers, right)] == [True, False, False, False]


def test_sampled_metrics_by_hand():
    # Two problems, 4 samples each.  The first: answers 3, 3, 8, 3, of which the three 3s are right;
    # the second: none right.
    # pass@1 = (3/4 + 0) / 2 = 0.375
    # pass@2 = (1 - C(1, 2) / C(4, 2) + 0) / 2 = (1 - 0) / 2 = 0.5   (one wrong: every pair holds a 3)
    # pass@3 = pass@4 = 0.5;  mean@4 = 3 right of 8 = 0.375;  maj@4: 3 wins the first (right), 1 the second: 0.5
    right = [[1, 1, 0, 1], [0, 0, 0, 0]]
    answers = [["3", "3", "8", "3"], ["1", "2", "1", None]]
    assert sampled_metrics(right, answers) == pytest.approx(
        {"pass@1": 0.375, "pass@2": 0.5, "pass@3": 0.5, "pass@4": 0.5, "mean@4": 0.375, "maj@4": 0.5})
    assert "maj@4" not in sampled_metrics(right, None)  # no parsed answers: no vote
