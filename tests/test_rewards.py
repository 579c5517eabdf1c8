"""Rewards (docs/design.md, "Rewards"): every prompt-row column reaches a reward function, several
rewards are summed with weights and logged by name, async rewards are awaited together, an HTTP
endpoint scores with retries, and the reusable checkers of ppo_rlhf.rewards."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from ppo_rlhf.config import ConfigError, build_config, read_setting
from ppo_rlhf.rewards import answer_match, extract_answer, math_equal
from ppo_rlhf.rollout.reward import CombinedReward, FunctionReward, RewardError, ScoringBatch, ScoringReward
from ppo_rlhf.rollout.reward_http import UrlReward
from ppo_rlhf.rollout.sequences import Sequences
from ppo_rlhf.stages.evaluate import EvalConfig
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import PROMPTS, run, run_failing, write_jsonl

ROWS = [{"prompt": "p0", "answer": "a0", "n": 0, "_source": "data.jsonl:1"},
        {"prompt": "p1", "answer": "a1", "n": 1, "_source": "data.jsonl:2"}]


def batch(rows=ROWS, responses=("r0", "r1"), finished=(True, False)) -> ScoringBatch:
    response_ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    sequences = Sequences(torch.tensor([[1], [2]]), torch.ones(2, 1, dtype=torch.long), response_ids,
                          (response_ids != 0).long())
    return ScoringBatch(rows, [r["prompt"] for r in rows], list(responses), list(finished), sequences)


# ---------------------------------------------------------------- the call convention
def test_a_function_gets_the_columns_it_names_one_value_per_response():
    def score(prompts, responses, answer, finished):
        assert (prompts, responses, answer, finished) == (["p0", "p1"], ["r0", "r1"], ["a0", "a1"], [True, False])
        return [1.0, 2.0]

    assert FunctionReward(score)(batch()).tolist() == [1.0, 2.0]


def test_kwargs_get_every_column_but_the_prompt_and_source():
    seen = {}

    def score(prompts, responses, **kwargs):
        seen.update(kwargs)
        return [0.0, 0.0]

    FunctionReward(score)(batch())
    assert set(seen) == {"answer", "n", "finished", "completion_ids"}
    assert seen["n"] == [0, 1] and seen["completion_ids"] == [[5, 6], [7]]


def test_a_trl_reward_function_runs_unchanged():
    """TRL's GRPOTrainer calls reward_func(prompts=..., completions=..., completion_ids=..., **columns)."""
    def trl_style(completions, answer, **kwargs):
        assert kwargs["prompts"] == ["p0", "p1"] and kwargs["completion_ids"] == [[5, 6], [7]]
        return [float(c == "r0") for c in completions]

    assert FunctionReward(trl_style)(batch()).tolist() == [1.0, 0.0]


def test_a_trl_reward_function_gets_messages_for_a_conversational_prompt():
    """TRL passes each completion as a list of messages when the prompt is one, and the text
    otherwise; a function written for chat data reads completion[0]["content"]."""
    messages = [[{"role": "user", "content": "p0"}], [{"role": "system", "content": "s"}, {"role": "user", "content": "p1"}]]
    rows = [dict(row, prompt=m) for row, m in zip(ROWS, messages)]

    def conversational(prompts, completions, **kwargs):
        assert prompts == messages
        assert completions == [[{"role": "assistant", "content": "r0"}], [{"role": "assistant", "content": "r1"}]]
        return [float(completion[0]["content"] == "r0") for completion in completions]

    scoring = ScoringBatch(rows, messages, ["r0", "r1"], [True, False], batch().sequences)
    assert FunctionReward(conversational)(scoring).tolist() == [1.0, 0.0]
    # A function of ppo-rlhf's own convention still gets the text; a plain prompt gives TRL's the text.
    assert FunctionReward(lambda prompts, responses: [float(r == "r1") for r in responses])(scoring).tolist() == [0.0, 1.0]
    assert FunctionReward(lambda completions, **kw: [len(c) for c in completions])(batch()).tolist() == [2.0, 2.0]


def test_a_function_cannot_change_the_trainers_rows():
    def vandal(prompts, responses, answer, **kwargs):
        answer[0] = "changed"
        prompts.clear()
        return [0.0, 0.0]

    rows = [dict(row) for row in ROWS]
    scoring = batch(rows)
    FunctionReward(vandal)(scoring)
    assert rows == ROWS and scoring.prompts == ["p0", "p1"]


