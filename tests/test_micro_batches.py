"""Micro-batches change how much is held at once, never the result: the rollout's old, reference
and critic passes in micro-batches equal one full pass, and a minibatch's gradient accumulated
over micro-batches equals the gradient of the whole minibatch (and so do its statistics)."""

from __future__ import annotations

import pytest
import torch

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.models import load_causal_lm, load_tokenizer
from ppo_rlhf.models.value import ModelCritic
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.reward import FunctionReward
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import PROMPTS, REWARDS_MODULE

ROWS = [{"prompt": PROMPTS[i % len(PROMPTS)]} for i in range(8)]


def trainer_with(zoo, critic: str = "shared", **overrides) -> PPOTrainer:
    config = build_config(PPOConfig, {
        "model": str(zoo["gpt2"]), "reward_fn": f"{REWARDS_MODULE}:length_score", "batch_size": 8,
        "mini_batch_size": 8, "ppo_epochs": 1, "max_new_tokens": 6, "max_length": 32, "lr": 1e-3,
        "kl_estimator": "full", "kl_in": "loss", **overrides})
    tokenizer = load_tokenizer(config.model)
    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, config.max_new_tokens, do_sample=True,
                               seed=0)
    torch.manual_seed(0)  # the value head starts the same in both trainers
    separate = ModelCritic.from_pretrained_trunk(config.model) if critic == "separate" else None
    return PPOTrainer(config, FunctionReward(config.reward_fn[0]), model=load_causal_lm(config.model),
                      ref=load_causal_lm(config.model), tokenizer=tokenizer, generator=generator, critic=separate)


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_rollout_passes_in_micro_batches_equal_one_full_pass(zoo, critic):
    whole, _ = trainer_with(zoo, critic).make_experience(ROWS)
    parts, _ = trainer_with(zoo, critic, rollout_micro_batch_size=3).make_experience(ROWS)  # 3 + 3 + 2 rows
    assert torch.equal(whole.sequences.response_ids, parts.sequences.response_ids)
    for name in ("logprobs", "ref_logprobs", "values", "kl", "advantages", "returns"):
        assert torch.allclose(getattr(whole, name), getattr(parts, name), atol=1e-6), name


@pytest.mark.parametrize("aggregation, critic", [("token-mean", "shared"), ("sequence-mean", "shared"),
                                                 ("token-mean", "separate")])
def test_gradient_accumulation_equals_one_large_minibatch(zoo, aggregation, critic):
    whole_trainer = trainer_with(zoo, critic, loss_aggregation=aggregation, entropy_coef=0.01)
    accumulated_trainer = trainer_with(zoo, critic, loss_aggregation=aggregation, entropy_coef=0.01,
                                       train_micro_batch_size=2)
    experience, _ = whole_trainer.make_experience(ROWS)
    minibatch = torch.tensor([5, 0, 7, 2, 3, 6, 1, 4])
    for trainer in (whole_trainer, accumulated_trainer):
        trainer.actor.train()
        trainer.critic.train()
    whole_stats = whole_trainer.accumulate_gradients(experience, minibatch, warming_up=False)
    accumulated_stats = accumulated_trainer.accumulate_gradients(experience, minibatch, warming_up=False)
    pairs = list(zip(whole_trainer.trainable_parameters, accumulated_trainer.trainable_parameters))
    assert all(a.grad is not None for a, _ in pairs)
    largest = max((a.grad - b.grad).abs().max().item() for a, b in pairs)
    assert largest <= 1e-6 * max(a.grad.abs().max().item() for a, _ in pairs), largest
    assert whole_stats.keys() == accumulated_stats.keys()
    for key in whole_stats:
        assert accumulated_stats[key].item() == pytest.approx(whole_stats[key].item(), rel=1e-5, abs=1e-7), key


def test_a_micro_batch_that_does_not_divide_the_minibatch_is_refused():
    with pytest.raises(ConfigError, match="'train_micro_batch_size'.*divisor of mini_batch_size \\(16\\)"):
        build_config(PPOConfig, {"task": "doubling", "mini_batch_size": 16, "train_micro_batch_size": 5})
    with pytest.raises(ConfigError, match="'rollout_micro_batch_size'.*> 0"):
        build_config(PPOConfig, {"task": "doubling", "rollout_micro_batch_size": 0})


def test_max_approx_kl_stops_alike_with_and_without_micro_batches_and_spends_no_backward_on_the_stop(zoo):
    settings = {"mini_batch_size": 4, "ppo_epochs": 4, "lr": 1e-2, "max_approx_kl": 1e-4}
    whole_trainer = trainer_with(zoo, **settings)
    accumulated_trainer = trainer_with(zoo, train_micro_batch_size=2, **settings)
    experience, _ = whole_trainer.make_experience(ROWS)
    backward_calls = {}
    for name, trainer in (("whole", whole_trainer), ("accumulated", accumulated_trainer)):
        original = trainer.accelerator.backward

        def counted(loss, name=name, original=original):
            backward_calls[name] = backward_calls.get(name, 0) + 1
            return original(loss)

        trainer.accelerator.backward = counted
    whole = whole_trainer.update(experience)
    accumulated = accumulated_trainer.update(experience)
    assert 0 < whole["update_steps"] < 8  # the stop was reached, after at least one step
    assert accumulated["update_steps"] == whole["update_steps"]
    # The same steps with the same statistics (the weights themselves are not compared: AdamW's
    # first steps are about lr * sign(gradient), which float rounding flips for a gradient near 0).
    for key in ("pg_loss", "approx_kl", "entropy", "vf_loss"):
        assert accumulated[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-7), key
    # One micro-batch: the stop is seen before its backward pass; two: after both (then discarded).
    assert backward_calls["whole"] == whole["update_steps"]
    assert backward_calls["accumulated"] == 2 * (whole["update_steps"] + 1)
