"""The tool, the data and the traces of the agent benchmarks (benchmarks/bench_agents.py), shared
with the TRL side of the comparison (benchmarks/peers/trl_tools.py): one file both import, so the
two systems call the same function on the same problems."""

from __future__ import annotations

import ast
import json
import operator
import random

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

    Args:
        expression: the expression to evaluate, e.g. 347 * 29
    """

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result) if float(result).is_integer() else round(result, 6))


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}? Give the number."


def problems(count: int, seed: int, exclude: set | None = None) -> list[tuple[int, int]]:
    """``count`` distinct products of a 3-digit and a 2-digit number (4 or 5 digits: past what a
    135M model multiplies in its head), none of ``exclude``."""
    rng, chosen = random.Random(seed), {}
    exclude = exclude or set()
    while len(chosen) < count:
        pair = (rng.randint(100, 999), rng.randint(11, 99))
        if pair not in exclude:
            chosen[pair] = None
    return list(chosen)


def prompt_rows(pairs) -> list[dict]:
    return [{"prompt": question(a, b), "answer": str(a * b)} for a, b in pairs]


def trace(a: int, b: int, schema: dict) -> dict:
    """An SFT row: the question, the model's tool call (written as Qwen's template writes one,
    which TRL's parser reads too), the tool's answer, the model's answer -- TRL's conversational
    format with its ``tools`` column."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}})
    return {"messages": [{"role": "user", "content": question(a, b)},
                         {"role": "assistant", "content": f"<tool_call>\n{call}\n</tool_call>"},
                         {"role": "tool", "name": "calculator", "content": calculator(f"{a} * {b}")},
                         {"role": "assistant", "content": f"The answer is {a * b}."}],
            "tools": [schema]}


def last_assistant_text(completion) -> str:
    """A completion's answer: its text, or the content of its last assistant message (TRL passes a
    multi-turn completion as messages)."""
    if isinstance(completion, str):
        return completion
    return next((m.get("content") or "" for m in reversed(completion) if m.get("role") == "assistant"), "")


def answer_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """1 for a completion whose answer is the row's (ppo_rlhf.rewards:answer_match), in TRL's calling
    convention: the same check both systems score with."""
    from ppo_rlhf.rewards import response_answer, same_answer

    return [float(same_answer(response_answer(last_assistant_text(c)), a)) for c, a in zip(completions, answer)]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as file:
        file.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


def lake_text(observation, env) -> str:
    """A FrozenLake board as the model reads it (``--observation-text``): the map's rows, the player
    as P, without the terminal colours of gymnasium's ansi render."""
    desc = env.unwrapped.desc
    columns = desc.shape[1]
    row, column = divmod(int(observation), columns)
    lines = []
    for r, cells in enumerate(desc):
        text = "".join(cell.decode() for cell in cells)
        if r == row:
            text = text[:column] + "P" + text[column + 1:]
        lines.append(text)
    return "\n".join(lines)