def test_a_missing_column_is_named_with_the_function_and_the_data():
    def needs_label(prompts, responses, label):
        return [0.0] * len(responses)

    reward = FunctionReward(needs_label)
    with pytest.raises(ConfigError, match="needs_label.*'label'.*data.jsonl:1"):
        reward.check_columns(ROWS, "data.jsonl")
    reward.check_columns([dict(row, label=1) for row in ROWS], "data.jsonl")  # present: fine
    FunctionReward(lambda prompts, responses, label=None: [0.0] * 2).check_columns(ROWS, "data.jsonl")  # a default


def test_trl_run_keywords_are_not_columns_a_row_must_hold():
    # TRL's trainer_state, log_metric and log_extra come from the run (tests/test_trl_gaps.py), not the data.
    reward = FunctionReward(lambda completions, trainer_state, log_metric, log_extra, **kwargs: [])
    assert reward.required_columns == []


# ---------------------------------------------------------------- several rewards
def test_the_score_is_the_weighted_sum_and_each_reward_is_kept_by_name():
    def ones(prompts, responses):
        return [1.0, 1.0]

    def index(prompts, responses, n):
        return [float(i) for i in n]

    combined = CombinedReward([FunctionReward(ones), FunctionReward(index), FunctionReward(ones)], [1.0, 0.5, 2.0])
    assert combined.names == ["ones", "index", "ones_2"]
    assert combined(batch()).tolist() == [3.0, 3.5]
    assert {k: v.tolist() for k, v in combined.last_components.items()} == {
        "ones": [1.0, 1.0], "index": [0.0, 1.0], "ones_2": [1.0, 1.0]}
    assert combined.plan() == "1 x function ones + 0.5 x function index + 2 x function ones"
    with pytest.raises(ConfigError, match="2 reward weights for 3 rewards"):
        CombinedReward(combined.parts, [1.0, 2.0])


class HalfParsedJudge(ScoringReward):
    """Stands in for a judge: it could not score the first response (its stand-in 5.0)."""

    short_name, description = "judge", "judge J"

    def __call__(self, batch_) -> torch.Tensor:
        self.last_unscored = torch.tensor([True, False])
        return torch.tensor([5.0, 8.0])


def test_a_row_one_reward_could_not_score_is_unscored_beside_the_others():
    """A judge's unparsed answer is not TRL's None (not this reward's row): the judge was asked and
    gave no score, so the sum is unknown and the whole row is left out of the update."""
    from ppo_rlhf.rollout.reward import unscored_rows

    def ones(prompts, responses):
        return [1.0, 1.0]

    combined = CombinedReward([FunctionReward(ones), HalfParsedJudge()], [1.0, 0.5])
    assert combined(batch()).tolist() == [3.5, 5.0]
    assert combined.last_unscored.tolist() == [True, False]
    assert unscored_rows(combined, 2).tolist() == [True, False]
    weighted_out = CombinedReward([FunctionReward(ones), HalfParsedJudge()], [1.0, 0.0])
    weighted_out(batch())
    assert weighted_out.last_unscored is None  # a reward of weight 0 takes no part in the sum
    assert unscored_rows(weighted_out, 2).tolist() == [False, False]
    assert unscored_rows(None, 3).tolist() == [False] * 3  # no reward


def test_a_none_beside_another_reward_is_counted_and_said_once(capsys):
    def sometimes(prompts, responses):
        return [None, 2.0]

    def ones(prompts, responses):
        return [1.0, 1.0]

    combined = CombinedReward([FunctionReward(sometimes), FunctionReward(ones)])
    assert combined(batch()).tolist() == [1.0, 3.0]  # TRL's rule: the row is left to the other rewards
    combined(batch())
    assert combined.iteration_counts() == {"reward/sometimes_none": 2.0, "reward/ones_none": 0.0}
    out = capsys.readouterr().out
    assert out.count("warning: the reward function sometimes gave no score (None, or NaN) for 1 of 2") == 1
    assert "reward/sometimes_none counts them" in out
    combined.new_iteration()
    assert combined.iteration_counts()["reward/sometimes_none"] == 0.0


def test_one_reward_gives_its_scores_unchanged():
    single = CombinedReward([FunctionReward(lambda prompts, responses: [0.1, 0.7])])
    assert single(batch()).tolist() == torch.tensor([0.1, 0.7]).tolist()


