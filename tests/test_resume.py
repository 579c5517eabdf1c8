"""sft, rm, gym and PPO resume: a run stopped after a checkpoint (a crash, or a SIGKILL) and continued
with --resume ends with exactly the weights of a straight run, each metric logged once; a resume
with nothing to resume, or with a setting that would make it another run, is refused by name."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ppo_rlhf.trainers.gym_ppo as gym_ppo
import ppo_rlhf.trainers.reward as reward_trainer
import ppo_rlhf.trainers.sft as sft_trainer
from ppo_rlhf.cli import main
from ppo_rlhf.runlog import read_metrics
from zoo import THREADS, TINY, run, run_failing, same_tensors

SRC = Path(__file__).resolve().parents[1] / "src"


class Crash(Exception):
    """Stands for whatever stops a run midway."""


def crash_at(monkeypatch, owner, name: str, call: int) -> None:
    """Make ``owner.name`` raise Crash on its ``call``-th call."""
    real, calls = getattr(owner, name), itertools.count(1)

    def crashing(*args, **kwargs):
        if next(calls) == call:
            raise Crash
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, crashing)


def logged_steps(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl")]


def sft_args(out, *extra):
    return ["sft", "--task", "doubling", "--steps", 6, "--batch-size", 16, "--eval-every", 3, "--save-every", 2,
            "--out", out, *TINY, *extra]


def rm_args(out, *extra):
    return ["rm", "--task", "doubling", "--steps", 30, "--batch-size", 16, "--save-every", 10, "--out", out, *TINY,
            *extra]


def gym_args(out, *extra):
    # the CartPole preset: 8 envs x 32 steps = 256 env steps an iteration, 20 minibatch steps each
    return ["gym", "--env", "CartPole-v1", "--total-steps", 6 * 256, "--save-every", 2, "--eval-episodes", 0,
            "--seed", 3, "--out", out, *extra]


# ---------------------------------------------------------------- crash, then --resume
def test_sft_resumes_to_the_weights_of_a_straight_run(tmp_path, monkeypatch, capsys):
    run(sft_args(tmp_path / "straight"))
    with monkeypatch.context() as patch:
        crash_at(patch, sft_trainer, "completion_loss", 6)  # in step 6, after the checkpoint of step 4
        with pytest.raises(Crash):
            main([str(a) for a in sft_args(tmp_path / "resumed")])
    assert logged_steps(tmp_path / "resumed") == [1, 3]
    capsys.readouterr()
    run(sft_args(tmp_path / "resumed", "--resume"))
    assert f"resumed from {tmp_path / 'resumed' / 'checkpoints' / 'last'} after step 4 of 6" in capsys.readouterr().out
    same_tensors(tmp_path / "straight" / "checkpoints" / "sft" / "model.safetensors",
                 tmp_path / "resumed" / "checkpoints" / "sft" / "model.safetensors")
    assert logged_steps(tmp_path / "resumed") == logged_steps(tmp_path / "straight") == [1, 3, 6]


def test_sft_resume_prints_where_and_refuses_another_run(tmp_path, capsys):
    out = tmp_path / "sft"
    err = run_failing(sft_args(out, "--resume"), capsys)
    assert "nothing to resume" in err and "drop --resume" in err
    run(sft_args(out))
    err = run_failing(sft_args(out, "--resume", "--batch-size", 8, "--warmup-steps", 1), capsys)
    assert "batch_size: 16 -> 8" in err and "warmup_steps: 50 -> 1" in err
    assert "after step 6, past the 4 asked for" in run_failing(sft_args(out, "--resume", "--steps", 4), capsys)
    capsys.readouterr()
    run(sft_args(out, "--resume", "--steps", 8))  # longer is allowed: the same run, continued
    assert f"resumed from {out / 'checkpoints' / 'last'} after step 6 of 8" in capsys.readouterr().out
    assert logged_steps(out) == [1, 3, 6, 8]


def test_classification_rm_resumes_to_the_weights_of_a_straight_run(tmp_path, monkeypatch):
    run(rm_args(tmp_path / "straight"))
    with monkeypatch.context() as patch:
        crash_at(patch, reward_trainer._Examples, "loss_and_correct", 25)  # step 25, after the checkpoint of 20
        with pytest.raises(Crash):
            main([str(a) for a in rm_args(tmp_path / "resumed")])
    run(rm_args(tmp_path / "resumed", "--resume"))
    same_tensors(tmp_path / "straight" / "checkpoints" / "reward" / "model.safetensors",
                 tmp_path / "resumed" / "checkpoints" / "reward" / "model.safetensors")
    assert logged_steps(tmp_path / "resumed") == logged_steps(tmp_path / "straight") == [1, 26, 30, 30]


def test_pairwise_lora_rm_resumes_to_the_same_adapter(zoo, tmp_path, monkeypatch, capsys):
    def args(out, *extra):
        return ["rm", "--mode", "pairwise", "--model", zoo["llama"], "--data", zoo["pairs"], "--prompt-field", "query",
                "--chosen-field", "good", "--rejected-field", "bad", "--steps", 6, "--batch-size", 4, "--lr", 1e-2,
                "--eval-fraction", 0.25, "--save-every", 2, "--lora", "--lora-r", 4, "--out", out, *THREADS, *extra]

    run(args(tmp_path / "straight"))
    with monkeypatch.context() as patch:
        crash_at(patch, reward_trainer._Examples, "loss_and_correct", 4)
        with pytest.raises(Crash):
            main([str(a) for a in args(tmp_path / "resumed")])
    err = run_failing(args(tmp_path / "resumed", "--resume", "--lora-r", 8), capsys)
    assert "lora_r: 4 -> 8" in err
    run(args(tmp_path / "resumed", "--resume"))
    same_tensors(tmp_path / "straight" / "checkpoints" / "reward" / "adapter_model.safetensors",
                 tmp_path / "resumed" / "checkpoints" / "reward" / "adapter_model.safetensors")


def test_gym_resumes_to_the_weights_of_a_straight_run(tmp_path, monkeypatch, capsys):
    run(gym_args(tmp_path / "straight"))
    with monkeypatch.context() as patch:
        crash_at(patch, gym_ppo, "ppo_update", 4)  # in iteration 4: iteration 3 was logged after the checkpoint of 2
        with pytest.raises(Crash):
            main([str(a) for a in gym_args(tmp_path / "resumed")])
    assert logged_steps(tmp_path / "resumed") == [256, 512, 768]
    capsys.readouterr()
    run(gym_args(tmp_path / "resumed", "--resume"))
    assert "after iteration 2 of 6" in capsys.readouterr().out
    same_tensors(tmp_path / "straight" / "policy" / "model.safetensors",
                 tmp_path / "resumed" / "policy" / "model.safetensors")
    assert logged_steps(tmp_path / "resumed") == logged_steps(tmp_path / "straight") == [256 * i for i in range(1, 7)]
    straight, resumed = (read_metrics(tmp_path / run_name / "metrics.jsonl") for run_name in ("straight", "resumed"))
    assert [r["episodic_return"] for r in straight] == [r["episodic_return"] for r in resumed]


def test_gym_resume_refuses_another_run(tmp_path, capsys):
    out = tmp_path / "gym"
    err = run_failing(gym_args(out, "--resume"), capsys)
    assert "nothing to resume" in err
    run(gym_args(out))
    err = run_failing(gym_args(out, "--resume", "--save-every", 3, "--gamma", 0.9), capsys)
    assert "save_every: 2 -> 3" in err and "gamma: 0.98 -> 0.9" in err


# ---------------------------------------------------------------- SIGKILL, then --resume
KILLED = {
    "sft": (["sft", "--task", "doubling", "--steps", 20, "--batch-size", 16, "--eval-every", 0, "--save-every", 2,
             *TINY], "checkpoints/sft/model.safetensors"),
    "rm": (["rm", "--task", "doubling", "--steps", 30, "--batch-size", 16, "--save-every", 2, *TINY],
           "checkpoints/reward/model.safetensors"),
    "gym": (["gym", "--env", "CartPole-v1", "--total-steps", 16 * 256, "--save-every", 2, "--eval-episodes", 0],
            "policy/model.safetensors"),
}


# Run in the process to be killed: the command, held still as it starts its second checkpoint (so
# its folder holds the first one and steps logged after it) until the test kills it.  The test
# waits on that hold, not on a file the run writes: a run that finished first would be a race.
HELD_AT_SECOND_CHECKPOINT = """
import contextlib, sys, threading
from pathlib import Path
import ppo_rlhf.checkpoint as checkpoint
write, started = checkpoint.atomic_directory, []
@contextlib.contextmanager
def held(destination):
    if Path(destination).name == "last":
        if started:
            Path(sys.argv[1]).touch()
            threading.Event().wait()
        started.append(destination)
    with write(destination) as staging:
        yield staging
