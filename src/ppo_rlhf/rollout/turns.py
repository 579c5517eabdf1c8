"""How the model's turns of a batch of episodes are served (docs/design.md, "Episodes").

Each episode runs as a coroutine of its own (rollout/episodes.py) on the run's event loop
(envs/calls.py) and asks for its next model turn with ``await turns.ask(row, ids, limit)``; the
trainer's thread serves the asks meanwhile (``EnvironmentCalls.run`` calls ``serve``):

- :class:`TurnBatches`, for any Generator (the torch loop): once every episode still going has
  asked, one ``generate`` call on them all, in row order -- the batched turn the torch loop makes.
  An episode whose environment answered early waits for the turn's slowest answer.
- :class:`ContinuousTurns`, for an engine that takes requests one at a time (the vLLM engine's
  ``requests``): each ask goes to the engine as soon as it comes, and the engine batches whatever
  is pending at each of its steps, so an episode never waits for another's environment.

Either way an ask is answered with the turn's ids (up to and including the first stop id) and the
engine's log-probs of them (None from an engine without them).
"""

from __future__ import annotations

import asyncio
import queue
from typing import Callable

Response = tuple[list[int], "list[float] | None"]  # a turn's ids and the engine's log-probs of them


def resolve(future: asyncio.Future, value) -> None:
    if not future.done():  # an episode cancelled meanwhile (its rollout stopped) takes no answer
        future.set_result(value)


class Asks:
    """The asks of a batch's episodes, from their coroutines (the loop's thread) to the thread
    that serves them: ``ask`` and ``ended`` on the loop, the rest on the serving thread."""

    def __init__(self, episodes: int, progress: Callable[[int, int], None] | None = None):
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.playing = set(range(episodes))  # the episodes that may still ask
        self.turns = [0] * episodes  # each episode's turns asked for so far
        self.progress = progress  # called with (the most turns an episode has played, episodes still going)

    # ------------------------------------------------------------ on the loop
    async def ask(self, row: int, ids: list[int], limit: int | None) -> Response:
        """The model's next turn of episode ``row``, after its ``ids`` so far, at most ``limit`` tokens
        (None: the generator's own limit)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.inbox.put(("ask", row, ids, limit, future, loop))
        return await future

    def ended(self, row: int) -> None:
        """Episode ``row`` asks for no more turns."""
        self.inbox.put(("end", row))

    # ------------------------------------------------------------ on the serving thread
    def take(self, wait: float) -> list[tuple]:
        """The asks come in since the last call (waiting up to ``wait`` seconds for the first message
        when none is there), as (row, turn, ids, limit, future, loop); ended episodes leave ``playing``."""
        asks = []
        block = wait > 0
        while True:
            try:
                message = self.inbox.get(timeout=wait) if block else self.inbox.get_nowait()
            except queue.Empty:
                return asks
            block = False
            if message[0] == "end":
                self.playing.discard(message[1])
                if self.progress is not None:
                    self.progress(max(self.turns), len(self.playing))
                continue
            _, row, ids, limit, future, loop = message
            asks.append((row, self.turns[row], ids, limit, future, loop))
            self.turns[row] += 1

    @staticmethod
    def answer(future: asyncio.Future, loop: asyncio.AbstractEventLoop, response: Response) -> None:
        loop.call_soon_threadsafe(resolve, future, response)

    def abort(self) -> None:
        """The rollout stopped (an episode failed): drop what is in flight."""

    def close(self) -> None:
        """Every episode has ended."""


class TurnBatches(Asks):
    """One ``generate(ids, limits) -> responses`` call per turn on every episode still going (module
    docstring), in row order: the call, and so the samples, a turn-by-turn loop makes."""

    def __init__(self, generate: Callable[[list[list[int]], list | None], list[Response]], episodes: int,
                 progress: Callable[[int, int], None] | None = None):
        super().__init__(episodes, progress)
        self.generate = generate
        self.asked: dict[int, tuple] = {}

    def serving(self, running: bool) -> bool:
        """Whether an episode may still ask for a turn (``running``: whether the rollout's coroutines
        are; here this process's own episodes decide alone)."""
        return bool(self.playing)

    def serve(self, wait: float) -> None:
        for ask in self.take(wait):
            self.asked[ask[0]] = ask
        if not self.asked or set(self.asked) != self.playing:  # some episode's environment is still answering
            return
        rows = sorted(self.asked)
        limits = [self.asked[row][3] for row in rows]
        responses = self.generate([self.asked[row][2] for row in rows], None if None in limits else limits)
        for row, response in zip(rows, responses):
            _, _, _, _, future, loop = self.asked.pop(row)
            self.answer(future, loop, response)


class ContinuousTurns(Asks):
    """Each ask submitted to ``requests`` (an engine's one-rollout session: ``VLLMGenerator.requests``)
    as it comes, the engine stepped while it has work (module docstring)."""

    def __init__(self, requests, episodes: int, progress: Callable[[int, int], None] | None = None):
        super().__init__(episodes, progress)
        self.requests = requests
        self.waiting: dict[str, tuple] = {}  # the engine's request id: (future, loop) of the ask
        self.engines_busy = False  # whether any process's engine had requests at the last ``serving``

    def serving(self, running: bool) -> bool:
        """Whether to serve on, decided with every process: each one's engine steps with the others'
        (vLLM's data parallel: each step is a collective), so all serve until no process has an
        episode running -- playing, or reading its reward after its last turn -- or a request in its
        engine, and then all stop in the same round (docs/design.md, "Collectives of a rollout")."""
        anyone_running, self.engines_busy = self.requests.anyone_working(running, self.requests.busy)
        return anyone_running

    def serve(self, wait: float) -> None:
        # While any engine has work, none waits for asks: its step would hold up the others' steps.
        for row, turn, ids, limit, future, loop in self.take(0 if self.engines_busy else wait):
            self.waiting[self.requests.add(row, turn, ids, limit)] = (future, loop)
        for key, response in self.requests.step():
            self.answer(*self.waiting.pop(key), response)

    def abort(self) -> None:
        self.requests.abort()

    def close(self) -> None:
        self.requests.close()
