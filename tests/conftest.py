"""Session fixtures: the tiny model zoo (tests/zoo.py), pairwise reward models trained on it, and a
tiny SFT model of the built-in task."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from datasets import Dataset

from zoo import ARCHS, LEFT_PADDED, PROMPTS, REWARDS_MODULE, REWARDS_SOURCE, THREADS, TINY, build_model, run, write_jsonl


def pytest_addoption(parser):
    parser.addoption("--learning-seed", type=int, default=0,
                     help="added to the seed of every test marked 'learning' (the runs it trains and the models it "
                          "draws): benchmarks/learning_spread.py measures each learning test's outcome over seeds "
                          "with it (DEVELOPERS.md, 'Learning tests')")


@pytest.fixture(scope="session")
def learning_seed(request) -> int:
    """The offset a learning test adds to its seeds: 0 in the suite, 0-4 (or more) when
    benchmarks/learning_spread.py measures the spread of the test's outcome."""
    return request.config.getoption("--learning-seed")


@pytest.fixture
def record_outcome(request, learning_seed):
    """``record_outcome(name, value)``: a learning test's measured outcome, appended as one JSON line
    to the file $PPO_RLHF_OUTCOMES names (nothing without it).  Called before the test asserts on
    the value, so a run whose outcome misses the bar is recorded too."""
    path = os.environ.get("PPO_RLHF_OUTCOMES")

    def record(name: str, value: float) -> None:
        if path:
            with open(path, "a") as file:
                file.write(json.dumps({"test": request.node.nodeid, "name": name, "seed": learning_seed,
                                       "threads": os.environ.get("OMP_NUM_THREADS"), "value": value}) + "\n")

    return record


def pytest_collection_modifyitems(items):
    """The learning tests first.  They share one SFT model, trained by whichever process gets there
    first while the others wait on its lock (test_learning.py); pytest-xdist's load scheduling hands
    each worker a first chunk of consecutive tests (about an eighth of the suite on 2 workers), so
    collected first they all land on one worker and no other sits waiting (measured: one worker
    idle for 141 s of an 18-minute run).  A stable sort: every other test keeps its order."""
    items.sort(key=lambda item: getattr(getattr(item, "module", None), "__name__", "") != "test_learning")


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    folders = {arch: build_model(arch, root / arch) for arch in ARCHS}
    folders[LEFT_PADDED] = build_model("llama", root / LEFT_PADDED, padding_side="left")
    folders["llama_bf16"] = build_model("llama", root / "llama_bf16", dtype=torch.bfloat16)  # stored as hub models are
    sft_rows = [{"question": p, "answer": " good answer"} for p in PROMPTS] * 2
    data = {"jsonl": write_jsonl(root / "sft.jsonl", sft_rows), "parquet": root / "sft.parquet", "disk": root / "sft_disk"}
    Dataset.from_list(sft_rows).to_parquet(str(data["parquet"]))
    Dataset.from_list(sft_rows).save_to_disk(str(data["disk"]))
    pairs = write_jsonl(root / "pairs.jsonl", [{"query": p, "good": " good answer", "bad": " bad answer, i do not know"}
                                               for p in PROMPTS] * 4)
    prompts = write_jsonl(root / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    chat = write_jsonl(root / "chat.jsonl", [{"messages": [{"role": "user", "content": p}]} for p in PROMPTS])
    (root / f"{REWARDS_MODULE}.py").write_text(REWARDS_SOURCE)
    sys.path.insert(0, str(root))
    yield {"root": root, **folders, "data": data, "pairs": pairs, "prompts": prompts, "chat": chat}
    sys.path.remove(str(root))
    sys.modules.pop(REWARDS_MODULE, None)


@pytest.fixture(scope="session")
def reward_models(zoo, learning_seed):
    """One pairwise reward model per architecture that PPO needs one for (llama, qwen2, gemma)."""
    out = {}
    for arch in ("llama", "qwen2", "gemma"):
        run(["rm", "--mode", "pairwise", "--model", zoo[arch], "--data", zoo["pairs"], "--prompt-field", "query",
             "--chosen-field", "good", "--rejected-field", "bad", "--steps", 15, "--batch-size", 8, "--lr", 1e-2,
             "--eval-fraction", 0.25, "--seed", learning_seed, "--out", zoo["root"] / f"rm_{arch}", *THREADS])
        out[arch] = zoo["root"] / f"rm_{arch}"
    return out


@pytest.fixture(scope="session")
def tiny_sft_model(tmp_path_factory):
    """A policy of the built-in task to start PPO from: 4 SFT steps of the TINY model."""
    out = tmp_path_factory.mktemp("sft") / "run"
    run(["sft", "--task", "doubling", "--steps", 4, "--batch-size", 16, "--eval-every", 0, "--out", out, *TINY])
    return out / "checkpoints" / "sft"
