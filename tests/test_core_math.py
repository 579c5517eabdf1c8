"""The core formulas against numbers worked out by hand (see the comments for the working)."""

import math

import pytest
import torch

from ppo_rlhf.core import (
    AdaptiveKLController,
    FixedKLController,
    KL_PLACEMENTS,
    aggregate_loss,
    check_kl_placement,
    chunked_entropy,
    entropy_from_logits,
    explained_variance,
    full_kl,
    gae_advantages,
    group_advantages,
    kl_penalty,
    last_token_index,
    masked_gae,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    reward_to_go,
    shaped_rewards,
    token_logprobs,
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


def test_gae_skips_the_environments_tokens_of_an_episode():
    # The three-token case above with the model's turns split by two environment tokens (mask 0,
    # holding garbage): the recursion runs over the model's tokens only, so token 1's successor is
    # token 4, undiscounted by the gap, and the numbers are the hand-worked ones above.
    rewards = torch.tensor([[0.0, 0.0, 5.0, -2.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 99.0, float("inf"), 0.7, 3.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]])
    advantages, returns = masked_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    assert torch.allclose(advantages, torch.tensor([[0.21712, 0.246, 0.0, 0.0, 0.3, 0.0]]), atol=1e-6)
    assert torch.allclose(returns, torch.tensor([[0.71712, 0.846, 0.0, 0.0, 1.0, 0.0]]), atol=1e-6)


def test_the_score_lands_on_the_last_token_the_model_wrote():
    # Row 0: a single turn of 2 tokens; row 1: an episode whose last model token (index 4) follows
    # the environment's tokens 2-3; row 2: empty.  A count of the mask would put row 1's score on
    # index 2, an environment token.
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 0, 0, 1], [0, 0, 0, 0, 0]])
    assert last_token_index(mask).tolist() == [1, 4, 0]
    rewards = shaped_rewards(torch.tensor([1.0, 2.0, 3.0]), torch.ones(3, 5), mask, kl_coef=0.1)
    assert torch.allclose(rewards, torch.tensor([[-0.1, 0.9, 0, 0, 0], [-0.1, -0.1, 0, 0, 1.9], [3.0, 0, 0, 0, 0]]))


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


# ---------------------------------------------------------------- advantages without a critic
# One group of 4 responses scored (1, 2, 3, 6), and one whose scores are all 0.4.
# mean 3, deviations (-2, -1, 0, 3), sum of squares 14: unbiased std sqrt(14/3) = 2.160247
GROUP_SCORES = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.4, 0.4, 0.4, 0.4]])


def test_grpo_advantages_by_hand():
    # (-2, -1, 0, 3) / 2.160247 = (-0.925820, -0.462910, 0, 1.388730)
    advantages = group_advantages(GROUP_SCORES, "grpo")
    assert torch.allclose(advantages[0], torch.tensor([-0.925820, -0.462910, 0.0, 1.388730]), atol=1e-5)


def test_dr_grpo_advantages_by_hand():
    advantages = group_advantages(GROUP_SCORES, "dr-grpo")  # score - mean, no std division
    assert torch.allclose(advantages[0], torch.tensor([-2.0, -1.0, 0.0, 3.0]))


def test_rloo_advantages_by_hand():
    # sum 12; each score less the mean of the other three:
    # 1 - 11/3 = -8/3;  2 - 10/3 = -4/3;  3 - 9/3 = 0;  6 - 6/3 = 4   (= 4/3 * (score - mean))
    advantages = group_advantages(GROUP_SCORES, "rloo")
    assert torch.allclose(advantages[0], torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0]))


@pytest.mark.parametrize("method", ["grpo", "dr-grpo", "rloo"])
def test_a_group_of_equal_scores_has_zero_advantage_and_no_nan(method):
    advantages = group_advantages(GROUP_SCORES, method)
    assert torch.equal(advantages[1], torch.zeros(4))  # 0 / (0 + eps) for grpo, never 0 / 0
    # The float32 mean of three 2.9s misses 2.9 by a rounding step; divided by (std + eps) that
    # would be an advantage of -0.18.  Equal scores must still give exactly 0.
    assert torch.equal(group_advantages(torch.full((1, 3), 2.9), method), torch.zeros(1, 3))


def test_a_group_baseline_needs_two_responses():
    with pytest.raises(ValueError, match="at least 2 responses"):
        group_advantages(torch.ones(3, 1), "rloo")
    with pytest.raises(ValueError, match="allowed: grpo, dr-grpo, rloo"):
        group_advantages(GROUP_SCORES, "ppo")


