"""Pieces every run uses before its first step: seeding, threads, the policy check."""

from __future__ import annotations

import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def set_threads(num_threads: int) -> None:
    """0 keeps torch's default.  Tiny models run fastest on one thread: the per-op work is too
    small to amortise OpenMP synchronisation, which turns pathological when another process
    holds a core."""
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def check_policy(model, tokenizer, where, prompts: list, chat_template: bool, max_prompt_length: int,
                 max_new_tokens: int, template_flag: str = "--chat-template", lengths: list[int] | None = None,
                 episode_tokens: int | None = None) -> None:
    """Refuse a policy that cannot answer these prompts (a tokenizer without EOS or, with
    --chat-template, without a template; a vocabulary or positions too small), and say how
    many prompts are longer than ``max_prompt_length`` (they lose their start).  ``lengths``: the
    prompts' lengths as the rollouts render them, where not the chat template's alone (an
    episode's prompt lists its tools: envs/chat.py, ``episode_prompt_lengths``).  ``episode_tokens``:
    with episodes, the tokens an episode may hold after its prompt (--max-episode-tokens, else all
    that --max-length leaves), which the model's positions must hold too."""
    from ppo_rlhf.models.loading import check_fits, check_tokenizer
    from ppo_rlhf.rollout.responses import prompt_lengths

    check_tokenizer(tokenizer, where, chat_template, template_flag=template_flag)
    lengths = lengths if lengths is not None else prompt_lengths(tokenizer, prompts, chat_template)
    cut = sum(length > max_prompt_length for length in lengths)
    if cut:
        print(f"{cut} of {len(lengths)} prompts are longer than {max_prompt_length} tokens (--max-length minus "
              f"--max-new-tokens) and lose their start")
    prompt = min(max(lengths), max_prompt_length)
    if episode_tokens is not None:  # an episode holds its prompt and turns up to --max-length
        check_fits(model, tokenizer, min(prompt + episode_tokens, max_prompt_length + max_new_tokens), where,
                   f"an episode's prompt and turns, up to --max-length {max_prompt_length + max_new_tokens} (1024 by "
                   f"default with --environment or --tool) or --max-episode-tokens")
        return
    check_fits(model, tokenizer, prompt + max_new_tokens, where, f"the longest prompt, at most --max-length minus "
                                                               f"--max-new-tokens = {max_prompt_length} tokens, plus "
                                                               f"--max-new-tokens {max_new_tokens}")


def prepare_to_train(model, config, accelerator, what: str):
    """``model`` ready for a trainer that trains it whole (sft, rm): its trained weights in float32,
    on the accelerator's device (default: the one ``config`` asks for), split over the processes
    of an FSDP launch (before the optimizer sees it), and each process's dropout seeded apart.
    Returns the accelerator."""
    from ppo_rlhf.distributed import rank
    from ppo_rlhf.hardware import train_in_float32
    from ppo_rlhf.sharding import shard_if_launched

    accelerator = accelerator or config.accelerator(shards=True)
    train_in_float32(model, what)
    model.to(accelerator.device)
    shard_if_launched(model)
    torch.manual_seed(config.seed + rank())  # dropout: each process draws its own masks
    return accelerator
