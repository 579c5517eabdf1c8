"""Typed configuration: one dataclass per stage, loaded from YAML and overridden by flags.

Every field is declared with :func:`option`, which carries the one-line help text shown by
``--help`` and, for a number, the range it must lie in (:class:`Range`).  Precedence: dataclass
default < ``--recipe`` (recipes.py) < YAML file < command-line flag.  Unknown keys and invalid values fail at start with a
message that names the key and says what is allowed (docs/design.md, "Configuration").
"""

from __future__ import annotations

import argparse
import contextvars
import copy
import dataclasses
import difflib
import inspect
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar


from ppo_rlhf.recipes import recipe_settings

C = TypeVar("C")


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The numbers a numeric option accepts: finite, between ``low`` and ``high`` (None: unbounded),
    each end closed (included) unless marked open.  Build one with :func:`at_least`,
    :func:`above`, :func:`between` or :func:`any_number`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def __str__(self) -> str:
        return self.describe("x")

    def describe(self, name: str) -> str:
        """The range in words, ``name`` standing for the value: "> 0", "0 <= gamma <= 1"."""
        low = None if self.low is None else f"{_number(self.low)} {'<' if self.low_open else '<='} "
        high = None if self.high is None else f"{'<' if self.high_open else '<='} {_number(self.high)}"
        if low and high:
            return f"{low}{name} {high}"
        if low:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if high:
            return high
        return "any finite number"

    def outside(self, kind: type) -> list:
        """Values of ``kind`` (int or float) just outside the range: what a test feeds the option."""
        step = 1 if kind is int else 0.5
        values = []
        if self.low is not None:
            values.append(kind(self.low) if self.low_open else kind(self.low - step))
        if self.high is not None:
            values.append(kind(self.high) if self.high_open else kind(self.high + step))
        if kind is float:
            values += [math.nan, math.inf, -math.inf]
        return values


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def at_least(low: float) -> Range:
    return Range(low=low)


def above(low: float) -> Range:
    return Range(low=low, low_open=True)


def between(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Range:
    return Range(low, high, low_open, high_open)


def any_number() -> Range:
    """Any finite number (a coefficient whose sign means something, a log-std, a weight)."""
    return Range()


# Ranges many options share.  Seeds: numpy's (0 .. 2**32 - 1), which seeds the gym envs and data
# shuffles; threads: 0 leaves torch's default.
SEEDS = between(0, 2**32 - 1)
THREADS = at_least(0)
# Sampling temperatures.  Below 0.01 sampling is greedy decoding (two tokens one logit apart are
# drawn e^100 : 1 at 0.01); vLLM raises such a temperature to 0.01 itself (its sampling_params.py),
# so its rollouts would be drawn at another temperature than the trainer's log-probs are taken at;
# and the log-probs of logits / T grow with 1 / T until the losses leave float32 (a ppo run at
# 1e-30 stopped as "diverged ... lower the learning rate").
TEMPERATURES = at_least(0.01)


# The groups ``--help`` shows a command's options in, in this order (docs/usage.md, "Options by
# group", lists them so).  Each option belongs to one: its own ``option(..., group=...)``, else
# the one its class declares for all its options (``option_group``, a mixin's such as
# HardwareOptions); tests/test_help_groups.py fails for an option with neither.  Within a group
# the options people set first (``first=True``) come first.
MODEL_DATA, REWARD, ROLLOUT, UPDATE, KL = "model and data", "reward", "rollout", "update and loss", "KL"
EPISODES, ENGINE, HARDWARE, RUN = "episodes", "rollout engine", "hardware", "run folder, evaluation, logging, checkpoints"
GROUPS = (MODEL_DATA, REWARD, ROLLOUT, UPDATE, KL, EPISODES, ENGINE, HARDWARE, RUN)


def option(default: Any, help: str, choices: tuple | None = None, flag: str | None = None,  # noqa: A002
           range: Range | None = None,  # noqa: A002 -- the word the declarations read best with
           group: str | None = None, first: bool = False, words: tuple[str, ...] = ()) -> Any:
    """A config field with its help text and, optionally, its allowed values, its flag name, or
    (for a number, or a list of numbers: each item) the :class:`Range` it must lie in; the
    ``--help`` group it is shown in (one of GROUPS; default: its class's ``option_group``), and
    ``first``: one of the options people set first, at the top of its group.  Every int and float
    field declares a range (tests/test_option_ranges.py walks them all).  ``words``: what a number
    option also takes in place of a number (``auto``: the program chooses), kept as the word."""
    if group is not None and group not in GROUPS:
        raise ValueError(f"unknown option group {group!r}; the groups are {GROUPS}")
    metadata = {"help": help, "choices": choices, "flag": flag, "range": range, "group": group, "first": first,
                "words": words}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def check(condition: bool, key: str, allowed: str, value: Any) -> None:
    """Raise ConfigError naming ``key``, its bad ``value`` and what is ``allowed``."""
    if not condition:
        raise ConfigError(f"invalid value for '{key}': {value!r}; allowed: {allowed}")


def check_range(field: dataclasses.Field, value: Any) -> None:
    """ConfigError unless ``value`` (each item of a list) lies in the field's declared range."""
    declared = field.metadata.get("range")
    if declared is None or value is None:
        return
    optional = _base_type(field.type)[1]
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, (int, float)) and item not in declared:
            allowed = "a finite number" if declared == Range() else declared.describe(field.name)
            if not math.isfinite(item) and declared != Range():
                allowed = f"a finite number, {allowed}"
            if isinstance(value, list):
                allowed = f"each {allowed}"
            check(False, field.name, allowed + (" or empty" if optional else ""), value)


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
    # An optional field left empty (--reward-fn "" on the command line) is unset, as the help texts say;
    # a word that is one of its choices (--is-correction none) is that choice.
    if value is None or (optional and is_empty_word(value) and value not in (field.metadata.get("choices") or ())):
        if optional:
            return None
        raise ConfigError(f"'{field.name}' in {cls.__name__} cannot be empty")
    # Booleans are true or false, and numbers are not booleans: YAML's `1` or "yes" for a switch,
    # or `true` for a count, is refused rather than read one way or another (docs/design.md,
    # "Configuration").  Flags cannot give either: a switch is --x / --no-x.
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"invalid value for '{field.name}': {value!r}; allowed: true or false")
    if kind in (int, float) and isinstance(value, bool):
        raise ConfigError(f"invalid value for '{field.name}': {value!r}; allowed: a number, not true or false")
    words = field.metadata.get("words") or ()
    if isinstance(value, str) and value.strip().lower() in words:  # a number option's word (auto)
        return value.strip().lower()
    try:
        if kind is bool:
            return value
        if kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if kind is float:
            return float(value)
        if kind is list:
            items = _coerce_list(value, whole_paths=_item_type(field.type) is str)
        else:
            return kind(value)
    except (TypeError, ValueError):
        named = "".join(f" or {word}" for word in words)
        raise ConfigError(
            f"'{field.name}' must be {getattr(kind, '__name__', kind)}{named}, got {value!r}"
        ) from None
    return _coerce_numbers(field, items)


