"""Ctrl-C (SIGINT) and SIGTERM: a real run, stopped at a chosen step, saves its state, prints one
line with the command that continues it and exits 130 (143); that command reaches exactly the
weights of a straight run.  A stop during the last step keeps the finished run, a second signal
aborts at once, and no line ever names a checkpoint that is not on disk (issue 63).

Each run is its own process, signalled by itself at a chosen step: ``interrupts.stop_requested``,
which every training loop calls once per step, raises the signal on its Nth call before answering
-- the signal arrives during step N's work, wherever the machine is slow, and no test waits on a
clock."""

from __future__ import annotations

import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from ppo_rlhf.interrupts import resume_command
from ppo_rlhf.runlog import read_metrics
from zoo import RULE, TINY, run, same_tensors, signalled


def sft_args(out, *extra, steps: int = 6, save_every: int = 1000):
    return ["sft", "--task", "doubling", "--steps", steps, "--batch-size", 8, "--eval-every", 0,
            "--save-every", save_every, "--out", out, *TINY, *extra]


def rm_args(out, *extra, steps: int = 6, save_every: int = 1000):
    return ["rm", "--task", "doubling", "--steps", steps, "--batch-size", 8, "--save-every", save_every,
            "--out", out, *TINY, *extra]


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    sft = tmp_path_factory.mktemp("sft")
    run(["sft", "--task", "doubling", "--steps", 4, "--batch-size", 16, "--eval-every", 0, "--out", sft, *TINY])
    return sft / "checkpoints" / "sft"


def ppo_args(model):
    def args(out, *extra, steps: int = 6, save_every: int = 1000):
        return ["ppo", "--task", "doubling", "--model", model, "--out", out, "--iterations", steps, "--batch-size", 8,
                "--mini-batch-size", 4, "--ppo-epochs", 1, "--max-new-tokens", 7, "--max-length", 19,
                "--eval-every", 0, "--eval-size", 8, "--save-every", save_every, "--lr", 1e-4, "--num-threads", 1,
                *RULE, *extra]
    return args


# stage: (its final model's file, what a step is called)
FINAL = {"sft": ("checkpoints/sft/model.safetensors", "step"), "rm": ("checkpoints/reward/model.safetensors", "step"),
         "ppo": ("checkpoints/actor/model.safetensors", "iteration")}


def checkpoint_step(out: Path) -> int | None:
    """The step of the resumable checkpoint on disk (None: there is none)."""
    state = out / "checkpoints" / "last" / "trainer_state.pt"
    return torch.load(state, weights_only=False, map_location="cpu")["step"] if state.exists() else None


def stopped_line(result: subprocess.CompletedProcess, command: str) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith(f"ppo-rlhf {command}: interrupted")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def check_said_against_disk(result: subprocess.CompletedProcess, command: str, out: Path, at: int, steps: int) -> None:
    """What the run said about how it stopped, held against what it left on disk."""
    final, unit = FINAL[command]
    if at == steps:  # during the last step: the run finishes and keeps its work
        assert result.returncode == 0, result.stderr
        assert f"came during the last {unit} ({steps} of {steps})" in result.stderr, result.stderr
        assert "interrupted" not in result.stderr and "--resume" not in result.stderr
        assert (out / final).exists() and (out / "summary.json").exists()
        return
    assert result.returncode == 143, result.stderr
    line = stopped_line(result, command)
    assert line.startswith(f"ppo-rlhf {command}: interrupted after {unit} {at}"), line
    assert not (out / final).exists() and not (out / "summary.json").exists()  # the run is not over
    on_disk = checkpoint_step(out)
    if "continue with:" in line:
        named = re.search(rf"its last checkpoint is after {unit} (\d+)", line)
        assert on_disk == (int(named.group(1)) if named else at), (line, on_disk)
        assert line.endswith("--resume")
    else:
        assert "no checkpoint to resume from" in line and on_disk is None, (line, on_disk)


POINTS = {"first": 1, "mid-run": 3, "last": 6}


@pytest.mark.parametrize("point", sorted(POINTS))
@pytest.mark.parametrize("command", ["sft", "rm", "ppo"])
def test_a_stop_at_the_first_mid_or_last_step_leaves_what_it_says(command, point, tmp_path, request):
    args = {"sft": sft_args, "rm": rm_args}.get(command) or ppo_args(request.getfixturevalue("sft_model"))
    at = POINTS[point]
    # Checkpoints every 2 steps: the first step's stop saves one of its own, the mid-run stop (3) too.
    out = tmp_path / "run"
    check_said_against_disk(signalled(args(out, save_every=2), at), command, out, at, steps=6)
    if point == "last" and command == "sft":  # what it kept is what a straight run saves
        run(args(tmp_path / "straight", save_every=2))
        same_tensors(tmp_path / "straight" / FINAL["sft"][0], out / FINAL["sft"][0])
    # Without checkpoints: a stop before the end says there is nothing to resume from.
    if point == "first":
        bare = tmp_path / "bare"
        check_said_against_disk(signalled(args(bare, save_every=0), at), command, bare, at, steps=6)


