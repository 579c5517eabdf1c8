"""The core formulas against numbers worked out by hand (see the comments for the working)."""

import math

import pytest
import torch

from ppo_rlhf.core import (
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    explained_variance,
    full_kl,
    gae_advantages,
    kl_penalty,
    masked_gae,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    value_loss,
)


# ---------------------------------------------------------------- masked statistics
def test_masked_mean_and_var_by_hand():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)
    # deviations -1, 0, 1: sum of squares 2; biased 2/3, unbiased 2/2 = 1
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(2 / 3)
    assert masked_var(x, mask).item() == pytest.approx(1.0)


def test_masked_mean_ignores_inf_in_padding():
    x = torch.tensor([[1.0, 3.0, float("inf")]])
    mask = torch.tensor([[1, 1, 0]])
    assert masked_mean(x, mask).item() == pytest.approx(2.0)


def test_masked_var_empty_mask_is_a_clear_error():
    with pytest.raises(ValueError, match="selects 0"):
        masked_var(torch.ones(3), torch.zeros(3))


def test_masked_whiten_by_hand_and_zero_padding():
    x = torch.tensor([1.0, 2.0, 3.0, 50.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # mean 2, unbiased var 1 -> (-1, 0, 1), padding -> 0
    assert torch.allclose(masked_whiten(x, mask), torch.tensor([-1.0, 0.0, 1.0, 0.0]), atol=1e-6)
    # without the shift, the mean comes back: (1, 2, 3)
    assert torch.allclose(masked_whiten(x, mask, shift_mean=False), torch.tensor([1.0, 2.0, 3.0, 0.0]), atol=1e-6)


# ---------------------------------------------------------------- GAE
def test_gae_three_tokens_by_hand():
    # gamma 0.9, lam 0.8, reward only at the end, V after the last token = 0:
    # delta2 = 1 - 0.7 = 0.3;  delta1 = 0.9*0.7 - 0.6 = 0.03;  delta0 = 0.9*0.6 - 0.5 = 0.04
    # A2 = 0.3;  A1 = 0.03 + 0.72*0.3 = 0.246;  A0 = 0.04 + 0.72*0.246 = 0.21712
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    advantages, returns = masked_gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert torch.allclose(advantages, torch.tensor([[0.21712, 0.246, 0.3]]), atol=1e-6)
    assert torch.allclose(returns, torch.tensor([[0.71712, 0.846, 1.0]]), atol=1e-6)


def test_gae_padding_never_changes_the_result():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    reference, _ = masked_gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # Same response followed by two padding positions holding garbage.
    padded_rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0, -3.0]])
    padded_values = torch.tensor([[0.5, 0.6, 0.7, 42.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])
    advantages, returns = masked_gae(padded_rewards, padded_values, mask, gamma=0.9, lam=0.8)
    assert torch.allclose(advantages[:, :3], reference, atol=1e-6)
    assert torch.all(advantages[:, 3:] == 0) and torch.all(returns[:, 3:] == 0)


def test_gae_truncation_bootstraps_and_termination_does_not():
    # One env, 4 steps, gamma 0.5, lam 1.  Step 1 is truncated (final state worth 10),
    # step 3 terminated.  V = 2, 3, 4, 5.
    # delta0 = 1 + 0.5*3 - 2 = 0.5;  delta1 = 1 + 0.5*10 - 3 = 3 (bootstrap from the final state)
    # delta2 = 1 + 0.5*5 - 4 = -0.5; delta3 = 1 + 0 - 5 = -4 (terminated: nothing after)
    # A3 = -4;  A2 = -0.5 + 0.5*(-4) = -2.5;  A1 = 3 (episode boundary);  A0 = 0.5 + 0.5*3 = 2
    rewards = torch.ones(4)
    values = torch.tensor([2.0, 3.0, 4.0, 5.0])
    next_values = torch.tensor([3.0, 10.0, 5.0, 0.0])
    continues = torch.tensor([1.0, 0.0, 1.0, 0.0])
    advantages = gae_advantages(rewards, values, next_values, continues, gamma=0.5, lam=1.0)
    assert torch.allclose(advantages, torch.tensor([2.0, 3.0, -2.5, -4.0]))


# ---------------------------------------------------------------- KL
def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([0.0]), torch.tensor([-0.5])  # log ratio 0.5
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-7)
    with pytest.raises(ValueError, match="allowed"):
        kl_penalty(logp, ref, "k9")


