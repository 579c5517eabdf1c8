"""One rollout's requests on a run's vLLM engine (docs/design.md, "The vLLM rollout engine"):
:class:`EngineRequests`, each episode's turn a request of its own, submitted the moment its episode
asks and the engine stepped while it has work (continuous batching; rollout/turns.py); and
:class:`EngineDecoding`, the engine with another caller's decoding settings and seeds (the in-run
evaluations, ReMax's greedy baseline).  Every response's seed is its own (``response_seed``), so
what an episode samples never depends on when its turn was asked."""

from __future__ import annotations

import hashlib

import torch


class DrawCount:
    """How many rollouts the engine has drawn: what a resumed run needs to draw the same ones.
    Saved and restored by the PPO loop as a sampling RNG's state (``get_state``/``set_state``)."""

    def __init__(self) -> None:
        self.draws = 0

    def get_state(self) -> torch.Tensor:
        return torch.tensor([self.draws], dtype=torch.long)

    def set_state(self, state: torch.Tensor) -> None:
        self.draws = int(state.reshape(-1)[0])


def response_seed(seed: int, process: int, draw: int, row: int, turn: int | None = None) -> int:
    """A 63-bit seed of its own for each response (``turn``: an episode's turn, asked on its own)."""
    key = f"{seed}/{process}/{draw}/{row}" + ("" if turn is None else f"/{turn}")
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sampling_params(vllm, stop_token_ids: list[int], do_sample: bool, temperature: float, max_tokens: int,
                    seed: int | None):
    """One request's SamplingParams, the Generator contract's points 2-3 as vLLM takes them (the
    colocated engine's and the generation server's alike): ``temperature`` and nothing else
    filtering the distribution (greedy: 0), the stop ids, the engine's log-probs of the sampled
    tokens, ``seed`` the request's own."""
    common = dict(n=1, stop_token_ids=stop_token_ids, ignore_eos=True,
                  top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                  frequency_penalty=0.0, logprobs=0, detokenize=False, skip_special_tokens=False)
    if not do_sample:
        return vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, **common)
    return vllm.SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, **common)


def probe_params(vllm):
    """The weight probe's request: its prompt log-probs (``prompt_logprobs=0``: each token's own, of
    the raw logits, computed afresh: such a request never reads the prefix cache), one greedy token
    that nobody reads."""
    return vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False,
                               skip_special_tokens=False)


def probe_logprobs(output, ids: list[int]) -> list[float]:
    """The engine's log-prob of each probe token after the first, from its request's ``output``."""
    return [step[token].logprob for step, token in zip(output.prompt_logprobs[1:], ids[1:])]


