"""Supervised fine-tuning: next-token loss on the completion only.

Rows are ``{prompt, completion}``; the loss covers the completion tokens and the EOS appended
after them (the model must learn to stop), never the prompt or the padding.  A completion that
already ends with a stop id (a chat template's end of turn) gets no EOS after it.  A row may also
be a whole conversation (formats.py, ``Conversation``): rendered by the chat template, the loss on
its assistant turns (trainers/sft_conversations.py).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from tqdm.auto import tqdm

from ppo_rlhf.config import (HARDWARE, MODEL_DATA, RUN, SEEDS, THREADS, UPDATE, above, at_least, between, check,
                             option)
from ppo_rlhf.data import DataError
from ppo_rlhf.distributed import batch_for_rank, is_main_process, split_for_rank, sum_across_processes, sum_gradients, world_size
from ppo_rlhf.envs.chat import qwen3_training_template_path
from ppo_rlhf.envs.options import check_template_file_used
from ppo_rlhf.formats import CONVERSATION
from ppo_rlhf.hardware import HardwareOptions
from ppo_rlhf.interrupts import RunInterrupted, stop_after
from ppo_rlhf.models.loading import check_scratch_model
from ppo_rlhf.models.lora import LoraOptions
from ppo_rlhf.recipes import recipe_names
from ppo_rlhf.run_folder import RunFolderOptions
from ppo_rlhf.trackers import ReportOptions
from ppo_rlhf.rollout.responses import apply_chat_template
from ppo_rlhf.rollout.sequences import stop_token_ids
from ppo_rlhf.sharding import gathered, plain, sharding_from_launch
from ppo_rlhf.trainers.common import prepare_to_train
from ppo_rlhf.trainers.guard import DivergenceGuard
from ppo_rlhf.trainers.optimizer import adamw
from ppo_rlhf.trainers.resume import Checkpoints
from ppo_rlhf.trainers.sft_conversations import conversation_tokens, training_template


@dataclass
class SFTConfig(RunFolderOptions, ReportOptions, LoraOptions, HardwareOptions):
    """``--lora``: train a LoRA adapter on the frozen ``--model``, saved as an adapter folder that
    every stage reads as the base with the adapter merged (a ``ppo --lora`` run on it adapts the
    merged model, whose reference it is)."""

    # --- model and data
    model: str | None = option(None, "causal LM folder to start from; empty: build a tiny GPT-2 for the task",
                               group=MODEL_DATA, first=True)
    data: str | None = option(None, "training rows (JSONL/Parquet/save_to_disk, or a data set's name in the local Hugging "
                                    "Face cache) with prompt and completion, or conversations, or Alpaca rows; empty: "
                                    "the task's", group=MODEL_DATA, first=True)
    task: str = option("doubling", "built-in task that supplies data, tokenizer and metric", choices=("doubling",),
                       group=MODEL_DATA, first=True)
    chat_template: bool = option(False, "format each prompt (a user message, or a list of chat messages) with the "
                                        "tokenizer's chat template; the completion is the assistant's reply",
                                 group=MODEL_DATA)
    chat_template_file: str | None = option(None, "a Jinja chat template to use instead of the tokenizer's (one that "
                                                  "renders tools, for a model whose own does not); saved with the "
                                                  "trained model", group=MODEL_DATA)
    prompt_field: str = option("prompt", "field of the data rows holding the prompt", group=MODEL_DATA)
    completion_field: str = option("completion", "field of the data rows holding the completion to learn",
                                   group=MODEL_DATA)
    max_length: int = option(256, "longest prompt + completion in tokens; longer rows are cut", range=above(1),
                             group=MODEL_DATA)
    data_split: str = option("train", "the split of --data when it names a data set in the local Hugging Face cache",
                             group=MODEL_DATA)
    n_layer: int = option(4, "layers of a model built from scratch", range=above(0), group=MODEL_DATA)
    n_head: int = option(4, "attention heads of a model built from scratch", range=above(0), group=MODEL_DATA)
    n_embd: int = option(64, "width of a model built from scratch", range=above(0), group=MODEL_DATA)
    dropout: float = option(0.1, "dropout of a model built from scratch (GPT-2's default; off in PPO rollouts)",
                            range=between(0, 1, high_open=True), group=MODEL_DATA)

    # --- update and loss
    steps: int = option(1500, "optimizer steps", range=above(0), group=UPDATE, first=True)
    batch_size: int = option(256, "sequences per step", range=above(0), group=UPDATE, first=True)
    lr: float = option(3e-3, "peak learning rate (AdamW), cosine-decayed to min_lr_ratio * lr after warm-up",
                       range=above(0), group=UPDATE, first=True)
    min_lr_ratio: float = option(0.1, "final learning rate as a fraction of the peak", range=between(0, 1),
                                 group=UPDATE)
    warmup_steps: int = option(50, "linear warm-up steps", range=at_least(0), group=UPDATE)
    weight_decay: float = option(0.01, "AdamW weight decay", range=at_least(0), group=UPDATE)
    max_grad_norm: float = option(1.0, "clip the gradient norm to this", range=above(0), group=UPDATE)
    max_bad_steps: int = option(5, "stop after this many steps in a row with a non-finite loss or gradient norm "
                                   "(each is skipped)", range=at_least(1), group=UPDATE)
    recipe: str | None = option(None, "measured settings in place of the defaults (ppo_rlhf/recipes.py, docs/agents.md "
                                      "\"Recipes\"): agents-warm-up (conversations through the chat template: the "
                                      "warm-up before ppo --recipe agents-grpo or agents-ppo); a setting given in "
                                      "--config or by a flag wins over the recipe's; printed at start",
                                choices=(None, *recipe_names("SFTConfig")), group=UPDATE)

    # --- hardware
    num_threads: int = option(0, "torch CPU threads (0: leave torch's default)", range=THREADS, group=HARDWARE)

    # --- run folder, evaluation, logging, checkpoints
    out: str = option("runs/sft", "run folder (checkpoints, metrics, summary)", group=RUN, first=True)
    resume: bool = option(False, "continue the run in --out from OUT/checkpoints/last (its settings must match but "
                                 "for steps, evaluation, saving, the learning rate and threads)",
                          group=RUN, first=True)
    seed: int = option(0, "random seed", range=SEEDS, group=RUN)
    save_every: int = option(500, "write a resumable checkpoint (OUT/checkpoints/last) every N steps and after the "
                                  "last (0: none)", range=at_least(0), group=RUN)
    eval_every: int = option(500, "evaluate on held-out prompts every N steps (0: only at the end)", range=at_least(0),
                             group=RUN)
    eval_fraction: float = option(0.05, "with --data: fraction of the rows held out (never trained on) for the "
                                        "held-out completion loss and next-token accuracy",
                                        range=between(0, 1, high_open=True), group=RUN)
    input_paths: ClassVar[tuple] = ("model", "data", "chat_template_file")
    may_change_on_resume: ClassVar[frozenset] = frozenset({
        "steps", "eval_every", "save_every", "resume", "overwrite", "out", "lr", "num_threads", "max_bad_steps",
        "report_to"})

    def validate(self) -> None:
        self.validate_lora()
        self.validate_hardware()
        check(self.model is not None or not self.lora, "lora", "--lora needs --model (the base to adapt; a model "
                                                               "built from scratch trains in full)", self.lora)
        if sharding_from_launch() is not None:  # an FSDP launch whose settings ppo-rlhf follows
            check(not self.lora, "lora", "off under an FSDP launch (ppo-rlhf shards full fine-tuning; LoRA trains "
                                         "data parallel: configs/accelerate/gpus_ddp.yaml)", self.lora)
        check_scratch_model(self)
        check_template_file_used(self)


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up, then cosine decay from ``peak`` to ``floor * peak``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def padded_examples(token_rows: list[tuple[list[int], list[int]]], max_length: int, pad_id: int):
    """Right-padded (N, L) input ids, attention mask and labels (-100 outside what is learned) of
    each row's (ids, labels), cut to ``max_length``."""
    sequences = [ids[:max_length] for ids, _ in token_rows]
    label_rows = [labels[:max_length] for _, labels in token_rows]
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    labels = torch.full((len(sequences), length), -100, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, (ids, lab) in enumerate(zip(sequences, label_rows)):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        attention_mask[i, : len(ids)] = 1
    return input_ids, attention_mask, labels


def completion_token_rows(tokenizer, prompts: list[str], completions: list[str], add_special_tokens: bool = True,
                          stop_ids: list[int] | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids and the EOS that ends them) of each row, before any cut."""
    eos = tokenizer.eos_token_id
    stop_ids = set([eos] if stop_ids is None else stop_ids)
    prompt_ids = tokenizer(prompts, add_special_tokens=add_special_tokens)["input_ids"] if prompts else []
    completion_ids = tokenizer(completions, add_special_tokens=False)["input_ids"] if completions else []
    # A completion that ends with a stop id (e.g. the template's <end_of_turn>) has ended:
    # generation stops at that token, so an EOS after it is a token the model would never be
    # asked for, and learning it only moves probability onto a second stop.
    return [(p, c + ([] if c and c[-1] in stop_ids else [eos])) for p, c in zip(prompt_ids, completion_ids)]


def _prompts(tokenizer, rows: list[dict], config: SFTConfig) -> list[str]:
    prompts = [r[config.prompt_field] for r in rows]
    # A row's tools (TRL's conversational format): listed by the template, as PPO's episodes list theirs.
    return apply_chat_template(tokenizer, prompts, [r.get("tools") for r in rows]) if config.chat_template else prompts


def sft_token_rows(tokenizer, rows: list[dict], config: SFTConfig, stop_ids: list[int] | None = None
                   ) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) of each row before any cut: a prompt and completion (the prompt through the
    chat template if asked), or a whole conversation rendered by it (trainers/sft_conversations.py)."""
    pairs = [row for row in rows if CONVERSATION not in row]
    completions = iter(completion_token_rows(tokenizer, _prompts(tokenizer, pairs, config),
                                             [r[config.completion_field] for r in pairs],
                                             not config.chat_template, stop_ids))
    template = training_template(tokenizer)
    token_rows = []
    for row in rows:
        if CONVERSATION in row:
            token_rows.append(conversation_tokens(tokenizer, row[CONVERSATION], row.get("_source", "a row"), template))
        else:
            p, target = next(completions)
            token_rows.append((p + target, [-100] * len(p) + target))
    return token_rows


def sft_examples(tokenizer, rows: list[dict], config: SFTConfig, stop_ids: list[int] | None = None):
    """The rows' (input ids, attention mask, labels), prompts through the chat template if asked."""
    return padded_examples(sft_token_rows(tokenizer, rows, config, stop_ids), config.max_length,
                           tokenizer.pad_token_id)


def fit_rows(tokenizer, rows: list[dict], config: SFTConfig, stop_ids: list[int] | None = None
             ) -> tuple[list[dict], int]:
    """The rows that keep a learned token within --max-length, and the longest sequence they
    make.  Says how many rows were cut (what is past --max-length is not learned: a completion's
    end, a conversation's last turns) or dropped (the prompt fills --max-length: nothing to learn
    from, a NaN loss if a batch held only such rows); stops when none is left."""
    token_rows = sft_token_rows(tokenizer, rows, config, stop_ids)
    limit = config.max_length
    first_learned = [next((i for i, label in enumerate(labels) if label != -100), len(labels))
                     for _, labels in token_rows]
    # Each kept row with its tokens and learned tokens within --max-length (the summary's counts).
    kept = [({**row, TOKENS: (min(len(ids), limit), sum(label != -100 for label in labels[:limit]))}, len(ids))
            for row, (ids, labels), first in zip(rows, token_rows, first_learned) if first < limit]
    if not kept:
        raise DataError(f"--max-length {limit}: no row keeps a completion token to learn (the shortest prompt is "
                        f"{min(first_learned)} tokens), so there is nothing left to learn; raise --max-length or "
                        f"shorten the prompts")
    cut = sum(1 for _, length in kept if length > limit)
    if cut or len(kept) < len(rows):
        print(f"--max-length {limit}: {cut} of {len(rows)} rows cut (what is past it is not learned: a completion's "
              f"end, a conversation's last turns), {len(rows) - len(kept)} dropped (the prompt fills it, leaving "
              f"nothing to learn)")
    warn_unstopped_turns(tokenizer, rows, token_rows, stop_ids)
    if any(CONVERSATION in row for row in rows) and training_template(tokenizer) is not None:
        print(f"chat template: Qwen3's writes a turn's think block only while the turn is last, so the conversations "
              f"render with ppo-rlhf's training template ({qwen3_training_template_path()}), which writes it in "
              f"every turn, as episodes do")
    return [row for row, _ in kept], min(limit, max(length for _, length in kept))


TOKENS = "_tokens"  # a row's (tokens, learned tokens) within --max-length, set by fit_rows


def token_counts(rows: list[dict]) -> dict[str, int]:
    """The tokens of ``rows`` (kept by :func:`fit_rows`) and how many of them are learned."""
    return {"tokens": sum(row[TOKENS][0] for row in rows), "trained_tokens": sum(row[TOKENS][1] for row in rows)}


def warn_unstopped_turns(tokenizer, rows: list[dict], token_rows: list, stop_ids: list[int] | None) -> None:
    """Say so when a conversation's trained turn ends with a token that is not a stop id: the model
    learns to end its turns with it, and generation would not stop there."""
    stops = set([tokenizer.eos_token_id] if stop_ids is None else stop_ids)
    for row, (_, labels) in zip(rows, token_rows):
        if CONVERSATION not in row:  # a completion gets an EOS where it does not end with a stop id
            continue
        ends = [labels[t] for t in range(len(labels)) if labels[t] != -100
                and (t + 1 == len(labels) or labels[t + 1] == -100)]
        loose = next((end for end in ends if end not in stops), None)
        if loose is not None:
            print(f"warning: {row.get('_source', 'a row')}: the chat template ends an assistant turn with "
                  f"{tokenizer.decode([loose])!r}, which is not one of the model's stop tokens "
                  f"({', '.join(repr(tokenizer.decode([i])) for i in sorted(stops))}): the model learns to end its "
                  f"turns with it, and generation would not stop there; add its id to the model's "
                  f"generation_config.json eos_token_id")
            return


def completion_loss(model, input_ids, attention_mask, labels) -> torch.Tensor:
    """Mean next-token cross-entropy over the labelled (completion) tokens."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (B, L, V)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def split_held_out(rows: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): ``fraction`` of the rows, drawn with ``seed``, never trained on."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_held_out = int(len(rows) * fraction)
    held_out = set(order[:n_held_out])
    return [r for i, r in enumerate(rows) if i not in held_out], [rows[i] for i in sorted(held_out)]


class HeldOutLoss:
    """The evaluator of SFT on a user's data: completion loss and next-token accuracy on rows
    the training never sees (the built-in task has a metric of its own instead).  Called as the
    task's evaluator is: ``(metrics, samples)``."""

    def __init__(self, tokenizer, rows: list[dict], config: SFTConfig, stop_ids, batch_size: int = 8):
        self.examples = sft_examples(tokenizer, rows, config, stop_ids)  # (N, L) ids, mask, labels
        self.batch_size = batch_size  # small: each batch holds a (b, L, V) logits tensor

    @torch.no_grad()
    def __call__(self, model) -> tuple[dict[str, float], list]:
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        loss_sum, correct, tokens = 0.0, 0, 0
        mine = split_for_rank(list(range(self.examples[0].shape[0])))  # several processes: a part each
        for start in range(0, len(mine), self.batch_size):
            index = torch.tensor(mine[start:start + self.batch_size], dtype=torch.long)
            ids, mask, labels = (t[index].to(device) for t in self.examples)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]  # (b, L-1, V)
            targets = labels[:, 1:]
            counted = targets != -100
            loss_sum += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                          targets.reshape(-1), ignore_index=-100,
                                                          reduction="sum").item()
            correct += ((logits.argmax(dim=-1) == targets) & counted).sum().item()
            tokens += counted.sum().item()
        model.train(was_training)
        loss_sum, correct, tokens = sum_across_processes(torch.tensor([loss_sum, correct, tokens],
                                                                      dtype=torch.float64, device=device)).tolist()
        return {"eval/loss": loss_sum / max(tokens, 1), "eval/token_accuracy": correct / max(tokens, 1)}, []


