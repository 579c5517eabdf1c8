"""The actor's weights to a generation server after each update (docs/design.md, "The generation
server"): the policy as the colocated engine receives it (``policy_weights``: named as in the
checkpoint, a LoRA adapter merged in float32 and rounded once to the engine's dtype), written one
tensor at a time as a safetensors file and loaded by the server's in-place reload, by one of:

- ``shared-memory``: the file written into the server's drop box, a folder in /dev/shm the server
  made at start (on the same machine: no copy over a socket), and its name posted;
- ``http``: the same bytes streamed in the body of one POST (a server on another machine);
- ``nccl``: on GPUs, vLLM's own NCCL weight transfer (TRL 1.16's way: the trainer as rank 0 of a
  group with the server's workers, each tensor broadcast), for a server started with
  ``--weight-transfer nccl``.

``auto`` takes shared memory where this process can see the server's drop box (the token file
the server wrote there holds the token it announced), else http."""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path

import torch

from ppo_rlhf.rollout.engine_weights import policy_layout, policy_weights

TRANSFERS = ("auto", "shared-memory", "http", "nccl")
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def safetensors_header(layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The header of a safetensors file holding ``layout``'s tensors in its order: the length, then
    the JSON naming each tensor's dtype, shape and byte range."""
    entries, offset = {}, 0
    for name, dtype, shape in layout:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


@torch.no_grad()
def policy_chunks(model, dtype: torch.dtype):
    """The policy as safetensors bytes: the header, then each tensor's (one merged weight exists at
    a time).  What the header says is checked against what comes, tensor by tensor."""
    layout = policy_layout(model, dtype)
    yield safetensors_header(layout)
    for (name, tensor), (declared, declared_dtype, shape) in zip(policy_weights(model, dtype), layout, strict=True):
        if name != declared or tensor.dtype != declared_dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(f"the policy's tensor {name} ({tensor.dtype}, {tuple(tensor.shape)}) is not what the "
                               f"file's header says ({declared}, {declared_dtype}, {shape})")
        yield tensor_bytes(tensor)


def write_policy_file(model, dtype: torch.dtype, folder: str | Path, stem: str) -> Path:
    """The policy written to ``folder/stem.safetensors`` (written aside, then renamed: the server
    never reads half a file); its path."""
    final = Path(folder) / f"{stem}.safetensors"
    partial = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(partial, "wb") as out:
            for chunk in policy_chunks(model, dtype):
                out.write(chunk)
        os.replace(partial, final)
    finally:
        partial.unlink(missing_ok=True)
    return final


def sees_drop_box(info: dict) -> bool:
    """Whether this process can write into the server's drop box: the folder it named holds the
    token it announced (a server on another machine names a folder that is not here, or not its)."""
    box, token = info.get("drop_box"), info.get("drop_token")
    if not box or not token:
        return False
    try:
        return (Path(box) / "token").read_text() == token and os.access(box, os.W_OK)
    except OSError:
        return False


def transfer_for(asked: str, info: dict, url: str) -> str:
    """The transfer a push to this server takes: ``asked``, where the server can take it (auto:
    shared memory where its drop box is visible here, else http); a ValueError saying why not."""
    offered = info.get("weight_transfers", ["shared-memory", "http"])
    if asked == "auto":
        return "shared-memory" if sees_drop_box(info) else "http"
    if asked == "shared-memory" and not sees_drop_box(info):
        raise ValueError(f"--weight-transfer shared-memory: the server at {url} keeps its drop box in "
                         f"{info.get('drop_box')}, which this process cannot see (a server on another machine, or "
                         f"in another container); use --weight-transfer http or auto")
    if asked not in offered:
        how = " (start it with ppo-rlhf serve --weight-transfer nccl, on a GPU)" if asked == "nccl" else ""
        raise ValueError(f"--weight-transfer {asked}: the server at {url} takes {', '.join(offered)}{how}")
    return asked


class NcclPush:
    """The trainer's end of vLLM's NCCL weight transfer with one server (TRL 1.16's
    ``WeightTransferClient``): rank 0 of a group whose other ranks are the server's workers, set up
    once (the server's workers join through its ``nccl-init`` route, called on a thread while this
    side opens its endpoint: both must meet), then each push broadcasts the policy tensor by tensor
    while the server's engine receives it (its ``nccl`` route, on a thread).  Needs vLLM and CUDA in
    the trainer's process; not run on this project's CPU-only machine (docs/design.md)."""

    def __init__(self, connection, info: dict, model, dtype: torch.dtype, timeout: float):
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine
        from vllm.utils.network_utils import get_ip, get_open_port

        self.connection, self.timeout = connection, timeout
        init = NCCLTrainerInitInfo(master_address=get_ip(), master_port=get_open_port(),
                                   world_size=int(info.get("world_size", 1)) + 1)
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(init, client=self,
                                                                   source=policy_source(model, dtype))
        self.pending: dict = {}  # the push in progress: its version and probe, for the update's call
        self.answer: dict | None = None

    # The four calls vLLM's trainer engine makes of the inference side (VLLMWeightSyncClient).
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.connection.call("POST", "/ppo-rlhf/weights/nccl-init", {"init_info": init_info}, timeout=self.timeout,
                             what="the NCCL group's setup")

    def start_weight_update(self) -> None:
        """Nothing here: the server starts, receives and finishes in one call (``update_weights``),
        once no rollout holds its weights."""

    def update_weights(self, update_info: dict) -> None:
        self.answer = self.connection.call("POST", "/ppo-rlhf/weights/nccl", {"update_info": update_info,
                                                                               **self.pending},
                                           timeout=self.timeout, what="an NCCL weight push")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass

    def push(self, request: dict) -> dict:
        """The policy broadcast to the server's workers; the server's answer (its load's seconds
        and probe)."""
        self.pending = request
        self.engine.send_weights()
        return self.answer


def policy_source(model, dtype: torch.dtype):
    """vLLM's ``WeightSource`` over ``policy_weights``: the metadata from ``policy_layout``, each
    tensor on the actor's device (a class made here: vLLM is imported only for an NCCL push)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Source(WeightSource):
        def metadata(self):
            return [ParamMeta(name, each_dtype, shape) for name, each_dtype, shape in policy_layout(model, dtype)]

        def __iter__(self):
            return iter(policy_weights(model, dtype))

    return Source()
