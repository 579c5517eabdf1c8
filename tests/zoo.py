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

import json
import socket
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (AutoModelForCausalLM, CohereConfig, Gemma2Config, GemmaConfig, GPT2Config, GraniteConfig,
                          LlamaConfig, PreTrainedTokenizerFast, Qwen2Config)

from ppo_rlhf.cli import main

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
