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
from ppo_rlhf.rollout.sequences import Sequences
from ppo_rlhf.trainers.ppo import PPOTrainer, token_micro_batches
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


# ------------------------------------------------------------------ --max-tokens-per-micro-batch auto
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, vocab_size=49152)


def test_a_token_of_smollm2_costs_what_its_layers_keep_hand_worked():
    from transformers import LlamaConfig

    from ppo_rlhf.trainers.token_budget import token_cost

    config = LlamaConfig(**SMOLLM2)
    # 30 layers x 4 x (576 + 1536) = 253,440 elements kept, x 4 bytes x 2.5 (peak over kept)
    assert token_cost(config, 4).flat == 2_534_400
    assert token_cost(config, 2).flat == 1_267_200  # bf16 autocast
    # checkpointed: each layer's input, 30 x 576, and one layer recomputed, 4 x 2,112 -> 25,728 x 10
    assert token_cost(config, 4, checkpointing=True).flat == 257_280
    # the model's own logits: 3 x 49,152 x 10; the sdpa kernels keep no scores
    assert token_cost(config, 4).own_logits == 1_474_560 and token_cost(config, 4).per_position == 0
    config._attn_implementation = "eager"  # 2 x 9 heads x 30 layers of scores a position, x 10
    assert token_cost(config, 4).per_position == 5_400
    assert token_cost(config, 4).bytes(650) == 2_534_400 + 5_400 * 650
    assert token_cost(config, 4).bytes(650, fused=False) == 2_534_400 + 5_400 * 650 + 1_474_560


def test_auto_budget_from_the_memory_free_hand_worked():
    from transformers import LlamaConfig

    from ppo_rlhf.trainers.token_budget import auto_budget

    model = type("Model", (), {"config": LlamaConfig(**SMOLLM2)})()
    gib = 2**30
    # A CPU with 20 GiB free: half of it less LoRA's 4,885,057 weights x 12 bytes is more than the
    # 4 GiB ceiling, and 4 GiB / 2,534,400 bytes = 1,694 tokens -> 1,536 (steps of 256).
    cpu = auto_budget([model], 4, False, free=20 * gib, trained=4_885_057, on_cpu=True)
    assert (cpu.room, cpu.kept_back) == (4 * gib, 58_620_684)
    assert cpu.tokens(650) == 1_536
    # A GPU with 20 GiB free: no ceiling, (20 GiB - 58,620,684) / 2 = 10,708,107,898 bytes -> 4,225 -> 4,096.
    gpu = auto_budget([model], 4, False, free=20 * gib, trained=4_885_057, on_cpu=False)
    assert gpu.room == 10_708_107_898 and gpu.tokens(650) == 4_096
    # 1 GiB free: 507,560,570 bytes hold 200 tokens, under a step: kept as they are; nothing free: one token.
    assert auto_budget([model], 4, False, free=gib, trained=4_885_057, on_cpu=True).tokens(650) == 200
    assert auto_budget([model], 4, False, free=0, trained=4_885_057, on_cpu=True).tokens(650) == 1
    # The full model: its 134,515,008 weights' gradients and moments (1.61 GB) are kept back first.
    full = auto_budget([model], 4, False, free=6 * gib, trained=134_515_008, on_cpu=True)
    assert full.room == (6 * gib - 134_515_008 * 12) // 2 and full.tokens(650) == 768  # 952 -> 768
    # Under FSDP every process takes the smallest room any of them has.
    assert auto_budget([model], 4, False, free=20 * gib, trained=0, on_cpu=False, agree=lambda room: gib).room == gib
    # The larger of the actor and a critic with a trunk of its own counts (each runs its backward alone).
    wide = type("Model", (), {"config": LlamaConfig(**{**SMOLLM2, "num_hidden_layers": 60})})()
    assert auto_budget([model, wide], 4, False, free=20 * gib, trained=0, on_cpu=True).tokens(650) == 768  # 847


