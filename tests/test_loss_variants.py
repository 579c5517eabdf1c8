"""The policy-loss variants of 2025, as options of the one update (docs/design.md, "Policy-loss
variants"): clip-higher, dual-clip, GSPO's sequence-level ratio, DAPO's dynamic sampling and
overlong shaping.  Each formula by hand (values and gradients), the trainer's dynamic sampling on
rewards built to tie, the refusals of what makes no sense, the plan, and resume equal to a
straight run with every variant on at once.
"""

from __future__ import annotations

import math

import pytest
import torch

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.core import cispo_loss, informative_groups, overlong_penalty, policy_loss, sapo_loss
from ppo_rlhf.models import load_causal_lm, load_tokenizer
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.reward import ScoringReward
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import PROMPTS, REWARDS_MODULE, THREADS, VaryingLengths, run, run_failing, same_actor_as_straight_run


def loss_and_gradient(log_ratios, advantages, mask=None, **options):
    """(loss, d loss / d logprobs, stats) of policy_loss with old log-probs 0."""
    logprobs = torch.tensor(log_ratios, dtype=torch.float64, requires_grad=True)
    old = torch.zeros_like(logprobs)
    mask = None if mask is None else torch.tensor(mask)
    loss, stats = policy_loss(logprobs, old, torch.tensor(advantages, dtype=torch.float64), mask, **options)
    loss.backward()
    return loss.item(), logprobs.grad, stats


# ---------------------------------------------------------------- the formulas by hand
def test_clip_higher_by_hand():
    # Ratios 1.25, 1.30, 0.75 with advantages +1, +1, -1, lower bound 0.8:
    # - upper bound 1.28: 1.25 is inside (loss -1.25, gradient -A * r = -1.25); 1.30 clips to
    #   1.28 (loss -1.28, gradient 0); 0.75 clips to 0.8 (loss 0.8, gradient 0);
    # - symmetric 0.2: 1.25 clips to 1.2 as well (gradient 0).
    log_ratios = [[math.log(1.25), math.log(1.30), math.log(0.75)]]
    advantages = [[1.0, 1.0, -1.0]]
    loss, grad, stats = loss_and_gradient(log_ratios, advantages, clip_ratio=0.2, clip_ratio_high=0.28)
    assert loss == pytest.approx((-1.25 - 1.28 + 0.8) / 3)
    assert torch.allclose(grad, torch.tensor([[-1.25 / 3, 0.0, 0.0]], dtype=torch.float64))
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    assert (stats["clipfrac_high"].item(), stats["clipfrac_low"].item()) == (pytest.approx(1 / 3), pytest.approx(1 / 3))
    loss, grad, stats = loss_and_gradient(log_ratios, advantages, clip_ratio=0.2)
    assert loss == pytest.approx((-1.2 - 1.2 + 0.8) / 3)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert "clipfrac_high" not in stats


