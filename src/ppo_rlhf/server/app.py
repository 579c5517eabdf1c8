"""The generation server's routes (docs/design.md, "The generation server"): health and the
model it serves (what a trainer checks at start), token-in token-out generation with the Generator
contract's settings and per-request seeds, leases, and weight pushes checked by the probe; the
OpenAI-compatible routes and agents' episodes are server/openai_api.py's.  Every error is answered
as the OpenAI API answers one, ``{"error": {"message": ...}}``, with its status."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request  # (vLLM brings FastAPI; this module is imported where vLLM is)

from ppo_rlhf.rollout import server_api as api
from ppo_rlhf.rollout.vllm_requests import sampling_params
from ppo_rlhf.server.engine import Refusal, ServedEngine

# A push's or a lease's wait, where the caller names none; the trainer sends its --server-timeout.
DEFAULT_WAIT = 600.0


@dataclass
class Served:
    """What the routes serve with: the engine, the model's name, identity and tokenizer, its limits."""

    engine: ServedEngine
    name: str
    tokenizer: object
    identity: dict
    dtype: str
    max_model_len: int
    max_rows: int
    stop_ids: list[int]
    drop_box: Path
    drop_token: str
    transfers: list[str]
    world_size: int = 1
    tool_parser: str = "auto"
    chat_template: str | None = None
    extra: dict = field(default_factory=dict)  # what server/openai_api.py keeps (the agents' episodes)

    def info(self) -> dict:
        return {"name": self.name, **self.identity, "dtype": self.dtype, "max_model_len": self.max_model_len,
                "max_rows": self.max_rows, "stop_ids": self.stop_ids, "drop_box": str(self.drop_box),
                "drop_token": self.drop_token, "weight_transfers": self.transfers, "world_size": self.world_size,
                **self.engine.state()}


