"""Advantage estimators: one trainer, only the advantage changes.

Hand-worked advantages of every estimator on one group; the K samples of a prompt stay with
their prompt through scoring and the update; ReMax's baseline is the greedy response's score;
a critic-free run builds, trains and saves no critic; every estimator resumes to the weights of
a straight run and runs with LoRA and a reward model; bad settings fail at start.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.models import load_causal_lm, load_tokenizer
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.reward import ScoringReward
from ppo_rlhf.rollout.responses import generate_responses
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.stages.ppo import draw_batch
from ppo_rlhf.trainers.estimators import (
    PAPER_WHITENING,
    check_prompt_groups,
    critic_free_advantages,
    score_advantages,
)
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import PROMPTS, REWARDS_MODULE, THREADS, run, run_failing, same_actor_as_straight_run

CRITIC_FREE = ["grpo", "dr-grpo", "rloo", "reinforce++", "remax"]
SAMPLES = {"grpo": 4, "dr-grpo": 4, "rloo": 4, "reinforce++": 2, "remax": 2}  # K per prompt in the runs below


# ---------------------------------------------------------------- advantages by hand
# One prompt, 4 responses scored (1, 2, 3, 6): mean 3, deviations (-2, -1, 0, 3), unbiased std
# sqrt(14/3) = 2.160247.  ReMax's greedy response to the prompt scored 2.
SCORES = torch.tensor([1.0, 2.0, 3.0, 6.0])
EXPECTED = {
    "grpo": [-0.925820, -0.462910, 0.0, 1.388730],  # (score - 3) / 2.160247
    "dr-grpo": [-2.0, -1.0, 0.0, 3.0],  # score - 3
    "rloo": [-8 / 3, -4 / 3, 0.0, 4.0],  # score - mean of the other three
    "reinforce++": [1.0, 2.0, 3.0, 6.0],  # no baseline (the trainer whitens over the batch)
    "remax": [-1.0, 0.0, 1.0, 4.0],  # score - 2
}


@pytest.mark.parametrize("estimator", CRITIC_FREE)
def test_each_estimators_advantages_on_a_group_of_four_by_hand(estimator):
    greedy = torch.full((4,), 2.0)
    centred = score_advantages(estimator, SCORES, 4, greedy)
    assert torch.allclose(centred, torch.tensor(EXPECTED[estimator]), atol=1e-5)
    # On the tokens: responses of 2, 3, 1 and 2 tokens.  KL out of the reward (gamma 1): the one
    # number on every token of a response, 0 on padding.
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    advantages = critic_free_advantages(estimator, SCORES, torch.zeros(4, 3), mask, 0.0, 1.0, 4, greedy)
    assert torch.allclose(advantages, torch.where(mask.bool(), centred[:, None], torch.tensor(0.0)), atol=1e-5)
    # All four scores equal: nothing to prefer, and no NaN
    equal = critic_free_advantages(estimator, torch.full((4,), 0.4), torch.zeros(4, 3), mask, 0.0, 1.0, 4,
                                   torch.full((4,), 0.4))
    expected_equal = 0.4 if estimator == "reinforce++" else 0.0  # reinforce++ centres by whitening, later
    assert torch.allclose(equal, torch.where(mask.bool(), torch.tensor(expected_equal), torch.tensor(0.0)))


def test_kl_in_the_reward_adds_its_reward_to_go_to_the_centred_score():
    # RLOO on two responses scored (1, 3) of 2 tokens each, k1 KL (0.2, 0.4) and (0, -0.2), kl_coef 0.5:
    # centred scores (-2, 2); rewards (-0.1, -0.2 - 2) and (0, 0.1 + 2); gamma 1 reward-to-go:
    # (-2.3, -2.2) and (2.1, 2.1)
    kl = torch.tensor([[0.2, 0.4], [0.0, -0.2]])
    advantages = critic_free_advantages("rloo", torch.tensor([1.0, 3.0]), kl, torch.ones(2, 2, dtype=torch.long), 0.5, 1.0, 2)
    assert torch.allclose(advantages, torch.tensor([[-2.3, -2.2], [2.1, 2.1]]))


def test_only_gae_and_reinforce_plus_plus_whiten_by_default():
    assert [e for e, whiten in PAPER_WHITENING.items() if whiten] == ["gae", "reinforce++"]


def test_groups_must_sit_in_adjacent_rows():
    check_prompt_groups(["a", "a", "b", "b"], 2)
    with pytest.raises(ValueError, match="row 3 holds another prompt than row 2"):
        check_prompt_groups(["a", "a", "b", "a"], 2)


# ---------------------------------------------------------------- the K samples of a prompt stay with it
def tiny_trainer(zoo, reward, **overrides) -> PPOTrainer:
    config = build_config(PPOConfig, {
        "model": str(zoo["gpt2"]), "reward_fn": f"{REWARDS_MODULE}:length_score", "batch_size": 12,
        "mini_batch_size": 4, "ppo_epochs": 2, "max_new_tokens": 6, "max_length": 32, "do_sample": True,
        "lr": 1e-3, **overrides})
    tokenizer = load_tokenizer(config.model)
    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, config.max_new_tokens, do_sample=True,
                               seed=0)
    return PPOTrainer(config, reward, model=load_causal_lm(config.model), ref=load_causal_lm(config.model),
                      tokenizer=tokenizer, generator=generator)


class PromptIndexReward(ScoringReward):
    """100 x the index its row gives the prompt + the response's length in tokens; checks on the
    way that the row, the prompt text and the prompt tokens of every sequence agree."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, batch) -> torch.Tensor:
        prompt_texts = self.tokenizer.batch_decode(batch.sequences.prompt_ids, skip_special_tokens=True)
        for row, prompt, tokens in zip(batch.rows, batch.prompts, prompt_texts):
            assert row["prompt"] == prompt == tokens, (row, prompt, tokens)
        lengths = batch.sequences.response_mask.sum(dim=1).float()
        return 100.0 * torch.tensor([float(row["index"]) for row in batch.rows]) + lengths


