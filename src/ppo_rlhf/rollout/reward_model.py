"""A reward model: a sequence classifier (or a value model) that scores the last token of each
prompt + response, in its own tokenizer where it has one (docs/design.md, "Rewards").  Its
passes: the trunk and the score head (``last_token_scores``), and a value model's per-token
scores (``token_scores``)."""

from __future__ import annotations

import torch

from ppo_rlhf.models.loading import base_of, max_positions, same_vocabulary
from ppo_rlhf.rollout.encoding import with_eos
from ppo_rlhf.rollout.responses import apply_chat_template
from ppo_rlhf.rollout.reward_base import RewardError, ScoringBatch, ScoringReward
from ppo_rlhf.rollout.sequences import position_ids_from_mask


def last_token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, K) head outputs of a sequence classifier at each sequence's last attended token.

    Read from the attention mask, not from the pad id: with pad = EOS, the model's own pooling
    would skip the EOS that ends a response.  Works for left or right padding.
    """
    trunk, head = trunk_and_head(model)
    if head is None:
        # No last-token head to call separately (e.g. BERT-style pooling): use the model's own.
        return model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    hidden = trunk_hidden(trunk, input_ids, attention_mask)  # (B, L, H)
    last = last_attended(attention_mask)  # (B,)
    pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, H)
    # The head's own dtype: a trained head is float32 on a trunk that may compute in bf16.
    return head(pooled.to(head.weight.dtype)).float()


def token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) outputs of a one-output reward model's head at every position (the per-token values
    DeepSpeed-Chat's reward loss compares); ModelError for a model without a separate head."""
    from ppo_rlhf.models.loading import ModelError

    trunk, head = trunk_and_head(model)
    if head is None or head.out_features != 1:
        raise ModelError(f"a {type(model).__name__} has no one-output head to apply at every token (a pooling "
                         f"classifier, or several classes); --rm-loss divergence needs a last-token reward model "
                         f"such as ...ForSequenceClassification of a causal LM")
    hidden = trunk_hidden(trunk, input_ids, attention_mask)  # (B, L, H)
    return head(hidden.to(head.weight.dtype)).float().squeeze(-1)


def trunk_and_head(model):
    """(trunk, score head) of a sequence classifier, also through a peft wrapper; head None when
    the model pools in its own way (no ``score`` module on top of a ``base_model``)."""
    inner = base_of(model)
    head = getattr(inner, "score", None)
    trunk = inner.base_model
    return (trunk, None) if head is None or trunk is inner else (trunk, head)


def trunk_hidden(trunk, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L, H) last hidden states, positions counted from each row's first attended token."""
    return trunk(input_ids=input_ids, attention_mask=attention_mask,
                 position_ids=position_ids_from_mask(attention_mask)).last_hidden_state


