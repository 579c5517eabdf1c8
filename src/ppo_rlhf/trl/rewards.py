"""What TRL's scripts import from ``trl.rewards``: ``accuracy_reward`` (math answers checked with
math_verify against a ``solution`` column) and ``think_format_reward``, as TRL 1.16 defines them
(Apache-2.0, (c) the HuggingFace team; trl/rewards of the 1.16.0 wheel).  Reward functions in
TRL's calling convention: this project's FunctionReward calls them as TRL's trainers do."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable


def accuracy_reward(completions: list[list[dict[str, str]]], solution: list[str],
                    log_extra: Callable[[str, list], None] | None = None, **kwargs) -> list[float | None]:
    """1.0 where the completion's answer (math_verify, \\boxed first) equals the parsed solution, 0.0
    where not, None (skip the row) where the solution cannot be parsed; ``log_extra`` gets the
    solutions and what was parsed of each (TRL's)."""
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError:
        raise ImportError("Please install the `math_verify` package to use accuracy_reward") from None
    contents = [completion[0]["content"] for completion in completions]
    rewards, gold_parsed_strs, answer_parsed_strs = [], [], []
    # math_verify times out with signal.alarm(), which only the main thread may use.
    is_main_thread = threading.current_thread() is threading.main_thread()
    parsing_timeout = None if not is_main_thread else 10
    verify_timeout = None if not is_main_thread else 5
    if not is_main_thread:
        logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
        logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    for content, sol in zip(contents, solution, strict=True):
        gold_parsed = parse(sol, parsing_timeout=parsing_timeout)
        if len(gold_parsed) != 0:
            answer_parsed = parse(
                content,
                extraction_config=[LatexExtractionConfig(normalization_config=NormalizationConfig(units=True),
                                                         boxed_match_priority=0, try_extract_without_anchor=False)],
                extraction_mode="first_match", parsing_timeout=parsing_timeout)
            reward = float(verify(gold_parsed, answer_parsed, timeout_seconds=verify_timeout))
            gold_parsed_strs.append(str(gold_parsed))
            answer_parsed_strs.append(str(answer_parsed) if answer_parsed else "[unparseable]")
        else:  # a solution that cannot be parsed: the row is skipped (None)
            reward = None
            gold_parsed_strs.append("[unparseable]")
            answer_parsed_strs.append("[skipped]")
        rewards.append(reward)
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", gold_parsed_strs)
        log_extra("answer_parsed", answer_parsed_strs)
    return rewards


def think_format_reward(completions: list[list[dict[str, str]]], **kwargs) -> list[float]:
    """1.0 where the completion opens with one <think>...</think> block, else 0.0 (TRL's)."""
    pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
    contents = [completion[0]["content"] for completion in completions]
    return [1.0 if re.match(pattern, content, re.DOTALL | re.MULTILINE) else 0.0 for content in contents]
