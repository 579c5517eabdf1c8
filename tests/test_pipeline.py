"""Every command smoke-run on a tiny budget, run folders checked, checkpoints reloaded."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from ppo_rlhf.runlog import read_metrics
from zoo import TINY, run

SPEC_METRICS = ["score", "kl", "kl_coef", "pg_loss", "abs_pg_loss", "ppo_ratio", "ppo_ratio_clamped", "clipfrac",
                "approx_kl", "entropy", "vf_loss", "vf_clipfrac", "explained_variance", "response_length",
                "time/generate", "time/score", "time/train", "tokens_per_s"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    run(["sft", "--task", "doubling", "--steps", 30, "--batch-size", 32, "--eval-every", 0, "--out", root / "sft", *TINY])
    run(["rm", "--task", "doubling", "--steps", 10, "--batch-size", 16, "--out", root / "rm", *TINY])
    return root


def test_run_folders_and_checkpoints_reload(trained):
    for stage, name in (("sft", "sft"), ("rm", "reward")):
        folder = trained / stage
        for item in ("config.yaml", "metrics.jsonl", "summary.json", "curves.png", "tb"):
            assert (folder / item).exists(), (stage, item)
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["checkpoints"][name] == str(folder / "checkpoints" / name)
    tokenizer = AutoTokenizer.from_pretrained(trained / "sft" / "checkpoints" / "sft")
    assert tokenizer.eos_token == "E" and len(tokenizer) == 42
    assert AutoModelForCausalLM.from_pretrained(trained / "sft" / "checkpoints" / "sft").config.model_type == "gpt2"
    classifier = AutoModelForSequenceClassification.from_pretrained(trained / "rm" / "checkpoints" / "reward")
    assert classifier.config.num_labels == 3


def ppo_args(trained, out, *extra):
    return ["ppo", "--task", "doubling", "--model", trained / "sft" / "checkpoints" / "sft", "--out", out,
            "--batch-size", 16, "--mini-batch-size", 8, "--ppo-epochs", 2, "--max-new-tokens", 7, "--max-length", 19,
            "--do-sample", "--eval-every", 2, "--eval-size", 64, "--lr", 1e-4, "--num-threads", 1, *extra]


@pytest.mark.parametrize("critic, reward", [("shared", "model"), ("separate", "rule")])
def test_ppo_runs_with_each_critic_and_reward(trained, tmp_path, critic, reward):
    extra = ["--reward-model", trained / "rm" / "checkpoints" / "reward"] if reward == "model" else []
    out = tmp_path / "ppo"
    before = AutoModelForCausalLM.from_pretrained(trained / "sft" / "checkpoints" / "sft").state_dict()
    run(ppo_args(trained, out, "--iterations", 2, "--critic", critic, *extra))
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in SPEC_METRICS:
        assert all(key in r for r in records[1:]), key
    assert "eval/exact_match" in records[0] and "eval/exact_match" in records[2]
    summary = json.loads((out / "summary.json").read_text())
    actor = AutoModelForCausalLM.from_pretrained(summary["checkpoints"]["actor"])
    changed = [not torch.equal(before[k], v) for k, v in actor.state_dict().items() if k in before]
    assert any(changed), "PPO did not change the actor's weights"
    assert (out / "curves.png").exists() and (out / "tb").is_dir()


def test_ppo_resumes_from_its_last_checkpoint(trained, tmp_path):
    out = tmp_path / "ppo"
    run(ppo_args(trained, out, "--iterations", 2, "--save-every", 1, "--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward"))
    state = torch.load(out / "checkpoints" / "last" / "trainer_state.pt", weights_only=False)
    assert state["trainer"]["iteration"] == 2
    run(ppo_args(trained, out, "--iterations", 4, "--save-every", 1, "--resume",
                 "--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward"))
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4], steps  # continued at 3; nothing logged twice


def test_eval_command(trained, tmp_path, capsys):
    run(["eval", "--task", "doubling", "--model", trained / "sft" / "checkpoints" / "sft", "--size", 50,
         "--max-new-tokens", 7, "--out", tmp_path / "eval"])
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["prompts"] == 50 and 0.0 <= summary["exact_match"] <= 1.0


def test_pairwise_reward_model_on_jsonl(trained, tmp_path):
    rows = [{"prompt": f"S__:{q}x2=", "chosen": str(2 * q), "rejected": str(2 * q + 1)} for q in range(1000, 1100)]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "rm"
    run(["rm", "--mode", "pairwise", "--model", trained / "sft" / "checkpoints" / "sft", "--data", data,
         "--steps", 5, "--batch-size", 8, "--eval-fraction", 0.2, "--out", out, "--num-threads", 1])
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["eval_accuracy"] <= 1.0
    assert AutoModelForSequenceClassification.from_pretrained(out / "checkpoints" / "reward").config.num_labels == 1


def test_demo_on_a_tiny_budget(tmp_path, capsys):
    stages = tmp_path / "stages.yaml"
    stages.write_text("sft: {n_layer: 2, n_head: 2, n_embd: 32, eval_every: 0, batch_size: 32}\n"
                      "rm: {n_layer: 2, n_head: 2, n_embd: 32, batch_size: 16}\n"
                      "ppo: {batch_size: 16, mini_batch_size: 8, eval_every: 2, eval_size: 64}\n")
    out = tmp_path / "demo"
    run(["demo", "--out", out, "--sft-steps", 20, "--rm-steps", 5, "--ppo-iterations", 2, "--stages-config", stages])
    printed = capsys.readouterr().out
    assert "after PPO, greedy" in printed and "Samples" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["checkpoints"]) >= {"sft", "reward", "actor"}
    for path in summary["checkpoints"].values():
        assert Path(path).exists(), path
    for item in ("config.yaml", "metrics.jsonl", "curves.png", "tb"):
        assert (out / item).exists(), item


def test_max_approx_kl_ends_the_update_early(trained, tmp_path):
    out = tmp_path / "ppo"
    # 2 epochs x 2 minibatches = 4 steps per iteration; a tiny limit stops after the first,
    # because only the first minibatch is measured before the policy has moved.
    run(ppo_args(trained, out, "--iterations", 2, "--max-approx-kl", 1e-12,
                 "--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward"))
    steps = [r["update_steps"] for r in read_metrics(out / "metrics.jsonl") if "update_steps" in r]
    assert steps == [1, 1]
    run(ppo_args(trained, tmp_path / "free", "--iterations", 1, "--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward"))
    assert [r["update_steps"] for r in read_metrics(tmp_path / "free" / "metrics.jsonl") if "update_steps" in r] == [4]


@pytest.mark.parametrize("estimator", ["k3", "full"])
def test_kl_in_the_loss(trained, tmp_path, estimator):
    out = tmp_path / "ppo"
    run(ppo_args(trained, out, "--iterations", 2, "--kl-in", "loss", "--kl-estimator", estimator,
                 "--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward"))
    records = [r for r in read_metrics(out / "metrics.jsonl") if "kl_loss" in r]
    assert len(records) == 2
    assert all(r["kl_loss"] >= 0 and math.isfinite(r["kl_loss"]) for r in records)
    # The reward is the score alone: no KL term in it.
    assert all(r["non_score_reward"] == 0.0 for r in records)


def test_logged_kl_coef_is_the_one_the_iteration_used(trained, tmp_path):
    out = tmp_path / "ppo"
    run(ppo_args(trained, out, "--iterations", 2, "--kl-coef", 0.2, "--target-kl", 1e-6, "--kl-horizon", 10,
                 "--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward"))
    coefs = [r["kl_coef"] for r in read_metrics(out / "metrics.jsonl") if "kl_coef" in r]
    assert coefs[0] == 0.2 and coefs[1] != 0.2  # the controller moves only after iteration 1


def test_the_entropy_coefficient_ramps_in_over_its_warmup():
    """--entropy-warmup 4: a quarter of --entropy-coef in the first iteration, all of it from the fourth."""
    from types import SimpleNamespace

    from ppo_rlhf.config import build_config
    from ppo_rlhf.trainers.ppo import PPOTrainer
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    trainer = SimpleNamespace(config=build_config(PPOConfig, {"task": "doubling", "entropy_coef": -1.0,
                                                              "entropy_warmup": 4}), iteration=0)
    coefficients = []
    for iteration in range(6):
        trainer.iteration = iteration
        coefficients.append(PPOTrainer.entropy_coef(trainer))
    assert coefficients == [-0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    trainer.config.entropy_warmup = 0  # no warm-up: the whole coefficient from the start
    trainer.iteration = 0
    assert PPOTrainer.entropy_coef(trainer) == -1.0
