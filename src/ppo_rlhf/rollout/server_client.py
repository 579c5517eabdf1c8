"""``--rollout-engine vllm-server``: the Generator contract (rollout/generation.py) on generation
servers (``ppo-rlhf serve``, docs/design.md "The generation server"), for ``ppo`` and ``eval``.

Each point of the contract is the colocated engine's (rollout/vllm_engine.py), kept across a
socket:

1. Weights: the trainer pushes the policy after each update (``policy_moved`` says which version
   the actor is at; the next rollout's ``sync`` pushes it, or the asynchronous loop does at once),
   by shared memory, HTTP or NCCL (rollout/weight_push.py), to every server; the server loads them
   in place and answers the weight probe's log-probs, which are checked here against the actor's
   with the colocated engine's tolerance.
2-4. Distribution, stopping, layout: the server builds each request's settings with the same
   function (vllm_requests.py, ``sampling_params``) and cuts each completion at its first stop id
   as the colocated engine does; token ids go in and out, with the engine's log-probs.
5. Randomness: each response's seed is computed here, as the colocated engine computes it (the run
   seed, the process, the draw count, the row and an episode's turn), and sent with the request,
   so what is sampled never depends on which server answered or when.

Rows are spread over the servers (a batch split in contiguous shares; an episode kept on one
server, the least busy when its first turn is asked).  Every rollout holds a lease on each server
(the weights it started with stay loaded until it ends), and every response records the policy
version that sampled it (``last_versions``).  A server that does not answer stops the run with
ServerUnavailable, naming it; the run's last checkpoint is whole and ``--resume`` goes on.

Several trainer processes (data parallel) share the servers without a collective through them:
process 0 pushes, and every process's calls ask for the version of the run it is at, which the
server grants once process 0's push has landed."""

from __future__ import annotations

import contextlib
import copy
import queue
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ppo_rlhf.config import ConfigError
from ppo_rlhf.models.loading import base_of
from ppo_rlhf.rollout.engine_weights import actor_probe_logprobs, probe_tolerance, refuse_probe_gap
from ppo_rlhf.rollout.server_api import (GENERATE, INFO, LEASES, UPLOAD, WEIGHTS, Connection, ServerRefused,
                                         ServerUnavailable, identity_mismatch, model_identity)
from ppo_rlhf.rollout.vllm_requests import DrawCount, EngineDecoding, response_seed
from ppo_rlhf.rollout.weight_push import NcclPush, policy_chunks, transfer_for, write_policy_file

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROBE_TOKENS = 32
TICK = 0.01  # seconds a serving round waits for a turn to come back before it looks for new asks


