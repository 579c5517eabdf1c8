"""Generation behind one small interface, so a faster engine can serve rollouts where installed.

``Generator.generate(model, prompt_ids, prompt_mask) -> (response_ids, response_mask)`` is all
the PPO trainer needs, and ``stop_token_ids``, the ids that end a response (to read which
responses finished).  ``TorchGenerator`` is the built-in engine: a plain decoding loop over the
KV cache, in eval mode (no dropout), that stops as soon as every response has emitted one of
its stop ids (see sequences.stop_token_ids).
It samples from ``softmax(logits / temperature)``, the same distribution the trainer's
log-probs use, so the PPO ratio is exactly 1 before the first update.  (No top-k / top-p:
they would make the sampling distribution differ from the one whose log-probs are trained.)
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from ppo_rlhf.rollout.sequences import StopIds, is_stop, position_ids_from_mask, response_mask_from_eos
from ppo_rlhf.rollout.turn_cache import TurnCache


def cache_of(output) -> tuple[str, object]:
    """(the keyword a forward takes its cache by, the cache) from that forward's output:
    transformers 5.2x renamed past_key_values to cache (the old name warns, and goes in 5.40);
    the output's own field says which name this version uses."""
    name = "cache" if "cache" in getattr(output, "__dataclass_fields__", {}) else "past_key_values"
    return name, getattr(output, name)


class EngineWeightsError(RuntimeError):
    """A rollout engine that does not hold the actor's weights after a sync: its log-probs of a
    fixed probe sequence are too far from the actor's (rollout/vllm_engine.py).  The run stops,
    like a diverged one (exit 3): every rollout after it would train on another policy's samples."""


