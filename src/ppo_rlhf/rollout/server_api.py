"""What a trainer and a generation server (``ppo-rlhf serve``) both know (docs/design.md, "The
generation server"): the routes, one JSON call over HTTP with the standard library's client (a
trainer needs no web package to use a server), the errors that stop a run when a server does not
answer or refuses, and what identifies a served model -- its architecture and sizes, and its
tokenizer -- so that a trainer can tell at start that a server serves its own."""

from __future__ import annotations

import hashlib
import http.client
import json
import socket
import threading
import urllib.parse

HEALTH, MODELS, INFO = "/health", "/v1/models", "/ppo-rlhf/info"
GENERATE, LEASES = "/ppo-rlhf/generate", "/ppo-rlhf/leases"
WEIGHTS, UPLOAD = "/ppo-rlhf/weights", "/ppo-rlhf/weights/upload"
NCCL_INIT, NCCL_WEIGHTS = "/ppo-rlhf/weights/nccl-init", "/ppo-rlhf/weights/nccl"
EPISODES = "/ppo-rlhf/episodes"  # an agent's episode: its OpenAI base URL is EPISODES/<key>/v1
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
# The sizes that decide whether one model's weights load into another's engine.
SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "n_embd", "num_hidden_layers", "n_layer",
                "num_attention_heads", "n_head", "num_key_value_heads", "intermediate_size", "head_dim",
                "max_position_embeddings", "n_positions", "tie_word_embeddings")


class ServerUnavailable(RuntimeError):
    """A generation server that does not answer (nothing listening, it died, a call past its
    timeout).  The run stops with this message; its last checkpoint is whole, and ``--resume``
    continues once the server runs again (``resume_from``: set by the training loop)."""


class ServerRefused(RuntimeError):
    """A generation server that answered a call with an error of its own (its message is kept)."""

    def __init__(self, url: str, status: int, message: str):
        super().__init__(f"the generation server at {url} refused the call ({status}): {message}")
        self.status, self.message = status, message


class Connection:
    """JSON calls to one server, over one kept-alive HTTP connection per thread (calls from
    several threads at once each use their own)."""

    def __init__(self, url: str, timeout: float, grace: float = 0.0):
        """``timeout``: the seconds a call may take, as messages say it; the socket waits ``grace``
        seconds more, so that a server's own answer to a wait it timed out arrives first."""
        parsed = urllib.parse.urlsplit(url if "//" in url else f"http://{url}")
        if parsed.scheme not in ("http", "") or not parsed.hostname:
            raise ValueError(f"{url!r} is not an http://host:port URL")
        self.url = f"http://{parsed.hostname}:{parsed.port or 80}{parsed.path.rstrip('/')}"
        self.host, self.port, self.prefix = parsed.hostname, parsed.port or 80, parsed.path.rstrip("/")
        self.timeout, self.grace = timeout, grace
        self.local = threading.local()

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        connection = getattr(self.local, "connection", None)
        if connection is None:
            connection = self.local.connection = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        connection.timeout = timeout
        if connection.sock is not None:
            connection.sock.settimeout(timeout)
        return connection

    def call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None,
             stream=None, what: str = "a call") -> dict:
        """The server's JSON answer to ``method path`` with ``body`` (or the bytes ``stream``
        yields, sent chunked); ServerUnavailable when it does not answer within ``timeout``
        seconds (default: the connection's), ServerRefused for an error it answers with.  ``what``
        names the call in the messages."""
        timeout = self.timeout if timeout is None else timeout
        said, timeout = timeout, timeout + self.grace
        headers = {"Content-Type": "application/json"}
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(2):
            connection = self.connection(timeout)
            try:
                if stream is not None:
                    connection.request(method, self.prefix + path, body=stream,
                                       headers={"Content-Type": "application/octet-stream",
                                                "Transfer-Encoding": "chunked"}, encode_chunked=True)
                else:
                    connection.request(method, self.prefix + path, body=data, headers=headers)
                response = connection.getresponse()
                payload = response.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as error:
                connection.close()
                self.local.connection = None
                # A kept-alive connection the server closed meanwhile (it reads as one of these on
                # the next call): one try on a fresh connection (never for a stream, which is spent).
                if attempt == 0 and stream is None:
                    continue
                raise self.unavailable(what, error) from None
            except (OSError, http.client.HTTPException) as error:
                connection.close()
                self.local.connection = None
                raise self.unavailable(what, error, said) from None
        try:
            answer = json.loads(payload or b"{}")
        except ValueError:
            answer = {"error": payload[:200].decode(errors="replace")}
        if response.status >= 400:
            error = answer.get("error") if isinstance(answer, dict) else None
            message = error.get("message") if isinstance(error, dict) else error or answer.get("detail") or answer
            raise ServerRefused(self.url, response.status, str(message))
        return answer

    def unavailable(self, what: str, error: BaseException, timeout: float | None = None) -> ServerUnavailable:
        if isinstance(error, (socket.timeout, TimeoutError)):
            reason = f"no answer to {what} within {timeout:g} s (--server-timeout)"
        elif isinstance(error, ConnectionRefusedError):
            reason = f"nothing listens there ({what}: connection refused)"
        else:
            reason = f"{what} failed ({type(error).__name__}: {error or 'connection closed'})"
        return ServerUnavailable(f"the generation server at {self.url} does not answer: {reason}; start it with "
                                 f"ppo-rlhf serve --model MODEL --port PORT (or check --server-url)")

    def close(self) -> None:
        connection = getattr(self.local, "connection", None)
        if connection is not None:
            connection.close()
            self.local.connection = None


