"""Tiny random models of five architectures with real (trained-here) BPE tokenizers, and the
helpers the real-model tests share (fixtures are in conftest.py).

    gpt2     GPT2LMHeadModel,    pad distinct from EOS, no BOS added, no chat template
    llama    LlamaForCausalLM,   pad = EOS, BOS added by the tokenizer
    qwen2    Qwen2ForCausalLM,   EOS <|im_end|>, a chat template
    granite  GraniteForCausalLM, its forward divides the logits by logits_scaling (4)
    gemma    GemmaForCausalLM,   two stop ids: the tokenizer's EOS <eos> and the chat template's
                                 <end_of_turn>, both in generation_config.json (as gemma-it)

and ``llama_left`` (LEFT_PADDED), the llama whose tokenizer pads on the left.  make_config also
builds two architectures that only the forward tests use: cohere (its forward multiplies the
logits by logit_scale) and gemma2 (caps them with final_logit_softcapping).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (AutoModelForCausalLM, CohereConfig, Gemma2Config, GemmaConfig, GPT2Config, GraniteConfig,
                          LlamaConfig, PreTrainedTokenizerFast, Qwen2Config)

from ppo_rlhf.cli import main

SRC = Path(__file__).resolve().parents[1] / "src"

TEXT = ["the cat sat on the mat", "a dog ran in the park", "good answer", "bad answer", "hello world",
        "what is two plus two", "four", "say something nice", "you are great", "i do not know"]
PROMPTS = ["hello world", "the cat sat", "what is two plus two", "say something nice", "a dog ran", "you are"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                       "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
ARCHS = ("gpt2", "llama", "qwen2", "granite", "gemma")
LEFT_PADDED = "llama_left"
THREADS = ["--num-threads", 1]
# The built-in task's model, tiny enough for a test to train it in seconds; its rule reward.
TINY = ["--n-layer", 2, "--n-head", 2, "--n-embd", 32, *THREADS]
RULE = ["--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward"]
REWARDS_MODULE = "ppo_rlhf_test_rewards"
REWARDS_SOURCE = '''
import math

def length_score(prompts, responses):
    return [len(r) / 10 for r in responses]

def wrong_length(prompts, responses):
    return [0.0]

def not_a_number(prompts, responses):
    return [math.nan] * len(responses)

def trl_chat_length(prompts, completions, **kwargs):
    """A reward written for TRL's GRPOTrainer on chat data: each completion a list of messages."""
    return [len(completion[0]["content"]) / 10 for completion in completions]

def long_answer(prompts, responses):
    """1 for a response of at least 12 characters, else 0: a 0/1 reward whose groups often tie."""
    return [float(len(r) >= 12) for r in responses]
