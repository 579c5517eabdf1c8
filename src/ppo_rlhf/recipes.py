"""Recipes: named settings that were measured to learn, given as ``--recipe NAME`` (docs/agents.md,
"Recipes"; the measurements: docs/benchmarks.md, "Agents").

A recipe's settings take the place of the defaults: a value given in the YAML file or by a flag
wins over the recipe's, one setting at a time, and the run's plan prints the recipe with the
settings given over it.  Each setting is one line here, and nowhere else: re-tuning a recipe from a
new measurement is changing its line (and the measurement's record in docs/benchmarks.md).
"""

from __future__ import annotations

# By the config class each command builds: recipe name -> {field: value}.
RECIPES: dict[str, dict[str, dict]] = {
    "SFTConfig": {
        # The SFT warm-up before the agents recipes: FrozenLake's seventh round (256 random walks, 16
        # steps of 8 rows at lr 1e-4; held-out success 5%, then 81-85% after PPO or GRPO), measured
        # when a row was one assistant turn; a row is now a whole conversation (benchmarks/results/
        # sft_rows.md), so 16 steps of 8 see every turn of 128 traces.  Not yet re-measured.
        "agents-warm-up": {
            "chat_template": True,
            "steps": 16,
            "batch_size": 8,
            "lr": 1e-4,
            "warmup_steps": 1,
            "max_length": 1024,  # ppo's budget for an episode: a trace that fits an episode fits here
        },
    },
    "PPOConfig": {
        # GRPO with the episode's reward: FrozenLake's seventh round, `--recipe grpo` of
        # benchmarks/bench_agents.py (held-out success 5% -> 85% in 4 iterations, 12.1 min).
        "agents-grpo": {
            "lora": True,
            "estimator": "grpo",
            "samples_per_prompt": 8,
            "batch_size": 32,
            "mini_batch_size": 16,
            "ppo_epochs": 1,
            "kl_in": "loss",
            "lr": 2e-4,
            "temperature": 1.0,
            "iterations": 8,
            "eval_every": 4,
        },
        # PPO with a critic crediting each move: FrozenLake's seventh round, `--recipe ppo-lambda`
        # (held-out success 5% -> 81% in 4 iterations, 15.5 min).  It ran with --turn-rewards
        # per-turn, which puts FrozenLake's only reward (at the goal, the episode's last move) where
        # sum puts it; left out here, so the recipe serves environments without per-turn rewards.
        "agents-ppo": {
            "lora": True,
            "estimator": "gae",
            "batch_size": 32,
            "mini_batch_size": 16,
            "ppo_epochs": 2,
            "lr": 3e-4,
            "lam": 0.95,
            "critic_lr": 1e-3,
            "critic_warmup": 1,
            "temperature": 1.0,
            "iterations": 8,
            "eval_every": 4,
        },
    },
}


def recipe_names(config_class: str) -> tuple[str, ...]:
    """The recipes of the command whose config class is named ``config_class``."""
    return tuple(RECIPES.get(config_class, {}))


def recipe_settings(config_class: str, name: str) -> dict:
    """The settings of recipe ``name`` for ``config_class`` (its choices are checked before)."""
    return dict(RECIPES[config_class][name])
