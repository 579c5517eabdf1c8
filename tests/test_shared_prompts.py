"""Shared prompts (docs/design.md, "Shared prompts"): with K responses to a prompt, each forward
pass runs the prompt once and the responses on its cached keys and values -- the same log-probs,
hidden states and gradients as the full pass, in fewer prompt tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from ppo_rlhf.config import build_config
from ppo_rlhf.models import load_causal_lm
from ppo_rlhf.models.lora import LoraOptions, with_adapter
from ppo_rlhf.rollout.logprobs import (
    PromptSharingUnsupported,
    distinct_prompts,
    forward_response,
    forward_shared_prompts,
    logprobs_from_logits,
)
from ppo_rlhf.rollout.passes import PassPlan, checked_plan
from ppo_rlhf.rollout.sequences import Sequences
from ppo_rlhf.trainers.ppo import PPOTrainer, prompt_sharing_possible
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import PROMPTS, REWARDS_MODULE, make_tokenizer

PAD = 0
SHARED = PassPlan(share_prompts=True)  # the own forward's logits, prompts shared: what these tests compare


def grouped_sequences(vocab: int, k: int = 3, seed: int = 0) -> Sequences:
    """Three prompts of 2, 5 and 4 tokens (left-padded to 5), each followed by k responses of up
    to 4 tokens (right-padded: some stop early), in shuffled row order."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids, prompt_mask = [], []
    for length in (2, 5, 4):
        ids = torch.randint(3, vocab, (length,), generator=generator)
        prompt_ids.append(torch.cat([torch.full((5 - length,), PAD), ids]))
        prompt_mask.append(torch.cat([torch.zeros(5 - length, dtype=torch.long), torch.ones(length, dtype=torch.long)]))
    rows = torch.randperm(3 * k, generator=generator) % 3  # which prompt each row answers
    lengths = torch.randint(1, 5, (3 * k,), generator=generator)
    response_mask = (torch.arange(4)[None, :] < lengths[:, None]).long()
    response_ids = torch.randint(3, vocab, (3 * k, 4), generator=generator) * response_mask
    return Sequences(torch.stack(prompt_ids)[rows], torch.stack(prompt_mask)[rows], response_ids, response_mask)


def test_distinct_prompts_names_one_row_per_prompt_and_each_rows_prompt():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 5, 6], [7, 8, 9]])
    mask = (ids != 0).long()
    # The same ids under another mask are another prompt (a pad id that is also a real token).
    ids, mask = torch.cat([ids, ids[:1]]), torch.cat([mask, torch.ones(1, 3, dtype=torch.long)])
    sequences = Sequences(ids, mask, torch.ones(6, 1, dtype=torch.long), torch.ones(6, 1, dtype=torch.long))
    first_rows, prompt_of_row = distinct_prompts(sequences)
    assert len(first_rows) == 3
    groups = prompt_of_row.tolist()
    assert groups[0] == groups[2] == groups[3] and groups[1] == groups[4] and len({groups[0], groups[1], groups[5]}) == 3
    for row, prompt in enumerate(groups):  # each row's prompt is held by the row named for it
        assert torch.equal(ids[first_rows[prompt]], ids[row]) and torch.equal(mask[first_rows[prompt]], mask[row])


def tiny_llama(dtype=torch.float32):
    tokenizer = make_tokenizer("llama")
    torch.manual_seed(0)
    from zoo import make_config
    return AutoModelForCausalLM.from_config(make_config("llama", tokenizer)).to(dtype).eval()


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2", "granite", "gemma"])
def test_the_shared_pass_gives_the_full_passs_logits_and_hidden_states(zoo, arch):
    model = load_causal_lm(zoo[arch]).eval()
    sequences = grouped_sequences(model.config.vocab_size)
    with torch.no_grad():
        whole = forward_response(model, sequences, temperature=0.7)
        shared = forward_response(model, sequences, temperature=0.7, share_prompts=True)
    assert shared.logits.shape == whole.logits.shape == (9, 4, model.config.vocab_size)
    assert shared.logits.dtype == torch.float32
    # Positions past a response's end are padding in both; compare where the mask is on.
    on = sequences.response_mask.bool()
    torch.testing.assert_close(shared.logits[on], whole.logits[on], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared.hidden[on], whole.hidden[on], rtol=1e-5, atol=1e-5)
    assert checked_plan(model, sequences, SHARED) == (SHARED, [])


def test_a_one_token_response_needs_only_the_prompt_pass():
    model = tiny_llama()
    sequences = grouped_sequences(model.config.vocab_size)
    sequences = Sequences(sequences.prompt_ids, sequences.prompt_mask, sequences.response_ids[:, :1],
                          sequences.response_mask[:, :1])
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        whole = forward_response(model, sequences)
        shared = forward_response(model, sequences, share_prompts=True)
    assert len(calls) == 2  # one each
    torch.testing.assert_close(shared.logits, whole.logits, rtol=1e-5, atol=1e-5)


def test_rows_that_all_differ_take_the_full_pass():
    model = tiny_llama()
    sequences = grouped_sequences(model.config.vocab_size, k=1)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        forward_response(model, sequences, share_prompts=True)
    assert len(calls) == 1


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_shared_pass_gives_the_full_passs_gradients(lora):
    model = tiny_llama().train()
    if lora:
        model = with_adapter(LoraOptions(lora=True), model, "CAUSAL_LM")
    sequences = grouped_sequences(model.config.vocab_size, k=4, seed=1)
    trained = [p for p in model.parameters() if p.requires_grad]
    gradients = []
    for share in (False, True):
        model.zero_grad()
        out = forward_response(model, sequences, share_prompts=share)
        logprobs = logprobs_from_logits(out.logits, sequences.response_ids)
        # A loss on the hidden states too: a shared value head's gradient goes through them.
        loss = (logprobs * sequences.response_mask).sum() + out.hidden.pow(2).mean()
        loss.backward()
        gradients.append([p.grad.clone() for p in trained])
    assert any(g.abs().max() > 0 for g in gradients[0])
    for whole, shared in zip(*gradients):
        torch.testing.assert_close(shared, whole, rtol=1e-4, atol=1e-5)  # float32 rounding: ~2e-6