def test_async_rewards_are_awaited_together():
    """Each waits until both have started: run one after the other, the first would time out."""
    started = []

    def waiting(name):
        async def reward(prompts, responses):
            started.append(name)
            for _ in range(500):  # up to 5 s for the other to start
                if len(started) == 2:
                    return [1.0, 1.0]
                await asyncio.sleep(0.01)
            raise TimeoutError("the other reward never started")
        reward.__name__ = name
        return reward

    combined = CombinedReward([FunctionReward(waiting("first")), FunctionReward(waiting("second")),
                               FunctionReward(lambda prompts, responses: [1.0, 1.0])])
    assert combined(batch()).tolist() == [3.0, 3.0]
    assert sorted(started) == ["first", "second"]


def test_an_async_reward_alone_is_awaited_and_checked():
    async def late(prompts, responses):
        await asyncio.sleep(0)
        return [float("nan"), 1.0]

    with pytest.raises(RewardError, match="late.*non-finite"):
        FunctionReward(late)(batch())


# ---------------------------------------------------------------- configuration
def test_reward_lists_from_yaml_and_flags():
    assert build_config(PPOConfig, {"model": "m", "reward_fn": "a:f"}).reward_fn == ["a:f"]  # one string, as before
    assert build_config(PPOConfig, {"model": "m", "reward_fn": ["a:f", "b:g,c:h"]}).reward_fn == ["a:f", "b:g", "c:h"]
    config = build_config(PPOConfig, {"model": "m", "reward_fn": ["a:f", ""], "reward_model": "rm"})  # "" unsets
    assert config.reward_fn == [] and config.reward_weights == []
    assert build_config(PPOConfig, {"model": "m", "reward_fn": "a:f", "reward_model": "rm",
                                    "reward_weights": "1,0.5"}).reward_weights == [1.0, 0.5]
    with pytest.raises(ConfigError, match="3 weights.*for 2 reward"):
        build_config(PPOConfig, {"model": "m", "reward_fn": "a:f", "reward_url": "http://x", "reward_weights": [1, 2, 3]})
    with pytest.raises(ConfigError, match="2 weights.*for 1 reward"):
        build_config(EvalConfig, {"model": "m", "reward_fn": "a:f", "reward_weights": "1,2"})
    # A run_config.json from when reward_fn was one string (or null) compares equal to the list now.
    assert read_setting(PPOConfig, "reward_fn", "mod:f") == ["mod:f"]
    assert read_setting(PPOConfig, "reward_fn", None) == []


def test_a_run_saved_with_one_reward_function_as_a_string_resumes(tmp_path):
    from ppo_rlhf.trainers.resume import RUN_CONFIG, check_resume_settings, last_checkpoint, run_settings

    config = build_config(PPOConfig, {"model": "m", "reward_fn": "mod:f", "out": str(tmp_path)})
    saved = {**run_settings(config), "reward_fn": "mod:f"}  # as run_config.json held it before lists
    saved.pop("reward_weights")
    last_checkpoint(tmp_path).mkdir(parents=True)
    (last_checkpoint(tmp_path) / RUN_CONFIG).write_text(json.dumps(saved))
    check_resume_settings(config, tmp_path)
    other = build_config(PPOConfig, {"model": "m", "reward_fn": "mod:g", "out": str(tmp_path)})
    with pytest.raises(ConfigError, match="reward_fn: \\['mod:f'\\] -> \\['mod:g'\\]"):
        check_resume_settings(other, tmp_path)


def test_an_object_with_an_async_call_is_awaited():
    class Judge:
        async def __call__(self, prompts, responses):
            return [0.5] * len(responses)

    assert FunctionReward(Judge(), name="judge")(batch()).tolist() == [0.5, 0.5]


# ---------------------------------------------------------------- the HTTP reward
class Judge(BaseHTTPRequestHandler):
    """Answers by path: /good scores len(response); /slow sleeps past the timeout; /flaky fails
    with 500 once, then answers; /short returns one score too few; /text is not JSON; /bad is a 400."""

    calls: dict = {}

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        calls = Judge.calls[self.path] = Judge.calls.get(self.path, 0) + 1
        scores = [len(r) + (a == "a0") for r, a in zip(body["responses"], body["columns"]["answer"])]
        if self.path == "/slow":
            time.sleep(0.5)
        if self.path == "/flaky" and calls == 1:
            return self.answer(500, b"overloaded")
        if self.path == "/bad":
            return self.answer(400, b"missing field 'prompts'")
        if self.path == "/text":
            return self.answer(200, b"<html>hello</html>")
        self.answer(200, json.dumps({"scores": scores[:-1] if self.path == "/short" else scores}).encode())

    def answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def judge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def url_reward(url: str, **options) -> UrlReward:
    return UrlReward(url, **{"timeout": 5.0, "retries": 1, "backoff": 0.01, **options})


