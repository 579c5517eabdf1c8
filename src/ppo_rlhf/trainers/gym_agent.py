"""The gym actor-critic: two small MLPs, running observation statistics, and save / load.

The actor outputs a Categorical over a ``Discrete`` action space, or a diagonal Gaussian with a
state-independent log-std over a ``Box`` action space.  The critic is a separate MLP (no shared
trunk): on small control tasks a shared trunk lets the value loss disturb the policy features.

A saved policy is a folder that needs nothing from the run that made it:

    POLICY/
      config.json         env id, spaces, network shape, observation-normalisation statistics
      model.safetensors   the weights
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ppo_rlhf.checkpoint import atomic_directory, atomic_write_json
from ppo_rlhf.core.normalize import merge_moments

POLICY_FORMAT = "ppo-rlhf-gym-policy/1"
SPEC_KEYS = ("obs_dim", "action_type", "act_dim", "action_low", "action_high")
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


class RunningMeanStd:
    """Running mean and variance of observations (parallel algorithm of Chan et al.), in float64."""

    def __init__(self, shape: tuple[int, ...], clip: float = 10.0, eps: float = 1e-8):
        self.mean = np.zeros(shape, dtype=np.float64)
        self.var = np.ones(shape, dtype=np.float64)
        self.count = 1e-4  # a tiny prior count so the first update does not divide by zero
        self.clip = clip
        self.eps = eps

    def update(self, batch: np.ndarray) -> None:
        self.mean, self.var, self.count = merge_moments(
            self.mean, self.var, self.count, batch.mean(axis=0), batch.var(axis=0), batch.shape[0]
        )

    def normalize(self, x: np.ndarray) -> np.ndarray:
        return np.clip((x - self.mean) / np.sqrt(self.var + self.eps), -self.clip, self.clip).astype(np.float32)

    def state_dict(self) -> dict:
        return {"mean": self.mean.tolist(), "var": self.var.tolist(), "count": self.count, "clip": self.clip}

    @classmethod
    def from_state_dict(cls, state: dict) -> "RunningMeanStd":
        rms = cls(np.asarray(state["mean"]).shape, clip=state["clip"])
        rms.mean = np.asarray(state["mean"], dtype=np.float64)
        rms.var = np.asarray(state["var"], dtype=np.float64)
        rms.count = state["count"]
        return rms


def layer_init(layer: nn.Linear, gain: float = math.sqrt(2), bias: float = 0.0) -> nn.Linear:
    """Orthogonal weights, constant bias: the initialisation PPO's published results rely on."""
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.constant_(layer.bias, bias)
    return layer


