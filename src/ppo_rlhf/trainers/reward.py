"""Reward-model training, in one of two modes.

- ``pairwise``: rows ``{prompt, chosen, rejected}``; loss ``-log sigmoid(r_chosen - r_rejected)``
  (Bradley-Terry), with ``r`` read at the last token of each sequence.  Reports pairwise
  accuracy: the fraction of held-out pairs where ``r_chosen > r_rejected``.
- ``classification``: rows ``{text, label}``; cross-entropy over K classes, read at the EOS
  that ends each text (added where the text lacks it), as a finished response is scored.  At
  PPO time the reward is the logit of the class the prompt asks for.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from tqdm.auto import tqdm

from ppo_rlhf.config import (HARDWARE, MODEL_DATA, RUN, SEEDS, THREADS, UPDATE, above, at_least, between, check,
                             option)
from ppo_rlhf.core import masked_mean
from ppo_rlhf.data import DataError, FieldCheck, class_index, prompt_check, text
from ppo_rlhf.distributed import batch_for_rank, is_main_process, split_for_rank, sum_across_processes, sum_gradients, world_size
from ppo_rlhf.hardware import HardwareOptions
from ppo_rlhf.interrupts import RunInterrupted, stop_after
from ppo_rlhf.models.loading import check_scratch_model
from ppo_rlhf.models.lora import LoraOptions
from ppo_rlhf.rollout.encoding import drop_padding_columns, encode_pairs, encode_texts, with_eos
from ppo_rlhf.run_folder import RunFolderOptions
from ppo_rlhf.trackers import ReportOptions
from ppo_rlhf.rollout.responses import apply_chat_template
from ppo_rlhf.rollout.reward import REWARD_PADDING_SIDE, last_attended, last_token_scores, token_scores
from ppo_rlhf.sharding import gathered, plain, sharding_from_launch
from ppo_rlhf.trainers.common import prepare_to_train
from ppo_rlhf.trainers.guard import DivergenceGuard
from ppo_rlhf.trainers.optimizer import adamw
from ppo_rlhf.trainers.resume import Checkpoints
from ppo_rlhf.trainers.sft import lr_at


RM_LOSSES = ("last-token", "divergence")


@dataclass
class RewardConfig(RunFolderOptions, ReportOptions, LoraOptions, HardwareOptions):
    """``--lora``: train a LoRA adapter and a score head on the frozen ``--model``; PPO with
    ``--lora`` on the same base then runs the reward from that one base."""

    # --- model and data
    model: str | None = option(None, "model folder to start from (a causal LM or a classifier); empty: build a tiny GPT-2",
                               group=MODEL_DATA, first=True)
    data: str | None = option(None, "training rows (JSONL/Parquet/save_to_disk, or a data set's name in the local Hugging "
                                    "Face cache); pairs may leave the prompt implicit (hh-rlhf) or be conversations; "
                                    "empty: the task's", group=MODEL_DATA, first=True)
    task: str = option("doubling", "built-in task that supplies data when --data is empty", choices=("doubling",),
                       group=MODEL_DATA, first=True)
    mode: str = option("classification", "pairwise {prompt, chosen, rejected} or classification {text, label}",
                       choices=("pairwise", "classification"), group=MODEL_DATA, first=True)
    num_labels: int = option(3, "classes for classification mode (pairwise always has one output)", range=at_least(1),
                             group=MODEL_DATA)
    chat_template: bool = option(False, "pairwise: format each prompt (a user message, or a list of chat messages) "
                                        "with the tokenizer's chat template, as ppo --chat-template will",
                                 group=MODEL_DATA)
    prompt_field: str = option("prompt", "pairwise: field holding the prompt", group=MODEL_DATA)
    chosen_field: str = option("chosen", "pairwise: field holding the preferred response", group=MODEL_DATA)
    rejected_field: str = option("rejected", "pairwise: field holding the other response", group=MODEL_DATA)
    text_field: str = option("text", "classification: field holding the text (EOS is appended unless it ends with one)",
                             group=MODEL_DATA)
    label_field: str = option("label", "classification: field holding the class index", group=MODEL_DATA)
    max_length: int = option(256, "longest sequence in tokens; longer rows lose their start", range=above(1),
                             group=MODEL_DATA)
    data_split: str = option("train", "the split of --data when it names a data set in the local Hugging Face cache",
                             group=MODEL_DATA)
    n_layer: int = option(4, "layers of a model built from scratch", range=above(0), group=MODEL_DATA)
    n_head: int = option(4, "attention heads of a model built from scratch", range=above(0), group=MODEL_DATA)
    n_embd: int = option(64, "width of a model built from scratch", range=above(0), group=MODEL_DATA)
    dropout: float = option(0.1, "dropout of a model built from scratch (GPT-2's default; off in PPO rollouts)",
                            range=between(0, 1, high_open=True), group=MODEL_DATA)

    # --- update and loss
    steps: int = option(300, "optimizer steps", range=above(0), group=UPDATE, first=True)
    batch_size: int = option(64, "rows per step (a pair counts once)", range=above(0), group=UPDATE, first=True)
    lr: float = option(2e-3, "peak learning rate (AdamW), cosine-decayed", range=above(0), group=UPDATE, first=True)
    rm_loss: str = option("last-token", "pairwise loss: last-token, -logsigmoid(r_chosen - r_rejected) of the scores "
                                        "at each sequence's last token (Bradley-Terry); divergence, DeepSpeed-Chat's: "
                                        "the same averaged over the tokens from the first one where the two sequences "
                                        "differ to the end of the longer (a pair longer than max_length loses "
                                        "the same prompt tokens from both, so they stay aligned)", choices=RM_LOSSES,
                          group=UPDATE)
    warmup_steps: int = option(20, "linear warm-up steps", range=at_least(0), group=UPDATE)
    weight_decay: float = option(0.01, "AdamW weight decay", range=at_least(0), group=UPDATE)
    max_grad_norm: float = option(1.0, "clip the gradient norm to this", range=above(0), group=UPDATE)
    max_bad_steps: int = option(5, "stop after this many steps in a row with a non-finite loss or gradient norm "
                                   "(each is skipped)", range=at_least(1), group=UPDATE)

    # --- hardware
    num_threads: int = option(0, "torch CPU threads (0: leave torch's default)", range=THREADS, group=HARDWARE)

    # --- run folder, evaluation, logging, checkpoints
    out: str = option("runs/rm", "run folder", group=RUN, first=True)
    resume: bool = option(False, "continue the run in --out from OUT/checkpoints/last (its settings must match but "
                                 "for steps, saving, the learning rate and threads)", group=RUN, first=True)
    seed: int = option(0, "random seed", range=SEEDS, group=RUN)
    save_every: int = option(100, "write a resumable checkpoint (OUT/checkpoints/last) every N steps and after the "
                                  "last (0: none)", range=at_least(0), group=RUN)
    eval_fraction: float = option(0.05, "fraction of the rows held out to measure accuracy",
                                  range=between(0, 1, high_open=True), group=RUN)
    input_paths: ClassVar[tuple] = ("model", "data")
    may_change_on_resume: ClassVar[frozenset] = frozenset({
        "steps", "save_every", "resume", "overwrite", "out", "lr", "num_threads", "max_bad_steps", "report_to"})

    def validate(self) -> None:
        self.validate_lora()
        self.validate_hardware()
        check(self.model is not None or not self.lora, "lora", "--lora needs --model (the base to adapt)", self.lora)
        if sharding_from_launch() is not None:  # an FSDP launch whose settings ppo-rlhf follows
            check(not self.lora, "lora", "off under an FSDP launch (ppo-rlhf shards full fine-tuning; LoRA trains "
                                         "data parallel: configs/accelerate/gpus_ddp.yaml)", self.lora)
        check_scratch_model(self)
        check(self.rm_loss == "last-token" or self.mode == "pairwise", "rm_loss",
              "last-token in classification mode (divergence compares a chosen with a rejected sequence)", self.rm_loss)
        # Cross-entropy over one class is 0 whatever the model says: it would train nothing.
        check(self.mode != "classification" or self.num_labels >= 2, "num_labels",
              ">= 2 in classification mode (cross-entropy over one class is 0 whatever the model outputs, so nothing "
              "is learned); for one score per text, train pairs with --mode pairwise", self.num_labels)

    @property
    def required_fields(self) -> dict[str, FieldCheck]:
        """The fields each data row needs, with the check of each value."""
        if self.mode == "pairwise":
            return {self.prompt_field: prompt_check(self.chat_template), self.chosen_field: text,
                    self.rejected_field: text}
        return {self.text_field: text, self.label_field: class_index(self.num_labels)}


def pairwise_texts(tokenizer, rows, config: RewardConfig) -> tuple[list[str], list[str]]:
    """prompt + response + EOS for the chosen and the rejected response of each row: the same
    shape of sequence the reward model will score at PPO time."""
    prompts = [r[config.prompt_field] for r in rows]
    if config.chat_template:
        prompts = apply_chat_template(tokenizer, prompts)
    chosen = [with_eos(tokenizer, p + r[config.chosen_field]) for p, r in zip(prompts, rows)]
    rejected = [with_eos(tokenizer, p + r[config.rejected_field]) for p, r in zip(prompts, rows)]
    return chosen, rejected


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """``-log sigmoid(r_chosen - r_rejected)``, averaged over pairs."""
    return -torch.nn.functional.logsigmoid(chosen_scores - rejected_scores).mean()


def divergence_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor, chosen_ids: torch.Tensor,
                    rejected_ids: torch.Tensor, chosen_mask: torch.Tensor, rejected_mask: torch.Tensor) -> torch.Tensor:
    """DeepSpeed-Chat's pairwise reward loss: per pair, ``-log sigmoid(v_chosen[t] - v_rejected[t])``
    averaged over the positions t from the first one where the two sequences differ to the end of
    the longer one, then averaged over pairs.  (B, L) per-token scores, ids and masks, right-padded
    to one width.

    The shared prompt (and any shared start of the responses) carries no preference, so it is left
    out -- which needs the two sequences aligned position by position: a pair longer than
    --max-length is cut alike (rollout/encoding.py, ``cut_pair_alike``).  Every token after the
    split is asked to prefer the chosen continuation, which gives the model a denser signal than the
    last token alone.  Past its own end a sequence's value is held
    at its last token's score (its reward), where DeepSpeed-Chat reads the value the head gives a
    pad token: the padding's length and token are arbitrary, the final score is not.
    """
    width = chosen_ids.shape[1]
    positions = torch.arange(width, device=chosen_ids.device)  # (L,)
    differs = (chosen_ids != rejected_ids) | (chosen_mask != rejected_mask)  # (B, L)
    first = torch.where(differs.any(dim=1), differs.float().argmax(dim=1), torch.full_like(differs[:, 0], width,
                                                                                            dtype=torch.long))  # (B,)
    chosen_length, rejected_length = chosen_mask.sum(dim=1), rejected_mask.sum(dim=1)
    end = torch.maximum(chosen_length, rejected_length)  # (B,) one past the longer sequence's last token
    compared = (positions >= first[:, None]) & (positions < end[:, None])  # (B, L)
    chosen_held = held_past_end(chosen_scores, chosen_length)
    rejected_held = held_past_end(rejected_scores, rejected_length)
    per_token = -torch.nn.functional.logsigmoid(chosen_held - rejected_held)  # (B, L)
    per_pair = masked_mean(per_token, compared, dim=1)  # a pair that never differs: 0 (dropped at loading)
    return per_pair.mean()


def held_past_end(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(B, L) scores with every position past a row's last token holding that token's score."""
    positions = torch.arange(scores.shape[1], device=scores.device)
    last = (lengths - 1).clamp(min=0)
    final = scores.gather(1, last[:, None])  # (B, 1)
    return torch.where(positions[None, :] < lengths[:, None], scores, final)