def kept_response(completion, stop_token_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """A completion's ids up to and including its first stop id (none after it: the Generator
    contract's mask), at most ``max_new_tokens``, and the engine's log-prob of each (0 where it
    gave none)."""
    ids = list(completion.token_ids)[:max_new_tokens]
    steps = completion.logprobs or []
    values = [steps[i][token].logprob if i < len(steps) and steps[i] and token in steps[i] else 0.0
              for i, token in enumerate(ids)]
    end = next((i + 1 for i, token in enumerate(ids) if token in stop_token_ids), len(ids))
    return ids[:end], values[:end]


class EngineDecoding:
    """A Generator on a run's vLLM engine with decoding settings of its own (greedy, or sampled
    from its own seeds and draw count, so the rollouts' draws, which checkpoints keep, stay as a
    run without it would have them).  The actor's weights are synced before each call, as for a
    rollout."""

    def __init__(self, engine, do_sample: bool, temperature: float, seed: int):  # engine: a VLLMGenerator
        self.engine, self.do_sample, self.temperature, self.seed = engine, do_sample, temperature, seed
        self.stop_token_ids, self.pad_token_id = engine.stop_token_ids, engine.pad_token_id
        self.max_new_tokens = engine.max_new_tokens
        self.rng = DrawCount()

    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 max_new_tokens: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.engine.generate(model, prompt_ids, prompt_mask, decoding=self, max_new_tokens=max_new_tokens)

    def holding_weights(self, model):
        return self.engine.holding_weights(model)

    @property
    def steps_together(self) -> bool:
        return self.engine.steps_together

    def requests(self, model) -> "EngineRequests":
        return self.engine.requests(model, decoding=self)


class EngineRequests:
    """One rollout's episode turns on a VLLMGenerator's engine, each submitted as its own request as
    soon as its episode asks (``add``), the engine stepped while it has work (``step``): continuous
    batching, each step the engine batching whatever is pending (rollout/turns.py,
    ``ContinuousTurns``).  Used inside ``holding_weights``: the weights were synced once for the
    rollout.  Each request's seed is its own, from (run seed, process, draw, row, turn), so what an
    episode samples never depends on when its turn was asked.  The probe rides with the first
    request and is checked when the rollout ends (``close``), where every process is alike."""

    def __init__(self, engine, model, decoding: "EngineDecoding | None" = None):  # engine: a VLLMGenerator
        from vllm.sampling_params import RequestOutputKind

        self.engine, self.model, self.decoding = engine, model, decoding or engine
        self.final_only = RequestOutputKind.FINAL_ONLY  # a request's output once, when it finishes
        self.core = engine.llm.llm_engine
        self.draw = self.decoding.rng.draws
        self.pending: set[str] = set()  # the requests in the engine
        self.count = 0
        self.probing = engine.probe_due  # the sync held for this rollout: its first request brings the probe
        self.probe_key: str | None = None
        self.probe_output = None

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def submit(self, ids: list[int], params) -> str:
        params.output_kind = self.final_only
        key = f"episode-turn-{self.count}"
        self.count += 1
        self.core.add_request(key, self.engine.engine_input(ids), params)
        self.pending.add(key)
        return key

    def add(self, row: int, turn: int, ids: list[int], limit: int | None) -> str:
        """Episode ``row``'s turn ``turn`` after its ``ids``, at most ``limit`` tokens; its request's key."""
        engine = self.engine
        engine.keep_probe_prompt(ids)
        if self.probing and self.probe_key is None and engine.probe_ids is not None:
            request, params = engine.probe_request()
            self.probe_key = self.submit(request["prompt_token_ids"], params)
        seed = response_seed(self.decoding.seed, engine.process, self.draw, row, turn)
        return self.submit(ids, engine.request_params(self.decoding, limit or engine.max_new_tokens, seed))

    def step(self) -> list[tuple[str, tuple[list[int], list[float]]]]:
        """One engine step if there is work; the requests it finished, as (key, (ids, log-probs)).
        Several processes: the engines step together (vLLM's data parallel coordinates each
        forward), so ``has_unfinished_requests`` is a collective, and a process without work of its
        own runs a dummy step while another has some."""
        if not self.core.has_unfinished_requests():
            return []
        finished = []
        for output in self.core.step():
            if not output.finished:
                continue
            self.pending.discard(output.request_id)
            if output.request_id == self.probe_key:
                self.probe_output = output
            else:
                finished.append((output.request_id, self.engine.kept_response(output.outputs[0])))
        return finished

    def anyone_working(self, running: bool, busy: bool) -> tuple[bool, bool]:
        """Whether any process still has episodes ``running`` or requests in its engine, and whether
        any has requests in its engine (``busy``), in one all-reduce (one process: this one's)."""
        from ppo_rlhf.distributed import sum_across_processes, world_size

        if world_size() == 1:
            return running or busy, busy
        counts = sum_across_processes(torch.tensor([float(running or busy), float(busy)], device=self.engine.device))
        anyone_running, anyone_busy = (count > 0 for count in counts.tolist())
        return anyone_running, anyone_busy

    def close(self) -> None:
        """The rollout ended: its draw counted, the probe checked (EngineWeightsError past its
        tolerance) in every process where the sync made it due, whether or not this one sent it."""
        self.decoding.rng.draws += 1
        if self.probing:
            probe = self.engine.check_weights(self.model, self.probe_output)
            self.engine.probe_due = not probe  # no process had a probe sequence: the next rollout's
            if self.decoding is self.engine:
                self.engine.last_probe = probe

    def abort(self) -> None:
        """The rollout stopped midway: its requests taken out of the engine, for the next rollout's."""
        if self.pending:
            self.core.abort_request(sorted(self.pending))
            self.pending.clear()