def test_dual_clip_by_hand():
    # Advantages -1, -1, +1, -2 and ratios 4, 2, 4, 0.5, clip 0.2, C = 3:
    # - A = -1, r = 4: max(4, 1.2) = 4, bounded by -C * A = 3 (gradient 0);
    # - A = -1, r = 2: 2 < 3, unbounded (gradient -A * r = 2);
    # - A = +1, r = 4: the ordinary clip, -1.2 (gradient 0), a positive advantage is never bounded;
    # - A = -2, r = 0.5: max(1.0, 1.6) = 1.6 < 6 (gradient 0).
    log_ratios = [[math.log(4.0), math.log(2.0), math.log(4.0), math.log(0.5)]]
    advantages = [[-1.0, -1.0, 1.0, -2.0]]
    loss, grad, stats = loss_and_gradient(log_ratios, advantages, clip_ratio=0.2, dual_clip=3.0)
    assert loss == pytest.approx((3.0 + 2.0 - 1.2 + 1.6) / 4)
    assert torch.allclose(grad, torch.tensor([[0.0, 2 / 4, 0.0, 0.0]], dtype=torch.float64))
    assert stats["dual_clipfrac"].item() == pytest.approx(1 / 4)
    loss, grad, _ = loss_and_gradient(log_ratios, advantages, clip_ratio=0.2)  # without it: 4 and its gradient
    assert loss == pytest.approx((4.0 + 2.0 - 1.2 + 1.6) / 4)
    assert torch.allclose(grad, torch.tensor([[4 / 4, 2 / 4, 0.0, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        loss_and_gradient(log_ratios, advantages, clip_ratio=0.2, dual_clip=1.0)


def test_sequence_level_ratio_by_hand():
    # Response 1: 2 tokens, log-ratios 0.0 and 0.4, mean 0.2, s1 = e^0.2 = 1.221403, advantage +1;
    # response 2: 3 tokens, -0.1, -0.2, -0.3, mean -0.2, s2 = e^-0.2 = 0.818731, advantage -1.
    # The padding (inf) must not count.  Sequence-mean: loss (-s1 + s2) / 2; d/d logp of each token
    # of response i: (1/2) * (-A_i) * s_i / |y_i|: -s1 / 4 and s2 / 6.
    s1, s2 = math.exp(0.2), math.exp(-0.2)
    log_ratios = [[0.0, 0.4, math.inf], [-0.1, -0.2, -0.3]]
    advantages = [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]
    mask = [[1, 1, 0], [1, 1, 1]]
    options = {"clip_ratio": 0.2, "aggregation": "sequence-mean", "ratio_level": "sequence"}
    loss, grad, stats = loss_and_gradient(log_ratios, advantages, mask, clip_ratio_high=0.28,
                                          **{k: v for k, v in options.items() if k != "clip_ratio"}, clip_ratio=0.2)
    assert loss == pytest.approx((-s1 + s2) / 2)
    expected = torch.tensor([[-s1 / 4, -s1 / 4, 0.0], [s2 / 6, s2 / 6, s2 / 6]], dtype=torch.float64)
    assert torch.allclose(grad, expected)
    assert stats["ppo_ratio"].item() == pytest.approx((2 * s1 + 3 * s2) / 5)
    # Clipped per response: at 1.2 response 1 is clipped as a whole, both its tokens lose their
    # gradient, though its first token's own ratio (1.0) is well inside the range.
    loss, grad, stats = loss_and_gradient(log_ratios, advantages, mask, **options)
    assert loss == pytest.approx((-1.2 + s2) / 2)
    assert torch.allclose(grad, torch.tensor([[0.0, 0.0, 0.0], [s2 / 6, s2 / 6, s2 / 6]], dtype=torch.float64))
    assert stats["clipfrac"].item() == pytest.approx(2 / 5)
    # Per token, the same numbers give each token its own ratio: token 1 (ratio 1) keeps its gradient.
    _, grad, _ = loss_and_gradient(log_ratios, advantages, mask, clip_ratio=0.2, aggregation="sequence-mean")
    assert grad[0, 0].item() == pytest.approx(-1.0 / 4) and grad[0, 1].item() == 0.0


def test_sequence_level_ratio_keeps_each_tokens_advantage_and_weight():
    # GSPO-token (verl's form): one response, log-ratios 0.0 and 0.4 (s = e^0.2), per-token
    # advantages +1 and -2 (a KL in the reward, or a critic, gives each token its own), importance
    # weights 2 and 0.5, sequence-mean, a range wide enough not to clip.  Loss (-1 x 2 + 2 x 0.5) s / 2
    # = -s / 2; d/d logp_t = -A_t w_t s / 2: -s for token 1, +s / 2 for token 2.  (Giving every token the
    # ratio s itself would give both the mean, (-2 + 1) s / 4 = -s / 4.)
    s = math.exp(0.2)
    logprobs = torch.tensor([[0.0, 0.4]], dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(logprobs, torch.zeros_like(logprobs), torch.tensor([[1.0, -2.0]], dtype=torch.float64),
                              None, clip_ratio=0.5, aggregation="sequence-mean", ratio_level="sequence",
                              token_weights=torch.tensor([[2.0, 0.5]], dtype=torch.float64))
    loss.backward()
    assert loss.item() == pytest.approx(-s / 2)
    assert logprobs.grad.tolist() == [pytest.approx([-s, s / 2])]
    assert stats["ppo_ratio"].item() == pytest.approx(s)  # the sequence ratio on every token
    # Clipped at 0.1 (s = 1.22 > 1.1): the positive-advantage token takes the clipped branch and loses
    # its gradient; the negative one stays on the unclipped branch, -A s = 2s, as PPO's max keeps it.
    logprobs.grad = None
    loss, stats = policy_loss(logprobs, torch.zeros_like(logprobs), torch.tensor([[1.0, -2.0]], dtype=torch.float64),
                              None, clip_ratio=0.1, aggregation="sequence-mean", ratio_level="sequence")
    loss.backward()
    assert loss.item() == pytest.approx((-1.1 + 2 * s) / 2)
    assert logprobs.grad.tolist() == [pytest.approx([0.0, s])]
    assert stats["clipfrac"].item() == pytest.approx(0.5)


def test_cispo_by_hand():
    # Ratios 1.5, 0.5, 1.1 with advantages +1, -1, +2, token-mean, upper range 0.2, no lower bound:
    # weights min(r, 1.2) = 1.2, 0.5, 1.1 (constants), so d/d logp_t = -A_t w_t / 3 = -0.4, +1/6, -2.2/3 --
    # every token keeps a gradient, the clipped one too (PPO's clip would give it 0).  Loss -A w: -2.9 / 3.
    # verl's compute_policy_loss_cispo (clip_ratio_low 10, high 0.2) gives the same gradients on these
    # inputs; its loss value, -A w log pi, is -0.347605 here (the same gradient, another number).
    log_ratios = [[math.log(1.5), math.log(0.5), math.log(1.1)]]
    logprobs = torch.tensor(log_ratios, dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    loss, stats = cispo_loss(logprobs, torch.zeros_like(logprobs), advantages, None, None, 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(-2.9 / 3)
    assert logprobs.grad.tolist() == [pytest.approx([-0.4, 1 / 6, -2.2 / 3])]
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)
    # A lower range of 0.2: 0.5 is raised to 0.8 (verl's clip_ratio_low 0.2 gives the same gradient).
    logprobs.grad = None
    loss, stats = cispo_loss(logprobs, torch.zeros_like(logprobs), advantages, None, 0.2, 0.2)
    loss.backward()
    assert logprobs.grad.tolist() == [pytest.approx([-0.4, 0.8 / 3, -2.2 / 3])]
    assert stats["clipfrac"].item() == pytest.approx(2 / 3)
    # A range of 1 or more is no lower bound at all.
    assert cispo_loss(logprobs, torch.zeros_like(logprobs), advantages, None, 10.0, 0.2)[0].item() == pytest.approx(-2.9 / 3)


def test_sapo_by_hand():
    # Ratios 1.5 (A = +1, tau 1) and 0.5 (A = -1, tau 1.05), one response, sequence-mean:
    # f(1.5) = 4 sigmoid(0.5) = 2.489837, f(0.5) = 4 / 1.05 sigmoid(-0.525) = 1.415950;
    # loss (-2.489837 + 1.415950) / 2 = -0.536949.  d/d logp_t = -A_t 4 s_t (1 - s_t) r_t / 2:
    # -4 x 0.622459 x 0.377541 x 1.5 / 2 = -0.705011 and +4 x 0.371686 x 0.628314 x 0.5 / 2 = 0.233535
    # (verl's compute_policy_loss_sapo gives -0.536949, -0.705011 and 0.233535 on these inputs).
    logprobs = torch.tensor([[math.log(1.5), math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    loss, stats = sapo_loss(logprobs, torch.zeros_like(logprobs), torch.tensor([[1.0, -1.0]], dtype=torch.float64),
                            None, 1.0, 1.05, aggregation="sequence-mean")
    loss.backward()
    assert loss.item() == pytest.approx(-0.536949, abs=1e-6)
    assert logprobs.grad.tolist() == [pytest.approx([-0.705011, 0.233535], abs=1e-6)]
    # On-policy (r = 1) the gate's gradient is PPO's: -A grad log pi, whatever tau.
    at_one = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    sapo_loss(at_one, torch.zeros_like(at_one), torch.tensor([[1.0, -1.0]], dtype=torch.float64), None, 3.0, 5.0)[0].backward()
    assert at_one.grad.tolist() == [pytest.approx([-0.5, 0.5])]
    assert stats["sapo_gate"].item() == pytest.approx((4 * 0.622459 * 0.377541 + 4 * 0.371686 * 0.628314) / 2, abs=1e-5)
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        sapo_loss(logprobs, logprobs, logprobs, None, 0.0, 1.05)


def test_overlong_penalty_by_hand():
    # At most 10 tokens, a buffer of 4: free up to 6, then -penalty * (length - 6) / 4.
    lengths = torch.tensor([5, 6, 7, 8, 10])
    assert torch.allclose(overlong_penalty(lengths, 10, 4, 1.0), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    assert torch.allclose(overlong_penalty(lengths, 10, 4, 0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    assert torch.allclose(overlong_penalty(lengths, 10, 10, 1.0), -lengths / 10)  # the whole length
    with pytest.raises(ValueError, match="1..10"):
        overlong_penalty(lengths, 10, 11, 1.0)


def test_informative_groups_by_hand():
    scores = torch.tensor([[1.0, 1.0], [0.0, 1.0], [2.0, 2.0], [0.5, 0.25]])
    assert informative_groups(scores).tolist() == [False, True, False, True]


# ---------------------------------------------------------------- dynamic sampling in the trainer
class TieReward(ScoringReward):
    """Rows marked ``tie`` score 7 for every response; the others 0, 1, 2, ... within each group of
    K (the batch's row index modulo K), so their groups always have a spread."""

    def __init__(self, k: int):
        self.k = k

    def __call__(self, batch) -> torch.Tensor:
        return torch.tensor([7.0 if row["tie"] else float(i % self.k) for i, row in enumerate(batch.rows)])


def tiny_grpo_trainer(zoo, **overrides) -> PPOTrainer:
    config = build_config(PPOConfig, {
        "model": str(zoo["gpt2"]), "reward_fn": f"{REWARDS_MODULE}:length_score", "estimator": "grpo",
        "samples_per_prompt": 2, "batch_size": 8, "mini_batch_size": 4, "ppo_epochs": 1, "max_new_tokens": 6,
        "max_length": 32, "lr": 1e-3, "dynamic_sampling": True, **overrides})
    tokenizer = load_tokenizer(config.model)
    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, config.max_new_tokens, do_sample=True,
                               seed=0)
    trainer = PPOTrainer(config, TieReward(2), model=load_causal_lm(config.model), ref=load_causal_lm(config.model),
                         tokenizer=tokenizer, generator=generator)
    return trainer


def groups(prompts: list[str], tie: bool) -> list[dict]:
    return [{"prompt": p, "tie": tie} for p in prompts for _ in range(2)]


def test_dynamic_sampling_drops_tied_groups_and_draws_more(zoo):
    trainer = tiny_grpo_trainer(zoo)
    first = groups(PROMPTS[:2], True) + groups(PROMPTS[2:4], False)  # 2 tied groups, 2 with a spread
    draws = iter([groups(PROMPTS[:3], True) + groups(PROMPTS[3:4], False),  # 1 more with a spread
                  groups(PROMPTS[:4], False)])  # 4 more: 2 of them fill the batch
    experience, metrics = trainer.make_experience(first, lambda: next(draws))
    assert metrics["dynamic_sampling/rounds"] == 3
    assert metrics["dynamic_sampling/dropped_groups"] == 2 + 3
    assert metrics["dynamic_sampling/filled_groups"] == 0
    assert experience.raw_scores.tolist() == [0.0, 1.0] * 4  # no tied group left
    assert metrics["score"] == pytest.approx((4 * 7 + 2 * 1) / 8)  # the first batch as drawn
    assert experience.advantages.abs().sum() > 0 and experience.sequences.response_ids.shape[0] == 8
    stats = trainer.update(experience)
    assert stats["update_steps"] == 2


def test_dynamic_sampling_completes_a_short_batch_with_dropped_groups(zoo):
    trainer = tiny_grpo_trainer(zoo, max_resample_rounds=1)
    draws = iter([groups(PROMPTS[:4], True)])
    experience, metrics = trainer.make_experience(groups(PROMPTS[:3], True) + groups(PROMPTS[3:4], False),
                                                  lambda: next(draws))
    assert (metrics["dynamic_sampling/rounds"], metrics["dynamic_sampling/filled_groups"]) == (2, 3)
    # The one group with a spread and the first three dropped groups, in the order they were drawn.
    assert experience.raw_scores.tolist() == [7.0] * 6 + [0.0, 1.0]
    # Nothing to learn from the filled groups: their advantages are 0 (their scores tie, and the KL in
    # the reward, zero at the start but for rounding, is not left in them either).
    assert experience.advantages[6:].abs().sum() > 0 and experience.advantages[:6].abs().max() == 0
    tokens = experience.mask.sum().item()
    assert metrics["dynamic_sampling/generated_tokens_per_kept_sample"] > tokens / 8


def test_dynamic_sampling_keeps_the_first_groups_of_a_full_round(zoo):
    trainer = tiny_grpo_trainer(zoo)
    experience, metrics = trainer.make_experience(groups(PROMPTS[:4], False), None)  # nothing to draw: not needed
    assert metrics["dynamic_sampling/rounds"] == 1 and metrics["dynamic_sampling/dropped_groups"] == 0
    assert metrics["dynamic_sampling/generated_tokens_per_kept_sample"] == pytest.approx(
        experience.mask.sum().item() / 8)


@pytest.mark.parametrize("decided_on, dropped", [("accuracy", 2), ("score", 0)])
def test_dynamic_sampling_decides_on_the_rewards_before_shaping(zoo, decided_on, dropped):
    """DAPO filters on the task's accuracy: a group whose rewards tie (7 and 7) is dropped even when
    the overlong shaping gives its responses of 1 and 2 tokens different scores (7 - 1/6, 7 - 2/6)."""
    trainer = tiny_grpo_trainer(zoo, overlong_buffer=6, dynamic_sampling_on=decided_on)
    trainer.generator = VaryingLengths(trainer.generator.stop_token_ids, trainer.tokenizer.pad_token_id, 6)
    draws = iter([groups(PROMPTS[:4], False)])
    experience, metrics = trainer.make_experience(groups(PROMPTS[:2], True) + groups(PROMPTS[2:4], False),
                                                  lambda: next(draws))
    assert metrics["dynamic_sampling/dropped_groups"] == dropped
    assert metrics["dynamic_sampling/rounds"] == (2 if dropped else 1)
    kept_tied = (experience.raw_scores == 7.0).sum().item()
    assert kept_tied == (0 if dropped else 4)


def test_filler_groups_teach_nothing_when_the_shaping_tells_their_responses_apart(zoo):
    """Dynamic sampling on accuracy drops groups whose rewards tie; when the rounds run out, dropped
    groups fill the batch.  The overlong shaping still scores their responses of 1 and 2 tokens
    differently (7 - 1/6, 7 - 2/6), which alone would give them advantages: a length signal from
    groups the filter dropped, which DAPO never trains on.  Their advantages are 0."""
    trainer = tiny_grpo_trainer(zoo, overlong_buffer=6, max_resample_rounds=0)
    trainer.generator = VaryingLengths(trainer.generator.stop_token_ids, trainer.tokenizer.pad_token_id, 6)
    experience, metrics = trainer.make_experience(groups(PROMPTS[:4], True), None)
    assert metrics["dynamic_sampling/filled_groups"] == 4
    shaped = experience.scores.reshape(4, 2)
    assert (shaped[:, 0] != shaped[:, 1]).all()  # the shaping tells each group's responses apart
    assert experience.advantages.abs().max() == 0


# ---------------------------------------------------------------- CISPO's and SAPO's dispatch in the trainer
RATIOS = (0.5, 2.0, 1.1)  # each response's tokens in turn: below, above and inside every bound used here


def trainer_on_known_ratios(zoo, **overrides) -> tuple[PPOTrainer, object, torch.Tensor, torch.Tensor]:
    """A trainer, and an experience whose first minibatch's ratios are RATIOS (the old log-probs
    shifted from the actor's own: dropout is off, so the ratio is 1 before the shift) and whose
    advantages are +1 in even rows, -0.5 in odd ones; (trainer, experience, ratios, advantages) (b, T)."""
    trainer = tiny_grpo_trainer(zoo, dynamic_sampling=False, loss_aggregation="token-mean", mini_batch_size=8,
                                **overrides)
    experience, _ = trainer.make_experience(groups(PROMPTS[:4], False))
    width = experience.mask.shape[1]
    ratios = torch.tensor([RATIOS[t % 3] for t in range(width)]).expand(8, width)
    experience.logprobs = experience.logprobs - torch.log(ratios) * experience.mask
    signs = torch.tensor([1.0 if row % 2 == 0 else -0.5 for row in range(8)])[:, None]
    experience.advantages = signs.expand(8, width) * experience.mask
    return trainer, experience, ratios, experience.advantages


def pg_loss_of_the_first_step(trainer, experience) -> float:
    return trainer.accumulate_gradients(experience, torch.arange(8), warming_up=False)["pg_loss"].item()


def token_mean(per_token: torch.Tensor, mask: torch.Tensor) -> float:
    return ((per_token * mask).sum() / mask.sum()).item()


def test_the_trainer_runs_cispo_with_its_lower_and_upper_bounds(zoo):
    """CISPO's loss value per token is -A * clip(r, 1 - low, 1 + high): with low 0.1 and high 0.3 the
    ratios 0.5, 2.0 and 1.1 weigh 0.9, 1.3 and 1.1.  PPO's clip (the branch missing) or the bounds
    swapped at the call (1 - 0.3, 1 + 0.1) give other numbers, checked here to differ."""
    trainer, experience, ratios, advantages = trainer_on_known_ratios(zoo, policy_loss="cispo", clip_ratio_low=0.1,
                                                                      clip_ratio_high=0.3)
    mask = experience.mask.float()
    expected = token_mean(-advantages * ratios.clamp(0.9, 1.3), mask)
    swapped = token_mean(-advantages * ratios.clamp(0.7, 1.1), mask)
    clipped = token_mean(torch.maximum(-advantages * ratios, -advantages * ratios.clamp(0.9, 1.3)), mask)
    assert min(abs(expected - swapped), abs(expected - clipped)) > 1e-2
    assert pg_loss_of_the_first_step(trainer, experience) == pytest.approx(expected, abs=1e-5)


def test_the_trainer_runs_sapo_with_each_temperature_on_its_side(zoo):
    """SAPO's loss per token is -A * 4 / tau * sigmoid(tau (r - 1)), tau_pos for A > 0 and tau_neg
    otherwise.  The temperatures swapped at the call, or PPO's clip in SAPO's place, differ."""
    trainer, experience, ratios, advantages = trainer_on_known_ratios(zoo, policy_loss="sapo", sapo_tau_pos=0.5,
                                                                      sapo_tau_neg=3.0)
    mask = experience.mask.float()

    def sapo(tau_pos: float, tau_neg: float) -> float:
        tau = torch.where(advantages > 0, torch.tensor(tau_pos), torch.tensor(tau_neg))
        return token_mean(-advantages * 4 / tau * torch.sigmoid(tau * (ratios - 1)), mask)

    expected = sapo(0.5, 3.0)
    clipped = token_mean(torch.maximum(-advantages * ratios, -advantages * ratios.clamp(0.8, 1.2)), mask)
    assert min(abs(expected - sapo(3.0, 0.5)), abs(expected - clipped)) > 1e-2
    assert pg_loss_of_the_first_step(trainer, experience) == pytest.approx(expected, abs=1e-5)


def test_the_trainer_runs_the_clip_with_its_lower_and_upper_bounds(zoo):
    """The control: PPO's clipped loss on the same ratios, bounds 1 - 0.1 and 1 + 0.3."""
    trainer, experience, ratios, advantages = trainer_on_known_ratios(zoo, clip_ratio_low=0.1, clip_ratio_high=0.3)
    mask = experience.mask.float()
    expected = token_mean(torch.maximum(-advantages * ratios, -advantages * ratios.clamp(0.9, 1.3)), mask)
    assert pg_loss_of_the_first_step(trainer, experience) == pytest.approx(expected, abs=1e-5)


def test_overlong_shaping_lowers_the_scores_of_long_responses(zoo):
    trainer = tiny_grpo_trainer(zoo, dynamic_sampling=False, overlong_buffer=4, overlong_penalty=0.5)
    scores = trainer.shape_scores(torch.ones(4), torch.ones(4, dtype=torch.bool), torch.tensor([1, 2, 4, 6]))
    assert scores.tolist() == [1.0, 1.0, 0.75, 0.5]


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "values, message",
    [
        ({"clip_ratio_low": 0.2, "clip_ratio_high": 0.1}, "'clip_ratio_high'.*>= the lower clip range \\(0.2\\)"),
        ({"clip_ratio": 0.3, "clip_ratio_high": 0.25}, "'clip_ratio_high'.*>= the lower clip range \\(0.3\\)"),
        ({"clip_ratio_low": 1.0}, "'clip_ratio_low'.*below 1 for the lower clip range"),
        ({"clip_ratio_low": 0.0}, "'clip_ratio_low'.*> 0"),
        ({"clip_ratio_high": 0.0}, "'clip_ratio_high'.*> 0"),
        ({"dual_clip": 1.0}, "'dual_clip'.*> 1"),
        ({"dual_clip": 0.5}, "'dual_clip'.*> 1"),
        ({"ratio_level": "word"}, "'ratio_level'.*token, sequence"),
        ({"policy_loss": "ppo"}, "'policy_loss'.*clip, cispo, sapo"),
        ({"policy_loss": "cispo", "ratio_level": "sequence"}, "'ratio_level'.*--policy-loss cispo"),
        ({"policy_loss": "sapo", "dual_clip": 3.0}, "'dual_clip'.*--policy-loss sapo"),
        ({"policy_loss": "sapo", "clip_ratio_high": 0.28}, "'clip_ratio_high'.*sapo: its soft gate has no clip"),
        ({"policy_loss": "sapo", "clip_ratio_low": 0.2}, "'clip_ratio_low'.*sapo: its soft gate has no clip"),
        ({"policy_loss": "sapo", "sapo_tau_neg": 0.0}, "'sapo_tau_neg'.*> 0"),
        ({"sapo_tau_pos": 1.0}, "'sapo_tau_pos'.*without --policy-loss sapo"),
        ({"dynamic_sampling_on": "score"}, "'dynamic_sampling_on'.*without --dynamic-sampling"),
        ({"dynamic_sampling": True, "estimator": "grpo", "samples_per_prompt": 2, "dynamic_sampling_on": "shaped"},
         "'dynamic_sampling_on'.*accuracy, score"),
        ({"dynamic_sampling": True}, "'dynamic_sampling'.*off with estimator gae"),
        ({"dynamic_sampling": True, "estimator": "remax", "samples_per_prompt": 2}, "'dynamic_sampling'.*remax"),
        ({"dynamic_sampling": True, "estimator": "reinforce++", "samples_per_prompt": 2}, "'dynamic_sampling'"),
        ({"dynamic_sampling": True, "estimator": "grpo", "samples_per_prompt": 1}, "'samples_per_prompt'.*>= 2"),
        ({"dynamic_sampling": True, "estimator": "grpo", "samples_per_prompt": 2, "max_resample_rounds": -1},
         "'max_resample_rounds'.*>= 0"),
        ({"max_resample_rounds": 2}, "'max_resample_rounds'.*without --dynamic-sampling"),
        ({"overlong_buffer": 200, "max_new_tokens": 128}, "'overlong_buffer'.*1..max_new_tokens \\(128\\)"),
        ({"overlong_buffer": 0}, "'overlong_buffer'.*> 0"),
        ({"overlong_penalty": 1.0}, "'overlong_penalty'.*without --overlong-buffer"),
        ({"overlong_buffer": 4, "overlong_penalty": -1.0}, "'overlong_penalty'.*> 0"),
    ],
)
def test_variant_settings_that_make_no_sense_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(PPOConfig, {"task": "doubling", **values})


def test_variant_defaults_resolve_where_they_apply():
    config = build_config(PPOConfig, {"task": "doubling", "overlong_buffer": 4, "estimator": "rloo",
                                      "samples_per_prompt": 2, "dynamic_sampling": True, "clip_ratio_high": 0.28})
    assert (config.overlong_penalty, config.max_resample_rounds) == (1.0, 4)
    assert (config.clip_low, config.clip_high) == (0.2, 0.28)
    assert config.dynamic_sampling_on == "accuracy"  # DAPO's
    sapo = build_config(PPOConfig, {"task": "doubling", "policy_loss": "sapo"})
    assert (sapo.sapo_tau_pos, sapo.sapo_tau_neg) == (1.0, 1.05)
    # CISPO may drop its lower bound (verl's example: 10); GSPO-token takes a critic's per-token advantages.
    assert build_config(PPOConfig, {"task": "doubling", "policy_loss": "cispo", "clip_ratio_low": 10.0}).clip_low == 10.0
    assert build_config(PPOConfig, {"task": "doubling", "ratio_level": "sequence"}).estimator == "gae"


def test_a_bad_variant_exits_2_naming_the_flag(tmp_path, capsys):
    err = run_failing(["ppo", "--task", "doubling", "--model", tmp_path, "--dual-clip", "0.9", "--out",
                       tmp_path / "run"], capsys)
    assert "'dual_clip'" in err and "> 1" in err and "Traceback" not in err


# ---------------------------------------------------------------- runs: plan, metrics, resume
def variants_command(zoo, out, *extra):
    return ["ppo", "--model", zoo["gpt2"], "--prompts", zoo["prompts"], "--reward-fn", f"{REWARDS_MODULE}:long_answer",
            "--estimator", "grpo", "--samples-per-prompt", 4, "--batch-size", 8, "--mini-batch-size", 4,
            "--ppo-epochs", 1, "--max-new-tokens", 8, "--max-length", 64, "--lr", 1e-3, "--clip-ratio-low", 0.2,
            "--clip-ratio-high", 0.28, "--dual-clip", 3, "--ratio-level", "sequence", "--dynamic-sampling",
            "--max-resample-rounds", 2, "--overlong-buffer", 3, "--save-every", 1, "--out", out, *THREADS, *extra]


@pytest.mark.parametrize("loss, plan_line, metric", [
    ("cispo", "CISPO: each token's log-prob gradient weighted by its ratio clipped to [no lower bound, 1 + 0.2]",
     "clipfrac"),
    ("sapo", "SAPO: a soft gate 4/tau sigmoid(tau (ratio - 1)) in place of the clip, tau 1 for positive advantages, "
             "1.05 for the others", "sapo_gate"),
])
def test_cispo_and_sapo_runs_plan_and_log(zoo, tmp_path, capsys, loss, plan_line, metric):
    command = variants_command(zoo, tmp_path / loss, "--iterations", 2)
    for flag in ("--clip-ratio-low", "--clip-ratio-high", "--dual-clip", "--ratio-level"):  # the clip loss's
        at = command.index(flag)
        del command[at:at + 2]
    run([*command, "--policy-loss", loss])
    assert plan_line in capsys.readouterr().out
    records = read_metrics(tmp_path / loss / "metrics.jsonl")
    assert all(math.isfinite(r[metric]) and math.isfinite(r["pg_loss"]) for r in records[1:])


def test_every_variant_at_once_plans_logs_and_resumes_to_a_straight_run(zoo, tmp_path, capsys):
    run(variants_command(zoo, tmp_path / "straight", "--iterations", 3))
    plan = capsys.readouterr().out
    assert "ratio per response (GSPO" in plan and "clipped to [1 - 0.2, 1 + 0.28] (the GSPO paper: 3e-4 / 4e-4)" in plan
    assert "dual clip: a negative advantage's loss at most 3 x |A|" in plan
    assert "sampling:  dynamic (DAPO)" in plan and "up to 2 extra rounds" in plan
    assert "overlong:  responses past 5 tokens lose up to 1 of their score" in plan
    records = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    for key in ("dynamic_sampling/rounds", "dynamic_sampling/dropped_groups", "dual_clipfrac", "clipfrac_high",
                "score_used"):
        assert all(key in r for r in records[1:]), key
    run(variants_command(zoo, tmp_path / "resumed", "--iterations", 2))
    run(variants_command(zoo, tmp_path / "resumed", "--iterations", 3, "--resume"))
    same_actor_as_straight_run(tmp_path / "straight", tmp_path / "resumed", zoo["gpt2"])
    resumed_records = read_metrics(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["dynamic_sampling/rounds"] for r in resumed_records[1:]] == [r["dynamic_sampling/rounds"] for r in records[1:]]
