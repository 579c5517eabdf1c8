"""The ``ppo-rlhf`` command: one subcommand per stage, each a thin layer over a trainer.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``func`` to the function that runs it.  This file only collects them.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import re
import sys

from ppo_rlhf.config import ConfigError

# Modules that add subcommands; each has register(subparsers).
SUBCOMMAND_MODULES = (
    "ppo_rlhf.cli_lm",
    "ppo_rlhf.cli_gym",
    "ppo_rlhf.cli_convert",
)


# A value that begins with a minus sign and reads as a number -- with an exponent (-1e-3), as
# inf or nan, or the first of a comma-separated list (--reward-weights -0.5,1) -- is a value, not a
# flag.  argparse takes only -1 and -0.5 so, and refused the others as a flag missing its value;
# no flag of ppo-rlhf begins with a minus and a digit (docs/design.md, "Configuration").
_NUMBER = r"(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?|inf(?:inity)?|nan"
NEGATIVE_VALUE = re.compile(rf"^-(?:{_NUMBER})(?:,\s*[-+]?(?:{_NUMBER}))*$", re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    """argparse that reads negative numbers as values (``NEGATIVE_VALUE``) and, on an unknown
    flag, also suggests the closest allowed one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_VALUE

    def error(self, message: str):  # noqa: D401
        if "unrecognized arguments" in message:
            # argparse reports a subcommand's unknown flag from the top parser: look in both.
            parsers = [self] + [
                sub for action in self._actions if isinstance(action, argparse._SubParsersAction)
                for sub in action.choices.values()
            ]
            allowed = [o for parser in parsers for action in parser._actions for o in action.option_strings
                       if o.startswith("--")]
            hints = []
            for word in message.split(":", 1)[1].split():
                if word.startswith("-"):
                    close = difflib.get_close_matches(word.split("=")[0], allowed, n=1)
                    if close:
                        hints.append(f"{word} -> did you mean {close[0]}?")
            if hints:
                message += "; " + "; ".join(hints)
            message += " (see --help for the allowed flags)"
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = _Parser(prog="ppo-rlhf", description="PPO from feedback (RLHF) for language models, and classic PPO.")
    subparsers = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ppo_rlhf.data import DataError
    from ppo_rlhf.distributed import end_processes, is_main_process
    from ppo_rlhf.envs.protocol import EnvironmentFailed
    from ppo_rlhf.envs.tools import ToolParserFailed
    from ppo_rlhf.interrupts import (RunInterrupted, aborted_message, failure_resume_hint, interrupted_message,
                                     stop_on_signals)
    from ppo_rlhf.models.loading import ModelError
    from ppo_rlhf.rollout.generation import EngineWeightsError
    from ppo_rlhf.rollout.reward import RewardError
    from ppo_rlhf.rollout.server_api import ServerRefused, ServerUnavailable
    from ppo_rlhf.trainers.guard import DivergenceError

    parser = build_parser()
    args = parser.parse_args(argv)
    # Ctrl-C / SIGTERM: the training loops stop at their next safe point; a command without one
    # (eval, merge, ...) stops at once, having written nothing half-done (its files are atomic).
    has_safe_points = args.command == "demo" or _can_resume(parser, args.command)
    try:
        with stop_on_signals() if has_safe_points else contextlib.nullcontext():
            result = args.func(args)
    except RunInterrupted as interrupted:
        if is_main_process():  # several processes: one line
            print(interrupted_message(interrupted, args.command, _can_resume(parser, args.command)), file=sys.stderr)
        end_processes()  # every process stopped at the same step (interrupts.stop_requested)
        return interrupted.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C, or one in a command without safe points
        print(aborted_message(args.command, _can_resume(parser, args.command)), file=sys.stderr)
        return 130
    except ConfigError as error:
        print(f"ppo-rlhf {args.command}: configuration error: {error}", file=sys.stderr)
        return 2
    except (FileNotFoundError, DataError, ModelError, RewardError, EnvironmentFailed, ToolParserFailed,
            ServerUnavailable, ServerRefused) as error:
        # Bad input (a missing file, a row without a field, a folder holding the wrong kind of
        # model, a reward function's bad output, an environment or a tool parser that raised, a
        # generation server that does not answer): the message names the culprit; no traceback.
        # Mid-run, how to continue once it is fixed, where this command can.
        hint = failure_resume_hint(error, _can_resume(parser, args.command))
        print(f"ppo-rlhf {args.command}: {error}{hint}", file=sys.stderr)
        return 2
    except (DivergenceError, EngineWeightsError) as error:
        # Not a usage error: 3, so that a sweep can tell a diverged run from a bad command line.
        print(f"ppo-rlhf {args.command}: {error}", file=sys.stderr)
        return 3
    end_processes()
    return int(result or 0)


def _can_resume(parser: argparse.ArgumentParser, command: str) -> bool:
    """Whether ``command`` takes --resume (the demo does not)."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return any("--resume" in action.option_strings for action in subparsers.choices[command]._actions)


def run() -> None:
    """The ``ppo-rlhf`` console command (and ``python -m ppo_rlhf.cli``): ``main()``, then exit.

    A process of a multi-process launch leaves without the interpreter's teardown.  By then the
    command has finished in every process (``end_processes``: barrier, group destroyed) and its
    files are closed; all that is left is finalisation, where now and then, under a loaded CPU, a
    process whose run had succeeded ended with SIGABRT ("terminate called without an active
    exception", exit -6: the message of a C++ thread that tries to take the GIL while the
    interpreter shuts down), and the launcher then reported the whole run as failed.
    """
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