def test_k_samples_stay_aligned_with_their_prompts_through_scoring_and_the_update(zoo):
    rows = [{"prompt": p, "index": i} for i, p in enumerate(PROMPTS)]
    trainer = tiny_trainer(zoo, None, estimator="dr-grpo", samples_per_prompt=3, kl_coef=0.0)
    trainer.reward = PromptIndexReward(trainer.tokenizer)
    batch = draw_batch(rows, trainer.config, torch.Generator().manual_seed(0))
    indices = [row["index"] for row in batch]
    assert len(batch) == 12 and all(indices[i] == indices[i - i % 3] for i in range(12))  # 4 prompts x 3, adjacent
    experience, _ = trainer.make_experience(batch)
    # Dr. GRPO: score - group mean.  Within an aligned group the 100 x index cancels and what is
    # left is the length less the group's mean length (< 6 tokens); a group mixing prompts would
    # leave multiples of 100.
    for selected in (experience, experience.select(torch.randperm(12))):  # the update's minibatches select so
        lengths = selected.mask.sum(dim=1).float()
        index = torch.tensor([float(r) for r in (selected.scores - lengths) / 100])
        for row in range(12):
            group = index == index[row]
            expected = lengths[row] - lengths[group].mean()
            response = selected.advantages[row][selected.mask[row].bool()]
            assert torch.allclose(response, expected.expand_as(response), atol=1e-5), row
    assert experience.advantages.abs().max() < 6
    stats = trainer.update(experience)
    assert stats["update_steps"] == 6 and "vf_loss" not in stats


def test_remax_baseline_is_the_score_of_each_prompts_greedy_response(zoo):
    trainer = tiny_trainer(zoo, None, estimator="remax", samples_per_prompt=2, batch_size=8, kl_coef=0.0)
    lengths_reward = lambda batch: batch.sequences.response_mask.sum(dim=1).float()  # noqa: E731
    trainer.reward = lengths_reward
    rows = [{"prompt": p} for p in PROMPTS[:4] for _ in range(2)]
    experience, _ = trainer.make_experience(rows)
    greedy = TorchGenerator(trainer.tokenizer.eos_token_id, trainer.tokenizer.pad_token_id, 6, do_sample=False)
    greedy_lengths = generate_responses(trainer.actor, trainer.tokenizer, greedy, PROMPTS[:4],
                                        trainer.config.max_prompt_length).sequences.response_mask.sum(dim=1).float()
    assert torch.equal(experience.greedy_scores, greedy_lengths.repeat_interleave(2))
    assert torch.allclose(experience.advantages[:, 0], experience.scores - experience.greedy_scores)


