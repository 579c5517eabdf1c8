"""A PPO run says what it will do before its first update, warns about settings that cannot learn,
and shows what it is doing: training samples, held-out lines, curves redrawn at each evaluation."""

from __future__ import annotations

import json

import pytest

from ppo_rlhf.config import build_config
from ppo_rlhf.trainers.ppo_config import FULL_MODEL_LR, LORA_LR, PPOConfig, default_lr

from zoo import PROMPTS, THREADS, run

BUDGET = ["--iterations", 1, "--batch-size", 4, "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 4,
          "--max-length", 32, "--save-every", 0, *THREADS]


def test_defaults_sample_and_pick_a_learning_rate_per_mode():
    config = build_config(PPOConfig, {"model": "m", "reward_fn": "r:f"})
    assert config.do_sample  # PPO's gradient assumes samples from the policy
    assert config.lr is None  # a full model's default needs its width: the trainer resolves it
    assert config.lam == 1.0  # the score reaches every token before the critic has learned
    assert build_config(PPOConfig, {"model": "m", "reward_fn": "r:f", "lora": True}).lr == LORA_LR
    assert build_config(PPOConfig, {"model": "m", "reward_fn": "r:f", "lora": True, "lr": 1e-3}).lr == 1e-3


def test_default_full_model_lr_scales_with_the_width():
    assert default_lr(768, lora=False) == FULL_MODEL_LR  # GPT-2 small: the reference width
    assert default_lr(576, lora=False) == 1e-5 * 768 / 576  # SmolLM2-135M: 1.33e-5
    assert abs(default_lr(4096, lora=False) - 1.875e-6) < 1e-12  # a 7B model
    assert abs(default_lr(64, lora=False) - 1.2e-4) < 1e-12  # a toy
    assert default_lr(8, lora=False) == LORA_LR  # capped
    assert default_lr(None, lora=False) == FULL_MODEL_LR  # a config without a width
    assert default_lr(64, lora=True) == LORA_LR


def test_plan_is_printed_and_greedy_rollouts_warn(zoo, tmp_path, capsys):
    run(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn", "ppo_rlhf_test_rewards:length_score",
         "--no-do-sample", "--out", tmp_path / "ppo", *BUDGET])
    printed = capsys.readouterr().out
    for role in ("actor:", "reference:", "critic:", "reward:", "rollout:", "update:", "KL:"):
        assert role in printed, role
    # the zoo's Llama is 32 wide: 1e-5 x 768 / 32
    assert "k1 in the reward, kl_coef 0.05 (fixed)" in printed and "lr 0.00024" in printed
    assert "warning: greedy rollouts" in printed
    # --max-tokens-per-micro-batch auto: a budget from the memory free, and the batch in one pass where it fits
    assert "micro-batches of up to " in printed and " a token with a gradient)" in printed
    assert "rows that fit in one pass as without a budget: the whole batch a rollout pass" in printed


def test_a_reward_without_spread_warns(zoo, tmp_path, capsys):
    reward = tmp_path / "flat.py"
    reward.write_text("def flat(prompts, responses):\n    return [1.0] * len(responses)\n")
    run(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn", f"{reward}:flat",
         "--out", tmp_path / "ppo", *BUDGET])
    captured = capsys.readouterr()
    assert "greedy" not in captured.out
    assert "every response of iteration 1 got the same score (1)" in captured.out + captured.err


def test_training_samples_and_evaluations_are_shown_and_written(zoo, tmp_path, capsys):
    out = tmp_path / "ppo"
    run(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn", "ppo_rlhf_test_rewards:length_score",
         "--eval-prompts", zoo["prompts"], "--eval-every", 1, "--eval-size", 2, "--sample-every", 2,
         "--out", out, *BUDGET[:1], 3, *BUDGET[2:]])
    printed = capsys.readouterr().out
    assert "iteration 1 sample:" in printed and "iteration 2 sample:" in printed and "iteration 3 sample:" not in printed
    assert "iteration 3: held-out eval/score" in printed
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == {1, 2} and all({"prompt", "response", "score"} <= set(r) for r in rows)
    assert (out / "curves.png").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["training_score"]) == {"first", "last"}  # even without a task metric


@pytest.mark.learning
def test_sft_on_user_data_reports_a_held_out_loss(zoo, tmp_path, learning_seed, record_outcome):
    rows = [{"prompt": f"{p} {i}", "completion": " good answer"} for i in range(7) for p in PROMPTS]  # 42 rows
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "sft"
    run(["sft", "--model", zoo["llama"], "--data", data, "--eval-fraction", 0.25, "--eval-every", 5, "--steps", 10,
         "--batch-size", 8, "--lr", 1e-2, "--seed", learning_seed, "--out", out, *THREADS])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 32  # 10 rows held out, never trained on
    first, last = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval/loss" in r]
    record_outcome("last_eval_loss_over_first", last["eval/loss"] / first["eval/loss"])
    assert last["eval/loss"] < first["eval/loss"] and 0.0 <= last["eval/token_accuracy"] <= 1.0
    assert summary["final_eval"]["eval/loss"] == last["eval/loss"]
