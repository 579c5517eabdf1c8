"""TRL 1.16's GRPOTrainer with an ``environment_factory`` class, for ``benchmarks/bench_agents.py peers-env``.

Runs in its own virtual environment (`.venv-trl116`, `make trl116-venv`).  It imports the
benchmark's pure-Python environment class and reward (benchmarks/agents_tools.py, which reads
``ppo_rlhf.rewards`` from src/: the standard library and yaml only), so both systems play the same
class and score with the same check.

    .venv-trl116/bin/python benchmarks/peers/trl_env.py --settings RUN.json

``environment_factory`` is the class ``settings["environment"]`` names in agents_tools: TRL makes
one instance per concurrent episode (kept and reset from batch to batch), calls its ``reset`` with
each row's columns, and offers its public methods as the tools; the reward functions get the
instances as ``environments=``.  Everything else is as in trl_tools.py (``peers``): the
benchmark's SFT warm-up, its tokenizer given TRL's Qwen 2.5 chat template (the one TRL parses tool
calls from; ppo-rlhf's side renders with the same file) and TRL's response parser; each iteration
one generation batch (K episodes of B/K prompts) and its optimizer step, timed by a callback (wall
and process CPU seconds); the LoRA adapter saved at the end, for ppo-rlhf's ``eval`` to score on
the held-out problems as it scores its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # agents_tools
sys.path.insert(0, str(HERE.parents[1] / "src"))  # ppo_rlhf.rewards, for the shared check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", required=True)
    settings = json.loads(Path(parser.parse_args().settings).read_text())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # environment_factory is experimental in TRL 1.16
    warnings.filterwarnings("ignore", category=UserWarning)

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import add_response_schema

    import agents_tools
    from trl_tools import train_and_record  # this folder: the script's own, first on sys.path

    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(settings["threads"])
    work = settings["work"]
    environment = getattr(agents_tools, settings["environment"])
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
        gradient_checkpointing=True)  # GRPOConfig's own default, as trl_tools.py runs it: stated, as it costs time
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=agents_tools.answer_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, environment_factory=environment)
    train_and_record(trainer, tokenizer, out, environment=settings["environment"])

if __name__ == "__main__":
    main()
