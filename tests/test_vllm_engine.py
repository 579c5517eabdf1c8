"""--rollout-engine vllm (docs/design.md, "The vLLM rollout engine"), on vLLM's CPU build: the
engine samples the trainer's distribution, receives every update (full and LoRA), stops, pads and
seeds as the Generator contract says, and a PPO run with it trains and resumes.  Skipped, saying
why, where vLLM is not installed (`make vllm-venv` installs it); the refusal without vLLM is
tested here too, where it is absent."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, OpenAIGPTConfig

from ppo_rlhf.config import ConfigError
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.logprobs import forward_response, logprobs_from_logits
from ppo_rlhf.rollout.sequences import Sequences
from zoo import THREADS, make_tokenizer, run, run_failing, same_actor_as_straight_run

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason='vLLM is not installed: make vllm-venv (pip install -e ".[vllm]") '
                                                     'runs these tests in .venv-vllm')
TEMPERATURE = 0.7
# float32 on both sides: the engine's log-probs of its samples equal the trainer's to round-off
# (1e-5 seen; a weight left stale moves them by 0.05 and more, see the updates test).
LOGPROB_TOLERANCE = 1e-4
# A tiny model of the built-in task whose attention heads vLLM's CPU build takes (128 / 2 = 64).
VLLM_TINY = ["--n-layer", 1, "--n-head", 2, "--n-embd", 128, *THREADS]


def tiny_llama(head_dim: int = 64, seed: int = 0, tied: bool = False, positions: int = 64):
    tokenizer = make_tokenizer("llama")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=2 * head_dim, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=positions,
                         initializer_range=0.2, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=tied,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config), tokenizer


def engine_for(model, **options):
    from ppo_rlhf.rollout.vllm_engine import VLLMGenerator

    settings = dict(stop_token_ids=[2], pad_token_id=2, max_new_tokens=6, do_sample=True, temperature=TEMPERATURE,
                    seed=0, max_model_len=64, memory_utilization=0.01, max_rows=256)
    settings.update(options)
    return VLLMGenerator(model, **settings)


@pytest.fixture(scope="module")
def engine():
    """One engine for the module's unit tests (each call sends it the weights of the model it gets)."""
    torch.set_num_threads(1)
    model, _ = tiny_llama()
    return engine_for(model)


