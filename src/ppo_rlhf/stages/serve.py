"""``ppo-rlhf serve``: a generation server on vLLM, in a process of its own (docs/design.md, "The
generation server").  Trainers take rollouts from it (``--rollout-engine vllm-server --server-url
URL``) and push their weights to it after each update; agents call it as an OpenAI endpoint.  It
runs until stopped (Ctrl-C, SIGTERM)."""

from __future__ import annotations

from dataclasses import dataclass

from ppo_rlhf.config import ENGINE, HARDWARE, MODEL_DATA, ROLLOUT, RUN, SEEDS, THREADS, above, between, check, option

SERVE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ServeConfig:
    # --- model and data
    model: str | None = option(None, "the causal LM folder to serve (its weights until a trainer pushes its own; "
                                     "its tokenizer and chat template for the OpenAI routes)", group=MODEL_DATA,
                               first=True)
    served_model_name: str | None = option(None, "the model's name in the OpenAI routes (empty: --model as given)",
                                           group=MODEL_DATA)
    chat_template_file: str | None = option(None, "a Jinja chat template for /v1/chat/completions instead of the "
                                                  "tokenizer's (the trainer's --chat-template-file, where it has one)",
                                            group=MODEL_DATA)
    tool_parser: str = option("auto", "how /v1/chat/completions reads tool calls from what the model wrote, when the "
                                      "request lists tools: auto (from the chat template), hermes, llama3-json, "
                                      "gpt-oss, or module:function", group=MODEL_DATA)

    # --- rollout
    max_model_len: int | None = option(None, "the longest prompt + response in tokens (empty: the model's positions)",
                                       range=above(1), group=ROLLOUT, first=True)
    max_rows: int = option(256, "the most sequences generated at once (vLLM's max_num_seqs; the rest wait)",
                           range=above(0), group=ROLLOUT)

    # --- rollout engine
    dtype: str = option("float32", "the engine's dtype; trainers push their weights in it (float32: the "
                                   "trainer's default --mixed-precision no, as the colocated engine)",
                        choices=SERVE_DTYPES, group=ENGINE, first=True)
    memory_utilization: float = option(0.1, "on a GPU, the share of its memory the engine may take (weights and KV "
                                             "cache); on the CPU, the most of the RAM its KV cache may take",
                                       range=between(0, 1, low_open=True), group=ENGINE)
    nccl_weight_transfer: bool = option(False, "also take weight pushes over NCCL (--weight-transfer nccl: GPUs on "
                                               "both sides, vLLM's weight-transfer engine, as TRL 1.16)", group=ENGINE)
    lease_idle: float = option(300.0, "seconds a rollout's hold on the weights may stay unused (none of its requests "
                                      "running) before it is dropped (its trainer stopped); a push waits for the "
                                      "holds", range=above(0), group=ENGINE)

    # --- hardware
    device: str = option("auto", "where the engine runs: auto (a GPU if there is one), cpu or cuda",
                         choices=("auto", "cpu", "cuda"), group=HARDWARE)
    num_threads: int = option(0, "torch CPU threads of the server's process (0: torch's default)", range=THREADS,
                              group=HARDWARE)

    # --- run folder, evaluation, logging, checkpoints
    port: int = option(8000, "the port to listen on (0: a free one, said at start)", range=between(0, 65535),
                       group=RUN, first=True)
    host: str = option("127.0.0.1", "the address to listen on (0.0.0.0: every interface, for trainers on other "
                                    "machines)", group=RUN)
    seed: int = option(0, "the engine's seed (every request of a trainer brings its own)", range=SEEDS, group=RUN)

    def validate(self) -> None:
        check(self.model is not None, "model", "the folder of the model to serve", self.model)


def run_serve(config: ServeConfig) -> dict:
    from ppo_rlhf.server.serving import serve
    from ppo_rlhf.trainers.common import set_threads

    set_threads(config.num_threads)
    serve(config.model, config.port, host=config.host, name=config.served_model_name, dtype=config.dtype,
          max_model_len=config.max_model_len, max_rows=config.max_rows, memory_utilization=config.memory_utilization,
          device=config.device, seed=config.seed, chat_template_file=config.chat_template_file,
          tool_parser=config.tool_parser, nccl=config.nccl_weight_transfer, lease_idle=config.lease_idle,
          ready=lambda line: print(line, flush=True))
    return {"served": config.model}