checkpoint.atomic_directory = held
from ppo_rlhf.cli import main
sys.exit(main(sys.argv[2:]))
"""


def kill_at_second_checkpoint(args, killed: Path) -> None:
    """Start the run in its own process and SIGKILL it where it starts its second checkpoint."""
    held = killed.parent / "held"
    command = [sys.executable, "-c", HELD_AT_SECOND_CHECKPOINT, str(held), *map(str, args), "--out", str(killed)]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(SRC)}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not held.exists():
        assert process.poll() is None, "the run ended before its second checkpoint"
        assert time.monotonic() < deadline, "no second checkpoint in time"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert (killed / "checkpoints" / "last" / "trainer_state.pt").exists()


@pytest.mark.parametrize("stage", sorted(KILLED))
def test_a_killed_run_resumes_to_the_weights_of_a_straight_run(stage, tmp_path):
    args, weights = KILLED[stage]
    killed = tmp_path / "killed"
    kill_at_second_checkpoint(args, killed)
    run([*args, "--out", tmp_path / "straight"])
    run([*args, "--out", killed, "--resume"])
    same_tensors(tmp_path / "straight" / weights, killed / weights)
    assert logged_steps(killed) == logged_steps(tmp_path / "straight")


@pytest.mark.parametrize("mode", [[], ["--lora", "--lora-r", 4], ["--lr-target-kl", 1e-3]],
                         ids=["full", "lora", "adapted-lr"])
def test_a_killed_ppo_run_resumes_to_the_weights_of_a_straight_run(zoo, mode, tmp_path):
    """The same for PPO, full model (value head) and LoRA, killed as it starts its second
    checkpoint (iteration 4; checkpoints every 2 iterations); and with the actor's lr adapted at
    each step (--lr-target-kl), which goes on from the lr the checkpoint holds."""
    reward = zoo["root"] / "ppo_rlhf_test_rewards.py"  # by path: the killed run is another process
    args = ["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn", f"{reward}:length_score",
            "--iterations", 30, "--batch-size", 4, "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 4,
            "--max-length", 32, "--save-every", 2, *mode, *THREADS]
    killed = tmp_path / "killed"
    kill_at_second_checkpoint(args, killed)
    run([*args, "--out", tmp_path / "straight"])
    run([*args, "--out", killed, "--resume"])
    weights = "checkpoints/actor/" + ("adapter_model.safetensors" if "--lora" in mode else "model.safetensors")
    same_tensors(tmp_path / "straight" / weights, killed / weights)
    assert logged_steps(killed) == logged_steps(tmp_path / "straight") == list(range(1, 31))