def prompts(rows: int = 4, extra_pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of lengths 3, 5, 2, 4, ... (pad id 2)."""
    lengths = [(3, 5, 2, 4)[row % 4] for row in range(rows)]
    width = max(lengths) + extra_pad
    ids = torch.full((rows, width), 2)
    mask = torch.zeros(rows, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.arange(10 + row % 4, 10 + row % 4 + length)
        mask[row, width - length:] = 1
    return ids, mask


def trainer_logprobs(model, ids, mask, responses, response_mask) -> torch.Tensor:
    with torch.no_grad():
        logits = forward_response(model.eval(), Sequences(ids, mask, responses, response_mask), TEMPERATURE).logits
    return logprobs_from_logits(logits, responses) * response_mask


def fresh(engine, **settings):
    """The engine with the settings a test needs, its draw count back at 0."""
    engine.rng.set_state(torch.tensor([0]))
    engine.stop_token_ids, engine.max_new_tokens, engine.do_sample = [2], 6, True
    for key, value in settings.items():
        setattr(engine, key, value)
    return engine


# ------------------------------------------------------------ the distribution
@needs_vllm
def test_first_tokens_follow_the_trainers_distribution(engine):
    """4,000 first tokens of one prompt against softmax(logits / T): a chi-square test that passes
    for the temperature asked and fails for temperature 1 (so it can tell)."""
    model, _ = tiny_llama()
    engine = fresh(engine, max_new_tokens=1)
    rows = 4000
    ids, mask = torch.tensor([[1, 10, 11, 12]]).repeat(rows, 1), torch.ones(rows, 4, dtype=torch.long)
    responses, _ = engine.generate(model, ids, mask)
    counts = torch.bincount(responses[:, 0], minlength=model.config.vocab_size).double()
    with torch.no_grad():
        logits = model(ids[:1]).logits[0, -1].double()

    def chi_square(temperature: float) -> tuple[float, int]:
        expected = torch.softmax(logits / temperature, dim=-1) * rows
        big = expected >= 5  # the rest pooled into one bin
        observed = torch.cat([counts[big], counts[~big].sum()[None]])
        expected = torch.cat([expected[big], expected[~big].sum()[None]])
        return float(((observed - expected) ** 2 / expected).sum()), int(big.sum())

    statistic, degrees = chi_square(TEMPERATURE)
    # The 99.99% point of chi-square(k) is below k + 6 sqrt(2k) for these k (Wilson-Hilferty).
    assert statistic < degrees + 6 * math.sqrt(2 * degrees), (statistic, degrees)
    wrong, degrees_wrong = chi_square(1.0)
    assert wrong > degrees_wrong + 6 * math.sqrt(2 * degrees_wrong), (wrong, degrees_wrong)


@needs_vllm
def test_every_later_token_is_drawn_from_the_trainers_distribution(engine):
    """Past the first token: at each position, a token drawn from p has E[log p(token)] =
    -E[entropy of p], the expectation over the prefixes drawn before it.  So over 2,000 engine
    responses the mean of (trainer's log-prob of the token + trainer's entropy there) is 0 to
    sampling noise at every position, and not for the distribution at temperature 1 (so it can tell)."""
    from ppo_rlhf.core import entropy_from_logits

    model, _ = tiny_llama()
    engine = fresh(engine, stop_token_ids=[])
    rows = 2000
    ids, mask = torch.tensor([[1, 10, 11, 12]]).repeat(rows, 1), torch.ones(rows, 4, dtype=torch.long)
    responses, response_mask = engine.generate(model, ids, mask)

    def mean_and_error(temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            sequences = Sequences(ids, mask, responses, response_mask)
            logits = forward_response(model.eval(), sequences, temperature).logits
        gap = logprobs_from_logits(logits, responses) + entropy_from_logits(logits)  # (rows, 6)
        return gap.mean(0), gap.std(0) / math.sqrt(rows)

    mean, error = mean_and_error(TEMPERATURE)
    assert bool((mean.abs() < 4 * error).all()), (mean, error)
    mean, error = mean_and_error(1.0)
    assert bool((mean.abs() > 4 * error).any()), (mean, error)


# ------------------------------------------------------------ the weights
def optimizer_steps(model, parameters, steps: int):
    """Updates as the trainer makes them: AdamW (fused where torch has it) on a loss of the model."""
    from ppo_rlhf.trainers.optimizer import adamw

    optimizer = adamw([{"params": parameters, "lr": 3e-2}], lr=3e-2, weight_decay=0.0)
    ids = torch.tensor([[1, 10, 11, 12, 13, 14]])
    for _ in range(steps):
        optimizer.zero_grad()
        model.train()
        model(ids, labels=ids).loss.backward()
        optimizer.step()


@needs_vllm
@pytest.mark.parametrize("lora", [False, True])
def test_engine_logprobs_equal_the_trainers_after_every_update(engine, lora):
    """Three updates, a rollout after each: the engine's log-probs of its samples equal the
    trainer's (weights synced), and differ from those of the weights before the update (so the
    comparison can fail).  LoRA: the policy adapter merged, the critic's adapter left out."""
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_llama()
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "up_proj"]),
                               adapter_name="policy")
        model.add_adapter("critic", LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
        model.set_adapter("policy")
        parameters = [p for name, p in model.named_parameters() if ".policy." in name]
    else:
        parameters = list(model.parameters())
    engine = fresh(engine)
    ids, mask = prompts(8)
    for update in range(3):
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer_steps(model, parameters, 2)
        responses, response_mask = engine.generate(model, ids, mask)
        assert engine.last_sync_seconds > 0
        mine = trainer_logprobs(model, ids, mask, responses, response_mask)
        gap = (mine - engine.last_logprobs).abs().max().item()
        assert gap < LOGPROB_TOLERANCE, (update, gap)
        with torch.no_grad():
            now = {name: p.detach().clone() for name, p in model.named_parameters()}
            for name, p in model.named_parameters():
                p.copy_(before[name])
            stale = trainer_logprobs(model, ids, mask, responses, response_mask)
            for name, p in model.named_parameters():
                p.copy_(now[name])
        assert (stale - engine.last_logprobs).abs().max().item() > 100 * LOGPROB_TOLERANCE, update


# ------------------------------------------------------------ the Generator contract
@needs_vllm
def test_stop_ids_end_a_response_and_the_rest_is_padding(engine):
    model, _ = tiny_llama()
    ids, mask = prompts(8)
    free, free_mask = fresh(engine, stop_token_ids=[]).generate(model, ids, mask)
    assert free.shape == (8, 6) and bool(free_mask.all())  # nothing stops: max_new_tokens each
    stops = [int(free[0, 2]), int(free[1, 1])]  # tokens rows 0 and 1 drew
    responses, response_mask = fresh(engine, stop_token_ids=stops).generate(model, ids, mask)
    assert torch.equal(responses[0, :3], free[0, :3]) and int(response_mask[0].sum()) <= 3
    for row in range(8):
        length = int(response_mask[row].sum())
        kept = responses[row, :length].tolist()
        assert kept == free[row, :length].tolist()  # the same draws (seeds) up to the stop
        assert not any(t in stops for t in kept[:-1])  # the first stop ends it, and is kept
        assert length == 6 or kept[-1] in stops
        assert bool((responses[row, length:] == 2).all()) and bool((response_mask[row, length:] == 0).all())
        assert bool((engine.last_logprobs[row, length:] == 0).all())


@needs_vllm
def test_seeds_per_response_and_left_padding(engine):
    """Copies of a prompt get different responses; the same draw count gives the same ones (what
    a resume restores); more left padding changes nothing; greedy is the argmax."""
    model, _ = tiny_llama()
    ids, mask = prompts(8)
    copies = ids[:1].repeat(8, 1), mask[:1].repeat(8, 1)
    responses, _ = fresh(engine).generate(model, *copies)
    assert len({tuple(r) for r in responses.tolist()}) > 4
    first, _ = fresh(engine).generate(model, ids, mask)
    second, _ = engine.generate(model, ids, mask)
    assert not torch.equal(first, second)  # the next draw
    state = engine.rng.get_state()
    third, _ = engine.generate(model, ids, mask)
    engine.rng.set_state(state)
    again, _ = engine.generate(model, ids, mask)
    assert torch.equal(third, again)
    padded, _ = fresh(engine).generate(model, *prompts(8, extra_pad=3))
    assert torch.equal(first, padded)
    greedy, greedy_mask = fresh(engine, do_sample=False).generate(model, ids, mask)
    argmax = TorchGenerator([2], 2, 6, do_sample=False).generate(model, ids, mask)
    assert torch.equal(greedy, argmax[0]) and torch.equal(greedy_mask, argmax[1])


@needs_vllm
def test_other_decodings_share_the_engine_and_leave_the_rollout_draws_alone(engine):
    """with_decoding (the in-run evaluations, ReMax's greedy baseline): greedy is the argmax, a
    sampled one draws from its own seed, and neither moves the rollouts' draw count, log-probs or
    sync time, which a resume restores."""
    model, _ = tiny_llama()
    ids, mask = prompts(8)
    engine = fresh(engine)
    rollout, _ = engine.generate(model, ids, mask)
    logprobs, sync = engine.last_logprobs, engine.last_sync_seconds
    greedy = engine.with_decoding(do_sample=False).generate(model, ids, mask)
    argmax = TorchGenerator([2], 2, 6, do_sample=False).generate(model, ids, mask)
    assert torch.equal(greedy[0], argmax[0]) and torch.equal(greedy[1], argmax[1])
    sampled = engine.with_decoding(do_sample=True, temperature=TEMPERATURE, seed=5).generate(model, ids, mask)
    again = engine.with_decoding(do_sample=True, temperature=TEMPERATURE, seed=5).generate(model, ids, mask)
    other = engine.with_decoding(do_sample=True, temperature=TEMPERATURE, seed=6).generate(model, ids, mask)
    assert torch.equal(sampled[0], again[0]) and not torch.equal(sampled[0], other[0])
    assert engine.rng.draws == 1 and engine.last_logprobs is logprobs and engine.last_sync_seconds == sync
    engine.rng.set_state(torch.tensor([0]))
    assert torch.equal(engine.generate(model, ids, mask)[0], rollout)


@needs_vllm
def test_tied_embeddings_receive_their_updates():
    """A model whose output layer is its input embedding (SmolLM2, Qwen2 small): the engine built
    from it follows an update of the shared matrix."""
    model, _ = tiny_llama(tied=True)
    engine = engine_for(model, max_rows=8)  # closes the module's engine: one per process (the tests above used it)
    ids, mask = prompts(8)
    optimizer_steps(model, list(model.parameters()), 2)
    responses, response_mask = engine.generate(model, ids, mask)
    gap = (trainer_logprobs(model, ids, mask, responses, response_mask) - engine.last_logprobs).abs().max().item()
    assert gap < LOGPROB_TOLERANCE, gap


@needs_vllm
def test_a_prompt_longer_than_a_kv_block_is_continued_from_the_weights_of_now():
    """vLLM caches the keys and values of every full KV block of a prompt (128 tokens on the CPU, 16
    on a GPU) and reuses them for the next prompt that starts alike; its weight reload leaves that
    cache alone.  Without emptying it after each sync, prompts of 200 tokens were continued from
    keys and values of the weights before the update: the engine's log-probs were 5.3 and then 31.8
    away from the trainer's after the first and second update (1e-5 before any)."""
    model, _ = tiny_llama(positions=512)
    engine = engine_for(model, max_model_len=300, max_rows=8)  # one engine per process: the one before closes
    ids, mask = (torch.arange(200) % 200 + 10).repeat(4, 1), torch.ones(4, 200, dtype=torch.long)
    for update in range(3):
        optimizer_steps(model, list(model.parameters()), 2)
        responses, response_mask = engine.generate(model, ids, mask)
        gap = (trainer_logprobs(model, ids, mask, responses, response_mask) - engine.last_logprobs).abs().max().item()
        assert gap < LOGPROB_TOLERANCE, (update, gap)


@needs_vllm
def test_a_sync_that_loads_nothing_stops_at_the_probe():
    """The probe after each sync (check_weights): the engine's log-probs of the first prompt against
    the actor's.  A reload that silently loaded nothing leaves the engine on the weights before the
    update, and the next rollout stops, naming the gap; while the weights agree the gap is round-off."""
    from ppo_rlhf.rollout.generation import EngineWeightsError

    model, _ = tiny_llama()
    engine = engine_for(model, max_rows=8)
    ids, mask = prompts(8)
    engine.generate(model, ids, mask)
    assert engine.probe_ids == [10, 11, 12]  # the first prompt of the engine's first call
    assert engine.last_probe["rollout/probe_gap"] < 1e-5 and engine.last_probe["time/engine_probe"] > 0
    optimizer_steps(model, list(model.parameters()), 2)
    reload = engine.llm.collective_rpc
    engine.llm.collective_rpc = lambda *args, **kwargs: None  # the sync reaches nothing
    try:
        with pytest.raises(EngineWeightsError, match="does not hold the actor's weights: after weight sync 2 .* "
                                                     "past the tolerance 0.001"):
            engine.generate(model, ids, mask)
    finally:
        engine.llm.collective_rpc = reload
    engine.generate(model, ids, mask)  # loaded for real: the probe passes again
    assert engine.last_probe["rollout/probe_gap"] < 1e-5


@needs_vllm
def test_prompts_longer_than_one_prefill_step_are_sampled():
    """1,024 seeded rows of 12-token prompts (12,288 prompt tokens, over vLLM's default step budget
    of 4,096 on the CPU, where a prefill split over steps failed: 'CPU Generator does not use
    offset'): every row gets its response."""
    model, _ = tiny_llama()
    engine = engine_for(model, max_rows=1024, max_model_len=20)  # all rows at once; closes the engine before it
    rows = 1024
    ids = (torch.arange(12)[None, :] + torch.arange(rows)[:, None]) % 50 + 10
    responses, response_mask = engine.generate(model, ids, torch.ones_like(ids))
    assert responses.shape[0] == rows and bool((response_mask.sum(dim=1) > 0).all())


# ------------------------------------------------------------ bad input, said at start
@needs_vllm
def test_refused_head_size_architecture_and_kv_cache_are_said_at_start():
    with pytest.raises(ConfigError, match="head size is 16"):
        engine_for(tiny_llama(head_dim=16)[0])
    gpt1 = AutoModelForCausalLM.from_config(OpenAIGPTConfig(vocab_size=50, n_embd=128, n_head=2, n_layer=1))
    with pytest.raises(ConfigError, match="has no OpenAIGPTLMHeadModel"):
        engine_for(gpt1)
    with pytest.raises(ConfigError, match="cannot hold one 64-token sequence"):
        engine_for(tiny_llama()[0], memory_utilization=1e-9)


def test_the_weight_probe_compares_the_engines_logprobs_with_the_actors():
    """check_weights on a stand-in for the probe request's output, its prompt log-probs from a model
    of its own: the actor's weights pass (gap 0), another model's stop the run naming the gap and
    the tolerance.  (Runs without vLLM; the real engine's probe is tested above.)"""
    from types import SimpleNamespace

    from ppo_rlhf.rollout.generation import EngineWeightsError
    from ppo_rlhf.rollout.vllm_engine import VLLMGenerator

    def probe_output(model, ids):
        """The output of a request with prompt_logprobs=0: None, then {token: Logprob} per later position."""
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1], dim=-1)
        return SimpleNamespace(prompt_logprobs=[None] + [{token: SimpleNamespace(logprob=logprobs[i, token].item())}
                                                         for i, token in enumerate(ids[1:])])

    actor, other = tiny_llama()[0], tiny_llama(seed=1)[0]
    engine = object.__new__(VLLMGenerator)  # the probe's state only: no vLLM behind it
    engine.probe_ids, engine.syncs, engine.given_tolerance, engine.dtype = [1, 10, 11, 12, 13], 3, None, torch.float32
    assert engine.check_weights(actor, probe_output(actor, engine.probe_ids))["rollout/probe_gap"] < 1e-6
    with pytest.raises(EngineWeightsError, match="after weight sync 3 its log-probs of the probe sequence "
                                                 "\\(4 positions\\) differ .* past the tolerance 0.001"):
        engine.check_weights(actor, probe_output(other, engine.probe_ids))


