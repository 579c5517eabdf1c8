"""Prompts in, decoded responses out: the step shared by PPO rollouts and evaluation."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo_rlhf.rollout.encoding import encode_texts
from ppo_rlhf.rollout.generation import Generator
from ppo_rlhf.rollout.sequences import Sequences, StopIds, finished_flags


def encode_prompts(tokenizer, prompts: list[str], max_prompt_length: int, device="cpu",
                   add_special_tokens: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) prompt ids and mask: every prompt ends where its response begins.
    Long prompts lose their start."""
    ids, mask = encode_texts(tokenizer, prompts, max_prompt_length, "left", add_special_tokens)
    return ids.to(device), mask.to(device)


@dataclass
class Responses:
    sequences: Sequences
    texts: list[str]  # decoded responses, special tokens removed
    finished: list[bool]  # ended with a stop id


def decode_responses(tokenizer, sequences: Sequences, stop_ids: StopIds) -> tuple[list[str], list[bool]]:
    texts = tokenizer.batch_decode(sequences.response_ids, skip_special_tokens=True)
    finished = finished_flags(sequences.response_ids, sequences.response_mask, stop_ids)
    return texts, finished.tolist()


@torch.no_grad()
def generate_responses(model, tokenizer, generator: Generator, prompts: list[str], max_prompt_length: int,
                       chat_template: bool = False) -> Responses:
    device = next(model.parameters()).device
    if chat_template:
        prompts = apply_chat_template(tokenizer, prompts)
    # A chat template writes the special tokens (BOS, turn markers) itself: do not add them twice.
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, max_prompt_length, device,
                                             add_special_tokens=not chat_template)
    response_ids, response_mask = generator.generate(model, prompt_ids, prompt_mask)
    sequences = Sequences(prompt_ids, prompt_mask, response_ids, response_mask)
    texts, finished = decode_responses(tokenizer, sequences, generator.stop_token_ids)
    return Responses(sequences, texts, finished)


def apply_chat_template(tokenizer, prompts: list, tools: list | None = None) -> list[str]:
    """Format each prompt (a user message string, or a list of chat messages) with the
    tokenizer's chat template, ending with the assistant's turn opened.  ``tools``: each prompt's
    tool schemas (or None), which the template lists (a conversational row's ``tools``)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
    formatted = []
    for prompt, prompt_tools in zip(prompts, tools or [None] * len(prompts)):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        formatted.append(tokenizer.apply_chat_template(messages, tools=prompt_tools or None, tokenize=False,
                                                       add_generation_prompt=True))
    return formatted


def prompt_lengths(tokenizer, prompts: list, chat_template: bool = False) -> list[int]:
    """Tokens of each prompt as a rollout encodes it (through the chat template if asked), before any cut."""
    if chat_template:
        prompts = apply_chat_template(tokenizer, prompts)
    return [len(ids) for ids in tokenizer(prompts, add_special_tokens=not chat_template)["input_ids"]]
