"""Classic PPO on gymnasium (Schulman et al., 2017), on the same core as the language-model trainer.

One iteration: (1) collect ``num_steps`` steps from ``num_envs`` vector envs with the current
policy; (2) GAE over the rollout, bootstrapping from V(final observation) where a time limit
truncated an episode and from 0 where it terminated; (3) ``ppo_epochs`` passes of minibatch
updates on the clipped policy loss, the (optionally clipped) value loss and an entropy bonus;
(4) log; (5) every ``save_every`` iterations, a resumable checkpoint and a restart of the envs.
The mapping to language models: first state = prompt, action = token, next state =
prompt + tokens so far, trajectory = response.

Layout of rollout tensors: (T, N, ...) with T = ``num_steps``, N = ``num_envs``; flattened for
the update into a batch of B = T * N samples (``b_`` names), minibatches of ``mini_batch_size``
(``mb_`` names).
"""

from __future__ import annotations

import collections
import difflib
import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from ppo_rlhf.config import ConfigError, to_dict
from ppo_rlhf.core import explained_variance, gae_advantages, masked_whiten, policy_loss, value_loss
from ppo_rlhf.interrupts import RunInterrupted, stop_after
from ppo_rlhf.run_folder import check_run_folder, start_run_folder
from ppo_rlhf.runlog import RunLog
from ppo_rlhf.trainers.guard import DivergenceGuard, require_finite
from ppo_rlhf.trainers.gym_agent import ActorCritic, RunningMeanStd, load_policy, save_policy, space_spec
from ppo_rlhf.trainers.gym_config import GymPPOConfig
from ppo_rlhf.trainers.resume import check_resume_settings, open_checkpoints, resumable


