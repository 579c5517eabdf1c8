"""``ppo-rlhf merge``: fold a LoRA adapter into its base, giving a full Hugging Face model folder.

Works for a policy adapter (``RUN/checkpoints/actor`` of a ``ppo --lora`` run: a causal LM) and a
reward adapter (``rm --lora``: a sequence classifier).  The base is the folder the adapter
records (``base_model_name_or_path``), unless ``--base`` names another copy of it.  The merge
is computed in float32 and saved in ``--dtype``: float32 by default, which holds the whole update
of an adapter trained on a 16-bit base (docs/lora.md, "Merging").
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import torch

from ppo_rlhf.config import HARDWARE, MODEL_DATA, RUN, ConfigError, check, option
from ppo_rlhf.hardware import DTYPES
from ppo_rlhf.models.loading import ADAPTER_CONFIG, adapter_base_path, is_adapter_folder
from ppo_rlhf.models.lora import merge_adapter_folder
from ppo_rlhf.run_folder import check_out_spares_inputs


@dataclass
class MergeConfig:
    # The fields naming a file or folder the run reads: --out may not be, hold or lie in one (run_folder.py).
    input_paths: ClassVar[tuple] = ("adapter", "base")

    # --- model and data
    adapter: str | None = option(None, "LoRA adapter folder (adapter_config.json + adapter_model.safetensors)",
                                 group=MODEL_DATA, first=True)
    base: str | None = option(None, "base model folder (default: the one the adapter records)", group=MODEL_DATA)

    # --- hardware
    dtype: str = option("float32", "dtype the merged model is saved in: float32 (every update of the adapter kept), "
                                   "bfloat16 or float16 (half the size; an update under half a 16-bit ulp of its "
                                   "weight is rounded away), or auto (the base's stored dtype); the merge itself "
                                   "is computed in float32", choices=DTYPES, group=HARDWARE)

    # --- run folder, evaluation, logging, checkpoints
    out: str | None = option(None, "where to write the merged model (with the tokenizer)", group=RUN, first=True)
    overwrite: bool = option(False, "replace what --out already holds", group=RUN, first=True)

    def validate(self) -> None:
        check(self.adapter is not None, "adapter", "an adapter folder", self.adapter)
        check(self.out is not None, "out", "a folder to write", self.out)


def run_merge(config: MergeConfig) -> dict:
    adapter = Path(config.adapter)
    if not is_adapter_folder(adapter):
        raise FileNotFoundError(f"{adapter} is not a LoRA adapter folder (no {ADAPTER_CONFIG})")
    check_out_spares_inputs(config)  # also for a caller that bypasses the command line
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not config.overwrite:
        held = ", ".join(sorted(p.name for p in out.iterdir())[:5])
        raise ConfigError(f"--out {out} already holds files ({held}): pass --overwrite to replace them, or choose "
                          f"another --out")
    start = time.perf_counter()
    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    out = merge_adapter_folder(adapter, config.out, base=config.base, dtype=dtype)
    saved = json.loads((out / "config.json").read_text()).get("dtype", config.dtype)  # what a loader will read
    return {"adapter": str(adapter), "base": str(config.base or adapter_base_path(adapter)), "merged": str(out),
            "dtype": saved, "seconds": round(time.perf_counter() - start, 2)}