def test_rows_that_fit_the_budget_are_cut_by_rows_and_others_by_tokens():
    from ppo_rlhf.trainers.token_budget import TokenBudget, TokenCost

    budget = TokenBudget(auto=True, room=100 * 1000, cost=TokenCost(flat=1000))  # 100 tokens
    assert budget.for_rows(100, 40) is None  # rows of 100 tokens in all: one pass, as without a budget
    assert budget.for_rows(101, 41) == 100
    eager = TokenBudget(auto=True, room=100 * 1000, cost=TokenCost(flat=500, per_position=10))
    assert eager.tokens(50) == 100 and eager.tokens(150) == 50  # longer rows, fewer tokens a pass
    assert TokenBudget(given=40).for_rows(60, 30) == 40  # a number given is kept as it is
    assert TokenBudget(given=None).for_rows(60, 30) is None


def test_rows_sharing_a_prompt_count_it_once_a_micro_batch():
    # Responses of 10 tokens, prompts of 20: prompt 0 has three rows (50 tokens), 1 two (40), 2 one (30).
    responses, prompts = torch.full((6,), 10), torch.tensor([0, 0, 0, 1, 1, 2])
    assert token_micro_batches(responses, 50, prompts=prompts, prompt_tokens=20) == [[0, 1, 2], [3, 4], [5]]
    # 45 tokens: prompt 0's third row starts a group (and pays its prompt again), prompt 1 one of its own.
    assert token_micro_batches(responses, 45, prompts=prompts, prompt_tokens=20) == [[0, 1], [2], [3, 4], [5]]
    # Rows of two prompts share a micro-batch where both prompts fit; a row cap still holds.
    assert token_micro_batches(torch.full((2,), 10), 60, prompts=torch.tensor([0, 1]), prompt_tokens=20) == [[0, 1]]
    assert token_micro_batches(responses, 50, max_rows=2, prompts=prompts, prompt_tokens=20) == [[0, 1], [2], [3, 4],
                                                                                                 [5]]
    # Counted per row (without prompts) the same rows of 30 tokens would take five passes of 50.
    assert len(token_micro_batches(torch.full((6,), 30), 50)) == 6


def test_the_option_takes_a_number_auto_or_empty_and_auto_is_the_default():
    config = build_config(PPOConfig, {"task": "doubling"})
    assert config.max_tokens_per_micro_batch == "auto"
    assert build_config(PPOConfig, {"task": "doubling", "max_tokens_per_micro_batch": "AUTO"}).max_tokens_per_micro_batch == "auto"
    assert build_config(PPOConfig, {"task": "doubling", "max_tokens_per_micro_batch": "4096"}).max_tokens_per_micro_batch == 4096
    assert build_config(PPOConfig, {"task": "doubling", "max_tokens_per_micro_batch": "none"}).max_tokens_per_micro_batch is None
    with pytest.raises(ConfigError, match="'max_tokens_per_micro_batch' must be int or auto, got 'automatic'"):
        build_config(PPOConfig, {"task": "doubling", "max_tokens_per_micro_batch": "automatic"})


def small_memory(monkeypatch, tokens: int) -> None:
    """The memory free at start holds ``tokens`` tokens a pass of the zoo's GPT-2 (32 wide, 128 in its
    MLP, 2 layers: 2.5 x 4 bytes x 2 x 4 x 160 = 12,800 bytes a token), nothing kept back."""
    from ppo_rlhf import hardware
    from ppo_rlhf.trainers import token_budget

    monkeypatch.setattr(token_budget, "OPTIMIZER_BYTES", 0)
    monkeypatch.setattr(hardware, "free_memory", lambda device: 2 * tokens * 12_800)


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_auto_budget_rollout_passes_equal_one_full_pass(zoo, critic, monkeypatch):
    whole, _ = trainer_with(zoo, critic, max_tokens_per_micro_batch=None).make_experience(ROWS)
    small_memory(monkeypatch, 24)
    trainer = trainer_with(zoo, critic)
    assert trainer.token_budget.tokens(32) == 24
    parts, _ = trainer.make_experience(ROWS)
    assert len(trainer.micro_batches(parts.sequences)) > 2  # the 8 rows took several passes
    assert torch.equal(whole.sequences.response_ids, parts.sequences.response_ids)
    for name in ("logprobs", "ref_logprobs", "values", "kl", "advantages", "returns"):
        assert torch.allclose(getattr(whole, name), getattr(parts, name), atol=1e-6), name


@pytest.mark.parametrize("aggregation, critic", [("token-mean", "shared"), ("sequence-mean", "separate"),
                                                 ("token-mean", "grpo")])
