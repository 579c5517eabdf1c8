"""Evaluation on held-out prompts: generate (or play episodes), decode, apply the task's metric.

A metric is ``metric(prompts, responses, finished, rows) -> dict[str, float]`` (a task's
``metric``; ``rows`` are the held-out prompt rows, where a task keeps what its checker needs).  Without one, the evaluator reports the mean reward and response length only.

With K samples of each prompt (``eval --samples K``, ``ppo --eval-samples K``) it also reports
pass@k for k = 1..K (core/pass_at_k.py), mean@K and maj@K (docs/design.md, "pass@k"), from each
response's 0/1 outcome: the task's (``outcomes(prompts, responses, finished, rows)`` -> right or
not, and the parsed answer), or the reward's, which must then be 0 or 1: refused at start where
the settings say it cannot be (:func:`pass_at_k_refusal`) or a run's first scores show it is not
(:meth:`Evaluator.check_outcomes`), and otherwise as the scores come (:class:`OutcomeError`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Callable

import torch

from ppo_rlhf.core import pass_at_k
from ppo_rlhf.distributed import gather_objects, rank, split_for_rank, world_size
from ppo_rlhf.rewards import response_answer, voted_answer
from ppo_rlhf.rollout.reward import RewardError
from ppo_rlhf.rollout.reward_base import averaged_logs
from ppo_rlhf.rollout.episodes import EpisodeLimits, episode_seeds, roll_out, samples_of, score_episodes
from ppo_rlhf.rollout.generation import Generator, TorchGenerator
from ppo_rlhf.rollout.sequences import stop_token_ids

Metric = Callable[[list, list, list, list], dict]
# (prompts, responses, finished, rows) -> (right or not, parsed answer) per response
Outcomes = Callable[[list, list, list, list], tuple[list[bool], list]]


def majority_correct(answers: list, right: list) -> bool:
    """maj@k of one problem: whether the answer given most often among its samples (None: none
    parsed, never counted; a tie goes to the answer given first) is a right one."""
    votes = Counter(answer for answer in answers if answer is not None)
    if not votes:
        return False
    top = max(votes.values())
    winner = next(answer for answer in answers if answer is not None and votes[answer] == top)
    return any(bool(r) for answer, r in zip(answers, right) if answer == winner)


def sampled_metrics(right: list[list], answers: list[list] | None) -> dict[str, float]:
    """pass@1..pass@K, mean@K and (with parsed answers) maj@K over problems of K samples each:
    ``right`` (P, K) 0/1 outcomes, ``answers`` (P, K) parsed answers or None."""
    correct = torch.tensor(right, dtype=torch.float64)  # (P, K)
    k_max = correct.shape[1]
    metrics = {f"pass@{k}": pass_at_k(correct, k).mean().item() for k in range(1, k_max + 1)}
    metrics[f"mean@{k_max}"] = correct.mean().item()
    if answers is not None:
        metrics[f"maj@{k_max}"] = sum(majority_correct(a, r) for a, r in zip(answers, right)) / len(right)
    return metrics


NO_OUTCOME = ("pass@k needs a right-or-wrong outcome per response: a task with a checker, or a reward that gives 1 "
              "for right and 0 for wrong (--reward-fn ...), and this run has neither")


class OutcomeError(RewardError):
    """pass@k cannot read a right-or-wrong outcome from the scores.  Raised from the scores every
    process gathered, so alike in every process: a run may save its state before it stops."""


def reward_name(reward) -> str:
    """The reward whose scores are the outcomes, for messages: several with their weights, or the
    environment's rewards where no other reward scores (``reward`` None)."""
    if reward is None:
        return "the environment's rewards"
    return reward.plan() if hasattr(reward, "plan") else reward.description


def reward_outcomes(scores: list[float], responses: list[str], reward, flag: str = "--samples"
                    ) -> tuple[list[bool], list]:
    """Each response's 0/1 outcome from the reward's scores, and its parsed answer (its last
    <answer> tags, else its last number); OutcomeError unless every score is 0 or 1 (``flag``: the
    option that asked for K samples, named in the fix)."""
    bad = next((i for i, score in enumerate(scores) if score not in (0.0, 1.0)), None)
    if bad is not None:
        raise OutcomeError(f"pass@k needs a right-or-wrong outcome per response, but {reward_name(reward)} scored "
                           f"{scores[bad]:g} for response {responses[bad]!r}; evaluate with a reward that gives 1 "
                           f"for right and 0 for wrong (e.g. ppo_rlhf.rewards:answer_match), a task with a checker, "
                           f"or a single sample ({flag} 1)")
    return [score == 1.0 for score in scores], [voted_answer(response_answer(r)) for r in responses]


