"""Evaluation on held-out prompts: generate (or play episodes), decode, apply the task's metric.

A metric is ``metric(prompts, responses, finished, rows) -> dict[str, float]`` (a task's
``metric``; ``rows`` are the held-out prompt rows, where a task keeps what its checker needs).  Without one, the evaluator reports the mean reward and response length only.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from ppo_rlhf.distributed import gather_objects, rank, split_for_rank
from ppo_rlhf.rollout.episodes import EpisodeLimits, episode_seeds, roll_out, score_episodes
from ppo_rlhf.rollout.generation import Generator, TorchGenerator
from ppo_rlhf.rollout.sequences import stop_token_ids

Metric = Callable[[list, list, list, list], dict]


class Evaluator:
    """Greedy (or sampled) responses to a fixed set of held-out prompts, scored by a metric."""

    def __init__(self, tokenizer, prompt_rows: list[dict], metric: Metric | None = None, reward=None,
                 prompt_field: str = "prompt", max_prompt_length: int = 128, max_new_tokens: int = 128,
                 batch_size: int = 1024, chat_template: bool = False, environments=None,
                 limits: EpisodeLimits | None = None, environment_weight: float = 1.0, seed: int = 0):
        self.tokenizer = tokenizer
        self.rows = prompt_rows
        self.prompts = [row.get(prompt_field) for row in prompt_rows]
        self.metric = metric
        self.reward = reward
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        # Episodes (rollout/episodes.py): with an environment, each held-out row is played as one,
        # its environment seeded from the row's place, the same at every evaluation.
        self.environments, self.environment_weight, self.seed = environments, environment_weight, seed
        self.limits = limits or EpisodeLimits(max_prompt_length, max_prompt_length + max_new_tokens,
                                              chat_template=chat_template)

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
        names = list(getattr(self.reward, "names", [])) + (["environment"] if self.environments is not None and
                                                            self.environments.pays and self.reward is not None else [])
        components = {name: [] for name in names} if len(names) > 1 else {}
        mine = split_for_rank(list(range(len(self.prompts))))
        for begin in range(0, len(mine), self.batch_size):
            index = mine[begin:begin + self.batch_size]
            prompts, rows = [self.prompts[i] for i in index], [self.rows[i] for i in index]
            seeds = None if self.environments is None else episode_seeds(self.seed, -1, 0, index[0], len(index), 1)
            out = roll_out(model, self.tokenizer, generator, rows, prompts, self.limits, self.environments, seeds)
            texts += out.texts
            finished += out.finished
            lengths += out.sequences.loss_mask.sum(dim=1).tolist()
            if self.reward is not None or out.environments:
                total, parts = score_episodes(self.reward, rows, out, self.environment_weight)
                scores += total.tolist()
                for name in components:
                    components[name] += parts[name].tolist()
        texts, finished, lengths, scores = (gather_objects(part) for part in (texts, finished, lengths, scores))
        components = {name: gather_objects(values) for name, values in components.items()}
        metrics = {}
        if self.metric is not None:
            metrics.update(self.metric(self.prompts, texts, finished, self.rows))
        if scores:
            metrics["score"] = sum(scores) / len(scores)
        for name, values in components.items():
            scored = [value for value in values if not math.isnan(value)]  # the rows this reward applies to
            metrics[f"reward/{name}"] = sum(scored) / len(scored) if scored else math.nan
        metrics["response_length"] = sum(lengths) / max(len(lengths), 1)
        metrics["seconds"] = time.perf_counter() - start
        return {prefix + k: v for k, v in metrics.items()}, list(zip(self.prompts, texts))