class _Examples:
    """Tokenised rows of either mode, indexable by a batch of row indices."""

    def __init__(self, tokenizer, rows, config: RewardConfig):
        self.mode, self.rm_loss = config.mode, config.rm_loss
        if config.mode == "pairwise":
            chosen, rejected = pairwise_texts(tokenizer, rows, config)
            # Encoded together so both halves share one padded width (a batch stacks them).
            # A chat template writes its own special tokens: none added on top (as PPO encodes them).
            add_special_tokens = not config.chat_template
            if config.rm_loss == "divergence":  # compared token by token: each pair cut alike, so it stays aligned
                self.chosen, self.rejected = encode_pairs(tokenizer, chosen, rejected, config.max_length,
                                                          add_special_tokens)
            else:  # each scored at its own end: each keeps its end
                ids, mask = encode_texts(tokenizer, chosen + rejected, config.max_length, REWARD_PADDING_SIDE,
                                         add_special_tokens=add_special_tokens)
                self.chosen = ids[: len(rows)], mask[: len(rows)]
                self.rejected = ids[len(rows):], mask[len(rows):]
        else:
            # Ending with EOS, as a finished response is scored at PPO time.
            texts = [with_eos(tokenizer, r[config.text_field]) for r in rows]
            try:
                labels = [int(r[config.label_field]) for r in rows]
            except (TypeError, ValueError):
                raise DataError(f"field '{config.label_field}' must hold integer class indices") from None
            bad = next((i for i, l in enumerate(labels) if not 0 <= l < config.num_labels), None)
            if bad is not None:
                raise DataError(
                    f"{rows[bad].get('_source', f'row {bad}')}: label {labels[bad]} is outside 0..{config.num_labels - 1}"
                )
            self.texts = encode_texts(tokenizer, texts, config.max_length, REWARD_PADDING_SIDE)
            self.labels = torch.tensor(labels)

    def loss_and_correct(self, model, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, per-row correctness) of the rows at ``index``, on the model's device."""
        device = next(model.parameters()).device
        if self.mode == "pairwise":
            both_ids = torch.cat([self.chosen[0][index], self.rejected[0][index]])
            both_mask = torch.cat([self.chosen[1][index], self.rejected[1][index]])
            ids, mask = (t.to(device) for t in drop_padding_columns(both_ids, both_mask))
            if self.rm_loss == "divergence":
                per_token = token_scores(model, ids, mask)  # (2B, L)
                scores = per_token.gather(1, last_attended(mask)[:, None]).squeeze(1)  # each sequence's reward
                loss = divergence_loss(*per_token.chunk(2), *ids.chunk(2), *mask.chunk(2))
            else:
                scores = last_token_scores(model, ids, mask)[:, 0]
                loss = bradley_terry_loss(*scores.chunk(2))
            chosen_scores, rejected_scores = scores.chunk(2)
            return loss, chosen_scores > rejected_scores
        ids, mask = drop_padding_columns(self.texts[0][index], self.texts[1][index])
        logits = last_token_scores(model, ids.to(device), mask.to(device))
        labels = self.labels[index].to(device)
        return torch.nn.functional.cross_entropy(logits, labels), logits.argmax(dim=1) == labels


