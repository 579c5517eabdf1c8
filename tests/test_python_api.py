"""The Python API (``from ppo_rlhf import PPOConfig, PPOTrainer``): a config is checked when it is
built, a trainer takes in-memory models and Python rewards, and its run folder is the command
line's -- a run started in one resumes in the other to the weights of a straight run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ppo_rlhf import ConfigError, PPOConfig, PPOTrainer, RewardConfig, SFTConfig
from ppo_rlhf.cli import main
from ppo_rlhf.models import load_causal_lm, load_tokenizer

BUDGET = {"batch_size": 4, "mini_batch_size": 2, "ppo_epochs": 1, "max_new_tokens": 4, "max_length": 32,
          "save_every": 1, "num_threads": 1}


def flags(values: dict) -> list[str]:
    return [part for key, value in values.items() for part in (f"--{key.replace('_', '-')}", str(value))]


def run(args) -> None:
    assert main([str(a) for a in args]) == 0, args


def same_weights(a: Path, b: Path) -> None:
    first, second = (load_file(str(p / "checkpoints" / "actor" / "model.safetensors")) for p in (a, b))
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


@pytest.mark.parametrize("cls, field, value", [(PPOConfig, "batch_size", -1), (PPOConfig, "estimator", "ppo2"),
                                               (PPOConfig, "iterations", "many"), (SFTConfig, "steps", 0),
                                               (RewardConfig, "batch_size", 0)])
def test_a_config_built_in_python_is_checked_at_once(cls, field, value):
    with pytest.raises(ConfigError, match=field):
        cls(**{field: value})


def test_a_config_built_in_python_is_the_one_build_config_gives():
    from ppo_rlhf.config import build_config, to_dict

    values = {"reward_fn": "a.py:f,b.py:g", "reward_weights": "1,0.5", "batch_size": "8", "mini_batch_size": 4}
    assert to_dict(PPOConfig(**values)) == to_dict(build_config(PPOConfig, values))
    assert PPOConfig(**values).reward_weights == [1.0, 0.5]


@pytest.fixture
def ppo_settings(zoo) -> dict:
    reward = zoo["root"] / "ppo_rlhf_test_rewards.py"
    return {"model": str(zoo["llama"]), "prompts": str(zoo["prompts"]), "reward_fn": [f"{reward}:length_score"],
            **BUDGET}


def cli_args(settings: dict, out: Path, iterations: int, *extra) -> list:
    values = {key: value for key, value in settings.items() if key != "reward_fn"}
    return ["ppo", *flags(values), "--reward-fn", settings["reward_fn"][0], "--iterations", iterations,
            "--out", out, *extra]


def test_a_run_started_in_python_resumes_from_the_cli_and_the_other_way_round(ppo_settings, tmp_path):
    run(cli_args(ppo_settings, tmp_path / "straight", 4))
    summary = PPOTrainer(PPOConfig(**ppo_settings, out=str(tmp_path / "py_cli"), iterations=2)).train()
    assert summary["iterations"] == 2
    assert (tmp_path / "py_cli" / "checkpoints" / "last" / "trained.safetensors").is_file()
    run(cli_args(ppo_settings, tmp_path / "py_cli", 4, "--resume"))
    run(cli_args(ppo_settings, tmp_path / "cli_py", 2))
    summary = PPOTrainer(PPOConfig(**ppo_settings, out=str(tmp_path / "cli_py"), iterations=4, resume=True)).train()
    assert summary["iterations"] == 4 and set(summary) >= {"training_score", "before", "after", "checkpoints"}
    same_weights(tmp_path / "straight", tmp_path / "py_cli")
    same_weights(tmp_path / "straight", tmp_path / "cli_py")


def test_a_checkpoint_of_the_old_ppo_format_is_refused_by_name(ppo_settings, tmp_path, capsys):
    out = tmp_path / "old"
    last = out / "checkpoints" / "last"
    (last / "actor").mkdir(parents=True)
    (last / "actor" / "config.json").write_text("{}")
    torch.save({"trainer": {"iteration": 1}}, last / "trainer_state.pt")
    (out / "config.yaml").write_text("stage: ppo\n")
    with pytest.raises(ConfigError, match="old PPO format"):
        PPOTrainer(PPOConfig(**ppo_settings, out=str(out), iterations=2, resume=True))
    assert main([str(a) for a in cli_args(ppo_settings, out, 2, "--resume")]) == 2
    err = capsys.readouterr().err
    assert "old PPO format" in err and str(last / "actor") in err


def test_an_in_memory_model_with_a_python_reward(zoo, tmp_path):
    calls = []

    def short(prompts, responses, **columns):
        calls.append(len(responses))
        return [-float(len(response)) for response in responses]

    model, tokenizer = load_causal_lm(zoo["llama"]), load_tokenizer(zoo["llama"])
    config = PPOConfig(prompts=str(zoo["prompts"]), out=str(tmp_path / "run"), iterations=2, **BUDGET)
    trainer = PPOTrainer(config, reward=short, model=model, tokenizer=tokenizer)
    assert trainer.actor is model and trainer.ref is not model
    summary = trainer.train()
    assert calls == [4, 4] and summary["iterations"] == 2
    assert (tmp_path / "run" / "checkpoints" / "actor" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "summary.json").is_file() and (tmp_path / "run" / "metrics.jsonl").is_file()


def test_a_model_object_of_the_wrong_kind_is_named(ppo_settings, zoo, reward_models):
    from ppo_rlhf.models import ModelError, load_sequence_classifier

    tokenizer = load_tokenizer(zoo["llama"])
    classifier = load_sequence_classifier(reward_models["llama"] / "checkpoints" / "reward")
    config = PPOConfig(prompts=str(zoo["prompts"]), out="unused", iterations=1, **BUDGET)
    for wrong in (classifier, {"weights": 1}):
        with pytest.raises(ModelError, match=f"model= must be a causal language model.*got a {type(wrong).__name__}"):
            PPOTrainer(config, reward=lambda prompts, responses: [0.0] * len(responses), model=wrong,
                       tokenizer=tokenizer)


def test_pieces_of_a_model_given_without_it_are_refused(ppo_settings, zoo):
    with pytest.raises(ConfigError, match="tokenizer given without model="):
        PPOTrainer(PPOConfig(**ppo_settings), tokenizer=load_tokenizer(zoo["llama"]))


def test_rewards_given_both_ways_are_refused(ppo_settings, zoo):
    model, tokenizer = load_causal_lm(zoo["llama"]), load_tokenizer(zoo["llama"])
    with pytest.raises(ConfigError, match="given twice"):
        PPOTrainer(PPOConfig(**ppo_settings), reward=lambda prompts, responses: [0.0] * len(responses),
                   model=model, tokenizer=tokenizer)


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_sft_and_the_reward_model_from_python_write_the_cli_s_run_folder(stage, tmp_path):
    from ppo_rlhf import RewardTrainer, SFTTrainer

    values = {"task": "doubling", "steps": 4, "batch_size": 8, "save_every": 2, "n_layer": 1, "n_head": 2,
              "n_embd": 16, "num_threads": 1}
    if stage == "sft":
        values["eval_every"] = 0
    config_cls, trainer_cls, model = {"sft": (SFTConfig, SFTTrainer, "sft"), "rm": (RewardConfig, RewardTrainer, "reward")}[stage]
    summary = trainer_cls(config_cls(**values, out=str(tmp_path / "py"))).train()
    run([stage, *flags(values), "--out", tmp_path / "cli"])
    assert summary["stage"] == {"sft": "sft", "rm": "reward"}[stage]
    first, second = (load_file(str(tmp_path / name / "checkpoints" / model / "model.safetensors")) for name in ("py", "cli"))
    assert all(torch.equal(first[key], second[key]) for key in first)
    assert (tmp_path / "py" / "checkpoints" / "last" / "trained.safetensors").is_file()


def test_a_model_and_a_tokenizer_given_as_folders_are_loaded_as_the_config_would(ppo_settings, zoo, tmp_path):
    settings = {key: value for key, value in ppo_settings.items() if key != "model"}
    trainer = PPOTrainer(PPOConfig(**settings, out=str(tmp_path / "run")), model=str(zoo["llama"]),
                         tokenizer=str(zoo["llama"]))
    assert trainer.config.model == str(zoo["llama"]) and trainer.run_parts is not None
    assert trainer.step(trainer.run_parts.train_rows[:4])["score"] >= 0


def test_each_kind_of_reward_is_told_apart(zoo, ppo_settings):
    """A ScoringReward is used as it is; any other callable is a function; a string is a function's
    path (or a reward-model folder); a module is a sequence classifier; a list is summed."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from ppo_rlhf.rollout.reward import CombinedReward, FunctionReward, ModelReward, ScoringReward
    from ppo_rlhf.trainers.roles import as_reward

    class Mine(ScoringReward):
        def __call__(self, batch):
            return torch.zeros(len(batch.rows))

    config = PPOConfig(prompts=str(zoo["prompts"]))
    tokenizer = load_tokenizer(zoo["llama"])
    mine = Mine()
    assert as_reward(mine, config, tokenizer) is mine

    def f(prompts, responses):
        return [0.0] * len(responses)

    classifier = GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_head=2, n_embd=8, num_labels=1,
                                                          vocab_size=len(tokenizer)))
    combined = as_reward([f, ppo_settings["reward_fn"][0], classifier, mine], config, tokenizer)
    assert isinstance(combined, CombinedReward)
    kinds = [type(part) for part in combined.parts]
    assert kinds == [FunctionReward, FunctionReward, ModelReward, Mine], kinds
    assert combined.parts[2].model is classifier
    assert combined.model is classifier  # moved, frozen and sharded with the other frozen roles
