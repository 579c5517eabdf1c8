"""Toy environments and tools for the multi-turn tests (tests/test_episodes.py): each of the
shapes a user gives -- plain tools, a TRL environment_factory class, a gymnasium text environment --
and the broken ones a user might write."""

from __future__ import annotations

import random
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b  # b = 0 raises: the model is told, the episode goes on


def sleepy(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "awake"


def no_hints(a, b):
    """Adds without type hints."""
    return a + b


def no_docstring(a: int) -> int:
    return a


class Counter:
    """TRL's environment_factory shape: reset() given the row's columns it names, public methods
    are tools, get_reward() scores the finished episode."""

    def __init__(self):
        self.count = 0
        self.target = 0

    def reset(self, target: int = 2, **kwargs) -> str:
        self.count, self.target = 0, int(target)
        return f" (count to {self.target})"

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    def get_reward(self) -> float:
        return float(self.count == self.target)


class LetterGame:
    """gymnasium's protocol in text: two turns; each turn pays the number of times the model writes
    the letter 'e' (at most 8).  What the environment says between the turns is long, so a loss on
    its tokens would show."""

    def __init__(self, turns: int = 2):
        self.turns = turns
        self.turn = 0

    def reset(self, *, seed=None, options=None):
        self.turn = 0
        return None, {}  # the row's prompt as it is

    def step(self, action: str):
        self.turn += 1
        reward = float(min(action.count("e"), 8))
        done = self.turn >= self.turns
        return (None if done else "again, with more of them please"), reward, done, False, {}


class RaisingStep(LetterGame):
    def step(self, action: str):
        raise KeyError("the board")


class NoReset:
    def step(self, action):  # gymnasium's step without a reset
        return None, 0.0, True, False, {}


def calls_increment(text: str):
    """A tool-call parser that reads one call of Counter's tool in every turn (tiny random models
    write none), so each episode runs to --max-turns."""
    from ppo_rlhf.envs.parsers import ToolCall

    return [ToolCall("increment", {"by": 1}, text=text)]


class FailsOnTheThirdBatch(LetterGame):
    """LetterGame whose reset raises on its ninth call (the third batch of four episodes) while
    PPO_RLHF_TEST_ENV_FAILS is set: a bug that stops a run midway."""

    resets = 0

    def reset(self, *, seed=None, options=None):
        import os

        FailsOnTheThirdBatch.resets += 1
        if os.environ.get("PPO_RLHF_TEST_ENV_FAILS") and FailsOnTheThirdBatch.resets == 9:
            raise ConnectionError("the game server went away")
        return super().reset(seed=seed, options=options)


class DrawsItsTarget:
    """TRL's shape, drawing its task at random in reset() as TRL's docs' IncrementEnv does (no seed
    parameter): Python's and numpy's generators decide the target."""

    def reset(self, **kwargs) -> str:
        import numpy

        self.target = (random.randint(1, 10**6), int(numpy.random.randint(0, 10**6)))
        return f" (reach {self.target})"

    def guess(self, number: int) -> str:
        """Guess the target.

        Args:
            number: the guess
        """
        return "higher" if number < self.target[0] else "lower or right"

    def get_reward(self) -> float:
        return 0.0


class TakesASeed(DrawsItsTarget):
    """TRL's shape whose reset names ``seed``: it gets the episode's seed."""

    def reset(self, seed=None, **kwargs) -> str:
        self.seed = seed
        return super().reset()


class ToolsNamedLikeGym:
    """TRL's shape (reset takes no seed= / options=) whose tools are named step, render and close."""

    def reset(self, **kwargs) -> None:
        self.moves, self.columns = [], kwargs

    def step(self, direction: str) -> str:
        """Take a step.

        Args:
            direction: where to
        """
        self.moves.append(direction)
        return f"stepped {direction}"

    def render(self) -> str:
        """Draw the board."""
        return "board"

    def close(self) -> str:
        """Close the door."""
        return "closed"

    def _helper(self) -> None:
        pass

    def get_reward(self) -> float:
        return float(len(self.moves))


class OldGymStep(LetterGame):
    def step(self, action: str):
        return None, 1.0, True, {}  # gym's 4-tuple (observation, reward, done, info)


class TextReward(LetterGame):
    def step(self, action: str):
        return None, "1.0", True, False, {}


class PaysEachTurn(LetterGame):
    """LetterGame paying 1 for every turn, however empty (three turns)."""

    def __init__(self):
        super().__init__(turns=3)

    def step(self, action: str):
        observation, _, done, truncated, info = super().step(action)
        return observation, 1.0, done, truncated, info


class ResetEndsWithTheReply(LetterGame):
    def reset(self, *, seed=None, options=None):
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], {}


class ResetReturnsText(LetterGame):
    def reset(self, *, seed=None, options=None):
        return "a bare string, not (observation, info)"


class RewardIsNaN(Counter):
    def get_reward(self) -> float:
        return float("nan")


class ResetLikeGymnasium(Counter):
    """TRL's shape (reset takes no seed= / options=) whose reset returns gymnasium's (observation, info)."""

    def reset(self, **kwargs):
        return "count", {}


class BrokenConstructor(LetterGame):
    def __init__(self):
        raise RuntimeError("the game server is down")


def raising_parser(text: str):
    raise KeyError("name")


def parser_of_strings(text: str):
    return ["add"]


def says_nothing(observation, env):
    return None


# TRL's dict form, named on the command line as --environment toy_envs:ENVIRONMENTS.
ENVIRONMENTS = {"count": Counter, "walk": ToolsNamedLikeGym}