EMPTY_WORDS = ("", "none", "null")  # how a flag or YAML string leaves an optional field empty


def is_empty_word(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in EMPTY_WORDS


def _item_type(annotation: Any) -> type | None:
    """The item type of a list annotation (``list[int]`` -> int), else None."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"typing": typing}, {})  # noqa: S307 -- our own annotations
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return _item_type(args[0])
    return args[0] if typing.get_origin(annotation) in (list, tuple) and args else None


def _coerce_numbers(field: dataclasses.Field, items: list) -> list:
    """A list of numbers (``list[int]``, ``list[float]``) with each item converted; other lists as they are."""
    kind = _item_type(field.type)
    if kind not in (int, float):
        return items
    words = "integers, e.g. 64,64" if kind is int else "numbers, e.g. 1,0.5"
    try:
        if any(isinstance(item, bool) or (kind is int and isinstance(item, float) and not item.is_integer())
               for item in items):
            raise ValueError
        return [kind(item) for item in items]
    except (TypeError, ValueError):
        raise ConfigError(f"invalid value for '{field.name}': {items!r}; allowed: comma-separated {words}") from None


def _coerce_list(value: Any, whole_paths: bool = False) -> list:
    """A list field from YAML (a list, or one comma-separated string) or from flags (each
    repeated flag's value, comma-separated): one flat list.  An empty value empties the list so
    far, so that ``--reward-fn ""`` still unsets what came before it.  Numbers are converted by
    :func:`_coerce_numbers`, other items checked by the config's ``validate``.

    ``whole_paths`` (a list of strings): a value naming a file or folder that exists, or
    ``path:function`` with such a path, is one item, commas and all; splitting it would hand on
    the pieces of a path as items of their own (docs/design.md, "Configuration")."""
    flat = []
    for item in [value] if isinstance(value, str) else list(value):
        if isinstance(item, str) and not item.strip():
            flat = []
        elif isinstance(item, str) and whole_paths and _names_a_path(item):
            flat.append(item)
        elif isinstance(item, str):
            flat += [part for part in item.split(",") if part]
        else:
            flat.append(item)
    return flat


def _names_a_path(item: str) -> bool:
    """Whether ``item`` (``path`` or ``path:function``) names a file or folder that exists."""
    path = item.rpartition(":")[0] if ":" in item else item
    try:
        return bool(path) and Path(path).exists()
    except OSError:  # a name too long for the file system names no path
        return False


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
        kwargs[name] = field_value(cls, fields[name], value)
    given = _GIVEN.set(frozenset(kwargs))  # a recipe's settings give way to these, equal to a default or not
    try:
        config = cls(**kwargs)
        if not hasattr(config, "__post_init__"):  # one that checks itself when built (run_folder.py) is done
            check_config(config)
    finally:
        _GIVEN.reset(given)
    return config


# The fields given to the config being built (build_config: the YAML's and the flags' keys); None
# while a config is built in Python, whose given fields are those that differ from their defaults.
_GIVEN: contextvars.ContextVar = contextvars.ContextVar("given_fields", default=None)


def apply_recipe(config: Any) -> None:
    """``config.recipe``'s settings (recipes.py) in place of the defaults: every field of the recipe
    not given (in the YAML or by a flag; built in Python: still at its default) takes the recipe's
    value.  Done once, when the config is first checked."""
    name = getattr(config, "recipe", None)
    if not name:
        return
    fields = {field.name: field for field in dataclasses.fields(config)}
    given = _GIVEN.get()
    for key, value in recipe_settings(type(config).__name__, name).items():
        field = fields[key]
        default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        if (key not in given) if given is not None else getattr(config, key) == default:
            setattr(config, key, copy.deepcopy(value))


def recipe_overrides(config: Any) -> dict[str, tuple[Any, Any]]:
    """The settings of ``config.recipe`` that the config holds otherwise: field -> (its value, the
    recipe's).  Empty without a recipe."""
    name = getattr(config, "recipe", None)
    if not name:
        return {}
    return {key: (getattr(config, key), value) for key, value in recipe_settings(type(config).__name__, name).items()
            if getattr(config, key) != value}


def from_recipe(config: Any, message: str) -> str:
    """Where a refused value came from when the recipe set it (the user never gave it), for the
    refusal's message; "" otherwise."""
    name = getattr(config, "recipe", None)
    if not name or not message.startswith("invalid value for '"):
        return ""
    key = message.removeprefix("invalid value for '").split("'", 1)[0]
    settings = recipe_settings(type(config).__name__, name)
    if key not in settings or key in recipe_overrides(config):
        return ""
    return f" ({key} {settings[key]!r} is --recipe {name}'s: give the option another value, or leave the recipe out)"


def recipe_line(config: Any) -> str | None:
    """The recipe as a run's plan prints it: its flags, and those given over it (None: no recipe)."""
    name = getattr(config, "recipe", None)
    if not name:
        return None
    fields = {field.name: field for field in dataclasses.fields(config)}

    def flag(key: str, value: Any) -> str:
        spelled = flag_name(fields[key])
        if isinstance(value, bool):
            return spelled if value else f"--no-{spelled.removeprefix('--')}"
        return f"{spelled} {value:g}" if isinstance(value, float) else f"{spelled} {value}"

    settings = " ".join(flag(key, value) for key, value in recipe_settings(type(config).__name__, name).items())
    overrides = recipe_overrides(config)
    given = "; given over it: " + ", ".join(flag(key, value) for key, (value, _) in overrides.items()) if overrides else ""
    return f"{name} ({settings}){given}"


def field_value(cls: type, field: dataclasses.Field, value: Any) -> Any:
    """``value`` converted to the field's type, held to its choices and its declared range; a
    ConfigError naming the field otherwise."""
    coerced = _coerce(cls, field, value)
    choices = field.metadata.get("choices")
    if choices is not None and coerced not in choices:
        raise ConfigError(f"invalid value for '{field.name}': {coerced!r}; allowed: {choice_words(choices)}")
    check_range(field, coerced)
    return coerced


def choice_words(choices: tuple) -> str:
    """An option's choices as a message lists them: None, an optional field's unset value, is "empty"."""
    named = ", ".join(str(choice) for choice in choices if choice is not None)
    return f"{named} or empty" if None in choices else named


class FlagChoices(tuple):
    """The choices argparse shows and checks for a flag: the named ones; an optional field's None
    is not a word on the command line (argparse compares the text given, so a None in the list was
    shown as a choice and then refused), and is given as any empty word ("", none, null), as every
    optional field is."""

    def __new__(cls, choices: tuple):
        return super().__new__(cls, [choice for choice in choices if choice is not None])

    def __init__(self, choices: tuple):
        self.optional = None in choices

    def __contains__(self, value: object) -> bool:
        return super().__contains__(value) or (self.optional and is_empty_word(value))


def check_config(config: Any) -> None:
    """Every field of ``config`` checked as ``build_config`` checks a value read from YAML or a
    flag, then the class's ``validate`` (the rules between fields).

    A config checked before is checked again from the values it was given: ``validate`` fills in
    what was left empty (the estimator's paper defaults, LoRA's learning rate, a task's chat
    template), and a field it filled in and nobody changed since is emptied again first, so a
    field set after the config was built is checked as if it had been given from the start
    rather than against what the check had derived from its old value (docs/design.md,
    "Configuration")."""
    fields = dataclasses.fields(config)
    record = config.__dict__.get(_CHECKED)
    if record is None and getattr(config, "recipe", None) is not None:
        named = next(field for field in fields if field.name == "recipe")
        config.recipe = field_value(type(config), named, config.recipe)  # a name it has, before its settings
        apply_recipe(config)
    if record is not None:
        given, derived = record
        for field in fields:
            if getattr(config, field.name) == derived[field.name] != given[field.name]:
                setattr(config, field.name, copy.deepcopy(given[field.name]))
    for field in fields:
        setattr(config, field.name, field_value(type(config), field, getattr(config, field.name)))
    given = {field.name: copy.deepcopy(getattr(config, field.name)) for field in fields}
    validate = getattr(config, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as error:
            raise ConfigError(f"{error}{from_recipe(config, str(error))}") from None
    config.__dict__[_CHECKED] = (given, {field.name: copy.deepcopy(getattr(config, field.name)) for field in fields})


_CHECKED = "_checked_from"  # (values as given, values after validate) of a config's last check


def checked_config(config: Any, cls: type[C], taker: str) -> C:
    """``config`` checked again for a trainer taking it (``taker``, e.g. "PPOTrainer"): a
    ConfigError names a config of another class, and any field changed since it was built is
    held to its declaration and the class's rules (:func:`check_config`)."""
    if not isinstance(config, cls):
        raise ConfigError(f"{taker} takes a {cls.__name__}, got a {type(config).__name__}: build a "
                          f"{cls.__name__}(...) for it")
    check_config(config)
    return config


def option_group(cls: type, field: dataclasses.Field) -> str | None:
    """The ``--help`` group of ``cls``'s ``field``: its own, else the one the class declaring it
    gives all its options (``option_group``); None for neither."""
    if field.metadata.get("group"):
        return field.metadata["group"]
    declaring = next(klass for klass in cls.__mro__ if field.name in inspect.get_annotations(klass))
    return vars(declaring).get("option_group")


def help_order(cls: type) -> list[dataclasses.Field]:
    """``cls``'s fields in the order ``--help`` lists them within a group: those marked ``first``,
    then the others; each part the class's own options in the order it declares them, then those
    of its bases, in the order it names them."""
    fields = {field.name: field for field in dataclasses.fields(cls)}
    ordered = {}
    for klass in cls.__mro__:
        for name in inspect.get_annotations(klass):
            if name in fields:
                ordered.setdefault(name, fields[name])
    return sorted(ordered.values(), key=lambda field: not field.metadata.get("first"))


def help_groups(cls: type) -> list[tuple[str, list[dataclasses.Field]]]:
    """(group, its fields in ``--help`` order) for each of GROUPS that ``cls`` has options in, in
    GROUPS' order; an option without a group last, under "other options"."""
    by_group: dict[str, list] = {}
    for field in help_order(cls):
        by_group.setdefault(option_group(cls, field) or "other options", []).append(field)
    return [(title, by_group[title]) for title in (*GROUPS, "other options") if title in by_group]


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field, in the groups of :func:`help_groups`; defaults are suppressed so we can
    tell which flags were given."""
    parser.set_defaults(config_class=cls)  # the tests find each command's options through it
    for title, fields in help_groups(cls):
        group = parser.add_argument_group(title)
        for field in fields:
            add_flag(group, field)


def add_flag(group, field: dataclasses.Field) -> None:
    """The flag of one config field (a switch, a repeated list flag, or a value)."""
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
            choices=FlagChoices(choices) if choices else None, metavar=None if choices else field.name.upper(),
        )


def config_from_args(cls: type[C], args: argparse.Namespace, yaml_values: dict | None = None) -> C:
    """Defaults, then the YAML values, then the flags that were actually given."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = dict(yaml_values or {})
    values.update({k: v for k, v in vars(args).items() if k in names})
    return build_config(cls, values)


def to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)
