"""TRL 1.16's GRPOTrainer on a reasoning-gym task, for benchmarks/bench_peers_grpo.py.

Runs in its own virtual environment (`.venv-trl116`: torch 2.13.0, trl 1.16.0, peft, reasoning-gym;
`make trl116-venv`).  It imports one pure-Python piece of ppo-rlhf: `ppo_rlhf.tasks.reasoning_gym`
(with `ppo_rlhf.rewards` and `ppo_rlhf.config`: the standard library, yaml and reasoning-gym
only), so the reward is ppo-rlhf's own code: the task's `score_answer` on the extracted answer,
plus the format reward.  `src/` goes on sys.path here, for that import only; no torch or
transformers code of ppo-rlhf runs in this process.

    .venv-trl116/bin/python benchmarks/peers/trl_grpo.py check --settings CHECK.json
    .venv-trl116/bin/python benchmarks/peers/trl_grpo.py train --settings RUN.json

`check` writes, for the benchmark to compare with ppo-rlhf's: the logits of the model loaded as
GRPOTrainer loads it on the given right-padded ids, the ids TRL's prompt tokenisation gives the
prompt strings, and this side's reward of the given responses.

`train --trainer ppo_rlhf.trl` runs the same script with its trainer and config imported from
ppo_rlhf.trl instead of trl (TRL's signatures over ppo-rlhf's trainer, docs/migrating_from_trl.md),
under ppo-rlhf's own environment: the script is TRL's in both, only the import differs.

`train` is `GRPOTrainer.train()` on the benchmark's prompt file: the rows in the order ppo-rlhf
draws them for the same seed (`shuffle_dataset=False`, so TRL's RepeatSampler takes them in
turn), each repeated num_generations times.  A callback times each iteration (one generation
batch and its optimizer steps; wall and process CPU seconds) and saves the LoRA adapter every `save_every` iterations outside
the timing; metrics.jsonl gets the wall seconds of each.
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

SRC = Path(__file__).resolve().parents[2] / "src"


def task_module():
    """ppo-rlhf's reasoning-gym task code (pure Python: no torch, no transformers)."""
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    import ppo_rlhf.tasks.reasoning_gym as module

    return module


def make_task(settings: dict):
    module = task_module()
    task = settings["task"]
    return module.make_task(task["name"], task["size"], task["eval_size"], task["seed"],
                            module.parse_task_config(task["config"]), task["format_reward"], task.get("exact", False))


def reward_function(task, seen: list | None = None):
    """The reward as ppo-rlhf computes it for --task reasoning-gym:NAME (ReasoningGymTask.rule_reward),
    in TRL's calling convention; ``seen`` collects each call's task indices."""

    def task_reward(prompts, completions, task_index, **kwargs):
        if seen is not None:
            seen.append(list(task_index))
        return task.rule_reward(prompts, completions, task_index)

    return task_reward


