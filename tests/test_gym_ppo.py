"""Gym PPO: GAE through the rollout code by hand, learning on CartPole, save/evaluate, config, CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from ppo_rlhf.cli import main
from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.config_yaml import load_yaml
from ppo_rlhf.trainers.gym_agent import ActorCritic, RunningMeanStd, load_policy, save_policy
from ppo_rlhf.trainers.gym_config import PRESETS, GymPPOConfig, config_with_preset
from ppo_rlhf.trainers.gym_ppo import Rollout, RolloutCollector, compute_advantages, evaluate_policy, make_envs, train

REPO = Path(__file__).resolve().parents[1]


class CountingEnv(gym.Env):
    """Observation = steps taken in this episode.  Reward 1 per step.  Every 2nd episode
    terminates after 2 steps; the others run into the time limit (3 steps) and are truncated."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        self.episode = 0
        self.k = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.episode += 1
        self.k = 0
        return np.array([0.0], dtype=np.float32), {}

    def step(self, action):
        self.k += 1
        terminated = self.episode % 2 == 0 and self.k == 2
        return np.array([float(self.k)], dtype=np.float32), 1.0, terminated, False, {}


COUNTING_ID = "PpoRlhfTest/Counting-v0"
if COUNTING_ID not in gym.registry:
    gym.register(id=COUNTING_ID, entry_point=CountingEnv, max_episode_steps=3)


# ---------------------------------------------------------------- GAE: truncation vs termination
def test_compute_advantages_by_hand():
    # gamma 0.5, lam 1; T = 4 steps, N = 2 envs (time along dim 0).
    # env 0: V = 2, 3, 4, 5; reward 1 each; truncated after step 1 (V(final obs) = 10), terminated after
    #   step 3 (so last_values = 100 must be ignored).
    #   delta = 1+0.5*3-2 = 0.5 | 1+0.5*10-3 = 3 | 1+0.5*5-4 = -0.5 | 1+0-5 = -4
    #   A3 = -4; A2 = -0.5 + 0.5*(-4) = -2.5; A1 = 3 (episode boundary); A0 = 0.5 + 0.5*3 = 2
    # env 1: V = 1, 1, 1, 1; rewards 0, 0, 0, 1; no episode end; bootstrap from last_values = 2.
    #   delta = -0.5, -0.5, -0.5, 1+0.5*2-1 = 1;  A3 = 1, A2 = 0, A1 = -0.5, A0 = -0.75
    zeros = torch.zeros(4, 2)
    rollout = Rollout(
        obs=torch.zeros(4, 2, 1), actions=torch.zeros(4, 2, dtype=torch.long), logprobs=zeros,
        values=torch.tensor([[2.0, 1.0], [3.0, 1.0], [4.0, 1.0], [5.0, 1.0]]),
        rewards=torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [1.0, 1.0]]),
        terminated=torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]]),
        truncated=torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]),
        final_values=torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 0.0], [0.0, 0.0]]),
        last_values=torch.tensor([100.0, 2.0]),
    )
    advantages, returns = compute_advantages(rollout, gamma=0.5, lam=1.0)
    expected = torch.tensor([[2.0, -0.75], [3.0, -0.5], [-2.5, 0.0], [-4.0, 1.0]])
    assert torch.allclose(advantages, expected)
    assert torch.allclose(returns, expected + rollout.values)
    # Treating the truncation as a termination would have given A1 = 1 + 0 - 3 = -2.
    assert advantages[1, 0].item() != pytest.approx(-2.0)


