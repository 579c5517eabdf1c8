"""The KV cache carried from an episode's turn to the next (rollout/turn_cache.py): the same tokens
and log-probs as reading each turn's whole context again, for every row whether it continues a
kept one or not, and only inside ``holding_weights``."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from ppo_rlhf.rollout.generation import TorchGenerator

PAD, STOP = 0, 1


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":  # learned positions
        config = GPT2Config(vocab_size=50, n_positions=128, n_embd=32, n_layer=2, n_head=2)
        model = GPT2LMHeadModel(config)
    else:  # rotary positions, grouped-query attention
        config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        model = LlamaForCausalLM(config)
    return model.double().eval()


def left_padded(contexts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, contexts))
    ids = torch.tensor([[PAD] * (width - len(c)) + c for c in contexts])
    mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
    return ids, mask


def responses(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[keep.bool()].tolist() for row, keep in zip(ids, mask)]


def play_turns(model, generator: TorchGenerator, first: list[list[int]], answers: list[list[list[int]]]):
    """Turns of several 'episodes': each next context is the last one, the response, and the turn's
    'tool answer' (the rows given, a row with None leaves the episode: the batch shrinks and
    reorders as rows end, as in a rollout); each turn's responses and the sampler's log-probs."""
    contexts, played = {i: c for i, c in enumerate(first)}, []
    for answer in [None, *answers]:
        if answer is not None:
            contexts = {i: contexts[i] + last[i] + answer[i] for i in contexts if answer[i] is not None}
        order = sorted(contexts, reverse=len(played) % 2 == 1)  # another row order each turn
        ids, mask = left_padded([contexts[i] for i in order])
        out_ids, out_mask = generator.generate(model, ids, mask)
        got = responses(out_ids, out_mask)
        last = {i: got[j] for j, i in enumerate(order)}
        played.append((last, {i: generator.last_logprobs[j][:len(got[j])] for j, i in enumerate(order)}))
    return played


FIRST = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
ANSWERS = [[[20, 21, 22], [23], [24, 25, 26, 27, 28]],
           [[29, 30], None, [31, 32, 33]],
           [[34], None, [35, 36, 37, 38]]]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_turns_from_the_kept_cache_are_the_turns_read_whole(kind, do_sample):
    model = tiny(kind)
    make = lambda: TorchGenerator([STOP], PAD, max_new_tokens=6, do_sample=do_sample, temperature=0.9, seed=3,
                                  keep_logprobs=True)
    whole = play_turns(model, make(), FIRST, ANSWERS)
    kept_generator = make()
    with kept_generator.holding_weights(model):
        kept = play_turns(model, kept_generator, FIRST, ANSWERS)
        assert kept_generator.turn_cache.cache is not None  # the last call left its cache
    assert kept_generator.turn_cache is None  # let go on leaving
    for (whole_tokens, whole_logprobs), (kept_tokens, kept_logprobs) in zip(whole, kept):
        assert kept_tokens == whole_tokens
        for row in whole_logprobs:
            torch.testing.assert_close(kept_logprobs[row], whole_logprobs[row], rtol=0, atol=1e-10)
    assert any(len(tokens) > 1 for turn, _ in whole for tokens in turn.values())  # the turns wrote something


def test_a_call_reads_only_what_is_new_when_its_rows_continue_kept_ones():
    model = tiny("llama")
    generator = TorchGenerator([STOP], PAD, max_new_tokens=4, do_sample=False, keep_logprobs=True)
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    with generator.holding_weights(model):
        first_ids, first_mask = left_padded(FIRST)
        # The second row's turn ends first, so the cache holds all of it, its last token included.
        out_ids, out_mask = generator.generate(model, first_ids, first_mask, max_new_tokens=[4, 2, 4])
        got = responses(out_ids, out_mask)
        assert generator.turn_cache.ids[1] == tuple(FIRST[1] + got[1])
        seen.clear()
        # Two rows continue their turn (one with an empty answer: all of it is in the cache, and its
        # last token is read again for the logits of the next); a third is a new prompt.
        contexts = [FIRST[0] + got[0] + [20, 21], FIRST[1] + got[1], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
        kept = responses(*generator.generate(model, *left_padded(contexts)))
        kept_logprobs = generator.last_logprobs
    hook.remove()
    # The first forward of the second call ran the new tokens only: at most the new prompt's 9, not
    # the continued rows' whole contexts.
    assert seen[0] == 9 < len(contexts[0])
    reading = TorchGenerator([STOP], PAD, max_new_tokens=4, do_sample=False, keep_logprobs=True)
    assert kept == responses(*reading.generate(model, *left_padded(contexts)))
    torch.testing.assert_close(kept_logprobs, reading.last_logprobs, rtol=0, atol=1e-10)


def test_without_holding_weights_each_call_reads_everything():
    model = tiny("gpt2")
    generator = TorchGenerator([STOP], PAD, max_new_tokens=4, do_sample=False)
    ids, mask = left_padded(FIRST)
    generator.generate(model, ids, mask)
    assert generator.turn_cache is None
