"""TRL's data sets as this project's prompt rows (docs/migrating_from_trl.md, "Data").

- TRL's PPOTrainer reads pre-tokenized prompts: a Dataset with an ``input_ids`` column (its
  scripts map the prompts through the tokenizer first).  Each row's ids become the prompt's text,
  checked to tokenize back to the same ids, so the model reads what TRL would have fed it.
- TRL's GRPOTrainer and RLOOTrainer read a ``prompt`` column -- text (standard) or chat messages
  (conversational) -- from a Dataset or a streamed IterableDataset, every other column reaching the
  reward functions; with an ``environment_factory`` and no data set, rows of an empty user message
  (TRL's placeholder) stand in, one generation's worth.  Those data sets are handed to this
  project's PPOConfig as they are (data.py reads them in memory).

A data set without the column the trainer reads is refused at construction, naming the column
and the ones it has.
"""

from __future__ import annotations

from ppo_rlhf.config import ConfigError
from ppo_rlhf.data import ENVIRONMENT_PLACEHOLDER, is_streamed


def columns_of(dataset) -> list[str]:
    """A data set's columns; a stream without declared features: the first row's."""
    names = getattr(dataset, "column_names", None)
    if names is None and is_streamed(dataset):
        first = next(iter(dataset), None)
        names = list(first) if isinstance(first, dict) else []
    return list(names or [])


def require_column(dataset, column: str, argument: str, how: str) -> None:
    """ConfigError unless ``dataset`` (a trainer's ``argument``) has ``column``."""
    columns = columns_of(dataset)
    if column not in columns:
        raise ConfigError(f"{argument} has no column '{column}' (its columns: {', '.join(columns) or 'none'}); {how}")


def one_split(dataset, argument: str):
    """eval_dataset as one data set: a dict of splits holding one is that split (TRL evaluates each
    split of several on its own; this project evaluates one held-out set)."""
    if isinstance(dataset, dict):
        if len(dataset) != 1:
            raise ConfigError(f"{argument} holds {len(dataset)} splits ({', '.join(map(str, dataset))}); ppo-rlhf "
                              f"evaluates one held-out set: give one of them")
        return next(iter(dataset.values()))
    return dataset


# ---------------------------------------------------------------- TRL's PPOTrainer: input_ids
PPO_HOW = ("TRL's PPOTrainer reads pre-tokenized prompts: map the data set through the tokenizer first, as TRL's "
           "examples/scripts/ppo/ppo.py does (prepare_dataset)")


def prompt_text(ids: list[int], tokenizer, where: str) -> str:
    """The text whose tokens are ``ids`` as the rollout encodes a plain prompt (the tokenizer adding
    its own special tokens: a BOS): decoded with its special tokens, less a leading BOS the
    tokenizer puts there itself, and checked to encode back to the same ids."""
    ids = [int(i) for i in ids]
    candidates = [ids] + ([ids[1:]] if len(ids) > 1 and ids[0] == tokenizer.bos_token_id else [])
    for kept in candidates:
        text = tokenizer.decode(kept, skip_special_tokens=False)
        if tokenizer(text, add_special_tokens=True)["input_ids"] == ids:
            return text
    text = tokenizer.decode(ids, skip_special_tokens=False)
    raise ConfigError(f"{where}: its input_ids do not tokenize back to themselves once decoded ({text[:60]!r}...), "
                      f"so the prompt cannot be given to the model as TRL gave it; tokenize the prompts with this "
                      f"tokenizer (processing_class)")


def ppo_rows(dataset, tokenizer, argument: str) -> list[dict]:
    """TRL PPO's pre-tokenized rows as prompt rows: ``prompt`` the text of ``input_ids``, every other
    column kept, ``_source`` naming the row."""
    require_column(dataset, "input_ids", argument, PPO_HOW)
    rows = []
    for i, row in enumerate(dataset):
        where = f"{argument}, row {i}"
        ids = row["input_ids"]
        if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(t, int) for t in ids):
            raise ConfigError(f"{where}: input_ids must be a non-empty list of token ids, got {str(ids)[:40]}")
        others = {key: value for key, value in row.items() if key not in ("input_ids", "attention_mask")}
        rows.append({**others, "prompt": prompt_text(ids, tokenizer, where), "_source": where})
    if not rows:
        raise ConfigError(f"{argument} holds no rows")
    return rows


# ---------------------------------------------------------------- TRL's GRPOTrainer / RLOOTrainer: prompt
ONLINE_HOW = ("TRL's GRPOTrainer and RLOOTrainer read the prompts from a 'prompt' column (text, or chat messages); "
              "rename the column (dataset.rename_column) or map the rows into one")


def online_prompts(dataset, argument: str, environments: bool, generation_rows: int):
    """What the project's PPOConfig reads as prompts: the data set itself, checked for its ``prompt``
    column (a row routed to an environment may go without: its reset() says the task); without a
    data set and with an environment, TRL's placeholder rows."""
    if dataset is None:
        if not environments:
            raise ConfigError(f"{argument} is required unless an environment_factory is given (TRL's rule)")
        return [{"prompt": [dict(message) for message in ENVIRONMENT_PLACEHOLDER]} for _ in range(generation_rows)]
    if not environments:
        require_column(dataset, "prompt", argument, ONLINE_HOW)
    return dataset