# ------------------------------------------------------------ models stored in bf16 (issue 45)
def bf16_lora_actor(seed: int = 0, targets=("q_proj", "v_proj", "up_proj")):
    """A tiny Llama stored in bf16 with a policy adapter, as the trainer holds it under --lora: the
    frozen base as loaded (bf16), the trained adapter upcast to float32 (hardware.train_in_float32),
    its B drawn small but nonzero (an adapter some updates in)."""
    from peft import LoraConfig, get_peft_model

    from ppo_rlhf.hardware import train_in_float32

    model, _ = tiny_llama(seed=seed)
    model = get_peft_model(model.to(torch.bfloat16), LoraConfig(r=4, target_modules=list(targets)),
                           adapter_name="policy")
    train_in_float32(model, "actor")
    torch.manual_seed(seed + 100)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 1e-4)
    return model


def test_a_16bit_model_is_computed_in_float32_one_module_at_a_time_and_left_as_it_was():
    """computed_in_float32: a bf16 LoRA actor's forward equals that of a float32 copy of its weights
    (what a float32 engine holds) to float32 round-off -- where its own bf16 forward is 1e-2 away --
    and its weights are the same bf16 tensors after, with no hook left behind."""
    import copy

    from ppo_rlhf.rollout.vllm_engine import actor_precision, computed_in_float32

    actor = bf16_lora_actor()
    upcast = copy.deepcopy(actor).float()
    before = {name: p.detach().clone() for name, p in actor.named_parameters()}
    ids = torch.tensor([[1, 10, 11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        exact = torch.log_softmax(upcast(ids).logits.float(), dim=-1)
        own = torch.log_softmax(actor(ids).logits.float(), dim=-1)
        with computed_in_float32(actor):
            lifted = torch.log_softmax(actor(ids).logits, dim=-1)
    assert lifted.dtype == torch.float32 and (lifted - exact).abs().max().item() < 1e-5
    assert (own - exact).abs().max().item() > 1e-3  # bf16's round-off, which the lift removes
    assert actor_precision(actor) == torch.bfloat16
    for name, p in actor.named_parameters():
        assert p.dtype == before[name].dtype and torch.equal(p, before[name]), name
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in actor.modules())


def test_a_lora_delta_is_merged_in_float32_and_rounded_once_to_the_engines_dtype():
    """policy_weights: an update under half a bf16 ulp of its weight reaches a float32 engine (W +
    delta in float32), which the old merge (the delta rounded to bf16 first, then added in bf16)
    lost; a bf16 engine gets the float32 sum rounded once."""
    from ppo_rlhf.rollout.vllm_engine import policy_weights

    actor = bf16_lora_actor()
    layer = actor.base_model.model.model.layers[0].self_attn.q_proj
    weight, delta = layer.base_layer.weight.detach(), layer.get_delta_weight("policy").detach()
    name = "model.layers.0.self_attn.q_proj.weight"
    float32 = dict(policy_weights(actor, torch.float32))
    assert set(float32) == set(dict(policy_weights(actor, torch.bfloat16)))
    assert not any("lora_" in key or "base_layer" in key for key in float32)
    assert float32[name].dtype == torch.float32 and torch.equal(float32[name], weight.float() + delta.float())
    old_merge = weight + delta.to(weight.dtype)
    size = weight.float().abs()  # deltas under a quarter of a bf16 ulp, over a few float32 ulps
    small = (delta.abs() < 0.25 * torch.finfo(torch.bfloat16).eps * size) & \
            (delta.abs() > 4 * torch.finfo(torch.float32).eps * size)
    assert bool(small.any()) and torch.equal(old_merge[small], weight[small])  # lost by the old merge
    assert bool((float32[name][small] != weight.float()[small]).all())  # held in float32
    bf16 = dict(policy_weights(actor, torch.bfloat16))[name]
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, (weight.float() + delta.float()).to(torch.bfloat16))


def test_the_probe_compares_in_the_engines_precision_and_bounds_by_it():
    """The probe's precision and default bound by the two sides: a float32 engine compares in
    float32 whatever the actor computes in (its side lifted), a bf16 engine in bf16; a given
    --vllm-probe-tolerance wins."""
    from ppo_rlhf.rollout.vllm_engine import PROBE_TOLERANCE, VLLMGenerator, probe_precision

    def engine(dtype, given=None):
        generator = object.__new__(VLLMGenerator)  # the probe's state only
        generator.dtype, generator.given_tolerance = dtype, given
        return generator

    bf16_actor, float32_actor = bf16_lora_actor(), tiny_llama()[0]
    assert probe_precision(bf16_actor, torch.float32) == torch.float32
    assert engine(torch.float32).probe_tolerance(bf16_actor) == PROBE_TOLERANCE[torch.float32]
    assert probe_precision(float32_actor, torch.bfloat16) == torch.bfloat16
    assert engine(torch.bfloat16).probe_tolerance(bf16_actor) == PROBE_TOLERANCE[torch.bfloat16]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert probe_precision(float32_actor, torch.bfloat16) == torch.bfloat16
    assert engine(torch.bfloat16, given=0.02).probe_tolerance(bf16_actor) == 0.02
    assert PROBE_TOLERANCE[torch.float32] < PROBE_TOLERANCE[torch.bfloat16]


@needs_vllm
@pytest.mark.parametrize("broken", ["nothing loaded", "wrong model", "stale"])
def test_a_broken_sync_of_a_bf16_lora_actor_stops_at_the_probe(broken):
    """A bf16 base with a float32 adapter and a float32 engine (the default precision): correct
    syncs pass with float32 round-off, and each broken one stops the next rollout -- vLLM's dummy
    weights (a first sync that loaded nothing), another model's weights, and weights four
    optimizer steps old at the trainer's LoRA learning rate (3e-4)."""
    from ppo_rlhf.rollout import vllm_engine
    from ppo_rlhf.rollout.generation import EngineWeightsError
    from ppo_rlhf.trainers.optimizer import adamw

    actor = bf16_lora_actor()
    engine = engine_for(actor, max_rows=8)
    ids, mask = prompts(8)
    reload = engine.llm.collective_rpc

    def one_sync(action):
        if action == "nothing loaded":
            engine.llm.collective_rpc = lambda *args, **kwargs: None
        elif action == "wrong model":
            other = bf16_lora_actor(seed=1)
            engine.llm.collective_rpc = lambda method, kwargs: reload(method, kwargs={
                **kwargs, "weights_iterator": vllm_engine.policy_weights(other, engine.dtype)})
        try:
            engine.generate(actor, ids, mask)
        finally:
            engine.llm.collective_rpc = reload

    if broken == "nothing loaded":
        with pytest.raises(EngineWeightsError, match="after weight sync 1 .* past the tolerance 0.001"):
            one_sync(broken)
        return
    engine.generate(actor, ids, mask)
    assert engine.last_probe["rollout/probe_gap"] < 1e-4  # float32 round-off: the actor's side lifted
    if broken == "stale":
        optimizer = adamw([p for p in actor.parameters() if p.requires_grad], lr=3e-4, weight_decay=0.0)
        for _ in range(4):
            optimizer.zero_grad()
            actor(ids, labels=ids).loss.backward()
            optimizer.step()
        broken = "nothing loaded"  # the sync after the updates reaches nothing
    with pytest.raises(EngineWeightsError, match="after weight sync 2 .* past the tolerance 0.001"):
        one_sync(broken)
    engine.generate(actor, ids, mask)  # a correct sync passes again
    assert engine.last_probe["rollout/probe_gap"] < 1e-4


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: the refusal is for a machine without it")
def test_without_vllm_the_engine_is_refused_at_start_saying_how_to_install(tmp_path, capsys):
    for command in (["ppo", "--task", "doubling", "--model", tmp_path / "none", "--out", tmp_path / "ppo"],
                    ["eval", "--task", "doubling", "--model", tmp_path / "none"]):
        error = run_failing([*command, "--rollout-engine", "vllm", *THREADS], capsys)
        assert "vLLM is not installed" in error and 'pip install -e ".[vllm]"' in error, error


# ------------------------------------------------------------ whole runs
@pytest.fixture(scope="module")
def vllm_sft_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm_sft") / "run"
    run(["sft", "--task", "doubling", "--steps", 4, "--batch-size", 16, "--eval-every", 0, "--out", out, *VLLM_TINY])
    return out / "checkpoints" / "sft"


def vllm_ppo(model: Path, out: Path, *extra) -> list:
    return ["ppo", "--task", "doubling", "--model", model, "--out", out, "--rollout-engine", "vllm",
            "--vllm-memory-utilization", 0.01, "--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward",
            "--batch-size", 8, "--mini-batch-size", 8, "--ppo-epochs", 1, "--max-new-tokens", 7, "--max-length", 19,
            "--eval-every", 0, "--eval-size", 16, "--no-eval-sampled", "--lr", 1e-3, *THREADS, *extra]


@needs_vllm
def test_ppo_with_the_vllm_engine_trains_logs_and_resumes_as_a_straight_run(vllm_sft_model, tmp_path):
    """Three iterations straight, and one then a resume to three: the same actor (the same rollouts
    drawn after the resume); the engine's metrics logged, its log-probs the trainer's."""
    from ppo_rlhf.runlog import read_metrics

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(vllm_ppo(vllm_sft_model, straight, "--iterations", 3, "--save-every", 1))
    records = [r for r in read_metrics(straight / "metrics.jsonl") if r["step"] > 0]
    assert len(records) == 3
    for record in records:
        assert record["time/weight_sync"] > 0
        assert record["rollout/logprob_diff_max"] < LOGPROB_TOLERANCE
        assert abs(record["is/weight_mean"] - 1) < 1e-3 and record["is/mismatch_kl"] < 1e-3
        assert record["rollout/probe_gap"] < 1e-5 and record["time/engine_probe"] > 0
    run(vllm_ppo(vllm_sft_model, resumed, "--iterations", 1, "--save-every", 1))
    run(vllm_ppo(vllm_sft_model, resumed, "--iterations", 3, "--save-every", 1, "--resume"))
    same_actor_as_straight_run(straight, resumed, vllm_sft_model)


@needs_vllm
def test_in_run_evaluations_and_remax_use_the_runs_engine(vllm_sft_model, tmp_path):
    """A trainer with the vLLM engine evaluates and takes ReMax's greedy baseline on that engine
    (not the torch loop), and its greedy held-out answers are the torch engine's."""
    from ppo_rlhf.config import build_config
    from ppo_rlhf.rollout.vllm_engine import EngineDecoding
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    evaluations = {}
    for engine in ("torch", "vllm"):
        config = build_config(PPOConfig, {
            "task": "doubling", "model": str(vllm_sft_model), "rollout_engine": engine, "estimator": "remax",
            "vllm_memory_utilization": 0.01, "batch_size": 8, "mini_batch_size": 8, "max_new_tokens": 7,
            "max_length": 19, "eval_size": 16, "out": str(tmp_path / engine), "num_threads": 1})
        trainer = PPOTrainer(config)
        if engine == "vllm":
            assert isinstance(trainer.greedy_generator, EngineDecoding)
            assert trainer.greedy_generator.engine is trainer.generator
            assert isinstance(trainer.decoding(do_sample=True, seed=3), EngineDecoding)
        trainer.evaluator = trainer.make_evaluator(trainer.prompt_rows()[1])
        evaluations[engine] = trainer.evaluate(sampled=True)
    (torch_metrics, torch_samples), (vllm_metrics, vllm_samples) = evaluations["torch"], evaluations["vllm"]
    assert vllm_samples == torch_samples
    assert vllm_metrics["eval/exact_match"] == torch_metrics["eval/exact_match"]
    assert "eval_sampled/exact_match" in vllm_metrics


@needs_vllm
def test_eval_with_the_vllm_engine_answers_as_the_torch_engine(vllm_sft_model, tmp_path):
    """Greedy answers are the argmax either way: the same held-out metrics."""
    summaries = {}
    for engine in ("torch", "vllm"):
        run(["eval", "--task", "doubling", "--model", vllm_sft_model, "--size", 32, "--max-new-tokens", 7,
             "--max-length", 19, "--rollout-engine", engine, "--vllm-memory-utilization", 0.01,
             "--out", tmp_path / engine, *THREADS])
        summaries[engine] = json.loads((tmp_path / engine / "summary.json").read_text())
    assert summaries["vllm"]["samples"] == summaries["torch"]["samples"]
    assert summaries["vllm"]["exact_match"] == summaries["torch"]["exact_match"]


def chatml_model(folder: Path) -> Path:
    """A tiny Qwen2 (ChatML turn tokens and a chat template) whose heads vLLM's CPU attention takes, saved."""
    from transformers import Qwen2Config

    tokenizer = make_tokenizer("qwen2")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@needs_vllm
def test_episodes_on_the_engine_receive_the_weights_once_per_rollout(tmp_path, monkeypatch):
    """Multi-turn episodes (docs/agents.md) on the engine: each episode's turn its own request
    (continuous batching), the actor's weights synced once for all of a rollout's turns, the probe
    checked once; the engine's log-probs on the model's tokens."""
    from ppo_rlhf.rollout import vllm_engine
    from ppo_rlhf.runlog import read_metrics
    from zoo import PROMPTS, write_jsonl

    chatml_model(tmp_path / "model")
    syncs, turns, probes = [], [], []
    sync, add, check = (vllm_engine.VLLMGenerator.sync_weights, vllm_engine.EngineRequests.add,
                        vllm_engine.VLLMGenerator.check_weights)
    monkeypatch.setattr(vllm_engine.VLLMGenerator, "sync_weights", lambda self, model: syncs.append(1) or sync(self, model))
    monkeypatch.setattr(vllm_engine.EngineRequests, "add", lambda self, *args: turns.append(args[:2]) or add(self, *args))
    monkeypatch.setattr(vllm_engine.VLLMGenerator, "check_weights",
                        lambda self, *args: probes.append(1) or check(self, *args))
    run(["ppo", "--model", tmp_path / "model", "--prompts", write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in
                                                                                            PROMPTS]),
         "--environment", f"{Path(__file__).parent / 'toy_envs.py'}:LetterGame", "--rollout-engine", "vllm",
         "--vllm-memory-utilization", 0.01, "--estimator", "grpo", "--samples-per-prompt", 2, "--batch-size", 4,
         "--mini-batch-size", 4, "--ppo-epochs", 1, "--max-new-tokens", 6, "--max-length", 128, "--iterations", 2,
         "--eval-every", 0, "--save-every", 0, "--out", tmp_path / "run", *THREADS])
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    # two rollouts of 4 episodes of two turns: 16 requests, each (row, turn) once a rollout; one sync and one probe each
    assert last["episode/turns"] == 2.0 and sorted(turns) == sorted([(r, t) for r in range(4) for t in (0, 1)] * 2)
    assert len(syncs) == 2 and len(probes) == 2 and last["rollout/probe_gap"] < 1e-5
    assert last["rollout/logprob_diff_max"] < LOGPROB_TOLERANCE  # read on the model's tokens only


