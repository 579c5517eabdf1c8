"""Two processes (gloo on CPU, launched by torchrun) train like one process with the same global
batch: the same final weights to float tolerance, one run folder written by rank 0."""

from __future__ import annotations

import json
import re
from pathlib import Path
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ppo_rlhf.cli import main
from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.trainers import ppo_setup
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import free_port, launched

# No dropout: each process draws its own dropout masks, so runs with it agree in distribution only.
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--dropout", "0", "--num-threads", "1"]


def launch(args: list, processes: int, timeout: int = 240) -> subprocess.CompletedProcess:
    """``ppo-rlhf ARGS`` in ``processes`` processes (torchrun, gloo on the CPU)."""
    return launched([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                     f"--master_port={free_port()}", "-m", "ppo_rlhf.cli", *map(str, args)], timeout)


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "run"
    assert main([str(a) for a in ["sft", "--task", "doubling", "--steps", 30, "--batch-size", 32, "--eval-every", 0,
                                  "--out", out, *TINY]]) == 0
    return out / "checkpoints" / "sft"


def ppo_args(model, out, *extra):
    # Greedy rollouts: a response must not depend on which process drew it.  The task's rule
    # reward unless the extra arguments name a reward model.
    reward = [] if "--reward-model" in extra else ["--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward"]
    return ["ppo", "--task", "doubling", "--model", model, "--out", out, "--batch-size", 8, "--mini-batch-size", 4,
            "--ppo-epochs", 2, "--max-new-tokens", 7, "--max-length", 19, "--no-do-sample", "--eval-every", 0,
            "--eval-size", 16, "--lr", 1e-4, "--iterations", 10, "--num-threads", 1, *reward, *extra]


def weights(folder) -> dict:
    return load_file(str(folder / "model.safetensors"))


def difference_outside_key_bias(one: torch.Tensor, two: torch.Tensor, name: str) -> float:
    """Largest |one - two|, leaving out GPT-2's attention key bias (the middle third of
    c_attn.bias).  Its gradient is zero in exact arithmetic (a softmax does not change when the
    same q.b_k is added to every score of a query), so what it receives is float round-off, which
    Adam divides by its own size into steps of about lr: it wanders by up to lr per step in any
    run, one process or two (measured: 1.5e-5 there, 1e-7 in every other weight)."""
    difference = (one - two).abs()
    if name.endswith("attn.c_attn.bias"):
        width = difference.shape[0] // 3
        difference = torch.cat([difference[:width], difference[2 * width:]])
    return difference.max().item()


# Critic-free: reinforce++ (returns whitened over the whole batch).  The group estimators need
# several different samples of a prompt, which greedy rollouts cannot give.
@pytest.mark.parametrize("variant", [["--critic", "shared"], ["--critic", "separate"], ["--estimator", "reinforce++"],
                                     # one step per batch: old log-probs read off the update (each process its rows)
                                     ["--estimator", "reinforce++", "--ppo-epochs", "1", "--mini-batch-size", "8",
                                      "--kl-in", "loss", "--kl-coef", "0.1", "--lr", "1e-3"],
                                     # each prompt twice: each process runs its distinct prompts once a pass
                                     ["--estimator", "reinforce++", "--samples-per-prompt", "2"]],
                         ids=["shared-critic", "separate-critic", "reinforce++", "old-logprobs-from-update",
                              "shared-prompts"])
def test_two_processes_train_like_one(sft_model, tmp_path, variant):
    assert main([str(a) for a in ppo_args(sft_model, tmp_path / "one", *variant, "--save-every", 0)]) == 0
    result = launch(ppo_args(sft_model, tmp_path / "two", *variant, "--save-every", 5), processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    if "--samples-per-prompt" in variant:  # the plan says prompts are shared, and the first batch's check agreed
        assert "each distinct prompt runs once" in result.stdout and "--share-prompts is off" not in result.stdout
    one, two = weights(tmp_path / "one" / "checkpoints" / "actor"), weights(tmp_path / "two" / "checkpoints" / "actor")
    largest = max(difference_outside_key_bias(one[k], two[k], k) for k in one)
    moved = max((one[k] - weights(sft_model)[k]).abs().max().item() for k in one)
    print(f"largest difference {largest:.3g}, largest move from the SFT weights {moved:.3g}")
    assert largest <= 1e-5, largest
    assert moved > 1e-3  # the comparison is between runs that trained
    # One run folder, written once: one metrics row per iteration, the same statistics as one process.
    rows_one = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    rows_two = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_two] == [r["step"] for r in rows_one]
    for key in ("score", "kl", "pg_loss", "vf_loss", "advantages_mean", "response_length"):
        if key in rows_one[-1]:
            assert rows_two[-1][key] == pytest.approx(rows_one[-1][key], rel=1e-4, abs=1e-6), key
    state = torch.load(tmp_path / "two" / "checkpoints" / "last" / "trainer_state.pt", weights_only=False)
    assert state["trainer"]["iteration"] == 10


