"""Off-policy corrections for a rollout engine's samples (core/offpolicy.py, --is-correction;
docs/design.md, "Off-policy corrections"): each mode's weights and statistics by hand, and the
trainer applying them, with an engine whose log-probs are the trainer's shifted by known ratios."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.core import engine_importance_weights, mismatch_statistics
from ppo_rlhf.models import load_causal_lm, load_tokenizer
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import PROMPTS, small_grpo_config

# Two responses: rho = pi_old / pi_engine of 3, 0.25, 1 and of 1.5, 1.2 (then padding, whose
# engine log-prob is made absurd: it must never count).
OLD = torch.zeros(2, 3)
ENGINE = -torch.log(torch.tensor([[3.0, 0.25, 1.0], [1.5, 1.2, math.exp(-9.0)]]))
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def weights(mode: str, cap: float | None = None, floor: float | None = None) -> list[list[float]]:
    return engine_importance_weights(OLD, ENGINE, MASK, mode, cap, floor).tolist()


def test_each_mode_by_hand():
    approx = pytest.approx
    # token-truncate, cap 2: min(rho_t, 2).
    assert weights("token-truncate") == [approx([2.0, 0.25, 1.0]), approx([1.5, 1.2, 0.0])]
    # token-mask, [1/2, 2]: 3 above, 0.25 below.
    assert weights("token-mask") == [approx([0.0, 0.0, 1.0]), approx([1.5, 1.2, 0.0])]
    # sequence-truncate: products 3 x 0.25 x 1 = 0.75 and 1.5 x 1.2 = 1.8; at cap 1.5 the second is cut.
    assert weights("sequence-truncate") == [approx([0.75] * 3), approx([1.8, 1.8, 0.0])]
    assert weights("sequence-truncate", cap=1.5) == [approx([0.75] * 3), approx([1.5, 1.5, 0.0])]
    # sequence-mask, [1/1.5, 1.5]: 0.75 stays with its weight, 1.8 is out.
    assert weights("sequence-mask", cap=1.5) == [approx([0.75] * 3), approx([0.0, 0.0, 0.0])]
    # geometric-mask, [1/1.2, 1.2]: 0.75^(1/3) = 0.9086 kept (weight 1), 1.8^(1/2) = 1.342 out; at its
    # default band [0.999, 1.001] both are out.
    assert weights("geometric-mask", cap=1.2) == [approx([1.0] * 3), approx([0.0, 0.0, 0.0])]
    assert weights("geometric-mask") == [approx([0.0] * 3), approx([0.0] * 3)]
    assert engine_importance_weights(OLD, ENGINE, MASK, "none") is None


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="truncates from above only"):
        weights("token-truncate", floor=0.5)
    with pytest.raises(ValueError, match="0 < floor <= 1 <= cap"):
        weights("token-mask", cap=0.9)
    with pytest.raises(ValueError, match="allowed: token-truncate"):
        weights("token-clip")


def test_mismatch_statistics_by_hand():
    # k3 per token, (rho - 1) - log rho: 0.901388, 0.636294, 0, 0.094535, 0.017678; mean 0.329979.
    stats = mismatch_statistics(OLD, ENGINE, MASK, "token-truncate", 2.0)
    assert stats["is/mismatch_kl"] == pytest.approx(0.329979, abs=1e-6)
    assert (stats["is/ratio_min"], stats["is/ratio_max"]) == (pytest.approx(0.25), pytest.approx(3.0))
    assert stats["is/ratio_mean"] == pytest.approx((3 + 0.25 + 1 + 1.5 + 1.2) / 5)
    assert stats["is/weight_mean"] == pytest.approx((2 + 0.25 + 1 + 1.5 + 1.2) / 5)
    assert stats["is/truncated_fraction"] == pytest.approx(1 / 5)
    # Per response for the sequence modes: 0.75 and 1.8; masked: the second response's 2 of 5 tokens.
    stats = mismatch_statistics(OLD, ENGINE, MASK, "sequence-mask", 1.5, 1 / 1.5)
    assert (stats["is/ratio_min"], stats["is/ratio_max"]) == (pytest.approx(0.75), pytest.approx(1.8))
    assert stats["is/masked_fraction"] == pytest.approx(2 / 5)
    assert stats["is/weight_mean"] == pytest.approx(0.75 * 3 / 5)
    stats = mismatch_statistics(OLD, ENGINE, MASK, "none")
    assert "is/weight_mean" not in stats and stats["is/mismatch_kl"] == pytest.approx(0.329979, abs=1e-6)


# ---------------------------------------------------------------- in the trainer
RHO_EVEN, RHO_ODD, RHO_STEADY = 3.0, 0.6, 1.1


def rho(row: int, t: int) -> float:
    """pi_old / pi_engine of the shifted engine's token t of response ``row``: in the even rows 3 at
    even positions and 0.6 at odd ones, in the odd rows 1.1 throughout."""
    if row % 2:
        return RHO_STEADY
    return RHO_EVEN if t % 2 == 0 else RHO_ODD


class ShiftedEngine(TorchGenerator):
    """The built-in loop, reporting engine log-probs that are the sampled tokens' own log-probs
    shifted by the known ratios of :func:`rho`."""

    def next_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        tokens = super().next_tokens(logits)
        logprobs = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        self.steps.append(logprobs.gather(1, tokens[:, None]).squeeze(1))
        return tokens

    def generate(self, model, prompt_ids, prompt_mask):
        self.steps = []
        response_ids, response_mask = super().generate(model, prompt_ids, prompt_mask)
        own = torch.stack(self.steps, dim=1)  # (B, T)
        shift = torch.tensor([[math.log(rho(row, t)) for t in range(own.shape[1])] for row in range(own.shape[0])])
        self.last_logprobs = (own - shift) * response_mask
        return response_ids, response_mask


def engine_trainer(zoo, **overrides) -> PPOTrainer:
    config = small_grpo_config(zoo, **overrides)
    tokenizer = load_tokenizer(config.model)
    torch.manual_seed(0)
    engine = ShiftedEngine(tokenizer.eos_token_id, tokenizer.pad_token_id, config.max_new_tokens, do_sample=True,
                           seed=0)
    return PPOTrainer(config, model=load_causal_lm(config.model), ref=load_causal_lm(config.model),
                      tokenizer=tokenizer, generator=engine)


def expected_weights(mode: str, lengths: list[int], width: int, cap: float, floor: float | None) -> torch.Tensor:
    """The mode's weights for the shifted engine's ratios, worked from the response lengths alone."""
    rows = []
    for row, length in enumerate(lengths):
        ratios = [rho(row, t) for t in range(length)]
        product = math.prod(ratios)
        geometric = product ** (1 / length)
        if mode == "token-truncate":
            weights = [min(r, cap) for r in ratios]
        elif mode == "token-mask":
            weights = [r if floor <= r <= cap else 0.0 for r in ratios]
        elif mode == "sequence-truncate":
            weights = [min(product, cap)] * length
        elif mode == "sequence-mask":
            weights = [product if floor <= product <= cap else 0.0] * length
        elif mode == "geometric-mask":
            weights = [1.0 if floor <= geometric <= cap else 0.0] * length
        else:
            weights = [1.0] * length
        rows.append(weights + [0.0] * (width - length))
    return torch.tensor(rows)


@pytest.mark.parametrize("mode, cap", [("token-truncate", 2.0), ("token-mask", 2.0), ("sequence-truncate", 2.0),
                                       ("sequence-mask", 2.0), ("geometric-mask", 1.2), ("none", None)])
def test_the_trainer_weights_each_tokens_policy_gradient(zoo, mode, cap):
    """The first minibatch's ratio is 1, so the clipped loss is -A per token and its sequence mean,
    with each token's weight, can be written from the advantages and the weights worked by hand.
    Without the weights (or with the wrong ones) pg_loss is another number."""
    trainer = engine_trainer(zoo, is_correction=mode, **({"is_cap": cap} if cap is not None else {}))
    rows = [{"prompt": p} for p in PROMPTS[:4] for _ in range(2)]
    experience, _ = trainer.make_experience(rows)
    mask = experience.mask
    lengths = mask.sum(dim=1).tolist()
    floor = None if cap is None else 1 / cap
    w = expected_weights(mode, lengths, mask.shape[1], cap or 0.0, floor)
    assert w.sum() > 0 and (mode == "none" or not torch.equal(w, mask.float()))  # weights that change something
    per_token = -experience.advantages * w
    expected = torch.stack([per_token[i, :n].sum() / n for i, n in enumerate(lengths)]).mean()  # sequence-mean
    stats = trainer.accumulate_gradients(experience, torch.arange(8), warming_up=False)
    assert stats["pg_loss"].item() == pytest.approx(expected.item(), abs=1e-5)


def test_the_trainer_logs_the_mismatch(zoo):
    trainer = engine_trainer(zoo, is_correction="token-truncate")
    metrics = trainer.step([{"prompt": p} for p in PROMPTS[:4] for _ in range(2)])
    # Every token's ratio is 3, 0.6 or 1.1: the k3 mismatch lies between theirs, the extremes are those.
    k3 = [(r - 1) - math.log(r) for r in (RHO_EVEN, RHO_ODD, RHO_STEADY)]
    assert min(k3) - 1e-4 < metrics["is/mismatch_kl"] < max(k3) + 1e-4
    assert metrics["is/ratio_max"] == pytest.approx(RHO_EVEN, rel=1e-4)
    assert metrics["is/ratio_min"] == pytest.approx(RHO_ODD, rel=1e-4)
    assert 0 < metrics["is/truncated_fraction"] < 1 and "is/masked_fraction" not in metrics
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(math.log(RHO_EVEN), rel=1e-4)


def test_gspo_in_the_trainer_keeps_each_tokens_advantage_and_weight(zoo):
    """GSPO-token at the first minibatch (every ratio 1): its gradient is the per-token loss's,
    -A_t w_t grad log pi_t per token.  The critic's advantages differ token by token and the
    engine's weights do too, so giving every token its response's mean (the old form) would move
    the weights elsewhere."""
    trainer = engine_trainer(zoo, estimator="gae", samples_per_prompt=1, is_correction="token-truncate")
    experience, _ = trainer.make_experience([{"prompt": p} for p in PROMPTS[:4] for _ in range(2)])
    assert (experience.advantages - experience.advantages[:, :1]).abs().max() > 1e-3  # per-token advantages
    gradients = {}
    for level in ("token", "sequence"):
        trainer.config.ratio_level = level
        trainer.accumulate_gradients(experience, torch.arange(8), warming_up=False)
        gradients[level] = torch.cat([p.grad.flatten() for p in trainer.actor.parameters() if p.grad is not None])
    assert torch.allclose(gradients["sequence"], gradients["token"], rtol=1e-4, atol=1e-7)
    # The response-mean form, for contrast: the same advantages averaged over each response differ.
    means = (experience.advantages * experience.mask).sum(1, keepdim=True) / experience.mask.sum(1, keepdim=True)
    experience.advantages = torch.where(experience.mask.bool(), means, experience.advantages)
    trainer.config.ratio_level = "token"
    trainer.accumulate_gradients(experience, torch.arange(8), warming_up=False)
    averaged = torch.cat([p.grad.flatten() for p in trainer.actor.parameters() if p.grad is not None])
    assert not torch.allclose(averaged, gradients["token"], rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"is_correction": "token-clip"}, "'is_correction'.*token-truncate"),
        ({"is_cap": 0.5}, "'is_cap'.*>= 1"),
        ({"is_floor": 0.0}, "'is_floor'.*0 < is_floor <= 1"),
        ({"is_floor": 1.5}, "'is_floor'.*0 < is_floor <= 1"),
        ({"is_floor": 0.5}, "'is_floor'.*truncates from above only"),
        ({"is_correction": "sequence-truncate", "is_floor": 0.5}, "'is_floor'.*truncates from above only"),
        ({"is_correction": "none", "is_cap": 2.0}, "'is_cap'.*--is-correction none"),
    ],
)
def test_bad_importance_settings_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(PPOConfig, {"task": "doubling", "rollout_engine": "vllm", **values})


def test_importance_defaults_resolve_by_mode():
    def resolved(**values):
        config = build_config(PPOConfig, {"task": "doubling", "rollout_engine": "vllm", **values})
        return config.is_cap, config.is_floor

    assert resolved() == (2.0, None)
    torch_engine = build_config(PPOConfig, {"task": "doubling"})  # its log-probs are the trainer's: no weights
    assert (torch_engine.is_correction, torch_engine.is_cap, torch_engine.is_floor) == ("none", None, None)
    assert resolved(is_correction="token-mask") == (2.0, 0.5)
    assert resolved(is_correction="geometric-mask") == (1.001, pytest.approx(1 / 1.001))
    assert resolved(is_correction="sequence-mask", is_cap=3.0, is_floor=0.1) == (3.0, 0.1)
    assert resolved(is_correction="none") == (None, None)


def test_a_run_saved_with_tis_cap_reads_as_token_truncate():
    assert PPOConfig.saved_settings_now({"rollout_engine": "vllm", "tis_cap": 2.0}) == {
        "rollout_engine": "vllm", "is_cap": 2.0, "is_correction": "token-truncate"}
    assert PPOConfig.saved_settings_now({"tis_cap": None}) == {"is_cap": None, "is_correction": "none"}


def test_a_torch_run_saved_with_the_weights_default_reads_as_none():
    """Before the torch engine's default became none, its runs recorded token-truncate with cap 2,
    weights never applied: a resume of one reads them as what they did."""
    saved = {"rollout_engine": "torch", "is_correction": "token-truncate", "is_cap": 2.0, "is_floor": None}
    assert PPOConfig.saved_settings_now(saved) == {**saved, "is_correction": "none", "is_cap": None}
    assert PPOConfig.saved_settings_now({**saved, "rollout_engine": "vllm"})["is_correction"] == "token-truncate"
    assert PPOConfig.saved_settings_now({"dynamic_sampling": True})["dynamic_sampling_on"] == "score"


def test_the_plan_names_the_engines_weights_and_probe():
    from ppo_rlhf.trainers.ppo_plan import _engine

    def line(**values):
        return _engine(build_config(PPOConfig, {"task": "doubling", "rollout_engine": "vllm", **values}))

    assert line() == ("; engine vllm in float32 (weights synced before each rollout and checked by a probe in "
                      "float32, tolerance 0.001; importance weights token-truncate, cap 2)")
    assert "vllm in bfloat16 (weights synced before each rollout and checked by a probe in bfloat16, tolerance 0.1; " \
           "importance weights sequence-mask to [0.3333, 3]" in line(mixed_precision="bf16",
                                                                     is_correction="sequence-mask", is_cap=3.0)
    assert "tolerance 0.05; no importance weights" in line(vllm_probe_tolerance=0.05, is_correction="none")
    with pytest.raises(ConfigError, match="'vllm_probe_tolerance'.*without --rollout-engine vllm"):
        build_config(PPOConfig, {"task": "doubling", "vllm_probe_tolerance": 0.01})


def test_the_probe_tolerance_may_change_on_resume():
    """A run the probe stopped may go on with another bound (it changes no arithmetic of the run)."""
    from ppo_rlhf.run_folder import changed_settings

    saved, now = {"vllm_probe_tolerance": None, "is_cap": 2.0}, {"vllm_probe_tolerance": 0.5, "is_cap": 2.0}
    assert changed_settings(saved, now) == []
    assert changed_settings({"is_cap": 2.0}, {"is_cap": 3.0}) == ["is_cap: 2.0 -> 3.0"]


@pytest.mark.parametrize("mode, per_response", [("sequence-truncate", [0.3, 0.4]), ("sequence-mask", [0.3, 0.4]),
                                                ("geometric-mask", [0.15, 0.2])])
def test_the_sequence_ratio_logged_is_read_from_the_responses_model_tokens(mode, per_response):
    """An episode's response may open with the environment's tokens (loss mask 0 there): is/ratio_*
    are each response's own product (or geometric mean) of rho, not the 0 padding holds at column 0."""
    engine = torch.tensor([[0.0, -0.1, -0.2, 0.0], [0.0, 0.0, -0.3, -0.1]])  # log rho = 0 - engine
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])  # each response's first position is the environment's
    stats = mismatch_statistics(torch.zeros(2, 4), engine, mask, mode, cap=2.0)
    ratios = [math.exp(value) for value in per_response]
    assert stats["is/ratio_min"] == pytest.approx(min(ratios), rel=1e-5)
    assert stats["is/ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
    assert stats["is/ratio_mean"] == pytest.approx(sum(ratios) / 2, rel=1e-5)
