"""Settings of the gym PPO trainer, and named presets.

Kept apart from the trainer so that building the command-line parser does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ppo_rlhf.config import (HARDWARE, MODEL_DATA, REWARD, ROLLOUT, RUN, SEEDS, UPDATE, above, any_number,
                             at_least, between, check, option)
from ppo_rlhf.run_folder import RunFolderOptions
from ppo_rlhf.trackers import ReportOptions


@dataclass
class GymPPOConfig(RunFolderOptions, ReportOptions):
    """Defaults follow CleanRL's ppo.py; the presets below follow the RL Baselines3 Zoo."""

    # --- model and data
    env_id: str = option("CartPole-v1", "gymnasium environment id; Discrete or Box actions, flat Box observations", flag="--env",
                         group=MODEL_DATA, first=True)
    hidden_sizes: list[int] = option([64, 64], "hidden layer widths of the actor and of the critic (separate MLPs); empty = linear",
                                     range=at_least(1), group=MODEL_DATA)
    activation: str = option("tanh", "hidden activation", choices=("tanh", "relu"), group=MODEL_DATA)
    log_std_init: float = option(0.0, "initial log std of the Gaussian policy (Box actions only); state-independent",
                                 range=any_number(), group=MODEL_DATA)
    norm_obs: bool = option(False, "normalise observations by running mean/std (clipped to +-10); the stats are saved with the policy",
                            group=MODEL_DATA)

    # --- reward
    norm_reward: bool = option(False, "scale rewards by the running std of the discounted return (like SB3's VecNormalize)",
                               group=REWARD)

    # --- rollout
    total_steps: int = option(100_000, "environment steps over all envs; rounded down to whole rollouts of num_envs * num_steps",
                              range=at_least(1), group=ROLLOUT, first=True)
    num_envs: int = option(4, "parallel envs (SyncVectorEnv, one process); more envs = more decorrelated batches, fewer updates",
                           range=at_least(1), group=ROLLOUT, first=True)
    num_steps: int = option(128, "steps per env per rollout; the batch is num_envs * num_steps samples",
                            range=at_least(1), group=ROLLOUT, first=True)

    # --- update and loss
    lr: float = option(2.5e-4, "Adam learning rate (Adam eps 1e-5)", range=above(0), group=UPDATE, first=True)
    ppo_epochs: int = option(4, "passes over each batch; more reuses data harder and risks moving the policy too far",
                             range=at_least(1), group=UPDATE)
    mini_batch_size: int = option(128, "samples per gradient step; must divide num_envs * num_steps", range=at_least(1),
                                  group=UPDATE)
    gamma: float = option(0.99, "discount; 1 / (1 - gamma) is roughly the horizon the critic looks ahead",
                          range=between(0, 1, low_open=True), group=UPDATE)
    lam: float = option(0.95, "GAE lambda: 1 = Monte-Carlo returns (high variance), 0 = one-step TD (high bias)",
                        range=between(0, 1), group=UPDATE)
    clip_ratio: float = option(0.2, "PPO clip epsilon: the policy ratio is clipped to [1 - eps, 1 + eps]",
                               range=between(0, 1, low_open=True, high_open=True), group=UPDATE)
    anneal_lr: bool = option(True, "decay lr linearly to 0 over the run (SB3 zoo's 'lin_<lr>')", group=UPDATE)
    anneal_clip: bool = option(False, "decay clip_ratio linearly to 0 over the run too (SB3 zoo's 'lin_0.2')",
                               group=UPDATE)
    cliprange_value: float | None = option(
        0.2, "clip each value prediction to old value +- this; 'none' disables.  In return units: "
        "with large unscaled returns it slows the critic badly", range=above(0), group=UPDATE)
    vf_coef: float = option(0.5, "weight of the value loss; ours is 0.5 * squared error, so 1.0 here equals SB3's 0.5",
                            range=at_least(0), group=UPDATE)
    entropy_coef: float = option(0.01, "weight of the entropy bonus; 0 lets the policy become deterministic as fast as it likes",
                                 range=at_least(0), group=UPDATE)
    max_grad_norm: float = option(0.5, "clip the global gradient norm (actor and critic together) to this",
                                  range=above(0), group=UPDATE)
    norm_adv: bool = option(True, "whiten advantages per minibatch (mean 0, std 1)", group=UPDATE)
    max_approx_kl: float | None = option(
        None, "stop this iteration's remaining minibatches once a minibatch's approx_kl exceeds this (SB3's target_kl, "
        "which stops at 1.5x its value; the language-model trainer's option of the same name); 'none' disables",
        range=above(0), group=UPDATE)
    max_bad_steps: int = option(5, "stop after this many updates or rollouts in a row with a non-finite loss, gradient "
                                   "norm, env reward or observation (each is skipped)", range=at_least(1),
                                group=UPDATE)

    # --- hardware
    threads: int = option(1, "torch CPU threads; tiny MLPs run fastest on one", range=at_least(1), group=HARDWARE)

    # --- run folder, evaluation, logging, checkpoints
    out_dir: str | None = option(None, "run folder; default runs/gym/<env>-seed<seed>", flag="--out",
                                 group=RUN, first=True)
    resume: bool = option(False, "continue the run in --out from RUN/checkpoints/last (its settings must match but "
                                 "for total_steps, lr, evaluation episodes and threads)", group=RUN, first=True)
    seed: int = option(1, "seeds torch and the envs (env i gets seed + i); on one thread the same seed gives the same run",
                       range=SEEDS, group=RUN)
    save_every: int = option(
        0, "every N iterations, write a resumable checkpoint (RUN/checkpoints/last) and restart the envs from a seed "
        "derived from the iteration, cutting the episodes in flight as a time limit would: an env's state cannot be "
        "saved in general, so a resumed run restarts them the same way and equals a straight run.  0: no checkpoints, "
        "envs never restarted", range=at_least(0), group=RUN)
    eval_episodes: int = option(100, "episodes of deterministic evaluation of the saved policy at the end; 0 skips it",
                                range=at_least(0), group=RUN)
    may_change_on_resume: ClassVar[frozenset] = frozenset({
        "total_steps", "lr", "eval_episodes", "threads", "resume", "overwrite", "out_dir", "max_bad_steps", "report_to"})

    @property
    def batch_size(self) -> int:
        return self.num_envs * self.num_steps

    @property
    def num_iterations(self) -> int:
        return self.total_steps // self.batch_size

    def validate(self) -> None:
        check(self.total_steps >= self.batch_size, "total_steps",
              f"at least one rollout, num_envs * num_steps = {self.batch_size}", self.total_steps)
        check(self.batch_size % self.mini_batch_size == 0, "mini_batch_size",
              f"a divisor of num_envs * num_steps = {self.batch_size}", self.mini_batch_size)
        check(self.mini_batch_size >= 2 or not self.norm_adv, "mini_batch_size",
              "at least 2 when norm_adv whitens advantages per minibatch", self.mini_batch_size)

    def resolved_out_dir(self) -> Path:
        return Path(self.out_dir or f"runs/gym/{self.env_id}-seed{self.seed}")