class ServerGenerator:
    """The Generator contract on generation servers (module docstring).

    ``urls``: the servers, each ``http://host:port``; ``timeout``: the most seconds one call may
    take (a push and its wait for the rollouts holding the weights, a batch's generation, a turn);
    ``transfer``: how weights reach the servers (rollout/weight_push.py, TRANSFERS)."""

    steps_together = False  # each process's calls are its own: no collective through a server

    def __init__(self, urls: list[str], stop_token_ids, pad_token_id: int, max_new_tokens: int, do_sample: bool,
                 temperature: float = 1.0, seed: int = 0, process: int = 0, timeout: float = 600.0,
                 transfer: str = "auto", probe_tolerance: float | None = None, workers: int = 64):
        if not urls:
            raise ConfigError("--rollout-engine vllm-server: give --server-url URL (one or several, comma-separated), "
                              "the address ppo-rlhf serve says it is ready at")
        self.stop_token_ids = torch.as_tensor(stop_token_ids).reshape(-1).tolist()
        self.pad_token_id, self.max_new_tokens = pad_token_id, max_new_tokens
        self.do_sample, self.temperature, self.seed, self.process = do_sample, temperature, seed, process
        self.timeout, self.given_tolerance = timeout, probe_tolerance
        try:
            self.servers = [Connection(url, timeout, grace=60) for url in urls]  # a server's own 504 comes first
        except ValueError as error:
            raise ConfigError(f"--server-url: {error}") from None
        self.infos = [self.checked_info(server) for server in self.servers]
        self.dtype = DTYPES[self.infos[0]["dtype"]]
        self.transfers = []
        for server, info in zip(self.servers, self.infos):
            try:
                self.transfers.append(transfer_for(transfer, info, server.url))
            except ValueError as error:
                raise ConfigError(str(error)) from None
        from ppo_rlhf.distributed import gather_objects

        # One name for this run's pushes, process 0's, so every process asks for the same versions.
        self.run_tag = gather_objects([secrets.token_hex(6)])[0]
        self.pushes = process == 0  # data parallel: one process pushes, the others ask for its versions
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ppo-rlhf-server")
        self.nccl: dict[int, NcclPush] = {}
        self.rng = DrawCount()  # saved in checkpoints as the sampling state (trainers/ppo_loop.py)
        self.version = 0  # the policy version the actor is at: updates made (``policy_moved``)
        self.pushed: int | None = None  # the version the servers were given (None: none yet)
        self.any_version = False  # a view that samples from whatever version of the run is loaded
        self.fixed_weights = False  # the model never changes (eval): pushed once
        self.syncs = 0
        self.holding = False
        self.leases: list[dict] = []  # inside holding_weights: each server's {"lease", "version"}
        self.probe_ids: list[int] | None = None
        self.probe_due = False  # a push whose probe waits for a prompt to probe with
        self.last_logprobs: torch.Tensor | None = None
        self.last_sync_seconds = 0.0
        self.last_probe: dict[str, float] = {}
        self.last_versions: list[int | None] = []  # the policy version that sampled each row of the last rollout

    # ------------------------------------------------------------ at start
    def servers_described(self) -> list[str]:
        """Each server as the plan names it: its address, and how its weights get there."""
        return [f"{server.url} (push by {transfer})" for server, transfer in zip(self.servers, self.transfers)]

    def checked_info(self, server: Connection) -> dict:
        info = server.call("GET", INFO, timeout=min(self.timeout, 30.0), what="the check at start")
        if "drop_token" not in info or "shape" not in info:
            raise ConfigError(f"--server-url {server.url}: what answers there is not ppo-rlhf serve (its "
                              f"{INFO} says {str(info)[:120]}); start one with ppo-rlhf serve --model MODEL")
        return info

    def check_served(self, model, tokenizer, max_length: int, agent: bool = False) -> None:
        """ConfigError at start unless every server serves the actor's model (architecture and sizes)
        with its tokenizer, and takes sequences of ``max_length`` tokens; with an agent, also its chat
        template (the server renders the agent's messages)."""
        config = base_of(model).config
        ours = model_identity(config, tokenizer)
        ours["architecture"] = ours["architecture"] or type(base_of(model)).__name__
        for server, info in zip(self.servers, self.infos):
            mismatch = identity_mismatch(info, ours, agent)
            if mismatch:
                raise ConfigError(f"--server-url {server.url} serves {info.get('name')}, not this run's model: "
                                  f"{mismatch}; start the server with the run's --model (its base, under --lora)")
            if info["max_model_len"] < max_length:
                raise ConfigError(f"--server-url {server.url} takes sequences of at most {info['max_model_len']} "
                                  f"tokens, and this run's reach {max_length} (--max-length); start it with "
                                  f"--max-model-len {max_length} or more")
        dtypes = {info["dtype"] for info in self.infos}
        if len(dtypes) > 1:
            raise ConfigError(f"--server-url: the servers run in {', '.join(sorted(dtypes))}; start them with one "
                              f"--dtype, which the weights are pushed in")

    # ------------------------------------------------------------ weights
    def policy_moved(self, version: int) -> None:
        """The actor is now at ``version`` (updates made since the start of the run): the next
        rollout, or the asynchronous loop's push, gives it to the servers."""
        self.version = version

    def probe_tolerance(self, model) -> float:
        return probe_tolerance(self.given_tolerance, model, self.dtype)

    def keep_probe_prompt(self, ids: list[int]) -> None:
        """The probe's sequence, once for the run: the last tokens of the first prompt longer than a token."""
        if self.probe_ids is None and len(ids) > 1:
            self.probe_ids = ids[-PROBE_TOKENS:]

    def sync(self, model) -> float:
        """The actor's weights on every server unless they hold its version already; seconds.
        Process 0 pushes and checks the probe (deferred to the next call where no prompt was seen
        yet); another process's calls wait, through the server, for that push."""
        if self.pushed == self.version or (self.fixed_weights and self.pushed is not None):
            return 0.0
        start = time.perf_counter()
        if self.pushes:
            self.last_probe = {}
            version = self.version
            answers = list(self.pool.map(lambda index: self.push_to(index, model, version), range(len(self.servers))))
            self.syncs += 1
            if self.probe_ids is not None:
                self.last_probe = self.check_probe(model, [answer["probe"] for answer in answers])
                self.probe_due = False
            else:
                self.probe_due = True
        self.pushed = self.version
        return time.perf_counter() - start

    def push_to(self, index: int, model, version: int) -> dict:
        """The policy at ``version`` to server ``index``, by its transfer; the server's answer."""
        server, info, transfer = self.servers[index], self.infos[index], self.transfers[index]
        request = {"run": self.run_tag, "version": version, "probe_ids": self.probe_ids, "timeout": self.timeout}
        what = f"the weight push of version {version}"
        try:
            if transfer == "shared-memory":
                path = write_policy_file(model, self.dtype, info["drop_box"], f"{self.run_tag}-v{version}")
                try:
                    return server.call("POST", WEIGHTS, {"path": str(path), **request}, what=what)
                finally:
                    path.unlink(missing_ok=True)
            if transfer == "http":
                query = f"?run={self.run_tag}&version={version}&timeout={self.timeout}"
                if self.probe_ids:
                    query += "&probe_ids=" + ",".join(map(str, self.probe_ids))
                return server.call("POST", UPLOAD + query, stream=policy_chunks(model, self.dtype), what=what)
            if index not in self.nccl:
                self.nccl[index] = NcclPush(server, info, model, self.dtype, self.timeout)
            return self.nccl[index].push(request)
        except ServerRefused as refused:
            if refused.status == 504:
                raise ServerUnavailable(f"the weight push of version {version} to the generation server at "
                                        f"{server.url} timed out: {refused.message} (--server-timeout "
                                        f"{self.timeout:g})") from None
            raise

    def check_probe(self, model, engine_values: list[list[float] | None]) -> dict[str, float]:
        """The probe's gap on every server against the actor's own log-probs (the largest decides);
        EngineWeightsError past the tolerance."""
        start = time.perf_counter()
        actor = actor_probe_logprobs(model, self.probe_ids, self.dtype)
        gaps = [(torch.tensor(values) - actor).abs().mean().item() for values in engine_values if values is not None]
        if not gaps:
            return {}
        worst = max(range(len(gaps)), key=lambda i: float("inf") if gaps[i] != gaps[i] else gaps[i])
        refuse_probe_gap(gaps[worst], self.probe_tolerance(model),
                         f"the generation server at {self.servers[worst].url}",
                         f"weight push {self.syncs} (policy version {self.version})", len(self.probe_ids) - 1)
        return {"rollout/probe_gap": gaps[worst], "time/engine_probe": time.perf_counter() - start}

    def want(self) -> dict:
        """The weights a call may be answered with: this run's version the actor is at (any of the
        run's, for the asynchronous loop's rollouts)."""
        return {"run": self.run_tag, "at_least": None if self.any_version else self.version}

    # ------------------------------------------------------------ the Generator contract
    @torch.no_grad()
    def generate(self, model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 decoding: EngineDecoding | None = None, max_new_tokens: list[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rollout's responses, the rows spread over the servers; ``decoding``: another caller's
        settings and seeds (vllm_requests.py, ``EngineDecoding``); ``max_new_tokens``: each row's limit."""
        settings = decoding or self
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        self.keep_probe_prompt(prompts[0])
        syncs = self.syncs
        sync_seconds = 0.0 if self.holding else self.sync(model)
        probing = self.probe_due and self.pushes and self.probe_ids is not None
        draw = settings.rng.draws
        limits = max_new_tokens or [self.max_new_tokens] * len(prompts)
        shares = split_rows(len(prompts), len(self.servers))

        def call(index: int) -> dict:
            rows = shares[index]
            body = {"requests": [{"ids": prompts[row], "max_tokens": limits[row],
                                  "seed": response_seed(settings.seed, self.process, draw, row)} for row in rows],
                    **self.decoding_body(settings), "want": self.want(), "timeout": self.timeout}
            if self.holding:
                body["lease"] = self.leases[index]["lease"]
            if probing:
                body["probe_ids"] = self.probe_ids
            if not rows and not probing:
                return {"responses": [], "version": None, "probe": None}
            return self.servers[index].call("POST", GENERATE, body, what="a rollout's generation")

        answers = list(self.pool.map(call, range(len(self.servers))))
        settings.rng.draws += 1
        responses, versions = [None] * len(prompts), [None] * len(prompts)
        for rows, answer in zip(shares, answers):
            for row, response in zip(rows, answer["responses"]):
                responses[row] = (response["ids"], response["logprobs"])
                versions[row] = (answer.get("version") or {}).get("version")
        probe = self.check_probe(model, [answer.get("probe") for answer in answers]) if probing else {}
        if probing:
            self.probe_due = False
        response_ids, response_mask, engine_logprobs = response_tensors(responses, self.pad_token_id)
        if decoding is None:
            self.last_logprobs = (engine_logprobs * response_mask).to(prompt_ids.device)
            self.last_sync_seconds = sync_seconds
            self.last_versions = versions
            if probing:
                self.last_probe = probe
            elif self.syncs == syncs and not self.holding:  # no push this call: no probe to report
                self.last_probe = {}
        return response_ids.to(prompt_ids.device), response_mask.to(prompt_ids.device)

    def decoding_body(self, settings) -> dict:
        return {"do_sample": settings.do_sample, "temperature": settings.temperature, "stop_ids": self.stop_token_ids}

    def with_decoding(self, do_sample: bool, temperature: float = 1.0, seed: int | None = None) -> EngineDecoding:
        """These servers with other decoding settings and seeds of their own (in-run evaluations,
        ReMax's greedy baseline), leaving the rollouts' draw count alone."""
        return EngineDecoding(self, do_sample, temperature, self.seed if seed is None else seed)

    def requests(self, model, decoding: EngineDecoding | None = None) -> "ServerRequests":
        """One rollout's episode turns, each its own call (continuous batching on the servers:
        rollout/turns.py), inside ``holding_weights``."""
        return ServerRequests(self, model, decoding)

    @contextlib.contextmanager
    def holding_weights(self, model):
        """A multi-turn rollout: the weights pushed if due, and a lease held on every server for all
        its turns (the weights stay the ones it started with); ``last_sync_seconds`` is the push."""
        seconds = self.sync(model)
        body = {"want": self.want(), "timeout": self.timeout}
        self.leases = list(self.pool.map(lambda server: server.call("POST", LEASES, body, what="a rollout's lease"),
                                         self.servers))
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
            leases, self.leases = self.leases, []
            for server, lease in zip(self.servers, leases):
                with contextlib.suppress(ServerUnavailable, ServerRefused):  # a server gone: the error is on its way
                    server.call("DELETE", f"{LEASES}/{lease['lease']}", timeout=30.0, what="a lease's end")
            self.last_sync_seconds = seconds

    def worker_view(self) -> "ServerGenerator":
        """These servers for the asynchronous loop's rollout worker (trainers/ppo_async.py): the
        same draw count, connections and threads; it never pushes, and samples from whatever
        version of the run is loaded (each response says which)."""
        view = copy.copy(self)
        view.pushes, view.any_version, view.holding, view.leases = False, True, False, []
        view.last_logprobs, view.last_versions, view.last_probe = None, [], {}
        return view

    def abort_leases(self) -> None:
        """The rollout in progress stopped from another thread: its leases closed, which aborts its
        calls on the servers (they answer with an error)."""
        for server, lease in zip(self.servers, list(self.leases)):
            with contextlib.suppress(ServerUnavailable, ServerRefused):
                server.call("DELETE", f"{LEASES}/{lease['lease']}", timeout=30.0, what="a lease's end")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for server in self.servers:
            server.close()


class ServerRequests:
    """One rollout's episode turns on the servers, each asked as its own call as soon as its
    episode asks (``add``), the answers handed back as they come (``step``): continuous batching,
    each server batching whatever is pending at each of its steps (rollout/turns.py,
    ``ContinuousTurns``).  An episode stays on one server; each call's seed is its own, from (run
    seed, process, draw, row, turn).  A push's probe that waited for a prompt goes to every server
    under the rollout's leases when the rollout ends (``close``), where the actor is still the
    version pushed."""

    def __init__(self, engine: ServerGenerator, model, decoding: EngineDecoding | None = None):
        if not engine.holding:
            raise RuntimeError("ServerRequests is used inside holding_weights (the rollout's leases)")
        self.engine, self.model, self.decoding = engine, model, decoding or engine
        self.draw = self.decoding.rng.draws
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.pending: set[str] = set()
        self.server_of: dict[int, int] = {}
        self.load = [0] * len(engine.servers)
        self.probing = engine.probe_due and engine.pushes

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def add(self, row: int, turn: int, ids: list[int], limit: int | None) -> str:
        engine = self.engine
        engine.keep_probe_prompt(ids)
        if row not in self.server_of:
            self.server_of[row] = min(range(len(self.load)), key=lambda index: self.load[index])
        index = self.server_of[row]
        key = f"episode-{row}-turn-{turn}"
        seed = response_seed(self.decoding.seed, engine.process, self.draw, row, turn)
        body = {"requests": [{"ids": ids, "max_tokens": limit or engine.max_new_tokens, "seed": seed}],
                **engine.decoding_body(self.decoding), "lease": engine.leases[index]["lease"],
                "timeout": engine.timeout}
        future = engine.pool.submit(engine.servers[index].call, "POST", GENERATE, body, what="an episode's turn")
        self.pending.add(key)
        self.load[index] += 1
        future.add_done_callback(lambda done: self.done.put((key, index, done)))
        return key

    def step(self) -> list[tuple[str, tuple[list[int], list[float]]]]:
        """The turns answered since the last call, as (key, (ids, log-probs)); waits up to TICK for
        the first where some are pending."""
        finished = []
        block = bool(self.pending)
        while True:
            try:
                key, index, future = self.done.get(timeout=TICK) if block else self.done.get_nowait()
            except queue.Empty:
                return finished
            block = False
            self.pending.discard(key)
            self.load[index] -= 1
            response = future.result()["responses"][0]  # ServerUnavailable / ServerRefused: the run stops
            finished.append((key, (response["ids"], response["logprobs"])))

    def anyone_working(self, running: bool, busy: bool) -> tuple[bool, bool]:
        """This process's own: a server's steps are no collective of the trainer's processes."""
        return running or busy, busy

    def close(self) -> None:
        """The rollout ended: its draw counted, each row's version recorded, a due probe checked."""
        engine = self.engine
        self.decoding.rng.draws += 1
        if self.decoding is engine:
            rows = max(self.server_of, default=-1) + 1
            engine.last_versions = [engine.leases[self.server_of[row]]["version"]["version"]
                                    if row in self.server_of else None for row in range(rows)]
        if self.probing and engine.probe_ids is not None:
            body = {"requests": [], "probe_ids": engine.probe_ids, "timeout": engine.timeout}
            answers = list(engine.pool.map(
                lambda index: engine.servers[index].call(
                    "POST", GENERATE, {**body, "lease": engine.leases[index]["lease"]}, what="the weight probe"),
                range(len(engine.servers))))
            probe = engine.check_probe(self.model, [answer["probe"] for answer in answers])
            engine.probe_due = False
            if self.decoding is engine:
                engine.last_probe = probe

    def abort(self) -> None:
        """The rollout stopped midway: its calls are left to the leases' end (closing a lease aborts
        what still runs under it)."""
        self.pending.clear()


def check_servers_answer(urls: list[str], timeout: float) -> None:
    """At start, before any model loads: a ConfigError unless each URL is a generation server that
    answers (the model it serves is checked against the actor's once that is loaded)."""
    for url in urls:
        try:
            server = Connection(url, min(timeout, 30.0))
            info = server.call("GET", INFO, what="the check at start")
        except ValueError as error:
            raise ConfigError(f"--server-url: {error}") from None
        except ServerRefused as error:
            raise ConfigError(f"--server-url {url}: what answers there is not ppo-rlhf serve (its {INFO} answers "
                              f"{error.status}: {error.message[:80]}); start one with ppo-rlhf serve --model MODEL"
                              ) from None
        except ServerUnavailable as error:
            raise ConfigError(f"--server-url {url}: {error}") from None
        if not isinstance(info, dict) or "drop_token" not in info:
            raise ConfigError(f"--server-url {url}: what answers there is not ppo-rlhf serve (its {INFO} says "
                              f"{str(info)[:120]}); start one with ppo-rlhf serve --model MODEL")


def split_rows(rows: int, parts: int) -> list[list[int]]:
    """``rows`` row indices in ``parts`` contiguous shares, as even as they go."""
    bounds = [rows * part // parts for part in range(parts + 1)]
    return [list(range(bounds[part], bounds[part + 1])) for part in range(parts)]


def response_tensors(responses: list[tuple[list[int], list[float]]], pad_token_id: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T) ids padded with ``pad_token_id``, their mask and the engine's log-probs, row for row."""
    width = max(1, max(len(ids) for ids, _ in responses))
    response_ids = torch.full((len(responses), width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(len(responses), width, dtype=torch.long)
    engine_logprobs = torch.zeros(len(responses), width)
    for row, (ids, values) in enumerate(responses):
        response_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[row, :len(ids)] = 1
        engine_logprobs[row, :len(values)] = torch.tensor(values, dtype=torch.float32)
    return response_ids, response_mask, engine_logprobs