def error_response(message: str, status: int):
    from fastapi.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def build_app(served: Served):
    """The FastAPI application; the engine's thread runs while it does."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        served.engine.start()
        yield
        served.engine.stop()

    app = FastAPI(title="ppo-rlhf serve", lifespan=lifespan)

    @app.exception_handler(Refusal)
    async def refused(request: Request, error: Refusal):
        return error_response(str(error), error.status)

    @app.get(api.HEALTH)
    async def health():
        return {"status": "ok"}

    @app.get(api.MODELS)
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "owned_by": "ppo-rlhf",
                                            "max_model_len": served.max_model_len}]}

    @app.get(api.INFO)
    async def info():
        return served.info()

    @app.post(api.LEASES)
    async def open_lease(body: dict):
        return await served.engine.open_lease(body.get("want"), float(body.get("timeout", DEFAULT_WAIT)))

    @app.delete(api.LEASES + "/{key}")
    async def close_lease(key: str):
        await served.engine.close_lease(key)
        return {"closed": key}

    @app.post(api.GENERATE)
    async def generate(body: dict):
        requests = generation_requests(served, body)
        probe = body.get("probe_ids")
        if probe:
            requests.append({"probe_ids": checked_ids(served, probe, 1, "probe_ids")})
        answer = await served.engine.generate(requests, body.get("lease"), body.get("want"),
                                              float(body.get("timeout", DEFAULT_WAIT)))
        responses = answer["responses"]
        return {"responses": [{"ids": ids, "logprobs": logprobs} for ids, logprobs in responses[:len(responses) -
                                                                                                 bool(probe)]],
                "probe": responses[-1] if probe else None, "version": answer["version"]}

    @app.post(api.WEIGHTS)
    async def push_file(body: dict):
        """A push by shared memory: a safetensors file the trainer wrote into the drop box."""
        path = Path(str(body.get("path", "")))
        if path.resolve().parent != served.drop_box.resolve() or not path.is_file():
            raise Refusal(f"{path} is not a weights file in this server's drop box ({served.drop_box})")
        return await load_file(served, path, body)

    @app.post(api.UPLOAD)
    async def push_stream(request: Request):
        """A push over HTTP: the safetensors bytes in the body, kept in the drop box while loading."""
        body = {key: request.query_params.get(key) for key in ("run", "version", "timeout", "probe_ids")}
        body["version"] = int(body["version"]) if body.get("version") not in (None, "") else None
        body["probe_ids"] = [int(i) for i in body["probe_ids"].split(",")] if body.get("probe_ids") else None
        path = served.drop_box / f"upload-{uuid.uuid4().hex[:12]}.safetensors"
        try:
            with open(path, "wb") as out:
                async for chunk in request.stream():
                    out.write(chunk)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return await load_file(served, path, body)

    @app.post(api.NCCL_INIT)
    async def nccl_init(body: dict):
        if "nccl" not in served.transfers:
            raise Refusal("this server takes no NCCL pushes: start it with ppo-rlhf serve --nccl-weight-transfer")
        init_info = body["init_info"]
        # The workers wait in the group's rendezvous until the trainer joins: called beside it.
        await served.engine.call(lambda llm: llm.collective_rpc("init_weight_transfer_engine",
                                                                kwargs={"init_info": init_info}) and None,
                                 float(body.get("timeout", DEFAULT_WAIT)))
        return {"ready": True}

    @app.post(api.NCCL_WEIGHTS)
    async def push_nccl(body: dict):
        update_info = body["update_info"]

        def receive(llm) -> None:
            llm.collective_rpc("start_weight_update")
            llm.collective_rpc("update_weights", kwargs={"update_info": update_info})
            llm.collective_rpc("finish_weight_update")

        return await served.engine.load({"load": receive, "run": body.get("run"), "version": body.get("version"),
                                         "probe_ids": body.get("probe_ids")}, float(body.get("timeout", DEFAULT_WAIT)))

    from ppo_rlhf.server.openai_api import add_openai_routes

    add_openai_routes(app, served)
    return app


def checked_ids(served: Served, ids, room: int, where: str) -> list[int]:
    """``ids`` as a list of token ids the model has, leaving ``room`` positions; a Refusal otherwise."""
    vocabulary = served.identity["shape"].get("vocab_size") or served.identity["vocabulary"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < vocabulary for i in ids):
        raise Refusal(f"{where}: a non-empty list of token ids below {vocabulary} was expected")
    if len(ids) + room > served.max_model_len:
        raise Refusal(f"{where}: {len(ids)} prompt tokens and {room} to generate pass the server's --max-model-len "
                      f"({served.max_model_len}); start the server with a larger one, or lower --max-length")
    return ids


def generation_requests(served: Served, body: dict) -> list[dict]:
    """The engine's requests of a generate call: each row's ids, seed and token limit, with the
    call's stop ids and decoding (the Generator contract's settings: rollout/vllm_requests.py)."""
    stop_ids = [int(i) for i in body.get("stop_ids") or served.stop_ids]
    do_sample, temperature = bool(body.get("do_sample", True)), float(body.get("temperature", 1.0))
    requests = []
    for row, request in enumerate(body.get("requests", [])):
        max_tokens = int(request["max_tokens"])
        ids = checked_ids(served, request.get("ids"), max_tokens, f"row {row}")
        params = sampling_params(served.engine.vllm, stop_ids, do_sample, temperature, max_tokens, request.get("seed"))
        requests.append({"ids": ids, "params": params, "stop_ids": stop_ids, "max_tokens": max_tokens})
    return requests


async def load_file(served: Served, path: Path, body: dict) -> dict:
    """A pushed safetensors file loaded into the engine (vLLM's in-place reload, reading it mapped
    in memory), then removed."""

    def load(llm) -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": file_tensors(path),
                                                     "is_checkpoint_format": True})

    return await served.engine.load({"load": load, "run": body.get("run"), "version": body.get("version"),
                                     "probe_ids": body.get("probe_ids"),
                                     "cleanup": lambda: path.unlink(missing_ok=True)},
                                    float(body.get("timeout") or DEFAULT_WAIT))


def file_tensors(path: Path):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as weights:
        for name in weights.keys():
            yield name, weights.get_tensor(name)


def make_drop_box() -> tuple[Path, str]:
    """A folder in shared memory (/dev/shm where there is one) that trainers on this machine write
    pushed weights into, and the token it holds: a trainer that reads it there sees this folder."""
    import tempfile

    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    box = Path(tempfile.mkdtemp(prefix="ppo-rlhf-serve-", dir=root))
    token = uuid.uuid4().hex
    (box / "token").write_text(token)
    return box, token