'''


# ---------------------------------------------------------------- building tiny models
def byte_level_bpe(special: list[str], vocab_size: int, bos: str | None = None) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXT, trainer)
    if bos:  # Llama-style: the tokenizer itself puts BOS in front
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    return tokenizer


def make_tokenizer(arch: str, padding_side: str = "right") -> PreTrainedTokenizerFast:
    if arch == "gpt2":
        return PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(["<|endoftext|>", "<pad>"], 300),
                                       bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<pad>",
                                       padding_side=padding_side)
    if arch in ("llama", "granite", "cohere", "gemma2"):
        return PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(["<s>", "</s>"], 320, bos="<s>"),
                                       bos_token="<s>", eos_token="</s>", pad_token="</s>", padding_side=padding_side)
    if arch == "gemma":
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=byte_level_bpe(["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], 330,
                                            bos="<bos>"),
            bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", padding_side=padding_side)
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
        return tokenizer
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], 310),
        eos_token="<|im_end|>", pad_token="<|endoftext|>", padding_side=padding_side)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_config(arch: str, tokenizer):
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id)
    if arch == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=128, initializer_range=0.2, **ids)
    # initializer_range 0.2: decisive logits, so greedy decoding is not decided by rounding.
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.2, **ids)
    if arch == "granite":
        return GraniteConfig(logits_scaling=4.0, **sizes)
    if arch == "cohere":
        return CohereConfig(logit_scale=4.0, **sizes)
    if arch == "gemma":
        return GemmaConfig(head_dim=8, **sizes)
    if arch == "gemma2":
        return Gemma2Config(head_dim=8, final_logit_softcapping=2.0, **sizes)
    config_class = LlamaConfig if arch == "llama" else Qwen2Config
    return config_class(tie_word_embeddings=arch == "qwen2", **sizes)


def build_model(arch: str, folder: Path, padding_side: str = "right", dtype: torch.dtype = torch.float32) -> Path:
    """``padding_side``: saved in the tokenizer's config, as chat models that pad on the left do.
    ``dtype``: the dtype the weights are stored in (most hub checkpoints: bfloat16)."""
    tokenizer = make_tokenizer(arch, padding_side)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(arch, tokenizer))
    if arch == "gemma":  # the chat model's end of turn stops generation too (saved as generation_config.json)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    model.to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class VaryingLengths:
    """A rollout engine (the built-in loop) whose row r gets a response of 1 + r % 3 tokens, the last
    one the stop id: the samples of a prompt differ in length, and every response is shorter than
    a --max-new-tokens of 4 or more (a tiny random model rarely stops on its own)."""

    def __init__(self, stop_token_ids, pad_token_id: int, max_new_tokens: int, seed: int = 0):
        from ppo_rlhf.rollout.generation import TorchGenerator

        self.loop = TorchGenerator(stop_token_ids, pad_token_id, max_new_tokens, do_sample=True, seed=seed)
        self.stop_token_ids, self.pad_token_id = self.loop.stop_token_ids, pad_token_id

    def generate(self, model, prompt_ids, prompt_mask):
        from ppo_rlhf.rollout.sequences import response_mask_from_eos

        ids, _ = self.loop.generate(model, prompt_ids, prompt_mask)
        for row in range(ids.shape[0]):
            ids[row, min(1 + row % 3, ids.shape[1]) - 1] = self.stop_token_ids[0]
        mask = response_mask_from_eos(ids, self.stop_token_ids)  # (an earlier stop of its own still ends it)
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, self.pad_token_id))
        keep = int(mask.sum(dim=1).max())
        return ids[:, :keep], mask[:, :keep]


class Scripted:
    """A Generator that writes given token ids, turn after turn (each call: one list per row), and
    keeps what it was asked: the ids each call continued, each call's per-row token limits."""

    def __init__(self, turns: list[list[list[int]]], stop_ids: list[int], pad: int):
        self.turns, self.stop_token_ids, self.pad = list(turns), stop_ids, pad
        self.contexts, self.limits = [], []

    def generate(self, model, prompt_ids, prompt_mask, max_new_tokens=None):
        self.contexts.append([ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)])
        self.limits.append(max_new_tokens)
        rows = self.turns.pop(0)
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [self.pad] * (width - len(r)) for r in rows])
        return ids, torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run(args) -> None:
    assert main([str(a) for a in args]) == 0, args


def run_failing(args, capsys) -> str:
    """The command's stderr; it must exit 2 without a traceback."""
    assert main([str(a) for a in args]) == 2, args
    return capsys.readouterr().err


def weights_changed(before: Path, after: Path) -> bool:
    old = AutoModelForCausalLM.from_pretrained(before).state_dict()
    new = AutoModelForCausalLM.from_pretrained(after).state_dict()
    return any(not torch.equal(old[k], v) for k, v in new.items() if k in old)


def same_tensors(a: Path, b: Path) -> None:
    """Two safetensors files hold exactly the same tensors."""
    straight, resumed = load_file(str(a)), load_file(str(b))
    assert straight.keys() == resumed.keys()
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


def actor_weights(run_folder: Path) -> dict[str, torch.Tensor]:
    """The state dict of a PPO run's full-model actor."""
    return AutoModelForCausalLM.from_pretrained(Path(run_folder) / "checkpoints" / "actor").state_dict()


def same_actor_as_straight_run(straight_run: Path, resumed_run: Path, start_model: Path) -> None:
    """A resumed PPO run's actor equals the straight run's, to float round-off, and it moved from
    ``start_model`` (else the comparison would prove nothing)."""
    straight, resumed = actor_weights(straight_run), actor_weights(resumed_run)
    start = AutoModelForCausalLM.from_pretrained(start_model).state_dict()
    assert any(not torch.equal(straight[k], v) for k, v in start.items()), "the actor did not move"
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], atol=1e-6, rtol=1e-5, msg=key)


def launched(command: list[str], timeout: int) -> subprocess.CompletedProcess:
    """A launcher's ``command`` (torchrun, accelerate launch) run to its end, one thread a process,
    output captured; past ``timeout`` seconds the launcher and every process under it are killed
    (torchrun starts its workers in sessions of their own: killing the launcher or its process group
    leaves them running, holding the cores and the output pipes) and subprocess.TimeoutExpired is
    raised."""
    import os

    import psutil

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher = psutil.Process(process.pid)
        for each in [*launcher.children(recursive=True), launcher]:
            with contextlib.suppress(psutil.NoSuchProcess):
                each.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def small_grpo_config(zoo, **overrides):
    """A small GRPO run on the zoo's GPT-2, one optimizer step a batch of 4 prompts x 2 samples
    (tests/test_wiring.py, tests/test_offpolicy.py)."""
    from ppo_rlhf.config import build_config
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    return build_config(PPOConfig, {
        "model": str(zoo["gpt2"]), "reward_fn": f"{REWARDS_MODULE}:length_score", "estimator": "grpo",
        "samples_per_prompt": 2, "batch_size": 8, "mini_batch_size": 8, "ppo_epochs": 1, "max_new_tokens": 6,
        "max_length": 32, "lr": 1e-3, **overrides})


# ---------------------------------------------------------------- the chat templates of the models people train
# Each carries the logic of a real family's template that episodes depend on, written here (none is
# downloaded): where the turns begin and end, how tools, tool calls and tool answers are written.
QWEN3_TEMPLATE = """
{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions.\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return <tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == 'user' and not message.content.startswith('<tool_response>') %}
{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}
{%- for message in messages %}{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' %}{{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}{%- set reasoning_content = message.reasoning_content or '' %}
{%- if '</think>' in content %}{%- set reasoning_content = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + content }}
{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}
{%- for call in message.tool_calls or [] %}{%- set call = call.function or call %}
{{- ('\\n' if content or not loop.first else '') + '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- 'Cutting Knowledge Date: December 2023\\n\\n' + system_message + '<|eot_id|>' }}
{%- if tools %}{%- set first_user = messages[0].content %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON for a function call. Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\\n\\n' }}
{%- for tool in tools %}{{- (tool | tojson) + '\\n\\n' }}{%- endfor %}{{- first_user + '<|eot_id|>' }}{%- endif %}
{%- for message in messages %}
{%- if message.tool_calls %}
{%- if message.tool_calls | length != 1 %}{{- raise_exception('This model only supports single tool-calls at once!') }}{%- endif %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.name + '", "parameters": ' + (call.arguments | tojson) + '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

GPT_OSS_TEMPLATE = """{{- '<|start|>system<|message|>You are a helpful assistant.<|end|>' }}
{%- if tools %}{{- '<|start|>developer<|message|># Tools\\n\\nnamespace functions {\\n' }}
{%- for tool in tools %}{{- 'type ' + tool.function.name + ' = (_: ' + (tool.function.parameters | tojson) + ') => any;\\n' }}{%- endfor %}
{{- '} // namespace functions<|end|>' }}{%- endif %}
{%- set last_tool_call = namespace(name=none) %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{%- if message.content %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.content + '<|end|>' }}{%- endif %}
{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' + (call.arguments | tojson) + '<|call|>' }}
{%- set last_tool_call.name = call.name %}
{%- elif message.role == 'assistant' %}
{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + ('<|return|>' if loop.last and not add_generation_prompt else '<|end|>') }}
{%- set last_tool_call.name = none %}
{%- elif message.role == 'tool' %}
{%- if last_tool_call.name is none %}{{- raise_exception('Message has tool role, but there was no previous assistant message with a tool call!') }}{%- endif %}
{{- '<|start|>functions.' + last_tool_call.name + ' to=assistant<|channel|>commentary<|message|>' + (message.content | tojson) + '<|end|>' }}
{%- else %}{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"""

TEMPLATE_TEXT = TEXT + ['{"name": "add", "arguments": {"a": 1, "b": 2}}', "<tool_call> </tool_call> <think> </think>",
                        "the tool response is 3", '{"name": "add", "parameters": {"a": 1}}']


def family_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A tokenizer trained here carrying one family's template and special tokens:

    qwen3          ChatML, Qwen3's template (a think block in the last assistant turn only)
    llama3         Llama 3.x's headers and JSON tool calls, tools in the first user message
    gpt_oss        GPT-OSS's harmony messages, tool calls ended by <|call|>
    special_tags   ChatML whose <tool_call> / </tool_call> are special tokens, ppo-rlhf's tool template
    sentencepiece  ChatML on a SentencePiece-style (Metaspace) vocabulary, which puts a prefix
                   space in front of a text tokenized on its own
    """
    from ppo_rlhf.envs.options import tool_template_path

    if family == "sentencepiece":
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tokenizer.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first"),
                                               decoders.ByteFallback()])
        special = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
        tokenizer.train_from_iterator(TEMPLATE_TEXT, trainers.BpeTrainer(
            vocab_size=400, special_tokens=special, initial_alphabet=list("abcdefghijklmnopqrstuvwxyz▁\n<>|_/0123456789{}\":,.? ")))
        fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="<|im_end|>",
                                       pad_token="</s>", unk_token="<unk>")
        fast.chat_template = tool_template_path().read_text()
        return fast
    special, ids = {
        "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
        "special_tags": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
                         dict(eos_token="<|im_end|>", pad_token="<|endoftext|>")),
        "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                    "<|eom_id|>", "<|python_tag|>"],
                   dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|end_of_text|>")),
        "gpt_oss": (["<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>",
                     "<|constrain|>"], dict(eos_token="<|return|>", pad_token="<|endoftext|>")),
    }[family]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(TEMPLATE_TEXT, trainers.BpeTrainer(vocab_size=360, special_tokens=special,
                                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, **ids)
    if family == "special_tags":
        fast.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    fast.chat_template = {"qwen3": QWEN3_TEMPLATE, "llama3": LLAMA3_TEMPLATE, "gpt_oss": GPT_OSS_TEMPLATE,
                          "special_tags": tool_template_path().read_text()}[family]
    return fast


def family_model(family: str, folder: Path, positions: int = 1024) -> Path:
    """A tiny random model (Llama's architecture for llama3, Qwen2's otherwise) with
    :func:`family_tokenizer`'s tokenizer, saved in ``folder``; ``positions``: room for a prompt
    that lists tools."""
    tokenizer = family_tokenizer(family)
    ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
               bos_token_id=tokenizer.bos_token_id)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=positions, initializer_range=0.2, **ids)
    torch.manual_seed(0)
    config = LlamaConfig(**sizes) if family == "llama3" else Qwen2Config(tie_word_embeddings=True, **sizes)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class CallsFirst:
    """A rollout engine (the built-in loop) whose first turn of every episode writes ``text`` (a tool
    call, as the template teaches it) and its stop token; later turns are sampled, ``sampled``
    tokens at most.  A tiny random model writes no call of its own, and an agent program's rewards
    read what its calls did."""

    def __init__(self, tokenizer, text: str, sampled: int = 8, seed: int = 0):
        from ppo_rlhf.rollout.generation import TorchGenerator

        self.stop_token_ids, self.pad, self.sampled = [tokenizer.eos_token_id], tokenizer.pad_token_id, sampled
        self.call = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.max_new_tokens = max(len(self.call), sampled)
        self.loop = TorchGenerator(self.stop_token_ids, self.pad, sampled, do_sample=True, seed=seed)
        self.turn = 0

    @contextlib.contextmanager
    def holding_weights(self, model):
        """Entered once per batch of episodes (rollout/episodes.py): the next call is their first turn."""
        self.turn = 0
        yield

    def generate(self, model, prompt_ids, prompt_mask, max_new_tokens=None):
        self.turn += 1
        if self.turn > 1:
            limits = [min(limit, self.sampled) for limit in max_new_tokens] if max_new_tokens else None
            return self.loop.generate(model, prompt_ids, prompt_mask, limits)
        rows = prompt_ids.shape[0]
        return torch.tensor([self.call] * rows), torch.ones(rows, len(self.call), dtype=torch.long)


def pythia_like(folder: Path) -> Path:
    """A tiny GPT-NeoX (Pythia's architecture) whose embeddings have rows to spare beyond its
    tokenizer, as Pythia's 50304 beyond 50277: TRL's PPO scripts add a [PAD] token to the tokenizer
    and leave the model as it is."""
    from transformers import GPTNeoXConfig

    tokenizer = make_tokenizer("gpt2")
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=len(tokenizer) + 16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=256, initializer_range=0.2,
                           eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# The command, run as `ppo-rlhf` runs it, signalling itself during step AT (TIMES signals: a second
# one aborts at once).  Patched before the trainers import it, so each loop calls the patched one.
SIGNALLED = """
import signal, sys
import ppo_rlhf.interrupts as interrupts
at, times, signum = int(sys.argv.pop(1)), int(sys.argv.pop(1)), signal.Signals[sys.argv.pop(1)]
calls, asked = [0], interrupts.stop_requested

def stop_requested():
    calls[0] += 1
    if calls[0] == at:
        for _ in range(times):
            signal.raise_signal(signum)
            (lambda: None)()  # a Python call: the handler runs here, once per signal
    return asked()

interrupts.stop_requested = stop_requested
sys.argv[0] = "ppo-rlhf"
from ppo_rlhf.cli import run
run()
"""


def signalled(args: list, at: int, signum=signal.SIGTERM, times: int = 1) -> subprocess.CompletedProcess:
    """Run the command in its own process, signalled ``times`` times during step ``at``."""
    command = [sys.executable, "-c", SIGNALLED, str(at), str(times), signum.name, *map(str, args)]
    return subprocess.run(command, env={**os.environ, "PYTHONPATH": str(SRC)}, capture_output=True, text=True,
                          timeout=600)
