"""TRL 1.16's GRPOTrainer with a tool (``tools=[calculator]``), for ``benchmarks/bench_agents.py peers``.

Runs in its own virtual environment (`.venv-trl116`, `make trl116-venv`).  It imports the
benchmark's pure-Python tool and reward (benchmarks/agents_tools.py, which reads
``ppo_rlhf.rewards`` from src/: the standard library and yaml only), so both systems call the same
calculator and score with the same check.

    .venv-trl116/bin/python benchmarks/peers/trl_tools.py --settings RUN.json

``bench_agents_latency.py trl`` runs it with the calculator served over HTTP after a wait (settings
``"tool": "http"`` or ``"http-async"``: the sync or the async client; ``"every_turn_calls": true``
reads a calculator call in every turn, as ppo-rlhf's side does with that benchmark's parser).

The model is the benchmark's SFT warm-up, its tokenizer given TRL's Qwen 2.5 chat template (the one
TRL parses tool calls from; ppo-rlhf's side renders with the same file) and TRL's response parser.
Each iteration is one generation batch (K samples of B/K prompts, tool calls run between turns)
and its optimizer step; a callback times it (wall and process CPU seconds) and the LoRA adapter is
saved at the end, for ppo-rlhf's ``eval`` to score on the held-out problems as it scores its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # agents_tools
sys.path.insert(0, str(HERE.parents[1] / "src"))  # ppo_rlhf.rewards, for the shared check


def tool(settings: dict):
    """The calculator the settings name: the local function (``calculator``, the default), or the one
    served over HTTP by benchmarks/bench_agents_latency.py through its sync client (``http``) or its
    async one (``http-async``), each with the calculator's name, signature and docstring."""
    chosen = settings.get("tool", "calculator")
    if chosen == "http":
        import agents_http

        return agents_http.calculator
    if chosen == "http-async":
        import agents_http_async

        return agents_http_async.calculator
    import agents_tools

    return agents_tools.calculator


def every_turn_calls() -> None:
    """One calculator call read in every turn, as ppo-rlhf's side reads it with
    ``--tool-parser agents_http.py:calls_calculator`` (``bench_agents_latency.py trl --calls
    every-turn``): TRL's response parser, wrapped where the trainer calls it, keeps the model's text
    and adds the call, so every episode plays its turns and makes its calls whatever it wrote."""
    from trl.trainer import grpo_trainer

    parse = grpo_trainer.parse_response

    def parse_with_a_call(*args, **kwargs):
        message = parse(*args, **kwargs)
        call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "347 * 29"}}}
        return {**message, "tool_calls": [call]}

    grpo_trainer.parse_response = parse_with_a_call


def train_and_record(trainer, tokenizer, out: Path, **fields) -> None:
    """Train, timing each optimizer step (wall and CPU seconds) into out/metrics.jsonl; save the
    adapter; write out/result.json with the versions, TRL's own training log and ``fields``."""
    import peft
    import transformers
    import trl
    from transformers import TrainerCallback

    log = open(out / "metrics.jsonl", "w")

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            wall, cpu = time.perf_counter() - self.last, time.process_time() - self.last_cpu
            log.write(json.dumps({"iteration": state.global_step, "time/iteration": wall, "cpu/iteration": cpu}) + "\n")
            log.flush()
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

    trainer.add_callback(Timer())
    trainer.train()
    log.close()
    trainer.model.save_pretrained(out / "adapter")
    tokenizer.save_pretrained(out / "adapter")
    history = [h for h in trainer.state.log_history if "reward" in h]
    (out / "result.json").write_text(json.dumps({
        "system": "trl", **fields,
        "versions": {"torch": str(torch.__version__), "transformers": transformers.__version__,
                     "trl": trl.__version__, "peft": peft.__version__},
        "train_log": [{k: h[k] for k in ("step", "reward", "kl", "completions/mean_length", "tools/call_frequency",
                                         "tools/failure_frequency") if k in h} for h in history],
    }, indent=2, default=str) + "\n")


def quiet_trl() -> None:
    """Before TRL is imported: no tokenizer threads, no notices of experimental features (TRL 1.16's
    environment_factory is one) or UserWarnings."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    warnings.filterwarnings("ignore", category=UserWarning)


def grpo_trainer(settings: dict, **tools):
    """TRL's GRPOTrainer on the settings' SFT warm-up, prompts and work (K, batch, tokens, turns, lr,
    beta), LoRA as ppo-rlhf's defaults, the calculator's answer check as the reward; ``tools``:
    ``tools=[...]`` or ``environment_factory=...``.  Returns the trainer and its tokenizer."""
    quiet_trl()
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import add_response_schema

    import agents_tools

    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(settings["threads"])
    work = settings["work"]
    rows = [json.loads(line) for line in Path(settings["prompts"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(settings["model"])
    tokenizer.chat_template = Path(settings["chat_template"]).read_text()
    tokenizer = add_response_schema(tokenizer)
    config = GRPOConfig(
        output_dir=str(out / "trl"), seed=settings["seed"], report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, bf16=False, fp16=False, disable_dropout=True, dataloader_num_workers=0,
        shuffle_dataset=False, remove_unused_columns=False,
        num_generations=work["k"], per_device_train_batch_size=work["batch_size"], gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=1, max_steps=settings["iterations"],
        max_completion_length=work["max_episode_tokens"], max_tool_calling_iterations=work["max_turns"] - 1,
        temperature=work["temperature"], top_p=1.0, top_k=0, learning_rate=work["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_epsilon=1e-8, max_grad_norm=1.0, beta=work["beta"], epsilon=0.2,
        loss_type="grpo", scale_rewards="group", mask_truncated_completions=False, log_completions=False,
        gradient_checkpointing=True)  # GRPOConfig's own default: stated, as it costs time
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=agents_tools.answer_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, **tools)
    return trainer, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", required=True)
    settings = json.loads(Path(parser.parse_args().settings).read_text())
    quiet_trl()
    if settings.get("every_turn_calls"):
        every_turn_calls()
    trainer, tokenizer = grpo_trainer(settings, tools=[tool(settings)])
    train_and_record(trainer, tokenizer, Path(settings["out"]))


if __name__ == "__main__":
    main()