def test_rollout_collects_final_observation_on_truncation():
    # One CountingEnv, 6 steps, critic V(s) = s (a linear critic with weight 1, bias 0):
    #   t:         0  1  2      3  4      5
    #   obs:       0  1  2      0  1      0      (the env resets after t2 and t4)
    #   end:             trunc     term
    #   final obs:       3         (2, unused)   last obs after t5: 1
    # next value:  1  2  3(V final)  1  0  1(last_values)
    # delta (gamma 0.5, reward 1): 1.5, 1, 0.5, 1.5, 0, 1.5
    # A (lam 1, stops at t2 and t4): 2.125, 1.25, 0.5, 1.5, 0, 1.5
    config = GymPPOConfig(env_id=COUNTING_ID, num_envs=1, num_steps=6, mini_batch_size=6, total_steps=6)
    envs = make_envs(COUNTING_ID, 1)
    agent = ActorCritic({"obs_dim": 1, "action_type": "discrete", "act_dim": 2}, hidden_sizes=[])
    with torch.no_grad():
        agent.critic[0].weight.fill_(1.0)
        agent.critic[0].bias.zero_()
    collector = RolloutCollector(envs, config)
    rollout = collector.collect(agent)
    assert rollout.obs[:, 0, 0].tolist() == [0, 1, 2, 0, 1, 0]
    assert rollout.truncated[:, 0].tolist() == [0, 0, 1, 0, 0, 0]
    assert rollout.terminated[:, 0].tolist() == [0, 0, 0, 0, 1, 0]
    assert rollout.final_values[:, 0].tolist() == [0, 0, 3, 0, 0, 0]
    assert rollout.last_values.tolist() == [1.0]
    advantages, returns = compute_advantages(rollout, gamma=0.5, lam=1.0)
    assert torch.allclose(advantages[:, 0], torch.tensor([2.125, 1.25, 0.5, 1.5, 0.0, 1.5]))
    assert torch.allclose(returns[:, 0], torch.tensor([2.125, 2.25, 2.5, 1.5, 1.0, 1.5]))
    assert list(collector.finished_returns) == [3.0, 2.0]
    envs.close()


# ---------------------------------------------------------------- the agent's distributions
def test_hand_written_distributions_match_torch():
    torch.manual_seed(0)
    obs = torch.randn(6, 3)
    discrete = ActorCritic({"obs_dim": 3, "action_type": "discrete", "act_dim": 4}, [8])
    actions = torch.randint(0, 4, (6,))
    logprobs, entropy, _ = discrete.evaluate_actions(obs, actions)
    reference = torch.distributions.Categorical(logits=discrete.actor(obs))
    assert torch.allclose(logprobs, reference.log_prob(actions), atol=1e-6)
    assert torch.allclose(entropy, reference.entropy(), atol=1e-6)

    spec = {"obs_dim": 3, "action_type": "continuous", "act_dim": 2, "action_low": [-1, -1], "action_high": [1, 1]}
    gaussian = ActorCritic(spec, [8], log_std_init=-0.7)
    actions = torch.randn(6, 2)
    logprobs, entropy, _ = gaussian.evaluate_actions(obs, actions)
    reference = torch.distributions.Normal(gaussian.actor(obs), gaussian.log_std.exp())
    assert torch.allclose(logprobs, reference.log_prob(actions).sum(-1), atol=1e-5)
    assert torch.allclose(entropy, reference.entropy().sum(-1), atol=1e-5)
    assert gaussian.to_env_action(np.array([[3.0, -0.5]])).tolist() == [[1.0, -0.5]]  # clipped to the box


def test_gumbel_max_sampling_follows_the_probabilities():
    torch.manual_seed(0)
    agent = ActorCritic({"obs_dim": 1, "action_type": "discrete", "act_dim": 3}, hidden_sizes=[])
    with torch.no_grad():  # logits = bias: probabilities 0.1, 0.3, 0.6
        agent.actor[0].weight.zero_()
        agent.actor[0].bias.copy_(torch.log(torch.tensor([0.1, 0.3, 0.6])))
        actions, logprobs, _ = agent.act(torch.zeros(20_000, 1))
    frequencies = torch.bincount(actions, minlength=3) / 20_000
    assert torch.allclose(frequencies, torch.tensor([0.1, 0.3, 0.6]), atol=0.01)
    assert torch.allclose(logprobs, torch.log(torch.tensor([0.1, 0.3, 0.6]))[actions], atol=1e-6)


# ---------------------------------------------------------------- learning
@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory, learning_seed):
    out = tmp_path_factory.mktemp("cartpole")
    values = config_with_preset("cartpole", {"total_steps": 15_360, "seed": 1 + learning_seed, "eval_episodes": 10,
                                             "out_dir": str(out)})
    return out, train(build_config(GymPPOConfig, values))


