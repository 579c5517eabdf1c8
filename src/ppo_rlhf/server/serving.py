"""Starting the generation server (docs/design.md, "The generation server"): the served model's
folder checked, its vLLM engine built as the colocated engine is (rollout/vllm_engine.py,
``engine_options``) but with the folder's own weights and tokenizer, the drop box for pushed
weights made, and the routes served until the process is stopped."""

from __future__ import annotations

import shutil
import socket

import torch

from ppo_rlhf.config import ConfigError
from ppo_rlhf.rollout.server_api import model_identity
from ppo_rlhf.rollout.sequences import stop_token_ids
from ppo_rlhf.rollout.vllm_engine import check_architecture, engine_options, import_vllm, start_llm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def serve(model: str, port: int, host: str = "127.0.0.1", name: str | None = None, dtype: str = "float32",
          max_model_len: int | None = None, max_rows: int = 256, memory_utilization: float = 0.1,
          device: str = "auto", seed: int = 0, chat_template_file: str | None = None, tool_parser: str = "auto",
          nccl: bool = False, lease_idle: float = 300.0, ready=print) -> None:
    """Serve ``model`` on ``host:port`` (port 0: a free one) until stopped; ``ready(line)`` is
    called with the line saying where, once the engine is built and the port listens."""
    from transformers import AutoConfig

    from ppo_rlhf.envs.options import apply_chat_template_file
    from ppo_rlhf.models import load_tokenizer
    from ppo_rlhf.server.app import Served, build_app, make_drop_box
    from ppo_rlhf.server.engine import ServedEngine

    vllm = import_vllm("the generation server", "")
    import uvicorn  # (vLLM brings it, and FastAPI)
    where = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                         "cpu" if device == "auto" else device)
    config = AutoConfig.from_pretrained(model)
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ConfigError(f"--model {model}: its config.json names no architecture, so vLLM cannot tell what to build; "
                          f"give a causal LM folder (one a run saved, or a Hub model's)")
    check_architecture(vllm, config, architectures[0], where, who="ppo-rlhf serve", whose=f"{model}'s",
                       instead="serve")
    tokenizer = load_tokenizer(model)
    apply_chat_template_file(tokenizer, chat_template_file)
    text = config.get_text_config()
    positions = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    length = min(max_model_len or positions or 2048, positions or max_model_len or 2048)
    options = engine_options(config, DTYPES[dtype], length, max_rows, memory_utilization, where, seed)
    options.update(model=model, load_format="auto")
    if nccl:
        options.update(weight_transfer_config={"backend": "nccl"})
    llm = start_llm(vllm, options, memory_utilization)
    render = getattr(llm, "_preprocess_cmpl_one", None)  # vLLM's own rendering of a token prompt (vllm_engine.py)

    def engine_input(ids: list[int]):
        prompt = {"prompt_token_ids": ids}
        return render(prompt) if render is not None else prompt

    box, token = make_drop_box()
    try:
        served = Served(ServedEngine(vllm, llm, engine_input, lease_idle), name or model, tokenizer,
                        model_identity(config, tokenizer), dtype, length, max_rows,
                        stop_token_ids(tokenizer, _GenerationConfig(model)), box, token,
                        ["shared-memory", "http"] + (["nccl"] if nccl else []), tool_parser=tool_parser,
                        chat_template=chat_template_file)
        listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listening.bind((host, port))
        except OSError as error:
            raise ConfigError(f"--port {port}: cannot listen on {host}:{port} ({error.strerror}); give another port, "
                              f"or 0 for a free one") from None
        listening.listen(256)  # connections wait in the backlog until the server accepts them
        address = f"http://{host}:{listening.getsockname()[1]}"
        # Trainers keep their connections between rollouts (an update takes a while): kept open 10 minutes.
        server = uvicorn.Server(uvicorn.Config(build_app(served), log_level="warning", lifespan="on",
                                               timeout_keep_alive=600))
        ready(f"ppo-rlhf serve: {served.name} ({architectures[0]}, {dtype}, up to {length} tokens, {max_rows} "
              f"sequences at once) ready at {address}")
        server.run(sockets=[listening])
    finally:
        shutil.rmtree(box, ignore_errors=True)
        llm.llm_engine.engine_core.shutdown()


class _GenerationConfig:
    """A stand-in model for ``stop_token_ids``: the folder's generation config (its end-of-turn ids)."""

    def __init__(self, model: str):
        from transformers import GenerationConfig

        try:
            self.generation_config = GenerationConfig.from_pretrained(model)
        except OSError:  # no generation_config.json: the model config's own eos_token_id
            from transformers import AutoConfig

            self.generation_config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model))