def registered_spec(env_id: str) -> gym.envs.registration.EnvSpec:
    """The registry entry of ``env_id``, or a ConfigError naming --env.  ``module:Env-v0``, as
    gymnasium's ``make`` reads it: the module is imported first, since importing it is what
    registers the user's env."""
    module, name = env_id.split(":", 1) if ":" in env_id else (None, env_id)
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ConfigError(f"--env {env_id}: cannot import {module!r}, the module that should register "
                              f"{name!r} ({error}); is it on PYTHONPATH?") from None
    if name not in gym.registry:
        close = difflib.get_close_matches(name, list(gym.registry), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        where = f" (importing {module!r} did not register it)" if module else ""
        raise ConfigError(f"unknown gymnasium environment {env_id!r} (--env){where}{hint}")
    return gym.registry[name]


def install_hint(spec: gym.envs.registration.EnvSpec) -> str:
    """The pip command for a gymnasium env family's optional packages (box2d, mujoco, ...)."""
    parts = str(spec.entry_point).split(".")
    if parts[:2] == ["gymnasium", "envs"] and len(parts) > 3:
        return f'pip install "gymnasium[{parts[2]}]"'
    return "install the package the environment needs"


def check_env(env_id: str) -> None:
    """Refuse at start, naming --env, what training could not use: a missing optional package,
    spaces other than a flat Box of observations and Discrete or bounded flat Box actions (Dict,
    Tuple, MultiDiscrete ... are not flattened here), observations unlike the declared space."""
    spec = registered_spec(env_id)
    try:
        env = gym.make(env_id)
    except gym.error.DependencyNotInstalled as error:
        hint = "" if "pip install" in str(error) else f"; {install_hint(spec)}"
        raise ConfigError(f"--env {env_id} needs a package that is not installed: {error}{hint}") from None
    try:
        try:
            space_spec(env.observation_space, env.action_space)
        except ValueError as error:
            raise ConfigError(f"--env {env_id}: {error}") from None
        action = env.action_space
        if isinstance(action, gym.spaces.Box) and not (np.isfinite(action.low).all() and np.isfinite(action.high).all()):
            raise ConfigError(f"--env {env_id}: the action space {action} has infinite bounds; actions are clipped "
                              f"to them, so they must be finite")
        observation, _ = env.reset(seed=0)
        observation = np.asarray(observation)
        if observation.shape != env.observation_space.shape or not np.issubdtype(observation.dtype, np.number):
            raise ConfigError(f"--env {env_id}: reset() returned an observation of shape {observation.shape} "
                              f"({observation.dtype}), unlike its declared space {env.observation_space}")
    finally:
        env.close()


def make_envs(env_id: str, num_envs: int) -> gym.vector.SyncVectorEnv:
    check_env(env_id)
    # SAME_STEP autoreset: a finished env is reset inside step() and its last observation comes
    # back in infos["final_obs"] -- exactly what bootstrapping a truncated episode needs.
    return gym.vector.SyncVectorEnv(
        [lambda: gym.make(env_id) for _ in range(num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )


@dataclass
class Rollout:
    """One batch of experience.  T = num_steps, N = num_envs."""

    obs: torch.Tensor  # (T, N, obs_dim) the observation each action was taken in (normalised if norm_obs)
    actions: torch.Tensor  # (T, N) int64, or (T, N, act_dim) unclipped Gaussian samples
    logprobs: torch.Tensor  # (T, N) log-prob of the action under the rollout policy
    values: torch.Tensor  # (T, N) V(obs)
    rewards: torch.Tensor  # (T, N) reward after the action (scaled if norm_reward)
    terminated: torch.Tensor  # (T, N) 1.0 where the episode really ended after step t
    truncated: torch.Tensor  # (T, N) 1.0 where a time limit cut the episode after step t
    final_values: torch.Tensor  # (T, N) V(final observation) where truncated, else 0
    last_values: torch.Tensor  # (N,) V(observation after the last step), to bootstrap the rollout's end


def compute_advantages(rollout: Rollout, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a rollout: (advantages, returns), each (T, N).

    What follows step t: the next step's value while the episode goes on; V(final observation)
    after a truncation (the episode was cut, not over); nothing (0) after a termination.  The
    recursion stops at every episode end, since step t + 1 then belongs to a new episode.
    """
    next_values = torch.cat([rollout.values[1:], rollout.last_values[None]])  # (T, N)
    next_values = torch.where(rollout.truncated.bool(), rollout.final_values, next_values)
    next_values = next_values * (1.0 - rollout.terminated)
    continues = 1.0 - torch.maximum(rollout.terminated, rollout.truncated)
    # The core works along the last dim: put time there, (T, N) -> (N, T), and back.
    advantages = gae_advantages(
        rollout.rewards.T, rollout.values.T, next_values.T, continues.T, gamma, lam
    ).T
    return advantages, advantages + rollout.values


class RolloutCollector:
    """Steps the vector envs with the current policy; keeps the env state between rollouts.

    The running statistics never take in a non-finite observation or return: one NaN would make
    every later normalised value NaN.  (The rollout still holds it, for the divergence guard.)"""

    def __init__(self, envs: gym.vector.VectorEnv, config: GymPPOConfig):
        self.envs, self.num_steps, self.gamma = envs, config.num_steps, config.gamma
        n = envs.num_envs
        obs_dim = envs.single_observation_space.shape[0]
        self.obs_rms = RunningMeanStd((obs_dim,)) if config.norm_obs else None
        self.return_rms = RunningMeanStd(()) if config.norm_reward else None
        self.discounted_return = np.zeros(n)  # per env, for reward scaling
        self.episode_return, self.episode_length = np.zeros(n), np.zeros(n, dtype=np.int64)
        self.finished_returns: collections.deque = collections.deque(maxlen=100)
        self.finished_lengths: collections.deque = collections.deque(maxlen=100)
        self.restart(config.seed)

    def restart(self, seed: int) -> None:
        """Reset every env from ``seed`` (env i from seed + i); episodes in flight are cut."""
        raw_obs, _ = self.envs.reset(seed=seed)
        self.discounted_return[:] = 0.0
        self.episode_return[:], self.episode_length[:] = 0.0, 0
        self.next_obs = self._observe(raw_obs, update_stats=True)  # (N, obs_dim)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the running statistics and the last finished episodes (the
        envs themselves restart, see GymPPOConfig.save_every)."""
        return {"obs_rms": self.obs_rms.state_dict() if self.obs_rms else None,
                "return_rms": self.return_rms.state_dict() if self.return_rms else None,
                "finished_returns": list(self.finished_returns), "finished_lengths": list(self.finished_lengths)}

    def load_state_dict(self, state: dict) -> None:
        if self.obs_rms is not None:
            self.obs_rms = RunningMeanStd.from_state_dict(state["obs_rms"])
        if self.return_rms is not None:
            self.return_rms = RunningMeanStd.from_state_dict(state["return_rms"])
        self.finished_returns.extend(state["finished_returns"])
        self.finished_lengths.extend(state["finished_lengths"])

    def _observe(self, raw_obs: np.ndarray, update_stats: bool) -> np.ndarray:
        """The observation as the network sees it: float32, normalised if norm_obs."""
        if self.obs_rms is not None:
            if update_stats and np.isfinite(raw_obs).all():
                self.obs_rms.update(raw_obs)
            return self.obs_rms.normalize(raw_obs)
        return raw_obs.astype(np.float32, copy=False)

    def _scale_rewards(self, rewards: np.ndarray, done: np.ndarray) -> np.ndarray:
        if self.return_rms is None:
            return rewards
        self.discounted_return = self.discounted_return * self.gamma + rewards
        finite = np.isfinite(self.discounted_return)
        if finite.all():
            self.return_rms.update(self.discounted_return)
        self.discounted_return[done | ~finite] = 0.0
        return np.clip(rewards / np.sqrt(self.return_rms.var + 1e-8), -10.0, 10.0)

    @torch.no_grad()
    def collect(self, agent: ActorCritic) -> Rollout:
        # numpy buffers: writing a row costs ~1 us against ~5 us for a torch tensor, and the env
        # speaks numpy anyway.  One numpy -> torch conversion per step (the observation).
        T, N = self.num_steps, self.envs.num_envs
        obs = np.zeros((T, *self.next_obs.shape), dtype=np.float32)
        actions = np.zeros((T, N, agent.spec["act_dim"]), dtype=np.float32) if agent.continuous else np.zeros((T, N), dtype=np.int64)
        logprobs, values, rewards, terminated, truncated, final_values = (np.zeros((T, N), dtype=np.float32) for _ in range(6))
        for step in range(T):
            obs[step] = self.next_obs
            action, logprob, value = agent.act(torch.from_numpy(self.next_obs))
            actions[step], logprobs[step], values[step] = action.numpy(), logprob.numpy(), value.numpy()
            raw_obs, reward, term, trunc, infos = self.envs.step(agent.to_env_action(actions[step]))
            done = term | trunc

            self.episode_return += reward
            self.episode_length += 1
            for i in np.flatnonzero(done):
                self.finished_returns.append(float(self.episode_return[i]))
                self.finished_lengths.append(int(self.episode_length[i]))
            self.episode_return[done], self.episode_length[done] = 0.0, 0

            # A truncated episode did not end: bootstrap from the value of where it was cut.
            # raw_obs already holds the reset observation of that env; the last one is in infos.
            cut = np.flatnonzero(trunc & ~term)
            if len(cut):
                final_obs = self._observe(np.stack(infos["final_obs"][cut]), update_stats=False)
                final_values[step, cut] = agent.value(torch.from_numpy(final_obs)).numpy()

            rewards[step] = self._scale_rewards(reward, done)
            terminated[step], truncated[step] = term, trunc
            self.next_obs = self._observe(raw_obs, update_stats=True)
        last_values = agent.value(torch.from_numpy(self.next_obs))
        return Rollout(*(torch.from_numpy(x) for x in (obs, actions, logprobs, values, rewards, terminated,
                                                        truncated, final_values)), last_values=last_values)


def ppo_update(
    agent: ActorCritic, optimizer: torch.optim.Optimizer, config: GymPPOConfig, clip_ratio: float,
    b_obs: torch.Tensor, b_actions: torch.Tensor, b_logprobs: torch.Tensor, b_values: torch.Tensor,
    b_advantages: torch.Tensor, b_returns: torch.Tensor, guard: DivergenceGuard | None = None, iteration: int = 0,
) -> dict[str, float]:
    """``ppo_epochs`` passes of minibatch steps over one flattened batch; stats averaged over all
    minibatches taken (``guard`` skips those with a non-finite loss or gradient norm)."""
    totals: dict[str, torch.Tensor] = collections.defaultdict(lambda: torch.zeros(()))
    num_minibatches, stopped_early = 0, False
    for epoch in range(config.ppo_epochs):
        b_inds = torch.randperm(config.batch_size)
        for start in range(0, config.batch_size, config.mini_batch_size):
            mb_inds = b_inds[start:start + config.mini_batch_size]
            new_logprobs, entropy, new_values = agent.evaluate_actions(b_obs[mb_inds], b_actions[mb_inds])
            mb_advantages = b_advantages[mb_inds]
            if config.norm_adv:
                mb_advantages = masked_whiten(mb_advantages, None)

            pg_loss, pg_stats = policy_loss(new_logprobs, b_logprobs[mb_inds], mb_advantages, None, clip_ratio)
            if config.max_approx_kl is not None and pg_stats["approx_kl"].item() > config.max_approx_kl:
                stopped_early = True  # the policy already moved far enough: skip this step and the rest
                break
            vf_loss, vf_stats = value_loss(new_values, b_values[mb_inds], b_returns[mb_inds], None, config.cliprange_value)
            entropy_bonus = entropy.mean()
            loss = pg_loss + config.vf_coef * vf_loss
            if config.entropy_coef > 0:  # with no weight, leave it out of the graph: a cheaper backward
                loss = loss - config.entropy_coef * entropy_bonus

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(agent.parameters(), config.max_grad_norm, foreach=True)
            if guard is None:
                optimizer.step()
            elif not guard.step(optimizer, iteration, loss=loss, grad_norm=grad_norm):
                continue

            for key, value in {**pg_stats, **vf_stats, "entropy": entropy_bonus.detach()}.items():
                totals[key] += value
            num_minibatches += 1
        if stopped_early:
            break
    stats = {key: (value / max(num_minibatches, 1)).item() for key, value in totals.items()}
    stats.update(minibatch_steps=num_minibatches, epochs=epoch + 1, stopped_early=float(stopped_early))
    return stats


def restart_seed(config: GymPPOConfig, iteration: int) -> int:
    """The seed the envs restart from after ``iteration``: env seeds never repeat within a run."""
    return config.seed + iteration * config.num_envs


def train(config: GymPPOConfig) -> dict[str, Any]:
    """Train, save the policy to RUN/policy, evaluate it, write the run folder; returns the summary."""
    out_dir, envs, checkpoints, log = open_gym_run(config)
    first_iteration = checkpoints.step
    agent = ActorCritic(space_spec(envs.single_observation_space, envs.single_action_space),
                        config.hidden_sizes, config.activation, config.log_std_init)
    # fused: one kernel for the whole parameter update instead of a dozen per tensor (~4x faster here)
    optimizer = torch.optim.Adam(agent.parameters(), lr=config.lr, eps=1e-5, fused=True)
    collector = RolloutCollector(envs, config)
    guard = DivergenceGuard(config.max_bad_steps, unit="iteration")
    seconds_before = 0.0
    if first_iteration:
        saved = checkpoints.restore(agent, optimizer)
        collector.load_state_dict(saved["collector"])
        guard.load_state_dict(saved["guard"])
        seconds_before = saved["seconds"]
        if first_iteration < config.num_iterations:
            collector.restart(restart_seed(config, first_iteration))  # as the straight run did after saving

    start_time = time.perf_counter() - seconds_before
    env_steps = first_iteration * config.batch_size
    for iteration in range(first_iteration, config.num_iterations):
        done = iteration + 1
        # 1. schedules: linear decay from the full value at the first iteration towards 0
        remaining = 1.0 - iteration / config.num_iterations
        lr = config.lr * remaining if config.anneal_lr else config.lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        clip_ratio = config.clip_ratio * remaining if config.anneal_clip else config.clip_ratio

        # 2. rollout; one holding a non-finite reward or observation teaches nothing: skipped
        rollout = collector.collect(agent)
        env_steps += config.batch_size
        metrics: dict[str, Any] = {"env_steps": env_steps}
        if not guard.skip(done, reward=rollout.rewards, observation=rollout.obs):
            metrics.update(learn_from(rollout, agent, optimizer, config, clip_ratio, guard, done), lr=lr)

        # 5. log
        metrics.update(skipped_steps=guard.skipped, sps=env_steps / (time.perf_counter() - start_time))
        log_iteration(log, metrics, agent, collector, config, done)

        # 6. checkpoint, then the envs restart from a seed of this iteration's (in a resumed run too)
        if checkpoints.due(done, config.num_iterations):
            checkpoints.save(done, agent, optimizer, {"collector": collector.state_dict(), "guard": guard.state_dict(),
                                                      "seconds": time.perf_counter() - start_time})
            if done < config.num_iterations:
                collector.restart(restart_seed(config, done))
        # 7. Ctrl-C: stop here.  No checkpoint of its own: one would restart the envs where a
        # straight run does not, so a resume continues from the last scheduled one (interrupts.py).
        if stop_after(done, config.num_iterations, "iteration"):  # the last iteration: the run finishes
            raise RunInterrupted(done, "iteration", checkpoints.saved_step)
    envs.close()
    return finish_gym_run(config, out_dir, agent, collector, log, env_steps, time.perf_counter() - start_time)


def open_gym_run(config: GymPPOConfig):
    """(run folder, envs, checkpoints, run log): the folder checked (and, resuming, the settings),
    the envs made (an unknown env stops here, before anything is removed), then the folder taken."""
    config.validate()
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    out_dir = config.resolved_out_dir()
    check_run_folder(out_dir, config.overwrite, config.resume, resumable=resumable(out_dir))
    if config.resume:
        check_resume_settings(config, out_dir)
    envs = make_envs(config.env_id, config.num_envs)
    for notice in start_run_folder(out_dir, config.overwrite):
        print(notice)
    checkpoints = open_checkpoints(config, out_dir, config.num_iterations, "iteration", config.batch_size)
    log = RunLog(out_dir, to_dict(config), resume_after=checkpoints.step * config.batch_size if config.resume else None)
    return out_dir, envs, checkpoints, log


def learn_from(rollout, agent, optimizer, config: GymPPOConfig, clip_ratio: float, guard, done: int) -> dict:
    """Stages 3-4 of an iteration: advantages and returns, flattened (T, N) -> (B,), then the update;
    returns its statistics."""
    advantages, returns = compute_advantages(rollout, config.gamma, config.lam)
    b_obs = rollout.obs.flatten(0, 1)  # (B, obs_dim)
    b_actions = rollout.actions.flatten(0, 1)  # (B,) or (B, act_dim)
    b_logprobs, b_values = rollout.logprobs.flatten(), rollout.values.flatten()
    b_advantages, b_returns = advantages.flatten(), returns.flatten()
    stats = ppo_update(agent, optimizer, config, clip_ratio,
                       b_obs, b_actions, b_logprobs, b_values, b_advantages, b_returns, guard, done)
    return {**stats, "clip_ratio": clip_ratio,
            "explained_variance": explained_variance(b_values, b_returns, None).item()}


def log_iteration(log: RunLog, metrics: dict, agent, collector, config: GymPPOConfig, done: int) -> None:
    """Stage 5: the policy's spread and the returns of the last (up to) 100 finished episodes,
    logged; a line on the console every tenth of the run."""
    if agent.continuous:
        metrics["action_std"] = agent.log_std.exp().mean().item()
    if collector.finished_returns:
        metrics["episodic_return"] = float(np.mean(collector.finished_returns))
        metrics["episodic_length"] = float(np.mean(collector.finished_lengths))
    log.log(metrics["env_steps"], metrics)
    if done % max(1, config.num_iterations // 10) == 0:
        print(f"env_steps {metrics['env_steps']:>9,}  return {metrics.get('episodic_return', float('nan')):8.1f}  "
              f"approx_kl {metrics.get('approx_kl', float('nan')):.4f}  sps {metrics['sps']:6.0f}", flush=True)


def finish_gym_run(config: GymPPOConfig, out_dir, agent, collector, log: RunLog, env_steps: int,
                   train_time: float) -> dict[str, Any]:
    """The policy saved (and scored from its files), the summary and the plots written."""
    require_finite(agent.state_dict(), "the policy")
    policy_dir = save_policy(out_dir / "policy", agent, config.env_id, collector.obs_rms)
    summary: dict[str, Any] = {
        "env_id": config.env_id, "seed": config.seed, "env_steps": env_steps, "iterations": config.num_iterations,
        "train_time_s": round(train_time, 3), "sps": round(env_steps / train_time, 1),
        "final_episodic_return": float(np.mean(collector.finished_returns)) if collector.finished_returns else None,
        "policy": str(policy_dir),
    }
    if config.eval_episodes > 0:
        # Score the saved files, not the in-memory agent: proves the saved policy is the trained one.
        result = evaluate_policy(policy_dir, config.eval_episodes, seed=config.seed + 10_000)
        summary.update({f"eval_{key}": value for key, value in result.items()})
    log.write_summary(summary)
    log.plot(["episodic_return"], "return.png", x="env_steps", title=f"{config.env_id}: return vs env steps")
    log.plot(["episodic_return", "episodic_length", "pg_loss", "vf_loss", "entropy", "approx_kl", "clipfrac",
              "explained_variance", "sps"], "curves.png", x="env_steps", title=config.env_id)
    log.close()
    return summary


@torch.no_grad()
def evaluate_policy(path: str | Path, episodes: int = 100, seed: int = 0, deterministic: bool = True) -> dict[str, Any]:
    """Run a saved policy for exactly ``episodes`` episodes; greedy (argmax / mean action) by default.

    Every env runs a fixed quota of episodes, so short episodes cannot crowd out long ones.
    """
    agent, policy_config, obs_rms = load_policy(path)
    num_envs = max(1, min(episodes, 10))
    envs = make_envs(policy_config["env_id"], num_envs)
    quotas = np.array([(episodes + i) // num_envs for i in range(num_envs)])
    returns: list[list[float]] = [[] for _ in range(num_envs)]
    lengths: list[list[int]] = [[] for _ in range(num_envs)]
    episode_return, episode_length = np.zeros(num_envs), np.zeros(num_envs, dtype=np.int64)
    raw_obs, _ = envs.reset(seed=seed)
    while any(len(r) < q for r, q in zip(returns, quotas)):
        obs = torch.as_tensor(obs_rms.normalize(raw_obs) if obs_rms else raw_obs, dtype=torch.float32)
        action = agent.deterministic_action(obs) if deterministic else agent.act(obs)[0]
        raw_obs, reward, term, trunc, _ = envs.step(agent.to_env_action(action.numpy()))
        episode_return += reward
        episode_length += 1
        for i in np.flatnonzero(term | trunc):
            if len(returns[i]) < quotas[i]:
                returns[i].append(float(episode_return[i]))
                lengths[i].append(int(episode_length[i]))
            episode_return[i], episode_length[i] = 0.0, 0
    envs.close()
    all_returns = np.array([r for env_returns in returns for r in env_returns])
    all_lengths = np.array([n for env_lengths in lengths for n in env_lengths])
    return {
        "episodes": int(len(all_returns)), "mean_return": float(all_returns.mean()), "std_return": float(all_returns.std()),
        "min_return": float(all_returns.min()), "max_return": float(all_returns.max()),
        "mean_length": float(all_lengths.mean()), "deterministic": deterministic, "seed": seed,
    }