@pytest.mark.learning
def test_cartpole_return_rises(cartpole_run, record_outcome):
    out, summary = cartpole_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first_return = records[0]["episodic_return"]  # a near-uniform policy: ~20
    record_outcome("first_return", first_return)
    record_outcome("final_over_first", summary["final_episodic_return"] / first_return)
    record_outcome("eval_mean_return", summary["eval_mean_return"])
    assert first_return < 40
    # Seeds 1-5 (--learning-seed 0-4): final / first 6.3-8.5; greedy evaluation 124-355 (a random policy ~20).
    assert summary["final_episodic_return"] > 3 * first_return
    assert summary["eval_mean_return"] > 80
    assert summary["env_steps"] == 15_360
    for key in ("pg_loss", "vf_loss", "entropy", "approx_kl", "clipfrac", "explained_variance", "sps", "lr"):
        assert key in records[-1]
    assert records[0]["minibatch_steps"] == 20  # 20 epochs x 1 full-batch minibatch
    assert records[-1]["lr"] < records[0]["lr"]  # annealed


def test_saved_policy_evaluates_the_same(cartpole_run):
    out, summary = cartpole_run
    result = evaluate_policy(out, episodes=10, seed=summary["eval_seed"])
    assert result["mean_return"] == summary["eval_mean_return"]  # deterministic: same episodes
    assert result["episodes"] == 10
    assert (out / "policy" / "model.safetensors").is_file()


def test_save_load_roundtrip_continuous(tmp_path):
    spec = {"obs_dim": 3, "action_type": "continuous", "act_dim": 1, "action_low": [-2.0], "action_high": [2.0]}
    torch.manual_seed(0)
    agent = ActorCritic(spec, [16], "tanh", log_std_init=-0.5)
    obs_rms = RunningMeanStd((3,))
    obs_rms.update(np.random.default_rng(0).normal(3.0, 2.0, size=(50, 3)))
    save_policy(tmp_path / "policy", agent, "Pendulum-v1", obs_rms)
    loaded, config, loaded_rms = load_policy(tmp_path)
    obs = torch.randn(5, 3)
    assert torch.equal(loaded.deterministic_action(obs), agent.deterministic_action(obs))
    assert torch.equal(loaded.value(obs), agent.value(obs))
    assert np.allclose(loaded_rms.mean, obs_rms.mean) and np.allclose(loaded_rms.var, obs_rms.var)
    assert config["env_id"] == "Pendulum-v1"
    result = evaluate_policy(tmp_path / "policy", episodes=2, seed=0)
    assert result["episodes"] == 2 and result["mean_length"] == 200  # Pendulum is cut at 200 steps


def test_missing_policy_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no saved policy"):
        evaluate_policy(tmp_path, episodes=1)


def test_pendulum_short_run_and_target_kl_stop(tmp_path):
    # Box actions, observation and reward normalisation, and a target KL so small that the
    # update stops at the second minibatch (the first one sees the unchanged policy: KL 0).
    values = config_with_preset("pendulum", {
        "total_steps": 1024, "num_steps": 256, "eval_episodes": 1, "max_approx_kl": 1e-6, "out_dir": str(tmp_path),
    })
    summary = train(build_config(GymPPOConfig, values))
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["stopped_early"] == 1.0 and record["minibatch_steps"] == 1
    assert "action_std" in record
    _, policy_config, obs_rms = load_policy(tmp_path)
    assert policy_config["obs_norm"] is not None and obs_rms.count > 1000
    assert summary["eval_episodes"] == 1


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("key, value", [
    ("lr", -1e-3), ("mini_batch_size", 100), ("gamma", 1.5), ("clip_ratio", 0.0), ("num_envs", 0),
    ("max_approx_kl", -0.1), ("hidden_sizes", "64,x"),
])
def test_bad_config_names_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        build_config(GymPPOConfig, {"num_envs": 8, "num_steps": 32, key: value})


def test_presets_match_yaml_files():
    for name, values in PRESETS.items():
        assert load_yaml(REPO / "configs" / "gym" / f"{name}.yaml") == values
        build_config(GymPPOConfig, values)  # and they are valid


