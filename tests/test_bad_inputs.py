"""Bad inputs across every command, table-driven.

Each case is a command line plus the files it needs.  Every one must stop with exit 2, no
traceback, and a message naming the culprit (file:line, field, flag or folder) and what is
allowed.  Cases marked ``existing_run`` point ``--out --overwrite`` at a folder holding a
previous run: a failed start must leave it as it was.

Placeholders in the arguments and expected texts: ``{tmp}`` (this case's folder), ``{out}``
(``{tmp}/out``), a zoo folder (``{gpt2}``, ``{llama}``, ``{qwen2}``, ``{prompts}``, ...) or a
broken model folder (``{no_eos}``, ``{small_vocab}``, ...: the ``broken`` fixture).
"""

from __future__ import annotations

import json
import shutil
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from ppo_rlhf.cli import main
from zoo import REWARDS_MODULE

REWARD = f"{REWARDS_MODULE}:length_score"
BAD_REWARDS_SOURCE = '''
def raises(prompts, responses):
    return [1.0 / 0 for r in responses]

def one_argument(prompts):
    return [0.0] * len(prompts)

def words(prompts, responses):
    return ["good"] * len(responses)

not_callable = 3

def needs_label(prompts, responses, label):
    return [0.0] * len(responses)

async def async_nan(prompts, responses, **columns):
    return [float("nan")] * len(responses)

def trl_logs_a_word(completions, trainer_state, log_metric, **kwargs):
    log_metric("length", "long")
    return [0.0] * len(completions)
'''


@dataclass
class Bad:
    id: str
    args: list
    expect: tuple  # substrings the message must hold
    files: dict = field(default_factory=dict)  # file name under {tmp} -> text, bytes or a list of JSONL rows
    existing_run: bool = False  # --out holds a previous run, given --overwrite: it must survive

    def __post_init__(self):
        self.expect = (self.expect,) if isinstance(self.expect, str) else tuple(self.expect)


# ---------------------------------------------------------------- command lines the cases start from
def sft(*extra, data="{tmp}/data.jsonl"):
    return ["sft", "--model", "{gpt2}", "--data", data, "--steps", 1, "--batch-size", 2, "--eval-every", 0,
            "--out", "{out}", "--num-threads", 1, *extra]


def rm_pairs(*extra, data="{tmp}/data.jsonl"):
    return ["rm", "--mode", "pairwise", "--model", "{llama}", "--data", data, "--steps", 1, "--batch-size", 2,
            "--out", "{out}", "--num-threads", 1, *extra]


def rm_classes(*extra, data="{tmp}/data.jsonl"):
    return ["rm", "--model", "{llama}", "--data", data, "--num-labels", 2, "--steps", 1, "--batch-size", 2,
            "--out", "{out}", "--num-threads", 1, *extra]


def ppo(*extra, prompts="{tmp}/data.jsonl"):
    return ["ppo", "--model", "{llama}", "--prompts", prompts, "--reward-fn", REWARD, "--iterations", 1,
            "--batch-size", 2, "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 4, "--max-length", 32,
            "--eval-every", 0, "--save-every", 0, "--out", "{out}", "--num-threads", 1, *extra]


def evaluate(*extra, prompts="{tmp}/data.jsonl"):
    return ["eval", "--model", "{llama}", "--prompts", prompts, "--size", 2, "--max-new-tokens", 4,
            "--max-length", 32, "--num-threads", 1, *extra]


def gym(*extra):
    return ["gym", "--env", "CartPole-v1", "--total-steps", 64, "--num-envs", 2, "--num-steps", 32,
            "--mini-batch-size", 32, "--preset", "none", "--out", "{out}", "--threads", 1,
            *extra]


ROW = {"prompt": "hello world", "completion": " good answer"}
PAIR = {"prompt": "hello world", "chosen": " good answer", "rejected": " bad answer"}
TEXT = {"text": "good answer", "label": 1}
PROMPT = {"prompt": "hello world"}
MESSAGES = [{"role": "user", "content": "hello world"}]
LONG = "the cat sat on the mat " * 12
NOT_UTF8 = b'{"prompt": "hello", "completion": " ok"}\n{"prompt": "caf\xe9", "completion": " ok"}\n'


def rows(*items, times=4):
    return [dict(item) for item in items] * times


def with_(base, **changes):
    return {**base, **changes}


def without(base, key):
    return {k: v for k, v in base.items() if k != key}


