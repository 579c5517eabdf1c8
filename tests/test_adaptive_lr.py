"""--lr-target-kl: the actor's lr steered by the update's approx_kl (core/adaptive_lr.py), its rule
by hand-worked numbers, and in the trainer: measured at every step but the first, applied to the
actor's group only, logged, refused where nothing would measure it.  (Its resume: test_resume.py.)"""

from __future__ import annotations

import math

import pytest

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.core import KLAdaptiveLR
from ppo_rlhf.trainers.ppo_config import PPOConfig
from test_micro_batches import ROWS, trainer_with


def test_the_lr_is_kept_within_the_band_around_the_target():
    control = KLAdaptiveLR(1e-3, target=0.01)
    for kl in (0.005, 0.01, 0.02):  # [target / 2, 2 target], ends included
        assert control.update(kl) == 1e-3


def test_outside_the_band_the_lr_moves_by_sqrt_target_over_kl_hand_worked():
    # kl 0.004 < 0.005: sqrt(0.01 / 0.004) = sqrt(2.5) = 1.58114
    assert KLAdaptiveLR(1e-3, 0.01).update(0.004) == pytest.approx(1.58114e-3, rel=1e-5)
    # kl 0.03 > 0.02: sqrt(0.01 / 0.03) = 0.57735
    assert KLAdaptiveLR(1e-3, 0.01).update(0.03) == pytest.approx(5.7735e-4, rel=1e-5)


def test_one_measurement_at_most_doubles_or_halves_the_lr():
    assert KLAdaptiveLR(1e-3, 0.01).update(1e-6) == pytest.approx(2e-3)  # sqrt(1e4) = 100, capped at 2
    assert KLAdaptiveLR(1e-3, 0.01).update(0.0) == pytest.approx(2e-3)
    assert KLAdaptiveLR(1e-3, 0.01).update(0.05) == pytest.approx(5e-4)  # sqrt(0.2) = 0.447, capped at 1/2
    assert KLAdaptiveLR(1e-3, 0.01).update(math.nan) == 1e-3  # a non-finite measurement changes nothing
    assert KLAdaptiveLR(1e-3, 0.01).update(math.inf) == 1e-3


def test_the_lr_stays_within_its_span_of_the_one_given():
    rising, falling = KLAdaptiveLR(1e-3, 0.01, span=10), KLAdaptiveLR(1e-3, 0.01, span=10)
    for _ in range(10):
        rising.update(0.0)
        falling.update(1.0)
    assert rising.lr == pytest.approx(1e-2) and falling.lr == pytest.approx(1e-4)


def test_its_state_round_trips():
    control = KLAdaptiveLR(1e-3, 0.01)
    control.update(0.0)
    restored = KLAdaptiveLR(5e-4, 0.01)
    restored.load_state_dict(control.state_dict())
    assert (restored.lr, restored.low, restored.high) == (control.lr, control.low, control.high)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        KLAdaptiveLR(1e-3, 0.0)
    with pytest.raises(ConfigError, match="'lr_target_kl'.*one optimizer step an iteration"):
        build_config(PPOConfig, {"task": "doubling", "batch_size": 16, "mini_batch_size": 16, "ppo_epochs": 1,
                                 "lr_target_kl": 0.01})
    with pytest.raises(ConfigError, match="'lr_target_kl'.*> 0"):
        build_config(PPOConfig, {"task": "doubling", "lr_target_kl": 0.0})


@pytest.mark.parametrize("target, factor", [(1e-12, 0.5), (10.0, 2.0)], ids=["over", "under"])
def test_the_update_adapts_the_actors_lr_at_each_step_after_the_first(zoo, target, factor):
    # 2 epochs x 2 minibatches: 4 steps, 3 of them measured.  A target no step can reach halves the lr
    # at each; one no step can exceed doubles it (the KL is far outside the band either way).
    trainer = trainer_with(zoo, mini_batch_size=4, ppo_epochs=2, lr_target_kl=target)
    experience, _ = trainer.make_experience(ROWS)
    measured = []
    real = trainer.lr_control.update
    trainer.lr_control.update = lambda kl: measured.append(kl) or real(kl)
    stats = trainer.update(experience)
    assert stats["update_steps"] == 4 and len(measured) == 3
    assert all(kl > 0 for kl in measured)  # the steps before each moved the policy
    actor_group, critic_group = trainer.optimizer.param_groups
    assert actor_group["lr"] == pytest.approx(1e-3 * factor ** 3) == stats["lr"]
    assert critic_group["lr"] == 1e-3  # the critic's loss is not the policy's move: its lr stays


def test_without_a_target_the_lr_is_fixed_and_not_logged(zoo):
    trainer = trainer_with(zoo, mini_batch_size=4, ppo_epochs=2)
    experience, _ = trainer.make_experience(ROWS)
    stats = trainer.update(experience)
    assert trainer.lr_control is None and "lr" not in stats
    assert [group["lr"] for group in trainer.optimizer.param_groups] == [1e-3, 1e-3]


def test_the_plan_says_how_the_lr_moves(zoo):
    from ppo_rlhf.trainers.ppo_plan import _lr_control

    line = _lr_control(trainer_with(zoo, mini_batch_size=4, lr_target_kl=0.02).lr_control)
    assert "toward approx_kl 0.02" in line and "[0.01, 0.04]" in line and "[1e-05, 0.1]" in line