# ---------------------------------------------------------------- command line
def test_cli_gym_and_gym_eval(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["gym", "--env", "CartPole-v1", "--total-steps", "512", "--seed", "3", "--out", str(out),
                 "--eval-episodes", "2", "--hidden-sizes", "32,32"])
    assert code == 0
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "return.png", "curves.png",
                 "policy/config.json", "policy/model.safetensors"):
        assert (out / name).is_file(), name
    assert any((out / "tb").iterdir())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["env_steps"] == 512 and "eval_mean_return" in summary
    resolved = load_yaml(out / "config.yaml")
    assert resolved["num_envs"] == 8 and resolved["hidden_sizes"] == [32, 32]  # preset, then flags
    capsys.readouterr()

    assert main(["gym-eval", str(out), "--episodes", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["episodes"] == 3


def test_cli_config_error_exit_code(tmp_path, capsys):
    code = main(["gym", "--lr", "-1", "--out", str(tmp_path / "bad")])
    assert code == 2
    assert "'lr'" in capsys.readouterr().err


# ------------------------------------------------------------------ a user's own envs (--env module:Env-vN)
USER_ENVS = '''
import gymnasium as gym
import numpy as np

OBS = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)


class Walk(gym.Env):
    """Two observations, two actions; an episode of 8 steps."""
    observation_space, action_space = OBS, gym.spaces.Discrete(2)

    def __init__(self, observation_space=None, action_space=None, wrong_shape=False):
        self.observation_space = observation_space or OBS
        self.action_space = action_space or gym.spaces.Discrete(2)
        self.wrong_shape, self.t = wrong_shape, 0

    def observe(self):
        return np.zeros(3 if self.wrong_shape else 2, np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.observe(), {}

    def step(self, action):
        self.t += 1
        return self.observe(), float(np.asarray(action).sum() > 0), self.t >= 8, False, {}


gym.register("Walk-v0", entry_point=Walk)
gym.register("WalkDict-v0", entry_point=lambda: Walk(observation_space=gym.spaces.Dict({"a": OBS})))
gym.register("WalkTuple-v0", entry_point=lambda: Walk(action_space=gym.spaces.Tuple((gym.spaces.Discrete(2),))))
gym.register("WalkMulti-v0", entry_point=lambda: Walk(action_space=gym.spaces.MultiDiscrete([2, 2])))
gym.register("WalkUnbounded-v0", entry_point=lambda: Walk(action_space=gym.spaces.Box(-np.inf, np.inf, (1,))))
gym.register("WalkWrongShape-v0", entry_point=lambda: Walk(wrong_shape=True))
'''


@pytest.fixture
def user_envs(tmp_path, monkeypatch):
    module = f"user_envs_{tmp_path.name}"  # a fresh module for each test: it registers on import
    (tmp_path / f"{module}.py").write_text(USER_ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module
    for name in [n for n in gym.registry if n.startswith("Walk")]:
        del gym.registry[name]


def test_a_user_env_registered_by_its_module_trains(user_envs, tmp_path):
    src = Path(__file__).resolve().parents[1] / "src"
    out = tmp_path / "run"
    command = [sys.executable, "-m", "ppo_rlhf.cli", "gym", "--env", f"{user_envs}:Walk-v0", "--total-steps", 256,
               "--num-envs", 2, "--num-steps", 128, "--mini-batch-size", 64, "--eval-episodes", 2, "--out", out]
    result = subprocess.run([str(a) for a in command],
                            env={**os.environ, "PYTHONPATH": f"{src}:{tmp_path}"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "summary.json").read_text())["eval_episodes"] == 2


@pytest.mark.parametrize("env, named", [
    ("WalkDict-v0", "observation space Dict"), ("WalkTuple-v0", "action space Tuple"),
    ("WalkMulti-v0", "action space MultiDiscrete"), ("WalkUnbounded-v0", "infinite bounds"),
    ("WalkWrongShape-v0", "unlike its declared space"), ("Walk-v9", "did not register it"),
])
def test_a_user_env_training_cannot_use_is_refused_at_start(env, named, user_envs, tmp_path, capsys):
    assert main(["gym", "--env", f"{user_envs}:{env}", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert named in err and "--env" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_missing_env_module_or_package_is_named(tmp_path, capsys):
    assert main(["gym", "--env", "no_such_module_xyz:Env-v0", "--out", str(tmp_path / "a")]) == 2
    assert "cannot import 'no_such_module_xyz'" in capsys.readouterr().err
    try:
        import Box2D  # noqa: F401
    except ImportError:
        assert main(["gym", "--env", "LunarLander-v3", "--out", str(tmp_path / "b")]) == 2
        assert 'pip install "gymnasium[box2d]"' in capsys.readouterr().err