def vllm_episodes(folder: Path, source, rows: int = 4, seeds=None, max_turns: int = 3):
    """``rows`` episodes of ``source`` rolled out on a vLLM engine, sampled."""
    from transformers import AutoTokenizer

    from ppo_rlhf.rollout.episodes import EpisodeLimits, roll_out
    from ppo_rlhf.rollout.vllm_engine import VLLMGenerator

    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    generator = VLLMGenerator(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, 6, do_sample=True,
                              temperature=TEMPERATURE, seed=3, max_model_len=128, memory_utilization=0.01, max_rows=8)
    rows = [{"prompt": f"play {i}", "id": i, "_source": f"rows.jsonl:{i + 1}"} for i in range(rows)]
    try:
        return roll_out(model, tokenizer, generator, rows, [row["prompt"] for row in rows],
                        EpisodeLimits(64, 128, max_turns=max_turns, chat_template=True), source,
                        seeds or [0] * len(rows))
    finally:
        generator.close()


@needs_vllm
def test_episodes_on_the_engine_never_wait_for_each_other(tmp_path, monkeypatch):
    """Each episode's next turn goes to the engine as soon as its own environment has answered: the
    first row's first step waits until every other episode has played all its turns and ended --
    which, were the episodes batched turn by turn, they never could (its wait would run out)."""
    import toy_envs
    from ppo_rlhf.envs import environment_source

    monkeypatch.setattr(toy_envs.WaitsForTheOthers, "state", toy_envs.WaitState(others=3))
    episodes = vllm_episodes(chatml_model(tmp_path / "model"), environment_source(toy_envs.WaitsForTheOthers))
    state = toy_envs.WaitsForTheOthers.state
    assert state.waited_for_the_others  # the others ended while the first row's environment was still answering
    assert sorted(state.order) == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3 and state.order[-2:] == [0, 0]
    assert episodes.turns == [3, 3, 3, 3] and episodes.engine_logprobs is not None


