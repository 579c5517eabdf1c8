"""What the reward model trains on is what PPO scores: every real token of every row (whatever
side the tokenizer pads on), EOS at the end of a text as at the end of a finished response, and
the missing-EOS penalty taken off the score (as TRL does)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.core.normalize import RunningMoments
from ppo_rlhf.models import build_sequence_classifier
from ppo_rlhf.rollout.encoding import drop_padding_columns
from ppo_rlhf.rollout.reward import last_token_scores
from ppo_rlhf.tasks import doubling as d
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.reward import RewardConfig, _Examples, pairwise_texts

torch.set_num_threads(1)

# The built-in task's tokenizer pads on the left, as many chat tokenizers do.  One row far
# longer than the others: a batch of short rows is padded to its width.
LONG = "S__:1234x2=2468" * 3 + "E"
SHORT = ["S__:1x2=2E", "S数字:12x2=24E", "S大写:5x2=壹零E"]


class RecordingClassifier(nn.Module):
    """Stands in for a classifier without a last-token head: records what it is given."""

    def __init__(self, num_labels: int):
        super().__init__()
        self.num_labels, self.seen = num_labels, []
        self.anchor = nn.Parameter(torch.zeros(1))  # a model has a device: where its parameters are

    @property
    def base_model(self):
        return self

    def forward(self, input_ids, attention_mask):
        self.seen.append((input_ids, attention_mask))
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], self.num_labels))


def classification_examples(texts: list[str], tokenizer=None):
    tokenizer = tokenizer or d.build_tokenizer()
    config = build_config(RewardConfig, {"mode": "classification", "num_labels": 3})
    return tokenizer, _Examples(tokenizer, [{"text": t, "label": i % 3} for i, t in enumerate(texts)], config)


def real_tokens(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]


def test_a_batch_of_short_rows_keeps_every_real_token_with_a_left_padding_tokenizer():
    tokenizer, examples = classification_examples([LONG, *SHORT])
    assert tokenizer.padding_side == "left"
    model = RecordingClassifier(3)
    examples.loss_and_correct(model, torch.tensor([1, 2, 3]))  # the short rows only
    (ids, mask), = model.seen
    assert real_tokens(ids, mask) == [tokenizer(t)["input_ids"] for t in SHORT]
    assert mask.any(dim=0).all()  # no column of padding only: the batch is as narrow as it can be


def test_rm_loss_of_a_batch_is_the_loss_of_each_row_scored_alone():
    tokenizer, examples = classification_examples([LONG, *SHORT])
    model = build_sequence_classifier(tokenizer, 3, n_layer=1, n_head=2, n_embd=16, seed=0).eval()
    with torch.no_grad():
        loss, _ = examples.loss_and_correct(model, torch.tensor([1, 2, 3]))
        alone = torch.cat([last_token_scores(model, torch.tensor([tokenizer(t)["input_ids"]]),
                                             torch.ones(1, len(tokenizer(t)["input_ids"]), dtype=torch.long))
                           for t in SHORT])
    expected = nn.functional.cross_entropy(alone, torch.tensor([1, 2, 0]))
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_padding_columns_are_dropped_on_either_side():
    ids = torch.tensor([[0, 0, 7, 8, 0], [0, 0, 0, 9, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 1, 0]])
    kept_ids, kept_mask = drop_padding_columns(ids, mask)
    assert kept_ids.tolist() == [[7, 8], [0, 9]] and kept_mask.tolist() == [[1, 1], [0, 1]]


def test_classification_texts_end_with_one_eos_as_a_finished_response_does():
    tokenizer, examples = classification_examples(["S__:12x2=24", "S__:12x2=24E"])
    rows = real_tokens(*examples.texts)
    assert rows[0] == rows[1] == tokenizer("S__:12x2=24E")["input_ids"]


def test_the_built_in_task_rows_are_encoded_as_before():
    tokenizer, examples = classification_examples([row["text"] for row in d.rm_rows([3320, 5487])])
    assert all(row[-1] == tokenizer.eos_token_id and row[-2] != tokenizer.eos_token_id
               for row in real_tokens(*examples.texts))


def test_pairwise_texts_end_with_one_eos():
    tokenizer = d.build_tokenizer()
    config = build_config(RewardConfig, {"mode": "pairwise"})
    chosen, rejected = pairwise_texts(tokenizer, [{"prompt": "S__:12x2=", "chosen": "24", "rejected": "48E"}], config)
    assert (chosen, rejected) == (["S__:12x2=24E"], ["S__:12x2=48E"])


def postprocess(scores, finished, **options):
    trainer = SimpleNamespace(config=build_config(PPOConfig, {"task": "doubling", **options}),
                              score_moments=RunningMoments())
    shaped = PPOTrainer.shape_scores(trainer, torch.tensor(scores), torch.tensor(finished), torch.ones(len(scores)))
    return PPOTrainer.normalise_scores(trainer, shaped)[0]


def test_missing_eos_penalty_is_taken_off_the_score_of_unfinished_responses():
    scores = postprocess([0.5, 2.0, -1.0], [True, False, False], missing_eos_penalty=1.5)
    torch.testing.assert_close(scores, torch.tensor([0.5, 0.5, -2.5]))
    # ... before clipping, as TRL applies it
    scores = postprocess([0.5, 2.0, -1.0], [True, False, False], missing_eos_penalty=1.5, score_clip=2.0)
    torch.testing.assert_close(scores, torch.tensor([0.5, 0.5, -2.0]))


def test_a_negative_missing_eos_penalty_is_refused():
    with pytest.raises(ConfigError, match="'missing_eos_penalty'.*>= 0"):
        build_config(PPOConfig, {"task": "doubling", "missing_eos_penalty": -1.0})
