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
from ppo_rlhf.rollout.episodes import EpisodeLimits, episode_seeds, roll_out, samples_of, score_episodes
from ppo_rlhf.rollout.generation import Generator, TorchGenerator
from ppo_rlhf.rollout.sequences import stop_token_ids

Metric = Callable[[list, list, list, list], dict]


class Evaluator:
    """Greedy (or sampled) responses to a fixed set of held-out prompts, scored by a metric."""

    def __init__(self, tokenizer, prompt_rows: list[dict], metric: Metric | None = None, reward=None,
                 prompt_field: str = "prompt", max_prompt_length: int = 128, max_new_tokens: int = 128,
                 batch_size: int = 1024, chat_template: bool = False, environments=None,
                 limits: EpisodeLimits | None = None, environment_weight: float = 1.0, seed: int = 0,
                 show_progress: bool = False):
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
        self.show_progress = show_progress  # a bar of the episodes played (ppo-rlhf eval)
        self.last_episodes: list[dict] = []  # the last call's episodes, whole (its prompts' order)

    @torch.no_grad()
    def __call__(self, model, do_sample: bool = False, temperature: float = 1.0, seed: int = 0,
                 prefix: str = "eval/", generator: Generator | None = None) -> tuple[dict[str, float], list[tuple[str, str]]]:
        """(metrics, [(prompt, response), ...]) over all held-out prompts; an episode's response is
        its whole conversation after the prompt, and ``last_episodes`` holds each one whole (its
        messages, tool calls and results, turns, score).

        Several processes: each answers its own contiguous part of the prompts (sampling with its
        own seed), and the metric is computed on all the answers, gathered in every process.
        ``generator``: the engine to answer with (``eval --rollout-engine vllm``); default: a
        TorchGenerator with the decoding asked for here."""
        start = time.perf_counter()
        generator = generator or TorchGenerator(stop_token_ids(self.tokenizer, model), self.tokenizer.pad_token_id,
                                                self.max_new_tokens, do_sample=do_sample, temperature=temperature,
                                                seed=seed + rank())
        texts, finished, lengths, scores, shown, episodes = [], [], [], [], [], []
        # Several rewards: each one's scores too, by name (the same names in every process).
        names = list(getattr(self.reward, "names", [])) + (["environment"] if self.environments is not None and
                                                            self.environments.pays and self.reward is not None else [])
        components = {name: [] for name in names} if len(names) > 1 else {}
        mine = split_for_rank(list(range(len(self.prompts))))
        bar = self.progress_bar(len(mine))
        for begin in range(0, len(mine), self.batch_size):
            index = mine[begin:begin + self.batch_size]
            prompts, rows = [self.prompts[i] for i in index], [self.rows[i] for i in index]
            seeds = None if self.environments is None else episode_seeds(self.seed, -1, 0, index[0], len(index), 1)
            done = bar.n if bar is not None else 0
            on_turn = None if bar is None else (
                lambda turns, going, total=len(index), done=done: bar.update(done + total - going - bar.n))
            out = roll_out(model, self.tokenizer, generator, rows, prompts, self.limits, self.environments, seeds,
                           progress=on_turn)
            if bar is not None:
                bar.update(done + len(index) - bar.n)
            texts += out.texts
            finished += out.finished
            lengths += out.sequences.loss_mask.sum(dim=1).tolist()
            total = None
            if self.reward is not None or out.environments:
                total, parts = score_episodes(self.reward, rows, out, self.environment_weight)
                scores += total.tolist()
                for name in components:
                    components[name] += parts[name].tolist()
            if out.environments:
                samples = samples_of(out, total if total is not None else torch.zeros(len(index)), len(index))
                shown += [sample["response"] for sample in samples]
                episodes += episode_records(out, total)
            else:
                shown += out.texts
        if bar is not None:
            bar.close()
        texts, finished, lengths, scores, shown, episodes = (
            gather_objects(part) for part in (texts, finished, lengths, scores, shown, episodes))
        components = {name: gather_objects(values) for name, values in components.items()}
        metrics = {}
        if self.metric is not None:
            metrics.update(self.metric(self.prompts, texts, finished, self.rows))
        if scores:
            metrics["score"] = sum(scores) / len(scores)
        for name, values in components.items():
            scored = [value for value in values if not math.isnan(value)]  # the rows this reward applies to
            metrics[f"reward/{name}"] = sum(scored) / len(scored) if scored else math.nan
        metrics.update(episode_metrics(episodes))
        metrics["response_length"] = sum(lengths) / max(len(lengths), 1)
        metrics["seconds"] = time.perf_counter() - start
        self.last_episodes = [{"prompt": prompt, **episode} for prompt, episode in zip(self.prompts, episodes)]
        return {prefix + k: v for k, v in metrics.items()}, list(zip(self.prompts, shown))

    def progress_bar(self, episodes: int):
        """A bar of the episodes played (``ppo-rlhf eval`` with an environment: minutes of play), on
        the main process; None otherwise."""
        if not self.show_progress or self.environments is None or rank() != 0:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=episodes, desc="eval", unit="episode", mininterval=1.0)


def episode_records(episodes, scores: torch.Tensor | None) -> list[dict]:
    """Each episode of a batch, whole, for people to read: its messages (the tool calls each turn
    made, the tools' results), turns, whether a limit cut it, its score and its tool counts."""
    records = []
    for i, conversation in enumerate(episodes.conversations):
        stats = episodes.environments[i].tool_stats if hasattr(episodes.environments[i], "tool_stats") else {}
        records.append({"messages": conversation, "turns": episodes.turns[i], "truncated": episodes.truncated[i],
                        "score": None if scores is None else float(scores[i]), "tool_calls": episodes.tool_logs[i],
                        "counts": dict(stats or {})})
    return records


def episode_metrics(episodes: list[dict]) -> dict[str, float]:
    """Per episode: its turns, the share a limit cut, tool calls, errors and timeouts (and what else
    the environments count, env/<name>), and ``episode/success``: the share scored above 0 (a
    goal reached, a right answer, for rewards that pay 1 for it).  Nothing without episodes."""
    if not episodes:
        return {}
    count = len(episodes)
    metrics = {"episode/turns": sum(e["turns"] for e in episodes) / count,
               "episode/truncated": sum(e["truncated"] for e in episodes) / count,
               "episode/success": sum((e["score"] or 0.0) > 0 for e in episodes) / count}
    names = sorted({name for e in episodes for name in e["counts"]} | {"calls", "errors", "timeouts"})
    for name in names:
        key = f"tools/{name}" if name in ("calls", "errors", "timeouts") else f"env/{name}"
        metrics[key] = sum(e["counts"].get(name, 0) for e in episodes) / count
    return metrics