# ---------------------------------------------------------------- a response with no score teaches nothing
# A judge's unparsed answer (rollout/judge.py): the group of four above with its third response
# (3) unscored.  The others are a group of (1, 2, 6): mean 3, deviations (-2, -1, 3), unbiased std
# sqrt(14 / 2) = 2.645751; RLOO's means of the other two: 4, 3.5, 1.5.
UNSCORED_EXPECTED = {
    "grpo": [-0.755929, -0.377964, 0.0, 1.133893],
    "dr-grpo": [-2.0, -1.0, 0.0, 3.0],
    "rloo": [-3.0, -1.5, 0.0, 4.5],
}


@pytest.mark.parametrize("estimator", ["grpo", "dr-grpo", "rloo"])
def test_an_unscored_response_is_out_of_its_groups_baseline_by_hand(estimator):
    from ppo_rlhf.core import group_advantages

    scored = torch.tensor([[True, True, False, True]])
    for stand_in in (3.0, -50.0):  # whatever stands in for its score
        scores = torch.tensor([[1.0, 2.0, stand_in, 6.0]])
        advantages = group_advantages(scores, estimator, scored=scored)
        assert torch.allclose(advantages, torch.tensor([UNSCORED_EXPECTED[estimator]]), atol=1e-5)
    # Fewer than two scored: no baseline, nothing to prefer.
    lone = group_advantages(torch.tensor([[1.0, 9.0]]), estimator, scored=torch.tensor([[False, True]]))
    assert lone.tolist() == [[0.0, 0.0]]


def test_a_group_is_informative_on_its_scored_responses_alone():
    from ppo_rlhf.core import informative_groups

    scores = torch.tensor([[7.0, 7.0, 3.0], [1.0, 2.0, 2.0], [4.0, 9.0, 9.0]])
    scored = torch.tensor([[True, True, False], [True, True, False], [True, False, False]])
    assert informative_groups(scores, scored).tolist() == [False, True, False]
    assert informative_groups(scores).tolist() == [True, True, True]


ESTIMATOR_SETTINGS = {  # (K, whitened) of each estimator's runs below
    "grpo": (4, False), "dr-grpo": (4, False), "rloo": (4, False), "reinforce++": (1, True), "remax": (2, False),
    "gae": (1, True)}


@pytest.mark.parametrize("estimator", list(ESTIMATOR_SETTINGS))
def test_an_unscored_response_teaches_nothing_under_every_estimator(estimator):
    """Stage 6 (advantages_and_returns): the unscored responses' advantages are 0 on every token,
    and no other response's advantage depends on what stands in for their scores (a baseline, the
    whitening); with a critic their returns are the critic's values."""
    from types import SimpleNamespace

    from ppo_rlhf.trainers.estimators import advantages_and_returns

    k, whiten = ESTIMATOR_SETTINGS[estimator]
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(8, 3, dtype=torch.long)
    mask[1, 2] = mask[6, 1:] = 0
    kl = torch.randn(8, 3, generator=generator) * 0.1
    values = torch.randn(8, 3, generator=generator) if estimator == "gae" else None
    greedy = torch.arange(8.0).div(k, rounding_mode="floor") if estimator == "remax" else None
    unscored = torch.zeros(8, dtype=torch.bool)
    unscored[[2, 5]] = True
    config = SimpleNamespace(estimator=estimator, gamma=1.0, lam=0.95, samples_per_prompt=k, whiten_advantages=whiten)

    def stage_6(stand_in: float):
        scores = torch.tensor([1.0, 3.0, stand_in, 2.0, 6.0, stand_in, 0.0, 4.0])
        from ppo_rlhf.core import shaped_rewards

        rewards = shaped_rewards(scores, kl, mask, 0.1)
        return advantages_and_returns(config, rewards, values, scores, kl, mask, 0.1, greedy, None, unscored)

    advantages, returns = stage_6(2.5)
    other_advantages, other_returns = stage_6(-40.0)
    assert advantages[unscored].abs().max() == 0
    assert advantages[~unscored].abs().max() > 0
    assert torch.allclose(advantages, other_advantages, atol=1e-6)
    if values is not None:
        assert torch.equal(returns[unscored], values[unscored])
        assert torch.allclose(returns, other_returns)


class UnparsedJudge(ScoringReward):
    """A judge's verdicts: each row's ``score``, or none for a row marked ``unparsed`` (its stand-in 100)."""

    short_name = "judge"

    def __call__(self, batch) -> torch.Tensor:
        self.last_unscored = torch.tensor([bool(row["unparsed"]) for row in batch.rows])
        return torch.tensor([100.0 if row["unparsed"] else float(row["score"]) for row in batch.rows])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "remax", "gae"])
