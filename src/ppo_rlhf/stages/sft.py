"""``ppo-rlhf sft``: supervised fine-tuning, from a model folder or a tiny model built for the task.

Run folder:
    OUT/config.yaml, metrics.jsonl, tb/, curves.png, summary.json
    OUT/checkpoints/sft/    the trained model, a standard causal-LM folder (with tokenizer); with
                            --lora, the adapter (a peft folder that names its base)
    OUT/checkpoints/last/   resumable state, rewritten atomically every --save-every steps
"""

from __future__ import annotations

import time
from pathlib import Path

from ppo_rlhf.config import ConfigError, recipe_line, to_dict
from ppo_rlhf.data import DataError, load_rows, prompt_check, row_complaint, text
from ppo_rlhf.envs.options import apply_chat_template_file
from ppo_rlhf.evaluation import Evaluator
from ppo_rlhf.formats import CONVERSATION, completion_rows
from ppo_rlhf.models import build_causal_lm, load_causal_lm, load_tokenizer, save_pretrained_atomic
from ppo_rlhf.models.loading import check_fits, check_tokenizer, refuse_adapter
from ppo_rlhf.models.lora import save_adapter, with_adapter
from ppo_rlhf.rollout.sequences import stop_token_ids
from ppo_rlhf.distributed import is_main_process, on_main_process
from ppo_rlhf.sharding import whole_weights
from ppo_rlhf.run_folder import start_run_folder
from ppo_rlhf.runlog import open_run_log
from ppo_rlhf.stages.common import load_task, open_resumable_stage, seed_everything, set_threads
from ppo_rlhf.trainers.guard import require_finite
from ppo_rlhf.trainers.resume import open_checkpoints
from ppo_rlhf.trainers.sft import HeldOutLoss, SFTConfig, fit_rows, split_held_out, token_counts, train_sft


def run_sft(config: SFTConfig) -> dict:
    set_threads(config.num_threads)
    seed_everything(config.seed)
    start = time.perf_counter()
    out = Path(config.out)
    open_resumable_stage(config, out)
    if config.data and not config.model:
        raise ConfigError(f"--data {config.data} needs --model DIR: without it sft trains the built-in "
                          f"{config.task} task's tiny model, whose tokenizer knows only that task's characters")
    # A user's model trained on the user's data: the built-in task has nothing to add (its
    # held-out prompts and metric mean nothing to that model).  Without --model, the task still
    # supplies the tokenizer of the model built from scratch.
    task = None if (config.model and config.data) else load_task(config.task, config.seed)
    refuse_adapter(config.model, "sft")
    if config.model:
        # The model before its tokenizer: a folder of the wrong kind is then named as such.
        model, tokenizer = load_causal_lm(config.model, config.load_dtype), load_tokenizer(config.model)
        if config.lora:
            model = with_adapter(config, model, "CAUSAL_LM")
    else:
        tokenizer = task.tokenizer
        model = build_causal_lm(tokenizer, config.n_layer, config.n_head, config.n_embd, dropout=config.dropout, seed=config.seed)
    apply_chat_template_file(tokenizer, config.chat_template_file)
    check_tokenizer(tokenizer, config.model or f"the {config.task} task", config.chat_template)
    if config.data:
        rows = load_rows(config.data, convert=completion_rows(config.prompt_field, config.completion_field,
                                                               config.chat_template), split=config.data_split)
        check_sft_rows(rows, config)
        rows, longest = fit_rows(tokenizer, rows, config, stop_token_ids(tokenizer, model))
        check_fits(model, tokenizer, longest, config.model, f"--max-length {config.max_length}")
    else:
        rows = task.sft_rows()
    rows, evaluator = sft_evaluator(config, task, model, tokenizer, rows)
    for notice in on_main_process(start_run_folder, out, config.overwrite):
        print(notice)
    if config.recipe and is_main_process():
        print(f"ppo-rlhf sft: recipe {recipe_line(config)}")
    checkpoints = open_checkpoints(config, out, config.steps, "step")
    run_log = open_run_log(out, to_dict(config), resume_after=checkpoints.step if config.resume else None)
    stored_dtype = model.dtype  # trained in float32, saved as it came in (bf16 in, bf16 out)
    evaluations = train_sft(model, tokenizer, rows, config, run_log=run_log, evaluator=evaluator,
                            checkpoints=checkpoints)
    # The processes hold the same weights (or, sharded, their parts of them): written once.
    weights = whole_weights(model)  # sharded: gathered, whole on the main process
    on_main_process(require_finite, weights, "the SFT model")
    if config.lora:  # an adapter folder: PeftModel.from_pretrained(base, folder); float32 as trained
        checkpoint = on_main_process(save_adapter, model, model.active_adapter, out / "checkpoints" / "sft", tokenizer)
    else:
        checkpoint = on_main_process(save_pretrained_atomic, model, tokenizer, out / "checkpoints" / "sft",
                                     weights, stored_dtype)
    run_log.plot(["loss", "eval/loss", "eval/token_accuracy", "eval/exact_match", "eval/value_correct",
                  "eval/style_correct", "lr"])
    summary = {
        "stage": "sft",
        "rows": len(rows),
        **(token_counts(rows) if config.data else {}),
        "seconds": round(time.perf_counter() - start, 2),
        "final_eval": evaluations[-1] if evaluations else None,
        "checkpoints": {"sft": str(checkpoint)},
    }
    run_log.write_summary(summary)
    run_log.close()
    return summary


def check_sft_rows(rows: list[dict], config: SFTConfig) -> None:
    """DataError naming the row: a prompt and completion whose fields are not what sft reads, or a
    conversation without --chat-template (only the template can render it)."""
    checks = {config.prompt_field: prompt_check(config.chat_template), config.completion_field: text}
    for row in rows:
        if CONVERSATION not in row:
            complaint = row_complaint(row, checks)
        elif not config.chat_template:
            complaint = ("holds a conversation (chat messages): add --chat-template to render it with the "
                         "tokenizer's chat template")
        else:
            continue
        if complaint:
            raise DataError(f"{row.get('_source', 'a row')}: {complaint}")


def sft_evaluator(config: SFTConfig, task, model, tokenizer, rows: list[dict]) -> tuple[list[dict], object]:
    """(the rows to train on, the evaluator): the task's held-out prompts and metric, or on a
    user's data the completion loss of --eval-fraction of the rows, held out (None: no evaluation)."""
    if task is not None:
        return rows, Evaluator(tokenizer, task.eval_rows(), task.metric, max_prompt_length=task.max_prompt_length,
                               max_new_tokens=task.max_new_tokens)
    if config.eval_fraction > 0:
        rows, held_out = split_held_out(rows, config.eval_fraction, config.seed)
        if held_out:
            print(f"sft: {len(held_out)} of the rows held out for the held-out loss (--eval-fraction)")
            return rows, HeldOutLoss(tokenizer, held_out, config, stop_token_ids(tokenizer, model))
    return rows, None