def load_model(folder: str):
    """The policy as GRPOTrainer loads a model given by name: AutoModelForCausalLM, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def check(settings: dict) -> None:
    from transformers import AutoTokenizer

    inputs = torch.load(settings["inputs"])
    model = load_model(settings["model"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(settings["model"])
    with torch.no_grad():  # TRL's forward: input ids and mask, no position ids (right padding: the same positions)
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    prompt_ids = tokenizer(text=inputs["prompts"])["input_ids"]  # GRPOTrainer._tokenize_prompts, string prompts
    task = make_task(settings)
    rewards = reward_function(task)(inputs["prompts"], inputs["responses"], inputs["task_index"])
    import peft
    import transformers
    import trl

    torch.save({"logits": logits, "prompt_ids": prompt_ids, "rewards": rewards,
                "versions": {"torch": str(torch.__version__), "transformers": transformers.__version__,
                             "trl": trl.__version__, "peft": peft.__version__}}, settings["out"])


TRAINERS = ("trl", "ppo_rlhf.trl")  # where GRPOConfig and GRPOTrainer come from: TRL, or TRL's API over ppo-rlhf


def trainer_module(name: str):
    """The module ``GRPOConfig`` and ``GRPOTrainer`` are imported from (the script's one difference)."""
    import importlib

    if name == "ppo_rlhf.trl" and str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    return importlib.import_module(name)


def grpo_config(settings: dict, out: Path):
    GRPOConfig = trainer_module(settings.get("trainer", "trl")).GRPOConfig

    work = settings["work"]
    steps_per_generation = work["batch_size"] // work["mini_batch_size"]
    return GRPOConfig(
        output_dir=str(out / "trl"), seed=settings["seed"], report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, bf16=False, fp16=False, gradient_checkpointing=False, disable_dropout=True,
        dataloader_num_workers=0, shuffle_dataset=False, remove_unused_columns=False,
        # the same work: K samples of batch_size / K prompts per generation; mini_batch_size sequences per
        # optimizer step (no accumulation); ppo_epochs passes over the generation batch
        num_generations=work["k"], per_device_train_batch_size=work["mini_batch_size"], gradient_accumulation_steps=1,
        steps_per_generation=steps_per_generation, num_iterations=work["ppo_epochs"],
        max_steps=settings["iterations"] * steps_per_generation * work["ppo_epochs"],
        max_completion_length=work["max_new_tokens"], temperature=work["temperature"], top_p=1.0, top_k=0,
        learning_rate=work["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_epsilon=1e-8, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=work["max_grad_norm"],
        beta=work["beta"], epsilon=work["clip_ratio"], loss_type="grpo", scale_rewards="group",
        mask_truncated_completions=False, log_completions=False,
    )


def train(settings: dict) -> None:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    GRPOTrainer = trainer_module(settings.get("trainer", "trl")).GRPOTrainer

    out = Path(settings["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(settings["threads"])
    warnings.filterwarnings("ignore", category=UserWarning)
    work = settings["work"]
    task = make_task(settings)
    rows = [json.loads(line) for line in Path(settings["prompts"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "task_index": r["task_index"]} for r in rows])
    seen: list = []
    lora = work["lora"]
    peft_config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                             target_modules=lora["target_modules"], task_type="CAUSAL_LM")
    config = grpo_config(settings, out)
    tokenizer = AutoTokenizer.from_pretrained(settings["model"])
    trainer = GRPOTrainer(model=load_model(settings["model"]), reward_funcs=reward_function(task, seen), args=config,
                          train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config)
    steps_per_iteration = config.steps_per_generation * config.num_iterations
    iterations, save_every = settings["iterations"], settings["save_every"]
    log = open(out / "metrics.jsonl", "w")

    def save(iteration: int) -> None:
        trainer.model.save_pretrained(out / "policies" / f"{iteration:05d}")

    class Timer(TrainerCallback):
        """Wall seconds of each iteration: from the end of the previous one (or the start of
        training) to the end of its last optimizer step; saving happens outside."""

        def on_train_begin(self, args, state, control, **kwargs):
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % steps_per_iteration:
                return
            wall, cpu = time.perf_counter() - self.last, time.process_time() - self.last_cpu
            iteration = state.global_step // steps_per_iteration
            log.write(json.dumps({"iteration": iteration, "time/iteration": wall, "cpu/iteration": cpu,
                                  "update_steps": steps_per_iteration}) + "\n")
            log.flush()
            if iteration % save_every == 0 or iteration == iterations:
                save(iteration)
            self.last, self.last_cpu = time.perf_counter(), time.process_time()

    trainer.add_callback(Timer())
    save(0)
    trainer.train()
    log.close()
    import peft
    import transformers

    trainer_name = settings.get("trainer", "trl")
    version = (__import__("trl").__version__ if trainer_name == "trl" else "ppo_rlhf.trl (no trl installed)")
    history = [h for h in trainer.state.log_history if "reward" in h]
    (out / "result.json").write_text(json.dumps({
        "system": "trl" if trainer_name == "trl" else "ppo-rlhf.trl", "threads": torch.get_num_threads(),
        "first_batch_task_indices": seen[0] if seen else None,
        "task_indices": seen,  # of every generation batch, in the order the reward saw them
        "versions": {"torch": str(torch.__version__), "transformers": transformers.__version__,
                     "trl": version, "peft": peft.__version__},
        "trl_config": {k: v for k, v in config.to_dict().items() if k in (
            "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "num_iterations", "max_steps", "max_completion_length", "temperature", "top_p",
            "top_k", "learning_rate", "lr_scheduler_type", "weight_decay", "adam_epsilon", "max_grad_norm", "beta",
            "epsilon", "epsilon_high", "loss_type", "scale_rewards", "mask_truncated_completions", "disable_dropout",
            "optim", "shuffle_dataset", "seed", "gradient_checkpointing", "activation_checkpointing", "bf16")},
        "lora": {"r": peft_config.r, "lora_alpha": peft_config.lora_alpha, "lora_dropout": peft_config.lora_dropout,
                 "target_modules": sorted(peft_config.target_modules) if isinstance(peft_config.target_modules, set)
                 else peft_config.target_modules},
        "train_log": [{k: h[k] for k in ("step", "reward", "kl", "completions/mean_length", "loss") if k in h}
                      for h in history],
    }, indent=2, default=str) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("check", "train"))
    parser.add_argument("--settings", required=True)
    parser.add_argument("--trainer", choices=TRAINERS, default="trl",
                        help="where GRPOConfig and GRPOTrainer come from (default: TRL)")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = {**json.loads(Path(args.settings).read_text()), "trainer": args.trainer}
    check(settings) if args.command == "check" else train(settings)


if __name__ == "__main__":
    main()