def last_attended(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of each row's last attended position (left or right padding)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask * positions).argmax(dim=1)


# Reward-model rows are padded on the right, in training and in scoring, whatever the
# tokenizer's default: each row then starts at position 0 as it would alone, which a classifier
# pooling its first token (BERT-style) needs; last_token_scores reads the last real token on
# either side.
REWARD_PADDING_SIDE = "right"


class ModelReward(ScoringReward):
    """A frozen sequence classifier as the reward.

    One output: that output is the score (pairwise-trained reward models).  K outputs: the
    score is the logit of the class named by the prompt row's ``label_field`` (a classification
    reward such as the built-in task's style classifier).

    A response that ended at a stop id other than EOS (a chat model's end-of-turn) is scored as
    ending at EOS, the way ``ppo-rlhf rm`` trains (each text + EOS): one end token in training
    and in scoring, whichever stop id the policy emitted.

    When the reward model's tokenizer differs from the policy's, prompt and response are
    decoded to text and re-encoded with the reward tokenizer (EOS appended when the response
    had one; a prompt given as chat messages formatted with the reward tokenizer's own chat
    template, and so is a plain prompt when PPO formats prompts that way; a sequence longer than
    the reward model's positions cut from the left).
    """

    short_name, waits = "model", False

    def __init__(self, model, tokenizer=None, policy_tokenizer=None, label_field: str = "label", batch_size: int = 256,
                 chat_template: bool = False, description: str = "a reward model"):
        self.model = model.eval()
        self.description = description  # for the run's plan: "model DIR"
        self.chat_template = chat_template  # prompts were formatted with the chat template (ppo --chat-template)
        self.label_field = label_field
        self.batch_size = batch_size
        self.tokenizer = tokenizer
        self.same_tokenizer = (tokenizer is None or policy_tokenizer is None
                               or same_vocabulary(tokenizer, policy_tokenizer))
        self.max_length = max_positions(model.config)

    def _inputs(self, batch: ScoringBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.same_tokenizer:
            return self._ending_at_eos(batch), batch.sequences.attention_mask
        # The same text as the reward model saw in training: prompt + response + EOS (pairwise_texts).
        # A prompt formatted by the reward tokenizer's chat template already holds its special
        # tokens (BOS, turn markers): none are added on top, as in `rm --chat-template`.
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        input_ids = []
        truncation_side = self.tokenizer.truncation_side
        self.tokenizer.truncation_side = "left"  # a long prompt loses its start, never the response
        try:
            for prompt, response, finished in zip(batch.prompts, batch.responses, batch.finished):
                templated = self.chat_template or not isinstance(prompt, str)
                if templated:
                    prompt = apply_chat_template(self.tokenizer, [prompt])[0]
                input_ids.append(self.tokenizer(
                    with_eos(self.tokenizer, prompt + response) if finished else prompt + response,
                    add_special_tokens=not (templated and has_template),
                    truncation=self.max_length is not None, max_length=self.max_length,
                )["input_ids"])
        finally:
            self.tokenizer.truncation_side = truncation_side
        # Padded as `ppo-rlhf rm` pads its rows (a classifier pooling its first token needs them
        # to start at position 0); last_token_scores reads the last real token either way.
        encoded = self.tokenizer.pad({"input_ids": input_ids}, padding=True, return_tensors="pt",
                                     padding_side=REWARD_PADDING_SIDE)
        return encoded["input_ids"], encoded["attention_mask"]

    def _ending_at_eos(self, batch: ScoringBatch) -> torch.Tensor:
        """The policy's token ids, each finished response's stop token replaced by EOS."""
        input_ids = batch.sequences.input_ids
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None or not any(batch.finished):
            return input_ids
        input_ids = input_ids.clone()
        rows = torch.tensor(batch.finished, device=input_ids.device).nonzero().squeeze(1)
        last = batch.sequences.prompt_length + batch.sequences.response_mask.sum(dim=1) - 1  # (B,)
        input_ids[rows, last[rows]] = eos
        return input_ids

    @torch.no_grad()
    def __call__(self, batch: ScoringBatch) -> torch.Tensor:
        input_ids, attention_mask = self._inputs(batch)
        device = next(self.model.parameters()).device
        outputs = []
        for start in range(0, input_ids.shape[0], self.batch_size):
            chunk = slice(start, start + self.batch_size)
            outputs.append(last_token_scores(self.model, input_ids[chunk].to(device), attention_mask[chunk].to(device)))
        logits = torch.cat(outputs)  # (B, K)
        if logits.shape[1] == 1:
            return logits[:, 0]
        try:
            labels = torch.tensor([int(row[self.label_field]) for row in batch.rows], device=logits.device)
        except KeyError:
            raise RewardError(
                f"the reward model has {logits.shape[1]} classes, so each prompt row needs a "
                f"'{self.label_field}' field naming the class to reward (set --label-field)"
            ) from None
        except (TypeError, ValueError):
            row = next(r for r in batch.rows if not isinstance(r[self.label_field], int))
            raise RewardError(f"{row.get('_source', 'a prompt row')}: field '{self.label_field}' must be an integer "
                              f"class index of the reward model (0..{logits.shape[1] - 1}), got "
                              f"{row[self.label_field]!r}") from None
        if not all(0 <= label < logits.shape[1] for label in labels.tolist()):
            row = next(r for r in batch.rows if not 0 <= int(r[self.label_field]) < logits.shape[1])
            raise RewardError(f"{row.get('_source', 'a prompt row')}: field '{self.label_field}' holds "
                              f"{row[self.label_field]!r}, but the reward model's classes are 0..{logits.shape[1] - 1}")
        return logits.gather(1, labels[:, None]).squeeze(1)
