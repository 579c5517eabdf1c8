"""``ppo-rlhf sft`` on conversations as TRL's SFTTrainer takes them (issue 63): an assistant
message's ``tool_calls`` (content empty or absent) and the tools' messages, rendered by the chat
template, one row a conversation with every assistant turn trained at once, the loss on the
assistant's tokens alone (trainers/sft_conversations.py)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from ppo_rlhf.config import build_config
from ppo_rlhf.data import DataError
from ppo_rlhf.envs.options import tool_template_path
from ppo_rlhf.envs.tools import ToolBox
from ppo_rlhf.formats import CONVERSATION, completion_rows
from ppo_rlhf.trainers.sft import SFTConfig, fit_rows, sft_token_rows
from toy_envs import add
from zoo import CHAT_TEMPLATE, THREADS, family_tokenizer, make_tokenizer, run, run_failing, write_jsonl

SCHEMA = ToolBox([add], 1.0).schemas[0]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}


def trace(content="", arguments=None) -> dict:
    """TRL's conversational row with a tool call: the call in ``tool_calls``, its content empty."""
    call = CALL if arguments is None else {**CALL, "function": {"name": "add", "arguments": arguments}}
    return {"messages": [{"role": "user", "content": "1 + 2?"},
                         {"role": "assistant", "content": content, "tool_calls": [call]},
                         {"role": "tool", "name": "add", "content": "3"},
                         {"role": "assistant", "content": "It is 3."}], "tools": [SCHEMA], "_source": "t.jsonl:1"}


def tool_tokenizer():
    tokenizer = make_tokenizer("qwen2")  # ChatML's turn tokens, EOS <|im_end|>
    tokenizer.chat_template = tool_template_path().read_text()
    return tokenizer


