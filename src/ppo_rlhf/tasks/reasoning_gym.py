"""Real reasoning tasks with their own checkers: ``--task reasoning-gym:NAME``.

The ``reasoning-gym`` package (``pip install -e ".[tasks]"``) generates each task's problems
offline from a seed and scores an answer with its own ``score_answer``: the problems and the
judge are someone else's, so a rising accuracy here is not a reward this project wrote for itself.

    prompt   chat messages: a system instruction asking for the final answer in <answer>...</answer>,
             then the problem; they go through the model's chat template (docs/design.md, "Tasks")
    reward   the task's own score of the extracted answer (0..1): the last <answer> tags' content,
             or without tags the last number when the answer is a number; plus --format-reward W
             for a response whose answer is in the tags
    metric   accuracy (score 1), the mean score, the fraction of answers in the tags

Problems ``0 .. task_size - 1`` of one generated set train; the next ``task_eval_size`` are held out,
less any whose question is also a training one, so training and held-out problems never overlap.
Each prompt row carries the problem's ``answer`` (a reward written for the data sees it) and its
``task_index``, which the task's reward and metric use to find the problem for its checker.
"""

from __future__ import annotations

import math

from ppo_rlhf.config import ConfigError
from ppo_rlhf.rewards import as_number, extract_answer, last_number, voted_answer

PREFIX = "reasoning-gym:"
SYSTEM_PROMPT = ("Solve the problem. You may reason briefly first; then give only the final answer inside "
                 "<answer></answer> tags, for example <answer>42</answer>.")
HELD_OUT_DRAWS = 4
INSTALL = 'pip install -e ".[tasks]" (or pip install reasoning-gym)'


def import_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(f"--task {PREFIX}NAME needs the reasoning-gym package, which is not installed: "
                          f"{INSTALL}") from None
    return reasoning_gym


def task_names() -> list[str]:
    return sorted(import_reasoning_gym().factory.DATASETS)


def parse_task_config(text: str) -> dict:
    """``key=value,key=value`` -> a dict, each value read as YAML (config_yaml.py, ``parse_key_values``)."""
    from ppo_rlhf.config_yaml import parse_key_values

    return parse_key_values(text, "task_config", "min_terms=2,max_terms=4")


class ReasoningGymTask:
    """One reasoning-gym dataset as the stages see a task: prompt rows, reward and metric."""

    def __init__(self, name: str, size: int, eval_size: int, seed: int, settings: dict | None = None,
                 format_reward: float = 0.0, exact: bool = False):
        reasoning_gym = import_reasoning_gym()
        if name not in reasoning_gym.factory.DATASETS:
            raise ConfigError(f"unknown reasoning-gym task {name!r}; allowed: {', '.join(task_names())}")
        # Held-out problems are drawn after the training ones, skipping any that repeats a training
        # question (or an earlier held-out one): a small problem space repeats itself, and a repeat
        # would be scored as held out.  Up to HELD_OUT_DRAWS x eval_size candidates are tried.
        pool = size + HELD_OUT_DRAWS * eval_size
        try:
            dataset = reasoning_gym.create_dataset(name, size=pool, seed=seed, **(settings or {}))
        except (TypeError, ValueError, AssertionError) as error:  # a setting its config does not have or refuses
            raise ConfigError(f"--task-config for reasoning-gym task {name!r}: {type(error).__name__}: {error}") from None
        self.name = PREFIX + name
        self.dataset = dataset
        self.entries = [dataset[i] for i in range(size)]  # generated once, index = the dataset's: the checker reads them
        self.format_reward = format_reward
        self.exact = exact  # the reward: 1 for a right answer, not the checker's partial credit
        self.train_indices = list(range(size))
        self.eval_indices, seen = [], {entry["question"] for entry in self.entries}
        for index in range(size, pool):
            if len(self.eval_indices) == eval_size:
                break
            self.entries.append(dataset[index])
            if self.entries[index]["question"] not in seen:
                seen.add(self.entries[index]["question"])
                self.eval_indices.append(index)
        self.held_out_short = eval_size - len(self.eval_indices)  # fewer distinct problems than asked
        if eval_size and not self.eval_indices:
            raise ConfigError(f"reasoning-gym task {name!r}{' with ' + str(settings) if settings else ''}: all of its "
                              f"distinct problems are among the {size} training ones (--task-size), none is left to "
                              f"hold out; lower --task-size or widen the problem space with --task-config")

    def row(self, index: int) -> dict:
        entry = self.entries[index]
        return {"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": entry["question"]}],
                "answer": str(entry["answer"]), "task_index": index}

    def prompt_rows(self) -> list[dict]:
        return [self.row(i) for i in self.train_indices]

    def eval_rows(self) -> list[dict]:
        return [self.row(i) for i in self.eval_indices]

    def answer(self, response: str, index: int) -> str | None:
        """What the response answers: the content of its last <answer> tags; without tags, the last
        number it writes when the problem's answer is a number (a small model often states it
        plainly, "... = 12"), else nothing."""
        tagged = extract_answer(response)
        if tagged is not None or as_number(self.entries[index]["answer"]) is None:
            return tagged
        return last_number(response)

    def score(self, response: str, index: int) -> float:
        """The task's own score (0..1) of the response's answer."""
        score = self.dataset.score_answer(self.answer(response, index), self.entries[index])
        return float(score) if score is not None and math.isfinite(score) else 0.0

    def rule_reward(self, prompts: list, responses: list[str], task_index: list[int], **columns) -> list[float]:
        """The task's score of each response (--task-reward exact: 1 where it is a full score, else
        0), plus --format-reward for an answer in the tags."""
        scores = [self.score(response, index) for response, index in zip(responses, task_index)]
        if self.exact:
            scores = [float(score >= 1.0) for score in scores]
        return [score + self.format_reward * (extract_answer(response) is not None)
                for score, response in zip(scores, responses)]

    def metric(self, prompts: list, responses: list[str], finished: list[bool], rows: list[dict]) -> dict[str, float]:
        scores = [self.score(response, row["task_index"]) for response, row in zip(responses, rows)]
        n = max(len(scores), 1)
        return {"accuracy": sum(s >= 1.0 for s in scores) / n, "task_score": sum(scores) / n,
                "answer_format": sum(extract_answer(r) is not None for r in responses) / n}


    def outcomes(self, prompts: list, responses: list[str], finished: list[bool], rows: list[dict]
                 ) -> tuple[list[bool], list]:
        """Each response's accuracy (the checker's full score: pass@k's outcome) and its answer as a
        vote counts it (rewards.py, voted_answer)."""
        right = [self.score(r, row["task_index"]) >= 1.0 for r, row in zip(responses, rows)]
        return right, [voted_answer(self.answer(r, row["task_index"])) for r, row in zip(responses, rows)]


def make_task(name: str, size: int, eval_size: int, seed: int, settings: dict | None = None,
              format_reward: float = 0.0, exact: bool = False) -> ReasoningGymTask:
    return ReasoningGymTask(name, size, eval_size, seed, settings, format_reward, exact)
