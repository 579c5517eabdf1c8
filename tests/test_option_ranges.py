"""Every numeric option declares its range, and every command refuses values outside it.

The cases are generated from the declarations (``option(..., range=...)``, docs/design.md,
"Configuration"), so they grow with them: for each command, each int or float option (or list of
them) and each value just outside its range (and nan, inf, -inf for a float), the command line
``ppo-rlhf COMMAND --option VALUE`` must exit 2 naming the option, without a traceback.  Config
building fails before any model or file is touched, so the whole table runs in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import traceback

import pytest
import yaml

from ppo_rlhf.cli import build_parser, main
from ppo_rlhf.config import (
    ConfigError, Range, _base_type, _item_type, above, any_number, at_least, between, build_config, flag_name,
)
from ppo_rlhf.config_yaml import parse_yaml

# Positional arguments a command needs before its options are looked at.
POSITIONALS = {"gym-eval": ["runs/nothing-here"]}


def command_classes() -> dict[str, type]:
    """Each subcommand and the config class its options come from."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.get_default("config_class") for name, sub in subparsers.choices.items()}


def numeric_kind(field: dataclasses.Field) -> type | None:
    """int or float for a number or a list of numbers, else None."""
    kind, _ = _base_type(field.type)
    if kind is list:
        kind = _item_type(field.type)
    return kind if kind in (int, float) else None


def numeric_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if numeric_kind(f) is not None]


def out_of_range_cases() -> list[tuple[str, str, str, object]]:
    """(command, field name, flag, value) for every value just outside a declared range."""
    cases = []
    for command, cls in sorted(command_classes().items()):
        for field in numeric_fields(cls):
            declared = field.metadata.get("range")
            if declared is None:
                continue  # test_every_numeric_option_declares_a_range says so
            for value in declared.outside(numeric_kind(field)):
                cases.append((command, field.name, flag_name(field), value))
    return cases


CASES = out_of_range_cases()


def test_every_command_has_a_config_class():
    assert all(cls is not None for cls in command_classes().values()), command_classes()


def test_every_numeric_option_declares_a_range():
    """A new int or float option without ``range=`` fails here, naming it."""
    missing = [f"{cls.__name__}.{field.name}" for cls in set(command_classes().values())
               for field in numeric_fields(cls) if field.metadata.get("range") is None]
    assert not missing, f"numeric options without a declared range: {missing}"


def test_every_default_lies_in_its_range():
    for cls in set(command_classes().values()):
        for field in numeric_fields(cls):
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            values = default if isinstance(default, list) else [default]
            words = field.metadata.get("words") or ()  # what the option takes in place of a number (auto)
            assert all(v in field.metadata["range"] for v in values if v is not None and v not in words), \
                (cls.__name__, field.name)


def test_the_table_covers_every_command_with_numbers():
    commands = {command for command, *_ in CASES}
    assert commands == {c for c, cls in command_classes().items() if numeric_fields(cls)}
    assert len(CASES) >= 300


@pytest.mark.parametrize("command, name, flag, value", CASES,
                         ids=[f"{c}{f}={v}" for c, _, f, v in CASES])
def test_a_value_outside_the_declared_range_is_refused_by_name(command, name, flag, value, capsys, tmp_path,
                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing may be written, but if it were, not in the repository
    argv = [command, *POSITIONALS.get(command, []), f"{flag}={value}"]
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse
        code = exit_info.code
    except Exception:  # noqa: BLE001 -- the point is to report it
        pytest.fail(f"traceback:\n{traceback.format_exc()}")
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"'{name}'" in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir()), "a refused command wrote files"


# ------------------------------------------------------------------ the mechanism itself
def test_range_membership_and_wording():
    assert 0 in at_least(0) and -1 not in at_least(0) and str(at_least(0)) == ">= 0"
    assert 0 not in above(0) and 1e-9 in above(0) and str(above(0)) == "> 0"
    assert 1 in between(0, 1) and 1 not in between(0, 1, high_open=True)
    assert str(between(0, 1, high_open=True)) == "0 <= x < 1"
    assert str(between(0, 2**32 - 1)) == "0 <= x <= 4294967295"
    assert -5.5 in any_number() and str(any_number()) == "any finite number"
    for declared in (at_least(0), above(0), between(0, 1), any_number()):
        assert math.nan not in declared and math.inf not in declared and -math.inf not in declared
    assert Range().outside(float)[:0] == [] and at_least(1).outside(int) == [0]


def test_the_message_names_the_option_and_the_range():
    from ppo_rlhf.trainers.sft import SFTConfig

    with pytest.raises(ConfigError, match=r"invalid value for 'steps': 0; allowed: > 0$"):
        build_config(SFTConfig, {"steps": 0})
    with pytest.raises(ConfigError, match=r"invalid value for 'lr': nan; allowed: a finite number, > 0$"):
        build_config(SFTConfig, {"lr": "nan"})


def test_yaml_booleans_and_numbers_are_not_mixed():
    from ppo_rlhf.trainers.gym_config import GymPPOConfig

    for value in (1, 0, "yes", "true", "on"):
        with pytest.raises(ConfigError, match="'norm_adv'.*true or false"):
            build_config(GymPPOConfig, {"norm_adv": value})
    for value in (True, False):
        with pytest.raises(ConfigError, match="'num_envs'.*not true or false"):
            build_config(GymPPOConfig, {"num_envs": value})
        with pytest.raises(ConfigError, match="'hidden_sizes'"):
            build_config(GymPPOConfig, {"hidden_sizes": [64, value]})
    assert build_config(GymPPOConfig, {"norm_adv": False, "num_envs": "8", "lr": 1}).num_envs == 8
    # YAML 1.1, as PyYAML reads it: unquoted yes/no/on/off are booleans, so they are accepted.
    assert build_config(GymPPOConfig, parse_yaml("norm_adv: no")).norm_adv is False


def test_a_yaml_key_given_twice_is_an_error_at_any_depth():
    with pytest.raises(ConfigError, match=r"key 'lr' is given twice \(lines 1 and 3\)"):
        parse_yaml("lr: 1\nseed: 2\nlr: 3\n")
    with pytest.raises(ConfigError, match="key 'steps' is given twice"):
        parse_yaml("sft:\n  steps: 1\n  steps: 2\nrm: {}\n")
    assert parse_yaml("a: 1\nb: {a: 2}\n") == yaml.safe_load("a: 1\nb: {a: 2}\n")