def test_the_url_reward_posts_prompts_responses_and_columns(judge):
    assert url_reward(f"{judge}/good")(batch()).tolist() == [3.0, 2.0]  # len + (answer == "a0")


def test_the_url_reward_retries_a_server_error(judge):
    Judge.calls.pop("/flaky", None)
    assert url_reward(f"{judge}/flaky")(batch()).tolist() == [3.0, 2.0]
    assert Judge.calls["/flaky"] == 2


def test_the_url_reward_gives_up_on_a_slow_server_naming_it(judge):
    Judge.calls.pop("/slow", None)
    with pytest.raises(RewardError, match=f"{judge}/slow failed 2 times.*timed out"):
        url_reward(f"{judge}/slow", timeout=0.1)(batch())
    assert Judge.calls["/slow"] == 2


@pytest.mark.parametrize("path, message", [("/short", "returned 1 scores for 2 responses"),
                                           ("/text", "must answer JSON.*<html>"),
                                           ("/bad", "HTTP 400.*missing field")])
def test_a_bad_answer_is_named(judge, path, message):
    Judge.calls.pop(path, None)
    with pytest.raises(RewardError, match=f"reward URL {judge}{path} .*{message}"):
        url_reward(f"{judge}{path}")(batch())
    assert Judge.calls[path] == 1  # none of these is retried


def test_an_unreachable_url_is_named():
    url = f"http://127.0.0.1:{closed_port()}/score"
    with pytest.raises(RewardError, match=f"{url} failed 2 times.*Connection"):
        url_reward(url)(batch())


def test_a_column_that_is_not_json_is_named_at_start():
    with pytest.raises(ConfigError, match="column 'when'.*data.jsonl"):
        url_reward("http://127.0.0.1:1").check_columns([{"prompt": "p", "when": {1, 2}}], "data.jsonl")


def test_the_url_reward_runs_alongside_async_functions(judge):
    async def zero(prompts, responses):
        return [0.0, 0.0]

    combined = CombinedReward([FunctionReward(zero), url_reward(f"{judge}/good")], [1.0, 2.0])
    assert combined.names == ["zero", "url"] and combined(batch()).tolist() == [6.0, 4.0]


# ---------------------------------------------------------------- ppo_rlhf.rewards
def test_extract_answer():
    assert extract_answer("think <answer>1</answer> again <ANSWER> 42 </ANSWER>.") == "42"
    assert extract_answer("<answer>two\nlines</answer>") == "two\nlines"
    assert extract_answer("no tags, 42") is None


@pytest.mark.parametrize("response, answer, score", [
    ("so <answer> 1,234 </answer>", "1234", 1.0),  # thousands separators
    ("the total is 42.", 42, 1.0),  # the last number; an integer column
    ("x = 1/2", "0.5", 1.0),  # a fraction
    ("first 3, then -3.50", "-3.5", 1.0),
    ("it is 0.1 + 0.2 = 0.30000000000000004", "0.3", 1.0),  # within the tolerance
    ("<answer>$5</answer>", "5", 1.0),
    ("about 0.5001", "0.5", 0.0),
    ("<answer>New  york</answer>", "new york", 1.0),  # case and whitespace do not count
    ("<answer>Paris</answer>", "London", 0.0),
    ("Paris", "Paris", 0.0),  # untagged text is not an answer: only a number would be
    ("no number here", "3", 0.0),
    ("<answer>7</answer> or 8", None, 0.0),  # a row without its answer never matches
])
def test_answer_match(response, answer, score):
    assert answer_match(["q"], [response], [answer]) == [score]


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                    reason="math-verify is not installed (pip install -e '.[tasks]')")
def test_math_equal():
    responses = ["<answer>\\frac{1}{2}</answer>", "so the result is $\\boxed{3}$", "it is 4", "<answer>x</answer>"]
    assert math_equal(None, responses, ["0.5", "3", "5", "2"]) == [1.0, 1.0, 0.0, 0.0]
    assert FunctionReward("ppo_rlhf.rewards:math_equal").short_name == "math_equal"


