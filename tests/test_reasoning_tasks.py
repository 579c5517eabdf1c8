"""reasoning-gym tasks (``--task reasoning-gym:NAME``): problems from the package's generator,
answers scored by its own checker, training and held-out problems apart, and the bad settings
named at start."""

from __future__ import annotations

import json

import pytest

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.tasks import held_out_mismatch
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import THREADS, run, run_failing

reasoning_gym = pytest.importorskip("reasoning_gym", reason="the tasks extra is not installed: pip install -e '.[tasks]'")

from ppo_rlhf.tasks.reasoning_gym import (  # noqa: E402 -- after the skip
    SYSTEM_PROMPT,
    ReasoningGymTask,
    parse_task_config,
)


def test_task_config_is_read_as_yaml_values():
    assert parse_task_config("min_terms=2,max_terms=3") == {"min_terms": 2, "max_terms": 3}
    assert parse_task_config("allow_negation=true, weights=[0.5, 0.5], name=abc") == {
        "allow_negation": True, "weights": [0.5, 0.5], "name": "abc"}
    assert parse_task_config("") == {}
    with pytest.raises(ConfigError, match="key=value pairs"):
        parse_task_config("min_terms")


def test_rows_hold_the_problem_its_answer_and_never_a_training_question_held_out():
    task = ReasoningGymTask("chain_sum", size=300, eval_size=100, seed=3, settings={"min_terms": 2, "max_terms": 2,
                                                                                    "min_digits": 1, "max_digits": 1})
    train, held_out = task.prompt_rows(), task.eval_rows()
    # One-digit sums and differences of two terms: 200 problems in all, most of them among 300 training ones.
    # The held-out set skips repeats (of a training problem or of itself) and stops short, saying so.
    training_questions = {r["prompt"][1]["content"] for r in train}
    held_out_questions = [r["prompt"][1]["content"] for r in held_out]
    assert len(train) == 300 and 0 < len(held_out) < 100 and task.held_out_short == 100 - len(held_out)
    assert not set(held_out_questions) & training_questions and len(set(held_out_questions)) == len(held_out)
    row = train[0]
    assert row["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert row["answer"] == str(task.entries[row["task_index"]]["answer"])


def test_the_held_out_set_draws_past_repeats_to_the_size_asked():
    # Two-digit sums of two terms: repeats among 2,000 training problems, and yet 100 held out.
    settings = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    task = ReasoningGymTask("chain_sum", size=2000, eval_size=100, seed=0, settings=settings)
    questions = [r["prompt"][1]["content"] for r in task.eval_rows()]
    assert len(questions) == 100 == len(set(questions)) and task.held_out_short == 0
    assert not set(questions) & {r["prompt"][1]["content"] for r in task.prompt_rows()}
    assert task.eval_indices[-1] > 2000 + 100 - 1  # it had to draw past the first 100 candidates



def test_a_held_out_set_short_of_the_size_asked_is_said_at_start(capsys):
    from ppo_rlhf.tasks import TaskOptions, make_task

    options = TaskOptions(task="reasoning-gym:chain_sum", task_size=300, task_eval_size=100,
                          task_config="min_terms=2,max_terms=2,min_digits=1,max_digits=1")
    task = make_task(options, seed=3)
    assert f"reasoning-gym:chain_sum gave {len(task.eval_indices)} held-out problems, not 100" in capsys.readouterr().out


def test_a_task_with_nothing_left_to_hold_out_is_refused_at_start():
    # 200 distinct one-digit problems, all among 3,000 training ones: an empty held-out set is an
    # error that says what to change, not a crash of the first evaluation.
    settings = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    with pytest.raises(ConfigError, match="none is left to hold out; lower --task-size"):
        ReasoningGymTask("chain_sum", size=3000, eval_size=50, seed=0, settings=settings)


def test_the_tasks_own_checker_scores_the_tagged_answer():
    task = ReasoningGymTask("chain_sum", size=4, eval_size=4, seed=0, format_reward=0.1)
    rows = task.eval_rows()
    right = [f"I add them: 1 + 2. <answer>{row['answer']}</answer>" for row in rows]
    untagged = [f"Adding up gives 3, then {row['answer']}" for row in rows]  # the last number counts
    wrong = ["<answer>not a number</answer> but " + row["answer"] for row in rows]  # the tags count, not the rest
    indices = [row["task_index"] for row in rows]
    assert task.rule_reward([], right, indices) == [pytest.approx(1.1)] * len(rows)
    assert task.rule_reward([], untagged, indices) == [1.0] * len(rows)  # right, without the format bonus
    assert task.rule_reward([], wrong, indices) == [pytest.approx(0.1)] * len(rows)
    assert task.rule_reward([], ["no number here"] * len(rows), indices) == [0.0] * len(rows)
    metrics = task.metric([], right[:2] + wrong[2:], [True] * len(rows), rows)
    assert metrics == {"accuracy": 0.5, "task_score": 0.5, "answer_format": 1.0}


def test_unknown_task_names_the_valid_ones_and_bad_settings_name_the_setting():
    with pytest.raises(ConfigError, match="unknown reasoning-gym task 'no_such'; allowed: .*basic_arithmetic.*chain_sum"):
        ReasoningGymTask("no_such", 4, 4, 0)
    with pytest.raises(ConfigError, match="--task-config for reasoning-gym task 'chain_sum'.*bogus"):
        ReasoningGymTask("chain_sum", 4, 4, 0, {"bogus": 1})


@pytest.mark.parametrize("values, message", [
    ({"task": "reasoning-gym:"}, "'task'.*doubling or reasoning-gym:NAME"),
    ({"task": "sudoku"}, "'task'.*doubling or reasoning-gym:NAME"),
    ({"task": "reasoning-gym:chain_sum", "task_size": 0}, "'task_size'.*> 0"),
    ({"task": "reasoning-gym:chain_sum", "format_reward": -1}, "'format_reward'.*>= 0"),
    ({"task": "reasoning-gym:chain_sum", "task_config": "x"}, "'task_config'.*key=value"),
    ({"task": "doubling", "format_reward": 0.5}, "'format_reward'.*without --task reasoning-gym"),
    ({"task": "doubling", "task_config": "a=1"}, "'task_config'.*without --task reasoning-gym"),
])
def test_bad_task_settings_fail_when_the_config_is_built(values, message):
    with pytest.raises(ConfigError, match=message):
        build_config(PPOConfig, {"model": "m", **values})


def test_a_reasoning_gym_task_formats_its_prompts_with_the_chat_template():
    assert build_config(PPOConfig, {"model": "m", "task": "reasoning-gym:chain_sum"}).chat_template is True


def test_a_tiny_model_trains_and_evaluates_on_a_reasoning_gym_task(zoo, tmp_path, capsys):
    out = tmp_path / "ppo"
    task = ["--task", "reasoning-gym:chain_sum", "--task-size", 12, "--task-eval-size", 4, "--task-config",
            "min_terms=2,max_terms=2"]
    run(["ppo", "--model", zoo["qwen2"], *task, "--format-reward", 0.5, "--estimator", "grpo",
         "--samples-per-prompt", 4, "--batch-size", 8, "--mini-batch-size", 4, "--ppo-epochs", 1, "--iterations", 2,
         "--max-new-tokens", 8, "--max-length", 120, "--eval-every", 1, "--lr", 1e-3, "--out", out, *THREADS])
    assert "reward:    " in capsys.readouterr().out
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(key in records[0] for key in ("eval/accuracy", "eval/task_score", "eval/answer_format"))
    assert all("eval_sampled/accuracy" in r and "reward/rule_reward" in r
               for r in records[1:])
    summary = json.loads((out / "summary.json").read_text())
    assert "eval/accuracy" in summary["before"] and "eval/accuracy" in summary["after"]
    assert "eval_sampled/accuracy" in summary["after_sampled"]
    run(["eval", "--model", out / "checkpoints" / "actor", *task, "--max-new-tokens", 8, "--max-length", 120,
         "--out", tmp_path / "eval", *THREADS])
    evaluated = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert evaluated["prompts"] == 4 and "accuracy" in evaluated and evaluated["samples"][0]["prompt"][0]["role"] == "system"
    assert "warning" not in capsys.readouterr().out  # the run's own task flags: its own held-out problems
    # The checkpoint evaluated with a smaller --task-size: held out from problem 6 on, which the run trained on.
    run(["eval", "--model", out / "checkpoints" / "actor", *task[:2], "--task-size", 6, *task[4:], "--size", 2,
         "--max-new-tokens", 8, "--max-length", 120, *THREADS])
    assert ("warning: " + str(out / "checkpoints" / "actor") + " was trained on reasoning-gym:chain_sum by " + str(out)
            + "; the run trained with --task-size 12, this evaluation uses --task-size 6: its held-out problems are not "
              "the ones that run held out, and some are problems it trained on") in capsys.readouterr().out


RUN = {"task": "reasoning-gym:chain_sum", "task_size": 2000, "task_seed": None, "seed": 0,
       "task_config": "min_terms=2,max_terms=2"}


@pytest.mark.parametrize("changed, said", [
    ({}, None),
    ({"task_config": "max_terms=2, min_terms=2"}, None),  # the same settings, written otherwise
    ({"task_seed": 0}, None),  # the seed the run's generator took from --seed
    ({"task": "reasoning-gym:gcd"}, None),  # another task: nothing to compare
    ({"task_size": 10000}, "the run trained with --task-size 2000, this evaluation uses --task-size 10000: its "
                           "held-out problems are not the ones that run held out"),
    ({"task_size": 500}, "uses --task-size 500: its held-out problems are not the ones that run held out, and some "
                         "are problems it trained on (the generator's first 2000)"),
    ({"seed": 1, "task_config": ""}, "the run trained with --task-seed 0 --task-config 'min_terms=2,max_terms=2', "
                                     "this evaluation uses --task-seed 1 --task-config ''"),
])
def test_an_evaluation_that_would_not_score_a_runs_held_out_problems_says_what_differs(changed, said):
    said_now = held_out_mismatch(RUN, {**RUN, **changed})
    assert said_now == said if said is None else said in said_now


def test_an_unknown_reasoning_gym_task_exits_2_naming_the_valid_ones(zoo, tmp_path, capsys):
    err = run_failing(["ppo", "--model", zoo["qwen2"], "--task", "reasoning-gym:no_such", "--out", tmp_path / "x",
                       *THREADS], capsys)
    assert "unknown reasoning-gym task 'no_such'; allowed:" in err and "chain_sum" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_the_exact_reward_pays_only_a_right_answer():
    # reasoning-gym's default checker gives len(answer) / len(given) to a given answer that contains the
    # right one: "722" earns 1/3 where the answer is 2, so a policy can be paid for writing longer numbers.
    rows = ReasoningGymTask("gcd", size=50, eval_size=10, seed=0).eval_rows()
    row = next(r for r in rows if r["answer"] == "2")
    index = [row["task_index"]]
    for exact, partial in ((False, pytest.approx(1 / 3)), (True, 0.0)):
        task = ReasoningGymTask("gcd", size=50, eval_size=10, seed=0, format_reward=0.1, exact=exact)
        assert task.rule_reward([], ["The GCD is 722"], index) == [partial]
        assert task.rule_reward([], ["<answer>2</answer>"], index) == [pytest.approx(1.1)]
        # The metric is the task's own either way: its accuracy counts full scores only.
        assert task.metric([], ["The GCD is 722"], [True], [row])["task_score"] == pytest.approx(1 / 3)


def test_the_task_reward_is_refused_without_a_reasoning_gym_task():
    from ppo_rlhf.tasks import TaskOptions

    with pytest.raises(ConfigError, match="task_reward"):
        TaskOptions(task="doubling", task_reward="exact").validate_task()
    with pytest.raises(ConfigError, match="task_reward"):
        build_config(PPOConfig, {"task": "reasoning-gym:gcd", "task_reward": "partial"})
