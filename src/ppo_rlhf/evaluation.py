"""Evaluation on held-out prompts: generate, decode, apply the task's metric.

A metric is ``metric(prompts, responses, finished, rows) -> dict[str, float]`` (a task's
``metric``; ``rows`` are the held-out prompt rows, where a task keeps what its checker needs).  Without one, the evaluator reports the mean reward and response length only.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ppo_rlhf.distributed import gather_objects, rank, split_for_rank
from ppo_rlhf.rollout.generation import Generator, TorchGenerator
from ppo_rlhf.rollout.responses import generate_responses
from ppo_rlhf.rollout.reward import ScoringBatch
from ppo_rlhf.rollout.sequences import stop_token_ids

Metric = Callable[[list, list, list, list], dict]


class Evaluator:
    """Greedy (or sampled) responses to a fixed set of held-out prompts, scored by a metric."""

    def __init__(self, tokenizer, prompt_rows: list[dict], metric: Metric | None = None, reward=None,
                 prompt_field: str = "prompt", max_prompt_length: int = 128, max_new_tokens: int = 128,
                 batch_size: int = 1024, chat_template: bool = False):
        self.tokenizer = tokenizer
        self.rows = prompt_rows
        self.prompts = [row[prompt_field] for row in prompt_rows]
        self.metric = metric
        self.reward = reward
        self.max_prompt_length = max_prompt_length
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        self.chat_template = chat_template

    @torch.no_grad()
    def __call__(self, model, do_sample: bool = False, temperature: float = 1.0, seed: int = 0,
                 prefix: str = "eval/", generator: Generator | None = None) -> tuple[dict[str, float], list[tuple[str, str]]]:
        """(metrics, [(prompt, response), ...]) over all held-out prompts.

        Several processes: each answers its own contiguous part of the prompts (sampling with its
        own seed), and the metric is computed on all the answers, gathered in every process.
        ``generator``: the engine to answer with (``eval --rollout-engine vllm``); default: a
        TorchGenerator with the decoding asked for here."""
        start = time.perf_counter()
        generator = generator or TorchGenerator(stop_token_ids(self.tokenizer, model), self.tokenizer.pad_token_id,
                                                self.max_new_tokens, do_sample=do_sample, temperature=temperature,
                                                seed=seed + rank())
        texts, finished, lengths, scores = [], [], [], []
        # Several rewards: each one's scores too, by name (the same names in every process).
        names = getattr(self.reward, "names", [])
        components = {name: [] for name in names} if len(names) > 1 else {}
        mine = split_for_rank(list(range(len(self.prompts))))
        for begin in range(0, len(mine), self.batch_size):
            index = mine[begin:begin + self.batch_size]
            prompts = [self.prompts[i] for i in index]
            out = generate_responses(model, self.tokenizer, generator, prompts, self.max_prompt_length, self.chat_template)
            texts += out.texts
            finished += out.finished
            lengths += out.sequences.response_mask.sum(dim=1).tolist()
            if self.reward is not None:
                rows = [self.rows[i] for i in index]
                scores += self.reward(ScoringBatch(rows, prompts, out.texts, out.finished, out.sequences)).tolist()
                for name in components:
                    components[name] += self.reward.last_components[name].tolist()
        texts, finished, lengths, scores = (gather_objects(part) for part in (texts, finished, lengths, scores))
        components = {name: gather_objects(values) for name, values in components.items()}
        metrics = {}
        if self.metric is not None:
            metrics.update(self.metric(self.prompts, texts, finished, self.rows))
        if scores:
            metrics["score"] = sum(scores) / len(scores)
        for name, values in components.items():
            metrics[f"reward/{name}"] = sum(values) / len(values)
        metrics["response_length"] = sum(lengths) / max(len(lengths), 1)
        metrics["seconds"] = time.perf_counter() - start
        return {prefix + k: v for k, v in metrics.items()}, list(zip(self.prompts, texts))
