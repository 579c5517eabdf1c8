"""Long, uneven responses (docs/design.md, "Long responses"): padding-free passes and the fused
output layer give the padded pass's log-probs, entropies, hidden states and gradients on every
architecture of the zoo; the plan falls back where a model differs; token-budget micro-batches
keep the minibatch's gradient."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.core import full_kl
from ppo_rlhf.models.loading import base_of, enable_activation_checkpointing
from ppo_rlhf.models.lora import LoraOptions, with_adapter
from ppo_rlhf.models.value import ValueHead
from ppo_rlhf.rollout.output_layer import KEPT_LOGITS_BYTES, OutputHead, chunk_positions, full_kl_stats, token_stats
from ppo_rlhf.rollout.packing import first_fit_bins, pack
from ppo_rlhf.rollout.passes import CHECK_ROWS, PassPlan, checked_plan, response_stats, rows_to_check
from ppo_rlhf.rollout.sequences import Sequences
from ppo_rlhf.trainers.ppo import PPOTrainer, token_micro_batches
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import PROMPTS, REWARDS_MODULE, make_config, make_tokenizer

ARCHS = ["gpt2", "llama", "qwen2", "granite", "gemma", "cohere", "gemma2"]  # the last two: logit scale, softcap
OWN = PassPlan(temperature=0.7)
FUSED = dataclasses.replace(OWN, fused=True)
PACKED = dataclasses.replace(OWN, fused=True, pack=True)


def uneven_batch(vocab: int, pad: int, seed: int = 1) -> Sequences:
    """Six rows: left-padded prompts of 3-7 tokens (two rows share one), responses of 1-9 tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, vocab, (6, 7), generator=generator)
    prompt_mask = torch.ones(6, 7, dtype=torch.long)
    for row, padding in enumerate([0, 2, 3, 0, 1, 4]):
        prompt_mask[row, :padding] = 0
        prompt_ids[row, :padding] = pad
    prompt_ids[3], prompt_mask[3] = prompt_ids[0], prompt_mask[0]
    response_ids = torch.randint(3, vocab, (6, 9), generator=generator)
    response_mask = (torch.arange(9)[None, :] < torch.tensor([9, 3, 5, 1, 7, 2])[:, None]).long()
    return Sequences(prompt_ids, prompt_mask, torch.where(response_mask.bool(), response_ids, pad), response_mask)


def tiny(arch: str):
    """A tiny random model, in eval mode (GPT-2's dropout would make two passes differ)."""
    tokenizer = make_tokenizer(arch)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(arch, tokenizer)).eval(), tokenizer


def test_rows_go_first_fit_by_decreasing_length_into_bins_as_long_as_the_longest():
    assert first_fit_bins([16, 8, 9, 8, 13, 5], capacity=16) == [[0], [4], [2, 5], [1, 3]]