def test_shaped_rewards_and_reward_to_go_by_hand():
    # Score 1 on the last of 3 tokens, k1 KL (0.1, -0.2, 0.3) at kl_coef 0.5, then 2 padding positions:
    # r = (-0.05, 0.1, -0.15 + 1) = (-0.05, 0.1, 0.85)
    # gamma 0.5:  G2 = 0.85;  G1 = 0.1 + 0.5*0.85 = 0.525;  G0 = -0.05 + 0.5*0.525 = 0.2125
    kl = torch.tensor([[0.1, -0.2, 0.3, 7.0, float("inf")]])
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    rewards = shaped_rewards(torch.tensor([1.0]), kl, mask, kl_coef=0.5)
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.1, 0.85, 0.0, 0.0]]))
    returns = reward_to_go(rewards, mask, gamma=0.5)
    assert torch.allclose(returns, torch.tensor([[0.2125, 0.525, 0.85, 0.0, 0.0]]))
    # gamma 1: the plain sum of what follows, 0.9, 0.95, 0.85
    assert torch.allclose(reward_to_go(rewards, mask, gamma=1.0), torch.tensor([[0.9, 0.95, 0.85, 0.0, 0.0]]))


# ---------------------------------------------------------------- loss aggregation
def test_loss_aggregations_by_hand():
    # Response 1: tokens 1, 2, 3 (then padding); response 2: the one token 4.
    per_token = torch.tensor([[1.0, 2.0, 3.0, float("inf")], [4.0, float("nan"), 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5
    assert aggregate_loss(per_token, mask, "token-mean").item() == pytest.approx(2.5)
    # sequence-mean: response means 2 and 4, then their mean 3
    assert aggregate_loss(per_token, mask, "sequence-mean").item() == pytest.approx(3.0)
    # sequence-sum-norm over 4 (the longest response allowed): (6/4 + 4/4) / 2 = 1.25
    assert aggregate_loss(per_token, mask, "sequence-sum-norm", norm_length=4).item() == pytest.approx(1.25)
    with pytest.raises(ValueError, match="norm_length"):
        aggregate_loss(per_token, mask, "sequence-sum-norm")
    with pytest.raises(ValueError, match="allowed: token-mean, sequence-mean, sequence-sum-norm"):
        aggregate_loss(per_token, mask, "median")


def test_policy_loss_aggregates_its_tokens_as_asked():
    # Ratio 1 everywhere: the per-token loss is -A, so the loss is the aggregate of -A.
    logprobs = torch.zeros(2, 3)
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    expected = {"token-mean": (-3 + 2) / 4, "sequence-mean": (-1 + 2) / 2, "sequence-sum-norm": (-3 / 3 + 2 / 3) / 2}
    for aggregation, value in expected.items():
        loss, stats = policy_loss(logprobs, logprobs, advantages, mask, 0.2, aggregation, norm_length=3)
        assert loss.item() == pytest.approx(value), aggregation
        assert stats["abs_pg_loss"].item() == pytest.approx(5 / 4)  # statistics stay token means


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


def test_policy_loss_token_weights_scale_each_token_as_constants():
    """--is-correction's importance weights: each token's loss (and gradient) times its weight,
    no gradient through the weight, padding untouched."""
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    advantages = torch.tensor([[1.0, -2.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    weights = torch.tensor([[2.0, 0.5, float("inf")]], requires_grad=True)  # inf under padding: left out
    loss, stats = policy_loss(logprobs, old, advantages, mask, 0.2, token_weights=weights)
    # ratio 1: per-token loss -A, weighted: (-1 x 2 + 2 x 0.5) / 2 tokens = -0.5
    assert loss.item() == pytest.approx(-0.5)
    loss.backward()
    assert logprobs.grad[0].tolist() == pytest.approx([-1.0, 0.5, 0.0])  # d(-A w ratio)/dlogp / 2 = -A w / 2
    assert weights.grad is None
    unweighted, _ = policy_loss(logprobs, old, advantages, mask, 0.2, token_weights=torch.ones(1, 3))
    assert unweighted.item() == pytest.approx(policy_loss(logprobs, old, advantages, mask, 0.2)[0].item())


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


# ---------------------------------------------------------------- padding never leaks
INF_PADDING_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0]])


def test_gae_inf_in_padding_stays_out():
    reference, _ = masked_gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]), torch.ones(1, 3), 0.9, 0.8)
    rewards = torch.tensor([[0.0, 0.0, 1.0, float("inf"), float("nan")]])
    values = torch.tensor([[0.5, 0.6, 0.7, float("-inf"), float("inf")]])
    advantages, returns = masked_gae(rewards, values, INF_PADDING_MASK, gamma=0.9, lam=0.8)
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    assert torch.allclose(advantages[:, :3], reference, atol=1e-6)
    assert torch.all(advantages[:, 3:] == 0)


def test_whiten_inf_in_padding_comes_back_zero():
    x = torch.tensor([1.0, 2.0, 3.0, float("inf")])
    assert torch.equal(masked_whiten(x, torch.tensor([1, 1, 1, 0]))[3:], torch.zeros(1))


