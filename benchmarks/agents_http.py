"""The calculator of the agent benchmarks served over HTTP with a latency of one's choosing, and its
synchronous client (benchmarks/bench_agents_latency.py; the async client is agents_http_async.py).

A tool an agent calls waits on something -- an API, a sandbox, a database.  :class:`LatencyServer`
is a local HTTP server that answers ``GET /calculate?expression=...`` with
``agents_tools.calculator``'s answer after a wait: a fixed number of seconds, or one drawn per
request from [low, high].  The client reads the server's address from ``AGENTS_TOOL_URL`` (set by
the benchmark for the run it starts), so the tool keeps the signature, name and docstring of the
calculator the SFT warm-up taught (its schema, in the prompt, is the same).  Standard library only:
TRL's virtual environment imports it too (benchmarks/peers/trl_tools.py).
"""

from __future__ import annotations

import os
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from agents_tools import calculator as local_calculator

URL_VARIABLE = "AGENTS_TOOL_URL"


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a batch's calls connect at once (socketserver's 5 would make them retry)


class LatencyServer:
    """``latency``: seconds every answer waits, or (low, high): a wait drawn per request from a
    generator seeded with ``seed``.  A thread per request, so waits overlap as a real service's do."""

    def __init__(self, latency: float | tuple[float, float], seed: int = 0):
        self.latency, self.draws, self.lock = latency, random.Random(seed), threading.Lock()
        self.requests = 0
        self.intervals: list[tuple[float, float]] = []  # (start, end) of each request's wait
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 -- http.server's name
                query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)
                start = time.monotonic()
                time.sleep(server.wait())
                with server.lock:
                    server.intervals.append((start, time.monotonic()))
                try:
                    status, body = 200, local_calculator(query.get("expression", [""])[0])
                except Exception as error:  # noqa: BLE001 -- the calculator's error is the answer
                    status, body = 400, f"{type(error).__name__}: {error}"
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # quiet: a line per request would bury the benchmark's
                pass

        self.http = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def wait(self) -> float:
        with self.lock:
            self.requests += 1
            if isinstance(self.latency, tuple):
                return self.draws.uniform(*self.latency)
            return self.latency

    def waiting_seconds(self) -> float:
        """Seconds during which at least one call was waiting for its answer: the union of the
        requests' waits.  Calls one after another add their waits; calls at once, the longest.
        What the waits can add to a run's wall time, measured where they happen, with none of the
        run-to-run variation of whole iterations."""
        with self.lock:
            intervals = sorted(self.intervals)
        total, covered_to = 0.0, float("-inf")
        for start, end in intervals:
            if end > covered_to:
                total += end - max(start, covered_to)
                covered_to = end
        return total

    @property
    def url(self) -> str:
        host, port = self.http.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "LatencyServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()


def calculate_url(expression: str) -> str:
    return os.environ[URL_VARIABLE] + "/calculate?" + urllib.parse.urlencode({"expression": expression})


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / and parentheses.

    Args:
        expression: the expression to evaluate, e.g. 347 * 29
    """
    try:
        with urllib.request.urlopen(calculate_url(expression), timeout=60) as response:
            return response.read().decode()
    except urllib.error.HTTPError as error:  # the calculator's own error, as the local tool raises it
        raise ValueError(error.read().decode()) from None


def calls_calculator(text: str):
    """A tool-call parser reading one calculator call in every turn (``--smoke``: a model as it
    comes rarely writes one, and the benchmark is about the calls' waits)."""
    from ppo_rlhf.envs.parsers import ToolCall

    return [ToolCall("calculator", {"expression": "347 * 29"}, text=text)]
