"""Toy environments and tools for the multi-turn tests (tests/test_episodes.py): each of the
shapes a user gives -- plain tools, a TRL environment_factory class, a gymnasium text environment --
and the broken ones a user might write."""

from __future__ import annotations

import random
import threading
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


# ---------------------------------------------------------------- concurrent environments (envs/calls.py)
class WaitState:
    """What the episodes of WaitsForTheOthers saw: the order of their steps, whether the first row
    waited for the others to end."""

    def __init__(self, others: int):
        self.others, self.ended, self.order = others, 0, []
        self.lock, self.all_ended = threading.Lock(), threading.Event()
        self.waited_for_the_others = None


class WaitsForTheOthers:
    """gymnasium's shape, three turns.  The episode of the row whose 'id' is 0 waits in its first
    step until every other episode has ended (its reward() read): with turns batched across
    episodes they never could, and the wait runs out."""

    state = WaitState(others=3)

    def reset(self, *, seed=None, options=None):
        self.id, self.turn = options["id"], 0
        return None, {}

    def step(self, action: str):
        self.turn += 1
        with self.state.lock:
            self.state.order.append(self.id)
        if self.id == 0 and self.turn == 1:
            self.state.waited_for_the_others = self.state.all_ended.wait(timeout=60)
        done = self.turn >= 3
        return (None if done else "go on"), 0.0, done, False, {}

    def reward(self) -> float:
        if self.id != 0:
            with self.state.lock:
                self.state.ended += 1
                if self.state.ended == self.state.others:
                    self.state.all_ended.set()
        return 0.0


class SleepsAtRandom(LetterGame):
    """LetterGame over three turns whose steps answer after a random wait (up to 50 ms, drawn from
    ``delays``): which episode answers first changes from run to run, what it answers never does."""

    delays = random.Random(0)
    lock = threading.Lock()

    def __init__(self):
        super().__init__(turns=3)

    def step(self, action: str):
        with self.lock:
            wait = self.delays.uniform(0, 0.05)
        time.sleep(wait)
        return super().step(action)


TOOL_DELAYS = random.Random(0)


def slow_add(a: int, b: int) -> int:
    """Add two integers, after a random wait.

    Args:
        a: the first number
        b: the second number
    """
    time.sleep(TOOL_DELAYS.uniform(0, 0.03))
    return a + b


def calls_slow_add(text: str):
    """A parser reading one call of slow_add in every turn, its numbers from the turn's length."""
    from ppo_rlhf.envs.parsers import ToolCall

    return [ToolCall("slow_add", {"a": len(text), "b": 1}, text=text)]


class SlowCounter(Counter):
    """Counter whose tool answers after a random wait (up to 20 ms)."""

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        time.sleep(TOOL_DELAYS.uniform(0, 0.02))
        return super().increment(by)


class AsyncState:
    """What Relay and AsyncGame did, in the order they finished (one per test: monkeypatched)."""

    def __init__(self):
        self.finished: list[str] = []
        self.event = None

    def game_stepped(self):
        import asyncio

        if self.event is None:  # made on the loop that awaits it
            self.event = asyncio.Event()
        return self.event


ASYNC_STATE = AsyncState()


class Relay:
    """TRL's shape with an ``async def`` tool that answers only once an AsyncGame episode's
    ``async def`` step has answered: both must be awaited at once, on one event loop."""

    def reset(self, **kwargs) -> None:
        pass

    async def relay(self) -> str:
        """Pass the word on."""
        import asyncio

        await asyncio.wait_for(ASYNC_STATE.game_stepped().wait(), timeout=30)
        ASYNC_STATE.finished.append("tool")
        return "passed"


class AsyncGame(LetterGame):
    """LetterGame whose step is an ``async def``."""

    async def step(self, action: str):
        import asyncio

        await asyncio.sleep(0.01)
        ASYNC_STATE.finished.append("step")
        ASYNC_STATE.game_stepped().set()
        return super().step(action)


ASYNC_ENVIRONMENTS = {"relay": Relay, "game": AsyncGame}


class DrawsAcrossAwaits(DrawsItsTarget):
    """DrawsItsTarget with an ``async def`` reset taking no seed, drawing from Python's and numpy's
    generators on both sides of an await: other episodes' resets run in between."""

    async def reset(self, **kwargs) -> str:
        import asyncio

        import numpy

        first = random.randint(1, 10**6)
        await asyncio.sleep(0.01)
        self.target = (first, random.randint(1, 10**6), int(numpy.random.randint(0, 10**6)))
        return f" (reach {self.target})"


