"""pass@k, mean@k and maj@k in evaluation (core/pass_at_k.py, evaluation.py): the estimator worked
by hand, and `eval --samples K` / `ppo --eval-samples K` writing them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ppo_rlhf.core import pass_at_k
from ppo_rlhf.evaluation import majority_correct, sampled_metrics


def outcomes(*rows: str) -> torch.Tensor:
    """'1010' -> one problem's samples, right (1) or wrong (0)."""
    return torch.tensor([[int(ch) for ch in row] for row in rows])


def test_pass_at_k_by_hand():
    # n = 2, c = 1, k = 1: 1 - C(1, 1) / C(2, 1) = 1 - 1/2 = 0.5
    # n = 4, c = 1, k = 2: 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5
    # n = 5, c = 2, k = 2: 1 - C(3, 2) / C(5, 2) = 1 - 3/10 = 0.7
    #   (the product form: (1 - 2/4)(1 - 2/5) = 0.5 x 0.6 = 0.3 of draws all wrong)
    # n = 3, c = 1, k = 3: only 2 wrong, so any 3 hold the right one: 1
    # n = 3, c = 0, k = 2: no right sample: 0
    assert pass_at_k(outcomes("10"), 1).tolist() == [0.5]
    assert pass_at_k(outcomes("0100"), 2).tolist() == [pytest.approx(0.5)]
    assert pass_at_k(outcomes("01010"), 2).tolist() == [pytest.approx(0.7)]
    assert pass_at_k(outcomes("010"), 3).tolist() == [1.0]
    assert pass_at_k(outcomes("000"), 2).tolist() == [0.0]
    # Several problems at once, each its own count: pass@1 is each problem's share of right samples.
    assert pass_at_k(outcomes("1100", "0001", "1111"), 1).tolist() == [0.5, 0.25, 1.0]


def test_pass_at_k_stays_exact_where_the_binomials_overflow():
    # n = 2000, c = 1, k = 1000: 1 - C(1999, 1000) / C(2000, 1000) = 1 - (2000 - 1000) / 2000 = 0.5,
    # though C(2000, 1000) ~ 2e600 is far past a float.
    correct = torch.zeros(1, 2000)
    correct[0, 7] = 1
    assert pass_at_k(correct, 1000).item() == pytest.approx(0.5, abs=1e-12)
    with pytest.raises(OverflowError):
        float(math.comb(2000, 1000))


def test_pass_at_k_needs_k_within_the_samples():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(outcomes("10"), 3)


def test_majority_vote_by_hand():
    # Problem 1: answers 4, 4, 5 -> 4 wins (2 of 3), and 4 was right.
    # Problem 2: answers 7, 9, 9 -> 9 wins, and 9 was wrong (7 was right): a miss though one was right.
    # Problem 3: a tie 1 / 2 goes to the answer given first (1), which was wrong.
    # Problem 4: no answer parsed at all: a miss.
    answers = [["4", "4", "5"], ["7", "9", "9"], ["1", "2", None], [None, None, None]]
    right = [[1, 1, 0], [1, 0, 0], [0, 1, 0], [0, 0, 0]]
    assert [majority_correct(a, r) for a, r in zip(answers, right)] == [True, False, False, False]


def test_sampled_metrics_by_hand():
    # Two problems, 4 samples each.  The first: answers 3, 3, 8, 3, of which the three 3s are right;
    # the second: none right.
    # pass@1 = (3/4 + 0) / 2 = 0.375
    # pass@2 = (1 - C(1, 2) / C(4, 2) + 0) / 2 = (1 - 0) / 2 = 0.5   (one wrong: every pair holds a 3)
    # pass@3 = pass@4 = 0.5;  mean@4 = 3 right of 8 = 0.375;  maj@4: 3 wins the first (right), 1 the second: 0.5
    right = [[1, 1, 0, 1], [0, 0, 0, 0]]
    answers = [["3", "3", "8", "3"], ["1", "2", "1", None]]
    assert sampled_metrics(right, answers) == pytest.approx(
        {"pass@1": 0.375, "pass@2": 0.5, "pass@3": 0.5, "pass@4": 0.5, "mean@4": 0.375, "maj@4": 0.5})
    assert "maj@4" not in sampled_metrics(right, None)  # no parsed answers: no vote


