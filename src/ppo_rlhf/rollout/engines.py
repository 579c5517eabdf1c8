"""Which engine generates: ``--rollout-engine torch|vllm|vllm-server`` for ``ppo`` and ``eval``
(docs/design.md, "The vLLM rollout engine", "The generation server").  vLLM is imported only when
asked for in this process (a trainer taking its rollouts from a server needs none)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ppo_rlhf.config import ENGINE, ConfigError, above, between, check, option
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.sequences import StopIds
from ppo_rlhf.rollout.weight_push import TRANSFERS

ENGINES = ("torch", "vllm", "vllm-server")

# Why the importance weights' options do nothing with the built-in engine.
NO_ENGINE_LOGPROBS = ("it samples with the trainer's own forward, so there are no engine log-probs to weight "
                      "(--is-correction, --is-cap and --is-floor are for --rollout-engine vllm or vllm-server)")


@dataclass
class RolloutEngineOptions:
    option_group = ENGINE  # --help's group of all these options (config.py, GROUPS)

    rollout_engine: str = option("torch", "what generates the responses: torch (the built-in decoding loop), vllm "
                                          "(a vLLM engine in this process, weights synced from the actor before each "
                                          "rollout; pip install -e \".[vllm]\"), or vllm-server (generation servers, "
                                          "ppo-rlhf serve, at --server-url; weights pushed after each update)",
                                  choices=ENGINES, first=True)
    server_url: list[str] = option([], "--rollout-engine vllm-server: the servers' addresses (http://host:port, "
                                       "comma-separated; rows are spread across them), as ppo-rlhf serve prints them")
    server_timeout: float = option(600.0, "--rollout-engine vllm-server: the most seconds one call to a server may "
                                          "take (a weight push, with its wait for the rollouts holding the weights; a "
                                          "batch's generation; an episode's turn); past it the run stops, naming it",
                                   range=above(0))
    weight_transfer: str = option("auto", "--rollout-engine vllm-server: how the weights reach the servers after each "
                                          "update: shared-memory (a file in the server's folder in /dev/shm, same "
                                          "machine), http (streamed in a request), nccl (GPUs on both sides, a server "
                                          "started with --nccl-weight-transfer), auto (shared memory where the "
                                          "server's folder is visible here, else http)", choices=TRANSFERS)
    vllm_memory_utilization: float = option(0.1, "--rollout-engine vllm: on a GPU, the share of its memory the engine "
                                                 "may take (vLLM's gpu_memory_utilization: weights and KV cache); on "
                                                 "the CPU, the most of the RAM its KV cache may take (no more than a "
                                                 "batch of --max-length sequences needs)",
                                            range=between(0, 1, low_open=True))
    vllm_probe_tolerance: float | None = option(None, "--rollout-engine vllm or vllm-server: after each weight sync "
                                                      "the engine's and the actor's log-probs of a fixed sequence (the "
                                                      "first prompt's last 32 tokens) are compared, and a mean gap per "
                                                      "token above this stops the run, naming it (empty: 1e-3 with a "
                                                      "float32 engine, 0.1 with a 16-bit one)", range=above(0))

    def validate_engine(self) -> None:
        check(self.vllm_probe_tolerance is None or self.rollout_engine != "torch", "vllm_probe_tolerance",
              "left out without --rollout-engine vllm or vllm-server (the torch engine is the trainer's own model)",
              self.vllm_probe_tolerance)
        server = self.rollout_engine == "vllm-server"
        check(server or not self.server_url, "server_url", "left out without --rollout-engine vllm-server",
              self.server_url)
        check(not server or self.server_url, "server_url", "one URL or more with --rollout-engine vllm-server: the "
              "address ppo-rlhf serve prints when it is ready (http://127.0.0.1:8000)", self.server_url)
        for name in ("server_timeout", "weight_transfer"):
            default = next(f.default for f in dataclasses.fields(self) if f.name == name)
            check(server or getattr(self, name) == default, name, "left out without --rollout-engine vllm-server",
                  getattr(self, name))


def require_engine(options: RolloutEngineOptions) -> None:
    """At start, before any model loads: the engine asked for can be imported (a ConfigError
    saying how to install vLLM otherwise); every server asked for answers as ppo-rlhf serve (its
    model is checked once the actor is loaded: ``make_engine``); a server's NCCL push needs vLLM
    here too."""
    if options.rollout_engine == "vllm":
        from ppo_rlhf.rollout.vllm_engine import import_vllm

        import_vllm()
    if options.rollout_engine == "vllm-server":
        from ppo_rlhf.rollout.server_client import check_servers_answer

        check_servers_answer(options.server_url, options.server_timeout)
    if options.rollout_engine == "vllm-server" and options.weight_transfer == "nccl":
        from ppo_rlhf.rollout.vllm_engine import import_vllm

        import_vllm("--weight-transfer nccl", "or push by --weight-transfer http (no vLLM needed in the trainer)")
        if not torch.cuda.is_available():
            raise ConfigError("--weight-transfer nccl: NCCL sends from a GPU, and this process sees none; use "
                              "--weight-transfer shared-memory (a server on this machine) or http")


def refuse_weights_without_engine(config) -> None:
    """ConfigError at start for --is-correction with the built-in torch engine, which the run is about
    to make: it samples with the trainer's own forward and reports no engine log-probs, so the weights
    would never be applied (a generator given to PPOTrainer(generator=...) may report them, and is
    not checked here)."""
    if config.rollout_engine == "torch" and config.is_correction != "none":
        raise ConfigError(f"invalid value for 'is_correction': {config.is_correction!r}; left out with "
                          f"--rollout-engine torch: {NO_ENGINE_LOGPROBS}")


def make_engine(options: RolloutEngineOptions, model, stop_ids: StopIds, pad_token_id: int, max_new_tokens: int,
                do_sample: bool, temperature: float, seed: int, process: int, device: torch.device | str,
                max_length: int, max_rows: int, tokenizer=None, agent: bool = False, keep_logprobs: bool = False):
    """The generator the options ask for: a TorchGenerator, a VLLMGenerator on ``model``, or a
    ServerGenerator on the servers, checked at start against ``model`` and ``tokenizer`` (the
    same model and tokenizer, room for ``max_length`` tokens; ``agent``: the same chat template).
    ``keep_logprobs``: the built-in loop keeps its sampled tokens' log-probs (the engines always do)."""
    if options.rollout_engine == "vllm":
        from ppo_rlhf.rollout.vllm_engine import VLLMGenerator

        return VLLMGenerator(model, stop_ids, pad_token_id, max_new_tokens, do_sample, temperature=temperature,
                             seed=seed, process=process, device=device, max_model_len=max_length,
                             memory_utilization=options.vllm_memory_utilization,
                             probe_tolerance=options.vllm_probe_tolerance,
                             mixed_precision=getattr(options, "mixed_precision", "no"), max_rows=max_rows)
    if options.rollout_engine == "vllm-server":
        from ppo_rlhf.rollout.server_client import ServerGenerator

        generator = ServerGenerator(options.server_url, stop_ids, pad_token_id, max_new_tokens, do_sample,
                                    temperature=temperature, seed=seed, process=process,
                                    timeout=options.server_timeout, transfer=options.weight_transfer,
                                    probe_tolerance=options.vllm_probe_tolerance)
        if tokenizer is not None:
            generator.check_served(model, tokenizer, max_length, agent)
        return generator
    return TorchGenerator(stop_ids, pad_token_id, max_new_tokens, do_sample=do_sample, temperature=temperature,
                          seed=seed + process, device=device, keep_logprobs=keep_logprobs)