def test_two_processes_keep_each_episode_with_its_row_and_train_like_one(tmp_path):
    """Episodes (docs/agents.md) of TRL's environment shape, K = 2 samples of each row: each row's
    reset() appends its own target to the prompt, and its get_reward() pays reaching it.  Greedy,
    so a process draws what one process would; the saved rollouts must be the same, row for row.
    Its tool answers after random waits, its calls one at a time in one process and at once in two
    (envs/calls.py): the order calls finish in changes nothing."""
    from test_default_learning import users_tiny_model

    # The tool template's prompt is ~470 tokens in the tiny vocabulary: room for it and two turns.
    users_tiny_model(tmp_path / "model", arch="qwen2", positions=1024)
    toy = Path(__file__).parent / "toy_envs.py"
    rows = [{"prompt": f"count {i}", "target": 1 + i % 2} for i in range(8)]
    prompts = tmp_path / "rows.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["ppo", "--model", tmp_path / "model", "--prompts", prompts, "--environment", f"{toy}:SlowCounter",
            "--tool-parser", f"{toy}:calls_increment", "--chat-template-file", tool_template(), "--max-turns", 2,
            "--estimator", "reinforce++", "--samples-per-prompt", 2, "--batch-size", 8, "--mini-batch-size", 4,
            "--ppo-epochs", 1, "--max-new-tokens", 4, "--max-length", 1024, "--no-do-sample", "--lr", 1e-3, "--adam-eps", 1e-5,
            "--iterations", 2, "--save-rollouts", 1, "--eval-every", 0, "--save-every", 0, "--num-threads", 1]
    assert main([str(a) for a in args + ["--env-workers", 1, "--out", tmp_path / "one"]]) == 0
    result = launch(args + ["--out", tmp_path / "two"], processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    for iteration in (1, 2):
        name = f"rollouts/iteration_{iteration:04d}.jsonl"
        one = [json.loads(line) for line in (tmp_path / "one" / name).read_text().splitlines()]
        two = [json.loads(line) for line in (tmp_path / "two" / name).read_text().splitlines()]
        assert [r["prompt"] for r in two] == [r["prompt"] for r in one]
        assert [r["response_ids"] for r in two] == [r["response_ids"] for r in one]
        for record in two:  # each episode played its own row: its target in its prompt, its reward by it
            target = int(record["prompt"][-1]["content"].split("count to ")[1].rstrip(")"))
            # one increment: the second (last) turn's call is not run, as TRL runs none
            assert record["turns"] == 2 and record["episode_reward"] == float(target == 1)
    a, b = (weights(tmp_path / run / "checkpoints" / "actor") for run in ("one", "two"))
    differences = {k: (a[k] - b[k]).abs().max().item() for k in a}
    print(sorted(differences.items(), key=lambda kv: -kv[1])[:5])
    assert max(differences.values()) <= 1e-5


def tool_template() -> str:
    from ppo_rlhf.envs.options import tool_template_path

    return str(tool_template_path())


@pytest.mark.slow  # a resume in two processes and a straight run, about a minute on 2 cores: make test-slow, which CI runs
def test_a_resume_in_two_processes_ends_where_a_straight_run_does_and_one_process_is_refused(sft_model, tmp_path):
    straight = launch(ppo_args(sft_model, tmp_path / "straight", "--iterations", 4, "--save-every", 2), processes=2)
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = launch(ppo_args(sft_model, tmp_path / "resumed", "--iterations", 2, "--save-every", 2), processes=2)
    assert first.returncode == 0, first.stderr[-3000:]
    # A resume on another world size is refused as a bad input, and leaves the run to resume as launched.
    assert main([str(a) for a in ppo_args(sft_model, tmp_path / "resumed", "--iterations", 4, "--save-every", 2,
                                          "--resume")]) == 2
    resumed = launch(ppo_args(sft_model, tmp_path / "resumed", "--iterations", 4, "--save-every", 2, "--resume"),
                     processes=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    a, b = (weights(tmp_path / run / "checkpoints" / "actor") for run in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def sft_args(out, *extra):
    return ["sft", "--task", "doubling", "--steps", 12, "--batch-size", 16, "--eval-every", 0, "--out", out, *TINY,
            *extra]


def rm_args(sft, out, *extra):
    return ["rm", "--task", "doubling", "--model", sft, "--steps", 12, "--batch-size", 16, "--out", out,
            "--num-threads", 1, *extra]


def largest_difference(folder_one, folder_two) -> float:
    one, two = weights(folder_one), weights(folder_two)
    assert one.keys() == two.keys()
    return max(difference_outside_key_bias(one[k], two[k], k) for k in one)


def test_sft_in_two_processes_trains_like_one(tmp_path):
    assert main([str(a) for a in sft_args(tmp_path / "one")]) == 0
    result = launch(sft_args(tmp_path / "two", "--save-every", 6), processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    largest = largest_difference(tmp_path / "one" / "checkpoints" / "sft", tmp_path / "two" / "checkpoints" / "sft")
    print(f"sft: largest difference {largest:.3g}")
    assert largest <= 1e-5


def test_a_pairwise_reward_model_in_two_processes_trains_like_one(sft_model, tmp_path):
    assert main([str(a) for a in rm_args(sft_model, tmp_path / "one")]) == 0
    result = launch(rm_args(sft_model, tmp_path / "two", "--save-every", 6), processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    largest = largest_difference(tmp_path / "one" / "checkpoints" / "reward", tmp_path / "two" / "checkpoints" / "reward")
    print(f"rm: largest difference {largest:.3g}")
    assert largest <= 1e-5
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["eval_accuracy"] == pytest.approx(one["eval_accuracy"])


def test_a_batch_that_does_not_split_over_the_processes_is_refused(sft_model, tmp_path):
    """Under a real launch; the other splits are checked in one process below, each launch costing
    two interpreters' imports."""
    args = ["--batch-size", 6, "--mini-batch-size", 2, "--samples-per-prompt", 2, "--estimator", "grpo"]
    result = launch(ppo_args(sft_model, tmp_path / "run", "--iterations", 1, *args), processes=2)
    assert result.returncode != 0
    assert re.search("'batch_size'.*multiple of 4", result.stderr), result.stderr[-2000:]
    assert re.search(r"exitcode\s*:\s*2", result.stderr)  # each process stopped as a bad input does: exit 2


@pytest.mark.parametrize("values, message", [
    ({"batch_size": 6, "mini_batch_size": 2, "samples_per_prompt": 2, "estimator": "grpo"}, "'batch_size'.*multiple of 4"),
    ({"batch_size": 6, "mini_batch_size": 3}, "'mini_batch_size'.*multiple of 2"),
    ({"batch_size": 8, "mini_batch_size": 8, "train_micro_batch_size": 8}, "'train_micro_batch_size'.*computes 4 rows"),
])
def test_each_split_over_two_processes_is_checked(monkeypatch, values, message):
    monkeypatch.setattr(ppo_setup, "world_size", lambda: 2)
    config = build_config(PPOConfig, {"task": "doubling", **values})
    with pytest.raises(ConfigError, match=message):
        ppo_setup.check_processes(config)
    monkeypatch.setattr(ppo_setup, "world_size", lambda: 1)
    ppo_setup.check_processes(config)  # one process takes any batch


# ------------------------------------------------------------------ FSDP (configs/accelerate/fsdp.yaml)
FSDP_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "fsdp.yaml"


def launch_fsdp(args: list, processes: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    """``ppo-rlhf ARGS`` under ``accelerate launch`` with the shipped FSDP config (on the CPU: gloo)."""
    return launched([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG),
                     "--num_processes", str(processes), "--main_process_port", str(free_port()), "-m",
                     "ppo_rlhf.cli", *map(str, args)], timeout)


@pytest.mark.slow  # two processes sharded (FSDP2), a minute a case on 2 cores: make test-slow, which CI runs
def test_sft_sharded_over_two_processes_trains_like_one_and_resumes(tmp_path):
    assert main([str(a) for a in sft_args(tmp_path / "one")]) == 0
    # Half the steps, then a resume from the sharded checkpoint (whole weights and AdamW moments,
    # each process taking its shards back) to the end.
    result = launch_fsdp(sft_args(tmp_path / "two", "--steps", 6))
    assert result.returncode == 0, result.stderr[-3000:]
    result = launch_fsdp(sft_args(tmp_path / "two", "--resume"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    largest = largest_difference(tmp_path / "one" / "checkpoints" / "sft", tmp_path / "two" / "checkpoints" / "sft")
    print(f"sft, FSDP: largest difference {largest:.3g}")
    assert largest <= 1e-5
    # A resume must be launched as the run was: sharded.
    result = launch(sft_args(tmp_path / "two", "--resume", "--steps", 18), processes=2)
    assert result.returncode != 0 and "trained with an FSDP config" in result.stderr, result.stderr[-2000:]


@pytest.mark.slow  # two processes sharded (FSDP2), a minute a case on 2 cores: make test-slow, which CI runs
def test_a_pairwise_reward_model_sharded_over_two_processes_trains_like_one(sft_model, tmp_path):
    assert main([str(a) for a in rm_args(sft_model, tmp_path / "one")]) == 0
    result = launch_fsdp(rm_args(sft_model, tmp_path / "two", "--save-every", 6))
    assert result.returncode == 0, result.stderr[-3000:]
    largest = largest_difference(tmp_path / "one" / "checkpoints" / "reward", tmp_path / "two" / "checkpoints" / "reward")
    print(f"rm, FSDP: largest difference {largest:.3g}")
    assert largest <= 1e-5
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["eval_accuracy"] == pytest.approx(one["eval_accuracy"])


@pytest.fixture(scope="module")
def style_reward_model(sft_model, tmp_path_factory):
    """The built-in task's style classifier, trained briefly on the SFT model: a reward model to shard."""
    out = tmp_path_factory.mktemp("style_rm") / "run"
    assert main([str(a) for a in rm_args(sft_model, out)]) == 0
    return out / "checkpoints" / "reward"


@pytest.mark.slow  # two processes sharded (FSDP2), a minute a case on 2 cores: make test-slow, which CI runs
@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_ppo_sharded_over_two_processes_trains_like_one_and_resumes(sft_model, style_reward_model, tmp_path, critic):
    """Actor (and a separate critic) sharded, and the frozen reference (and reward model) too;
    generation and evaluation on the actor gathered once; half the iterations, then a resume from
    the sharded checkpoint, against one process."""
    args = ["--critic", critic, "--eval-every", 5]
    if critic == "separate":  # a reward model (sharded as well), the critic starting from its trunk
        args += ["--reward-model", style_reward_model]
    assert main([str(a) for a in ppo_args(sft_model, tmp_path / "one", *args, "--save-every", 0)]) == 0
    result = launch_fsdp(ppo_args(sft_model, tmp_path / "two", *args, "--iterations", 5, "--save-every", 5))
    assert result.returncode == 0, result.stderr[-3000:]
    sharded = "actor, critic, reference and reward model" if critic == "separate" else "actor and reference"
    assert f"sharded (FSDP): {sharded} split over the 2 processes" in result.stdout, result.stdout[-2000:]
    result = launch_fsdp(ppo_args(sft_model, tmp_path / "two", *args, "--save-every", 5, "--resume"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout
    for role in ["actor"] + (["critic"] if critic == "separate" else []):
        largest = largest_difference(tmp_path / "one" / "checkpoints" / role, tmp_path / "two" / "checkpoints" / role)
        print(f"ppo, FSDP, {critic} critic, {role}: largest difference {largest:.3g}")
        assert largest <= 1e-5
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert two["after"]["eval/exact_match"] == pytest.approx(one["after"]["eval/exact_match"])


@pytest.mark.slow  # two processes sharded (FSDP2), a minute on 2 cores: make test-slow, which CI runs
def test_sharded_passes_run_in_step_when_dynamic_sampling_keeps_no_row_of_one_process(sft_model, tmp_path):
    """Dynamic sampling keeps the informative groups wherever they were drawn: here every group of
    the first process is dropped and the second's are all kept, so the first has no row for the
    reference's pass while the second has the whole batch.  Each pass of a sharded model gathers
    its layers (a collective): the first process runs as many passes as the second, on a throwaway
    row, and the run ends.  (It returned at once with no row, and the second waited for ever.)"""
    toy = Path(__file__).parent / "toy_envs.py"
    args = ["ppo", "--task", "doubling", "--model", sft_model, "--out", tmp_path / "run", "--estimator", "grpo",
            "--samples-per-prompt", 2, "--dynamic-sampling", "--max-resample-rounds", 2, "--batch-size", 8,
            "--mini-batch-size", 8, "--ppo-epochs", 1, "--max-new-tokens", 7, "--max-length", 19,
            "--rollout-micro-batch-size", 2, "--reward-fn", f"{toy}:informative_on_the_second_process",
            "--iterations", 2, "--eval-every", 0, "--save-every", 0, "--num-threads", 1]
    result = launch_fsdp(args)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    trained = [m for m in metrics if "dynamic_sampling/rounds" in m]
    assert trained and all(m["dynamic_sampling/filled_groups"] == 0 for m in trained)


def test_eval_under_an_fsdp_launch_is_refused_by_name(sft_model, tmp_path):
    result = launch_fsdp(["eval", "--task", "doubling", "--model", sft_model, "--size", 8, "--out",
                          tmp_path / "run", "--num-threads", 1])
    assert result.returncode != 0
    assert "distributed_type FSDP shards the models" in result.stderr and "gpus_ddp.yaml" in result.stderr


@pytest.mark.slow  # two processes sharded (FSDP2), a minute a case on 2 cores: make test-slow, which CI runs
def test_a_bf16_llama_sharded_over_two_processes_trains_on_user_data_like_one(zoo, tmp_path):
    """A hub-like checkpoint (untied head, stored in bf16): sft on the user's rows, then a pairwise
    reward model on it, each sharded over 2 processes, against 1 process."""
    sft = ["sft", "--model", zoo["llama_bf16"], "--data", zoo["data"]["jsonl"], "--prompt-field", "question",
           "--completion-field", "answer", "--steps", 6, "--batch-size", 8, "--eval-fraction", 0.25, "--lr", 1e-3,
           "--num-threads", 1]
    assert main([str(a) for a in [*sft, "--out", tmp_path / "sft_one"]]) == 0
    result = launch_fsdp([*sft, "--out", tmp_path / "sft_two"])
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = (tmp_path / f"sft_{n}" / "checkpoints" / "sft" for n in ("one", "two"))
    assert largest_difference(one, two) <= 1e-2  # bf16 as stored: one bf16 spacing at most
    assert json.loads((two / "config.json").read_text())["dtype"] == "bfloat16"  # saved as it came in
    assert {t.dtype for t in weights(two).values()} == {torch.bfloat16}
    rm = ["rm", "--mode", "pairwise", "--model", two, "--data", zoo["pairs"], "--prompt-field", "query",
          "--chosen-field", "good", "--rejected-field", "bad", "--steps", 6, "--batch-size", 8, "--num-threads", 1]
    assert main([str(a) for a in [*rm, "--out", tmp_path / "rm_one"]]) == 0
    result = launch_fsdp([*rm, "--out", tmp_path / "rm_two"])
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = (tmp_path / f"rm_{n}" / "checkpoints" / "reward" for n in ("one", "two"))
    assert largest_difference(one, two) <= 1e-2
    # PPO on it: actor and separate critic sharded, the bf16 reference and reward model sharded for
    # inference, held-out prompts scored by the (gathered) reward model.
    ppo = ["ppo", "--model", tmp_path / "sft_two" / "checkpoints" / "sft", "--reward-model", two, "--prompts",
           zoo["prompts"], "--eval-prompts", zoo["prompts"], "--critic", "separate", "--no-do-sample",
           "--batch-size", 4, "--mini-batch-size", 2, "--max-new-tokens", 6, "--iterations", 2, "--eval-every", 2,
           "--lr", 1e-4, "--num-threads", 1]
    assert main([str(a) for a in [*ppo, "--out", tmp_path / "ppo_one"]]) == 0
    result = launch_fsdp([*ppo, "--out", tmp_path / "ppo_two"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "actor, critic, reference and reward model split over the 2 processes" in result.stdout
    one, two = (tmp_path / f"ppo_{n}" / "checkpoints" / "actor" for n in ("one", "two"))
    assert largest_difference(one, two) <= 1e-2
    summaries = [json.loads((tmp_path / f"ppo_{n}" / "summary.json").read_text()) for n in ("one", "two")]
    assert summaries[1]["after"]["eval/score"] == pytest.approx(summaries[0]["after"]["eval/score"], abs=1e-2)
