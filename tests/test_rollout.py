"""Generation, masks and log-probs: the places where RLHF implementations go quietly wrong."""

import math

import pytest
import torch

from ppo_rlhf.models import build_causal_lm
from ppo_rlhf.rollout.generation import TorchGenerator, token_logprob
from ppo_rlhf.rollout.logprobs import forward_response, logprobs_from_logits
from ppo_rlhf.rollout.responses import encode_prompts
from ppo_rlhf.rollout.sequences import Sequences, finished_flags, response_mask_from_eos
from ppo_rlhf.tasks import doubling as d


def test_response_mask_from_first_eos_even_when_pad_is_eos():
    eos = 2
    ids = torch.tensor([[5, 6, 2, 2, 2], [5, 2, 7, 2, 8], [5, 6, 7, 8, 9]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.equal(response_mask_from_eos(ids, eos), expected)



def test_a_response_ends_at_whichever_stop_id_comes_first():
    # EOS 2 and an end-of-turn 7, as a chat model declares both.
    stops = torch.tensor([2, 7])
    ids = torch.tensor([[5, 7, 2, 2], [5, 6, 2, 7], [5, 6, 8, 9], [7, 2, 2, 2]])
    mask = response_mask_from_eos(ids, stops)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert finished_flags(ids, mask, stops).tolist() == [True, True, False, True]
    # One stop id, given as a plain int, as before.
    eos_mask = response_mask_from_eos(ids, 2)
    assert eos_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert finished_flags(ids, eos_mask, 2).tolist() == [True, True, False, True]

def _tiny_model():
    tokenizer = d.build_tokenizer()
    return tokenizer, build_causal_lm(tokenizer, n_layer=2, n_head=2, n_embd=32, seed=1).eval()


def test_left_padding_gives_the_same_greedy_response():
    tokenizer, model = _tiny_model()
    long_prompt, short_prompt = "S数字:3320x2=", "S__:12x2="
    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, max_new_tokens=6, do_sample=False)
    ids, mask = encode_prompts(tokenizer, [long_prompt, short_prompt], 32)
    assert mask[1, 0] == 0  # the short prompt is left-padded
    batched, _ = generator.generate(model, ids, mask)
    alone_ids, alone_mask = encode_prompts(tokenizer, [short_prompt], 32)
    alone, _ = generator.generate(model, alone_ids, alone_mask)
    width = alone.shape[1]
    assert torch.equal(batched[1, :width], alone[0])


def test_response_logprobs_match_a_plain_forward_and_respect_temperature():
    tokenizer, model = _tiny_model()
    ids, mask = encode_prompts(tokenizer, ["S数字:3320x2=", "S__:12x2="], 32)
    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, 5, do_sample=True, temperature=0.7, seed=0)
    response_ids, response_mask = generator.generate(model, ids, mask)
    sequences = Sequences(ids, mask, response_ids, response_mask)
    out = forward_response(model, sequences, temperature=0.7)
    full = model(input_ids=sequences.input_ids, attention_mask=sequences.attention_mask,
                 position_ids=(sequences.attention_mask.cumsum(1) - 1).clamp(min=0)).logits
    prompt_length = ids.shape[1]
    expected = logprobs_from_logits(full[:, prompt_length - 1:-1] / 0.7, response_ids)
    got = logprobs_from_logits(out.logits, response_ids)
    assert torch.allclose(got[response_mask.bool()], expected[response_mask.bool()], atol=1e-5)


def test_the_loop_keeps_the_logprobs_it_sampled_with_when_asked():
    """keep_logprobs: each sampled token's log-prob under softmax(logits / T), as the trainer's pass
    gives it (to round-off), 0 past a response's end; the sampled tokens are those of a loop that
    keeps none."""
    tokenizer, model = _tiny_model()
    ids, mask = encode_prompts(tokenizer, ["S数字:3320x2=", "S__:12x2=", "S:7x2="], 32)
    keeping = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, 6, do_sample=True, temperature=0.7,
                             seed=0, keep_logprobs=True)
    response_ids, response_mask = keeping.generate(model, ids, mask)
    plain = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, 6, do_sample=True, temperature=0.7, seed=0)
    assert torch.equal(plain.generate(model, ids, mask)[0], response_ids) and plain.last_logprobs is None
    expected = logprobs_from_logits(forward_response(model, Sequences(ids, mask, response_ids, response_mask),
                                                     temperature=0.7).logits, response_ids)
    assert keeping.last_logprobs.shape == response_ids.shape and keeping.last_logprobs.dtype == torch.float32
    torch.testing.assert_close(keeping.last_logprobs, expected * response_mask, atol=1e-5, rtol=0)
    assert (keeping.last_logprobs[~response_mask.bool()] == 0).all() and (expected[response_mask.bool()] < 0).all()


def test_token_logprob_by_hand():
    # logits [0, 2, 4] at T 2: [0, 1, 2]; log-sum-exp = log(1 + e + e^2) = 2.4076; token 1: 1 - 2.4076
    logprob = token_logprob(torch.tensor([[0.0, 2.0, 4.0]]), torch.tensor([1]), 2.0)
    assert logprob.item() == pytest.approx(1 - math.log(1 + math.e + math.e ** 2), abs=1e-6)


def test_sampling_follows_softmax_of_logits_over_temperature():
    # The generator must sample from exactly the distribution whose log-probs PPO trains.
    generator = TorchGenerator(stop_token_ids=2, pad_token_id=0, max_new_tokens=1, do_sample=True, temperature=2.0, seed=0)
    logits = torch.tensor([[0.0, 2.0, 4.0]]).repeat(20000, 1)
    counts = torch.bincount(generator.next_tokens(logits), minlength=3).float() / 20000
    expected = torch.softmax(torch.tensor([0.0, 2.0, 4.0]) / 2.0, dim=0)
    assert torch.allclose(counts, expected, atol=0.015)
