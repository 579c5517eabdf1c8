"""DeepSpeed-Chat's pairwise reward loss (``rm --rm-loss divergence``): by hand, and a run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.trainers.reward import RewardConfig, bradley_terry_loss, divergence_loss
from zoo import THREADS, run


def softplus(x: float) -> float:
    return math.log1p(math.exp(-x))  # -log sigmoid(x)


def test_divergence_loss_by_hand():
    # Pair 1: the prompt (ids 1, 2) is shared; the responses split at position 2; the chosen has 4
    # tokens, the rejected 3, so positions 2 and 3 count.  The rejected sequence's value past its
    # end is held at its last token's (0.0), never the 9.0 the head gave its pad.
    # Pair 2: the chosen is the rejected plus one token: only position 3 differs (a token against
    # padding), where the rejected holds its last score 0.2.
    chosen_ids = torch.tensor([[1, 2, 3, 4, 0], [1, 2, 6, 7, 0]])
    chosen_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 0]])
    rejected_ids = torch.tensor([[1, 2, 5, 0, 0], [1, 2, 6, 0, 0]])
    rejected_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    chosen_scores = torch.tensor([[5.0, 5.0, 0.5, 1.0, -9.0], [5.0, 5.0, 0.3, 1.2, -9.0]], requires_grad=True)
    rejected_scores = torch.tensor([[-5.0, -5.0, 0.0, 9.0, 9.0], [-5.0, -5.0, 0.2, 9.0, 9.0]], requires_grad=True)
    loss = divergence_loss(chosen_scores, rejected_scores, chosen_ids, rejected_ids, chosen_mask, rejected_mask)
    pair1 = (softplus(0.5 - 0.0) + softplus(1.0 - 0.0)) / 2
    pair2 = softplus(1.2 - 0.2)
    assert loss.item() == pytest.approx((pair1 + pair2) / 2, abs=1e-6)
    loss.backward()
    # Nothing before the split, or past the longer end, gets a gradient; the held value passes its
    # gradient to the rejected sequence's last token.
    assert chosen_scores.grad[:, :2].abs().sum() == 0 and chosen_scores.grad[:, 4].abs().sum() == 0
    assert rejected_scores.grad[0, 3:].abs().sum() == 0 and rejected_scores.grad[0, 2] != 0
    assert chosen_scores.grad[1, 2] == 0  # pair 2 shares position 2
    # Sequences that end together at the split's next token reduce to Bradley-Terry on the last scores.
    one = divergence_loss(torch.tensor([[0.0, 2.0]]), torch.tensor([[0.0, 0.5]]), torch.tensor([[1, 2]]),
                          torch.tensor([[1, 3]]), torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long))
    assert one.item() == pytest.approx(bradley_terry_loss(torch.tensor([2.0]), torch.tensor([0.5])).item())


def test_divergence_is_pairwise_only():
    with pytest.raises(ConfigError, match="'rm_loss'.*last-token in classification mode"):
        build_config(RewardConfig, {"mode": "classification", "rm_loss": "divergence"})
    with pytest.raises(ConfigError, match="'rm_loss'.*last-token, divergence"):
        build_config(RewardConfig, {"mode": "pairwise", "rm_loss": "mean"})


@pytest.mark.learning
def test_a_divergence_reward_model_learns_the_preference(zoo, tmp_path, learning_seed, record_outcome):
    out = tmp_path / "rm"
    run(["rm", "--mode", "pairwise", "--rm-loss", "divergence", "--model", zoo["llama"], "--data", zoo["pairs"],
         "--prompt-field", "query", "--chosen-field", "good", "--rejected-field", "bad", "--steps", 15,
         "--batch-size", 8, "--lr", 1e-2, "--eval-fraction", 0.25, "--seed", learning_seed, "--out", out, *THREADS])
    summary = json.loads((out / "summary.json").read_text())
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    record_outcome("last_loss_over_first", losses[-1] / losses[0])
    record_outcome("eval_accuracy", summary["eval_accuracy"])
    # Seeds 0-4: the last loss 0.0003-0.0007 of the first, held-out accuracy 1.0 on all five (6 pairs).
    assert losses[-1] < 0.5 * losses[0] and summary["eval_accuracy"] >= 0.8


def test_divergence_loss_on_pairs_longer_than_max_length_keeps_the_prompt_aligned(monkeypatch):
    """A pair longer than --max-length is cut alike (rollout/encoding.py, cut_pair_alike): the same
    prompt tokens leave both sequences, so position t of the chosen is position t of the rejected.
    The built-in task's tokenizer has one token per character ('2'..'9' are ids 5..12, 'E' = EOS is 2),
    and the per-token score here is the token's id, so the loss can be worked by hand."""
    from ppo_rlhf.tasks.doubling import build_tokenizer
    from ppo_rlhf.trainers import reward as reward_module

    monkeypatch.setattr(reward_module, "token_scores", lambda model, ids, mask: ids.float())
    config = build_config(RewardConfig, {"mode": "pairwise", "rm_loss": "divergence", "max_length": 10})
    rows = [{"prompt": "S__:1234x2=", "chosen": "2468", "rejected": "246"}]  # + EOS: 16 and 15 tokens
    examples = reward_module._Examples(build_tokenizer(), rows, config)
    # Both lose their first 16 - 10 = 6 tokens: "34x2=2468E" and "34x2=246E", first apart at position
    # 8 ('8', id 11, against 'E', id 2), compared to the end of the longer: positions 8 and 9, where
    # the rejected holds its last score (2).
    chosen_ids, rejected_ids = examples.chosen[0][0], examples.rejected[0][0]
    assert chosen_ids.tolist() == [6, 7, 41, 5, 39, 5, 7, 9, 11, 2]
    assert rejected_ids.tolist() == [6, 7, 41, 5, 39, 5, 7, 9, 2, 0]  # right-padded
    loss, correct = examples.loss_and_correct(torch.nn.Linear(1, 1), torch.tensor([0]))
    assert loss.item() == pytest.approx((softplus(11.0 - 2.0) + softplus(2.0 - 2.0)) / 2, abs=1e-6)  # 0.346635
    assert correct.tolist() == [False]  # last-token scores 2 and 2: a tie is not a win


def test_pairs_are_cut_alike_from_the_shared_prompt_then_from_the_end():
    from ppo_rlhf.rollout.encoding import cut_pair_alike

    assert cut_pair_alike([1, 2, 3, 4, 5], [1, 2, 3, 9], 4) == ([2, 3, 4, 5], [2, 3, 9])  # 1 shared token off both
    assert cut_pair_alike([1, 2, 3], [1, 2, 4], 5) == ([1, 2, 3], [1, 2, 4])  # fits: untouched
    # The responses alone do not fit: the shared prompt (1, 2) goes, then both lose their ends.
    assert cut_pair_alike([1, 2, 3, 4, 5, 6], [1, 2, 7], 3) == ([3, 4, 5], [7])
    # One is the other's start: the shorter keeps its last token.
    assert cut_pair_alike([1, 2, 3, 4], [1, 2], 3) == ([2, 3, 4], [2])
