"""Environment calls, run concurrently (docs/design.md, "Episodes"; docs/agents.md, "Tools that wait").

Every call of an environment's code -- its ``reset``, ``step``, ``get_reward`` and tools -- goes
through :meth:`EnvironmentCalls.call`, awaited by the episode runner's coroutines
(rollout/episodes.py: one coroutine per episode), all on one event loop that runs in a thread of
its own for the whole run:

- a plain ``def`` runs on a worker thread, at most ``workers`` (``--env-workers``) at once: a
  tool waiting on a server, a sandbox or a database waits with the GIL released, so the waits of
  different episodes overlap, and with ``workers=1`` the calls run one after another;
- an ``async def`` is awaited on that loop as a task of its own, as many at once as there are;
- a call with a ``timeout`` (a tool's ``--tool-timeout``) that runs past it raises
  :class:`CallTimedOut`.  An async call is cancelled; a thread cannot be stopped from outside, so
  it is left to finish (a daemon thread: it never holds the process open at exit), and the
  caller retires the environment it may still change (``EnvironmentSource.retire``).

An ``async def`` that blocks the loop (``time.sleep``, a synchronous client inside it) stops every
other episode's calls and its own timeout with them: past ``stall_limit`` seconds without the loop
turning, the run stops with :class:`LoopStalled`, naming the call, and the blocked loop's thread
(a daemon) is abandoned -- the next run of calls starts a loop of its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import threading
import time
import weakref
from typing import Callable

from ppo_rlhf.envs.protocol import EnvironmentFailed

# What the calls of the current coroutine are on ("the row of prompts.jsonl:3"), for the names of
# their tasks: a stalled loop is reported by the name of the task that holds it.
CALLS_ON: contextvars.ContextVar[str] = contextvars.ContextVar("calls_on", default="a prompt row")
# --env-workers' default: the tools agents call mostly wait (a server, a sandbox, a database), and a
# thread that waits costs little and holds no core, so the waits of a batch of episodes overlap.
ENV_WORKERS = 64
TICK = 0.05  # seconds between the checks of a waiting thread (the loop's heartbeat, a stalled loop)


class CallTimedOut(Exception):
    """A call ran past its timeout; ``still_running``: it may still be running (a thread, or a
    task that did not stop when cancelled), so what it changes must not serve another episode."""

    def __init__(self, still_running: bool):
        super().__init__("timed out")
        self.still_running = still_running


class LoopStalled(EnvironmentFailed):
    """An ``async def`` call held the event loop past ``stall_limit`` without awaiting: the run stops."""

    def __init__(self, call: str, seconds: float):
        RuntimeError.__init__(self, (
            f"{call} is an async def that held the event loop for more than {seconds:g} seconds without awaiting, "
            f"and every other episode's calls waited behind it; inside an async def, await what waits "
            f"(asyncio.sleep, an async client), or make it a plain def, which runs on a worker thread of its own "
            f"(--env-workers)"))


def is_async(function: Callable) -> bool:
    """Whether calling ``function`` makes a coroutine: an ``async def``, a partial of one, or an
    object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(getattr(function, "__call__", None))


