"""Bad input fails at start with a message that names the culprit and what is allowed."""

import json

import pytest

from ppo_rlhf.cli import main
from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.data import DataError, load_rows
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.sft import SFTConfig


@pytest.mark.parametrize(
    "values, message",
    [
        ({"lr": -1e-5}, "'lr'.*> 0"),
        ({"clip_ratio": 0}, "'clip_ratio'.*> 0"),
        ({"batch_size": 64, "mini_batch_size": 24}, "'mini_batch_size'.*divisor of batch_size"),
        ({"kl_estimator": "k7"}, "'kl_estimator'.*k1, k2, k3, full"),
        ({"kl_estimator": "k3"}, "'kl_estimator'.*k3 cannot go in the reward.*kl_in: loss"),
        ({"kl_estimator": "full"}, "'kl_estimator'.*full cannot go in the reward"),
        ({"kl_in": "loss", "kl_estimator": "k1"}, "'kl_estimator'.*k1 cannot go in the loss.*zero expected gradient"),
        ({"kl_in": "elsewhere"}, "'kl_in'.*reward, loss"),
        ({"gamma": 1.5}, "'gamma'"),
        ({"lr": "fast"}, "'lr' must be float"),
        ({"max_length": 64, "max_new_tokens": 128}, "'max_length'"),
        ({"entropy_warmup": -5}, "'entropy_warmup'.*>= 0"),
    ],
)
def test_invalid_values_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(PPOConfig, {"task": "doubling", **values})


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ConfigError, match="unknown key 'kl_coeff'.*did you mean 'kl_coef'"):
        build_config(PPOConfig, {"kl_coeff": 0.1})


def test_yaml_unknown_key_fails_through_the_cli(tmp_path, capsys):
    config = tmp_path / "sft.yaml"
    config.write_text("steps: 10\nlearning_rate: 0.1\n")
    assert main(["sft", "--config", str(config), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'learning_rate'" in err and "allowed:" in err


def test_wrong_flag_says_what_is_allowed(capsys):
    with pytest.raises(SystemExit):
        main(["ppo", "--kl-coeff", "0.1"])
    assert "did you mean --kl-coef" in capsys.readouterr().err


def test_wrong_choice_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["ppo", "--critic", "both"])
    assert "shared" in capsys.readouterr().err


def test_missing_checkpoint_names_the_path(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    assert main(["ppo", "--model", str(missing), "--task", "doubling", "--out", str(tmp_path / "r")]) == 2
    assert str(missing) in capsys.readouterr().err


def test_malformed_data_row_names_file_and_line(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"rows.jsonl:2"):
        load_rows(data)


def test_missing_field_names_field_file_and_line(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(DataError, match=r"rows.jsonl:2: missing field 'completion' \(the row has: prompt\)"):
        load_rows(data, ("prompt", "completion"))


def test_missing_data_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.jsonl"):
        load_rows(tmp_path / "nothing.jsonl")


def test_sft_config_rejects_zero_steps():
    with pytest.raises(ConfigError, match="'steps'"):
        build_config(SFTConfig, {"steps": 0})


@pytest.mark.parametrize("command", ["demo", "sft", "rm", "ppo", "eval", "merge", "gym", "gym-eval", "convert-gguf"])
def test_every_command_prints_its_help(command, capsys):
    # argparse %-formats help text: a bare "%" in one field's help once broke `ppo --help`.
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")
