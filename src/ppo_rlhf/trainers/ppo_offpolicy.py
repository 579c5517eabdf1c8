"""The PPO trainer's options for samples an engine drew with other numerics or an older policy:
--is-correction's importance weights and --max-staleness's bound (docs/design.md, "Rollout
engines" and "Asynchronous rollouts")."""

from __future__ import annotations

from dataclasses import dataclass

from ppo_rlhf.config import ENGINE, at_least, between, check, option
from ppo_rlhf.core import IS_CORRECTIONS
from ppo_rlhf.core.offpolicy import MASKING, default_cap
from ppo_rlhf.rollout.engines import NO_ENGINE_LOGPROBS
from ppo_rlhf.sharding import sharding_from_launch


@dataclass
class OffPolicyOptions:
    """Part of PPOConfig (trainers/ppo_config.py), beside RolloutEngineOptions, whose engine it reads."""

    is_correction: str | None = option(None, "importance weights for an engine whose numerics differ from the "
                                             "trainer's (--rollout-engine vllm), on each token's policy-gradient "
                                             "term, from rho = pi_old / pi_engine: token-truncate min(rho_t, cap) "
                                             "(TIS); token-mask rho_t inside [floor, cap], else 0; "
                                             "sequence-truncate / sequence-mask the same with the response's "
                                             "product of rho_t; geometric-mask 1 where the response's geometric "
                                             "mean of rho_t is inside [floor, cap], else 0; none: no weights (the "
                                             "mismatch is still logged).  Empty: token-truncate with vllm; the "
                                             "torch engine is the trainer's own forward, has no mismatch and gets "
                                             "none", choices=(None, *IS_CORRECTIONS), group=ENGINE)
    is_cap: float | None = option(None, "--is-correction's upper bound: the truncation's cap, the masks' upper end "
                                        "(empty: 2, geometric-mask 1.001)", range=at_least(1), group=ENGINE)
    is_floor: float | None = option(None, "--is-correction's lower end for the masking modes (empty: 1 / is_cap)",
                                    range=between(0, 1, low_open=True), group=ENGINE)
    max_staleness: int = option(0, "--rollout-engine vllm-server: generate the next batches while the trainer updates "
                                   "on this one, each sample at most this many policy versions (updates) older than "
                                   "the policy it trains (TRL's max_staleness); an older one is dropped and counted, "
                                   "the rest weighted by --is-correction; 0: synchronous, each rollout after the "
                                   "update's push", range=at_least(0), group=ENGINE)

    def validate_staleness(self) -> None:
        """--max-staleness above 0: a generation server to overlap with (a colocated engine shares the
        trainer's process and takes turns with it), no ReMax (its greedy baseline would come from
        another policy than the samples), no FSDP (the worker rolls out while the update gathers)."""
        if self.max_staleness == 0:
            return
        check(self.rollout_engine == "vllm-server", "max_staleness",
              "0 without --rollout-engine vllm-server (the torch and vllm engines generate in the trainer's own "
              "process, between its updates: nothing runs beside them)", self.max_staleness)
        check(self.estimator != "remax", "max_staleness",
              "0 with --estimator remax: its greedy baseline is rolled out with the policy of now, and the samples "
              "with an older one", self.max_staleness)
        check(sharding_from_launch() is None, "max_staleness",
              "0 under an FSDP launch (the worker would roll out while the update gathers the sharded layers); "
              "launch data parallel", self.max_staleness)

    def validate_is_correction(self) -> None:
        """--is-correction's bounds: a cap for every mode but none, a floor for the masking modes only;
        the mode's defaults resolved here, so config.yaml records the values used: token-truncate with
        vllm, none with the torch engine (whose log-probs are the trainer's own: nothing to weight).
        A mode named with the torch engine is refused when the run starts it (rollout/engines.py,
        ``refuse_weights_without_engine``): a generator of one's own given to PPOTrainer may report
        engine log-probs."""
        mode = self.is_correction
        if mode is None and self.rollout_engine == "torch":
            for key in ("is_cap", "is_floor"):
                check(getattr(self, key) is None, key, f"left out with --rollout-engine torch: {NO_ENGINE_LOGPROBS}",
                      getattr(self, key))
            mode = self.is_correction = "none"
        elif mode is None:
            mode = self.is_correction = "token-truncate"
        if mode == "none":
            for key in ("is_cap", "is_floor"):
                check(getattr(self, key) is None, key, "left out with --is-correction none (no weights)",
                      getattr(self, key))
            return
        check(mode in MASKING or self.is_floor is None, "is_floor",
              f"left out with --is-correction {mode}, which truncates from above only (a floor bounds the masking "
              f"modes: {', '.join(MASKING)})", self.is_floor)
        if self.is_cap is None:
            self.is_cap = default_cap(mode)
        if mode in MASKING and self.is_floor is None:
            self.is_floor = 1.0 / self.is_cap