@torch.no_grad()
def reward_accuracy(model, examples: _Examples, indices: torch.Tensor, batch_size: int = 512) -> float:
    model.eval()
    if len(indices) == 0:
        return float("nan")
    mine = split_for_rank(indices)  # several processes: each its part, the counts summed
    correct = [examples.loss_and_correct(model, mine[i:i + batch_size])[1] for i in range(0, len(mine), batch_size)]
    right = torch.cat(correct).float().sum() if correct else torch.zeros((), device=next(model.parameters()).device)
    return (sum_across_processes(right) / len(indices)).item()


def train_reward_model(model, tokenizer, rows: list[dict], config: RewardConfig, run_log=None,
                       accelerator=None, checkpoints: Checkpoints | None = None) -> dict[str, float]:
    """Train ``model`` in place, its trained weights in float32 on the accelerator's device
    (default: the one ``config`` asks for); returns final train/held-out accuracy.
    ``checkpoints``: where to save resumable state, and the state a resumed run continues from."""
    accelerator = prepare_to_train(model, config, accelerator, "reward model")
    order = list(range(len(rows)))
    random.Random(config.seed).shuffle(order)
    n_eval = int(len(rows) * config.eval_fraction)
    eval_index, train_index = torch.tensor(order[:n_eval], dtype=torch.long), torch.tensor(order[n_eval:])
    examples = _Examples(tokenizer, rows, config)
    parameters = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapter and the head
    optimizer = accelerator.prepare(adamw(parameters, lr=config.lr, weight_decay=config.weight_decay))
    generator = torch.Generator().manual_seed(config.seed)
    guard = DivergenceGuard(config.max_bad_steps)
    first_step, seconds_before = (checkpoints.step if checkpoints is not None else 0), 0.0
    if first_step:
        saved = checkpoints.restore(model, optimizer, accelerator)
        generator.set_state(saved["batch_rng"])
        seconds_before = saved["seconds"]
        guard.load_state_dict(saved["guard"])
    start = time.perf_counter() - seconds_before
    model.train()
    for step in tqdm(range(first_step, config.steps), desc=f"reward ({config.mode})", mininterval=1.0,
                     disable=not is_main_process()):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config.steps, config.lr, config.warmup_steps)
        batch = train_index[torch.randint(len(train_index), (config.batch_size,), generator=generator)]
        # Several processes: each its equal part of the batch, its mean loss scaled by 1 / processes,
        # the gradients summed (docs/design.md, "Scale").
        with accelerator.autocast():
            loss, correct = examples.loss_and_correct(model, batch_for_rank(batch))
        loss = loss / world_size() if world_size() > 1 else loss
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        sum_gradients(parameters)
        grad_norm = plain(accelerator.clip_grad_norm_(parameters, config.max_grad_norm))
        loss = sum_across_processes(loss.detach())  # the whole batch's loss
        done = step + 1
        guard.step(optimizer, done, accelerator, loss=loss, grad_norm=grad_norm)
        if run_log is not None and (step % 25 == 0 or done == config.steps):
            accuracy = sum_across_processes(correct.float().sum()) / config.batch_size
            run_log.log(done, {"loss": loss.item(), "train_accuracy": accuracy.item(),
                               "skipped_steps": guard.skipped, "seconds": time.perf_counter() - start})
        stop = stop_after(done, config.steps)  # Ctrl-C: this step's state saved, then the run stops (interrupts.py)
        if checkpoints is not None and (checkpoints.due(done, config.steps) or (stop and checkpoints.every)):
            checkpoints.save(done, model, optimizer, accelerator=accelerator, state={
                "batch_rng": generator.get_state(), "seconds": time.perf_counter() - start, "guard": guard.state_dict()})
        if stop:
            raise RunInterrupted(done, "step", checkpoints.saved_step if checkpoints is not None else None)
    with accelerator.autocast(), gathered(model):
        eval_accuracy = reward_accuracy(model, examples, eval_index)
    result = {"eval_accuracy": eval_accuracy, "seconds": time.perf_counter() - start,
              "eval_rows": n_eval}
    if run_log is not None:
        run_log.log(config.steps, result)
    model.zero_grad(set_to_none=True)  # the last step's gradients: a model's worth of memory, not needed to save it
    model.eval()
    return result
