"""``ppo-rlhf demo``: the whole pipeline on the built-in task, SFT -> reward model -> PPO -> evaluation.

    OUT/sft/      SFT run folder       (checkpoints/sft)
    OUT/rm/       reward-model run     (checkpoints/reward)
    OUT/          the PPO run: config.yaml (all three stages), metrics.jsonl, tb/, curves.png,
                  summary.json with before/after accuracy and checkpoints.{sft, reward, actor}
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

from ppo_rlhf.checkpoint import atomic_write_json
from ppo_rlhf.config import (HARDWARE, MODEL_DATA, RUN, SEEDS, THREADS, UPDATE, ConfigError, above, at_least,
                             build_config, option, to_dict)
from ppo_rlhf.config_yaml import load_yaml
from ppo_rlhf.interrupts import RunInterrupted, stop_requested
from ppo_rlhf.run_folder import check_run_folder
from ppo_rlhf.stages.ppo import run_ppo
from ppo_rlhf.stages.reward import run_reward
from ppo_rlhf.stages.sft import run_sft
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.reward import RewardConfig
from ppo_rlhf.trainers.sft import SFTConfig

# Settings for the built-in task, measured on it (benchmarks/results/ppo_tuning.md):
# - SFT with dropout (GPT-2's 0.1) and a learning rate annealed to 1% of its peak: without
#   dropout the arithmetic it learns breaks under the first PPO updates; 1600 steps, because
#   PPO's reward (a style classifier) says nothing about the digits, so sampled exact-match
#   starts from the SFT model's sampled value-correctness: 98.7% on seeds 1 and 2 after 1200
#   steps, 99.45-99.6% after 1600;
# - small models take much larger steps than the 1e-5 a 7B model would use; an update stops
#   early once the policy has moved 0.02 (approx_kl) from the one that collected the batch;
# - the critic is a separate model initialised from the reward model's trunk: a value head on
#   the SFT trunk cannot represent "does the style match the prefix", because SFT never saw a
#   prefix; it gets its own learning rate and a few critic-only iterations before the actor moves;
# - the value loss is not clipped: the 0.2 clip range is absolute, and reward-model logits span ~8;
# - scores are normalised, so kl_coef means the same whatever the reward model's scale;
# - an entropy *penalty* sharpens the policy past the SFT model's sampled accuracy, which the KL
#   penalty alone only pulls back toward; it ramps in over 100 iterations (entropy_warmup) to
#   -1.0.  At full strength early it fixes the style choice before the prefix is learned: a
#   constant -0.4 stalled seed 1 at 53-64%, and -1.0 reached by iteration 60 stalled it at 67%.
#   Ramped over 100 iterations it ended at 99.3-99.9% sampled on seeds 0-4 (constant -0.3:
#   97.2-99.35% on seeds 0-2 after 160 iterations).
SFT_PRESET = {"steps": 1600, "batch_size": 128, "lr": 3e-3, "min_lr_ratio": 0.01, "eval_every": 400}
RM_PRESET = {"mode": "classification", "num_labels": 3, "steps": 300, "batch_size": 64, "lr": 2e-3}
PPO_PRESET = {
    "task": "doubling", "critic": "separate", "do_sample": True, "max_new_tokens": 7, "max_length": 19,
    "batch_size": 64, "mini_batch_size": 32, "ppo_epochs": 4, "lr": 3e-4, "max_approx_kl": 0.02,
    "kl_coef": 0.3, "score_norm": True, "gamma": 1.0, "lam": 0.95, "vf_coef": 1.0, "critic_lr": 1e-3,
    "critic_warmup": 3, "cliprange_value": None, "entropy_coef": -1.0, "entropy_warmup": 100, "iterations": 120,
    "eval_every": 10,
    "save_every": 0,
}


@dataclass
class DemoConfig:
    # The fields naming a file or folder the run reads: --out may not be, hold or lie in one (run_folder.py).
    input_paths: ClassVar[tuple] = ("stages_config",)

    # --- model and data
    reward: str = option("model", "PPO reward: the learned style classifier, or the rule-based reward",
                         choices=("model", "rule"), group=MODEL_DATA, first=True)
    critic: str = option("separate", "critic: separate model from the RM's trunk, or a value head on the actor (shared)",
                         choices=("shared", "separate"), group=MODEL_DATA, first=True)

    # --- update and loss
    sft_steps: int | None = option(None, "SFT steps (default: the task preset)", range=above(0), group=UPDATE)
    rm_steps: int | None = option(None, "reward-model steps (default: the task preset)", range=above(0), group=UPDATE)
    ppo_iterations: int | None = option(None, "PPO iterations (default: the task preset)", range=above(0),
                                        group=UPDATE)
    stages_config: str | None = option(None, "YAML with optional 'sft', 'rm' and 'ppo' sections overriding any stage field",
                                       group=UPDATE)

    # --- hardware
    num_threads: int = option(0, "torch CPU threads (0: torch's default, one per core); use 1 when another job "
                                 "holds a core: tiny models then slow down badly with more threads", range=THREADS,
                              group=HARDWARE)

    # --- run folder, evaluation, logging, checkpoints
    out: str = option("runs/demo", "run folder for the whole pipeline", group=RUN, first=True)
    overwrite: bool = option(False, "replace the demo run already in --out (all three stages)", group=RUN, first=True)
    seed: int = option(0, "random seed for every stage", range=SEEDS, group=RUN)
    show_samples: int = option(6, "prompts to print with their responses before and after PPO", range=at_least(0),
                               group=RUN)


def stage_configs(config: DemoConfig) -> tuple[SFTConfig, RewardConfig, PPOConfig]:
    out = Path(config.out)
    overrides = load_yaml(config.stages_config) if config.stages_config else {}
    unknown = set(overrides) - {"sft", "rm", "ppo"}
    if unknown:
        raise ConfigError(f"unknown section(s) {sorted(unknown)} in {config.stages_config}; allowed: sft, rm, ppo")
    for section, values in overrides.items():
        if not isinstance(values, dict):
            raise ConfigError(f"section '{section}' in {config.stages_config} must be a mapping of {section} fields "
                              f"to values, got {type(values).__name__}")
    common = {"seed": config.seed, "num_threads": config.num_threads, "overwrite": config.overwrite}
    sft = {**SFT_PRESET, **common, "out": str(out / "sft"), "task": "doubling"}
    rm = {**RM_PRESET, **common, "out": str(out / "rm"), "task": "doubling"}
    ppo = {**PPO_PRESET, **common, "out": str(out), "critic": config.critic,
           "model": str(out / "sft" / "checkpoints" / "sft")}
    if config.reward == "model":
        ppo["reward_model"] = str(out / "rm" / "checkpoints" / "reward")
    for values, key, name in ((sft, "sft_steps", "steps"), (rm, "rm_steps", "steps"), (ppo, "ppo_iterations", "iterations")):
        if getattr(config, key) is not None:
            values[name] = getattr(config, key)
    sft.update(overrides.get("sft", {}))
    rm.update(overrides.get("rm", {}))
    ppo.update(overrides.get("ppo", {}))
    source = config.stages_config or "demo presets"
    return (build_config(SFTConfig, sft, source), build_config(RewardConfig, rm, source),
            build_config(PPOConfig, ppo, source))


def _print_samples(title: str, samples: list[dict]) -> None:
    print(title)
    for sample in samples:
        print(f"  {sample['prompt']:<16} before: {sample['before'] or '(empty)':<8} after: {sample['after'] or '(empty)'}")


def _accuracy_line(name: str, metrics: dict, prefix: str) -> str:
    keys = ("exact_match", "value_correct", "style_correct")
    return f"  {name:<26}" + "  ".join(f"{k} {100 * metrics.get(prefix + k, float('nan')):6.2f}%" for k in keys)


def stop_between_stages(done: int) -> None:
    """A stop that came during a stage's last step let the stage finish (interrupts.stop_after); the
    next stage is not begun."""
    if stop_requested():
        raise RunInterrupted(done, "stage", None)


def run_demo(config: DemoConfig) -> dict:
    start = time.perf_counter()
    sft_config, rm_config, ppo_config = stage_configs(config)
    # Every stage's run folder is checked before the first one runs, not after SFT has trained.
    for stage_config in (sft_config, rm_config):
        check_run_folder(stage_config.out, stage_config.overwrite)
    check_run_folder(ppo_config.out, ppo_config.overwrite, resumable=Path(ppo_config.out) / "checkpoints" / "last")
    record = {"demo": to_dict(config), "sft": to_dict(sft_config), "rm": to_dict(rm_config), "ppo": to_dict(ppo_config)}

    print(f"[1/3] SFT on unprefixed data ({sft_config.steps} steps) -> {sft_config.out}")
    sft = run_sft(sft_config)
    print(f"      {sft['seconds']:.1f}s")
    stop_between_stages(1)
    print(f"[2/3] reward model: style classifier ({rm_config.steps} steps) -> {rm_config.out}")
    rm = run_reward(rm_config)
    print(f"      held-out accuracy {100 * rm['eval_accuracy']:.2f}%, {rm['seconds']:.1f}s")
    stop_between_stages(2)
    reward_name = "learned reward model" if config.reward == "model" else "rule-based reward"
    print(f"[3/3] PPO with the {reward_name} ({ppo_config.iterations} iterations) -> {ppo_config.out}")
    ppo = run_ppo(ppo_config, config_record=record, show_samples=config.show_samples)
    print(f"      {ppo['ppo_seconds']:.1f}s of PPO")

    total = time.perf_counter() - start
    print(f"\nHeld-out prompts ({ppo_config.eval_size}), exact-match / value / style:")
    print(_accuracy_line("SFT, greedy", ppo["before"], "eval/"))
    print(_accuracy_line("after PPO, greedy", ppo["after"], "eval/"))
    if ppo["after_sampled"]:
        print(_accuracy_line("after PPO, sampled (T=1)", ppo["after_sampled"], "eval_sampled/"))
    _print_samples("\nSamples (greedy):", ppo["samples"])
    summary = {
        **ppo,
        "stage": "demo",
        "reward": config.reward,
        "total_seconds": round(total, 2),
        "sft_seconds": sft["seconds"],
        "rm_seconds": rm["seconds"],
        "rm_eval_accuracy": rm["eval_accuracy"],
        "checkpoints": {"sft": sft["checkpoints"]["sft"], "reward": rm["checkpoints"]["reward"], **ppo["checkpoints"]},
    }
    atomic_write_json(Path(config.out) / "summary.json", summary)
    print(f"\nDone in {total:.1f}s.  Summary: {Path(config.out) / 'summary.json'}   Curves: {Path(config.out) / 'curves.png'}")
    return summary