@needs_vllm
def test_what_episodes_sample_on_the_engine_never_depends_on_when_their_turns_were_asked(tmp_path, monkeypatch):
    """Each request's seed is its own (run seed, process, draw, row, turn): episodes whose
    environments answer after random waits, one call at a time or eight, sample the same tokens."""
    import toy_envs
    from ppo_rlhf.envs import environment_source

    folder = chatml_model(tmp_path / "model")
    runs = []
    for workers, delay_seed in ((1, 0), (8, 1)):
        monkeypatch.setattr(toy_envs.SleepsAtRandom, "delays", __import__("random").Random(delay_seed))
        source = environment_source(toy_envs.SleepsAtRandom, env_workers=workers)
        runs.append(vllm_episodes(folder, source, rows=6, seeds=[5, 5, 6, 6, 7, 7]))
    one, eight = runs
    assert torch.equal(one.sequences.response_ids, eight.sequences.response_ids)
    assert torch.equal(one.sequences.loss_mask, eight.sequences.loss_mask) and one.step_rewards == eight.step_rewards
    # the batches the engine ran differed: its log-probs may differ by round-off (docs/design.md)
    assert torch.allclose(one.engine_logprobs, eight.engine_logprobs, atol=1e-4)


def launched_twice(args: list, what: str, timeout: int = 300) -> None:
    """``ppo-rlhf`` with ``args`` in two processes (torchrun, gloo), one thread each; fails saying
    ``what`` never finished if they do not end within ``timeout`` seconds (both killed)."""
    import subprocess
    import sys

    from zoo import free_port, launched

    try:
        done = launched([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                         f"--master_port={free_port()}", "-m", "ppo_rlhf.cli", *map(str, args)], timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} never finished")
    assert done.returncode == 0, done.stderr[-3000:]


