"""``--help`` in groups a person scans (config.py, GROUPS), and docs/usage.md in the same order.

Each option names its group where it is declared (``option(..., group=...)``, or its class's
``option_group``); a new option without one fails here, naming it.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from ppo_rlhf.cli import build_parser
from ppo_rlhf.config import GROUPS, flag_name, help_groups, option, option_group

USAGE = Path(__file__).resolve().parent.parent / "docs" / "usage.md"
SECTION = "## Options by group"


def commands() -> dict[str, argparse.ArgumentParser]:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(subparsers.choices)


def test_every_option_of_every_command_has_a_group():
    missing = sorted({f"{parser.get_default('config_class').__name__}.{field.name}"
                      for parser in commands().values()
                      for _, fields in help_groups(parser.get_default("config_class")) for field in fields
                      if option_group(parser.get_default("config_class"), field) not in GROUPS})
    assert not missing, (f"options without a --help group (give option(..., group=...) one of {GROUPS}, or their "
                         f"class an option_group): {missing}")


def test_an_option_without_a_group_is_found():
    """What the test above relies on: an option declared without a group, in a class without one."""
    from dataclasses import dataclass

    @dataclass
    class Options:
        grouped: int = option(1, "a count", group="rollout")
        loose: int = option(2, "another")

    assert [(title, [f.name for f in fields]) for title, fields in help_groups(Options)] == [
        ("rollout", ["grouped"]), ("other options", ["loose"])]
    with pytest.raises(ValueError, match="unknown option group 'rollouts'"):
        option(1, "a count", group="rollouts")


def shown_groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[str]]]:
    """(title, flags) of each group of config options ``parser`` shows in --help, in order."""
    return [(group.title, [action.option_strings[0] for action in group._group_actions])
            for group in parser._action_groups if group.title in GROUPS or group.title == "other options"]


def test_ppo_help_shows_the_groups_in_order_with_the_first_options_at_the_top():
    groups = shown_groups(commands()["ppo"])
    titles = [title for title, _ in groups]
    assert titles == [title for title in GROUPS if title in titles] and len(titles) >= 8
    flags = dict(groups)
    assert flags["model and data"][:3] == ["--model", "--prompts", "--task"]
    assert flags["reward"][:4] == ["--reward-model", "--reward-fn", "--reward-url", "--reward-weights"]
    assert flags["rollout"][:2] == ["--batch-size", "--samples-per-prompt"]
    assert flags["update and loss"][:3] == ["--iterations", "--lr", "--estimator"]
    assert flags["KL"][0] == "--kl-coef" and flags["episodes"][:2] == ["--environment", "--tool"]
    assert flags["rollout engine"][0] == "--rollout-engine" and flags["hardware"][0] == "--device"
    assert flags[GROUPS[-1]][:3] == ["--out", "--resume", "--overwrite"]
    assert max(len(shown) for shown in flags.values()) < 40  # no group of a hundred options


def options_by_group() -> str:
    """docs/usage.md's section: each command's groups and their flags, as --help shows them."""
    lines = [SECTION, ""]
    for name, parser in commands().items():
        lines += [f"`{name}`:", ""]
        lines += [f"- {title}: " + ", ".join(f"`{flag}`" for flag in flags) for title, flags in shown_groups(parser)]
        lines.append("")
    return "\n".join(lines)


def test_usage_lists_the_options_by_group_as_help_does():
    text = USAGE.read_text()
    assert SECTION in text, f"docs/usage.md has no {SECTION!r} section"
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    documented = text[start:end if end != -1 else len(text)].strip()
    # The section opens with a paragraph of its own; the lists after it must be --help's.
    lists = documented[re.search(r"^`[\w-]+`:$", documented, re.M).start():].strip()
    expected = options_by_group()[len(SECTION):].strip()
    assert lists == expected, f"docs/usage.md's {SECTION!r} lists differ from --help; they should read:\n{expected}"


@pytest.mark.parametrize("name", ["sft", "rm", "eval", "gym"])
def test_each_command_opens_its_groups_with_what_it_reads(name):
    first = dict(shown_groups(commands()[name]))["model and data"][0]
    assert first == {"sft": "--model", "rm": "--model", "eval": "--model", "gym": "--env"}[name]


def test_flag_names_in_the_groups_are_the_fields_flags():
    parser = commands()["ppo"]
    cls = parser.get_default("config_class")
    declared = {flag_name(field) for _, fields in help_groups(cls) for field in fields}
    assert declared == {flag for _, flags in shown_groups(parser) for flag in flags}
    assert all(re.fullmatch(r"--[a-z0-9-]+", flag) for flag in declared)
