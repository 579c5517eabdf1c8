"""Ctrl-C (SIGINT) and SIGTERM: a real run, stopped once it has logged a step, saves its state,
prints one line with the command that continues it and exits 130 (143); that command reaches
exactly the weights of a straight run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppo_rlhf.interrupts import resume_command
from ppo_rlhf.runlog import read_metrics
from zoo import RULE, TINY, run, same_tensors

SRC = Path(__file__).resolve().parents[1] / "src"


def interrupt_once_logged(args: list, out: Path, signum=signal.SIGINT, env: dict | None = None
                          ) -> subprocess.CompletedProcess:
    """Run the command in its own process; send ``signum`` once metrics.jsonl holds a row past
    step 0, then wait for it to stop (bounded)."""
    command = [sys.executable, "-m", "ppo_rlhf.cli", *map(str, args)]
    process = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(SRC), **(env or {})},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not any(row["step"] > 0 for row in read_metrics(out / "metrics.jsonl")):
        assert process.poll() is None, f"the run ended before it logged a step: {process.communicate()}"
        assert time.monotonic() < deadline, "no step logged in time"
        time.sleep(0.02)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=180)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def sft_args(out, *extra):
    return ["sft", "--task", "doubling", "--steps", 300, "--batch-size", 8, "--eval-every", 0, "--save-every", 1000,
            "--out", out, *TINY, *extra]


def rm_args(out, *extra):
    return ["rm", "--task", "doubling", "--steps", 300, "--batch-size", 8, "--save-every", 1000, "--out", out, *TINY,
            *extra]


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
    check_message(interrupt_once_logged(args(stopped), stopped, signum), args(stopped)[0], code)
    assert (stopped / "checkpoints" / "last" / "trainer_state.pt").exists()  # saved at the stop, not only every 1000
    assert not (stopped / "summary.json").exists()
    run(args(stopped, "--resume"))
    run(args(tmp_path / "straight"))
    same_tensors(tmp_path / "straight" / weights, stopped / weights)
    steps = [r["step"] for r in read_metrics(stopped / "metrics.jsonl")]
    assert steps == [r["step"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl")]


def test_an_interrupted_ppo_run_resumes_to_the_weights_of_a_straight_run(tmp_path):
    sft = tmp_path / "sft"
    run(["sft", "--task", "doubling", "--steps", 4, "--batch-size", 16, "--eval-every", 0, "--out", sft, *TINY])

    def ppo_args(out, *extra):
        return ["ppo", "--task", "doubling", "--model", sft / "checkpoints" / "sft", "--out", out, "--iterations", 60,
                "--batch-size", 8, "--mini-batch-size", 4, "--ppo-epochs", 1, "--max-new-tokens", 7,
                "--max-length", 19, "--eval-every", 0, "--eval-size", 8, "--save-every", 1000, "--lr", 1e-4,
                "--num-threads", 1, *RULE, *extra]

    stopped = tmp_path / "stopped"
    line = check_message(interrupt_once_logged(ppo_args(stopped), stopped), "ppo", 130)
    assert " interrupted after iteration " in line
    run(ppo_args(stopped, "--resume"))
    run(ppo_args(tmp_path / "straight"))
    weights = "checkpoints/actor/model.safetensors"
    same_tensors(tmp_path / "straight" / weights, stopped / weights)
    steps = [r["step"] for r in read_metrics(stopped / "metrics.jsonl")]
    assert steps == [r["step"] for r in read_metrics(tmp_path / "straight" / "metrics.jsonl")] == list(range(61))


def test_an_interrupted_gym_run_names_its_last_checkpoint(tmp_path):
    out = tmp_path / "gym"
    args = ["gym", "--env", "CartPole-v1", "--total-steps", 400 * 256, "--save-every", 100000, "--eval-episodes", 0,
            "--out", out]
    result = interrupt_once_logged(args, out)
    assert result.returncode == 130, result.stderr
    assert "Traceback" not in result.stderr
    assert "no checkpoint to resume from" in result.stderr, result.stderr


def test_an_interrupted_gym_run_resumes_from_its_last_checkpoint_to_a_straight_run(tmp_path):
    # Checkpoints every iteration: the stop names the last one, and --resume from it reaches the
    # straight run's policy exactly (gym saves nothing at the stop itself: interrupts.py).
    def args(out, *extra):
        return ["gym", "--env", "CartPole-v1", "--total-steps", 40 * 256, "--save-every", 1, "--eval-episodes", 0,
                "--seed", 3, "--out", out, *extra]

    stopped = tmp_path / "stopped"
    result = interrupt_once_logged(args(stopped), stopped)
    assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr
    assert "--resume" in result.stderr, result.stderr
    run(args(stopped, "--resume"))
    run(args(tmp_path / "straight"))
    same_tensors(tmp_path / "straight" / "policy" / "model.safetensors", stopped / "policy" / "model.safetensors")


def test_the_resume_command_drops_overwrite_and_adds_resume():
    assert resume_command(["sft", "--out", "runs/a b", "--overwrite"]) == "ppo-rlhf sft --out 'runs/a b' --resume"
    assert resume_command(["ppo", "--resume"]) == "ppo-rlhf ppo --resume"