@needs_vllm
def test_two_processes_whose_episodes_end_apart_step_their_engines_together(tmp_path):
    """Two processes with the engine, the second's episodes ending after one turn and the first's
    after three: vLLM's data parallel coordinates every forward across the engines, so they step
    together until every process's episodes have ended.  (Turn by turn, the second stopped calling
    its engine while the first asked its own for more, and both waited for each other for ever.)"""
    from zoo import PROMPTS, write_jsonl

    chatml_model(tmp_path / "model")
    launched_twice(["ppo", "--model", tmp_path / "model", "--prompts",
                    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS]),
                    "--environment", f"{Path(__file__).parent / 'toy_envs.py'}:ShortOnTheSecondProcess",
                    "--rollout-engine", "vllm", "--vllm-memory-utilization", 0.01, "--estimator", "reinforce++",
                    "--batch-size", 4, "--mini-batch-size", 4, "--ppo-epochs", 1, "--max-new-tokens", 6,
                    "--max-length", 128, "--iterations", 2, "--save-rollouts", 1, "--eval-every", 0, "--save-every",
                    0, "--out", tmp_path / "two", *THREADS], "two processes whose episodes ended apart")
    records = [json.loads(line) for line in (tmp_path / "two" / "rollouts" / "iteration_0002.jsonl").open()]
    assert [record["turns"] for record in records] == [3, 3, 1, 1]


