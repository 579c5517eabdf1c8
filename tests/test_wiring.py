"""The trainer's wiring of the core formulas, pinned by numbers a wrong sign or a wrong normaliser
would change: the KL term of the loss by a gradient check, and Dr. GRPO's constant normaliser.
(The per-token advantages and importance weights under GSPO and the importance modes are pinned
in tests/test_offpolicy.py; TRL-style rewards on chat prompts in tests/test_real_models.py.)"""

from __future__ import annotations

import pytest
import torch

from ppo_rlhf.models import load_causal_lm, load_tokenizer
from ppo_rlhf.core import entropy_from_logits
from ppo_rlhf.rollout.logprobs import forward_response, logprobs_from_logits
from ppo_rlhf.rollout.passes import ResponseStats
from ppo_rlhf.trainers.ppo import PPOTrainer
from zoo import PROMPTS, VaryingLengths, small_grpo_config

ROWS = [{"prompt": p} for p in PROMPTS[:4] for _ in range(2)]


def trainer_of(zoo, **overrides) -> PPOTrainer:
    config = small_grpo_config(zoo, **overrides)
    tokenizer = load_tokenizer(config.model)
    torch.manual_seed(0)
    actor, ref = load_causal_lm(config.model), load_causal_lm(config.model)
    with torch.no_grad():  # an actor that has moved away from the reference, so the KL is not 0
        for parameter in actor.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    generator = VaryingLengths(tokenizer.eos_token_id, tokenizer.pad_token_id, config.max_new_tokens)
    return PPOTrainer(config, model=actor, ref=ref, tokenizer=tokenizer, generator=generator)


@pytest.mark.parametrize("estimator", ["k3", "k2"])
def test_the_kl_in_the_loss_is_added_with_its_sign(zoo, estimator):
    """Gradient check.  With advantages 0 and no entropy term the actor's loss is
    kl_coef * sequence_mean(k(logp, ref)): d/d logp_t of k3 = logp - ref + exp(ref - logp) - 1 is
    1 - exp(ref - logp_t), of k2 = (logp - ref)^2 / 2 is logp_t - ref_t; through log_softmax,
    d/d logits_t = dk/dlogp_t (onehot(y_t) - softmax(logits_t)), over B responses of L_i tokens.
    A KL subtracted instead of added (pushing away from the reference) flips every entry."""
    kl_coef = 0.5
    trainer = trainer_of(zoo, kl_in="loss", kl_estimator=estimator, kl_coef=kl_coef)
    experience, _ = trainer.make_experience(ROWS)
    experience.advantages = torch.zeros_like(experience.advantages)
    trainer.actor.train()
    logits = forward_response(trainer.actor, experience.sequences).logits.detach().requires_grad_()
    response = ResponseStats(logprobs_from_logits(logits, experience.sequences.response_ids), hidden=None,
                             entropy=entropy_from_logits(logits), logits=logits)
    loss, stats = trainer.actor_loss(experience, response, 1.0, 1.0, warming_up=False)
    loss.backward()

    with torch.no_grad():
        logprobs = logprobs_from_logits(logits, experience.sequences.response_ids)
        log_ratio = logprobs - experience.ref_logprobs
        dk = 1 - torch.exp(-log_ratio) if estimator == "k3" else log_ratio  # (B, T)
        lengths = experience.mask.sum(dim=1, keepdim=True)
        dlogp = torch.where(experience.mask.bool(), kl_coef * dk / (lengths * len(lengths)), torch.zeros_like(dk))
        onehot = torch.nn.functional.one_hot(experience.sequences.response_ids, logits.shape[-1]).to(logits.dtype)
        expected = dlogp[..., None] * (onehot - torch.softmax(logits, dim=-1))
    assert dlogp.abs().max() > 1e-4  # the actor and the reference differ
    assert torch.allclose(logits.grad, expected, atol=1e-7, rtol=1e-4)
    k = torch.where(experience.mask.bool(), log_ratio.exp().reciprocal() - 1 + log_ratio if estimator == "k3"
                    else log_ratio.square() / 2, torch.zeros_like(log_ratio))
    assert stats["kl_loss"].item() == pytest.approx(((k.sum(1) / lengths[:, 0]).mean()).item(), rel=1e-5)
    assert stats["kl_loss"].item() > 0


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_dr_grpo_divides_each_responses_sum_by_max_new_tokens(zoo, micro_batch):
    """Dr. GRPO's loss: each response's token sum over the constant --max-new-tokens (6 here), then
    the mean over responses; the responses are 1 to 3 tokens (batch width 3), so dividing by the
    batch's width or by each length gives other numbers.  At the first minibatch every ratio is 1,
    so the loss is -A summed: mean_i(-A_i L_i) / 6.  The same with two rows per micro-batch."""
    trainer = trainer_of(zoo, estimator="dr-grpo", kl_coef=0.0, train_micro_batch_size=micro_batch)
    assert trainer.config.loss_aggregation == "sequence-sum-norm"
    experience, _ = trainer.make_experience(ROWS)
    lengths = experience.mask.sum(dim=1)
    assert experience.mask.shape[1] == 3 and lengths.tolist() == [1, 2, 3, 1, 2, 3, 1, 2]
    first_advantage = experience.advantages[:, 0]  # one per response (no KL in the reward, gamma 1)
    assert first_advantage.abs().sum() > 0
    expected = (-first_advantage * lengths).mean() / 6
    stats = trainer.accumulate_gradients(experience, torch.arange(8), warming_up=False)
    assert stats["pg_loss"].item() == pytest.approx(expected.item(), abs=1e-6)