# ---------------------------------------------------------------- eval --samples K, ppo --eval-samples K
def test_eval_samples_writes_pass_at_k_to_the_summary(tiny_sft_model, tmp_path):
    from zoo import run

    run(["eval", "--model", tiny_sft_model, "--task", "doubling", "--size", 20, "--do-sample", "--samples", 4,
         "--num-threads", 1, "--out", tmp_path / "eval"])
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    passes = [summary[f"pass@{k}"] for k in range(1, 5)]
    assert summary["samples_per_prompt"] == 4 and "maj@4" in summary
    assert passes == sorted(passes)  # more tries never pass fewer problems
    # pass@1 and mean@4 are both the share of right samples; exact_match is over all 80 samples too.
    assert summary["pass@1"] == pytest.approx(summary["mean@4"]) == pytest.approx(summary["exact_match"])


def test_ppo_eval_samples_logs_pass_at_k_of_the_sampled_evaluation(tiny_sft_model, tmp_path):
    from zoo import run

    run(["ppo", "--model", tiny_sft_model, "--task", "doubling", "--estimator", "grpo", "--samples-per-prompt", 2,
         "--batch-size", 8, "--mini-batch-size", 8, "--ppo-epochs", 1, "--iterations", 1, "--eval-size", 10,
         "--max-new-tokens", 7, "--max-length", 24, "--eval-samples", 3, "--save-every", 0, "--num-threads", 1, "--out", tmp_path / "run"])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {"eval_sampled/pass@1", "eval_sampled/pass@3", "eval_sampled/mean@3", "eval_sampled/maj@3"} <= set(
        summary["after_sampled"])
    assert "eval/pass@1" not in summary["after"]  # the greedy evaluation is one response a prompt


def test_bad_sample_counts_are_refused_by_name(tiny_sft_model, tmp_path, capsys):
    from zoo import run_failing

    err = run_failing(["eval", "--model", tiny_sft_model, "--task", "doubling", "--samples", 0], capsys)
    assert "invalid value for 'samples': 0; allowed: > 0" in err
    err = run_failing(["eval", "--model", tiny_sft_model, "--task", "doubling", "--samples", 3], capsys)
    assert "'samples': 3; allowed: 1 without --do-sample" in err and "add --do-sample" in err
    err = run_failing(["ppo", "--model", tiny_sft_model, "--task", "doubling", "--eval-samples", 0,
                       "--out", tmp_path / "r"], capsys)
    assert "invalid value for 'eval_samples': 0; allowed: > 0" in err
    err = run_failing(["ppo", "--model", tiny_sft_model, "--task", "doubling", "--eval-samples", 4,
                       "--no-eval-sampled", "--out", tmp_path / "r"], capsys)
    assert "'eval_samples': 4; allowed: 1 with --no-eval-sampled" in err


def test_pass_at_k_of_a_reward_that_is_not_right_or_wrong_is_refused_naming_it(zoo, tmp_path, capsys):
    from zoo import REWARDS_MODULE, run_failing

    err = run_failing(["eval", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn",
                       f"{REWARDS_MODULE}:length_score", "--do-sample", "--samples", 2, "--max-new-tokens", 4,
                       "--max-length", 32, "--num-threads", 1], capsys)
    assert "pass@k needs a right-or-wrong outcome per response" in err and "length_score" in err