@needs_vllm
@pytest.mark.parametrize("slow", ["get_reward", "reward function", "tool"])
def test_two_processes_finish_when_one_of_them_waits_on_its_environment(tmp_path, slow):
    """Two processes with the engine, a TRL class with one tool, the first process's episodes
    playing three turns and the second's one; in the first process only, the environment's
    get_reward(), the run's reward function or the tool takes half a second.  Every process serves
    until no process has an episode running -- one reading its reward included -- and all leave
    the serving loop in the same round.  (With get_reward slow, the first process asked the others
    once more whether anyone was playing while they had moved on to the probe's collective, and
    both waited for ever.)"""
    from ppo_rlhf.envs.options import tool_template_path
    from zoo import PROMPTS, write_jsonl

    tool_model(tmp_path / "model")
    envs = Path(__file__).parent / "toy_envs.py"
    environment = {"get_reward": "SlowRewardOnTheFirstProcess", "tool": "SlowToolOnTheFirstProcess"}.get(slow, "Counter")
    reward = ["--reward-fn", f"{envs}:slow_reward_on_the_first_process"] if slow == "reward function" else []
    launched_twice(["ppo", "--model", tmp_path / "model", "--prompts",
                    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "target": 2} for p in PROMPTS]),
                    "--environment", f"{envs}:{environment}", *reward,
                    "--tool-parser", f"{envs}:calls_increment_on_the_first_process", "--max-turns", 3,
                    "--chat-template-file", tool_template_path(), "--rollout-engine", "vllm",
                    "--vllm-memory-utilization", 0.01, "--estimator", "reinforce++", "--batch-size", 4,
                    "--mini-batch-size", 4, "--ppo-epochs", 1, "--max-new-tokens", 6, "--max-length", 768,
                    "--iterations", 2, "--save-rollouts", 1, "--eval-every", 0, "--save-every", 0,
                    "--out", tmp_path / "two", *THREADS], f"two processes, one with a slow {slow},")
    records = [json.loads(line) for line in (tmp_path / "two" / "rollouts" / "iteration_0002.jsonl").open()]
    assert [record["turns"] for record in records] == [3, 3, 1, 1]


@needs_vllm
def test_two_processes_evaluate_a_held_out_set_smaller_than_the_launch(tmp_path):
    """One held-out prompt, two processes with the engine: the second process has no prompt of its
    own to answer, and still calls its engine as often as the first (each call a collective of
    vLLM's data parallel), on a prompt whose answer it drops; the metrics are the one prompt's."""
    from ppo_rlhf.runlog import read_metrics
    from zoo import PROMPTS, write_jsonl

    chatml_model(tmp_path / "model")
    launched_twice(["ppo", "--model", tmp_path / "model", "--prompts",
                    write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS]),
                    "--eval-prompts", write_jsonl(tmp_path / "held_out.jsonl", [{"prompt": PROMPTS[0]}]),
                    "--reward-fn", f"{Path(__file__).parent / 'toy_envs.py'}:slow_reward_on_the_first_process",
                    "--rollout-engine", "vllm", "--vllm-memory-utilization", 0.01, "--estimator", "reinforce++",
                    "--batch-size", 4, "--mini-batch-size", 4, "--ppo-epochs", 1, "--max-new-tokens", 6,
                    "--max-length", 128, "--iterations", 1, "--eval-every", 1, "--save-every", 0,
                    "--out", tmp_path / "two", *THREADS], "two processes evaluating one held-out prompt")
    evaluated = [record for record in read_metrics(tmp_path / "two" / "metrics.jsonl") if "eval/score" in record]
    assert evaluated and all(record["eval/response_length"] <= 6 for record in evaluated)