class Generator(Protocol):
    """The rollout engine's contract.  An inference server (vLLM, SGLang) can fill this seam if it
    meets every point; anything less trains the actor on samples from another policy.

    1. Weights: it samples from the actor *as it is now*.  The trainer calls ``generate`` at the
       start of every iteration, after the previous update, so an engine that holds its own copy
       of the weights must receive the actor's updated weights before each call (full weights, or
       base + the policy adapter under ``--lora``; under ZeRO-3/FSDP gathered once per rollout,
       not per token), and in the dtype the trainer's old pass runs in.
    2. Distribution: each token is drawn from ``softmax(logits / temperature)`` of the model's own
       forward (its logit scaling or soft-capping included), with the trainer's ``temperature``
       and no top-k, top-p, repetition penalty or min-p: the old pass recomputes the log-probs of
       exactly that distribution, and the first PPO ratio must be 1.  Greedy when
       ``do_sample`` is false.
    3. Stopping: a response ends at the first of ``stop_token_ids`` (the union the trainer passes:
       the tokenizer's EOS and the model's end-of-turn ids), which is kept in the response; every
       position after it is the pad id and 0 in the mask; at most ``max_new_tokens`` tokens, or
       for each row the number the optional ``max_new_tokens=`` list gives (an episode's later
       turn asks for no more than the room its episode has left, rollout/episodes.py).
    4. Layout: ``prompt_ids``/``prompt_mask`` are (B, P), left-padded; responses come back (B, T)
       aligned with them, row for row, T the longest response of the batch.
    5. Randomness: with a seed, the same prompts give the same responses (resume and the
       multi-process parity test rely on it).

    An engine that takes requests one at a time may also offer ``requests(model)``: one rollout's
    session whose ``add(row, turn, ids, limit)`` submits an episode's turn the moment it is asked
    and whose ``step()`` hands back the finished ones, for episodes that never wait for each other
    (rollout/turns.py, ``ContinuousTurns``; the vLLM engine's ``EngineRequests``).  Without it an
    episode's turns are batched, one ``generate`` call per turn.

    An engine whose calls are collectives of a launch's processes (vLLM's data parallel steps
    every process's engine together) says so with ``steps_together``; its callers then make as
    many calls in every process (docs/design.md, "Collectives of a rollout").
    """

    stop_token_ids: list[int]  # the ids that end a response

    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 max_new_tokens: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Responses (B, T) with pad after the first stop id, and their mask (B, T)."""


class TorchGenerator:
    """Greedy or temperature sampling with the KV cache; left-padded prompts.

    ``stop_token_ids``: one id or several (``stop_token_ids(tokenizer, model)`` gives them all).
    ``seed`` seeds a sampling generator of its own on ``device`` (re-made there, same seed, if the
    model is elsewhere).  ``keep_logprobs``: keep each sampled token's log-prob under
    ``softmax(logits / temperature)`` in ``last_logprobs`` ((B, T), 0 after a response's end), read
    off the logits the loop computes anyway -- the sampler's own log-probs, which on-policy
    distillation's reward takes instead of a pass of its own (docs/design.md, "On-policy
    distillation").  Inside ``holding_weights`` (an episode rollout's turns) each call starts from
    the KV cache the one before left (rollout/turn_cache.py).
    """

    def __init__(self, stop_token_ids: StopIds, pad_token_id: int, max_new_tokens: int, do_sample: bool,
                 temperature: float = 1.0, seed: int | None = None, device: torch.device | str = "cpu",
                 keep_logprobs: bool = False):
        self.stop_token_ids = torch.as_tensor(stop_token_ids).reshape(-1).tolist()
        self.pad_token_id = pad_token_id
        self.max_new_tokens = max_new_tokens
        self.do_sample = do_sample
        self.temperature = temperature
        self.seed = seed
        self.rng = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        self.keeps_logprobs = keep_logprobs
        self.last_logprobs: torch.Tensor | None = None  # (B, T) with keep_logprobs, of the last responses
        self.turn_cache: TurnCache | None = None  # inside holding_weights: the last call's cache

    @contextlib.contextmanager
    def holding_weights(self, model):
        """Calls within hold the weights fixed (one rollout's turns), so each call may start from
        the cache the call before left; the cache is let go on leaving."""
        self.turn_cache = TurnCache()
        try:
            yield
        finally:
            self.turn_cache = None

    def with_decoding(self, do_sample: bool, temperature: float = 1.0, seed: int | None = None) -> "TorchGenerator":
        """Another loop with these decoding settings and this one's stop ids and length."""
        return TorchGenerator(self.stop_token_ids, self.pad_token_id, self.max_new_tokens, do_sample=do_sample,
                              temperature=temperature, seed=seed)

    def next_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) logits of the last position -> (B,) chosen token ids."""
        if not self.do_sample:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.rng is not None and self.rng.device.type != probs.device.type:
            self.rng = torch.Generator(device=probs.device).manual_seed(self.seed)
        return torch.multinomial(probs, num_samples=1, generator=self.rng).squeeze(-1)

    @torch.no_grad()
    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 max_new_tokens: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``max_new_tokens``: each row's own limit (default: the loop's for every row)."""
        was_training = model.training
        model.eval()
        batch_size = prompt_ids.shape[0]
        limits = torch.tensor(max_new_tokens if max_new_tokens is not None else [self.max_new_tokens] * batch_size,
                              device=prompt_ids.device)  # (B,)
        start = (self.turn_cache.start(prompt_ids, prompt_mask, self.pad_token_id) if self.turn_cache is not None
                 else None)
        if start is None:
            attention_mask = prompt_mask.clone()
            position_ids = position_ids_from_mask(attention_mask)
            next_position = attention_mask.sum(dim=1, keepdim=True)  # (B, 1) first position after the prompt
            inputs, cache = prompt_ids, {}  # no cache before the prompt's pass
            holds, contexts = prompt_mask.bool(), None  # the columns holding a row's tokens
        else:
            inputs, attention_mask, position_ids = start.inputs, start.attention_mask, start.position_ids
            next_position, holds, contexts = start.next_position, start.holds, start.contexts
            cache = {self.turn_cache.keyword: start.cache}
        finished = torch.zeros(batch_size, dtype=torch.bool, device=prompt_ids.device)
        tokens, logprobs, fed_going = [], [], []
        for step in range(int(limits.max())):
            out = model(
                input_ids=inputs, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=True, logits_to_keep=1, **cache,
            )
            cache_name, past = cache_of(out)
            cache = {cache_name: past}
            token = self.next_tokens(out.logits[:, -1])
            if self.keeps_logprobs:
                logprobs.append(token_logprob(out.logits[:, -1], token, self.temperature))
            going = ~finished  # the rows this token is a response's own
            token = torch.where(finished, torch.full_like(token, self.pad_token_id), token)
            tokens.append(token)
            finished |= is_stop(token, self.stop_token_ids) | (limits <= step + 1)
            if bool(finished.all()):
                break
            fed_going.append(going)  # the token goes in next, its keys and values into the cache
            inputs = token[:, None]
            position_ids = next_position
            next_position = next_position + 1
            attention_mask = torch.cat([attention_mask, torch.ones_like(inputs)], dim=1)
        model.train(was_training)
        if self.turn_cache is not None:
            self.keep_cache(cache, holds, contexts, prompt_ids, prompt_mask, tokens, fed_going)
        response_ids = torch.stack(tokens, dim=1)  # (B, T)
        response_mask = response_mask_from_eos(response_ids, self.stop_token_ids)
        positions = torch.arange(response_ids.shape[1], device=response_ids.device)
        response_mask = response_mask * (positions[None, :] < limits[:, None])  # a row's own limit
        response_ids = torch.where(response_mask.bool(), response_ids, torch.full_like(response_ids, self.pad_token_id))
        if self.keeps_logprobs:
            self.last_logprobs = torch.stack(logprobs, dim=1) * response_mask
        return response_ids, response_mask

    def keep_cache(self, cache: dict, holds: torch.Tensor, contexts: list | None, prompt_ids: torch.Tensor,
                   prompt_mask: torch.Tensor, tokens: list, fed_going: list) -> None:
        """What this call leaves for the next (rollout/turn_cache.py): its cache, the columns that hold
        each row's tokens -- the context's, then each token fed back while the row's response went
        on -- and those tokens."""
        if not cache:
            return
        fed = len(fed_going)
        going = torch.stack(fed_going, dim=1) if fed else holds.new_zeros((holds.shape[0], 0))
        fed_ids = torch.stack(tokens[:fed], dim=1) if fed else prompt_ids.new_zeros((holds.shape[0], 0))
        if contexts is None:
            contexts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        rows = [context + ids[keep].tolist() for context, ids, keep in zip(contexts, fed_ids, going)]
        (keyword, past), = cache.items()  # the one cache, by the name the model takes it by
        self.turn_cache.keep(keyword, past, torch.cat([holds, going], dim=1), rows)


def token_logprob(logits: torch.Tensor, token: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, V) logits of one position, (B,) tokens -> (B,) float32 log-probs of the tokens under
    ``softmax(logits / temperature)``, the distribution the trainer's passes score."""
    logits = logits.float() / temperature
    return logits.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
