"""Two processes (gloo on CPU, launched by torchrun) train like one process with the same global
batch: the same final weights to float tolerance, one run folder written by rank 0."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ppo_rlhf.cli import main

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--num-threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list, processes: int, timeout: int = 240) -> subprocess.CompletedProcess:
    """``ppo-rlhf ARGS`` in ``processes`` processes (torchrun, gloo on the CPU)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
               f"--master_port={free_port()}", "-m", "ppo_rlhf.cli", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "run"
    assert main([str(a) for a in ["sft", "--task", "doubling", "--steps", 30, "--batch-size", 32, "--eval-every", 0,
                                  "--out", out, *TINY]]) == 0
    return out / "checkpoints" / "sft"


def ppo_args(model, out, *extra):
    # Greedy rollouts: a response must not depend on which process drew it.
    return ["ppo", "--task", "doubling", "--model", model, "--out", out, "--batch-size", 8, "--mini-batch-size", 4,
            "--ppo-epochs", 2, "--max-new-tokens", 7, "--max-length", 19, "--no-do-sample", "--eval-every", 0,
            "--eval-size", 16, "--lr", 1e-4, "--iterations", 10, "--num-threads", 1,
            "--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward", *extra]


def weights(folder) -> dict:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_two_processes_train_like_one(sft_model, tmp_path, critic):
    assert main([str(a) for a in ppo_args(sft_model, tmp_path / "one", "--critic", critic, "--save-every", 0)]) == 0
    result = launch(ppo_args(sft_model, tmp_path / "two", "--critic", critic, "--save-every", 5), processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = weights(tmp_path / "one" / "checkpoints" / "actor"), weights(tmp_path / "two" / "checkpoints" / "actor")
    largest = max((one[k] - two[k]).abs().max().item() for k in one)
    moved = max((one[k] - weights(sft_model)[k]).abs().max().item() for k in one)
    print(f"largest difference {largest:.3g}, largest move from the SFT weights {moved:.3g}")
    assert largest <= 1e-5, largest
    assert moved > 1e-3  # the comparison is between runs that trained
    # One run folder, written once: one metrics row per iteration, the same statistics as one process.
    rows_one = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    rows_two = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one]
    for key in ("score", "kl", "pg_loss", "vf_loss", "advantages_mean", "response_length"):
        assert rows_two[-1][key] == pytest.approx(rows_one[-1][key], rel=1e-4, abs=1e-6), key
    state = torch.load(tmp_path / "two" / "checkpoints" / "last" / "trainer_state.pt", weights_only=False)
    assert state["trainer"]["iteration"] == 10


def test_a_resume_on_another_world_size_is_refused(sft_model, tmp_path):
    result = launch(ppo_args(sft_model, tmp_path / "two", "--iterations", 2, "--save-every", 1), processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    code = main([str(a) for a in ppo_args(sft_model, tmp_path / "two", "--iterations", 3, "--save-every", 1,
                                          "--resume")])
    assert code == 2