def model_shape(config) -> dict:
    """The sizes of a model's (text) config that decide whether its weights load into an engine
    built for another's."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    values = text.to_dict()
    return {key: values[key] for key in SHAPE_FIELDS if values.get(key) is not None}


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what a tokenizer's ids mean: every token with its id, and the special tokens'
    ids -- two tokenizers with the same fingerprint encode and decode alike."""
    digest = hashlib.sha256()
    for token, index in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        digest.update(f"{index}\t{token}\n".encode())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        digest.update(f"{name}={getattr(tokenizer, name, None)}\n".encode())
    return digest.hexdigest()[:16]


def template_fingerprint(tokenizer) -> str | None:
    """A hash of the tokenizer's chat template (None: it has none)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return None if template is None else hashlib.sha256(template.encode()).hexdigest()[:16]


def model_identity(config, tokenizer) -> dict:
    """What a server says it serves, and a trainer checks against its own at start."""
    architectures = getattr(config, "architectures", None) or []
    return {"architecture": architectures[0] if architectures else None, "shape": model_shape(config),
            "tokenizer": tokenizer_fingerprint(tokenizer), "vocabulary": len(tokenizer),
            "chat_template": template_fingerprint(tokenizer)}


def identity_mismatch(served: dict, ours: dict, agent: bool) -> str | None:
    """What differs between a served model and the trainer's (None: nothing that matters):
    another architecture or size (the pushed weights would not load), another tokenizer (the
    ids would mean other words), and with an agent, whose calls the server renders, another
    chat template."""
    if served.get("architecture") != ours.get("architecture"):
        return f"it serves a {served.get('architecture')} and the actor is a {ours.get('architecture')}"
    for key in sorted(set(served["shape"]) | set(ours["shape"])):
        if served["shape"].get(key) != ours["shape"].get(key):
            return f"its model's {key} is {served['shape'].get(key)} and the actor's {ours['shape'].get(key)}"
    if served.get("tokenizer") != ours.get("tokenizer"):
        return (f"its tokenizer is another ({served.get('vocabulary')} tokens, fingerprint {served.get('tokenizer')}; "
                f"the actor's: {ours.get('vocabulary')} tokens, {ours.get('tokenizer')}), so the same ids would "
                f"mean other words")
    if agent and served.get("chat_template") != ours.get("chat_template"):
        return ("its chat template differs from the actor's tokenizer's, and it renders the agent's messages with its "
                "own: serve the same one (ppo-rlhf serve --chat-template-file FILE)")
    return None