def test_a_trainer_gives_an_unparsed_judge_answer_advantage_0(zoo, estimator):
    """Through the trainer: the judge's unparsed rows (2 and 5) reach stage 6 and teach nothing; the
    group estimators' other rows are compared with their group's scored rows alone; ReMax's group
    whose greedy response (judged as its first row) has no score has no baseline, so teaches nothing."""
    k = {"grpo": 4, "rloo": 4, "remax": 2, "gae": 1}[estimator]
    trainer = tiny_trainer(zoo, None, estimator=estimator, samples_per_prompt=k, batch_size=8, kl_coef=0.0,
                           **({"critic_warmup": 0} if estimator == "gae" else {}))
    trainer.reward = UnparsedJudge()
    scores = [1.0, 3.0, 0.0, 2.0, 6.0, 0.0, 0.0, 4.0]
    rows = [{"prompt": PROMPTS[i // k % len(PROMPTS)], "score": s, "unparsed": i in (2, 5)}
            for i, s in enumerate(scores)]
    experience, _ = trainer.make_experience(rows)
    unscored = torch.tensor([i in (2, 5) for i in range(8)])
    if estimator == "remax":
        unscored[3] = True  # its group's greedy response is row 2's prompt row, unparsed
    assert experience.advantages[unscored].abs().max() == 0
    assert experience.advantages[~unscored].abs().sum() > 0
    if estimator in ("grpo", "rloo"):
        from ppo_rlhf.core import group_advantages

        for group in range(2):
            rows_in = [i for i in range(group * 4, group * 4 + 4) if not unscored[i]]
            expected = group_advantages(torch.tensor([[scores[i] for i in rows_in]]), estimator)[0]
            assert torch.allclose(experience.advantages[rows_in, 0], expected, atol=1e-5)
    if estimator == "gae":
        assert torch.equal(experience.returns[unscored], experience.values[unscored])
        trainer.update(experience)


# ---------------------------------------------------------------- runs: no critic, resume, LoRA
def ppo_command(zoo, out, estimator, *extra):
    return ["ppo", "--model", zoo["gpt2"], "--prompts", zoo["prompts"], "--eval-prompts", zoo["prompts"],
            "--eval-size", 3, "--reward-fn", f"{REWARDS_MODULE}:length_score", "--estimator", estimator,
            "--samples-per-prompt", SAMPLES[estimator], "--batch-size", 8, "--mini-batch-size", 4, "--ppo-epochs", 1,
            "--max-new-tokens", 8, "--max-length", 64, "--do-sample", "--lr", 1e-3, "--out", out, *THREADS, *extra]


def test_a_critic_free_run_has_no_critic_anywhere(zoo, tmp_path, capsys):
    out = tmp_path / "grpo"
    run(ppo_command(zoo, out, "grpo", "--iterations", 2, "--save-every", 1))
    assert "critic:    none (estimator grpo)" in capsys.readouterr().out
    assert not (out / "checkpoints" / "critic").exists()
    assert not (out / "checkpoints" / "last" / "critic").exists()
    state = torch.load(out / "checkpoints" / "last" / "trainer_state.pt", weights_only=False)
    assert "value_head" not in state["trainer"]
    assert [len(group["params"]) for group in state["optimizer"]["param_groups"]][1] == 0  # the critic's: empty
    trained = load_file(out / "checkpoints" / "last" / "trained.safetensors")
    assert trained and all(name.startswith("actor.") for name in trained)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["checkpoints"]) == {"actor"}
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2] and "eval/score" in records[-1]
    for key in ("vf_loss", "vf_clipfrac", "explained_variance"):
        assert all(key not in r for r in records), key
    assert all("pg_loss" in r and "score" in r for r in records[1:])


