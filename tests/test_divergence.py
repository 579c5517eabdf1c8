"""The divergence guard: a non-finite step is skipped and counted, several in a row stop the run
with a message naming the step and the cause (exit 3, no traceback), and no checkpoint ever
holds a non-finite tensor."""

from __future__ import annotations

import math
from pathlib import Path

import gymnasium as gym
import pytest
import torch
from safetensors.torch import load_file

import ppo_rlhf.trainers.sft as sft_trainer
from ppo_rlhf.cli import main
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.trainers.guard import DivergenceError, DivergenceGuard, require_finite
from zoo import TINY

NAN = float("nan")


def sft_args(out, *extra):
    return ["sft", "--task", "doubling", "--steps", 12, "--batch-size", 16, "--eval-every", 0, "--save-every", 1,
            "--out", out, *TINY, *extra]


def diverges(args, capsys) -> str:
    assert main([str(a) for a in args]) == 3, args
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def all_finite(folder: Path) -> bool:
    tensors = [t for path in folder.rglob("*.safetensors") for t in load_file(str(path)).values()]
    tensors += [t for path in folder.rglob("*.pt") for t in _tensors(torch.load(path, weights_only=False))]
    return bool(tensors) and all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def test_guard_skips_counts_and_stops_naming_the_step_and_the_cause():
    guard = DivergenceGuard(max_bad_steps=3)
    assert not guard.skip(1, loss=torch.tensor(1.0), grad_norm=torch.tensor(2.0))
    assert guard.skip(2, loss=torch.tensor(NAN), grad_norm=None)
    assert not guard.skip(3, loss=1.0)  # a finite step ends the run of bad ones
    assert guard.skip(4, loss=torch.tensor(1.0), grad_norm=torch.tensor(math.inf))
    assert guard.skip(5, reward=torch.tensor([1.0, NAN]))
    with pytest.raises(DivergenceError, match=r"at step 6: non-finite gradient norm \(inf\), 3 times in a row"):
        guard.skip(6, loss=torch.tensor(0.5), grad_norm=torch.tensor(math.inf))
    assert guard.skipped == 4


def test_require_finite_names_the_tensor():
    require_finite({"a": torch.ones(2), "steps": torch.tensor([3])}, "x")
    with pytest.raises(DivergenceError, match="the model: layer.weight holds non-finite values"):
        require_finite({"ok": torch.ones(2), "layer.weight": torch.tensor([1.0, math.inf])}, "the model")


def test_a_nan_step_is_skipped_and_the_run_goes_on(tmp_path, monkeypatch):
    real, calls = sft_trainer.completion_loss, iter(range(1, 100))
    monkeypatch.setattr(sft_trainer, "completion_loss",
                        lambda *args: real(*args) * (NAN if next(calls) == 3 else 1.0))
    out = tmp_path / "sft"
    assert main([str(a) for a in sft_args(out)]) == 0
    assert read_metrics(out / "metrics.jsonl")[-1]["skipped_steps"] == 1
    assert all_finite(out / "checkpoints")


def test_sft_with_a_nan_loss_stops_naming_the_step(tmp_path, monkeypatch, capsys):
    real, calls = sft_trainer.completion_loss, iter(range(1, 100))
    monkeypatch.setattr(sft_trainer, "completion_loss",  # NaN from step 4 on
                        lambda *args: real(*args) * (NAN if next(calls) >= 4 else 1.0))
    out = tmp_path / "sft"
    err = diverges(sft_args(out, "--max-bad-steps", 3), capsys)
    assert "training diverged at step 6: non-finite loss (nan), 3 times in a row" in err
    assert not (out / "checkpoints" / "sft").exists()  # no final model
    state = torch.load(out / "checkpoints" / "last" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 5 and state["guard"]["skipped"] == 2  # steps 4 and 5 were skipped, not trained on
    assert all_finite(out / "checkpoints")


def test_sft_with_a_huge_learning_rate_stops_and_saves_nothing_non_finite(tmp_path, capsys):
    out = tmp_path / "sft"
    err = diverges(sft_args(out, "--lr", 1e30, "--warmup-steps", 0), capsys)
    assert "non-finite" in err
    assert not (out / "checkpoints" / "sft").exists()
    assert not (out / "checkpoints" / "last").exists() or all_finite(out / "checkpoints" / "last")


class NaNReward(gym.Wrapper):
    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        return obs, NAN, terminated, truncated, info


gym.register("NaNRewardCartPole-v0", entry_point=lambda: NaNReward(gym.make("CartPole-v1")))


def test_a_gym_env_with_nan_rewards_stops_the_run_and_saves_no_policy(tmp_path, capsys):
    out = tmp_path / "gym"
    err = diverges(["gym", "--env", "NaNRewardCartPole-v0", "--preset", "cartpole", "--total-steps", 10 * 256,
                    "--save-every", 1, "--eval-episodes", 0, "--out", out], capsys)
    assert "training diverged at iteration 5: non-finite reward from the env" in err
    assert not (out / "policy").exists()
    assert all_finite(out / "checkpoints" / "last")


# ---------------------------------------------------------------- PPO
def ppo_args(model, out, *extra):
    return ["ppo", "--task", "doubling", "--model", model, "--out", out, "--batch-size", 8, "--mini-batch-size", 4,
            "--ppo-epochs", 1, "--max-new-tokens", 7, "--max-length", 19, "--eval-every", 0, "--eval-size", 8,
            "--iterations", 6, "--save-every", 1, "--num-threads", 1, *extra]


def test_ppo_with_huge_scores_stops_naming_the_iteration_and_saves_nothing_non_finite(tiny_sft_model, tmp_path, capsys):
    reward = tmp_path / "huge.py"
    # Finite scores, but their squares overflow float32: the value loss is inf from the first step.
    reward.write_text("def huge(prompts, responses):\n    return [1e30 * (i % 2) for i in range(len(responses))]\n")
    out = tmp_path / "ppo"
    err = diverges(ppo_args(tiny_sft_model, out, "--reward-fn", f"{reward}:huge"), capsys)
    assert "training diverged at iteration 3: non-finite loss" in err and "5 times in a row" in err
    assert not (out / "checkpoints" / "actor").exists()
    assert not (out / "checkpoints" / "last").exists() or all_finite(out / "checkpoints" / "last")


def test_ppo_skips_a_bad_step_and_goes_on(tiny_sft_model, tmp_path, monkeypatch):
    import ppo_rlhf.trainers.ppo_update as ppo_trainer

    real_policy_loss, calls = ppo_trainer.policy_loss, []

    def once_nan(*args, **kwargs):  # the third minibatch step's loss is NaN, the others are not
        loss, stats = real_policy_loss(*args, **kwargs)
        calls.append(1)
        return (loss * NAN if len(calls) == 3 else loss), stats

    monkeypatch.setattr(ppo_trainer, "policy_loss", once_nan)
    out = tmp_path / "ppo"
    assert main([str(a) for a in ppo_args(tiny_sft_model, out, "--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward")]) == 0
    skipped = [r["skipped_steps"] for r in read_metrics(out / "metrics.jsonl") if "skipped_steps" in r]
    assert skipped[-1] == 1 and all_finite(out / "checkpoints" / "actor")