def test_loss_gradients_are_finite_and_zero_on_padding():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.0]], requires_grad=True)
    old_logprobs = torch.tensor([[-1.1, -1.9, -0.5, float("-inf"), float("nan")]])
    advantages = torch.tensor([[1.0, -1.0, 0.5, float("inf"), 2.0]])
    loss, _ = policy_loss(logprobs, old_logprobs, advantages, INF_PADDING_MASK, clip_ratio=0.2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert torch.all(logprobs.grad[:, 3:] == 0)

    values = torch.tensor([[0.1, 0.2, 0.3, 5.0, 6.0]], requires_grad=True)
    returns = torch.tensor([[0.0, 1.0, 0.0, float("inf"), float("-inf")]])
    old_values = torch.tensor([[0.0, 0.0, 0.0, float("nan"), 0.0]])
    for clip in (None, 0.2):
        values.grad = None
        vf, _ = value_loss(values, old_values, returns, INF_PADDING_MASK, clip)
        vf.backward()
        assert torch.isfinite(vf) and torch.isfinite(values.grad).all(), clip
        assert torch.all(values.grad[:, 3:] == 0), clip


def test_float64_stays_float64():
    x64 = torch.tensor([[0.1, -0.2, 0.3]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    advantages, returns = masked_gae(x64, x64, mask, 1.0, 0.95)
    assert advantages.dtype == returns.dtype == torch.float64
    assert masked_whiten(x64, mask).dtype == torch.float64
    loss, stats = policy_loss(x64, x64 * 0.9, x64, mask, 0.2)
    assert loss.dtype == torch.float64 and stats["approx_kl"].dtype == torch.float64
    logits = torch.randn(2, 5, dtype=torch.float64)
    assert entropy_from_logits(logits).dtype == torch.float64
    assert full_kl(logits, logits.flip(-1)).dtype == torch.float64
    # half precision is computed in float32
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32


# ---------------------------------------------------------------- diagnostics
def test_approx_kl_estimates_kl_old_new_by_hand():
    # log ratio r = log new/old = 0.5: (e^0.5 - 1) - 0.5 = 0.1487213 (the mirror form gives 0.1065307)
    _, stats = policy_loss(torch.tensor([0.0]), torch.tensor([-0.5]), torch.zeros(1), None, 0.2)
    assert stats["approx_kl"].item() == pytest.approx(0.1487213, abs=1e-6)


def test_approx_kl_is_unbiased_for_kl_old_new():
    # old = (1/2, 1/2) samples the tokens, new = (0.9, 0.1).  Enumerating both tokens with the old
    # policy's weights: KL(old || new) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = 0.5108256.
    # (The mirror form exp(-r) - 1 + r gives 1.2669 here: it overestimates.)
    old, new = torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1])
    _, stats = policy_loss(new.log(), old.log(), torch.zeros(2), None, 0.2)  # mean = old-weighted here
    assert stats["approx_kl"].item() == pytest.approx(0.5108256, abs=1e-6)


def test_vf_clipfrac_counts_only_active_clipping():
    # old 0, clip 0.2.  V = 0.5, R = 0: clipped V 0.2 is closer to R, so the unclipped loss is used.
    # V = 0.5, R = 1: clipped loss (0.2 - 1)^2 = 0.64 > 0.25: the clip is active.  V = 0.1: inside.
    values = torch.tensor([0.5, 0.5, 0.1])
    _, stats = value_loss(values, torch.zeros(3), torch.tensor([0.0, 1.0, 1.0]), None, 0.2)
    assert stats["vf_clipfrac"].item() == pytest.approx(1 / 3)


def test_vf_clipfrac_ignores_float_round_off_inside_the_range():
    generator = torch.Generator().manual_seed(0)
    # V_old = V + u: V_old + clamp(V - V_old) differs from V by float round-off, not by clipping.
    values = torch.randn(10_000, generator=generator)
    old_values = values + 0.19 * (2 * torch.rand(10_000, generator=generator) - 1)  # all inside +-0.2
    returns = torch.randn(10_000, generator=generator)
    _, stats = value_loss(values, old_values, returns, None, 0.2)
    assert stats["vf_clipfrac"].item() == 0.0


# ---------------------------------------------------------------- where the KL goes
# One categorical distribution: pi = softmax(theta) at theta = 0 (uniform over 3 tokens), the
# reference q = (1/2, 1/4, 1/4).  Expectations are exact sums over the 3 tokens.
#   log(pi/q) = (ln 2/3, ln 4/3, ln 4/3) = (-0.405465, 0.287682, 0.287682)
#   KL(pi||q) = (1/3)(-0.405465 + 2 * 0.287682) = 0.056633
#   grad KL(pi||q) = pi_j (log(pi_j/q_j) - KL) = (-0.154033, 0.077016, 0.077016)
#   grad KL(q||pi) = pi - q = (-0.166667, 0.083333, 0.083333)
# Descent along either gradient raises pi_0 toward q_0 = 1/2: toward the reference.
Q = torch.tensor([0.5, 0.25, 0.25])
GRAD_KL_PI_Q = torch.tensor([-0.154033, 0.077016, 0.077016])
GRAD_KL_Q_PI = torch.tensor([-1 / 6, 1 / 12, 1 / 12])


def expected_gradient(placement: str, estimator: str) -> torch.Tensor:
    """Exact expected gradient (of the loss PPO minimises) with respect to the logits theta."""
    theta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    logp = torch.log_softmax(theta, dim=0)  # log pi(x) for every token x
    ref_logp = Q.double().log()
    pi = logp.exp().detach()  # the sampling distribution: not differentiated
    if estimator == "full":
        k = full_kl(theta.expand(3, 3), ref_logp.expand(3, 3))  # the same at every token
    else:
        k = kl_penalty(logp, ref_logp, estimator)
    if placement == "reward":  # score function: the KL as a reward, k detached, times log pi
        loss = (pi * k.detach() * logp).sum()
    else:  # differentiated directly
        loss = (pi * k).sum()
    (grad,) = torch.autograd.grad(loss, theta)
    return grad.float()


def test_kl_in_the_reward_only_k1_pulls_toward_the_reference():
    assert torch.allclose(expected_gradient("reward", "k1"), GRAD_KL_PI_Q, atol=1e-6)
    # k2 and k3 in the reward: g_j = (1/3)(k_j - mean k), a few percent of the size, pointing away:
    #   k2 = (0.082201, 0.041380, 0.041380), mean 0.054987 -> (0.009071, -0.004536, -0.004536)
    #   k3 = (0.094535, 0.037682, 0.037682), mean 0.056633 -> (0.012634, -0.006317, -0.006317)
    k2, k3 = expected_gradient("reward", "k2"), expected_gradient("reward", "k3")
    assert torch.allclose(k2, torch.tensor([0.009071, -0.004536, -0.004536]), atol=1e-6)
    assert torch.allclose(k3, torch.tensor([0.012634, -0.006317, -0.006317]), atol=1e-6)
    for wrong in (k2, k3):
        assert torch.dot(wrong, GRAD_KL_PI_Q) < 0  # descent on it *raises* the KL
    assert torch.allclose(expected_gradient("reward", "full"), torch.zeros(3), atol=1e-7)  # no gradient at all


def test_kl_in_the_loss_k2_k3_full_pull_toward_the_reference():
    assert torch.allclose(expected_gradient("loss", "k2"), GRAD_KL_PI_Q, atol=1e-6)
    assert torch.allclose(expected_gradient("loss", "full"), GRAD_KL_PI_Q, atol=1e-6)
    assert torch.allclose(expected_gradient("loss", "k3"), GRAD_KL_Q_PI, atol=1e-6)
    assert torch.allclose(expected_gradient("loss", "k1"), torch.zeros(3), atol=1e-7)  # never pulls


def test_kl_placements_refuse_the_wrong_estimators():
    assert check_kl_placement("reward", None) == "k1" and check_kl_placement("loss", None) == "k3"
    for placement, estimator in (("reward", "k2"), ("reward", "k3"), ("reward", "full"), ("loss", "k1")):
        with pytest.raises(ValueError, match=f"{estimator} cannot go in the {placement}"):
            check_kl_placement(placement, estimator)
    for placement, allowed in KL_PLACEMENTS.items():
        for estimator in allowed:
            assert check_kl_placement(placement, estimator) == estimator


# ---------------------------------------------------------------- log-probs without (B, T, V) copies
@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_chunked_logprobs_and_entropy_equal_the_plain_ones(chunk):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator, requires_grad=True)
    tokens = torch.randint(11, (2, 5), generator=generator)
    plain = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    chunked = token_logprobs(logits, tokens, chunk=chunk)
    assert torch.allclose(chunked, plain, atol=1e-6)
    (plain_grad,) = torch.autograd.grad(plain.sum(), logits)
    (chunked_grad,) = torch.autograd.grad(chunked.sum(), logits)
    assert torch.allclose(chunked_grad, plain_grad, atol=1e-6)
    logp = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(chunked_entropy(logits, chunk=chunk), -(logp.exp() * logp).sum(-1), atol=1e-6)
    # bf16 logits are computed in float32, float64 stays float64
    assert token_logprobs(logits.detach().bfloat16(), tokens, chunk).dtype == torch.float32
    assert token_logprobs(logits.detach().double(), tokens, chunk).dtype == torch.float64
