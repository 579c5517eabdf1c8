"""Old log-probs read off the update's own forward pass (docs/design.md, "Old log-probs from the
update"): where a batch gets one optimizer step, the trainer skips the actor's pass before the
update, and trains, logs and resumes as it does with that pass."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_rlhf.config import build_config
from ppo_rlhf.models import load_causal_lm
from ppo_rlhf.trainers.ppo import PPOTrainer, old_logprobs_from_update
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import PROMPTS, REWARDS_MODULE

ONE_STEP = {"estimator": "grpo", "samples_per_prompt": 2, "batch_size": 8, "mini_batch_size": 8, "ppo_epochs": 1,
            "kl_in": "loss", "kl_coef": 0.1}


def config_of(zoo, **overrides) -> PPOConfig:
    return build_config(PPOConfig, {"model": str(zoo["gpt2"]), "prompts": str(zoo["prompts"]), "reward_fn": f"{REWARDS_MODULE}:length_score",
                                    "max_new_tokens": 6, "max_length": 32, "lr": 1e-2, "num_threads": 1, **{**ONE_STEP, **overrides}})


@pytest.mark.parametrize("overrides, expected", [
    ({}, True),
    ({"kl_in": "reward", "kl_coef": 0.0}, True),  # no KL in the reward: nothing before the update needs them
    ({"kl_in": "reward", "kl_estimator": None}, False),  # the reward's KL needs the old log-probs first
    ({"ppo_epochs": 2}, False),  # a second step runs moved weights
    ({"mini_batch_size": 4}, False),
    ({"estimator": "gae", "samples_per_prompt": 1}, False),  # the critic's values come from the same pass
    ({"disable_dropout": False}, False),
    ({"lora": True}, True),
    ({"lora": True, "lora_dropout": 0.1}, False),  # dropout on in the update, off in the rollout's pass
])
def test_which_settings_take_the_old_logprobs_from_the_update(zoo, overrides, expected):
    config = config_of(zoo, **overrides)
    assert old_logprobs_from_update(config, critic=object() if config.estimator == "gae" else None) is expected


def trainer_of(zoo, from_update: bool, **overrides) -> PPOTrainer:
    trainer = PPOTrainer(config_of(zoo, **overrides))  # seeded by the config: both runs draw the same
    assert trainer.old_logprobs_from_update  # what the settings give
    trainer.old_logprobs_from_update = from_update
    return trainer


@pytest.mark.parametrize("overrides", [{}, {"kl_in": "reward", "kl_coef": 0.0}, {"kl_estimator": "full"},
                                       {"lora": True, "lr": 3e-2}],
                         ids=["k3-in-loss", "no-kl-in-reward", "full-kl-in-loss", "lora"])
def test_the_update_trains_and_logs_as_with_a_pass_of_their_own(zoo, overrides):
    rows = [{"prompt": p} for p in PROMPTS[:4] for _ in range(2)]
    runs = []
    for from_update in (True, False):
        trainer = trainer_of(zoo, from_update, **overrides)
        start = {name: p.detach().clone() for name, p in trainer.actor.named_parameters() if p.requires_grad}
        calls = []
        trainer.actor.register_forward_hook(lambda *_: calls.append(1))
        metrics = [trainer.step(rows) for _ in range(3)]
        runs.append((trainer, start, metrics, len(calls)))
    (fast, start, fast_metrics, fast_calls), (slow, _, slow_metrics, slow_calls) = runs
    trained = dict(fast.actor.named_parameters())
    assert max((trained[name] - weights).abs().max().item() for name, weights in start.items()) > 1e-3  # it trained
    for ours, theirs in zip(fast.actor.state_dict().values(), slow.actor.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(fast_metrics, slow_metrics):
        for key in ("score", "kl", "pg_loss", "approx_kl", "clipfrac", "entropy", "kl_loss", "grad_norm"):
            if key in theirs:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
    assert fast_metrics[0]["kl"] == pytest.approx(0, abs=1e-6) and fast_metrics[-1]["kl"] > 1e-4  # filled in by the update
    # Without its own pass the actor runs one forward pass less per iteration (two model calls where
    # prompts are shared: the distinct prompts, then the responses).
    assert fast.pass_plan.share_prompts is slow.pass_plan.share_prompts is True
    assert slow_calls - fast_calls == 3 * 2


def test_a_batch_whose_update_is_skipped_logs_no_kl(zoo, monkeypatch):
    # A reward that gave a non-finite score: the update is skipped, so the old log-probs it would
    # have read were never computed -- the KL is logged as unknown and the controller left alone.
    trainer = trainer_of(zoo, True, target_kl=1.0)
    score = trainer.score
    monkeypatch.setattr(trainer, "score", lambda *args: (score(*args)[0] * float("nan"), *score(*args)[1:]))
    before = {name: p.detach().clone() for name, p in trainer.actor.named_parameters()}
    coef = trainer.kl_controller.value
    metrics = trainer.step([{"prompt": p} for p in PROMPTS[:4] for _ in range(2)])
    assert math.isnan(metrics["kl"]) and metrics["skipped_steps"] == 1 and trainer.kl_controller.value == coef
    assert all(torch.equal(p, before[name]) for name, p in trainer.actor.named_parameters())
