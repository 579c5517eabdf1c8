"""Which engine generates: ``--rollout-engine torch|vllm`` for ``ppo`` and ``eval``
(docs/design.md, "The vLLM rollout engine").  vLLM is imported only when asked for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo_rlhf.config import ENGINE, ConfigError, above, between, check, option
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.sequences import StopIds

ENGINES = ("torch", "vllm")
# Why the importance weights' options do nothing with the built-in engine.
NO_ENGINE_LOGPROBS = ("it samples with the trainer's own forward, so there are no engine log-probs to weight "
                      "(--is-correction, --is-cap and --is-floor are for --rollout-engine vllm)")


@dataclass
class RolloutEngineOptions:
    option_group = ENGINE  # --help's group of all these options (config.py, GROUPS)

    rollout_engine: str = option("torch", "what generates the responses: torch (the built-in decoding loop) or vllm "
                                          "(a vLLM engine in this process, weights synced from the actor before each "
                                          "rollout; pip install -e \".[vllm]\")", choices=ENGINES,
                                  first=True)
    vllm_memory_utilization: float = option(0.1, "--rollout-engine vllm: on a GPU, the share of its memory the engine "
                                                 "may take (vLLM's gpu_memory_utilization: weights and KV cache); on "
                                                 "the CPU, the most of the RAM its KV cache may take (no more than a "
                                                 "batch of --max-length sequences needs)",
                                            range=between(0, 1, low_open=True))
    vllm_probe_tolerance: float | None = option(None, "--rollout-engine vllm: after each weight sync the engine's and "
                                                      "the actor's log-probs of a fixed sequence (the first prompt's "
                                                      "last 32 tokens) are compared, and a mean gap per token above "
                                                      "this stops the run, naming it (empty: 1e-3 with a float32 "
                                                      "engine, 0.1 with a 16-bit one)", range=above(0))


    def validate_engine(self) -> None:
        check(self.vllm_probe_tolerance is None or self.rollout_engine == "vllm", "vllm_probe_tolerance",
              "left out without --rollout-engine vllm (the torch engine is the trainer's own model)",
              self.vllm_probe_tolerance)


def require_engine(options: RolloutEngineOptions) -> None:
    """At start, before any model loads: the engine asked for can be imported (a ConfigError
    saying how to install vLLM otherwise)."""
    if options.rollout_engine == "vllm":
        from ppo_rlhf.rollout.vllm_engine import import_vllm

        import_vllm()


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
                max_length: int, max_rows: int):
    """The generator the options ask for: a TorchGenerator, or a VLLMGenerator on ``model``."""
    if options.rollout_engine == "vllm":
        from ppo_rlhf.rollout.vllm_engine import VLLMGenerator

        return VLLMGenerator(model, stop_ids, pad_token_id, max_new_tokens, do_sample, temperature=temperature,
                             seed=seed, process=process, device=device, max_model_len=max_length,
                             memory_utilization=options.vllm_memory_utilization,
                             probe_tolerance=options.vllm_probe_tolerance,
                             mixed_precision=getattr(options, "mixed_precision", "no"), max_rows=max_rows)
    return TorchGenerator(stop_ids, pad_token_id, max_new_tokens, do_sample=do_sample, temperature=temperature,
                          seed=seed + process, device=device)
