"""``--recipe``: the agents recipes' measured settings in place of the defaults, from one place
(recipes.py), each overridable by a setting given (issue 63)."""

from __future__ import annotations

import dataclasses

import pytest

from ppo_rlhf.cli import build_parser
from ppo_rlhf.config import ConfigError, build_config, config_from_args, recipe_line
from ppo_rlhf.recipes import RECIPES
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.sft import SFTConfig

CLASSES = {"SFTConfig": SFTConfig, "PPOConfig": PPOConfig}
EVERY = [(cls, name) for cls in RECIPES for name in RECIPES[cls]]


@pytest.mark.parametrize("cls, name", EVERY, ids=[name for _, name in EVERY])
def test_each_recipe_builds_its_settings(cls, name):
    config = build_config(CLASSES[cls], {"recipe": name})
    fields = {field.name for field in dataclasses.fields(config)}
    for key, value in RECIPES[cls][name].items():
        assert key in fields and getattr(config, key) == value, key
    assert recipe_line(config).startswith(f"{name} (") and "given over it" not in recipe_line(config)


def parsed(command: str, *flags: str):
    args = build_parser().parse_args([command, *flags])
    return config_from_args({"sft": SFTConfig, "ppo": PPOConfig}[command], args)


def test_a_flag_given_wins_over_the_recipe_even_at_its_default():
    config = parsed("sft", "--recipe", "agents-warm-up", "--lr", "3e-3", "--no-chat-template")  # both the defaults
    assert config.lr == 3e-3 and config.chat_template is False and config.steps == RECIPES["SFTConfig"]["agents-warm-up"]["steps"]
    assert recipe_line(config).endswith("given over it: --no-chat-template, --lr 0.003")
    config = parsed("ppo", "--recipe", "agents-grpo", "--no-lora", "--iterations", "3")
    assert config.lora is False and config.iterations == 3 and config.estimator == "grpo"


def test_a_yaml_setting_wins_over_the_recipe_and_a_flag_over_both():
    config = build_config(PPOConfig, {"recipe": "agents-ppo", "lr": 1e-4})
    assert config.lr == 1e-4 and config.lam == RECIPES["PPOConfig"]["agents-ppo"]["lam"]


def test_a_config_built_in_python_takes_the_recipe_where_a_field_is_at_its_default():
    config = SFTConfig(recipe="agents-warm-up", steps=5)
    assert config.steps == 5 and config.lr == RECIPES["SFTConfig"]["agents-warm-up"]["lr"]
    config.batch_size = 4  # checked again by a trainer: the recipe is applied once, a field set since is kept
    from ppo_rlhf.config import check_config

    check_config(config)
    assert config.batch_size == 4 and config.steps == 5


def test_a_refusal_of_a_recipes_value_says_it_came_from_the_recipe():
    with pytest.raises(ConfigError, match=r"'critic_lr'.*no critic.*is --recipe agents-ppo's"):
        build_config(PPOConfig, {"recipe": "agents-ppo", "estimator": "grpo", "samples_per_prompt": 8})


def test_an_unknown_recipe_is_refused_naming_the_ones_there_are():
    with pytest.raises(ConfigError, match="'recipe'.*agents-grpo, agents-ppo"):
        build_config(PPOConfig, {"recipe": "agents"})
    with pytest.raises(ConfigError, match="'recipe'.*agents-warm-up"):
        build_config(SFTConfig, {"recipe": "agents-grpo"})