def run_into(future: concurrent.futures.Future, function: Callable, args: tuple, kwargs: dict) -> None:
    """``function(*args, **kwargs)`` on this thread, its result or exception into ``future``."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(function(*args, **kwargs))
    except BaseException as error:  # noqa: BLE001 -- the caller decides what an exception of the user's means
        future.set_exception(error)


class EnvironmentCalls:
    """The run's environment calls (module docstring): one event loop in a daemon thread, started
    at the first call, and at most ``workers`` plain-``def`` calls on threads at once."""

    def __init__(self, workers: int, stall_limit: float = 10.0):
        self.workers, self.stall_limit = workers, stall_limit
        self.loop: asyncio.AbstractEventLoop | None = None
        self.slots: asyncio.Semaphore | None = None  # the worker threads' places, on the loop
        self.beat = 0.0  # when the loop last turned (monotonic), while a run of calls is waited for

    def start(self) -> asyncio.AbstractEventLoop:
        if self.loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="ppo-rlhf-environments", daemon=True).start()
            self.loop, self.slots = loop, asyncio.Semaphore(self.workers)
            weakref.finalize(self, loop.call_soon_threadsafe, loop.stop)  # no idle thread outlives the run's calls
        return self.loop

    # ------------------------------------------------------------ on the loop
    async def call(self, function: Callable, args: tuple = (), kwargs: dict | None = None, *,
                   timeout: float | None = None, name: str = "a call"):
        """``function(*args, **kwargs)``: on a worker thread for a plain def, awaited for an async
        def; CallTimedOut past ``timeout``.  ``name`` names it (with what CALLS_ON holds) should it
        stall the loop."""
        kwargs = kwargs or {}
        start = time.monotonic()
        if is_async(function):
            return await self.awaited(function(*args, **kwargs), timeout, name)
        async with self.slots:
            future = concurrent.futures.Future()
            threading.Thread(target=run_into, args=(future, function, args, kwargs), daemon=True,
                             name=f"ppo-rlhf-{name}"[:60]).start()
            try:
                result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
            except TimeoutError:
                raise CallTimedOut(still_running=True) from None
        if inspect.isawaitable(result):  # a plain def handing back a coroutine: awaited here, in the time left
            left = None if timeout is None else max(timeout - (time.monotonic() - start), 0.0)
            return await self.awaited(result, left, name)
        return result

    async def awaited(self, awaitable, timeout: float | None, name: str):
        """An awaitable as a task of its own (named, so that a stall says whose), cancelled past
        ``timeout`` or when its caller is."""
        task = asyncio.ensure_future(awaitable)
        task.set_name(f"{name} (on {CALLS_ON.get()})")
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if done:
            return task.result()
        task.cancel()
        for _ in range(3):  # the cancellation reaches the task at its next await, a loop turn or two away
            await asyncio.sleep(0)
        raise CallTimedOut(still_running=not task.done())

    async def heartbeat(self) -> None:
        while True:
            self.beat = time.monotonic()
            await asyncio.sleep(TICK)

    async def watched(self, coroutine):
        beating = asyncio.get_running_loop().create_task(self.heartbeat(), name="ppo-rlhf heartbeat")
        try:
            return await coroutine
        finally:
            beating.cancel()

    # ------------------------------------------------------------ from the caller's thread
    def run(self, coroutine, server=None):
        """Run ``coroutine`` on the loop and wait for it here; ``server`` (rollout/turns.py), if
        given, is served on this thread meanwhile (the model's turns the episodes ask for), until
        it says it has nothing more to serve.  LoopStalled if the loop stops turning past
        ``stall_limit``; an exception of ``coroutine`` is raised here."""
        loop = self.start()
        self.beat = time.monotonic()
        future = asyncio.run_coroutine_threadsafe(self.watched(coroutine), loop)
        try:
            while True:
                if future.done() and future.exception() is not None:
                    break  # an episode failed: raised below (under a launch, the launcher stops the others)
                # Whether to serve on is asked of the server with whether this process's episodes
                # are still running -- an ended episode may still be reading its reward -- so that,
                # where the server decides with the other processes (each step of their engines is
                # a collective), every process leaves in the same round (docs/design.md, "Collectives
                # of a rollout").
                if server is not None and server.serving(running=not future.done()):
                    server.serve(TICK)
                elif future.done():
                    break
                else:
                    concurrent.futures.wait([future], timeout=TICK)
                self.check_turning()
        except BaseException:
            future.cancel()  # the episodes' tasks are cancelled; what runs on threads is left to finish
            if server is not None:
                server.abort()
            raise
        if future.exception() is not None and server is not None:
            server.abort()
        return future.result()

    def check_turning(self) -> None:
        """LoopStalled, naming the task that holds the loop, once it has not turned for ``stall_limit``."""
        if time.monotonic() - self.beat <= self.stall_limit:
            return
        task = asyncio.current_task(self.loop)  # the one the loop's thread is running (read from here: a name)
        call = task.get_name() if task is not None else "a call"
        self.loop = None  # abandoned, with its daemon thread: the next run of calls starts a loop of its own
        raise LoopStalled(call, self.stall_limit)

    def run_one(self, function: Callable, *args, **kwargs):
        """One call from synchronous code (an adapter's own ``step``, called outside a rollout)."""
        return self.run(self.call(function, args, kwargs))