def mlp(in_dim: int, hidden_sizes: list[int], out_dim: int, activation: str, out_gain: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for size in hidden_sizes:
        layers += [layer_init(nn.Linear(in_dim, size)), ACTIVATIONS[activation]()]
        in_dim = size
    layers.append(layer_init(nn.Linear(in_dim, out_dim), gain=out_gain))
    return nn.Sequential(*layers)


def space_spec(observation_space: gym.Space, action_space: gym.Space) -> dict:
    """The parts of the spaces the network needs, as plain JSON."""
    if not isinstance(observation_space, gym.spaces.Box) or len(observation_space.shape) != 1:
        raise ValueError(f"its observation space {type(observation_space).__name__} {observation_space} is not supported: "
                         f"only a flat Box (a Dict or Tuple can be flattened with gymnasium.wrappers.FlattenObservation "
                         f"in the env's registration)")
    spec = {"obs_dim": int(observation_space.shape[0])}
    if isinstance(action_space, gym.spaces.Discrete):
        spec.update(action_type="discrete", act_dim=int(action_space.n))
    elif isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
        spec.update(
            action_type="continuous", act_dim=int(action_space.shape[0]),
            action_low=action_space.low.tolist(), action_high=action_space.high.tolist(),
        )
    else:
        raise ValueError(f"its action space {type(action_space).__name__} {action_space} is not supported: only "
                         f"Discrete or a flat Box")
    return spec


class ActorCritic(nn.Module):
    """Actor (policy MLP) and critic (value MLP) for one env's spaces, as described by ``space_spec``."""

    def __init__(self, spec: dict, hidden_sizes: list[int], activation: str = "tanh", log_std_init: float = 0.0):
        super().__init__()
        self.spec = dict(spec)
        self.hidden_sizes = list(hidden_sizes)
        self.activation = activation
        self.continuous = spec["action_type"] == "continuous"
        obs_dim, act_dim = spec["obs_dim"], spec["act_dim"]
        # A small output gain starts the policy near uniform / near its mean, so early updates
        # are not dominated by an arbitrary initial preference (Andrychowicz et al., 2021).
        self.actor = mlp(obs_dim, hidden_sizes, act_dim, activation, out_gain=0.01)
        self.critic = mlp(obs_dim, hidden_sizes, 1, activation, out_gain=1.0)
        if self.continuous:
            self.log_std = nn.Parameter(torch.full((act_dim,), float(log_std_init)))
            self.action_low = np.asarray(spec["action_low"], dtype=np.float32)
            self.action_high = np.asarray(spec["action_high"], dtype=np.float32)

    # The distributions are written out by hand: on batches this small, torch.distributions'
    # bookkeeping costs about a third of the forward pass.
    def _log_prob_and_entropy(self, out: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``out``: actor output (B, act_dim), logits or Gaussian mean.  Returns log-probs (B,), entropies (B,)."""
        if self.continuous:
            # Diagonal Gaussian: the log-density and the entropy are sums over action dimensions.
            log_std = self.log_std.expand_as(out)
            logprobs = -0.5 * ((actions - out) * torch.exp(-log_std)).square() - log_std - HALF_LOG_2PI
            return logprobs.sum(-1), (0.5 + HALF_LOG_2PI + log_std).sum(-1)
        logp_all = torch.log_softmax(out, dim=-1)  # (B, act_dim)
        logprobs = logp_all.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        return logprobs, -(logp_all.exp() * logp_all).sum(-1)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs).squeeze(-1)  # (B,)

    def act(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample actions for a batch of observations: (actions, logprobs (B,), values (B,))."""
        out = self.actor(obs)
        if self.continuous:
            actions = out + self.log_std.exp() * torch.randn_like(out)  # (B, act_dim)
        else:
            # Gumbel-max trick: argmax(logits + Gumbel noise) is a categorical sample, and costs
            # a third of torch.multinomial on these tiny batches.  -log(Exp(1)) ~ Gumbel(0, 1).
            actions = (out - torch.empty_like(out).exponential_().log()).argmax(-1)  # (B,)
        logprobs, _ = self._log_prob_and_entropy(out, actions)
        return actions, logprobs, self.value(obs)

    def evaluate_actions(self, obs: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Log-probs, entropies and values of given actions under the current weights, each (B,)."""
        logprobs, entropy = self._log_prob_and_entropy(self.actor(obs), actions)
        return logprobs, entropy, self.value(obs)

    def deterministic_action(self, obs: torch.Tensor) -> torch.Tensor:
        out = self.actor(obs)
        return out if self.continuous else out.argmax(-1)

    def to_env_action(self, actions: np.ndarray) -> np.ndarray:
        """What the env receives: Gaussian samples are clipped to the box (the stored action is not)."""
        if self.continuous:
            return np.clip(actions, self.action_low, self.action_high)
        return actions


def save_policy(path: str | Path, agent: ActorCritic, env_id: str, obs_rms: RunningMeanStd | None) -> Path:
    """Write the policy folder atomically: a crash leaves the old folder or the new one."""
    path = Path(path)
    with atomic_directory(path) as staging:
        atomic_write_json(staging / "config.json", {
            "format": POLICY_FORMAT,
            "env_id": env_id,
            "hidden_sizes": agent.hidden_sizes,
            "activation": agent.activation,
            **agent.spec,
            "obs_norm": obs_rms.state_dict() if obs_rms is not None else None,
        })
        state = {k: v.detach().contiguous() for k, v in agent.state_dict().items()}
        save_file(state, str(staging / "model.safetensors"))
    return path


def resolve_policy_dir(path: str | Path) -> Path:
    """Accept a policy folder or a run folder that holds one in ``policy/``."""
    path = Path(path)
    for candidate in (path, path / "policy"):
        if (candidate / "config.json").is_file() and (candidate / "model.safetensors").is_file():
            return candidate
    raise FileNotFoundError(f"no saved policy at {path} (expected config.json and model.safetensors there or in policy/)")


def load_policy(path: str | Path) -> tuple[ActorCritic, dict, RunningMeanStd | None]:
    """(agent in eval mode, its config dict, observation statistics or None)."""
    from safetensors import SafetensorError

    from ppo_rlhf.models.loading import ModelError

    path = resolve_policy_dir(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelError(f"{path}/config.json is not valid JSON ({error}); it is not a policy `ppo-rlhf gym` saved") from None
    if not isinstance(config, dict) or config.get("format") != POLICY_FORMAT:
        found = config.get("format") if isinstance(config, dict) else type(config).__name__
        raise ModelError(f"{path}/config.json has format {found!r}, expected {POLICY_FORMAT!r}: give a run folder "
                         f"of `ppo-rlhf gym` or its policy/ folder")
    spec = {key: config[key] for key in SPEC_KEYS if key in config}
    agent = ActorCritic(spec, config["hidden_sizes"], config["activation"])
    try:
        agent.load_state_dict(load_file(str(path / "model.safetensors")))
    except (SafetensorError, RuntimeError, OSError) as error:
        raise ModelError(f"{path}/model.safetensors cannot be read as this policy's weights: "
                         f"{str(error).splitlines()[0]}") from None
    obs_rms = RunningMeanStd.from_state_dict(config["obs_norm"]) if config["obs_norm"] else None
    return agent.eval(), config, obs_rms