def train_sft(model, tokenizer, rows: list[dict], config: SFTConfig, run_log=None, evaluator=None, accelerator=None,
              checkpoints: Checkpoints | None = None):
    """Train ``model`` in place, in float32 on the accelerator's device (default: the one
    ``config`` asks for); returns the list of evaluation records.  ``checkpoints``: where to save
    resumable state, and the state a resumed run continues from."""
    accelerator = prepare_to_train(model, config, accelerator, "SFT model")
    # (N, L) ids, mask and labels, kept on the CPU; a batch moves to the device when it is used
    examples = sft_examples(tokenizer, rows, config, stop_token_ids(tokenizer, model))
    trained = [p for p in model.parameters() if p.requires_grad]  # with --lora: the adapter's
    optimizer = adamw(trained, lr=config.lr, weight_decay=config.weight_decay)
    optimizer = accelerator.prepare(optimizer)  # with fp16 autocast: loss scaling
    generator = torch.Generator().manual_seed(config.seed)
    order = torch.randperm(len(rows), generator=generator)
    cursor, evaluations, seconds_before = 0, [], 0.0
    guard = DivergenceGuard(config.max_bad_steps)
    first_step = checkpoints.step if checkpoints is not None else 0
    if first_step:
        saved = checkpoints.restore(model, optimizer, accelerator)
        generator.set_state(saved["order_rng"])
        order, cursor, evaluations, seconds_before = saved["order"], saved["cursor"], saved["evaluations"], saved["seconds"]
        guard.load_state_dict(saved["guard"])
    start = time.perf_counter() - seconds_before
    model.train()
    progress = tqdm(range(first_step, config.steps), desc="sft", mininterval=1.0, disable=not is_main_process())
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config.steps, config.lr, config.warmup_steps, config.min_lr_ratio)
        if cursor + config.batch_size > len(order):  # new epoch, new order
            order, cursor = torch.randperm(len(rows), generator=generator), 0
        batch = order[cursor : cursor + config.batch_size]
        cursor += config.batch_size
        optimizer.zero_grad(set_to_none=True)
        loss = sum_across_processes(backward_batch(model, examples, batch, accelerator))  # the whole batch's loss
        sum_gradients(trained)
        grad_norm = plain(accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm))
        done = step + 1
        guard.step(optimizer, done, accelerator, loss=loss, grad_norm=grad_norm)
        last = done == config.steps
        evaluate_now = evaluator is not None and (last or (config.eval_every and done % config.eval_every == 0))
        if step % 50 == 0 or last or evaluate_now:
            record = {"loss": loss.item(), "grad_norm": float(grad_norm), "lr": optimizer.param_groups[0]["lr"],
                      "skipped_steps": guard.skipped, "seconds": time.perf_counter() - start}
            if evaluate_now:
                metrics = evaluate(evaluator, model, accelerator)
                record.update(metrics)
                evaluations.append({"step": done, **metrics})
            progress.set_postfix(loss=f"{record['loss']:.4f}")
            if run_log is not None:
                run_log.log(done, record)
        stop = stop_after(done, config.steps)  # Ctrl-C: this step's state saved, then the run stops (interrupts.py)
        if checkpoints is not None and (checkpoints.due(done, config.steps) or (stop and checkpoints.every)):
            checkpoints.save(done, model, optimizer, accelerator=accelerator, state={
                "order": order, "cursor": cursor, "order_rng": generator.get_state(), "evaluations": evaluations,
                "seconds": time.perf_counter() - start, "guard": guard.state_dict()})
        if stop:
            raise RunInterrupted(done, "step", checkpoints.saved_step if checkpoints is not None else None)
    model.zero_grad(set_to_none=True)  # the last step's gradients: a model's worth of memory, not needed to save it
    model.eval()
    return evaluations