class StuckAfterATimeout:
    """TRL's shape: the 'slow' row's tool call sleeps until ``release`` is set, then writes to its
    object -- past --tool-timeout, on an object the next episode must not get."""

    release = threading.Event()

    def reset(self, slow: bool = False, **kwargs) -> None:
        self.slow, self.log = slow, []

    def work(self) -> str:
        """Do the work."""
        if self.slow:
            self.release.wait(timeout=60)
        self.log.append("worked")
        return "done"


class FailState:
    def __init__(self):
        self.cancelled, self.finished = [], []


class FailsOnOneRow:
    """gymnasium's shape with an async step: the row whose 'id' is 2 raises in it; the row whose 'id'
    is 1 answers at once, the others wait long enough to be cancelled."""

    state = FailState()

    def reset(self, *, seed=None, options=None):
        self.id = options["id"]
        return None, {}

    async def step(self, action: str):
        import asyncio

        if self.id == 2:
            await asyncio.sleep(0.05)
            raise ConnectionError("the sandbox died")
        if self.id == 1:
            self.state.finished.append(self.id)
            return None, 0.0, True, False, {}
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.state.cancelled.append(self.id)
            raise
        return None, 0.0, True, False, {}


class WaitsForever:
    """TRL's shape whose tool, a plain def, never answers."""

    def reset(self, **kwargs) -> None:
        pass

    def wait(self) -> str:
        """Wait for an answer that never comes."""
        threading.Event().wait()
        return "never"

    def get_reward(self) -> float:
        return 0.0


class HogsTheLoop:
    """TRL's shape whose tool is an async def that never awaits: it blocks the event loop."""

    def reset(self, **kwargs) -> None:
        pass

    async def hog(self) -> str:
        """Work without ever awaiting."""
        while True:
            time.sleep(0.05)

    def get_reward(self) -> float:
        return 0.0


def calls_wait(text: str):
    from ppo_rlhf.envs.parsers import ToolCall

    return [ToolCall("wait", {}, text=text)]


def calls_hog(text: str):
    from ppo_rlhf.envs.parsers import ToolCall

    return [ToolCall("hog", {}, text=text)]


class ShortOnTheSecondProcess(LetterGame):
    """LetterGame of three turns, one in the second process of a launch (RANK 1): the processes'
    episodes end apart."""

    def __init__(self):
        import os

        super().__init__(turns=1 if os.environ.get("RANK") == "1" else 3)


class NoTools:
    """TRL's shape (reset takes no seed= / options=) with no tool: only reset and get_reward."""

    def reset(self, **kwargs) -> str:
        return " (answer in one turn)"

    def get_reward(self) -> float:
        return 1.0


def first_process() -> bool:
    """Whether this is the first process of a launch (or the only one)."""
    import os

    return os.environ.get("RANK", "0") == "0"


def calls_increment_on_the_first_process(text: str):
    """calls_increment in the first process of a launch; no call in the second, whose episodes so
    end after their first turn while the first process's play to --max-turns."""
    return calls_increment(text) if first_process() else []


class SlowRewardOnTheFirstProcess(Counter):
    """Counter (TRL's shape, one tool) whose get_reward() takes half a second in the first process
    of a launch: that process's episodes have all ended while their rewards are still being read."""

    def get_reward(self) -> float:
        if first_process():
            time.sleep(0.5)
        return super().get_reward()


class SlowToolOnTheFirstProcess(Counter):
    """Counter whose tool answers after half a second in the first process of a launch."""

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: how much to add
        """
        if first_process():
            time.sleep(0.5)
        return super().increment(by)


def slow_reward_on_the_first_process(prompts, responses, **kwargs) -> list[float]:
    """A reward function that takes half a second in the first process of a launch."""
    if first_process():
        time.sleep(0.5)
    return [float(len(response) % 3) for response in responses]


def informative_on_the_second_process(prompts, responses, **kwargs) -> list[float]:
    """0 for every response in the first process of a launch (each prompt group all alike: dynamic
    sampling drops them), 0 and 1 in turn in the second (each group of two informative)."""
    return [0.0 if first_process() else float(i % 2) for i in range(len(responses))]