def test_a_cache_that_drops_positions_is_refused_and_the_check_says_why():
    # A sliding window shorter than the sequences: its cache keeps only the window's keys.
    tokenizer = make_tokenizer("llama")
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=3,
                           pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config).eval()
    sequences = grouped_sequences(model.config.vocab_size)
    first_rows, prompt_of_row = distinct_prompts(sequences)
    with torch.no_grad(), pytest.raises(PromptSharingUnsupported, match="DynamicSlidingWindowLayer"):
        forward_shared_prompts(model, sequences, first_rows, prompt_of_row)
    plan, warnings = checked_plan(model, sequences, SHARED)
    assert not plan.share_prompts and "DynamicSlidingWindowLayer" in warnings[0]


def test_a_shared_pass_that_disagrees_is_caught_by_the_check(monkeypatch):
    # A model whose cached continuation computes something else (here: positions shifted by one):
    # the check compares log-probs and names the gap.
    model = tiny_llama()
    sequences = grouped_sequences(model.config.vocab_size)
    forward = model.forward

    def shifted_when_cached(*args, position_ids=None, **kwargs):
        if kwargs.get("cache", kwargs.get("past_key_values")) is not None:
            position_ids = position_ids + 7
        return forward(*args, position_ids=position_ids, **kwargs)

    monkeypatch.setattr(model, "forward", shifted_when_cached)
    plan, warnings = checked_plan(model, sequences, SHARED)
    assert not plan.share_prompts and "differ from the model's own padded pass" in warnings[0]


def config_of(zoo, **overrides) -> PPOConfig:
    settings = {"model": str(zoo["llama"]), "prompts": str(zoo["prompts"]), "reward_fn": f"{REWARDS_MODULE}:length_score",
                "estimator": "grpo", "samples_per_prompt": 4, "batch_size": 8, "mini_batch_size": 4,
                "max_new_tokens": 6, "max_length": 32, "lr": 1e-2, "num_threads": 1}
    return build_config(PPOConfig, {**settings, **overrides})


@pytest.mark.parametrize("overrides, expected", [
    ({}, True),
    ({"share_prompts": False}, False),
    ({"samples_per_prompt": 1, "estimator": "gae"}, False),  # no prompt repeats
    ({"gradient_checkpointing": True}, False),  # the recomputation would append to the cache again
])
def test_which_runs_may_share_prompts(zoo, overrides, expected):
    assert prompt_sharing_possible(config_of(zoo, **overrides), sharding=None) is expected
    assert prompt_sharing_possible(config_of(zoo, **overrides), sharding=object()) is False  # FSDP


@pytest.mark.parametrize("overrides", [{}, {"lora": True, "lr": 3e-2}, {"estimator": "rloo", "kl_in": "loss"}],
                         ids=["grpo", "grpo-lora", "rloo-kl-in-loss"])
def test_a_run_trains_as_it_does_without_sharing(zoo, overrides):
    rows = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]
    runs = []
    for share in (True, False):
        trainer = PPOTrainer(config_of(zoo, share_prompts=share, **overrides))
        calls = []
        trainer.actor.register_forward_hook(lambda *_: calls.append(1))
        start = {name: p.detach().clone() for name, p in trainer.actor.named_parameters() if p.requires_grad}
        # One iteration: both sample the same responses (the same seeds, before any update); later
        # rollouts would sample from weights that differ by rounding, and diverge as samples do.
        metrics = trainer.step(rows)
        runs.append((trainer, start, metrics, len(calls)))
    (shared, start, shared_metrics, shared_calls), (whole, _, whole_metrics, whole_calls) = runs
    assert shared.pass_plan.share_prompts is True and whole.pass_plan.share_prompts is False
    trained = dict(shared.actor.named_parameters())
    moved = max((trained[name] - weights).abs().max().item() for name, weights in start.items())
    assert moved > 1e-3  # it trained
    # Adam's first step is g / (|g| + eps) x lr: for a gradient near eps (an adapter's B) it turns a
    # rounding difference of the gradient into a visible part of the step (up to 0.6% measured).
    for ours, theirs in zip(shared.actor.state_dict().values(), whole.actor.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0.02 * moved)
    for key in ("score", "kl", "pg_loss", "approx_kl", "entropy", "grad_norm", "kl_loss"):
        if key in whole_metrics:
            assert shared_metrics[key] == pytest.approx(whole_metrics[key], rel=1e-4, abs=1e-6), key
    # Two calls a pass (the distinct prompts, then the responses), and the first batch's check.
    assert shared_calls > whole_calls


def test_a_model_that_fails_the_check_trains_without_sharing_and_says_so(zoo, monkeypatch, capsys):
    def fancy(*args, **kwargs):
        raise PromptSharingUnsupported("its cache is a FancyCache")

    monkeypatch.setattr("ppo_rlhf.rollout.logprobs.forward_shared_prompts", fancy)
    trainer = PPOTrainer(config_of(zoo))
    assert trainer.pass_plan is None and trainer.wanted_pass_plan.share_prompts  # not yet checked
    trainer.step([{"prompt": p} for p in PROMPTS[:2] for _ in range(4)])
    assert trainer.pass_plan.share_prompts is False
    assert ("warning: --share-prompts off for this run (--no-share-prompts): its cache is a FancyCache"
            in capsys.readouterr().out)
