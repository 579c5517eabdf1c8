"""bench_distill.py's teacher and its off-policy student (issue 61, items 2-3).

The teacher: SmolLM2-135M-Instruct fine-tuned in full on worked solutions of chain_sum problems,
each written from the problem's own terms and answer (left to right, every operand split into its
place values), on problems drawn from another seed than the students' and never one of their
training or held-out questions: the worked solutions stay out of every student's data.

The off-policy student ("SFT on the teacher's samples"): the teacher samples K answers to the
prompts the RL students draw, at their temperature, and the student's LoRA adapter is fine-tuned on
them with the RL recipe's batch and learning rate, one optimizer step a batch; it is evaluated after
every ``eval_every`` steps (the run resumed between), against its training seconds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

TEACHER_SEED_OFFSET = 1000  # the teacher's problems: another seed than the students' task seed
TERM = re.compile(r"\s*([+-])?\s*(\d+)")


def place_values(number: int) -> list[int]:
    """42 -> [40, 2]; 305 -> [300, 5]; 7 -> [7]; 0 -> [0]: the non-zero place values, largest first."""
    digits = str(number)
    parts = [int(d) * 10 ** (len(digits) - 1 - i) for i, d in enumerate(digits) if d != "0"]
    return parts or [0]


def worked_solution(expression: str, answer: str) -> str:
    """A chain_sum problem worked left to right: '15 - 43', '-28' ->
    'Start at 15. Subtract 43: 15 - 40 = -25, -25 - 3 = -28. <answer>-28</answer>'.
    ValueError where the working does not reach ``answer`` (a problem this reader does not parse)."""
    terms = [(sign or "+", int(value)) for sign, value in TERM.findall(expression)]
    if not terms or TERM.sub("", expression).strip():
        raise ValueError(f"not a chain of sums: {expression!r}")
    total = terms[0][1] if terms[0][0] == "+" else -terms[0][1]
    steps = [f"Start at {total}."]
    for sign, value in terms[1:]:
        moves = []
        for part in place_values(value):
            after = total + part if sign == "+" else total - part
            moves.append(f"{total} {sign} {part} = {after}")
            total = after
        verb = "Add" if sign == "+" else "Subtract"
        steps.append(f"{verb} {value}: " + ", ".join(moves) + ".")
    if str(total) != str(answer).strip():
        raise ValueError(f"{expression!r} works out to {total}, not the answer {answer!r}")
    return " ".join(steps) + f" <answer>{total}</answer>"


def teacher_rows(recipe: dict, size: int) -> list[dict]:
    """``size`` chain_sum problems of the students' generator settings from another seed, none of
    them a question the students train or are evaluated on (their ``task_seed``, fixed for every
    student), each with its worked solution, as chat rows for ``sft --chat-template`` (the
    students' system prompt and question)."""
    from ppo_rlhf.tasks.reasoning_gym import ReasoningGymTask, parse_task_config

    name, settings = recipe["task"].split(":", 1)[1], parse_task_config(recipe["task_config"])
    students = ReasoningGymTask(name, recipe["task_size"], recipe.get("task_eval_size", 200), recipe["task_seed"],
                                settings)
    seen = {entry["question"] for entry in students.entries}
    teacher = ReasoningGymTask(name, size * 3, 0, TEACHER_SEED_OFFSET, settings)
    rows = []
    for index, entry in enumerate(teacher.entries):
        if entry["question"] in seen or len(rows) == size:
            continue
        seen.add(entry["question"])
        row = teacher.row(index)
        rows.append({"prompt": row["prompt"],
                     "completion": worked_solution(entry["metadata"]["expression"], entry["answer"])})
    return rows


def cli(arguments: list, log: Path) -> None:
    """``ppo-rlhf ARGUMENTS`` in a process of its own, its output appended to ``log``."""
    with log.open("a") as handle:
        subprocess.run([sys.executable, "-m", "ppo_rlhf.cli", *map(str, arguments)], check=True, stdout=handle,
                       stderr=subprocess.STDOUT)


def build_teacher(out: Path, model: str, recipe: dict, size: int, steps: int, lr: float, log: Path,
                  num_threads: int) -> str:
    """The worked-solution teacher: ``steps`` full fine-tuning steps of 32 rows on ``size``
    problems (a finished one is kept, a stopped one resumed from its last checkpoint)."""
    run = out / "teacher-sft"
    folder = run / "checkpoints" / "sft"
    if (folder / "config.json").is_file():
        return str(folder)
    data = out / "teacher_rows.jsonl"
    started = (run / "checkpoints" / "last").is_dir() and data.is_file()
    if not started:
        data.write_text("".join(json.dumps(row) + "\n" for row in teacher_rows(recipe, size)))
    cli(["sft", "--model", model, "--data", data, "--chat-template", "--steps", steps, "--batch-size", 32, "--lr", lr,
         "--warmup-steps", 10, "--max-length", 256, "--eval-fraction", 0, "--save-every", 25,
         "--num-threads", num_threads, "--out", run, "--resume" if started else "--overwrite", "--report-to", "none"],
        log)
    return str(folder)


def teacher_samples(teacher: str, recipe: dict, prompts: int, seed: int, path: Path) -> float:
    """The teacher's answers to the first ``prompts`` training prompts, ``samples_per_prompt`` each
    at the recipe's temperature, as sft rows at ``path``; returns the sampling seconds."""
    import time

    from ppo_rlhf.config import build_config
    from ppo_rlhf.evaluation import Evaluator
    from ppo_rlhf.models import load_causal_lm, load_tokenizer
    from ppo_rlhf.tasks import make_task
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    config = build_config(PPOConfig, {**recipe, "model": teacher, "out": str(path.parent / "unused"), "seed": seed})
    task = make_task(config, seed)
    k = recipe["samples_per_prompt"]
    rows = [row for row in task.prompt_rows()[:prompts] for _ in range(k)]  # each prompt K times, adjacent
    tokenizer = load_tokenizer(teacher)
    chat = not isinstance(rows[0]["prompt"], str)
    evaluator = Evaluator(tokenizer, rows, task.metric, max_prompt_length=config.max_prompt_length,
                          max_new_tokens=recipe["max_new_tokens"], chat_template=chat)
    start = time.perf_counter()
    evaluator(load_causal_lm(teacher).eval(), do_sample=True, temperature=recipe.get("temperature", 1.0), seed=seed)
    seconds = time.perf_counter() - start
    _, responses = evaluator.last_scored
    path.write_text("".join(json.dumps({"prompt": row["prompt"], "completion": response}) + "\n"
                            for row, response in zip(rows, responses)))
    return seconds


def sft_student(out: Path, model: str, data: Path, recipe: dict, steps: int, eval_every: int, evaluate, log: Path,
                num_threads: int) -> list[tuple[float, float]]:
    """The LoRA student fine-tuned on ``data``: (training seconds, held-out accuracy) before it and
    after every ``eval_every`` of ``steps`` steps of the recipe's batch and learning rate (constant,
    as the RL students' is), the run resumed between; ``evaluate(folder)`` gives an accuracy."""
    chat = "--chat-template" if recipe["task"] != "doubling" else "--no-chat-template"
    common = ["sft", "--model", model, "--data", data, chat, "--lora", "--batch-size", recipe["batch_size"],
              "--lr", recipe["lr"], "--min-lr-ratio", 1.0, "--warmup-steps", 0, "--eval-fraction", 0,
              "--save-every", eval_every, "--max-length", recipe.get("max_length", 256), "--seed", 0,
              "--num-threads", num_threads, "--out", out, "--report-to", "none"]
    curve = [(0.0, evaluate(model))]
    for done in range(eval_every, steps + eval_every, eval_every):
        done = min(done, steps)
        cli([*common, "--steps", done, *(["--resume"] if done > eval_every else ["--overwrite"])], log)
        seconds = [json.loads(line)["seconds"] for line in (out / "metrics.jsonl").read_text().splitlines()
                   if '"seconds"' in line][-1]
        curve.append((seconds, evaluate(str(out / "checkpoints" / "sft"))))
    return curve