CASES = [
    # ------------------------------------------------------------ sft: the data file
    Bad("sft-data-missing", sft(data="{tmp}/nothing.jsonl"), ("data not found", "nothing.jsonl")),
    Bad("sft-data-not-utf8", sft(), ("data.jsonl:2", "UTF-8"), {"data.jsonl": NOT_UTF8}, existing_run=True),
    Bad("sft-data-utf16", sft(), ("data.jsonl:1", "UTF-8"),
        {"data.jsonl": json.dumps(ROW).encode("utf-16")}),
    Bad("sft-data-invalid-json", sft(), ("data.jsonl:2", "not valid JSON"),
        {"data.jsonl": json.dumps(ROW) + "\n{\"prompt\": \"a\",\n"}, existing_run=True),
    Bad("sft-data-json-array-one-line", sft(), ("data.jsonl", "JSON array", "one JSON object per line"),
        {"data.jsonl": json.dumps(rows(ROW))}),
    Bad("sft-data-json-array-multiline", sft(data="{tmp}/data.json"), ("data.json", "JSON array", "one JSON object per line"),
        {"data.json": json.dumps(rows(ROW), indent=2)}),
    Bad("sft-data-line-is-a-string", sft(), ("data.jsonl:1", "must be a JSON object", "str"),
        {"data.jsonl": '"hello"\n'}),
    Bad("sft-data-empty-file", sft(), ("data.jsonl", "no rows"), {"data.jsonl": ""}),
    Bad("sft-data-blank-lines", sft(), ("data.jsonl", "no rows"), {"data.jsonl": "\n  \n\n"}),
    Bad("sft-data-unsupported-format", sft(data="{tmp}/data.csv"), ("data.csv", "unsupported data format", ".jsonl"),
        {"data.csv": "prompt,completion\nhello,world\n"}),
    Bad("sft-data-corrupt-parquet", sft(data="{tmp}/data.parquet"), ("data.parquet", "Parquet"),
        {"data.parquet": b"this is not parquet"}),
    Bad("sft-data-empty-folder", sft(data="{tmp}/folder"), ("folder", "save_to_disk"), {"folder/": None}),
    Bad("sft-data-is-a-model-folder", sft(data="{gpt2}"), ("{gpt2}", "model folder", "--model")),
    Bad("sft-missing-prompt-field", sft(), ("data.jsonl:1", "missing field 'prompt'", "completion"),
        {"data.jsonl": rows(without(ROW, "prompt"))}),
    Bad("sft-missing-completion-field", sft("--completion-field", "answer"), ("data.jsonl:1", "missing field 'answer'"),
        {"data.jsonl": rows(ROW)}),
    Bad("sft-null-completion", sft(), ("data.jsonl:1", "missing field 'completion'"),
        {"data.jsonl": rows(with_(ROW, completion=None))}),
    Bad("sft-prompt-is-a-number", sft(), ("data.jsonl:1", "'prompt'", "a string", "int"),
        {"data.jsonl": rows(with_(ROW, prompt=5))}, existing_run=True),
    Bad("sft-prompt-is-a-list-of-strings", sft(), ("data.jsonl:1", "'prompt'", "a string", "list"),
        {"data.jsonl": rows(with_(ROW, prompt=["a", "b"]))}),
    Bad("sft-prompt-is-a-dict", sft(), ("data.jsonl:1", "'prompt'", "dict"),
        {"data.jsonl": rows(with_(ROW, prompt={"text": "a"}))}),
    Bad("sft-completion-is-a-number", sft(), ("data.jsonl:1", "'completion'", "a string", "float"),
        {"data.jsonl": rows(with_(ROW, completion=2.5))}),
    Bad("sft-completion-is-a-list", sft(), ("data.jsonl:1", "'completion'", "a string", "list"),
        {"data.jsonl": rows(with_(ROW, completion=["a"]))}),
    Bad("sft-completion-is-a-bool", sft(), ("data.jsonl:1", "'completion'", "bool"),
        {"data.jsonl": rows(with_(ROW, completion=True))}),
    Bad("sft-chat-messages-without-chat-template", sft(), ("data.jsonl:1", "chat messages", "--chat-template"),
        {"data.jsonl": rows(with_(ROW, prompt=MESSAGES))}, existing_run=True),
    Bad("sft-chat-template-without-template", sft("--chat-template"),
        ("{gpt2}", "no chat template", "--chat-template"), {"data.jsonl": rows(ROW)}, existing_run=True),
    Bad("sft-chat-message-without-content", sft("--chat-template", "--model", "{qwen2}"),
        ("data.jsonl:1", "'prompt'", "role", "content"), {"data.jsonl": rows(with_(ROW, prompt=[{"role": "user"}]))}),
    Bad("sft-chat-messages-empty-list", sft("--chat-template", "--model", "{qwen2}"),
        ("data.jsonl:1", "'prompt'", "empty"), {"data.jsonl": rows(with_(ROW, prompt=[]))}),
    Bad("sft-chat-message-content-a-number", sft("--chat-template", "--model", "{qwen2}"),
        ("data.jsonl:1", "'prompt'", "content"),
        {"data.jsonl": rows(with_(ROW, prompt=[{"role": "user", "content": 3}]))}),
    Bad("sft-completions-cut-away", sft("--max-length", 8), ("--max-length 8", "no row", "completion"),
        {"data.jsonl": rows(with_(ROW, prompt=LONG))}, existing_run=True),
    Bad("sft-data-without-model", sft("--model", ""), ("--data", "needs --model"), {"data.jsonl": rows(ROW)}),
    Bad("sft-model-missing", sft("--model", "{tmp}/nowhere"), ("causal LM not found", "nowhere"),
        {"data.jsonl": rows(ROW)}),
    Bad("sft-model-empty-folder", sft("--model", "{tmp}/empty"), ("empty", "no config.json"),
        {"data.jsonl": rows(ROW), "empty/": None}),
    Bad("sft-model-is-a-data-file", sft("--model", "{tmp}/data.jsonl"), ("data.jsonl", "not a Hugging Face model folder"),
        {"data.jsonl": rows(ROW)}),
    Bad("sft-model-without-tokenizer", sft("--model", "{no_tokenizer}"), ("{no_tokenizer}", "has no tokenizer"),
        {"data.jsonl": rows(ROW)}),
    Bad("sft-tokenizer-without-eos", sft("--model", "{no_eos}"), ("{no_eos}", "no EOS", "eos_token"),
        {"data.jsonl": rows(ROW)}, existing_run=True),
    Bad("sft-vocabulary-smaller-than-tokenizer", sft("--model", "{small_vocab}"), ("{small_vocab}", "100 tokens", "300"),
        {"data.jsonl": rows(ROW)}, existing_run=True),
    Bad("sft-positions-below-max-length", sft("--model", "{short_positions}", "--max-length", 64),
        ("{short_positions}", "16 positions", "--max-length"), {"data.jsonl": rows(with_(ROW, completion=LONG))},
        existing_run=True),
    Bad("sft-corrupt-weights", sft("--model", "{corrupt}"), ("{corrupt}", "model.safetensors"),
        {"data.jsonl": rows(ROW)}, existing_run=True),
    Bad("sft-corrupt-config-json", sft("--model", "{bad_config}"), ("{bad_config}", "config.json"),
        {"data.jsonl": rows(ROW)}),
    Bad("sft-out-is-a-file", sft(), ("--out", "is a file"), {"data.jsonl": rows(ROW), "out": "x"}),
    Bad("sft-out-holds-a-run", sft(), ("already holds a run", "--overwrite"),
        {"data.jsonl": rows(ROW), "out/metrics.jsonl": '{"step": 1}\n'}),
    # ------------------------------------------------------------ sft: numbers and flags
    Bad("sft-steps-zero", sft("--steps", 0), ("'steps'", "> 0"), {"data.jsonl": rows(ROW)}),
    Bad("sft-steps-not-a-number", sft("--steps", "ten"), ("'steps'", "int", "ten"), {"data.jsonl": rows(ROW)}),
    Bad("sft-steps-fractional", sft("--steps", "2.5"), ("'steps'", "int"), {"data.jsonl": rows(ROW)}),
    Bad("sft-batch-size-negative", sft("--batch-size", -1), ("'batch_size'", "> 0"), {"data.jsonl": rows(ROW)}),
    Bad("sft-lr-zero", sft("--lr", 0), ("'lr'", "> 0"), {"data.jsonl": rows(ROW)}),
    Bad("sft-lr-nan", sft("--lr", "nan"), ("'lr'",), {"data.jsonl": rows(ROW)}),
    Bad("sft-max-length-one", sft("--max-length", 1), ("'max_length'", "> 1"), {"data.jsonl": rows(ROW)}),
    Bad("sft-dropout-one", sft("--dropout", 1), ("'dropout'", "< 1"), {"data.jsonl": rows(ROW)}),
    Bad("sft-warmup-negative", sft("--warmup-steps", -3), ("'warmup_steps'", ">= 0"), {"data.jsonl": rows(ROW)}),
    Bad("sft-unknown-flag", sft("--stpes", 3), ("--stpes", "--steps")),
    Bad("sft-unknown-task", ["sft", "--task", "tripling"], ("--task", "doubling")),
    Bad("sft-unknown-device", sft("--device", "tpu"), ("--device", "cuda")),
    Bad("sft-config-missing", sft("--config", "{tmp}/nothing.yaml"), ("config file not found", "nothing.yaml")),
    Bad("sft-config-not-yaml", sft("--config", "{tmp}/c.yaml"), ("c.yaml", "not valid YAML"), {"c.yaml": "steps: [1\n"}),
    Bad("sft-config-a-list", sft("--config", "{tmp}/c.yaml"), ("c.yaml", "mapping"), {"c.yaml": "- steps\n"}),
    Bad("sft-config-unknown-key", sft("--config", "{tmp}/c.yaml"), ("unknown key 'stpes'", "steps"),
        {"c.yaml": "stpes: 3\n"}),
    Bad("sft-config-bad-value", sft("--config", "{tmp}/c.yaml"), ("'lr'", "float", "fast"), {"c.yaml": "lr: fast\n"}),
    # ------------------------------------------------------------ rm
    Bad("rm-pairs-missing-rejected", rm_pairs(), ("data.jsonl:1", "missing field 'rejected'"),
        {"data.jsonl": rows(without(PAIR, "rejected"))}),
    Bad("rm-pairs-chosen-a-number", rm_pairs(), ("data.jsonl:1", "'chosen'", "a string", "int"),
        {"data.jsonl": rows(with_(PAIR, chosen=1))}, existing_run=True),
    Bad("rm-pairs-rejected-a-list", rm_pairs(), ("data.jsonl:1", "'rejected'", "list"),
        {"data.jsonl": rows(with_(PAIR, rejected=["a"]))}),
    Bad("rm-pairs-prompt-a-number", rm_pairs(), ("data.jsonl:1", "'prompt'", "int"),
        {"data.jsonl": rows(with_(PAIR, prompt=7))}),
    Bad("rm-pairs-chosen-equals-rejected", rm_pairs(), ("data.jsonl", "chosen", "rejected", "same"),
        {"data.jsonl": rows(with_(PAIR, rejected=PAIR["chosen"]))}, existing_run=True),
    Bad("rm-pairs-chat-messages-without-chat-template", rm_pairs(), ("data.jsonl:1", "chat messages", "--chat-template"),
        {"data.jsonl": rows(with_(PAIR, prompt=MESSAGES))}),
    Bad("rm-pairs-chat-template-without-template", rm_pairs("--chat-template"), ("{llama}", "no chat template"),
        {"data.jsonl": rows(PAIR)}),
    Bad("rm-pairs-not-utf8", rm_pairs(), ("data.jsonl:2", "UTF-8"), {"data.jsonl": NOT_UTF8}),
    Bad("rm-pairs-wrong-field-flag", rm_pairs("--chosen-field", "good"), ("missing field 'good'", "chosen"),
        {"data.jsonl": rows(PAIR)}),
    Bad("rm-classes-label-a-word", rm_classes(), ("data.jsonl:1", "'label'", "integer", "'good'"),
        {"data.jsonl": rows(with_(TEXT, label="good"))}, existing_run=True),
    Bad("rm-classes-label-fractional", rm_classes(), ("data.jsonl:1", "'label'", "integer", "1.5"),
        {"data.jsonl": rows(with_(TEXT, label=1.5))}),
    Bad("rm-classes-label-a-bool", rm_classes(), ("data.jsonl:1", "'label'", "integer", "True"),
        {"data.jsonl": rows(with_(TEXT, label=True))}),
    Bad("rm-classes-label-out-of-range", rm_classes(), ("data.jsonl:1", "label 2", "0..1"),
        {"data.jsonl": rows(with_(TEXT, label=2))}, existing_run=True),
    Bad("rm-classes-label-negative", rm_classes(), ("data.jsonl:1", "label -1", "0..1"),
        {"data.jsonl": rows(with_(TEXT, label=-1))}),
    Bad("rm-classes-text-a-number", rm_classes(), ("data.jsonl:1", "'text'", "a string", "int"),
        {"data.jsonl": rows(with_(TEXT, text=3))}),
    Bad("rm-classes-missing-label", rm_classes(), ("data.jsonl:1", "missing field 'label'"),
        {"data.jsonl": rows(without(TEXT, "label"))}),
    Bad("rm-data-without-model", rm_classes("--model", ""), ("--data", "--model"), {"data.jsonl": rows(TEXT)}),
    Bad("rm-model-is-a-data-file", rm_classes("--model", "{tmp}/data.jsonl"), ("data.jsonl", "not a Hugging Face model"),
        {"data.jsonl": rows(TEXT)}),
    Bad("rm-corrupt-weights", rm_classes("--model", "{corrupt}"), ("{corrupt}", "model.safetensors"),
        {"data.jsonl": rows(TEXT)}, existing_run=True),
    Bad("rm-num-labels-zero", rm_classes("--num-labels", 0), ("'num_labels'", ">= 1"), {"data.jsonl": rows(TEXT)}),
    Bad("rm-eval-fraction-one", rm_classes("--eval-fraction", 1), ("'eval_fraction'", "< 1"), {"data.jsonl": rows(TEXT)}),
    Bad("rm-unknown-mode", rm_classes("--mode", "ranking"), ("--mode", "pairwise")),
    Bad("rm-lora-without-model", ["rm", "--lora", "--out", "{out}"], ("lora", "--model")),
    # ------------------------------------------------------------ ppo: prompts
    Bad("ppo-prompts-missing", ppo(prompts="{tmp}/nothing.jsonl"), ("data not found", "nothing.jsonl")),
    Bad("ppo-prompts-not-utf8", ppo(), ("data.jsonl:2", "UTF-8"), {"data.jsonl": NOT_UTF8}, existing_run=True),
    Bad("ppo-prompts-json-array", ppo(), ("data.jsonl", "JSON array"), {"data.jsonl": json.dumps(rows(PROMPT))}),
    Bad("ppo-prompts-empty-file", ppo(), ("data.jsonl", "no rows"), {"data.jsonl": ""}),
    Bad("ppo-prompts-missing-field", ppo(), ("data.jsonl:1", "missing field 'prompt'", "question"),
        {"data.jsonl": rows({"question": "hi"})}),
    Bad("ppo-prompt-a-number", ppo(), ("data.jsonl:1", "'prompt'", "a string", "int"),
        {"data.jsonl": rows({"prompt": 12})}, existing_run=True),
    Bad("ppo-prompt-a-list-of-strings", ppo(), ("data.jsonl:1", "'prompt'", "list"),
        {"data.jsonl": rows({"prompt": ["a", "b"]})}),
    Bad("ppo-all-prompts-empty", ppo(), ("data.jsonl", "empty", "prompt"), {"data.jsonl": rows({"prompt": ""})},
        existing_run=True),
    Bad("ppo-chat-messages-without-chat-template", ppo(), ("data.jsonl:1", "chat messages", "--chat-template"),
        {"data.jsonl": rows({"prompt": MESSAGES})}, existing_run=True),
    Bad("ppo-chat-template-without-template", ppo("--chat-template"), ("{llama}", "no chat template"),
        {"data.jsonl": rows(PROMPT)}, existing_run=True),
    Bad("ppo-chat-message-bad-role-type", ppo("--chat-template", "--model", "{qwen2}"), ("data.jsonl:1", "role"),
        {"data.jsonl": rows({"prompt": [{"role": 1, "content": "hi"}]})}),
    Bad("ppo-prompts-is-a-model-folder", ppo(prompts="{gpt2}"), ("{gpt2}", "model folder")),
    Bad("ppo-eval-prompts-missing-field", ppo("--eval-prompts", "{tmp}/eval.jsonl"),
        ("eval.jsonl:1", "missing field 'prompt'"), {"data.jsonl": rows(PROMPT), "eval.jsonl": rows({"q": "hi"})},
        existing_run=True),
    Bad("ppo-eval-prompts-not-utf8", ppo("--eval-prompts", "{tmp}/eval.jsonl"), ("eval.jsonl:2", "UTF-8"),
        {"data.jsonl": rows(PROMPT), "eval.jsonl": NOT_UTF8}),
    Bad("ppo-eval-prompts-missing", ppo("--eval-prompts", "{tmp}/nothing.jsonl"), ("nothing.jsonl",),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-no-prompts", ["ppo", "--model", "{llama}", "--reward-fn", REWARD, "--out", "{out}"], ("--prompts", "--task")),
    # ------------------------------------------------------------ ppo: models
    Bad("ppo-no-model", ppo("--model", ""), ("--model",), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-model-missing", ppo("--model", "{tmp}/nowhere"), ("nowhere", "not found"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-model-is-a-data-file", ppo("--model", "{tmp}/data.jsonl"), ("data.jsonl", "not a Hugging Face model"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-tokenizer-without-eos", ppo("--model", "{no_eos}"), ("{no_eos}", "no EOS"), {"data.jsonl": rows(PROMPT)},
        existing_run=True),
    Bad("ppo-vocabulary-smaller-than-tokenizer", ppo("--model", "{small_vocab}"), ("{small_vocab}", "100 tokens", "300"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-positions-below-max-length", ppo("--model", "{short_positions}"),
        ("{short_positions}", "16 positions", "--max-length"), {"data.jsonl": rows({"prompt": LONG})},
        existing_run=True),
    Bad("ppo-corrupt-weights", ppo("--model", "{corrupt}"), ("{corrupt}", "model.safetensors"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-model-corrupt", ppo("--reward-fn", "", "--reward-model", "{corrupt_rm}"),
        ("{corrupt_rm}", "model.safetensors"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-model-a-causal-lm", ppo("--reward-fn", "", "--reward-model", "{gpt2}"),
        ("{gpt2}", "not a reward model"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-model-missing", ppo("--reward-fn", "", "--reward-model", "{tmp}/nowhere"),
        ("reward model not found", "nowhere"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-model-and-function-a-causal-lm", ppo("--reward-model", "{gpt2}"), ("{gpt2}", "not a reward model"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-no-reward", ppo("--reward-fn", ""), ("no reward", "--reward-fn", "--reward-url"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-critic-other-vocabulary", ppo("--critic", "separate", "--critic-model", "{gpt2}"),
        ("{gpt2}", "different vocabulary"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-critic-lora-without-lora", ppo("--critic", "lora"), ("'critic'", "needs --lora"), {"data.jsonl": rows(PROMPT)}),
    # ------------------------------------------------------------ ppo: reward functions
    Bad("ppo-reward-module-missing", ppo("--reward-fn", "no_such_module:score"), ("no_such_module", "cannot import"),
        {"data.jsonl": rows(PROMPT)}, existing_run=True),
    Bad("ppo-reward-function-missing", ppo("--reward-fn", f"{REWARDS_MODULE}:nothing"), ("has no function 'nothing'",),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-not-callable", ppo("--reward-fn", "{tmp}/bad_rewards.py:not_callable"),
        ("has no function 'not_callable'",), {"data.jsonl": rows(PROMPT), "bad_rewards.py": BAD_REWARDS_SOURCE}),
    Bad("ppo-reward-file-missing", ppo("--reward-fn", "{tmp}/nothing.py:score"), ("nothing.py",),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-file-syntax-error", ppo("--reward-fn", "{tmp}/broken.py:score"),
        ("broken.py", "SyntaxError", "line 1"), {"data.jsonl": rows(PROMPT), "broken.py": "def score(:\n"},
        existing_run=True),
    Bad("ppo-reward-module-import-raises", ppo("--reward-fn", "{tmp}/imports.py:score"), ("imports.py", "ModuleNotFoundError"),
        {"data.jsonl": rows(PROMPT), "imports.py": "import not_installed_pkg\n"}),
    Bad("ppo-reward-not-a-dotted-path", ppo("--reward-fn", "score"), ("package.module:function", "'score'"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-function-raises", ppo("--reward-fn", "{tmp}/bad_rewards.py:raises"),
        ("bad_rewards.py:raises", "ZeroDivisionError", "bad_rewards.py, line 3"),
        {"data.jsonl": rows(PROMPT), "bad_rewards.py": BAD_REWARDS_SOURCE}),
    Bad("ppo-reward-function-one-argument", ppo("--reward-fn", "{tmp}/bad_rewards.py:one_argument"),
        ("one_argument", "(prompts, responses)"), {"data.jsonl": rows(PROMPT), "bad_rewards.py": BAD_REWARDS_SOURCE},
        existing_run=True),
    Bad("ppo-reward-function-returns-words", ppo("--reward-fn", "{tmp}/bad_rewards.py:words"),
        ("bad_rewards.py:words", "numbers", "'good'"), {"data.jsonl": rows(PROMPT), "bad_rewards.py": BAD_REWARDS_SOURCE}),
    Bad("ppo-reward-function-wrong-length", ppo("--reward-fn", f"{REWARDS_MODULE}:wrong_length"),
        ("wrong_length", "returned 1 scores for 2 responses"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-function-nan", ppo("--reward-fn", f"{REWARDS_MODULE}:not_a_number"),
        ("not_a_number", "non-finite"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-column-missing", ppo("--reward-fn", "{tmp}/bad_rewards.py:needs_label"),
        ("needs_label", "'label'", "data.jsonl:1"), {"data.jsonl": rows(PROMPT), "bad_rewards.py": BAD_REWARDS_SOURCE},
        existing_run=True),
    Bad("ppo-reward-async-nan", ppo("--reward-fn", "{tmp}/bad_rewards.py:async_nan"), ("async_nan", "non-finite"),
        {"data.jsonl": rows(PROMPT), "bad_rewards.py": BAD_REWARDS_SOURCE}),
    Bad("ppo-reward-logs-a-word", ppo("--reward-fn", "{tmp}/bad_rewards.py:trl_logs_a_word"),
        ("trl_logs_a_word", "log_metric", "'long'", "one finite number"),
        {"data.jsonl": rows(PROMPT), "bad_rewards.py": BAD_REWARDS_SOURCE}),
    Bad("ppo-reward-weights-count", ppo("--reward-weights", "1,2"), ("'reward_weights'", "2 weights", "1 reward"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-weights-not-numbers", ppo("--reward-weights", "heavy"), ("'reward_weights'", "numbers"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-url-not-http", ppo("--reward-url", "ftp://judge"), ("'reward_url'", "ftp://judge", "http://"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-reward-url-unreachable", ppo("--reward-url", "http://127.0.0.1:9/score", "--reward-retries", 0),
        ("http://127.0.0.1:9/score", "failed 1 times"), {"data.jsonl": rows(PROMPT)}),
    # ------------------------------------------------------------ ppo: numbers and run folders
    Bad("ppo-mini-batch-not-a-divisor", ppo("--mini-batch-size", 3), ("'mini_batch_size'", "divisor"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-max-length-below-new-tokens", ppo("--max-length", 4), ("'max_length'", "> max_new_tokens"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-temperature-zero", ppo("--temperature", 0), ("'temperature'", ">= 0.01"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-gamma-above-one", ppo("--gamma", 1.5), ("'gamma'", "<= 1"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-kl-coef-negative", ppo("--kl-coef", -0.1), ("'kl_coef'", ">= 0"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-iterations-zero", ppo("--iterations", 0), ("'iterations'", "> 0"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-kl-estimator-k1-in-loss", ppo("--kl-in", "loss", "--kl-estimator", "k1"), ("'kl_estimator'", "k1"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-resume-nothing", ppo("--resume"), ("nothing to resume", "drop --resume"), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-resume-and-overwrite", ppo("--resume", "--overwrite"), ("contradict",), {"data.jsonl": rows(PROMPT)}),
    Bad("ppo-out-holds-a-run", ppo(), ("already holds a run", "--resume"),
        {"data.jsonl": rows(PROMPT), "out/summary.json": "{}"}),
    # ------------------------------------------------------------ eval
    Bad("eval-no-model", ["eval", "--task", "doubling"], ("--model",)),
    Bad("eval-no-prompts", ["eval", "--model", "{llama}"], ("--prompts", "--task")),
    Bad("eval-prompts-missing-field", evaluate("--prompt-field", "question"), ("data.jsonl:1", "missing field 'question'"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("eval-prompts-not-utf8", evaluate(), ("data.jsonl:2", "UTF-8"), {"data.jsonl": NOT_UTF8}),
    Bad("eval-prompt-a-number", evaluate(), ("data.jsonl:1", "'prompt'", "int"), {"data.jsonl": rows({"prompt": 1})}),
    Bad("eval-chat-messages-without-chat-template", evaluate(), ("data.jsonl:1", "chat messages", "--chat-template"),
        {"data.jsonl": rows({"prompt": MESSAGES})}),
    Bad("eval-chat-template-without-template", evaluate("--chat-template"), ("{llama}", "no chat template"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("eval-all-prompts-empty", evaluate(), ("data.jsonl", "empty"), {"data.jsonl": rows({"prompt": ""})}),
    Bad("eval-tokenizer-without-eos", evaluate("--model", "{no_eos}"), ("{no_eos}", "no EOS"), {"data.jsonl": rows(PROMPT)}),
    Bad("eval-positions-below-max-length", evaluate("--model", "{short_positions}"), ("{short_positions}", "16 positions"),
        {"data.jsonl": rows({"prompt": LONG})}),
    Bad("eval-corrupt-weights", evaluate("--model", "{corrupt}"), ("{corrupt}", "model.safetensors"),
        {"data.jsonl": rows(PROMPT)}),
    Bad("eval-reward-function-raises", evaluate("--reward-fn", "{tmp}/bad_rewards.py:raises"),
        ("bad_rewards.py:raises", "ZeroDivisionError"), {"data.jsonl": rows(PROMPT), "bad_rewards.py": BAD_REWARDS_SOURCE}),
    Bad("eval-reward-column-missing", evaluate("--reward-fn", "{tmp}/bad_rewards.py:needs_label"),
        ("needs_label", "'label'", "data.jsonl:1"), {"data.jsonl": rows(PROMPT), "bad_rewards.py": BAD_REWARDS_SOURCE}),
    Bad("eval-reward-weights-count", evaluate("--reward-fn", REWARD, "--reward-weights", "1,2"),
        ("'reward_weights'", "2 weights", "1 reward"), {"data.jsonl": rows(PROMPT)}),
    Bad("eval-size-zero", evaluate("--size", 0), ("'size'", "> 0"), {"data.jsonl": rows(PROMPT)}),
    Bad("eval-out-holds-a-run", evaluate("--out", "{out}"), ("already holds a run",),
        {"data.jsonl": rows(PROMPT), "out/summary.json": "{}"}),
    # ------------------------------------------------------------ merge
    Bad("merge-adapter-missing", ["merge", "--adapter", "{tmp}/nowhere", "--out", "{out}"], ("nowhere", "adapter")),
    Bad("merge-adapter-is-a-full-model", ["merge", "--adapter", "{gpt2}", "--out", "{out}"],
        ("{gpt2}", "not a LoRA adapter folder", "adapter_config.json")),
    Bad("merge-no-out", ["merge", "--adapter", "{gpt2}"], ("'out'",)),
    Bad("merge-no-adapter", ["merge", "--out", "{out}"], ("'adapter'",)),
    Bad("merge-out-is-the-adapter", ["merge", "--adapter", "{adapter}", "--out", "{adapter}"], ("is --adapter",)),
    Bad("merge-base-missing", ["merge", "--adapter", "{adapter}", "--base", "{tmp}/nowhere", "--out", "{out}"],
        ("nowhere", "not a model folder")),
    Bad("merge-recorded-base-missing", ["merge", "--adapter", "{orphan_adapter}", "--out", "{out}"],
        ("{orphan_adapter}", "/no/such/base")),
    Bad("merge-out-holds-a-model", ["merge", "--adapter", "{adapter}", "--out", "{tmp}/mine"], ("mine", "already"),
        {"mine/config.json": "{}"}),
    # ------------------------------------------------------------ gym, gym-eval
    Bad("gym-unknown-env", gym("--env", "CartPole-v9"), ("unknown gymnasium environment 'CartPole-v9'", "CartPole-v1"),
        existing_run=True),
    Bad("gym-total-steps-below-a-rollout", gym("--total-steps", 10), ("'total_steps'", "64")),
    Bad("gym-num-envs-zero", gym("--num-envs", 0), ("'num_envs'", ">= 1")),
    Bad("gym-hidden-sizes-words", gym("--hidden-sizes", "a,b"), ("'hidden_sizes'", "integers")),
    Bad("gym-gamma-zero", gym("--gamma", 0), ("'gamma'", "0 < gamma")),
    Bad("gym-unknown-preset", gym("--preset", "acrobot"), ("--preset", "cartpole")),
    Bad("gym-out-holds-a-run", gym(), ("already holds a run", "--overwrite"), {"out/metrics.jsonl": '{"step": 1}\n'}),
    Bad("gym-out-is-a-file", gym(), ("is a file",), {"out": "x"}),
    Bad("gym-eval-missing", ["gym-eval", "{tmp}/nowhere"], ("nowhere",)),
    Bad("gym-eval-folder-without-policy", ["gym-eval", "{tmp}/empty"], ("empty", "policy"), {"empty/": None}),
    Bad("gym-eval-policy-of-another-format", ["gym-eval", "{tmp}/policy"], ("policy", "config.json", "format"),
        {"policy/config.json": '{"format": "something-else"}', "policy/model.safetensors": b""}),
    Bad("gym-eval-policy-config-not-json", ["gym-eval", "{tmp}/policy"], ("policy", "config.json"),
        {"policy/config.json": "{not json", "policy/model.safetensors": b""}),
    Bad("gym-eval-episodes-zero", ["gym-eval", "{tmp}", "--episodes", 0], ("'episodes'", ">= 1")),
    # ------------------------------------------------------------ convert-gguf
    Bad("convert-gguf-missing", ["convert-gguf", "--gguf", "{tmp}/nothing.gguf", "--out", "{out}"],
        ("GGUF file not found", "nothing.gguf")),
    Bad("convert-gguf-not-gguf", ["convert-gguf", "--gguf", "{tmp}/fake.gguf", "--out", "{out}"],
        ("fake.gguf", "GGUF"), {"fake.gguf": b"definitely not a gguf file" * 10}),
    Bad("convert-gguf-is-a-folder", ["convert-gguf", "--gguf", "{tmp}/empty", "--out", "{out}"],
        ("empty", "GGUF"), {"empty/": None}),
    Bad("convert-gguf-unknown-dtype", ["convert-gguf", "--dtype", "int8"], ("--dtype", "float32")),
    Bad("convert-gguf-sample-tokens-zero", ["convert-gguf", "--sample-tokens", 0], ("'sample_tokens'", "> 0")),
    # ------------------------------------------------------------ demo
    Bad("demo-out-is-a-file", ["demo", "--out", "{out}", "--sft-steps", 1], ("is a file",), {"out": "x"}),
    Bad("demo-stages-config-missing", ["demo", "--out", "{out}", "--stages-config", "{tmp}/nothing.yaml"],
        ("nothing.yaml", "not found")),
    Bad("demo-stages-config-unknown-section", ["demo", "--out", "{out}", "--stages-config", "{tmp}/s.yaml"],
        ("'gym'", "sft, rm, ppo"), {"s.yaml": "gym: {}\n"}),
    Bad("demo-stages-config-section-a-list", ["demo", "--out", "{out}", "--stages-config", "{tmp}/s.yaml"],
        ("s.yaml", "'sft'", "mapping"), {"s.yaml": "sft: [1, 2]\n"}),
    Bad("demo-stages-config-unknown-field", ["demo", "--out", "{out}", "--stages-config", "{tmp}/s.yaml"],
        ("unknown key 'step'", "s.yaml", "steps"), {"s.yaml": "sft: {step: 3}\n"}),
    Bad("demo-sft-steps-zero", ["demo", "--out", "{out}", "--sft-steps", 0], ("'sft_steps'", "> 0")),
    Bad("demo-unknown-reward", ["demo", "--reward", "learned"], ("--reward", "model", "rule")),
    Bad("demo-out-holds-a-run", ["demo", "--out", "{out}", "--sft-steps", 1], ("already holds a run", "--overwrite"),
        {"out/sft/metrics.jsonl": '{"step": 1}\n'}),
]


# ---------------------------------------------------------------- broken model folders, built once
@pytest.fixture(scope="module")
def broken(zoo, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("broken")

    def copy(name, source="gpt2"):
        return Path(shutil.copytree(zoo[source], root / name))

    folders = {}
    folders["no_eos"] = copy("no_eos")
    config_path = folders["no_eos"] / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.pop("eos_token", None)
    config_path.write_text(json.dumps(tokenizer_config))
    special = folders["no_eos"] / "special_tokens_map.json"
    if special.exists():
        special.write_text(json.dumps({k: v for k, v in json.loads(special.read_text()).items() if k != "eos_token"}))

    folders["small_vocab"] = copy("small_vocab")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(GPT2Config(vocab_size=100, n_embd=16, n_layer=1, n_head=2, n_positions=128)
                                     ).save_pretrained(folders["small_vocab"])

    folders["short_positions"] = copy("short_positions")
    AutoModelForCausalLM.from_config(GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2, n_positions=16)
                                     ).save_pretrained(folders["short_positions"])

    folders["corrupt"] = copy("corrupt")
    weights = folders["corrupt"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])

    folders["corrupt_rm"] = copy("corrupt_rm", "llama")
    config = json.loads((folders["corrupt_rm"] / "config.json").read_text())
    (folders["corrupt_rm"] / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    weights = folders["corrupt_rm"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])

    folders["bad_config"] = copy("bad_config")
    (folders["bad_config"] / "config.json").write_text("{\"model_type\": \"gpt2\",")

    folders["no_tokenizer"] = copy("no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folders["no_tokenizer"] / name).unlink(missing_ok=True)

    base = AutoModelForCausalLM.from_pretrained(zoo["llama"])
    adapter = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"]))
    adapter.save_pretrained(root / "adapter")
    folders["adapter"] = root / "adapter"
    folders["orphan_adapter"] = Path(shutil.copytree(root / "adapter", root / "orphan_adapter"))
    record_path = folders["orphan_adapter"] / "adapter_config.json"
    record = json.loads(record_path.read_text())
    record_path.write_text(json.dumps({**record, "base_model_name_or_path": "/no/such/base"}))
    return folders


def write_files(tmp: Path, files: dict) -> None:
    for name, content in files.items():
        path = tmp / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, list):
            path.write_text("".join(json.dumps(row) + "\n" for row in content))
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def fill(text: str, places: dict) -> str:
    return str(text).format(**places) if "{" in str(text) else str(text)


def previous_run(out: Path) -> dict[str, str]:
    """A run folder as a previous run left it; returns its files and their contents."""
    files = {"metrics.jsonl": '{"step": 1, "loss": 0.5}\n', "summary.json": '{"stage": "earlier"}',
             "config.yaml": "steps: 1\n", "checkpoints/sft/config.json": "{}"}
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return files


def outcome(args: list[str]) -> tuple[int | None, str | None]:
    """(exit code, traceback text if it raised)."""
    try:
        return main(args), None
    except SystemExit as exit_info:  # argparse: bad flag or choice
        return exit_info.code, None
    except Exception:  # noqa: BLE001 -- the point is to report it
        return None, traceback.format_exc()


def assert_refused(args: list[str], expect, places: dict, capsys) -> None:
    """The command exits 2, with no traceback, and its message holds every text of ``expect``."""
    code, raised = outcome(args)
    err = capsys.readouterr().err
    assert raised is None, f"traceback:\n{raised}"
    assert code == 2, f"exit {code} (ran on bad input); stderr: {err[-2000:]}"
    assert "Traceback" not in err
    for text in expect:
        assert fill(text, places) in err, f"{fill(text, places)!r} not in: {err}"


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_input_is_named_and_stops_the_run(case: Bad, zoo, broken, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    places = {**{k: str(v) for k, v in zoo.items() if isinstance(v, (str, Path))},
              **{k: str(v) for k, v in broken.items()}, "tmp": str(tmp_path), "out": str(tmp_path / "out")}
    places["prompts"] = str(zoo["prompts"])
    write_files(tmp_path, case.files)
    args = [fill(a, places) for a in case.args]
    kept = {}
    if case.existing_run:
        (tmp_path / "out").mkdir(exist_ok=True)
        kept = previous_run(tmp_path / "out")
        args.append("--overwrite")
    assert_refused(args, case.expect, places, capsys)
    for name, text in kept.items():
        assert (tmp_path / "out" / name).read_text() == text, f"{name} of the previous run was changed"


def test_there_are_at_least_100_distinct_bad_inputs():
    assert len({case.id for case in CASES}) == len(CASES) >= 100


def test_rows_cut_or_dropped_by_max_length_are_counted(zoo, tmp_path, capsys):
    # One row fits, one loses the end of its completion, one has a prompt that fills --max-length.
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in [ROW, with_(ROW, completion=LONG), with_(ROW, prompt=LONG)]))
    places = {"gpt2": zoo["gpt2"], "out": tmp_path / "out"}
    assert main([fill(a, places) for a in sft("--max-length", 24, data=data)]) == 0
    printed = capsys.readouterr().out
    assert "--max-length 24: 1 of 3 rows cut" in printed and "1 dropped" in printed
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["rows"] == 2


def test_empty_prompts_and_identical_pairs_are_dropped_and_counted(zoo, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in [PAIR, PAIR, with_(PAIR, rejected=PAIR["chosen"])]))
    assert main([fill(a, {"llama": zoo["llama"], "out": tmp_path / "rm"}) for a in rm_pairs(data=data)]) == 0
    assert "dropped 1 of 3 rows that have the same chosen and rejected response" in capsys.readouterr().out
