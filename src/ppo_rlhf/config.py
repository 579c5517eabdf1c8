"""Typed configuration: one dataclass per stage, loaded from YAML and overridden by flags.

Every field is declared with :func:`option`, which carries the one-line help text shown by
``--help``.  Precedence: dataclass default < YAML file < command-line flag.  Unknown keys and
invalid values fail at start with a message that names the key and says what is allowed.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message says what to change."""


def option(default: Any, help: str, choices: tuple | None = None, flag: str | None = None) -> Any:
    """A config field with its help text (and, optionally, its allowed values or flag name)."""
    metadata = {"help": help, "choices": choices, "flag": flag}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check(condition: bool, key: str, allowed: str, value: Any) -> None:
    """Raise ConfigError naming ``key``, its bad ``value`` and what is ``allowed``."""
    if not condition:
        raise ConfigError(f"invalid value for '{key}': {value!r}; allowed: {allowed}")


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, optional?) for annotations like ``int``, ``float | None``, ``list[str]``."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"typing": typing}, {})  # noqa: S307 -- our own annotations
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])[0], True
    if origin in (list, tuple):
        return list, False
    return annotation, False


def _coerce(cls: type, field: dataclasses.Field, value: Any) -> Any:
    """Convert a YAML or flag value to the field's type, or raise ConfigError naming the key."""
    kind, optional = _base_type(field.type)
    if kind is list and value is None and not optional:  # an empty list (a run_config.json from when the field was optional)
        return []
    # An optional field left empty (--reward-fn "" on the command line) is unset, as the help texts say.
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in ("none", "null", "")):
        if optional:
            return None
        raise ConfigError(f"'{field.name}' in {cls.__name__} cannot be empty")
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("true", "1", "yes"):
                return True
            if str(value).lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            return float(value)
        if kind is list:
            return _coerce_list(value)
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(
            f"'{field.name}' must be {getattr(kind, '__name__', kind)}, got {value!r}"
        ) from None


def _coerce_list(value: Any) -> list:
    """A list field from YAML (a list, or one comma-separated string) or from flags (each
    repeated flag's value, comma-separated): one flat list.  An empty value empties the list so
    far, so that ``--reward-fn ""`` still unsets what came before it.  The items are converted by
    the config's ``validate``, which can say what each must be."""
    flat = []
    for item in [value] if isinstance(value, str) else list(value):
        if isinstance(item, str) and not item.strip():
            flat = []
        elif isinstance(item, str):
            flat += [part for part in item.split(",") if part]
        else:
            flat.append(item)
    return flat


def read_setting(cls: type, name: str, value: Any) -> Any:
    """A saved setting as ``cls`` reads it now: a value saved before a field changed type (one
    reward function as a string, now a list of them) compares equal to the same value given now.
    Unknown names and values that no longer convert are returned as saved."""
    field = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    if field is None:
        return value
    try:
        return _coerce(cls, field, value)
    except ConfigError:
        return value


def build_config(cls: type[C], values: dict[str, Any], source: str = "config") -> C:
    """Make ``cls`` from a dict, rejecting unknown keys (with a suggestion) and invalid values."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown key '{key}' in {source} for {cls.__name__}{hint} "
                f"(allowed: {', '.join(sorted(fields))})"
            )
        field = fields[name]
        coerced = _coerce(cls, field, value)
        choices = field.metadata.get("choices")
        if choices is not None and coerced not in choices:
            raise ConfigError(
                f"invalid value for '{name}': {coerced!r}; allowed: {', '.join(map(str, choices))}"
            )
        kwargs[name] = coerced
    config = cls(**kwargs)
    validate = getattr(config, "validate", None)
    if validate is not None:
        validate()
    return config


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of keys to values, got {type(data).__name__}")
    return data


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field; defaults are suppressed so we can tell which flags were given."""
    group = parser.add_argument_group(f"{cls.__name__} options")
    for field in dataclasses.fields(cls):
        kind, _ = _base_type(field.type)
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        # argparse %-formats help strings: a literal % must be doubled.
        help_text = f"{field.metadata.get('help', '')} (default: {default})".replace("%", "%%")
        choices = field.metadata.get("choices")
        if kind is bool:
            group.add_argument(
                flag_name(field), dest=field.name, action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS, help=help_text,
            )
        elif kind is list:  # repeated or comma-separated: --reward-fn a:f --reward-fn b:g, or a:f,b:g
            group.add_argument(
                flag_name(field), dest=field.name, action="append", default=argparse.SUPPRESS, help=help_text,
                metavar=field.name.upper(),
            )
        else:
            group.add_argument(
                flag_name(field), dest=field.name, default=argparse.SUPPRESS, help=help_text,
                choices=choices, metavar=None if choices else field.name.upper(),
            )


def config_from_args(cls: type[C], args: argparse.Namespace, yaml_values: dict | None = None) -> C:
    """Defaults, then the YAML values, then the flags that were actually given."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = dict(yaml_values or {})
    values.update({k: v for k, v in vars(args).items() if k in names})
    return build_config(cls, values)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