def test_auto_budget_accumulates_the_gradient_of_one_pass(zoo, aggregation, critic, monkeypatch):
    """Also GRPO's 4 samples of 2 prompts, whose passes run each prompt once (shared prompts): a
    micro-batch counts its prompts once."""
    grpo = {"estimator": "grpo", "samples_per_prompt": 4} if critic == "grpo" else {}
    rows = [{"prompt": PROMPTS[i // 4]} for i in range(8)] if grpo else ROWS
    whole_trainer = trainer_with(zoo, critic, loss_aggregation=aggregation, entropy_coef=0.01,
                                 max_tokens_per_micro_batch=None, **grpo)
    small_memory(monkeypatch, 24)
    auto_trainer = trainer_with(zoo, critic, loss_aggregation=aggregation, entropy_coef=0.01, **grpo)
    experience, _ = whole_trainer.make_experience(rows)
    auto_trainer.checked_pass_plan(experience.sequences)
    assert auto_trainer.pass_plan.share_prompts == bool(grpo)
    minibatch = torch.tensor([5, 0, 7, 2, 3, 6, 1, 4])
    _, parts = auto_trainer.update_micro_batches(experience, minibatch)
    assert len(parts) > 2
    if not grpo:
        lengths = experience.sequences.attention_mask.sum(dim=1)
        assert all(lengths[minibatch[part]].sum() <= 24 or len(part) == 1 for part in parts)
    for trainer in (whole_trainer, auto_trainer):
        trainer.actor.train()
        if trainer.critic is not None:
            trainer.critic.train()
    whole_stats = whole_trainer.accumulate_gradients(experience, minibatch, warming_up=False)
    auto_stats = auto_trainer.accumulate_gradients(experience, minibatch, warming_up=False)
    pairs = list(zip(whole_trainer.trainable_parameters, auto_trainer.trainable_parameters))
    largest = max((a.grad - b.grad).abs().max().item() for a, b in pairs)
    assert largest <= 1e-6 * max(a.grad.abs().max().item() for a, _ in pairs), largest
    for key in whole_stats:
        assert auto_stats[key].item() == pytest.approx(whole_stats[key].item(), rel=1e-5, abs=1e-7), key


def test_under_fsdp_every_process_cuts_its_share_into_as_many_micro_batches(zoo):
    """Padded passes (FSDP's) count every row at the batch's width, so the minibatch splits into
    equal shares and each process runs as many micro-batches, each pass a collective -- even where
    one row is far longer than the rest, which a split by real tokens gives fewer rows to share."""
    from types import SimpleNamespace

    from ppo_rlhf.trainers.ppo_update import split_by_tokens

    trainer = trainer_with(zoo, max_tokens_per_micro_batch=64)
    assert trainer.pass_plan is None  # padded: each row counts the batch's width (32)
    response_mask = (torch.arange(24)[None, :] < torch.tensor([24, 1, 1, 1, 1, 1, 1, 1])[:, None]).long()
    sequences = Sequences(torch.ones(8, 8, dtype=torch.long), torch.ones(8, 8, dtype=torch.long), response_mask,
                          response_mask)
    experience = SimpleNamespace(sequences=sequences)
    minibatch = torch.arange(8)
    real = split_by_tokens(minibatch, sequences.attention_mask.sum(dim=1), 2)
    assert [len(share) for share in real] == [3, 5]  # by real tokens: the long row with 2 short ones, 5 short
    trainer.processes = 2
    cut = []
    for rank in (0, 1):
        trainer.rank = rank
        mine, parts = trainer.update_micro_batches(experience, minibatch)
        cut.append((len(mine), len(parts)))
    assert cut == [(4, 2), (4, 2)]  # 4 rows each, 2 of 32 positions a micro-batch of 64 tokens


def test_a_run_saved_with_another_budget_resumes_with_auto():
    """How a batch is cut into passes changes no sum: a run saved before auto (its budget empty), or
    with a number, resumes under the default."""
    from ppo_rlhf.run_folder import changed_settings

    for saved in (None, 4096):
        assert changed_settings({"max_tokens_per_micro_batch": saved}, {"max_tokens_per_micro_batch": "auto"}) == []