def test_a_second_signal_aborts_naming_only_a_checkpoint_on_disk(sft_model, tmp_path):
    args = ppo_args(sft_model)
    none = tmp_path / "none"  # before any checkpoint: the run said "its last checkpoint is whole"
    result = signalled(args(none, save_every=0), at=1, times=2)
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr
    assert "ppo-rlhf ppo: interrupted before it wrote a checkpoint" in result.stderr, result.stderr
    assert "is whole" not in result.stderr and checkpoint_step(none) is None
    some = tmp_path / "some"
    result = signalled(args(some, save_every=2), at=3, times=2)
    assert result.returncode == 130, result.stderr
    assert "its last checkpoint, after iteration 2, is whole: continue with:" in result.stderr, result.stderr
    assert checkpoint_step(some) == 2


def test_a_stop_in_the_last_step_of_the_demos_sft_keeps_it_and_begins_no_other_stage(tmp_path):
    out = tmp_path / "demo"
    (tmp_path / "stages.yaml").write_text("sft: {batch_size: 8, n_layer: 2, n_head: 2, n_embd: 32}\n")
    result = signalled(["demo", "--sft-steps", 2, "--rm-steps", 2, "--ppo-iterations", 1, "--num-threads", 1,
                        "--stages-config", tmp_path / "stages.yaml", "--out", out], at=2)
    assert result.returncode == 143 and "Traceback" not in result.stderr, result.stderr
    assert "ppo-rlhf demo: interrupted after stage 1; this command cannot resume" in result.stderr, result.stderr
    assert (out / "sft" / "checkpoints" / "sft" / "model.safetensors").exists() and not (out / "rm").exists()


# stage: (its command line, the signal, the exit code, the trained weights it writes)
STOPPED = {
    "sft-sigint": (sft_args, signal.SIGINT, 130, "checkpoints/sft/model.safetensors"),
    "sft-sigterm": (sft_args, signal.SIGTERM, 143, "checkpoints/sft/model.safetensors"),
    "rm-sigint": (rm_args, signal.SIGINT, 130, "checkpoints/reward/model.safetensors"),
}


def check_message(result: subprocess.CompletedProcess, command: str, code: int) -> str:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if "continue with:" in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"ppo-rlhf {command}: interrupted after "), lines[0]
    assert lines[0].endswith("--resume"), lines[0]
    return lines[0]


@pytest.mark.parametrize("case", sorted(STOPPED))
def test_an_interrupted_run_resumes_to_the_weights_of_a_straight_run(case, tmp_path):
    args, signum, code, weights = STOPPED[case]
    stopped = tmp_path / "stopped"
    check_message(signalled(args(stopped), 3, signum), args(stopped)[0], code)
    assert checkpoint_step(stopped) == 3  # saved at the stop, not only every 1000
    assert not (stopped / "summary.json").exists()
    run(args(stopped, "--resume"))
    run(args(tmp_path / "straight"))
    same_tensors(tmp_path / "straight" / weights, stopped / weights)
    steps = [r["step"] for r in read_metrics(stopped / "metrics.jsonl")]
    assert steps == [r["step"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl")]


def test_an_interrupted_ppo_run_resumes_to_the_weights_of_a_straight_run(sft_model, tmp_path):
    args = ppo_args(sft_model)
    stopped = tmp_path / "stopped"
    line = check_message(signalled(args(stopped), 3, signal.SIGINT), "ppo", 130)
    assert " interrupted after iteration 3" in line
    run(args(stopped, "--resume"))
    run(args(tmp_path / "straight"))
    weights = "checkpoints/actor/model.safetensors"
    same_tensors(tmp_path / "straight" / weights, stopped / weights)
    steps = [r["step"] for r in read_metrics(stopped / "metrics.jsonl")]
    assert steps == [r["step"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl")] == list(range(7))


def test_an_interrupted_gym_run_names_its_last_checkpoint(tmp_path):
    out = tmp_path / "gym"
    args = ["gym", "--env", "CartPole-v1", "--total-steps", 8 * 256, "--save-every", 100000, "--eval-episodes", 0,
            "--out", out]
    result = signalled(args, 2, signal.SIGINT)
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr
    assert "no checkpoint to resume from" in result.stderr, result.stderr


def test_an_interrupted_gym_run_resumes_from_its_last_checkpoint_to_a_straight_run(tmp_path):
    # Checkpoints every iteration: the stop names the last one, and --resume from it reaches the
    # straight run's policy exactly (gym saves nothing at the stop itself: interrupts.py).
    def args(out, *extra):
        return ["gym", "--env", "CartPole-v1", "--total-steps", 8 * 256, "--save-every", 1, "--eval-episodes", 0,
                "--seed", 3, "--out", out, *extra]

    stopped = tmp_path / "stopped"
    result = signalled(args(stopped), 3, signal.SIGINT)
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr
    assert "--resume" in result.stderr, result.stderr
    run(args(stopped, "--resume"))
    run(args(tmp_path / "straight"))
    same_tensors(tmp_path / "straight" / "policy" / "model.safetensors", stopped / "policy" / "model.safetensors")


def test_the_resume_command_drops_overwrite_and_adds_resume():
    assert resume_command(["sft", "--out", "runs/a b", "--overwrite"]) == "ppo-rlhf sft --out 'runs/a b' --resume"
    assert resume_command(["ppo", "--resume"]) == "ppo-rlhf ppo --resume"