def pass_at_k_refusal(config) -> str | None:
    """Why pass@k cannot be read from the scores of a ``ppo`` or ``eval`` config's reward, where
    its settings alone say so: without a task's checker, a reward whose scores are never only 0
    and 1 -- a reward model's, a judge's probability or its rating on another scale than 0 to 1.
    None: they do not say (every task ppo-rlhf has comes with a checker; the scores themselves
    are checked as they come, :func:`reward_outcomes`)."""
    from ppo_rlhf.rollout.judge import JudgeScore

    if config.task is not None:
        return None
    if config.reward_model:
        return f"the reward model {config.reward_model} scores with a number of its own, never only 0 or 1"
    if config.reward_judge:
        score = JudgeScore.parse(config.judge_score)
        if score.kind == "token":
            return f"the judge's score (--judge-score {config.judge_score}) is a probability, not 0 or 1"
        if score.kind == "number" and (score.low, score.high) != (0.0, 1.0):
            return (f"the judge's score (--judge-score {config.judge_score}) is a rating from {score.low:g} to "
                    f"{score.high:g}, not 0 or 1 (number:0:1 asks the judge for right or wrong)")
    return None


# The held-out rates a run is judged by, the first one present: each a share of prompts in [0, 1].
HEADLINE_RATES = ("eval/exact_match", "eval/accuracy", "eval/episode/success")


def fell_below_start(before: dict, now: dict, prompts: int) -> tuple[str, float, float] | None:
    """(metric, at the start, now) where the held-out rate a run is judged by (``HEADLINE_RATES``)
    is now below the run's start by more than two standard errors of the difference of two rates
    on ``prompts`` prompts each, sqrt((p0 (1 - p0) + p1 (1 - p1)) / n): a drop the held-out set can
    tell from its noise.  None otherwise, and where there is no such rate."""
    key = next((key for key in HEADLINE_RATES if key in before and key in now), None)
    if key is None or prompts < 1:
        return None
    start, current = before[key], now[key]
    noise = math.sqrt((start * (1 - start) + current * (1 - current)) / prompts)
    return (key, start, current) if start - current > 2 * noise else None


