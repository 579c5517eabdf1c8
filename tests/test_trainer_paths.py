"""Faster paths of the PPO update give the weights and metrics of the plain ones.

Each speed-up of trainers/ppo.py that claims to change nothing but round-off is run here against
the plain path for a few iterations on the built-in task's tiny model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ppo_rlhf.config import build_config
from ppo_rlhf.models import build_causal_lm
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.reward import FunctionReward
from ppo_rlhf.stages.ppo import draw_batch
from ppo_rlhf.tasks.doubling import make_task
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig

ITERATIONS = 3


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: with two, a parallel reduction's split can follow the machine's load, and
    two runs of the same path may then differ in the last bit, whatever the optimizer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_iterations(estimator: str) -> tuple[dict[str, torch.Tensor], list[dict], PPOTrainer]:
    torch.manual_seed(0)
    task = make_task(seed=0, n_eval=100)
    tokenizer = task.tokenizer
    model = build_causal_lm(tokenizer, n_layer=2, n_head=2, n_embd=32, seed=0)
    extra = {"samples_per_prompt": 4} if estimator == "grpo" else {}
    config = build_config(PPOConfig, {"task": "doubling", "estimator": estimator, "batch_size": 16,
                                      "mini_batch_size": 8, "ppo_epochs": 2, "max_new_tokens": 7, "max_length": 19,
                                      "lr": 1e-3, "entropy_coef": -0.1, "num_threads": 1, **extra})
    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, config.max_new_tokens, do_sample=True,
                               seed=0)
    reward = FunctionReward(task.rule_reward, name="doubling.rule_reward")
    trainer = PPOTrainer(config, reward, model=model, ref=copy.deepcopy(model), tokenizer=tokenizer, generator=generator)
    rng = torch.Generator().manual_seed(0)
    rows = task.prompt_rows()
    metrics = []
    for _ in range(ITERATIONS):
        step = trainer.step(draw_batch(rows, config, rng))
        metrics.append({k: v for k, v in step.items() if not k.startswith("time/") and "per_s" not in k})
    weights = {name: p.detach().clone() for name, p in trainer.actor.named_parameters()}
    if trainer.critic is not None:
        weights.update({f"critic.{n}": p.detach().clone() for n, p in trainer.critic.named_parameters()})
    return weights, metrics, trainer


def plain_adamw(monkeypatch) -> None:
    """torch.optim.AdamW as torch builds it on a CPU by default: the per-parameter loop."""
    original = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *args, **kwargs: original(*args, **{**kwargs, "fused": None,
                                                                                       "foreach": False}))


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_fused_adamw_gives_the_weights_and_metrics_of_the_plain_loop(estimator, monkeypatch):
    """Fused AdamW (trainers/optimizer.py) rounds differently from the loop: after 3 iterations of
    sampled rollouts the two runs still draw the same responses and every weight agrees to 1e-5."""
    fast_weights, fast_metrics, fast = run_iterations(estimator)
    assert all(group["fused"] for group in fast.optimizer.param_groups)  # the fast path is the one taken
    with monkeypatch.context() as patch:
        plain_adamw(patch)
        plain_weights, plain_metrics, plain = run_iterations(estimator)
    assert not any(group["fused"] or group["foreach"] for group in plain.optimizer.param_groups)
    for fast_row, plain_row in zip(fast_metrics, plain_metrics):
        assert fast_row.keys() == plain_row.keys()
        assert fast_row["response_length"] == plain_row["response_length"]  # the same rollouts
        for key, value in fast_row.items():
            assert value == pytest.approx(plain_row[key], rel=1e-3, abs=1e-5), key
    assert fast_weights.keys() == plain_weights.keys()
    largest = max((tensor - plain_weights[name]).abs().max().item() for name, tensor in fast_weights.items())
    assert largest <= 1e-5, largest
    moved = max((fast_weights[n] - p).abs().max().item() for n, p in build_causal_lm(
        fast.tokenizer, n_layer=2, n_head=2, n_embd=32, seed=0).named_parameters())
    assert moved > 100 * max(largest, 1e-7)  # the iterations did train, far beyond the difference
