"""The tool, the environment class, the data and the traces of the agent benchmarks
(benchmarks/bench_agents.py), shared with the TRL side of the comparisons
(benchmarks/peers/trl_tools.py, trl_env.py): one file both import, so the two systems call the
same function on the same problems."""

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


class CalculatorEnv:
    """The calculator as a TRL ``environment_factory`` class, in TRL 1.16's documented shape: one
    object per concurrent episode, made once and reset before each.  ``reset(**kwargs)`` gets the
    row's columns (TRL passes every one, ``prompt`` and ``answer``; none is needed here) and
    returns None, so the prompt stays the question alone.  Its public method ``calculator`` is the
    model's one tool, with the plain :func:`calculator`'s schema (the same docstring and type
    hints), so the prompt renders as in ``tools`` and ``peers`` and their SFT warm-up applies; the
    object keeps what its episode computed.  No ``get_reward``: both systems score with
    :func:`answer_reward`.  ``benchmarks/bench_agents.py peers-env`` plays it with ppo-rlhf
    (``--environment benchmarks/agents_tools.py:CalculatorEnv``) and with TRL
    (``environment_factory=CalculatorEnv``)."""

    def __init__(self):
        self.computed: list[tuple[str, str]] = []  # (expression, result) of each call that returned

    def reset(self, **kwargs) -> None:
        self.computed = []

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

        Args:
            expression: the expression to evaluate, e.g. 347 * 29
        """
        result = calculator(expression)
        self.computed.append((expression, result))
        return result


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


LAKE_MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
LAKE_CELLS = {"S": "ice", "F": "ice", "H": "hole", "G": "goal"}


def lake_sides(desc, row: int, column: int) -> dict[str, str]:
    """What each move from (row, column) steps onto: ice, hole, goal or edge."""
    size = len(desc)
    return {move: LAKE_CELLS[desc[row + dr][column + dc]] if 0 <= row + dr < size and 0 <= column + dc < size
            else "edge" for move, (dr, dc) in LAKE_MOVES.items()}


def lake_safe_moves(sides: dict[str, str]) -> list[str]:
    """The moves of ``lake_sides`` onto ice or the goal: never into a hole, never against an edge."""
    return [move for move, cell in sides.items() if cell in ("ice", "goal")]


def lake_square(observation, env) -> tuple[str, dict[str, str]]:
    """Where the player stands and where the goal lies, in words, and what each move steps onto
    (ice, hole, goal or edge)."""
    desc = [[cell.decode() for cell in cells] for cells in env.unwrapped.desc]
    size = len(desc)
    row, column = divmod(int(observation), size)
    goal = next((r, c) for r in range(size) for c in range(size) if desc[r][c] == "G")
    return (f"You are at row {row + 1}, column {column + 1}; the goal is {goal[0] - row} down and "
            f"{goal[1] - column} right."), lake_sides(desc, row, column)


def lake_view(observation, env) -> str:
    """A FrozenLake position as the model reads it (``--observation-text``): where the player is,
    where the goal lies, and what each move steps onto.  A 135M model does not learn to read a
    drawn board from a few dozen examples (SFT on them left it moving down on every map); this says
    in words what the board shows, so the choice is local."""
    where, around = lake_square(observation, env)
    return where + " " + ", ".join(f"{move}: {cell}" for move, cell in around.items()) + "."


def lake_safe_view(observation, env) -> str:
    """``lake_view`` with the moves that stay on the lake named as a list, "Safe moves: down, right."
    (never into a hole, never against an edge).  Measured (frozenlake-probe): after SFT on
    ``lake_view``'s boards, SmolLM2-135M moves from the start with the same odds whether the hole is
    below or to the right -- it does not bind "down: hole"; choosing a word from a list the text
    gives is what small models do well."""
    where, around = lake_square(observation, env)
    return where + " Safe moves: " + ", ".join(lake_safe_moves(around)) + "."


def lake_path(desc: list[str]) -> list[str]:
    """The shortest moves from S to G on a FrozenLake map that step on no hole (breadth first)."""
    size = len(desc)
    start = next((r, c) for r in range(size) for c in range(size) if desc[r][c] == "S")
    paths, frontier = {start: []}, [start]
    while frontier:
        following = []
        for r, c in frontier:
            if desc[r][c] == "G":
                return paths[(r, c)]
            for move in lake_safe_moves(lake_sides(desc, r, c)):
                cell = (r + LAKE_MOVES[move][0], c + LAKE_MOVES[move][1])
                if cell not in paths:
                    paths[cell] = paths[(r, c)] + [move]
                    following.append(cell)
        frontier = following
    raise ValueError(f"no path on {desc}")


def lake_conversation(prompt: str, desc: list[str], moves: list[str], view=lake_view) -> list[dict]:
    """One map played with ``moves``, each board exactly as the episode runner shows it (the gym
    adapter renders it with ``view``, as ``--observation-text`` does; the prompt and the adapter's
    instructions a paragraph each): the prompt, then each move and the board it leads to, until a
    move ends the game."""
    from ppo_rlhf.envs.gym_text import GymActionEnvironment
    from ppo_rlhf.rollout.episodes import first_messages

    environment = GymActionEnvironment("FrozenLake-v1", {"is_slippery": False}, observation_text=view)
    observation, _ = environment.reset(seed=0, options={"desc": desc})
    messages = first_messages(prompt, observation, "user", environment.prompt_separator)
    for move in moves:
        messages.append({"role": "assistant", "content": move})
        observation, _, terminated, _, _ = environment.step(move)
        if terminated:
            break
        messages.append({"role": "user", "content": observation})
    environment.close()
    return messages


def lake_walk(desc: list[str], rng: random.Random, turns: int = 8) -> list[str]:
    """A random walk on a FrozenLake map of at most ``turns`` moves, each drawn uniformly among the
    moves that step onto ice or the goal (never into a hole, never against an edge), ending at the
    goal if it gets there: moves that keep the rules and do not seek the goal (4% of such walks
    reach it within 8 moves on the held-out maps)."""
    size = len(desc)
    (row, column), moves = divmod(next(i for i, cell in enumerate("".join(desc)) if cell == "S"), size), []
    while len(moves) < turns and desc[row][column] != "G":
        move = rng.choice(lake_safe_moves(lake_sides(desc, row, column)))
        moves.append(move)
        row, column = row + LAKE_MOVES[move][0], column + LAKE_MOVES[move][1]
    return moves


def lake_trace(row: dict, walk_seed: int | None = None, view=lake_view) -> dict:
    """An SFT row: one map played along its shortest path, or with ``walk_seed`` a random walk that
    keeps the rules (:func:`lake_walk`, drawn with that seed); each move one word, each board as
    ``view`` writes it."""
    moves = lake_path(row["desc"]) if walk_seed is None else lake_walk(row["desc"], random.Random(walk_seed))
    messages = lake_conversation(row["prompt"], row["desc"], moves, view)
    return {"messages": messages[:-1] if messages[-1]["role"] == "user" else messages}  # a walk out of moves