def test_a_packed_batch_restarts_positions_at_each_row_and_reads_each_response_back_in_place():
    sequences = Sequences(torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]),
                          torch.tensor([[10, 11, 0], [12, 0, 0]]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    packed = pack(sequences, pad_token_id=0)
    # Row 0: 5 6 10 11 (4 tokens), row 1: 7 8 9 12 (4): one bin each (capacity 4, both full).
    assert packed.input_ids.tolist() == [[5, 6, 10, 11], [7, 8, 9, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    # Response token t of a row is predicted at prompt_length - 1 + t of its place.
    assert packed.source.tolist() == [[1, 2, 0], [6, 0, 0]]
    short = Sequences(torch.tensor([[5, 6], [7, 8]]), torch.ones(2, 2, dtype=torch.long), torch.tensor([[1, 2, 3], [4, 0, 0]]),
                      torch.tensor([[1, 1, 1], [1, 0, 0]]))
    packed = pack(short, pad_token_id=0)  # 5 and 3 tokens: one bin of 5, one of 3 padded to 5
    assert packed.input_ids.tolist() == [[5, 6, 1, 2, 3], [7, 8, 4, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]  # the padding: a sequence of its own


@pytest.mark.parametrize("seed", range(5))
def test_each_row_sits_whole_in_its_bin_with_positions_from_zero(seed):
    """Uneven random batches against the definition, row by row: the row's real tokens in order
    at one place of one bin, positions 0.. there, each response token read back one place earlier."""
    sequences = uneven_batch(vocab=50, pad=0, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    sequences.response_mask[:] = (torch.arange(9)[None, :] < torch.randint(1, 10, (6, 1), generator=generator)).long()
    packed = pack(sequences, pad_token_id=0)
    flat_ids, flat_positions = packed.input_ids.reshape(-1), packed.position_ids.reshape(-1)
    placed = torch.zeros(flat_ids.shape, dtype=torch.bool)
    for row in range(6):
        tokens = torch.cat([sequences.prompt_ids[row][sequences.prompt_mask[row].bool()],
                            sequences.response_ids[row][sequences.response_mask[row].bool()]])
        prompt_length = int(sequences.prompt_mask[row].sum())
        start = int(packed.source[row, 0]) - (prompt_length - 1)
        span = slice(start, start + len(tokens))
        assert start // packed.input_ids.shape[1] == (start + len(tokens) - 1) // packed.input_ids.shape[1]
        assert flat_ids[span].tolist() == tokens.tolist()
        assert flat_positions[span].tolist() == list(range(len(tokens)))
        assert not placed[span].any()
        placed[span] = True
        response_length = int(sequences.response_mask[row].sum())
        assert packed.source[row, :response_length].tolist() == list(range(start + prompt_length - 1,
                                                                          start + prompt_length - 1 + response_length))
        assert not packed.source[row, response_length:].any()
    assert (flat_ids[~placed] == 0).all()  # the rest is padding


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("plan", [FUSED, PACKED], ids=["fused", "packed"])
def test_each_layout_gives_the_padded_passs_numbers_and_gradients(arch, plan):
    model, tokenizer = tiny(arch)
    plan = dataclasses.replace(plan, pad_token_id=tokenizer.pad_token_id)
    sequences = uneven_batch(model.config.vocab_size, tokenizer.pad_token_id)
    head = ValueHead(model.config.get_text_config().hidden_size)
    results = []
    for used in (dataclasses.replace(OWN, pad_token_id=tokenizer.pad_token_id), plan):
        model.zero_grad()
        head.zero_grad()
        stats = response_stats(model, sequences, used, entropy=True, entropy_grad=True)
        mask = sequences.response_mask.bool()
        values = head(stats.hidden)  # the critic's trunk: a value head reads the same hidden states
        loss = stats.logprobs[mask].sum() + 0.1 * stats.entropy[mask].sum() + values[mask].pow(2).sum()
        loss.backward()
        results.append((stats.logprobs[mask].detach(), stats.entropy[mask].detach(), values[mask].detach(),
                        [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (logprobs, entropy, values, grads), (plan_logprobs, plan_entropy, plan_values, plan_grads) = results
    assert stats.logits is None  # the plan never held (B, T, V) logits
    torch.testing.assert_close(plan_logprobs, logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plan_entropy, entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(plan_values, values, rtol=1e-5, atol=1e-5)
    assert len(plan_grads) == len(grads) and any(g.abs().max() > 0 for g in grads)
    for got, expected in zip(plan_grads, grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_packing_is_read_from_the_restarting_positions():
    """Without the restart, rows would attend each other: the numbers must then differ, so the
    equality above shows the model took the packed rows apart."""
    model, tokenizer = tiny("llama")
    sequences = uneven_batch(model.config.vocab_size, tokenizer.pad_token_id)
    packed = pack(sequences, tokenizer.pad_token_id)
    continuing = torch.arange(packed.input_ids.shape[1]).expand_as(packed.input_ids)
    with torch.no_grad():
        # use_cache=False, as the passes run: with a cache transformers reads no packing from the positions.
        apart = model.model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                            use_cache=False).last_hidden_state
        together = model.model(input_ids=packed.input_ids, position_ids=continuing, use_cache=False).last_hidden_state
    assert (packed.gather(apart) - packed.gather(together)).abs().max() > 1e-3


def test_a_packed_pass_says_nothing_of_a_missing_attention_mask():
    """The packed pass has no attention mask on purpose (a mask of ones would join a bin's rows into
    one sequence: the numbers change); transformers' warning that the input may be padded, which
    `make demo` printed in the middle of its progress bar, is held back for that pass alone."""
    import logging

    from transformers.utils import logging as transformers_logging

    model, tokenizer = tiny("gpt2")
    sequences = uneven_batch(model.config.vocab_size, tokenizer.pad_token_id)
    packed = pack(sequences, tokenizer.pad_token_id)
    assert tokenizer.pad_token_id in packed.input_ids[:, -1]  # what transformers looks for
    with torch.no_grad():
        apart = model.transformer(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                  use_cache=False).last_hidden_state
        masked = model.transformer(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False,
                                   attention_mask=torch.ones_like(packed.input_ids)).last_hidden_state
    assert (packed.gather(apart) - packed.gather(masked)).abs().max() > 1e-3

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addHandler(handler)
    try:
        logging.Logger.warning_once.cache_clear()  # printed once per process: a test before this one may have
        with torch.no_grad():
            response_stats(model, sequences, dataclasses.replace(PACKED, pad_token_id=tokenizer.pad_token_id))
            assert not [r for r in records if "attention_mask" in r.getMessage()]
            logging.Logger.warning_once.cache_clear()
            model.transformer(input_ids=packed.input_ids, position_ids=packed.position_ids,
                              use_cache=False)  # another pass without a mask is still warned
    finally:
        logger.removeHandler(handler)
    assert [r for r in records if "attention_mask" in r.getMessage()]
    assert transformers_logging.get_verbosity() <= logging.WARNING  # the warning is shown where it is due


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_activation_checkpointing_is_enabled_by_the_name_this_transformers_has(lora):
    model, _ = tiny("llama")
    if lora:
        model = with_adapter(LoraOptions(lora=True), model, "CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the deprecated name warns
        enable_activation_checkpointing(model)
    inner = base_of(model)
    assert inner.is_activation_checkpointing if hasattr(inner, "is_activation_checkpointing") else \
        inner.is_gradient_checkpointing


def test_a_lora_model_and_gradient_checkpointing_through_the_packed_pass():
    model, tokenizer = tiny("llama")
    model = with_adapter(LoraOptions(lora=True), model, "CAUSAL_LM")
    enable_activation_checkpointing(model)
    model.train()
    sequences = uneven_batch(model.config.vocab_size, tokenizer.pad_token_id)
    grads = []
    for plan in (dataclasses.replace(OWN, pad_token_id=tokenizer.pad_token_id),
                 dataclasses.replace(PACKED, pad_token_id=tokenizer.pad_token_id)):
        model.zero_grad()
        stats = response_stats(model, sequences, plan)
        stats.logprobs[sequences.response_mask.bool()].sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    assert any(g.abs().max() > 0 for g in grads[0])
    for got, expected in zip(*grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_a_reference_head_built_without_the_adapters_stays_the_bases():
    from ppo_rlhf.models.lora import adapters_disabled

    model, tokenizer = tiny("llama")  # untied: LoRA adapts its output layer too
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    base_logits = OutputHead(model).logits(hidden)
    model = with_adapter(LoraOptions(lora=True), model, "CAUSAL_LM")
    assert hasattr(model.get_output_embeddings(), "lora_B")
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # a trained adapter: the output layer's logits move
            torch.nn.init.normal_(parameter, std=0.5)
    with adapters_disabled(model):
        ref_head = OutputHead(model)
    # Read after the context closed, as the full KL reads it in the update.
    torch.testing.assert_close(ref_head.logits(hidden), base_logits)
    assert (OutputHead(model).logits(hidden) - base_logits).abs().max() > 1e-2


def test_the_fused_full_kl_is_the_vocabularys():
    model, tokenizer = tiny("granite")  # a logit scale to apply per chunk
    ref, _ = tiny("granite")
    torch.nn.init.normal_(ref.lm_head.weight, std=0.3)
    sequences = uneven_batch(model.config.vocab_size, tokenizer.pad_token_id)
    with torch.no_grad():
        own, ref_own = (response_stats(m, sequences, OWN) for m in (model, ref))
        fused, ref_fused = (response_stats(m, sequences, FUSED) for m in (model, ref))
    mask = sequences.response_mask.bool()
    expected = full_kl(own.logits, ref_own.logits)[mask]
    got = full_kl_stats(fused.head, fused.hidden, ref_fused.head, ref_fused.hidden, sequences.response_mask)[mask]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert expected.abs().max() > 1e-3


def test_chunks_give_the_same_numbers_as_one_pass():
    model, tokenizer = tiny("gemma2")
    sequences = uneven_batch(model.config.vocab_size, tokenizer.pad_token_id)
    with torch.no_grad():
        hidden = response_stats(model, sequences, FUSED).hidden
    head = OutputHead(model, 0.7)
    whole = token_stats(head, hidden, sequences.response_ids, sequences.response_mask, entropy=True)
    chunked = token_stats(head, hidden, sequences.response_ids, sequences.response_mask, entropy=True, chunk=4)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b)


def test_large_passes_recompute_their_chunks_in_the_backward_pass_with_the_same_gradients():
    """A pass with few logits keeps them for the backward pass; past ``keep_bytes`` each chunk is a
    checkpoint that keeps none (recomputed there); the gradients are the same either way."""
    model, tokenizer = tiny("gemma2")
    ref, _ = tiny("gemma2")
    torch.nn.init.normal_(ref.lm_head.weight, std=0.3)
    sequences = uneven_batch(model.config.vocab_size, tokenizer.pad_token_id)
    with torch.no_grad():
        hidden = response_stats(model, sequences, FUSED).hidden
        ref_hidden = response_stats(ref, sequences, FUSED).hidden
    head, ref_head, vocab = OutputHead(model, 0.7), OutputHead(ref, 0.7), model.config.vocab_size
    results = []
    assert not head.recomputes(int(sequences.response_mask.sum()))  # 28 positions of a 64-token vocabulary
    for keep_bytes in (KEPT_LOGITS_BYTES, 0):
        leaf = hidden.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            logprobs, entropies = token_stats(head, leaf, sequences.response_ids, sequences.response_mask,
                                              entropy=True, entropy_grad=True, chunk=4, keep_bytes=keep_bytes)
            kl = full_kl_stats(head, leaf, ref_head, ref_hidden, sequences.response_mask, chunk=4,
                               keep_bytes=keep_bytes)
        loss = logprobs.sum() + 0.1 * entropies.sum() + kl.sum()
        results.append(torch.autograd.grad(loss, leaf)[0])
        holds_logits = any(len(shape) and shape[-1] == vocab for shape in saved)
        assert holds_logits == (keep_bytes > 0), keep_bytes
    torch.testing.assert_close(results[1], results[0])
    assert results[0].abs().max() > 0


def test_a_chunk_is_64_mib_of_float32_logits():
    assert chunk_positions(49152) == 341  # SmolLM2: 2**26 / (4 * 49152) = 341.3
    assert chunk_positions(151936) == 110  # Qwen2: 110.4
    assert chunk_positions(2**30) == 1


def test_the_entropy_as_a_statistic_holds_nothing_for_the_backward_pass_nor_is_recomputed(monkeypatch):
    model, tokenizer = tiny("llama")
    sequences = uneven_batch(model.config.vocab_size, tokenizer.pad_token_id)
    with torch.no_grad():
        hidden = response_stats(model, sequences, FUSED).hidden
    head, tokens, mask = OutputHead(model), sequences.response_ids, sequences.response_mask
    held = {}
    for entropy in (False, True):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            token_stats(head, hidden.clone().requires_grad_(), tokens, mask, entropy=entropy)
        held[entropy] = saved
    assert held[True] == held[False]
    softmax_calls = []
    monkeypatch.setattr(torch, "softmax", lambda *args, **kwargs: softmax_calls.append(1) or torch.exp(
        torch.log_softmax(*args, **kwargs)))
    leaf = hidden.clone().requires_grad_()
    logprobs, entropies = token_stats(head, leaf, tokens, mask, entropy=True, chunk=4, keep_bytes=0)
    forward_calls = len(softmax_calls)
    logprobs.sum().backward()
    assert forward_calls == 7 and len(softmax_calls) == forward_calls  # 28 positions, 4 a chunk; none in the backward
    assert leaf.grad.abs().max() > 0 and entropies[mask.bool()].min() > 0


def test_the_first_batch_check_never_holds_more_than_one_rows_logits():
    model, tokenizer = tiny("llama")
    sequences = uneven_batch(model.config.vocab_size, tokenizer.pad_token_id)
    logits_rows = []
    model.register_forward_hook(lambda module, args, output: logits_rows.append(output.logits.shape[:2]))
    plan, warnings = checked_plan(model, sequences, dataclasses.replace(PACKED, pad_token_id=tokenizer.pad_token_id,
                                                                        share_prompts=True))
    assert plan.fused and plan.pack and plan.share_prompts and not warnings
    own = [shape for shape in logits_rows if shape[1] > 1]  # the fused passes keep one position
    assert len(own) == 6 and all(rows == 1 for rows, _ in own)


def test_the_first_batch_check_takes_the_longest_and_shortest_rows_with_their_prompts_rows():
    # Twelve rows, three prompts of four: row 5 is the longest, row 10 the shortest.
    prompt_ids = torch.tensor([[1, 2], [3, 4], [5, 6]]).repeat(4, 1)  # row r answers prompt r % 3
    lengths = torch.tensor([3, 4, 2, 3, 4, 9, 3, 2, 4, 3, 1, 2])
    response_mask = (torch.arange(9)[None, :] < lengths[:, None]).long()
    sequences = Sequences(prompt_ids, torch.ones_like(prompt_ids), response_mask * 7, response_mask)
    rows = rows_to_check(sequences).tolist()
    assert rows == [1, 2, 4, 5, 7, 8, 10, 11]  # 5 with 2, 8, 11 (its prompt); 10 with 1, 4, 7
    assert rows_to_check(sequences.select(torch.arange(6))).tolist() == list(range(6))  # a small batch whole
    assert len(rows_to_check(sequences, most=3)) == 3


def test_the_first_batch_check_runs_on_at_most_its_rows_and_still_catches_a_wrong_way(monkeypatch):
    model, tokenizer = tiny("granite")
    sequences = Sequences.concat([uneven_batch(model.config.vocab_size, tokenizer.pad_token_id, seed=seed)
                                  for seed in (1, 2, 3)], tokenizer.pad_token_id)  # 18 rows
    own_rows = []
    model.register_forward_hook(lambda module, args, output: own_rows.append(output.logits.shape[0])
                                if output.logits.shape[1] > 1 else None)
    wanted = dataclasses.replace(PACKED, pad_token_id=tokenizer.pad_token_id, share_prompts=True)
    assert checked_plan(model, sequences, wanted) == (wanted, [])
    assert own_rows == [1] * CHECK_ROWS  # the model's own padded pass, a row at a time, on 8 of the 18
    monkeypatch.setattr(OutputHead, "__init__", lambda self, model, temperature=1.0: (  # Granite's scale left out
        setattr(self, "layer", model.get_output_embeddings()), setattr(self, "scale", 1.0),
        setattr(self, "softcap", None), setattr(self, "temperature", temperature),
        setattr(self, "vocab_size", model.config.vocab_size)) and None)
    plan, warnings = checked_plan(model, sequences, wanted)
    assert not plan.fused and "the fused output layer off for this run" in warnings[0]


def test_a_model_whose_fused_numbers_differ_falls_back_and_says_why(monkeypatch):
    model, tokenizer = tiny("granite")
    sequences = uneven_batch(model.config.vocab_size, tokenizer.pad_token_id)
    # An architecture ppo-rlhf does not know: its logit scaling is left out of the fused layer.
    monkeypatch.setattr(OutputHead, "__init__", lambda self, model, temperature=1.0: (
        setattr(self, "layer", model.get_output_embeddings()), setattr(self, "scale", 1.0),
        setattr(self, "softcap", None), setattr(self, "temperature", temperature),
        setattr(self, "vocab_size", model.config.vocab_size)) and None)
    wanted = dataclasses.replace(PACKED, pad_token_id=tokenizer.pad_token_id, share_prompts=True)
    plan, warnings = checked_plan(model, sequences, wanted)
    assert not plan.fused and not plan.pack and plan.share_prompts
    assert "the fused output layer off for this run (--no-fused-output-layer)" in warnings[0]


def test_token_budget_micro_batches():
    lengths = [100, 30, 90, 10, 60, 40]
    groups = token_micro_batches(torch.tensor(lengths), max_tokens=120)
    assert sorted(i for g in groups for i in g) == list(range(6))  # every row once
    assert all(sum(lengths[i] for i in g) <= 120 or len(g) == 1 for g in groups)
    assert groups == [[0, 3], [1, 2], [4, 5]]  # longest first, each into the first group it fits
    assert token_micro_batches(torch.tensor(lengths), max_tokens=None) == [list(range(6))]
    assert token_micro_batches(torch.tensor(lengths), max_tokens=None, max_rows=4) == [[0, 1, 2, 3], [4, 5]]
    assert token_micro_batches(torch.tensor(lengths), max_tokens=1000, max_rows=2) == [[0, 2], [4, 5], [1, 3]]


def config_of(zoo, **overrides) -> PPOConfig:
    settings = {"model": str(zoo["llama"]), "prompts": str(zoo["prompts"]), "reward_fn": f"{REWARDS_MODULE}:length_score",
                "batch_size": 8, "mini_batch_size": 4, "max_new_tokens": 8, "max_length": 40, "lr": 1e-2,
                "num_threads": 1}
    return build_config(PPOConfig, {**settings, **overrides})


@pytest.mark.parametrize("overrides", [
    {}, {"critic": "separate"}, {"lora": True, "lr": 3e-2}, {"gradient_checkpointing": True},
    {"max_tokens_per_micro_batch": 40, "train_micro_batch_size": 2},
    {"estimator": "grpo", "samples_per_prompt": 4, "kl_in": "loss", "kl_estimator": "full"},
], ids=["shared-critic", "separate-critic", "lora", "gradient-checkpointing", "token-budget", "grpo-full-kl"])
def test_an_iteration_trains_as_the_padded_one_does(zoo, overrides):
    rows = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]
    runs = []
    for faster in (True, False):
        config = config_of(zoo, padding_free=faster, fused_output_layer=faster, **overrides)
        trainer = PPOTrainer(config)
        start = {name: p.detach().clone() for name, p in trainer.actor.named_parameters() if p.requires_grad}
        metrics = trainer.step(rows)  # one iteration: both sample the same responses
        runs.append((trainer, start, metrics))
    (fast, start, fast_metrics), (padded, _, padded_metrics) = runs
    assert fast.pass_plan.fused and fast.pass_plan.pack and not padded.pass_plan.fused
    trained = dict(fast.actor.named_parameters())
    moved = max((trained[name] - weights).abs().max().item() for name, weights in start.items())
    assert moved > 1e-3
    for ours, theirs in zip(fast.actor.state_dict().values(), padded.actor.state_dict().values()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0.02 * moved)
    for key in ("score", "kl", "pg_loss", "entropy", "vf_loss", "kl_loss"):
        if key in padded_metrics:
            assert fast_metrics[key] == pytest.approx(padded_metrics[key], rel=1e-4, abs=1e-6), key


def test_the_token_budget_is_checked_at_start():
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch"):
        build_config(PPOConfig, {"max_tokens_per_micro_batch": 0})


def test_the_plan_says_how_passes_run_and_a_fallback_is_told(zoo, tmp_path, capsys):
    from zoo import THREADS, run

    run(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn", f"{REWARDS_MODULE}:length_score",
         "--max-tokens-per-micro-batch", 40, "--iterations", 1, "--batch-size", 4, "--mini-batch-size", 2,
         "--max-new-tokens", 6, "--max-length", 32, "--eval-every", 0, "--save-every", 0, "--out", tmp_path / "run",
         *THREADS])
    printed = capsys.readouterr().out
    assert "passes:    packed without padding; the output layer a chunk of positions at a time" in printed
    assert "micro-batches of up to 40 tokens, rows grouped longest first" in printed
    assert "warning" not in printed  # the first batch's check agreed


@pytest.mark.parametrize("packed", [True, False])
def test_the_token_budget_counts_a_padded_pass_by_the_batchs_width(zoo, packed):
    trainer = PPOTrainer(config_of(zoo, padding_free=packed, fused_output_layer=packed))
    sequences = uneven_batch(trainer.actor.config.vocab_size, 0)
    width = sequences.attention_mask.shape[1]
    assert trainer.pass_lengths(sequences).tolist() == [width] * 6  # before the plan is checked: padded
    trainer.checked_pass_plan(sequences)
    real = sequences.attention_mask.sum(dim=1).tolist()
    assert trainer.pass_lengths(sequences).tolist() == (real if packed else [width] * 6)