def test_mlflow_gets_pass_at_k_under_a_name_it_takes(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    import mlflow
    from mlflow.tracking import MlflowClient

    import ppo_rlhf.trackers as trackers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    [tracker] = trackers.open_trackers(["mlflow"], tmp_path / "run", {}, resumed=False)
    tracker.log(1, {"eval_sampled/pass@2": 0.5})
    tracker.finish()
    mlflow.end_run()
    assert MlflowClient().get_run(tracker.run_id).data.metrics == {"eval_sampled/pass_at_2": 0.5}


def test_a_reasoning_gym_tasks_outcomes_are_its_accuracy_and_parsed_answers():
    pytest.importorskip("reasoning_gym")
    from ppo_rlhf.tasks.reasoning_gym import make_task

    task = make_task("chain_sum", 20, 5, 0, {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    row = task.eval_rows()[0]
    responses = [f"<answer>{row['answer']}</answer>", f"so {row['answer']}.0", "<answer>no idea</answer>"]
    right, answers = task.outcomes([row["prompt"]] * 3, responses, [True] * 3, [row] * 3)
    assert right == [True, True, False]
    assert answers == [float(row["answer"]), float(row["answer"]), "no idea"]  # one vote for the two right ones


# ---------------------------------------------------------------- pass@k's preconditions at start (issue 57)
def ppo_on_prompts(zoo, tmp_path, *extra):
    """A tiny ppo run of the zoo's llama on its prompts, held out as well: two iterations, evaluated at the end."""
    return ["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--eval-prompts", zoo["prompts"],
            "--batch-size", 4, "--mini-batch-size", 4, "--ppo-epochs", 1, "--max-new-tokens", 4, "--max-length", 32,
            "--iterations", 2, "--eval-every", 0, "--save-every", 0, "--num-threads", 1, "--out", tmp_path / "run",
            *extra]


def test_eval_samples_with_a_reward_that_is_not_right_or_wrong_is_refused_before_the_first_iteration(
        zoo, tmp_path, capsys):
    """It was refused at the sampled evaluation, after the last iteration and before any checkpoint."""
    from zoo import REWARDS_MODULE, run_failing

    err = run_failing(ppo_on_prompts(zoo, tmp_path, "--reward-fn", f"{REWARDS_MODULE}:length_score",
                                     "--eval-samples", 2), capsys)
    assert "pass@k needs a right-or-wrong outcome per response" in err and "length_score" in err
    assert "--eval-samples 1" in err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0]  # the evaluation before the first iteration, and no iteration


@pytest.mark.parametrize("flags, says", [
    (("--reward-model", "{rm}"), "reward model"),
    (("--reward-judge", "{llama}"), "rating from 0 to 10"),
    (("--reward-judge", "{llama}", "--judge-score", "token:a"), "a probability"),
], ids=["reward-model", "judge-rating", "judge-token"])
def test_eval_samples_with_a_reward_that_is_never_right_or_wrong_is_refused_as_the_config_is_built(
        zoo, tmp_path, capsys, flags, says):
    from transformers import AutoModelForSequenceClassification

    from ppo_rlhf.models import load_tokenizer
    from zoo import run_failing

    reward_model = tmp_path / "rm"  # a sequence classifier on the zoo's llama: a real reward model, untrained
    AutoModelForSequenceClassification.from_pretrained(zoo["llama"], num_labels=1).save_pretrained(reward_model)
    load_tokenizer(zoo["llama"]).save_pretrained(reward_model)
    flags = [str(flag).format(rm=reward_model, llama=zoo["llama"]) for flag in flags]
    err = run_failing([*ppo_on_prompts(zoo, tmp_path, "--reward-fn", "", *flags, "--eval-samples", 2)], capsys)
    assert "invalid value for 'eval_samples': 2" in err and says in err and "--eval-samples 1" in err
    err = run_failing(["eval", "--model", zoo["llama"], "--prompts", zoo["prompts"], *flags, "--do-sample",
                       "--samples", 2], capsys)
    assert "invalid value for 'samples': 2" in err and says in err and "--samples 1" in err
    assert not (tmp_path / "run").exists()


def test_eval_samples_without_held_out_prompts_is_refused(zoo, tmp_path, capsys):
    """Without --eval-prompts (or a task's) nothing is evaluated: the option did nothing, silently."""
    from zoo import REWARDS_MODULE, run_failing

    args = ppo_on_prompts(zoo, tmp_path, "--reward-fn", f"{REWARDS_MODULE}:long_answer", "--eval-samples", 2)
    at = args.index("--eval-prompts")
    err = run_failing(args[:at] + args[at + 2:], capsys)
    assert "invalid value for 'eval_samples': 2" in err and "without held-out prompts" in err
    assert "--eval-prompts FILE" in err


def test_eval_samples_with_nothing_to_score_is_refused_before_any_sample(zoo, tmp_path, capsys):
    from zoo import run_failing

    err = run_failing(["eval", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--do-sample", "--samples", 2],
                      capsys)
    assert "invalid value for 'samples': 2" in err and "no --task with a checker and no reward" in err
    err = run_failing(ppo_on_prompts(zoo, tmp_path, "--reward-fn", "", "--teacher", zoo["granite"],
                                     "--eval-samples", 2), capsys)  # a teacher's reward is per token
    assert "pass@k needs a right-or-wrong outcome per response" in err and "has neither" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_eval_samples_on_an_environment_that_is_not_right_or_wrong_names_its_rewards(zoo, tmp_path, capsys):
    """It ended in AttributeError: the environment's rewards have no reward object to name."""
    from zoo import run_failing

    err = run_failing(["eval", "--model", zoo["qwen2"], "--prompts", zoo["prompts"], "--environment",
                       "toy_envs:PaysEachTurn", "--size", 2, "--max-new-tokens", 4, "--max-length", 128, "--do-sample",
                       "--samples", 2, "--num-threads", 1], capsys)
    assert "pass@k needs a right-or-wrong outcome per response, but the environment's rewards scored" in err
    assert "--samples 1" in err


HALF_WHEN_MANY = '''
def half_when_many(prompts, responses):
    """1 on small batches (training, the greedy evaluation), 0.5 on the sampled evaluation's 12 responses."""
    return [0.5 if len(responses) > 8 else 1.0 for _ in responses]
'''


def test_a_sampled_evaluation_that_refuses_pass_at_k_keeps_the_runs_last_iteration(zoo, tmp_path, capsys,
                                                                                    monkeypatch):
    """With --eval-every 0 and --save-every 0, the refusal at the final evaluation lost every
    iteration: it now saves the iteration's checkpoint first, and a resume finishes the run."""
    from zoo import run, run_failing

    (tmp_path / "half_rewards.py").write_text(HALF_WHEN_MANY)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ppo_on_prompts(zoo, tmp_path, "--reward-fn", "half_rewards:half_when_many", "--eval-samples", 2)
    err = run_failing(args, capsys)
    assert "pass@k needs a right-or-wrong outcome per response" in err
    assert "continue from its checkpoint after iteration 2" in err
    assert (tmp_path / "run" / "checkpoints" / "last").is_dir()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2]  # the last iteration logged, its evaluation refused
    at = args.index("--eval-samples")
    run(args[:at] + args[at + 2:] + ["--resume"])  # the same run, evaluated with one sample: finished
    assert (tmp_path / "run" / "checkpoints" / "actor" / "config.json").is_file()


def test_near_greedy_samples_are_warned_about_at_start_and_a_temperature_below_001_is_refused(
        zoo, tmp_path, capsys):
    from zoo import REWARDS_MODULE, run, run_failing

    run(["eval", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn", f"{REWARDS_MODULE}:long_answer",
         "--size", 2, "--max-new-tokens", 4, "--max-length", 32, "--do-sample", "--temperature", 0.05,
         "--samples", 2, "--num-threads", 1])
    out = capsys.readouterr().out
    assert "warning: --temperature 0.05 samples as greedy decoding does" in out and "pass@k says little" in out
    err = run_failing(["eval", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--do-sample", "--temperature",
                       1e-6, "--samples", 2], capsys)
    assert "invalid value for 'temperature': 1e-06; allowed: >= 0.01" in err
    (tmp_path / "c.yaml").write_text("temperature: 1.0e-30\n")  # once "training diverged ... lower the learning rate"
    err = run_failing(["ppo", "--config", tmp_path / "c.yaml", "--model", zoo["llama"], "--prompts", zoo["prompts"],
                       "--reward-fn", f"{REWARDS_MODULE}:length_score", "--out", tmp_path / "run"], capsys)
    assert "invalid value for 'temperature': 1e-30; allowed: >= 0.01" in err
    assert not (tmp_path / "run").exists()
