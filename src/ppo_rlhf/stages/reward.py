"""``ppo-rlhf rm``: train a reward model (pairwise Bradley-Terry or classification).

Run folder:
    OUT/config.yaml, metrics.jsonl, tb/, curves.png, summary.json
    OUT/checkpoints/reward/  the trained classifier (with --lora: a peft folder, adapter + score head)
    OUT/checkpoints/last/    resumable state, rewritten atomically every --save-every steps
"""

from __future__ import annotations

import time
from pathlib import Path

from ppo_rlhf.config import to_dict
from ppo_rlhf.data import drop_rows, load_rows
from ppo_rlhf.formats import preference_rows
from ppo_rlhf.models import build_sequence_classifier, load_tokenizer, save_pretrained_atomic
from ppo_rlhf.models.loading import (POLICY_CHECKPOINTS, check_tokenizer, from_pretrained, refuse_adapter,
                                    require_model_folder)
from ppo_rlhf.models.lora import save_adapter, with_adapter
from ppo_rlhf.distributed import on_main_process
from ppo_rlhf.sharding import whole_weights
from ppo_rlhf.run_folder import start_run_folder
from ppo_rlhf.runlog import open_run_log
from ppo_rlhf.stages.common import load_task, open_resumable_stage, seed_everything, set_threads
from ppo_rlhf.trainers.guard import require_finite
from ppo_rlhf.trainers.resume import open_checkpoints
from ppo_rlhf.trainers.reward import RewardConfig, train_reward_model


def load_classifier_from(path: str, num_labels: int, tokenizer, dtype="auto"):
    """A sequence classifier from a causal LM or classifier folder, with a fresh head of ``num_labels``."""
    from transformers import AutoModelForSequenceClassification

    path = require_model_folder(path, "reward model initialisation")
    # A ValueError: an architecture transformers has no sequence classifier for.
    model = from_pretrained(AutoModelForSequenceClassification, path, f"{path}: transformers cannot build a reward "
                            f"model (a sequence classifier) from this model", num_labels=num_labels,
                            ignore_mismatched_sizes=True, dtype=dtype)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


def pairs_worth_learning(rows: list[dict], config: RewardConfig) -> list[dict]:
    """Pairs without those that teach nothing, each kind counted (data.drop_rows): a reply that is
    empty -- given so, or left so by an implicit prompt that took all of it (one reply a prefix
    of the other) -- and a pair whose two replies are the same."""
    for name in (config.chosen_field, config.rejected_field):
        rows = drop_rows(rows, lambda row: not row[name].strip(),
                         f"have an empty '{name}' reply (as given, or after the prompt the pair shares)", config.data)
    return drop_rows(rows, lambda row: row[config.chosen_field] == row[config.rejected_field],
                     "have the same chosen and rejected response", config.data)


def run_reward(config: RewardConfig) -> dict:
    set_threads(config.num_threads)
    seed_everything(config.seed)
    start = time.perf_counter()
    out = Path(config.out)
    open_resumable_stage(config, out)
    task = load_task(config.task if not config.data else None, config.seed)
    num_labels = 1 if config.mode == "pairwise" else config.num_labels
    refuse_adapter(config.model, "rm")
    if config.model:
        tokenizer = load_tokenizer(config.model, "--model", POLICY_CHECKPOINTS)  # a run folder: its model named
        model = load_classifier_from(config.model, num_labels, tokenizer, config.load_dtype)
        if config.lora:
            # SEQ_CLS: peft trains the new score head in full beside the adapter and saves it with it.
            model = with_adapter(config, model, "SEQ_CLS")
    else:
        tokenizer = task.tokenizer if task is not None else None
        if tokenizer is None:
            raise FileNotFoundError("reward model training from --data needs --model (a folder with the tokenizer)")
        model = build_sequence_classifier(tokenizer, num_labels, config.n_layer, config.n_head, config.n_embd,
                                          dropout=config.dropout, seed=config.seed)
    convert = preference_rows(config.prompt_field, config.chosen_field, config.rejected_field) \
        if config.mode == "pairwise" else None
    rows = load_rows(config.data, config.required_fields, convert, config.data_split) if config.data else task.rm_rows()
    if config.data and config.mode == "pairwise":
        rows = pairs_worth_learning(rows, config)
    check_tokenizer(tokenizer, config.model or f"the {config.task} task", config.chat_template, needs_eos=False)
    for notice in on_main_process(start_run_folder, out, config.overwrite):
        print(notice)
    checkpoints = open_checkpoints(config, out, config.steps, "step")
    run_log = open_run_log(out, to_dict(config), resume_after=checkpoints.step if config.resume else None)
    stored_dtype = model.dtype  # trained in float32, saved as it came in (bf16 in, bf16 out)
    result = train_reward_model(model, tokenizer, rows, config, run_log=run_log, checkpoints=checkpoints)
    # The processes hold the same weights (or, sharded, their parts of them): written once.
    weights = whole_weights(model)  # sharded: gathered, whole on the main process
    on_main_process(require_finite, weights, "the reward model")
    if config.lora:  # a peft folder: PeftModel.from_pretrained(classifier of the base, folder); float32 as trained
        checkpoint = on_main_process(save_adapter, model, model.active_adapter, out / "checkpoints" / "reward", tokenizer)
    else:
        checkpoint = on_main_process(save_pretrained_atomic, model, tokenizer, out / "checkpoints" / "reward",
                                     weights, stored_dtype)
    run_log.plot(["loss", "train_accuracy"])
    summary = {
        "stage": "reward",
        "mode": config.mode,
        "rows": len(rows),
        "eval_accuracy": result["eval_accuracy"],
        "seconds": round(time.perf_counter() - start, 2),
        "checkpoints": {"reward": str(checkpoint)},
    }
    run_log.write_summary(summary)
    run_log.close()
    return summary
