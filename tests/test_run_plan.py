"""A PPO run says what it will do before its first update, and warns about settings that cannot learn."""

from __future__ import annotations

from ppo_rlhf.config import build_config
from ppo_rlhf.trainers.ppo_config import FULL_MODEL_LR, LORA_LR, PPOConfig

from zoo import THREADS, run

BUDGET = ["--iterations", 1, "--batch-size", 4, "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 4,
          "--max-length", 32, "--save-every", 0, *THREADS]


def test_defaults_sample_and_pick_a_learning_rate_per_mode():
    config = build_config(PPOConfig, {"model": "m", "reward_fn": "r:f"})
    assert config.do_sample  # PPO's gradient assumes samples from the policy
    assert config.lr == FULL_MODEL_LR
    assert build_config(PPOConfig, {"model": "m", "reward_fn": "r:f", "lora": True}).lr == LORA_LR
    assert build_config(PPOConfig, {"model": "m", "reward_fn": "r:f", "lora": True, "lr": 1e-3}).lr == 1e-3


def test_plan_is_printed_and_greedy_rollouts_warn(zoo, tmp_path, capsys):
    run(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn", "ppo_rlhf_test_rewards:length_score",
         "--no-do-sample", "--out", tmp_path / "ppo", *BUDGET])
    printed = capsys.readouterr().out
    for role in ("actor:", "reference:", "critic:", "reward:", "rollout:", "update:", "KL:"):
        assert role in printed, role
    assert "k1 in the reward, kl_coef 0.3" in printed and "lr 1e-05" in printed
    assert "warning: greedy rollouts" in printed


def test_a_reward_without_spread_warns(zoo, tmp_path, capsys):
    reward = tmp_path / "flat.py"
    reward.write_text("def flat(prompts, responses):\n    return [1.0] * len(responses)\n")
    run(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn", f"{reward}:flat",
         "--out", tmp_path / "ppo", *BUDGET])
    captured = capsys.readouterr()
    assert "greedy" not in captured.out
    assert "every response of iteration 1 got the same score (1)" in captured.out + captured.err