# Tuned settings from the RL Baselines3 Zoo (hyperparams/ppo.yml), translated to our names.  The
# same values live in configs/gym/<name>.yaml (a test keeps them equal).
PRESETS: dict[str, dict[str, Any]] = {
    "cartpole": dict(
        env_id="CartPole-v1", total_steps=100_000, num_envs=8, num_steps=32, mini_batch_size=256,
        gamma=0.98, lam=0.8, ppo_epochs=20, entropy_coef=0.0, lr=0.001, anneal_lr=True, clip_ratio=0.2,
        anneal_clip=True, cliprange_value=None, vf_coef=1.0, max_grad_norm=0.5,
    ),
    # The zoo uses gSDE and lr 1e-3 here.  With a state-independent log-std instead, lr 1e-3 let the
    # policy collapse on 2 of 3 seeds (benchmarks/results/gym.md); lr 3e-4 did not.
    "pendulum": dict(
        env_id="Pendulum-v1", total_steps=200_000, num_envs=4, num_steps=1024, mini_batch_size=64,
        gamma=0.9, lam=0.95, ppo_epochs=10, entropy_coef=0.0, lr=0.0003, anneal_lr=False, clip_ratio=0.2,
        anneal_clip=False, cliprange_value=None, vf_coef=1.0, max_grad_norm=0.5,
        norm_obs=True, norm_reward=True,
    ),
}


def preset_for_env(env_id: str) -> str | None:
    return next((name for name, values in PRESETS.items() if values["env_id"] == env_id), None)


def config_with_preset(preset: str, values: dict[str, Any]) -> dict[str, Any]:
    """Preset values under ``values``.  ``preset``: a name, 'auto' (the env's preset if it has one) or 'none'."""
    if preset == "auto":
        preset = preset_for_env(values.get("env_id", GymPPOConfig.env_id)) or "none"
    if preset == "none":
        return dict(values)
    return {**PRESETS[preset], **values}