# ---------------------------------------------------------------- whole runs
CHECKS = '''
import asyncio, json, os

def own_answers(prompts, responses, answer, n, finished):
    """Fails the run unless each response gets its own prompt row's columns, K adjacent copies."""
    assert len(prompts) == len(responses) == len(answer) == len(n) == len(finished)
    for prompt, expected, number in zip(prompts, answer, n):
        assert expected == "A:" + prompt, (prompt, expected)
        assert number == int(prompt.rsplit(" ", 1)[1]), (prompt, number)
    for first, second in zip(prompts[::2], prompts[1::2]):
        assert first == second, prompts  # --samples-per-prompt 2: each prompt twice, adjacent
    return [1.0] * len(responses)

def answer_given(prompts, responses, answer):
    return [float(expected == "A:" + prompt) for prompt, expected in zip(prompts, answer)]

async def waits(prompts, responses, **columns):
    await asyncio.sleep(0.01)
    return [len(r) / 10 for r in responses]
'''


def answer_rows(tmp_path):
    """Prompt rows with answers, written in a shuffled order."""
    rows = [{"prompt": f"{p} {i}", "answer": f"A:{p} {i}", "n": i} for i, p in enumerate(PROMPTS)]
    random.Random(0).shuffle(rows)
    (tmp_path / "checks.py").write_text(CHECKS)
    return write_jsonl(tmp_path / "rows.jsonl", rows)


def ppo_with_answers(zoo, tmp_path, *extra):
    return ["ppo", "--model", zoo["llama"], "--prompts", answer_rows(tmp_path), "--estimator", "grpo",
            "--samples-per-prompt", 2, "--batch-size", 8, "--mini-batch-size", 4, "--ppo-epochs", 1,
            "--max-new-tokens", 4, "--max-length", 32, "--iterations", 2, "--eval-every", 0, "--save-every", 0,
            "--sample-every", 0, "--num-threads", 1, "--out", tmp_path / "run", *extra]


def test_every_response_gets_its_own_rows_columns_and_each_reward_is_logged(zoo, tmp_path, capsys):
    run(ppo_with_answers(zoo, tmp_path, "--reward-fn", f"{tmp_path}/checks.py:own_answers",
                         "--reward-fn", f"{tmp_path}/checks.py:waits", "--reward-weights", "2,0.5"))
    assert "2 x function" in capsys.readouterr().out  # the plan names each reward with its weight
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        assert record["reward/own_answers"] == 1.0 and record["reward/own_answers_std"] == 0.0
        assert record["score"] == pytest.approx(2.0 + 0.5 * record["reward/waits"], rel=1e-5)
    # eval scores through the same rewards, columns included, each by name
    run(["eval", "--model", zoo["llama"], "--prompts", tmp_path / "rows.jsonl", "--reward-fn",
         f"{tmp_path}/checks.py:waits,{tmp_path}/checks.py:answer_given", "--max-new-tokens", 4, "--max-length", 32,
         "--num-threads", 1, "--out", tmp_path / "eval"])
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["reward/answer_given"] == 1.0 and summary["score"] == pytest.approx(1.0 + summary["reward/waits"])


def test_a_missing_column_stops_the_run_before_any_model_loads(zoo, tmp_path, capsys):
    reward = tmp_path / "needs.py"
    reward.write_text("def needs_label(prompts, responses, label):\n    return [0.0] * len(responses)\n")
    args = ppo_with_answers(zoo, tmp_path, "--reward-fn", f"{reward}:needs_label", "--model", tmp_path / "nowhere")
    err = run_failing(args, capsys)
    assert "needs_label" in err and "'label'" in err and "rows.jsonl:1" in err and "nowhere" not in err


def test_an_unreachable_reward_url_stops_the_run_naming_it(zoo, tmp_path, capsys):
    url = f"http://127.0.0.1:{closed_port()}/score"
    err = run_failing(ppo_with_answers(zoo, tmp_path, "--reward-url", url, "--reward-retries", 1,
                                       "--reward-backoff", 0.01), capsys)
    assert url in err and "failed 2 times" in err


def test_two_processes_give_each_response_its_own_columns(zoo, tmp_path):
    from test_multiprocess import launch

    args = ppo_with_answers(zoo, tmp_path, "--reward-fn", f"{tmp_path}/checks.py:own_answers")
    result = launch(args, processes=2)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/own_answers"] for r in records] == [1.0, 1.0]