@pytest.mark.parametrize("estimator", CRITIC_FREE)
def test_each_estimator_resumes_to_the_weights_of_a_straight_run(zoo, tmp_path, estimator):
    run(ppo_command(zoo, tmp_path / "straight", estimator, "--iterations", 3, "--save-every", 1))
    run(ppo_command(zoo, tmp_path / "resumed", estimator, "--iterations", 2, "--save-every", 1))
    run(ppo_command(zoo, tmp_path / "resumed", estimator, "--iterations", 3, "--save-every", 1, "--resume"))
    same_actor_as_straight_run(tmp_path / "straight", tmp_path / "resumed", zoo["gpt2"])
    assert [r["step"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.parametrize("estimator", CRITIC_FREE)
def test_each_estimator_with_lora_and_a_reward_model(zoo, reward_models, tmp_path, estimator):
    out = tmp_path / "ppo"
    run(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--eval-prompts", zoo["prompts"],
         "--eval-size", 3, "--reward-model", reward_models["llama"] / "checkpoints" / "reward",
         "--estimator", estimator, "--samples-per-prompt", SAMPLES[estimator], "--lora", "--lora-r", 4,
         "--lora-alpha", 8, "--iterations", 2, "--batch-size", 8, "--mini-batch-size", 4, "--ppo-epochs", 1,
         "--max-new-tokens", 8, "--max-length", 64, "--do-sample", "--lr", 1e-2, "--save-every", 1, "--out", out,
         *THREADS])
    actor = load_file(str(out / "checkpoints" / "actor" / "adapter_model.safetensors"))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in actor.items()), "the policy did not move"
    assert "critic" not in actor and not any("critic" in k for k in actor)
    assert not (out / "checkpoints" / "critic").exists() and not (out / "checkpoints" / "last" / "critic").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]


# ---------------------------------------------------------------- bad settings fail at start
@pytest.mark.parametrize(
    "values, message",
    [
        ({"estimator": "grpo"}, "'samples_per_prompt'.*>= 2 with estimator grpo"),
        ({"estimator": "rloo", "samples_per_prompt": 1}, "'samples_per_prompt'.*>= 2 with estimator rloo"),
        ({"estimator": "dr-grpo", "samples_per_prompt": 3, "batch_size": 64}, "'batch_size'.*multiple of samples_per_prompt"),
        ({"samples_per_prompt": 0}, "'samples_per_prompt'.*> 0"),
        ({"estimator": "ppo"}, "'estimator'.*gae, grpo, dr-grpo, rloo, reinforce\\+\\+, remax"),
        ({"estimator": "remax", "critic": "separate"}, "'critic'.*estimator remax, which has no critic"),
        ({"estimator": "grpo", "samples_per_prompt": 4, "critic_model": "rm"}, "'critic_model'.*no critic"),
        ({"estimator": "rloo", "samples_per_prompt": 2, "critic_lr": 1e-3}, "'critic_lr'.*no critic"),
        ({"estimator": "reinforce++", "critic_warmup": 3}, "'critic_warmup'.*no critic"),
        ({"estimator": "reinforce++", "vf_coef": 0.1}, "'vf_coef'.*no critic"),
        ({"loss_aggregation": "sum"}, "'loss_aggregation'.*token-mean, sequence-mean, sequence-sum-norm"),
    ],
)
def test_bad_estimator_settings_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(PPOConfig, {"task": "doubling", **values})


def test_each_estimator_gets_its_papers_defaults_unless_told_otherwise():
    def config(**values):
        return build_config(PPOConfig, {"task": "doubling", "samples_per_prompt": 4, **values})

    assert (config().loss_aggregation, config().whiten_advantages, config().vf_coef) == ("token-mean", True, 0.1)
    grpo = config(estimator="grpo")
    assert (grpo.loss_aggregation, grpo.whiten_advantages, grpo.vf_coef) == ("sequence-mean", False, None)
    assert config(estimator="dr-grpo").loss_aggregation == "sequence-sum-norm"
    assert config(estimator="reinforce++").whiten_advantages is True
    assert config(estimator="dr-grpo", loss_aggregation="token-mean", whiten_advantages=True).loss_aggregation == "token-mean"


def test_a_group_estimator_without_groups_exits_2_with_the_reason(zoo, tmp_path, capsys):
    err = run_failing(["ppo", "--model", zoo["gpt2"], "--prompts", zoo["prompts"], "--reward-fn",
                       f"{REWARDS_MODULE}:length_score", "--estimator", "grpo", "--out", tmp_path / "run"], capsys)
    assert "samples_per_prompt" in err and ">= 2 with estimator grpo" in err and "Traceback" not in err


def test_group_outcomes_by_hand():
    from ppo_rlhf.trainers.ppo_metrics import group_outcomes

    # Four groups of K 4: one success alone, all right, all wrong, two of four.
    scores = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0])
    assert group_outcomes(scores, 4) == {"groups/zero_std": 0.5, "groups/one_best": 0.25}
    # Graded scores: the best alone counts whatever the others score.
    assert group_outcomes(torch.tensor([0.2, 0.9, 0.5, 0.5]), 2) == {"groups/zero_std": 0.5, "groups/one_best": 0.5}