def test_full_kl_by_hand():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 0.5 ln 2 + 0.5 ln(2/3) = 0.1438410
    logits = torch.log(torch.tensor([0.5, 0.5]))
    ref_logits = torch.log(torch.tensor([0.25, 0.75]))
    assert full_kl(logits, ref_logits).item() == pytest.approx(0.1438410, abs=1e-6)
    assert full_kl(logits, logits).item() == pytest.approx(0.0, abs=1e-7)


def test_kl_controllers():
    fixed = FixedKLController(0.3)
    fixed.update(100.0, 64)
    assert fixed.value == 0.3
    adaptive = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    adaptive.update(12.0, 64)  # error +1 clipped to +0.2: 0.2 * (1 + 0.2 * 64 / 10000)
    assert adaptive.value == pytest.approx(0.200256)
    adaptive.update(3.0, 64)  # error -0.5 clipped to -0.2
    assert adaptive.value == pytest.approx(0.200256 * (1 - 0.2 * 64 / 10000))


# ---------------------------------------------------------------- losses
def test_policy_loss_ratio_outside_clip_gets_zero_gradient():
    old = torch.zeros(2)
    # token 0: ratio 1.5 with A = +1 -> clipped at 1.2, no gradient
    # token 1: ratio 0.5 with A = +1 -> unclipped branch wins (pessimistic), gradient -ratio/2
    logprobs = torch.log(torch.tensor([1.5, 0.5])).requires_grad_()
    advantages = torch.tensor([1.0, 1.0])
    loss, stats = policy_loss(logprobs, old, advantages, None, clip_ratio=0.2)
    loss.backward()
    assert loss.item() == pytest.approx((-1.2 - 0.5) / 2)
    assert logprobs.grad[0].item() == 0.0
    assert logprobs.grad[1].item() == pytest.approx(-0.25)
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    assert stats["ppo_ratio"].item() == pytest.approx(1.0)
    assert stats["ppo_ratio_clamped"].item() == pytest.approx((1.2 + 0.8) / 2)
    assert stats["abs_pg_loss"].item() == pytest.approx((1.2 + 0.5) / 2)


def test_policy_loss_padding_never_changes_the_result():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    old = torch.tensor([[-1.1, -1.9, -0.5]])
    advantages = torch.tensor([[0.3, -0.7, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = policy_loss(logprobs, old, advantages, mask, 0.2)
    loss_short, _ = policy_loss(logprobs[:, :2], old[:, :2], advantages[:, :2], None, 0.2)
    assert loss.item() == pytest.approx(loss_short.item())


def test_value_loss_by_hand():
    # V = 1.5, V_old = 1, R = 2, c = 0.2: clipped V = 1.2
    # unclipped (1.5-2)^2 = 0.25, clipped (1.2-2)^2 = 0.64 -> max 0.64, times 0.5 = 0.32
    values = torch.tensor([1.5], requires_grad=True)
    loss, stats = value_loss(values, torch.tensor([1.0]), torch.tensor([2.0]), None, 0.2)
    assert loss.item() == pytest.approx(0.32)
    assert stats["vf_clipfrac"].item() == 1.0
    loss.backward()
    assert values.grad.item() == 0.0  # the clipped branch is constant in V
    plain, _ = value_loss(torch.tensor([1.5]), torch.tensor([1.0]), torch.tensor([2.0]), None, None)
    assert plain.item() == pytest.approx(0.125)


def test_entropy_and_explained_variance():
    uniform = torch.zeros(4)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(4))
    returns = torch.tensor([1.0, 2.0, 3.0])
    assert explained_variance(returns, returns, None).item() == pytest.approx(1.0)
    # constant prediction at the mean explains nothing
    assert explained_variance(torch.full((3,), 2.0), returns, None).item() == pytest.approx(0.0)


def test_merge_moments_by_hand_for_tensors_and_arrays():
    import numpy as np

    from ppo_rlhf.core.normalize import RunningMoments, merge_moments

    # {1, 3}: mean 2, variance 1, count 2;  {5}: mean 5, variance 0, count 1.
    # {1, 3, 5}: mean 3, variance (4 + 0 + 4) / 3 = 8/3.
    for kind in (torch.tensor, np.array):
        mean, var, count = merge_moments(kind([2.0]), kind([1.0]), 2, kind([5.0]), kind([0.0]), 1)
        assert float(mean[0]) == pytest.approx(3.0) and float(var[0]) == pytest.approx(8 / 3) and count == 3
    moments = RunningMoments(eps=0.0)
    moments.update(torch.tensor([1.0, 3.0]))
    moments.update(torch.tensor([5.0]))
    assert moments.mean.item() == pytest.approx(3.0) and moments.std.item() == pytest.approx((8 / 3) ** 0.5)