class Evaluator:
    """Greedy (or sampled) responses to a fixed set of held-out prompts, scored by a metric."""

    def __init__(self, tokenizer, prompt_rows: list[dict], metric: Metric | None = None, reward=None,
                 prompt_field: str = "prompt", max_prompt_length: int = 128, max_new_tokens: int = 128,
                 batch_size: int = 1024, chat_template: bool = False, environments=None,
                 limits: EpisodeLimits | None = None, environment_weight: float = 1.0, seed: int = 0,
                 outcomes: Outcomes | None = None, show_progress: bool = False, samples_flag: str = "--samples"):
        self.tokenizer = tokenizer
        self.rows = prompt_rows
        self.prompts = [row.get(prompt_field) for row in prompt_rows]
        self.metric = metric
        self.outcomes = outcomes  # a task's right-or-wrong per response, for pass@k
        self.samples_flag = samples_flag  # the option asking for K samples, named in pass@k's refusals
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
        # The last call's scores and responses, every process's (pass@k's outcomes checked at start).
        self.last_scored: tuple[list[float], list[str]] = ([], [])

    @torch.no_grad()
    def __call__(self, model, do_sample: bool = False, temperature: float = 1.0, seed: int = 0,
                 prefix: str = "eval/", generator: Generator | None = None, samples: int = 1
                 ) -> tuple[dict[str, float], list[tuple[str, str]]]:
        """(metrics, [(prompt, response), ...]) over all held-out prompts; an episode's response is
        its whole conversation after the prompt, and ``last_episodes`` holds each one whole (its
        messages, tool calls and results, turns, score).

        Several processes: each answers its own contiguous part of the prompts (sampling with its
        own seed), and the metric is computed on all the answers, gathered in every process.
        ``generator``: the engine to answer with (``eval --rollout-engine vllm``); default: a
        TorchGenerator with the decoding asked for here.  ``samples`` K > 1: each prompt answered
        K times (sampled: the generator's decoding), the metrics over all K x P answers, and
        pass@k, mean@K and maj@K added; the pairs returned are each prompt's first answer."""
        start = time.perf_counter()
        generator = generator or TorchGenerator(stop_token_ids(self.tokenizer, model), self.tokenizer.pad_token_id,
                                                self.max_new_tokens, do_sample=do_sample, temperature=temperature,
                                                seed=seed + rank())
        texts, finished, lengths, scores, shown, episodes = [], [], [], [], [], []
        # Several rewards: each one's scores too, by name (the same names in every process).
        names = list(getattr(self.reward, "names", [])) + (["environment"] if self.environments is not None and
                                                            self.environments.pays and self.reward is not None else [])
        components = {name: [] for name in names} if len(names) > 1 else {}
        if self.reward is not None:
            self.reward.new_iteration()  # a judge's cache and counts: this evaluation's own
        mine = split_for_rank(list(range(len(self.prompts))))
        per_batch = max(self.batch_size // samples, 1)  # prompts a generate call answers, K times each
        bar = self.progress_bar(len(mine) * samples)
        calls = [mine[begin:begin + per_batch] for begin in range(0, len(mine), per_batch)]
        if getattr(generator, "steps_together", False):
            # An engine whose steps are collectives (vLLM under a launch) is called as often in every
            # process: a process with fewer prompts plays the rest on the first prompt, answers dropped
            # (docs/design.md, "Collectives of a rollout").
            most = math.ceil(math.ceil(len(self.prompts) / world_size()) / per_batch)
            for _ in range(most - len(calls)):
                roll_out(model, self.tokenizer, generator, self.rows[:1], self.prompts[:1], self.limits,
                         self.environments, None if self.environments is None else [self.seed])
        for index in calls:
            # Each prompt's K samples in adjacent rows; an environment's K episodes start alike.
            prompts = [self.prompts[i] for i in index for _ in range(samples)]
            rows = [self.rows[i] for i in index for _ in range(samples)]
            seeds = (None if self.environments is None
                     else episode_seeds(self.seed, -1, 0, index[0], len(index), samples))
            done = bar.n if bar is not None else 0
            on_turn = None if bar is None else (
                lambda turns, going, total=len(rows), done=done: bar.update(done + total - going - bar.n))
            out = roll_out(model, self.tokenizer, generator, rows, prompts, self.limits, self.environments, seeds,
                           progress=on_turn)
            if bar is not None:
                bar.update(done + len(rows) - bar.n)
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
                shown += [sample["response"] for sample in samples_of(
                    out, total if total is not None else torch.zeros(len(rows)), len(rows))]
                episodes += episode_records(out, total)
            else:
                shown += out.texts
        if bar is not None:
            bar.close()
        texts, finished, lengths, scores, shown, episodes = (
            gather_objects(part) for part in (texts, finished, lengths, scores, shown, episodes))
        components = {name: gather_objects(values) for name, values in components.items()}
        metrics = {}
        all_prompts = [p for p in self.prompts for _ in range(samples)]
        all_rows = [row for row in self.rows for _ in range(samples)]
        if self.metric is not None:
            metrics.update(self.metric(all_prompts, texts, finished, all_rows))
        if scores:
            metrics["score"] = sum(scores) / len(scores)
        for name, values in components.items():
            scored = [value for value in values if not math.isnan(value)]  # the rows this reward applies to
            metrics[f"reward/{name}"] = sum(scored) / len(scored) if scored else math.nan
        metrics.update(episode_metrics(episodes))
        if self.reward is not None:  # a judge's counts (judge/unparsed), summed over the processes
            for counts in gather_objects([self.reward.iteration_counts()]):
                for name, count in counts.items():
                    metrics[name] = metrics.get(name, 0.0) + count
            # What reward functions logged (TRL's log_metric), averaged over every call and process.
            metrics.update(averaged_logs(gather_objects([self.reward.logged_metrics()])))
        self.last_scored = scores, texts
        if samples > 1:
            metrics.update(self.pass_at_k(all_prompts, texts, finished, all_rows, scores, samples))
        metrics["response_length"] = sum(lengths) / max(len(lengths), 1)
        metrics["seconds"] = time.perf_counter() - start
        self.last_episodes = [{"prompt": prompt, **episode} for prompt, episode in zip(all_prompts, episodes)]
        return {prefix + k: v for k, v in metrics.items()}, list(zip(self.prompts, shown[::samples]))

    def progress_bar(self, episodes: int):
        """A bar of the episodes played (``ppo-rlhf eval`` with an environment: minutes of play), on
        the main process; None otherwise."""
        if not self.show_progress or self.environments is None or rank() != 0:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=episodes, desc="eval", unit="episode", mininterval=1.0)

    def check_outcomes(self) -> None:
        """OutcomeError, before a run's first iteration, where the last call's scores (its greedy
        evaluation's, every process's) already show that pass@k cannot be read from the reward: a
        score that is neither 0 nor 1.  Nothing with a task's checker."""
        scores, texts = self.last_scored
        if self.outcomes is not None:
            return
        if self.reward is None and not (self.environments is not None and self.environments.pays):
            raise OutcomeError(NO_OUTCOME)
        if scores:
            reward_outcomes(scores, texts, self.reward, self.samples_flag)

    def pass_at_k(self, prompts: list, texts: list[str], finished: list[bool], rows: list[dict], scores: list[float],
                  samples: int) -> dict[str, float]:
        """pass@k, mean@K, maj@K of K adjacent samples per prompt, from the task's outcomes (its
        checker says right or wrong, and what each answer was), else the reward's 0/1 scores."""
        if self.outcomes is not None:
            right, answers = self.outcomes(prompts, texts, finished, rows)
        elif scores:
            right, answers = reward_outcomes(scores, texts, self.reward, self.samples_flag)
        else:
            raise OutcomeError(NO_OUTCOME)
        grouped = [list(right[i:i + samples]) for i in range(0, len(right), samples)]
        votes = [list(answers[i:i + samples]) for i in range(0, len(answers), samples)]
        return sampled_metrics(grouped, votes)



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
