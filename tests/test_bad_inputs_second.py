"""Bad inputs, second pass (issue 38: nothing silent), none of them in test_bad_inputs.py or
test_bad_inputs_more.py.

The same rules as there: a refusal is exit 2, no traceback, and a message naming the culprit; a
row that is only useless is dropped with a count.  The classes, each fixed where it starts:

- values parsed whole or refused: negative numbers as values, a task config read only in part,
  a tracker list that says none and something, a reward URL whose host or port cannot be valid
  (refused before any model loads: the cases name a model folder that does not exist);
- every data shape checked and named: each format the stages read crossed with each way a
  field can be wrong (``DATA_CASES``, generated), the file, line and field named;
- folders and adapters that say what they are: a critic where a policy is expected, an adapter
  where a full model is, a run folder given as a model, a resume of another stage's run;
- settings that imply others: a task with prompts of one's own, weights that zero every reward,
  one class to classify;
- the Python API's objects: a trainer trains once, a config is checked again when a trainer
  takes it, a config of another stage, a model or a reward object that cannot serve, rows given
  to ``step()`` that are not prompt rows.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ppo_rlhf import ConfigError, PPOConfig, PPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from ppo_rlhf.cli import main
from ppo_rlhf.config import build_config
from ppo_rlhf.config_yaml import load_yaml
from ppo_rlhf.data import DataError
from ppo_rlhf.models import ModelError, load_causal_lm, load_tokenizer
from test_bad_inputs import (  # noqa: F401 -- broken is a fixture the cases use
    PAIR, PROMPT, REWARD, ROW, TEXT, Bad, assert_refused, broken, evaluate, fill, gym, outcome, ppo, rm_classes,
    rm_pairs, rows, sft, write_files,
)
from zoo import REWARDS_MODULE

PROMPTS = {"data.jsonl": rows(PROMPT)}
NOWHERE = "{tmp}/no_such_model"  # a URL must be refused before the model is looked for


def ppo_without_model(*extra):
    return [NOWHERE if a == "{llama}" else a for a in ppo(*extra)]


def eval_task(*extra):
    """eval on a reasoning-gym task (its settings are read when the config is built)."""
    return ["eval", "--model", "{llama}", "--task", "reasoning-gym:chain_sum", "--size", 2, "--num-threads", 1, *extra]


CASES = [
    # ------------------------------------------------------------ values parsed whole or refused
    Bad("ppo-lr-negative-with-exponent", ppo("--lr", "-1e-3"), ("'lr'", "> 0"), PROMPTS),
    Bad("ppo-temperature-negative-with-exponent", ppo("--temperature", "-1e-2"), ("'temperature'", ">= 0.01"), PROMPTS),
    Bad("ppo-reward-weights-negative-list-for-one-reward", ppo("--reward-weights", "-0.5,1"),
        ("'reward_weights'", "2 weights", "1 reward"), PROMPTS),
    Bad("sft-eval-fraction-negative-with-exponent", sft("--eval-fraction", "-5e-2"), ("'eval_fraction'",),
        {"data.jsonl": rows(ROW)}),
    Bad("gym-lr-negative-with-exponent", gym("--lr", "-3e-4"), ("'lr'", "> 0")),
    Bad("eval-task-config-unclosed-bracket", eval_task("--task-config", "min_terms=2,max_terms=[3"),
        ("'task_config'", "max_terms=[3", "bracket")),
    Bad("eval-task-config-key-twice", eval_task("--task-config", "min_terms=2,min_terms=3"),
        ("'task_config'", "min_terms", "twice")),
    Bad("eval-task-config-value-not-yaml", eval_task("--task-config", "min_terms=2,max_terms=[1]]"),
        ("'task_config'", "max_terms=[1]]")),
    Bad("ppo-report-to-none-and-a-tracker", ppo("--report-to", "none,tensorboard"),
        ("--report-to", "none", "tensorboard", "alone"), PROMPTS),
    Bad("ppo-reward-url-without-host", ppo_without_model("--reward-url", "http://:8000/score"),
        ("'reward_url'", "http://:8000/score", "host"), PROMPTS),
    Bad("ppo-reward-url-port-out-of-range", ppo_without_model("--reward-url", "http://localhost:99999/score"),
        ("'reward_url'", "99999", "port"), PROMPTS),
    Bad("ppo-reward-url-port-not-a-number", ppo_without_model("--reward-url", "http://localhost:abc/score"),
        ("'reward_url'", "abc", "port"), PROMPTS),
    Bad("ppo-reward-url-port-zero", ppo_without_model("--reward-url", "http://localhost:0/score"),
        ("'reward_url'", "port"), PROMPTS),
    Bad("ppo-reward-url-host-with-a-space", ppo_without_model("--reward-url", "http://judge host/score"),
        ("'reward_url'", "judge host", "host"), PROMPTS),
    Bad("sft-yaml-key-twice-in-a-merged-mapping", sft("--config", "{tmp}/c.yaml"), ("steps", "twice"),
        {"data.jsonl": rows(ROW), "c.yaml": "<<: {steps: 1, steps: 2}\nlr: 0.001\n"}),
    # ------------------------------------------------------------ folders and adapters say what they are
    Bad("merge-a-critic-adapter", ["merge", "--adapter", "{critic_adapter}", "--out", "{out}"],
        ("{critic_adapter}", "critic", "value_head.safetensors")),
    Bad("eval-model-a-critic-adapter", evaluate("--model", "{critic_adapter}"), ("{critic_adapter}", "critic"), PROMPTS),
    Bad("ppo-model-a-critic-adapter", ppo("--model", "{critic_adapter}"), ("{critic_adapter}", "critic"), PROMPTS),
    Bad("ppo-reward-model-a-critic-adapter", ppo("--reward-fn", "", "--reward-model", "{critic_adapter}"),
        ("{critic_adapter}", "critic"), PROMPTS),
    Bad("eval-model-a-shared-critic-folder", evaluate("--model", "{shared_critic}"),
        ("{shared_critic}", "critic", "value head"), PROMPTS),
    Bad("eval-model-a-separate-critic-folder", evaluate("--model", "{full_critic}"), ("{full_critic}", "critic"),
        PROMPTS),
    Bad("eval-model-a-reward-adapter", evaluate("--model", "{reward_adapter}"), ("{reward_adapter}", "reward adapter"),
        PROMPTS),
    Bad("eval-model-a-run-folder", evaluate("--model", "{sft_run}"), ("{sft_run}", "run folder", "checkpoints/sft"),
        PROMPTS),
    Bad("ppo-model-a-run-folder", ppo("--model", "{ppo_run}"), ("{ppo_run}", "run folder", "checkpoints/actor"),
        PROMPTS),
    Bad("ppo-reward-model-a-run-folder", ppo("--reward-fn", "", "--reward-model", "{rm_run}"),
        ("{rm_run}", "run folder", "checkpoints/reward"), PROMPTS),
    Bad("sft-model-a-lora-adapter", sft("--model", "{adapter}"), ("{adapter}", "LoRA adapter", "ppo-rlhf merge"),
        {"data.jsonl": rows(ROW)}),
    Bad("rm-model-a-lora-adapter", rm_pairs("--model", "{adapter}"), ("{adapter}", "LoRA adapter", "ppo-rlhf merge"),
        {"data.jsonl": rows(PAIR)}),
    Bad("ppo-resume-an-sft-run", ppo("--resume", "--out", "{sft_run}"), ("{sft_run}", "an sft run", "ppo-rlhf sft"),
        PROMPTS),
    Bad("sft-resume-a-ppo-run", sft("--resume", "--out", "{ppo_run}"), ("{ppo_run}", "a ppo run", "ppo-rlhf ppo"),
        {"data.jsonl": rows(ROW)}),
    Bad("rm-resume-an-sft-run", rm_pairs("--resume", "--out", "{sft_run}"), ("{sft_run}", "an sft run"),
        {"data.jsonl": rows(PAIR)}),
    # ------------------------------------------------------------ settings that imply others
    Bad("ppo-task-and-prompts", ppo("--task", "doubling"), ("--prompts", "--task doubling"), PROMPTS),
    Bad("eval-task-and-prompts", evaluate("--task", "doubling"), ("--prompts", "--task doubling"), PROMPTS),
    Bad("ppo-reward-weight-zero", ppo("--reward-weights", "0"), ("'reward_weights'", "0", "every reward"), PROMPTS),
    Bad("ppo-reward-weights-all-zero", ppo("--reward-fn", f"{REWARDS_MODULE}:long_answer", "--reward-weights", "0,0"),
        ("'reward_weights'", "every reward"), PROMPTS),
    Bad("rm-classification-one-label", rm_classes("--num-labels", 1), ("'num_labels'", "classification"),
        {"data.jsonl": rows(TEXT)}),
]


# ---------------------------------------------------------------- every data shape x every malformed field
USER = {"role": "user", "content": "hello world"}


def said(text: str, role: str = "assistant") -> dict:
    return {"role": role, "content": text}


HH = "\n\nHuman: hello world\n\nAssistant:"


@dataclass
class Shape:
    """One data format a stage reads: a good row, and the command that reads a file of them."""

    stage: str
    row: dict
    args: list
    chat: bool = False


SHAPES = {
    "sft-prompt-completion": Shape("sft", ROW, sft()),
    "sft-prompt-completion-chat": Shape("sft", {"prompt": [USER], "completion": " good answer"},
                                        sft("--chat-template", "--model", "{qwen2}"), chat=True),
    "sft-conversational": Shape("sft", {"messages": [USER, said("good answer")]},
                                sft("--chat-template", "--model", "{qwen2}"), chat=True),
    "sft-alpaca": Shape("sft", {"instruction": "Say hello.", "input": "to Bob", "output": "hello Bob"},
                        sft("--chat-template", "--model", "{qwen2}")),
    "rm-explicit-text": Shape("rm", PAIR, rm_pairs()),
    "rm-explicit-chat": Shape("rm", {"prompt": [USER], "chosen": [said("good")], "rejected": [said("bad")]},
                              rm_pairs("--chat-template", "--model", "{qwen2}"), chat=True),
    "rm-implicit-text": Shape("rm", {"chosen": HH + " good answer", "rejected": HH + " bad answer"}, rm_pairs()),
    "rm-implicit-chat": Shape("rm", {"chosen": [USER, said("good")], "rejected": [USER, said("bad")]},
                              rm_pairs("--chat-template", "--model", "{qwen2}"), chat=True),
    "ppo-prompt": Shape("ppo", PROMPT, ppo()),
    "ppo-prompt-chat": Shape("ppo", {"prompt": [USER]}, ppo("--chat-template", "--model", "{qwen2}"), chat=True),
    "ppo-conversational": Shape("ppo", {"messages": [USER, said("good answer")]},
                                ppo("--chat-template", "--model", "{qwen2}"), chat=True),
    "ppo-alpaca": Shape("ppo", {"instruction": "Say hello.", "input": "to Bob"}, ppo()),
}


@dataclass
class DataCase:
    id: str
    shape: str
    bad: dict  # the malformed row: line 2 of the file (and 4), after a good row
    expect: tuple  # what the message names, besides the file and line
    dropped: bool = False  # a useless row: dropped with a count, the rest used
    everywhere: bool = False  # every row malformed (a file nearly of a format): line 1

    @property
    def line(self) -> int:
        return 1 if self.everywhere else 2


def changed(shape: str, **fields) -> dict:
    return {**SHAPES[shape].row, **fields}


def lacking(shape: str, key: str) -> dict:
    return {k: v for k, v in SHAPES[shape].row.items() if k != key}


DATA_CASES = [
    # sft, {prompt, completion}
    DataCase("sft-prompt-null", "sft-prompt-completion", changed("sft-prompt-completion", prompt=None), ("'prompt'",)),
    DataCase("sft-completion-a-number", "sft-prompt-completion", changed("sft-prompt-completion", completion=7),
             ("'completion'", "int")),
    DataCase("sft-completion-missing-in-a-later-row", "sft-prompt-completion", lacking("sft-prompt-completion", "completion"),
             ("missing field 'completion'",)),
    DataCase("sft-prompt-message-of-an-unknown-role", "sft-prompt-completion-chat",
             changed("sft-prompt-completion-chat", prompt=[said("hi", "robot")]), ("'prompt'", "'robot'", "user")),
    DataCase("sft-prompt-ending-with-the-assistant", "sft-prompt-completion-chat",
             changed("sft-prompt-completion-chat", prompt=[USER, said("hi")]), ("'prompt'", "assistant")),
    DataCase("sft-prompt-message-empty", "sft-prompt-completion-chat",
             changed("sft-prompt-completion-chat", prompt=[said("", "user")]), ("'prompt'", "empty")),
    DataCase("sft-prompt-message-without-content", "sft-prompt-completion-chat",
             changed("sft-prompt-completion-chat", prompt=[{"role": "user"}]), ("'prompt'", "content")),
    # sft, {messages}
    DataCase("sft-messages-null", "sft-conversational", {"messages": None}, ("'messages'",)),
    DataCase("sft-messages-a-string", "sft-conversational", {"messages": "hello"}, ("'messages'", "str")),
    DataCase("sft-messages-of-an-unknown-role", "sft-conversational",
             {"messages": [said("hi", "robot"), said("ok")]}, ("'messages'", "'robot'")),
    DataCase("sft-messages-empty-content", "sft-conversational", {"messages": [said("", "user"), said("ok")]},
             ("'messages'", "empty")),
    DataCase("sft-messages-reply-without-content", "sft-conversational", {"messages": [USER, {"role": "assistant"}]},
             ("'messages'", "content")),
    DataCase("sft-messages-reply-a-number", "sft-conversational", {"messages": [USER, said(5)]},
             ("'messages'", "content", "int")),
    DataCase("sft-messages-missing-in-a-later-row", "sft-conversational", {"question": "hello"},
             ("missing field 'messages'",)),
    # sft, Alpaca
    DataCase("sft-alpaca-instruction-null", "sft-alpaca", changed("sft-alpaca", instruction=None), ("'instruction'",)),
    DataCase("sft-alpaca-instruction-a-number", "sft-alpaca", changed("sft-alpaca", instruction=3),
             ("'instruction'", "int")),
    DataCase("sft-alpaca-input-a-number", "sft-alpaca", changed("sft-alpaca", input=3), ("'input'", "int")),
    DataCase("sft-alpaca-output-null", "sft-alpaca", changed("sft-alpaca", output=None), ("'output'",)),
    DataCase("sft-alpaca-output-a-number", "sft-alpaca", changed("sft-alpaca", output=5), ("'output'", "int")),
    DataCase("sft-alpaca-output-missing-in-a-later-row", "sft-alpaca", lacking("sft-alpaca", "output"),
             ("missing field 'output'",)),
    DataCase("sft-nearly-alpaca-without-instruction", "sft-alpaca", lacking("sft-alpaca", "instruction"),
             ("'instruction'", "Alpaca"), everywhere=True),
    # rm, {prompt, chosen, rejected} as text
    DataCase("rm-chosen-null", "rm-explicit-text", changed("rm-explicit-text", chosen=None), ("'chosen'",)),
    DataCase("rm-rejected-a-number", "rm-explicit-text", changed("rm-explicit-text", rejected=4), ("'rejected'", "int")),
    DataCase("rm-rejected-missing-in-a-later-row", "rm-explicit-text", lacking("rm-explicit-text", "rejected"),
             ("missing field 'rejected'",)),
    DataCase("rm-chosen-empty", "rm-explicit-text", changed("rm-explicit-text", chosen=""), ("'chosen'", "empty"),
             dropped=True),
    # rm, a prompt and replies as messages
    DataCase("rm-chat-reply-of-the-user", "rm-explicit-chat", changed("rm-explicit-chat", chosen=[said("x", "user")]),
             ("'chosen'", "assistant")),
    DataCase("rm-chat-reply-a-number", "rm-explicit-chat", changed("rm-explicit-chat", chosen=[said(3)]),
             ("'chosen'", "content", "int")),
    DataCase("rm-chat-reply-without-content", "rm-explicit-chat",
             changed("rm-explicit-chat", rejected=[{"role": "assistant"}]), ("'rejected'", "content")),
    DataCase("rm-chat-prompt-of-an-unknown-role", "rm-explicit-chat",
             changed("rm-explicit-chat", prompt=[said("hi", "robot")]), ("'prompt'", "'robot'")),
    DataCase("rm-chat-prompt-ending-with-the-assistant", "rm-explicit-chat",
             changed("rm-explicit-chat", prompt=[USER, said("hi")]), ("'prompt'", "assistant")),
    DataCase("rm-chat-reply-empty", "rm-explicit-chat", changed("rm-explicit-chat", rejected=[said("")]),
             ("'rejected'", "empty"), dropped=True),
    # rm, {chosen, rejected} as text with an implicit prompt (hh-rlhf)
    DataCase("rm-implicit-chosen-null", "rm-implicit-text", changed("rm-implicit-text", chosen=None), ("'chosen'",)),
    DataCase("rm-implicit-rejected-a-number", "rm-implicit-text", changed("rm-implicit-text", rejected=2),
             ("'rejected'", "int")),
    DataCase("rm-implicit-reply-empty", "rm-implicit-text", changed("rm-implicit-text", rejected=HH),
             ("'rejected'", "empty"), dropped=True),
    DataCase("rm-implicit-reply-a-prefix-of-the-other", "rm-implicit-text",
             {"chosen": "The sky is blue", "rejected": "The sky is"}, ("'rejected'", "empty"), dropped=True),
    DataCase("rm-implicit-rejected-missing-in-a-later-row", "rm-implicit-text", lacking("rm-implicit-text", "rejected"),
             ("missing field 'rejected'",)),
    DataCase("rm-nearly-pairs-without-rejected", "rm-implicit-text", lacking("rm-implicit-text", "rejected"),
             ("missing field 'rejected'",), everywhere=True),
    # rm, {chosen, rejected} as conversations
    DataCase("rm-conversation-of-an-unknown-role", "rm-implicit-chat",
             {"chosen": [said("hi", "robot"), said("good")], "rejected": [said("hi", "robot"), said("bad")]},
             ("'chosen'", "'robot'")),
    DataCase("rm-conversation-rejected-a-string", "rm-implicit-chat", changed("rm-implicit-chat", rejected="bad"),
             ("'rejected'", "str")),
    DataCase("rm-conversation-ending-with-the-user", "rm-implicit-chat",
             changed("rm-implicit-chat", chosen=[USER, said("more", "user")]), ("'chosen'", "assistant")),
    DataCase("rm-conversation-reply-empty", "rm-implicit-chat", changed("rm-implicit-chat", rejected=[USER, said("")]),
             ("'rejected'", "empty"), dropped=True),
    DataCase("rm-conversation-reply-without-content", "rm-implicit-chat",
             changed("rm-implicit-chat", chosen=[USER, {"role": "assistant"}]), ("'chosen'", "content")),
    # ppo, {prompt}
    DataCase("ppo-prompt-null", "ppo-prompt", {"prompt": None}, ("'prompt'",)),
    DataCase("ppo-prompt-missing-in-a-later-row", "ppo-prompt", {"question": "hello"}, ("missing field 'prompt'",)),
    DataCase("ppo-prompt-ending-with-the-assistant", "ppo-prompt-chat", {"prompt": [USER, said("hi")]},
             ("'prompt'", "assistant")),
    DataCase("ppo-prompt-message-of-an-unknown-role", "ppo-prompt-chat", {"prompt": [said("hi", "robot")]},
             ("'prompt'", "'robot'")),
    DataCase("ppo-prompt-message-empty", "ppo-prompt-chat", {"prompt": [said("", "user")]}, ("'prompt'", "empty")),
    # ppo, {messages}
    DataCase("ppo-messages-null", "ppo-conversational", {"messages": None}, ("'messages'",)),
    DataCase("ppo-messages-of-an-unknown-role", "ppo-conversational", {"messages": [said("hi", "robot")]},
             ("'messages'", "'robot'")),
    DataCase("ppo-messages-empty-content", "ppo-conversational", {"messages": [said(" ", "user"), said("ok")]},
             ("'messages'", "empty")),
    DataCase("ppo-messages-missing-in-a-later-row", "ppo-conversational", {"question": "hello"},
             ("missing field 'messages'",)),
    # ppo, Alpaca
    DataCase("ppo-alpaca-instruction-null", "ppo-alpaca", changed("ppo-alpaca", instruction=None), ("'instruction'",)),
    DataCase("ppo-alpaca-instruction-a-number", "ppo-alpaca", changed("ppo-alpaca", instruction=12),
             ("'instruction'", "int")),
    DataCase("ppo-alpaca-input-a-list", "ppo-alpaca", changed("ppo-alpaca", input=["to Bob"]), ("'input'", "list")),
    DataCase("ppo-nearly-alpaca-without-instruction", "ppo-alpaca", {"input": "to Bob"}, ("'instruction'", "Alpaca"),
             everywhere=True),
]


# ---------------------------------------------------------------- folders that are not what the flag expects
@pytest.fixture(scope="module")
def folders(zoo, broken, tmp_path_factory):
    """A critic adapter (a policy adapter with a value head beside it), a shared critic's folder
    (its value head alone), a separate critic (a trunk and a value head), a reward adapter, and
    run folders of sft, rm and ppo with their resumable checkpoints."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoModelForSequenceClassification

    from ppo_rlhf.config import to_dict
    from ppo_rlhf.models.value import VALUE_HEAD, ValueHead

    root = tmp_path_factory.mktemp("folders")  # the folders' names say nothing: a message must
    head = {k: v.contiguous() for k, v in ValueHead(32).state_dict().items()}
    made = {}
    made["critic_adapter"] = Path(shutil.copytree(broken["adapter"], root / "f1"))
    save_file(head, str(made["critic_adapter"] / VALUE_HEAD))
    made["shared_critic"] = root / "f2"
    made["shared_critic"].mkdir()
    save_file(head, str(made["shared_critic"] / VALUE_HEAD))
    made["full_critic"] = root / "f3"
    AutoModel.from_pretrained(zoo["llama"]).save_pretrained(made["full_critic"])
    load_tokenizer(zoo["llama"]).save_pretrained(made["full_critic"])
    save_file(head, str(made["full_critic"] / VALUE_HEAD))
    classifier = AutoModelForSequenceClassification.from_pretrained(zoo["llama"], num_labels=1)
    get_peft_model(classifier, LoraConfig(r=2, target_modules=["q_proj"], task_type="SEQ_CLS")).save_pretrained(
        root / "f4")
    made["reward_adapter"] = root / "f4"

    def run_folder(name: str, config, model_folder: str) -> Path:
        out = root / name
        shutil.copytree(zoo["llama"], out / "checkpoints" / model_folder)
        last = out / "checkpoints" / "last"
        last.mkdir()
        (last / "run_config.json").write_text(json.dumps({**to_dict(config), "processes": 1, "sharded": False}))
        save_file({"w": torch.zeros(1)}, str(last / "trained.safetensors"))
        torch.save({"step": 1}, last / "trainer_state.pt")
        (out / "config.yaml").write_text("steps: 1\n")
        (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
        return out

    made["sft_run"] = run_folder("f5", SFTConfig(model=str(zoo["llama"]), data="d.jsonl"), "sft")
    made["rm_run"] = run_folder("f6", RewardConfig(model=str(zoo["llama"]), data="d.jsonl"), "reward")
    made["ppo_run"] = run_folder("f7", PPOConfig(model=str(zoo["llama"]), prompts="p.jsonl"), "actor")
    return made


def places_for(zoo, broken, folders, tmp_path) -> dict:
    return {**{k: str(v) for k, v in zoo.items() if isinstance(v, (str, Path))},
            **{k: str(v) for k, v in broken.items()}, **{k: str(v) for k, v in folders.items()},
            "tmp": str(tmp_path), "out": str(tmp_path / "out")}


def files_in(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_input_is_named_and_stops_the_run(case: Bad, zoo, broken, folders, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    places = places_for(zoo, broken, folders, tmp_path)
    write_files(tmp_path, case.files)
    before = {name: files_in(folders[name]) for name in ("sft_run", "rm_run", "ppo_run")}
    assert_refused([fill(a, places) for a in case.args], case.expect, places, capsys)
    for name, held in before.items():
        assert files_in(folders[name]) == held, f"the {name} folder was changed"


@pytest.mark.parametrize("case", DATA_CASES, ids=[case.id for case in DATA_CASES])
def test_each_data_shape_names_the_file_line_and_field_of_a_malformed_row(case: DataCase, zoo, tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    shape = SHAPES[case.shape]
    data = [case.bad] * 4 if case.everywhere else [shape.row, case.bad] * 2
    write_files(tmp_path, {"data.jsonl": data})
    places = {**{k: str(v) for k, v in zoo.items() if isinstance(v, (str, Path))}, "tmp": str(tmp_path),
              "out": str(tmp_path / "out")}
    args = [fill(a, places) for a in shape.args]
    where = f"data.jsonl:{case.line}"
    if not case.dropped:
        assert_refused(args, (where, *case.expect), places, capsys)
        return
    code, raised = outcome(args)
    printed = capsys.readouterr()
    assert raised is None, f"traceback:\n{raised}"
    assert code == 0, printed.err[-2000:]
    for text in ("dropped 2 of 4 rows", where, *case.expect):
        assert text in printed.out, f"{text!r} not in: {printed.out}"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_file_of_good_rows_of_each_shape_is_read(name, zoo, tmp_path, monkeypatch):
    """The good rows the data cases start from: each shape as it is read without complaint."""
    monkeypatch.chdir(tmp_path)
    write_files(tmp_path, {"data.jsonl": [SHAPES[name].row] * 4})
    places = {**{k: str(v) for k, v in zoo.items() if isinstance(v, (str, Path))}, "tmp": str(tmp_path),
              "out": str(tmp_path / "out")}
    assert main([fill(a, places) for a in SHAPES[name].args]) == 0


def test_every_shape_meets_the_defects_its_fields_can_have():
    """The generated table: every shape with several defects, each shape of chat messages with a
    role outside the template's, each pair shape with a reply that comes out empty."""
    by_shape = {name: [case for case in DATA_CASES if case.shape == name] for name in SHAPES}
    assert all(len(cases) >= 2 for cases in by_shape.values()), {k: len(v) for k, v in by_shape.items()}
    for name, shape in SHAPES.items():
        if shape.chat:
            assert any("'robot'" in case.expect for case in by_shape[name]), name
        if shape.stage == "rm":
            assert any(case.dropped for case in by_shape[name]), name


# ---------------------------------------------------------------- values parsed whole: what now reads
def test_negative_numbers_are_read_as_values(tmp_path):
    from ppo_rlhf.cli import build_parser
    from ppo_rlhf.config import config_from_args

    args = build_parser().parse_args(["ppo", "--entropy-coef", "-1e-3", "--reward-weights", "-0.5,1",
                                      "--reward-fn", "a.py:f", "--reward-fn", "b.py:g"])
    config = config_from_args(PPOConfig, args)
    assert config.entropy_coef == -1e-3 and config.reward_weights == [-0.5, 1.0]


def test_a_path_with_a_comma_is_one_reward_function(tmp_path):
    folder = tmp_path / "a,b"
    folder.mkdir()
    (folder / "rewards.py").write_text("def score(prompts, responses):\n    return [0.0] * len(responses)\n")
    path = f"{folder}/rewards.py:score"
    assert build_config(PPOConfig, {"reward_fn": [path]}).reward_fn == [path]
    assert build_config(PPOConfig, {"reward_fn": [path, "m:f,n:g"]}).reward_fn == [path, "m:f", "n:g"]


def test_yaml_merge_keys_are_read_and_a_key_given_twice_is_still_refused(tmp_path):
    merged = tmp_path / "merged.yaml"
    merged.write_text("<<: &common {seed: 3, lr: 0.5}\nlr: 0.001\n")  # an explicit key overrides a merged one
    assert load_yaml(merged) == {"seed": 3, "lr": 0.001}
    twice = tmp_path / "twice.yaml"
    twice.write_text("<<: {seed: 3}\nlr: 0.001\nlr: 0.002\n")
    with pytest.raises(ConfigError, match="'lr' is given twice"):
        load_yaml(twice)


# ---------------------------------------------------------------- settings that imply others say so
@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="reasoning-gym is not installed")
def test_a_task_that_formats_prompts_with_the_chat_template_names_itself(zoo, tmp_path, capsys):
    code, raised = outcome([str(a) for a in ["ppo", "--model", zoo["llama"], "--task", "reasoning-gym:chain_sum",
                                             "--task-size", 8, "--task-eval-size", 2, "--out", tmp_path / "out",
                                             "--num-threads", 1]])
    err = capsys.readouterr().err
    assert raised is None and code == 2, err
    assert "--task reasoning-gym:chain_sum" in err and "chat template" in err
    assert "drop --chat-template" not in err  # the user never gave it


PLAN = ["--iterations", 1, "--batch-size", 2, "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 4,
        "--max-length", 32, "--eval-every", 0, "--save-every", 0, "--num-threads", 1]


def test_lora_on_a_tied_output_layer_says_it_is_not_adapted(zoo, tmp_path, capsys):
    assert main([str(a) for a in ["ppo", "--model", zoo["qwen2"], "--prompts", zoo["prompts"], "--reward-fn", REWARD,
                                  "--lora", "--out", tmp_path / "out", *PLAN]]) == 0
    printed = capsys.readouterr().out
    warning = next((line for line in printed.splitlines() if line.startswith("warning: --lora")), "")
    assert "output layer" in warning and "tied" in warning and "not adapted" in warning, printed
    # It says when it matters: a model this small; a larger one (SmolLM2, the agents recipes') trains its other layers.
    assert "under 50M" in warning and "SmolLM2-135M" in warning, warning


def test_lora_on_a_tied_output_layer_of_a_larger_model_is_a_plan_line_not_a_warning(zoo, tmp_path, capsys,
                                                                                    monkeypatch):
    from ppo_rlhf.trainers import ppo_plan

    monkeypatch.setattr(ppo_plan, "SMALL_MODEL", 1000)  # the zoo's model taken for one past the bound
    assert main([str(a) for a in ["ppo", "--model", zoo["qwen2"], "--prompts", zoo["prompts"], "--reward-fn", REWARD,
                                  "--lora", "--out", tmp_path / "out", *PLAN]]) == 0
    printed = capsys.readouterr().out
    assert "warning: --lora" not in printed, printed  # the agents recipes' --lora on SmolLM2 is not contradicted
    actor = next(line for line in printed.splitlines() if line.strip().startswith("actor:"))
    assert "tied to the input embeddings, not adapted" in actor, actor


def test_a_temperature_that_samples_like_greedy_decoding_warns(zoo, tmp_path, capsys):
    assert main([str(a) for a in ["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn", REWARD,
                                  "--temperature", "0.01", "--out", tmp_path / "out", *PLAN]]) == 0
    printed = capsys.readouterr().out
    assert any(line.startswith("warning:") and "--temperature 0.01" in line for line in printed.splitlines()), printed


def test_overwrite_of_a_run_whose_checkpoints_cannot_be_deleted_is_refused_and_deletes_nothing(zoo, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoints" / "sft").mkdir(parents=True)
    (out / "checkpoints" / "sft" / "model.safetensors").write_text("weights")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    held = files_in(out)
    locked = out / "checkpoints"
    os.chmod(locked, 0o555)
    immutable = os.geteuid() == 0  # root ignores permission bits: the folder is made immutable instead
    if immutable and subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        os.chmod(locked, 0o755)
        pytest.skip("cannot make a folder read-only here (root without chattr)")
    try:
        (tmp_path / "data.jsonl").write_text(json.dumps(ROW) + "\n")
        code, raised = outcome([fill(str(a), {"gpt2": str(zoo["gpt2"]), "tmp": str(tmp_path), "out": str(out)})
                                for a in sft("--overwrite")])
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(locked)], check=True)
        os.chmod(locked, 0o755)
    err = capsys.readouterr().err
    assert raised is None, raised
    assert code == 2 and str(locked) in err and "--overwrite" in err, err
    assert files_in(out) == held


# ---------------------------------------------------------------- the Python API: every object x reuse
BUDGET = {"batch_size": 2, "mini_batch_size": 2, "ppo_epochs": 1, "max_new_tokens": 4, "max_length": 32,
          "eval_every": 0, "save_every": 1, "num_threads": 1}
SCRATCH = {"task": "doubling", "steps": 2, "batch_size": 4, "n_layer": 1, "n_head": 2, "n_embd": 16, "num_threads": 1}


def length_reward(prompts, responses, **columns):
    return [float(len(response)) for response in responses]


def one_reward(prompts, responses, **columns):
    return [1.0] * len(responses)


def trainer_of(kind: str, zoo, out: Path, **changes):
    """A trainer of each kind, ready to train into ``out``."""
    if kind == "ppo":
        config = PPOConfig(model=str(zoo["llama"]), prompts=str(zoo["prompts"]), out=str(out), iterations=1, **BUDGET,
                           **changes)
        return PPOTrainer(config, reward=length_reward)
    if kind == "sft":
        return SFTTrainer(SFTConfig(**SCRATCH, eval_every=0, out=str(out), **changes))
    return RewardTrainer(RewardConfig(**SCRATCH, out=str(out), **changes))


KINDS = ["ppo", "sft", "rm"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_trainer_trains_once_and_a_second_train_deletes_nothing(kind, zoo, tmp_path):
    out = tmp_path / "run"
    trainer = trainer_of(kind, zoo, out, overwrite=True)
    trainer.train()
    held = files_in(out)
    with pytest.raises(ConfigError, match=r"train\(\) ran already.*resume"):
        trainer.train()
    assert files_in(out) == held


@pytest.mark.parametrize("kind, key, value", [("ppo", "batch_size", -1), ("sft", "steps", 0), ("rm", "lr", float("nan"))])
def test_a_config_changed_after_it_was_built_is_checked_when_a_trainer_takes_it(kind, key, value, zoo, tmp_path):
    config = {"ppo": PPOConfig(model=str(zoo["llama"]), prompts=str(zoo["prompts"]), out=str(tmp_path / "o"), **BUDGET),
              "sft": SFTConfig(**SCRATCH, out=str(tmp_path / "o")), "rm": RewardConfig(**SCRATCH, out=str(tmp_path / "o"))}[kind]
    setattr(config, key, value)
    trainer = {"ppo": lambda c: PPOTrainer(c, reward=length_reward), "sft": SFTTrainer, "rm": RewardTrainer}[kind]
    with pytest.raises(ConfigError, match=f"'{key}'"):
        trainer(config)
    assert not (tmp_path / "o").exists()


def test_a_setting_the_check_filled_in_is_filled_in_again_for_a_changed_config(zoo, tmp_path):
    """vf_coef is resolved for gae when the config is built; switching the estimator afterwards
    is checked as if the estimator had been given so from the start."""
    config = PPOConfig(model=str(zoo["llama"]), prompts=str(zoo["prompts"]), out=str(tmp_path / "o"), **BUDGET)
    assert config.vf_coef is not None
    config.estimator, config.samples_per_prompt = "grpo", 2
    trainer = PPOTrainer(config, reward=length_reward)
    assert trainer.critic is None and config.vf_coef is None and config.loss_aggregation == "sequence-mean"


@pytest.mark.parametrize("trainer, wanted, given", [("PPOTrainer", "PPOConfig", "SFTConfig"),
                                                    ("SFTTrainer", "SFTConfig", "PPOConfig"),
                                                    ("RewardTrainer", "RewardConfig", "SFTConfig")])
def test_a_config_of_another_stage_is_named(trainer, wanted, given, tmp_path):
    import ppo_rlhf

    config = getattr(ppo_rlhf, given)(out=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match=f"{trainer} takes a {wanted}, got a {given}"):
        getattr(ppo_rlhf, trainer)(config)


def tiny_model(vocab_size: int, classifier: bool = False):
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab_size, n_embd=16, n_layer=1, n_head=2, num_labels=1, pad_token_id=0)
    return (GPT2ForSequenceClassification if classifier else GPT2LMHeadModel)(config)


def in_memory(zoo, tmp_path, **kwargs):
    config = PPOConfig(prompts=str(zoo["prompts"]), out=str(tmp_path / "o"), iterations=1, **BUDGET)
    return PPOTrainer(config, **{"reward": length_reward, "model": load_causal_lm(zoo["llama"]),
                                 "tokenizer": load_tokenizer(zoo["llama"]), **kwargs})


def test_a_model_whose_vocabulary_does_not_match_the_tokenizer_is_named(zoo, tmp_path):
    with pytest.raises(ModelError, match="model=.*50 tokens.*320"):
        in_memory(zoo, tmp_path, model=tiny_model(50))


def test_a_causal_lm_given_as_the_reward_is_named(zoo, tmp_path):
    with pytest.raises(ModelError, match="reward=.*causal language model.*sequence classifier"):
        in_memory(zoo, tmp_path, reward=load_causal_lm(zoo["llama"]))


def test_a_reward_classifier_of_a_smaller_vocabulary_is_named(zoo, tmp_path):
    with pytest.raises(ModelError, match="reward=.*50 tokens.*320"):
        in_memory(zoo, tmp_path, reward=tiny_model(50, classifier=True))


def test_a_reward_class_given_for_an_instance_is_named(zoo, tmp_path):
    from ppo_rlhf import ScoringReward

    class Mine(ScoringReward):
        def __call__(self, batch):
            return torch.zeros(len(batch.rows))

    with pytest.raises(ConfigError, match="Mine.*class.*Mine\\(\\)"):
        in_memory(zoo, tmp_path, reward=Mine)


def test_a_scoring_reward_without_a_call_is_named(zoo, tmp_path):
    from ppo_rlhf import ScoringReward

    class Unfinished(ScoringReward):
        pass

    with pytest.raises(ConfigError, match="Unfinished.*__call__"):
        in_memory(zoo, tmp_path, reward=Unfinished())


@pytest.mark.parametrize("rows, expect", [
    ([{"question": "hello"}, {"question": "you are"}], "step\\(\\).*row 0.*'prompt'.*question"),
    (["hello", "you are"], "step\\(\\).*row 0.*dict.*str"),
    ([{"prompt": 5}, {"prompt": 6}], "step\\(\\).*row 0.*'prompt'.*int"),
])
def test_rows_given_to_step_that_are_not_prompt_rows_are_named(rows, expect, zoo, tmp_path):
    trainer = in_memory(zoo, tmp_path)
    with pytest.raises(DataError, match=expect):
        trainer.step(rows)


def test_a_list_of_rewards_with_weights_as_the_docs_show_it(zoo, tmp_path):
    config = PPOConfig(model=str(zoo["llama"]), prompts=str(zoo["prompts"]), out=str(tmp_path / "o"), iterations=1,
                       reward_weights=[1, 0.2], **BUDGET)
    trainer = PPOTrainer(config, reward=[length_reward, one_reward])
    assert trainer.reward.weights == [1.0, 0.2]
    metrics = trainer.step([{"prompt": "hello"}, {"prompt": "you are"}])
    assert {"reward/length_reward", "reward/one_reward"} <= set(metrics)


def test_a_list_of_rewards_with_another_count_of_weights_is_named(zoo, tmp_path):
    config = PPOConfig(model=str(zoo["llama"]), prompts=str(zoo["prompts"]), out=str(tmp_path / "o"),
                       reward_weights=[1, 0.2, 3], **BUDGET)
    with pytest.raises(ConfigError, match="3 reward weights for 2 rewards"):
        PPOTrainer(config, reward=[length_reward, one_reward])


# Python cases of the classes above, counted with the tables.
PYTHON_CASES = {
    "api: second train() of a trainer (x3)": 3, "api: config changed after it was built (x3)": 3,
    "api: config of another stage (x3)": 3, "api: a setting the check filled in, filled in again": 1,
    "api: model vocabulary against the tokenizer": 1,
    "api: causal LM as the reward": 1, "api: reward classifier of another vocabulary": 1,
    "api: reward class for an instance": 1, "api: ScoringReward without __call__": 1,
    "api: step() rows (x3)": 3,
    "api: list of rewards and weights (works; another count named)": 2,
    "values: negative numbers, a comma in a path, YAML merge keys (now read)": 3,
    "settings: task naming itself, tied output layer, tiny temperature": 3,
    "folders: --overwrite of undeletable checkpoints": 1,
}


def test_there_are_at_least_60_new_bad_inputs():
    from test_bad_inputs import CASES as FIRST
    from test_bad_inputs_more import CASES as MORE

    ids = [case.id for case in CASES] + [case.id for case in DATA_CASES]
    assert len(set(ids)) == len(ids)
    assert not set(ids) & {case.id for case in FIRST + MORE}
    assert len(ids) + sum(PYTHON_CASES.values()) >= 60
