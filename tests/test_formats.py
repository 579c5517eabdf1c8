"""The data shapes people bring (formats.py): implicit-prompt pairs (hh-rlhf), conversational
rows and pairs, Alpaca rows; by hand, through every stage that takes them, and the bad ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_rlhf.data import DataError
from ppo_rlhf.formats import (
    ALPACA,
    ALPACA_WITH_INPUT,
    CONVERSATION,
    Conversation,
    completion_rows,
    implicit_prompt,
    preference_rows,
    prompt_rows,
)
from zoo import PROMPTS, THREADS, run, run_failing, write_jsonl

USER = {"role": "user", "content": "What is 2+2?"}


def reply(text: str) -> dict:
    return {"role": "assistant", "content": text}


# ---------------------------------------------------------------- by hand
def test_the_implicit_prompt_ends_at_the_last_assistant_marker():
    human = "\n\nHuman: What is 2+2?\n\nAssistant: Let me think.\n\nHuman: And?\n\nAssistant:"
    assert implicit_prompt(human + " The answer is 4.", human + " The answer is 5.") == human
    # No marker: the common prefix, less the space the replies share -- TRL's extract_prompt, which
    # cuts at the first differing character, one back where a space precedes it (its example).
    assert implicit_prompt("The sky is blue.", "The sky is green.") == "The sky is"
    # With one, ppo-rlhf's rule and TRL's part: replies that begin alike keep their shared words,
    # where extract_prompt would give "\n\nHuman: hi\n\nAssistant: I'm sorry," as the prompt.
    assert implicit_prompt("\n\nHuman: hi\n\nAssistant: I'm sorry, I can't.",
                           "\n\nHuman: hi\n\nAssistant: I'm sorry, but no.") == "\n\nHuman: hi\n\nAssistant:"
    assert implicit_prompt("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHello!",
                           "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHey.") == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert implicit_prompt("abc", "xyz") == ""


def test_preference_rows_of_each_shape():
    convert = preference_rows("prompt", "chosen", "rejected")
    hh = [{"chosen": "\n\nHuman: hi\n\nAssistant: Hello there.", "rejected": "\n\nHuman: hi\n\nAssistant: Go away.",
           "_source": "hh.jsonl:1"}]
    assert convert(hh)[0] == {"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " Hello there.",
                              "rejected": " Go away.", "_source": "hh.jsonl:1"}
    implicit_chat = [{"chosen": [USER, reply("4")], "rejected": [USER, reply("5")]}]
    assert convert(implicit_chat)[0] == {"prompt": [USER], "chosen": "4", "rejected": "5"}
    same_chat = [{"chosen": [USER, reply("4")], "rejected": [USER, reply("4")]}]  # dropped as the same by rm
    assert convert(same_chat)[0] == {"prompt": [USER], "chosen": "4", "rejected": "4"}
    explicit_chat = [{"prompt": [USER], "chosen": [reply("4")], "rejected": [reply("5")]}]
    assert convert(explicit_chat)[0] == {"prompt": [USER], "chosen": "4", "rejected": "5"}
    plain = [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    assert convert(plain) is plain


def test_completion_and_prompt_rows_of_each_shape():
    sft = completion_rows("prompt", "completion", chat_template=False)
    # A conversation stays one row, every assistant turn after the first message trained at once.
    assert sft([{"messages": [USER, reply("4")]}])[0] == {"messages": [USER, reply("4")],
                                                           CONVERSATION: Conversation([USER, reply("4")], 1)}
    alpaca = {"instruction": "Add the numbers.", "input": "2 and 2", "output": "4"}
    assert sft([alpaca])[0]["prompt"] == ALPACA_WITH_INPUT.format(instruction="Add the numbers.", input="2 and 2")
    assert sft([{**alpaca, "input": ""}])[0]["prompt"] == ALPACA.format(instruction="Add the numbers.")
    chat_sft = completion_rows("prompt", "completion", chat_template=True)
    assert chat_sft([alpaca])[0]["prompt"] == [{"role": "user", "content": "Add the numbers.\n\n2 and 2"}]
    prompts = prompt_rows("prompt", chat_template=False)
    assert prompts([{"messages": [USER, reply("4")], "answer": "4"}])[0]["prompt"] == [USER]  # the reply dropped
    assert prompts([{"instruction": "Add.", "input": "", "output": "x"}])[0]["prompt"] == ALPACA.format(instruction="Add.")


@pytest.mark.parametrize("rows, message", [
    ([{"chosen": "abc", "rejected": "xyz", "_source": "p.jsonl:1"}], "p.jsonl:1: chosen and rejected share no prefix"),
    ([{"chosen": [reply("a")], "rejected": [reply("b")], "_source": "p.jsonl:1"}], "share no prefix"),
    ([{"prompt": "p", "chosen": "a", "rejected": "b", "_source": "p.jsonl:1"},
      {"chosen": "p a", "rejected": "p b", "_source": "p.jsonl:2"}],
     "p.jsonl:2: an implicit prompt, text row in a file of explicit prompt, text rows \\(p.jsonl:1\\)"),
    ([{"chosen": [USER, reply("4"), reply("5")], "rejected": [USER, reply("6")], "_source": "p.jsonl:1"}],
     "p.jsonl:1: field 'chosen' goes on for 2 messages .* must be one assistant message"),
])
def test_bad_preference_rows_name_the_row(rows, message):
    with pytest.raises(DataError, match=message):
        preference_rows("prompt", "chosen", "rejected")(rows)


def test_mixed_sft_shapes_and_a_conversation_without_a_reply_are_named():
    convert = completion_rows("prompt", "completion", chat_template=True)
    with pytest.raises(DataError, match="s.jsonl:2: an Alpaca row in a file of conversational rows"):
        convert([{"messages": [USER, reply("4")], "_source": "s.jsonl:1"},
                 {"instruction": "x", "output": "y", "_source": "s.jsonl:2"}])
    with pytest.raises(DataError, match="s.jsonl:1: field 'messages' must end with the assistant's reply"):
        convert([{"messages": [USER], "_source": "s.jsonl:1"}])


# ---------------------------------------------------------------- through the stages
def test_each_shape_through_the_stages_that_take_it(zoo, tmp_path):
    marker = "\n\nAssistant:"
    hh = write_jsonl(tmp_path / "hh.jsonl", [{"chosen": f"\n\nHuman: {p}{marker} good answer",
                                              "rejected": f"\n\nHuman: {p}{marker} bad answer, i do not know"}
                                             for p in PROMPTS] * 2)
    run(["rm", "--mode", "pairwise", "--model", zoo["llama"], "--data", hh, "--steps", 2, "--batch-size", 4,
         "--eval-fraction", 0.25, "--out", tmp_path / "rm_hh", *THREADS])
    chat_pairs = write_jsonl(tmp_path / "chat_pairs.jsonl", [
        {"chosen": [{"role": "user", "content": p}, reply("good answer")],
         "rejected": [{"role": "user", "content": p}, reply("bad answer")]} for p in PROMPTS] * 2)
    run(["rm", "--mode", "pairwise", "--model", zoo["qwen2"], "--data", chat_pairs, "--chat-template", "--steps", 2,
         "--batch-size", 4, "--eval-fraction", 0.25, "--out", tmp_path / "rm_chat", *THREADS])
    messages = write_jsonl(tmp_path / "messages.jsonl", [{"messages": [{"role": "user", "content": p},
                                                                      reply("good answer")]} for p in PROMPTS])
    run(["sft", "--model", zoo["qwen2"], "--data", messages, "--chat-template", "--steps", 2, "--batch-size", 4,
         "--out", tmp_path / "sft_chat", *THREADS])
    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": p, "input": "", "output": " good answer"}
                                                     for p in PROMPTS])
    run(["sft", "--model", zoo["llama"], "--data", alpaca, "--max-length", 128, "--steps", 2, "--batch-size", 4,
         "--out", tmp_path / "sft_alpaca", *THREADS])
    budget = ["--iterations", 1, "--batch-size", 4, "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 4,
              "--reward-fn", "ppo_rlhf_test_rewards:length_score", "--save-every", 0, *THREADS]
    run(["ppo", "--model", zoo["llama"], "--prompts", alpaca, "--max-length", 100, "--out", tmp_path / "ppo_alpaca",
         *budget])
    run(["ppo", "--model", zoo["qwen2"], "--prompts", messages, "--chat-template", "--max-length", 64,
         "--out", tmp_path / "ppo_chat", *budget])
    samples = [json.loads(line) for line in (tmp_path / "ppo_alpaca" / "samples.jsonl").open()]
    assert samples[0]["prompt"].startswith("Below is an instruction")


def test_a_mixed_file_exits_2_naming_the_line(zoo, tmp_path, capsys):
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"},
                                                   {"chosen": "p a", "rejected": "p b"}])
    err = run_failing(["rm", "--mode", "pairwise", "--model", zoo["llama"], "--data", mixed, "--out",
                       tmp_path / "rm", *THREADS], capsys)
    assert "mixed.jsonl:2" in err and "a file holds one shape" in err and "Traceback" not in err


# ---------------------------------------------------------------- names on the Hub, from the local cache
def cache_repo(hub: Path, kind: str, name: str, files: dict[str, Path | str]) -> None:
    """A repository as the Hugging Face cache holds it: refs/main naming a snapshot of the files."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = hub / f"{kind}s--{name.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for relative, source in files.items():
        (snapshot / relative).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(source, Path):
            (snapshot / relative).write_bytes(source.read_bytes())
        else:
            (snapshot / relative).write_text(source)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


def test_models_and_data_named_as_on_the_hub_come_from_the_local_cache(zoo, tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    cache_repo(hub, "model", "acme/tiny-llama", {f.name: f for f in Path(zoo["llama"]).iterdir() if f.is_file()})
    marker = "\n\nAssistant:"
    pairs = "".join(json.dumps({"chosen": f"\n\nHuman: {p}{marker} good answer",
                                "rejected": f"\n\nHuman: {p}{marker} bad answer"}) + "\n" for p in PROMPTS * 2)
    cache_repo(hub, "dataset", "acme/hh", {"data/train.jsonl": pairs})
    cache_repo(hub, "dataset", "acme/prompts", {"data/test.jsonl": "".join(json.dumps({"prompt": p}) + "\n"
                                                                           for p in PROMPTS)})
    run(["rm", "--mode", "pairwise", "--model", "acme/tiny-llama", "--data", "acme/hh", "--steps", 2, "--batch-size", 4,
         "--eval-fraction", 0.25, "--out", tmp_path / "rm", *THREADS])
    run(["ppo", "--model", "acme/tiny-llama", "--prompts", "acme/prompts", "--data-split", "test",
         "--reward-model", tmp_path / "rm" / "checkpoints" / "reward", "--iterations", 1, "--batch-size", 4,
         "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 4, "--max-length", 32, "--save-every", 0,
         "--out", tmp_path / "ppo", *THREADS])
    assert "--model acme/tiny-llama: the cached snapshot" in capsys.readouterr().out
    recorded = (tmp_path / "ppo" / "config.yaml").read_text()
    assert "models--acme--tiny-llama/snapshots/" in recorded  # the files the run read
    err = run_failing(["ppo", "--model", "acme/not-cached", "--prompts", "acme/prompts", "--data-split", "test",
                       "--reward-fn", "ppo_rlhf_test_rewards:length_score", "--out", tmp_path / "x", *THREADS], capsys)
    assert "--model acme/not-cached: not a folder here, and not in the local Hugging Face cache" in err
    assert "huggingface-cli download acme/not-cached" in err and "Traceback" not in err
    err = run_failing(["sft", "--model", "acme/tiny-llama", "--data", "acme/missing", "--out", tmp_path / "s",
                       *THREADS], capsys)
    assert "nor a data set in the local Hugging Face cache" in err and "--repo-type dataset acme/missing" in err
    err = run_failing(["rm", "--mode", "pairwise", "--model", "acme/tiny-llama", "--data", "acme/hh", "--data-split",
                       "validation", "--out", tmp_path / "r", *THREADS], capsys)
    assert "Unknown split" in err and "--data-split" in err
