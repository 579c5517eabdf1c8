"""Models and data sets named as on the Hugging Face Hub, read from the local cache (offline).

``--model HuggingFaceTB/SmolLM2-135M-Instruct`` or ``--data Anthropic/hh-rlhf`` work as
``from_pretrained`` and ``load_dataset`` do once the files are in the cache (``HF_HOME``), with
nothing downloaded: ppo-rlhf never reaches the network at run time.  A name that is a local file
or folder is that file or folder; a name in neither place is an error that says how to fetch it.
"""

from __future__ import annotations

import re
from pathlib import Path

# What a Hub repository id looks like: "name" or "owner/name", no file suffix of the data formats.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not name.endswith(DATA_SUFFIXES)


def cached_snapshot(name: str, repo_type: str) -> Path | None:
    """The local folder of the cached snapshot of Hub repository ``name``, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, repo_type=repo_type, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def local_model(name: str | None, flag: str) -> str | None:
    """``name`` itself when it is a local path (or empty); else the cached snapshot of the Hub model
    ``name``; FileNotFoundError naming ``flag`` when it is neither."""
    if name is None or Path(name).exists() or not looks_like_hub_id(name):
        return name
    snapshot = cached_snapshot(name, "model")
    if snapshot is None:
        raise FileNotFoundError(
            f"{flag} {name}: not a folder here, and not in the local Hugging Face cache (HF_HOME); ppo-rlhf works "
            f"offline: on a machine with a network run `huggingface-cli download {name}` and copy its cache here, or "
            f"give the model's folder")
    print(f"{flag} {name}: the cached snapshot {snapshot}")
    return str(snapshot)


def hub_dataset_rows(name: str, split: str) -> list[dict] | None:
    """The rows of split ``split`` of the Hub data set ``name`` from the local cache: a data set
    ``load_dataset`` prepared before, or the data files of a cached snapshot; None if neither.
    A split the data set does not have is a ``ValueError`` naming it (data.py reports it as bad data)."""
    import datasets

    offline, datasets.config.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE, True
    try:
        try:
            dataset = datasets.load_dataset(name, split=split)
        except ValueError as error:  # a split it does not have
            raise ValueError(f"{name}: {str(error).splitlines()[0]} (--data-split)") from None
        except Exception:  # noqa: BLE001 -- not prepared in the cache: try the snapshot's own files
            snapshot = cached_snapshot(name, "dataset")
            if snapshot is None:
                return None
            try:
                dataset = datasets.load_dataset(str(snapshot), split=split)
            except ValueError as error:
                raise ValueError(f"{name}: {str(error).splitlines()[0]} (--data-split)") from None
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
    return [dict(row, _source=f"{name}[{split}][{i}]") for i, row in enumerate(dataset)]


MODEL_FLAGS = {"model": "--model", "reward_model": "--reward-model", "critic_model": "--critic-model"}


def resolve_hub_models(config) -> None:
    """Each model field of ``config`` that names a Hub model rather than a local folder, replaced by
    its cached snapshot's folder (so config.yaml records the files the run read)."""
    for field, flag in MODEL_FLAGS.items():
        if getattr(config, field, None) is not None:
            setattr(config, field, local_model(getattr(config, field), flag))
