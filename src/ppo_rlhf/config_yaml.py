"""Reading YAML: a config file (``--config``), and the ``key=value,...`` settings of
``--task-config``, ``--environment-config`` and ``--chat-template-kwargs``, each read whole or
refused with a ConfigError that names the file, line or option (docs/design.md, "Configuration")."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml

from ppo_rlhf.config import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load``, but a key given twice in one mapping is an error: plain PyYAML keeps
    the last value, and the first is lost without a word.  Merge keys (``<<: *defaults``) are
    read as YAML reads them: the merged keys come first and a key of the mapping's own replaces
    one merged in, which is what a merge is for; a key given twice among the mapping's own (or
    within a merged mapping) is still refused."""

    def construct_mapping(self, node, deep=False):
        self.refuse_repeated_keys(node)
        return super().construct_mapping(node, deep)

    def refuse_repeated_keys(self, node) -> None:
        """ConfigError for a key given twice among ``node``'s own keys, or within a mapping it
        merges (PyYAML flattens a merged mapping's pairs into this one, where the last would win)."""
        seen = {}
        for key_node, value_node in node.value:
            if key_node.tag == MERGE_TAG:
                merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for mapping in merged:
                    if isinstance(mapping, yaml.MappingNode):
                        self.refuse_repeated_keys(mapping)
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, typing.Hashable):
                continue  # SafeLoader refuses it below, with its own message
            if key in seen:
                raise ConfigError(f"key '{key}' is given twice (lines {seen[key]} and {line}); YAML would keep only "
                                  f"the last, so give it once")
            seen[key] = line


MERGE_TAG = "tag:yaml.org,2002:merge"


def parse_yaml(text: str) -> Any:
    """YAML as ``yaml.safe_load`` reads it, with a key given twice refused (ConfigError)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass


def parse_key_values(text: str, option: str, example: str) -> dict:
    """``key=value,key=value`` (``--task-config``, ``--environment-config``) -> a dict, each value
    read as YAML (3, 0.5, true, [1, 2], text).  A comma inside brackets belongs to its value.  Read
    whole or refused (ConfigError naming ``option`` and the part): a bracket left open or closed
    twice, a key given twice, a value that is not YAML -- never the settings before the broken
    part with the rest dropped (docs/design.md, "Tasks")."""

    def refused(why: str) -> ConfigError:
        return ConfigError(f"invalid value for '{option}': {text!r}; {why}; allowed: key=value pairs separated by "
                           f"commas, e.g. {example} (a value is read as YAML)")

    depth, start, parts = 0, 0, []
    for i, char in enumerate(text):
        if char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
            if depth < 0:
                raise refused(f"the bracket '{char}' at character {i + 1} closes none that was opened")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise refused(f"a bracket opened in {text[start:]!r} is never closed")
    parts.append(text[start:])
    settings = {}
    for part in (p.strip() for p in parts):
        if not part:
            continue
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not key:
            raise refused(f"{part!r} is not key=value")
        if key in settings:
            raise refused(f"'{key}' is given twice")
        try:
            settings[key] = parse_yaml(value)
        except (yaml.YAMLError, ConfigError) as error:
            raise refused(f"the value of {part!r} is not YAML ({str(error).splitlines()[0]})") from None
    return settings


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = parse_yaml(path.read_text()) or {}
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys to values, got {type(data).__name__}")
    return data