def learned_runs(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The text of each run of labelled tokens (each trained turn)."""
    runs, current = [], []
    for token, label in zip(ids, labels):
        if label != -100:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return [tokenizer.decode(run) for run in runs + ([current] if current else [])]


CONFIG = build_config(SFTConfig, {"chat_template": True, "max_length": 1024})


def test_a_trl_tool_call_trace_is_one_row_trained_on_the_assistants_turns_alone():
    tokenizer = tool_tokenizer()
    rows = completion_rows("prompt", "completion", True)([trace()])
    assert len(rows) == 1  # one row, not one per assistant turn
    [(ids, labels)] = sft_token_rows(tokenizer, rows, CONFIG, [tokenizer.eos_token_id])
    text = tokenizer.decode(ids)
    assert '"name": "add"' in text.split("<|im_start|>user")[0]  # the row's tools listed by the template
    # Both turns, each as the template writes it and closed by its end of turn; the tool's answer,
    # the user's question and the newline the template writes after a turn are context.
    assert learned_runs(tokenizer, ids, labels) == [
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call><|im_end|>', "It is 3.<|im_end|>"]
    assert text.endswith("It is 3.<|im_end|>\n") and ids[-1] != labels[-1]


def test_a_call_given_as_json_text_or_without_content_reads_as_trl_writes_it():
    tokenizer = tool_tokenizer()
    given = [trace(), trace(arguments='{"a": 1, "b": 2}'), {**trace(), "messages": [
        {k: v for k, v in m.items() if k != "content"} if m.get("tool_calls") else m for m in trace()["messages"]]}]
    token_rows = [sft_token_rows(tokenizer, completion_rows("prompt", "completion", True)([row]), CONFIG)[0]
                  for row in given]
    assert token_rows[1] == token_rows[0] and token_rows[2] == token_rows[0]


@pytest.mark.parametrize("family", ["qwen3", "llama3", "gpt_oss"])
def test_every_template_family_trains_its_own_call_format(family):
    tokenizer = family_tokenizer(family)
    rows = completion_rows("prompt", "completion", True)([trace()])
    [(ids, labels)] = sft_token_rows(tokenizer, rows, CONFIG)
    call, answer = learned_runs(tokenizer, ids, labels)
    assert '"a": 1' in call and "It is 3." in answer and "3\n" not in call  # the tool's answer is no target
    assert not call.endswith("\n") and not answer.endswith("\n")  # the template's newline after a turn: context


def test_a_prompt_and_completion_of_messages_trains_the_completions_turns():
    tokenizer = tool_tokenizer()
    messages = trace()["messages"]
    row = {"prompt": messages[:1], "completion": messages[1:], "tools": [SCHEMA], "_source": "t.jsonl:1"}
    rows = completion_rows("prompt", "completion", True)([row])
    assert sft_token_rows(tokenizer, rows, CONFIG) == sft_token_rows(
        tokenizer, completion_rows("prompt", "completion", True)([trace()]), CONFIG)


def test_a_template_that_drops_tool_calls_is_refused_naming_the_row_and_the_fix():
    tokenizer = make_tokenizer("qwen2")
    tokenizer.chat_template = CHAT_TEMPLATE  # role and content alone: no calls, no tools
    rows = completion_rows("prompt", "completion", True)([trace()])
    with pytest.raises(DataError, match=r"t.jsonl:1: .*leaves out assistant message 1's tool call \(add\).*"
                                        r"chatml_tools.jinja"):
        sft_token_rows(tokenizer, rows, CONFIG)


def test_a_template_that_rewrites_earlier_turns_is_refused():
    tokenizer = make_tokenizer("qwen2")
    # Writes only the last assistant message's content: an earlier turn renders otherwise once more follow.
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                               "{% if loop.last or m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
                               "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rows = completion_rows("prompt", "completion", True)([{"messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"}], "_source": "t.jsonl:1"}])
    with pytest.raises(DataError, match="t.jsonl:1: the chat template writes assistant message 1 differently"):
        sft_token_rows(tokenizer, rows, CONFIG)


@pytest.mark.parametrize("message, expected", [
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "message 1 (role 'user') field 'tool_calls'"),
    ({"role": "assistant", "content": "", "tool_calls": [{"name": "add"}]}, "call 0 must be"),
    ({"role": "assistant", "content": "", "tool_calls": []}, "non-empty list of calls"),
    ({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": "{a: 1"}}]}, "arguments that are text but not JSON"),
    ({"role": "assistant", "content": ""}, "message 1 (role 'assistant') has empty content"),
])
def test_malformed_tool_calls_are_named_by_row_and_message(message, expected):
    row = {"messages": [{"role": "user", "content": "1 + 2?"}, message, {"role": "assistant", "content": "3"}],
           "_source": "t.jsonl:1"}
    with pytest.raises(DataError) as refused:
        completion_rows("prompt", "completion", True)([row])
    assert str(refused.value).startswith("t.jsonl:1: field 'messages' ") and expected in str(refused.value)


def test_a_long_conversation_keeps_its_first_turns_and_says_it_was_cut(capsys):
    tokenizer = tool_tokenizer()
    rows = completion_rows("prompt", "completion", True)([trace()])
    [(ids, labels)] = sft_token_rows(tokenizer, rows, CONFIG)
    second_turn = max(i for i, label in enumerate(labels) if label != -100)
    config = build_config(SFTConfig, {"chat_template": True, "max_length": second_turn - 2})
    kept, longest = fit_rows(tokenizer, rows, config, [tokenizer.eos_token_id])
    assert len(kept) == 1 and longest == second_turn - 2
    assert kept[0]["_tokens"][1] < sum(label != -100 for label in labels)  # the last turn's end is not learned
    assert "1 of 1 rows cut" in capsys.readouterr().out


def test_a_turn_that_does_not_end_with_a_stop_token_is_said(capsys):
    tokenizer = make_tokenizer("qwen2")
    tokenizer.chat_template = CHAT_TEMPLATE
    rows = completion_rows("prompt", "completion", True)([{"messages": [{"role": "user", "content": "a"},
                                                                        {"role": "assistant", "content": "b"}],
                                                           "_source": "t.jsonl:1"}])
    fit_rows(tokenizer, rows, CONFIG, [tokenizer.convert_tokens_to_ids("<|endoftext|>")])  # a model stopping elsewhere
    printed = capsys.readouterr().out
    assert "warning: t.jsonl:1" in printed and "'<|im_end|>'" in printed and "eos_token_id" in printed


def test_sft_trains_a_trl_trace_file_one_row_a_conversation(tmp_path, capsys):
    from test_default_learning import users_tiny_model

    users_tiny_model(tmp_path / "model", arch="qwen2", positions=1024)
    rows = [trace() for _ in range(4)]
    for row in rows:
        row.pop("_source")
    data = write_jsonl(tmp_path / "traces.jsonl", rows)
    args = ["sft", "--model", tmp_path / "model", "--data", data, "--steps", 2, "--batch-size", 2,
            "--eval-fraction", 0, "--max-length", 1024, *THREADS]
    err = run_failing([*args, "--out", tmp_path / "refused"], capsys)  # without --chat-template: said
    assert "traces.jsonl:1" in err and "--chat-template" in err
    run([*args, "--chat-template", "--chat-template-file", tool_template_path(), "--out", tmp_path / "sft"])
    summary = json.loads((tmp_path / "sft" / "summary.json").read_text())
    assert summary["rows"] == 4 and summary["trained_tokens"] < summary["tokens"]
    saved = AutoTokenizer.from_pretrained(tmp_path / "sft" / "checkpoints" / "sft")
    assert "tool_call" in saved.chat_template  # the template it trained with, saved with the model


def test_conversations_of_the_training_template_for_qwen3_are_read_whole():
    tokenizer = family_tokenizer("qwen3")
    rows = completion_rows("prompt", "completion", True)([{**trace(), "messages": [
        *trace()["messages"], {"role": "user", "content": "And 2 + 2?"}, {"role": "assistant", "content": "4."}]}])
    [(ids, labels)] = sft_token_rows(tokenizer, rows, CONFIG)
    assert len(learned_runs(tokenizer, ids, labels)) == 3  # Qwen3's own template would rewrite the earlier turns
    assert rows[0][CONVERSATION].trained_from == 1