def tool_model(folder: Path, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny Qwen2 with room for the tool template's prompt (about 455 tokens), saved in ``dtype``."""
    from transformers import Qwen2Config

    tokenizer = make_tokenizer("qwen2")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def vllm_sft_model_bf16(vllm_sft_model, tmp_path_factory):
    """The SFT model saved again in bf16, as most hub checkpoints are stored."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("vllm_sft_bf16")
    AutoModelForCausalLM.from_pretrained(vllm_sft_model, dtype=torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(vllm_sft_model).save_pretrained(folder)
    return folder


@needs_vllm
@pytest.mark.parametrize("case", ["full", "lora", "lora grpo", "lora bf16"])
def test_a_model_stored_in_bf16_trains_past_the_probe(vllm_sft_model_bf16, tmp_path, case):
    """A bf16 checkpoint at the default precision: trained in full (upcast to float32) or with
    --lora (its base kept in bf16, read by a float32 engine: the probe compares in float32, the
    actor's side lifted, where a bf16-level gap of 1e-2 stopped the first sync), with PPO's critic
    or GRPO; and under --mixed-precision bf16 (a bf16 engine, its own bound).  Every sync passes
    the probe, with float32 round-off where the engine is float32."""
    from ppo_rlhf.rollout.vllm_engine import PROBE_TOLERANCE
    from ppo_rlhf.runlog import read_metrics

    extra = {"full": [], "lora": ["--lora"], "lora grpo": ["--lora", "--estimator", "grpo", "--samples-per-prompt", 4],
             "lora bf16": ["--lora", "--mixed-precision", "bf16"]}[case]
    run(vllm_ppo(vllm_sft_model_bf16, tmp_path / "run", "--iterations", 3, *extra))
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    bound = PROBE_TOLERANCE[torch.bfloat16] if case == "lora bf16" else 1e-4
    assert len(records) == 3 and all(r["rollout/probe_gap"] < bound for r in records), records


@needs_vllm
def test_an_episode_with_a_tool_on_a_bf16_model_passes_the_probe(tmp_path):
    """A TRL environment class with a tool, played on a ChatML model stored in bf16 with --lora: the
    engine receives the merged weights once per rollout and the probe passes in float32."""
    from ppo_rlhf.envs.options import tool_template_path
    from ppo_rlhf.runlog import read_metrics
    from zoo import PROMPTS, write_jsonl

    tool_model(tmp_path / "model", torch.bfloat16)
    envs = Path(__file__).parent / "toy_envs.py"
    run(["ppo", "--model", tmp_path / "model", "--lora", "--prompts",
         write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "target": 2} for p in PROMPTS]),
         "--environment", f"{envs}:Counter", "--tool-parser", f"{envs}:calls_increment", "--max-turns", 2,
         "--chat-template-file", tool_template_path(), "--rollout-engine", "vllm", "--vllm-memory-utilization", 0.01,
         "--estimator", "grpo", "--samples-per-prompt", 2, "--batch-size", 4, "--mini-batch-size", 4,
         "--ppo-epochs", 1, "--max-new-tokens", 6, "--max-length", 512, "--iterations", 2, "--eval-every", 0,
         "--save-every", 0, "--out", tmp_path / "run", *THREADS])  # the tools listed: a 455-token prompt, kept whole
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert all(r["tools/calls"] > 0 and r["rollout/probe_gap"] < 1e-4 for r in records), records


@needs_vllm
def test_eval_of_a_bf16_checkpoint_kept_in_bf16_passes_the_probe(vllm_sft_model_bf16, tmp_path):
    """eval --dtype auto keeps a bf16 checkpoint in bf16, and the float32 engine's probe compares in
    float32 (it stopped at 1.6e-3 against 1e-3); greedy answers are the torch engine's."""
    summaries = {}
    for engine in ("torch", "vllm"):
        run(["eval", "--task", "doubling", "--model", vllm_sft_model_bf16, "--size", 32, "--max-new-tokens", 7,
             "--max-length", 19, "--rollout-engine", engine, "--vllm-memory-utilization", 0.01,
             "--out", tmp_path / engine, *THREADS])
        summaries[engine] = json.loads((tmp_path / engine / "summary.json").read_text())
    assert summaries["vllm"]["exact_match"] == pytest.approx(summaries["torch"]["exact_match"], abs=0.07)


@needs_vllm
@pytest.mark.parametrize("launch", ["torchrun", "fsdp"])
def test_two_gloo_processes_each_with_its_engine_train_like_one(vllm_sft_model, tmp_path, launch):
    """2 processes: each builds its own engine (vLLM's external launcher, data parallel) and rolls
    out its own rows; greedy rollouts, so the final actor equals one process's.  torchrun: data
    parallel; fsdp: the actor sharded (accelerate's FSDP config), its whole weights gathered for
    each rollout and sent to each process's engine; in-run evaluations on the engines too."""
    import sys

    from safetensors.torch import load_file

    from test_multiprocess import difference_outside_key_bias, launch_fsdp
    from zoo import free_port, launched

    args = ["--no-do-sample", "--iterations", 3, "--mini-batch-size", 4, "--ppo-epochs", 2, "--eval-every", 1]
    run(vllm_ppo(vllm_sft_model, tmp_path / "one", *args))
    if launch == "fsdp":
        done = launch_fsdp(vllm_ppo(vllm_sft_model, tmp_path / "two", *args), timeout=600)
        assert "sharded (FSDP): actor and reference split over the 2 processes" in done.stdout, done.stdout[-2000:]
    else:
        done = launched([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                         f"--master_port={free_port()}", "-m", "ppo_rlhf.cli",
                         *map(str, vllm_ppo(vllm_sft_model, tmp_path / "two", *args))], 600)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = (load_file(str(tmp_path / name / "checkpoints" / "actor" / "model.safetensors")) for name in ("one", "two"))
    start = load_file(str(vllm_sft_model / "model.safetensors"))
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-4  # it trained
    # GPT-2's attention key bias left out: its gradient is round-off, which Adam turns into steps of
    # about lr in any run (tests/test_multiprocess.py, difference_outside_key_bias).
    assert max(difference_outside_key_bias(one[k], two[k], k) for k in one) <= 1e-5
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("one", "two")]
    assert summaries[1]["after"]["eval/exact_match"] == pytest.approx(summaries[0]["after"]["eval/exact_match"])


@needs_vllm
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PPO_RLHF_VLLM_LEARNING"),
                    reason="one seed is not a verdict (8 minutes a run): set PPO_RLHF_VLLM_LEARNING=1 to run it")
def test_the_built_in_task_learns_as_well_with_the_vllm_engine(tmp_path):
    """The built-in task's SFT preset (2 heads of 32: vLLM's CPU attention refuses the default's
    16), then the critic-free learning test's recipe (grpo, 16 prompts x 4 samples, 80 iterations;
    tests/test_learning.py) with each engine: both pass that test's bar, within 0.15 of each
    other (the engines draw different samples, so the curves agree in distribution only).

    Measured once (seed 0, 2026-11-25 on 2 shared cores): exact match torch 0.906, vllm 0.588,
    the training score alike for 40 iterations (0.58 -> 0.66 both) and apart after; the engine's
    log-probs within 1.7e-5 of the trainer's and every TIS weight 1, so the samples come from the
    trainer's distribution and the gap is one draw of the sampling noise -- or not: it needs
    several seeds of each engine (DEVELOPERS.md: one run's curve moves by tens of iterations on
    round-off alone), which is why this test runs on demand.  Six seeds of each (the retired
    bench_engine_learning.py, docs/benchmarks.md): torch 0.850 (0.700-0.970), vllm 0.736 (0.558-0.882),
    not shown to differ (Welch p = 0.14); this test's 0.15 bar fails on some seeds of either."""
    from ppo_rlhf.config import build_config
    from ppo_rlhf.stages.demo import SFT_PRESET
    from ppo_rlhf.stages.ppo import run_ppo
    from ppo_rlhf.stages.sft import run_sft
    from ppo_rlhf.trainers.ppo_config import PPOConfig
    from ppo_rlhf.trainers.sft import SFTConfig
    from test_learning import ESTIMATOR_PRESET

    sft = run_sft(build_config(SFTConfig, {**SFT_PRESET, "n_head": 2, "eval_every": 0, "out": str(tmp_path / "sft"),
                                           "num_threads": 1}))
    after = {}
    for engine in ("torch", "vllm"):
        values = {**ESTIMATOR_PRESET, "estimator": "grpo", "samples_per_prompt": 4, "rollout_engine": engine,
                  "vllm_memory_utilization": 0.01, "model": sft["checkpoints"]["sft"], "out": str(tmp_path / engine),
                  "eval_every": 0, "eval_size": 500, "eval_sampled": False, "num_threads": 1}
        summary = run_ppo(build_config(PPOConfig, values))
        assert summary["before"]["eval/exact_match"] <= 0.45
        after[engine] = summary["after"]["eval/exact_match"]
    print(f"exact match after PPO: {after}")
    assert min(after.values()) >= 0.8, after
    assert abs(after["vllm"] - after["torch"]) <= 0.15, after
