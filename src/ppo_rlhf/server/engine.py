"""The generation server's engine (docs/design.md, "The generation server"): one vLLM engine in
the server's process, built as the colocated engine is (rollout/vllm_engine.py, ``engine_options``)
from the served model's folder, and stepped by a thread of its own.  The web routes hand it their
work through a queue and await the answer; between two steps the thread takes in new requests,
opens and closes leases and loads pushed weights, so nothing else ever touches the engine.

Leases keep every rollout on one set of weights.  A rollout (a batch of single turns, a batch of
episodes, an agent's episodes) holds a lease on the version loaded when it started; a push waits
until no lease is held, and while a push waits no new lease is granted, so a rollout never spans
two versions and a push is never starved.  A lease may ask for a version of a run (the weights a
trainer pushed: ``want`` {"run", "at_least"}): it is granted once that is loaded -- so another
process of a data-parallel trainer, which pushes nothing, waits for the push of the process that
does, through the server and with no collective of its own.  A lease left idle past
``lease_idle`` seconds (its trainer died) is closed, and closing a lease aborts what still runs
under it."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ppo_rlhf.rollout.vllm_requests import kept_response, probe_logprobs, probe_params

TICK = 0.02  # seconds the thread waits for work when the engine has none


class Refusal(Exception):
    """What a route answers with an error status (``status``), its message said to the caller."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class Reply:
    """Where a route awaits its answer: a future of its event loop, resolved from the engine's thread."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    @classmethod
    def new(cls) -> "Reply":
        loop = asyncio.get_running_loop()
        return cls(loop, loop.create_future())

    def send(self, value) -> None:
        self.loop.call_soon_threadsafe(_settle, self.future, value, None)

    def fail(self, error: BaseException) -> None:
        self.loop.call_soon_threadsafe(_settle, self.future, None, error)


def _settle(future: asyncio.Future, value, error) -> None:
    if future.done():  # the route stopped waiting (its caller left)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


@dataclass
class Lease:
    key: str
    version: dict  # what was loaded when it was granted: {"run", "version"}
    implicit: bool = False  # opened for one call, closed when its requests are done
    running: set = field(default_factory=set)  # the engine's request ids under it
    used: float = field(default_factory=time.monotonic)


@dataclass
class Waiting:
    """Something waiting for its turn: a lease for its ``want``, or a push for the leases to close."""

    what: str  # "lease" or "load"
    deadline: float
    reply: Reply
    want: dict | None = None
    action: Callable | None = None  # a lease's: run once granted (an implicit lease's requests)
    load: dict | None = None


@dataclass
class Running:
    """One request in the engine: where its answer goes, how it is cut."""

    lease: str
    collect: Callable  # called with (index, answer) when it finishes
    fail: Callable  # called with an error when it is aborted (its lease closed)
    index: int
    stop_ids: list[int]
    max_tokens: int
    probe_ids: list[int] | None = None


class ServedEngine:
    """The engine and the thread that steps it (module docstring).  ``llm``: vLLM's ``LLM``;
    ``engine_input(ids)``: a prompt of token ids as the engine takes a request's."""

    def __init__(self, vllm, llm, engine_input: Callable, lease_idle: float = 300.0):
        self.vllm, self.llm, self.core = vllm, llm, llm.llm_engine
        self.engine_input = engine_input
        self.lease_idle = lease_idle
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.loaded = {"run": None, "version": None}  # None: the served folder's own weights
        self.leases: dict[str, Lease] = {}
        self.waiting: list[Waiting] = []
        self.running: dict[str, Running] = {}
        self.counter = itertools.count()
        self.loads = 0  # pushes loaded
        self.served = 0  # requests answered
        self.thread = threading.Thread(target=self.run, name="ppo-rlhf-serve-engine", daemon=True)
        self.stopped = False

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped = True

    # ------------------------------------------------------------ from the routes (any thread)
    def submit(self, command: Callable) -> None:
        """``command()`` on the engine's thread, between two steps."""
        self.inbox.put(command)

    async def open_lease(self, want: dict | None, timeout: float) -> dict:
        reply = Reply.new()
        self.submit(lambda: self.waiting.append(Waiting("lease", time.monotonic() + timeout, reply, want)))
        return await reply.future

    async def close_lease(self, key: str) -> None:
        reply = Reply.new()
        self.submit(lambda: (self.end_lease(key), reply.send(None)))
        await reply.future

    async def generate(self, requests: list[dict], lease: str | None, want: dict | None, timeout: float) -> dict:
        """Each request's (ids, log-probs) cut at its first stop id, and the version that sampled
        them; under ``lease``, or else under one of its own granted for ``want``.  A request:
        ``ids``, ``params`` (vLLM's SamplingParams), ``stop_ids``, ``max_tokens``, and for the weight
        probe ``probe_ids`` (then its prompt log-probs come back)."""
        reply = Reply.new()

        def start(granted: Lease) -> None:
            answers: list = [None] * len(requests)
            left = [len(requests)]

            def collect(index: int, answer) -> None:
                answers[index] = answer
                left[0] -= 1
                if left[0] == 0:
                    if granted.implicit:
                        self.end_lease(granted.key)
                    reply.send({"responses": answers, "version": granted.version})

            for index, request in enumerate(requests):
                self.add(granted, collect, reply.fail, index, request)
            if not requests:
                reply.send({"responses": [], "version": granted.version})

        def command() -> None:
            if lease is None:
                self.waiting.append(Waiting("lease", time.monotonic() + timeout, reply, want, action=start))
                return
            granted = self.leases.get(lease)
            if granted is None:
                reply.fail(Refusal(f"lease {lease} is not open on this server (closed, expired after "
                                   f"{self.lease_idle:g} s idle, or the server restarted)", 409))
                return
            start(granted)

        self.submit(command)
        return await reply.future

    async def load(self, load: dict, timeout: float) -> dict:
        """A push: ``load["weights"]()`` (the (name, tensor) pairs) loaded once no lease is held,
        then ``load["probe_ids"]``' log-probs; {"seconds", "probe", "version"}.  ``load["cleanup"]``
        runs after, whatever happened."""
        reply = Reply.new()
        self.submit(lambda: self.waiting.append(Waiting("load", time.monotonic() + timeout, reply, load=load)))
        return await reply.future

    async def call(self, function: Callable, timeout: float):
        """``function(llm)`` on the engine's thread once no lease is held (as a push waits): the
        NCCL group's setup."""
        return await self.load({"call": function}, timeout)

    def state(self) -> dict:
        return {"loaded": dict(self.loaded), "leases": len(self.leases), "running": len(self.running),
                "waiting": len(self.waiting), "loads": self.loads, "served": self.served}

    # ------------------------------------------------------------ on the engine's thread
    def run(self) -> None:
        while not self.stopped:
            busy = self.core.has_unfinished_requests()
            self.take(0.0 if busy else TICK)
            self.admit()
            if self.core.has_unfinished_requests():
                for output in self.core.step():
                    if output.finished:
                        self.finished(output)

    def take(self, wait: float) -> None:
        block = wait > 0
        while True:
            try:
                command = self.inbox.get(timeout=wait) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            try:
                command()
            except Exception as error:  # noqa: BLE001 -- a route's bad request must not stop the engine
                print(f"ppo-rlhf serve: a request failed: {type(error).__name__}: {error}", flush=True)

    def admit(self) -> None:
        """Leases idle too long closed; waiters past their deadline answered; a push loaded once no
        lease is held (none is granted while one waits); leases granted whose version is loaded."""
        now = time.monotonic()
        for key, lease in list(self.leases.items()):
            if not lease.running and now - lease.used > self.lease_idle:
                self.end_lease(key)
        for waiting in [w for w in self.waiting if w.deadline < now]:
            self.waiting.remove(waiting)
            self.time_out(waiting)
        load = next((w for w in self.waiting if w.what == "load"), None)
        if load is not None:
            if not self.leases and not self.running:
                self.waiting.remove(load)
                self.apply(load)
            return
        for waiting in [w for w in self.waiting if w.what == "lease" and self.satisfies(w.want)]:
            self.waiting.remove(waiting)
            lease = Lease(f"lease-{next(self.counter)}", dict(self.loaded), implicit=waiting.action is not None)
            self.leases[lease.key] = lease
            if waiting.action is not None:
                waiting.action(lease)
            else:
                waiting.reply.send({"lease": lease.key, "version": lease.version})

    def satisfies(self, want: dict | None) -> bool:
        if not want:
            return True
        if want.get("run") != self.loaded["run"]:
            return False
        at_least = want.get("at_least")
        return at_least is None or (self.loaded["version"] is not None and self.loaded["version"] >= at_least)

    def time_out(self, waiting: Waiting) -> None:
        if waiting.what == "load":
            held = ", ".join(f"{lease.key} on version {lease.version['version']}" for lease in self.leases.values())
            message = (f"the push waited past its timeout for the rollouts holding the weights to end ({held or 'none'}"
                       f"; {len(self.running)} requests running)")
            cleanup = waiting.load.get("cleanup")
            if cleanup is not None:
                cleanup()
        else:
            want = waiting.want or {}
            message = (f"no lease within the timeout: the server holds version {self.loaded['version']} of run "
                       f"{self.loaded['run']}, and the call wants version {want.get('at_least')} or later of run "
                       f"{want.get('run')} (its trainer's push did not come: another trainer pushes to this server, "
                       f"or the pushing process stopped)")
        waiting.reply.fail(Refusal(message, 504))

    def end_lease(self, key: str) -> None:
        """The lease closed, and whatever still runs under it aborted."""
        lease = self.leases.pop(key, None)
        if lease is None:
            return
        if lease.running:
            self.core.abort_request(sorted(lease.running))
            for request_id in lease.running:
                running = self.running.pop(request_id, None)
                if running is not None:  # its call is answered: nothing more comes for it
                    running.fail(Refusal(f"aborted: the lease it ran under ({key}) was closed", 409))

    def add(self, lease: Lease, collect: Callable, fail: Callable, index: int, request: dict) -> None:
        request_id = f"request-{next(self.counter)}"
        probe_ids = request.get("probe_ids")
        if probe_ids is not None:
            params, ids = probe_params(self.vllm), probe_ids
        else:
            params, ids = request["params"], request["ids"]
        params.output_kind = self.vllm.sampling_params.RequestOutputKind.FINAL_ONLY
        self.running[request_id] = Running(lease.key, collect, fail, index, request.get("stop_ids", []),
                                           request.get("max_tokens", 0), probe_ids)
        lease.running.add(request_id)
        lease.used = time.monotonic()
        self.core.add_request(request_id, self.engine_input(ids), params)

    def finished(self, output) -> None:
        running = self.running.pop(output.request_id, None)
        if running is None:  # aborted meanwhile
            return
        lease = self.leases.get(running.lease)
        if lease is not None:
            lease.running.discard(output.request_id)
            lease.used = time.monotonic()
        if running.probe_ids is not None:
            answer = probe_logprobs(output, running.probe_ids)
        else:
            answer = kept_response(output.outputs[0], running.stop_ids, running.max_tokens)
            self.served += 1
        running.collect(running.index, answer)

    def apply(self, waiting: Waiting) -> None:
        """A push loaded (or a call made) with no lease held and nothing running."""
        load = waiting.load
        start = time.perf_counter()
        try:
            if "call" in load:
                waiting.reply.send(load["call"](self.llm))
                return
            load["load"](self.llm)
            # The prefix cache holds keys and values of the weights before (docs/design.md, "The
            # vLLM rollout engine"); nothing runs now, so it empties whole.
            self.llm.reset_prefix_cache()
            self.loaded = {"run": load.get("run"), "version": load.get("version")}
            self.loads += 1
            seconds = time.perf_counter() - start
            probe = self.probe(load["probe_ids"]) if load.get("probe_ids") else None
            waiting.reply.send({"seconds": seconds, "probe": probe, "version": dict(self.loaded)})
        except Exception as error:  # noqa: BLE001 -- said to the trainer that pushed
            waiting.reply.fail(Refusal(f"the weights did not load ({type(error).__name__}: {error})", 500))
        finally:
            cleanup = load.get("cleanup")
            if cleanup is not None:
                cleanup()

    def probe(self, ids: list[int]) -> list[float]:
        """The engine's log-probs of ``ids`` after the first, right after a load (nothing else runs)."""
        request_id = f"probe-{next(self.counter)}"
        params = probe_params(self.vllm)
        params.output_kind = self.vllm.sampling_params.RequestOutputKind.FINAL_ONLY
        self.core.add_request(request_id, self.engine_input(ids), params)
        while True:
            for output in self.core.step():
                if output.request_id == request_id and output.finished:
                    return probe_logprobs(output, ids)