def backward_batch(model, examples: tuple, batch: torch.Tensor, accelerator) -> torch.Tensor:
    """The backward pass of this process's part of ``batch`` (row indices into the (N, L)
    ``examples``); returns its loss.  Several processes: each part's loss is scaled by its share of
    the batch's completion tokens, so the gradients summed over the processes, and the losses, are
    the whole batch's (docs/design.md, "Scale")."""
    input_ids, attention_mask, labels = examples
    mine = batch_for_rank(batch)
    share = (labels[mine, 1:] != -100).sum().item() / (labels[batch, 1:] != -100).sum().item() \
        if world_size() > 1 else 1.0
    # Trim the rows to their longest: shorter tensors, same loss.
    width = int(attention_mask[mine].sum(dim=1).max())
    inputs = (t[mine, :width].to(accelerator.device) for t in (input_ids, attention_mask, labels))
    with accelerator.autocast():
        loss = share * completion_loss(model, *inputs)
    accelerator.backward(loss)
    return loss.detach()


def evaluate(evaluator, model, accelerator) -> dict[str, float]:
    """The evaluator's metrics of ``model`` (sharded: gathered once for it), training mode restored."""
    with accelerator.autocast(), gathered(model):
        metrics, _ = evaluator(model)
    model.train()
    return metrics
