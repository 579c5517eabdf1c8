"""TRL 1.16 agent programs run unchanged (docs/agents.md): reward functions as TRL calls them, TRL's
environment factories in every form, the shape read off reset's signature, seeded resets, None
scores -- and agent programs from TRL's own documentation and examples (tests/trl_examples/), each
run on a tiny model, their reward functions seeing what TRL would pass them."""

from __future__ import annotations

import functools
import json
import random

import numpy
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppo_rlhf.data import DataError
from ppo_rlhf.envs import environment_source
from ppo_rlhf.envs.options import tool_template_path
from ppo_rlhf.envs.parsers import ToolCall
from ppo_rlhf.rollout.episodes import EpisodeLimits, roll_out, score_episodes
from ppo_rlhf.rollout.reward import CombinedReward, FunctionReward, RewardError, ScoringBatch
from ppo_rlhf.rollout.sequences import Sequences
from toy_envs import Counter, DrawsItsTarget, LetterGame, TakesASeed, ToolsNamedLikeGym
from zoo import CallsFirst, Scripted, family_model


@pytest.fixture(scope="module")
def qwen(zoo):
    tokenizer = AutoTokenizer.from_pretrained(zoo["qwen2"])
    tokenizer.chat_template = tool_template_path().read_text()
    return AutoModelForCausalLM.from_pretrained(zoo["qwen2"]), tokenizer


def always_call(name: str, arguments: dict):
    return lambda text: [ToolCall(name, arguments, text=text)]


def counted_episodes(qwen, source, rows: list[dict], turns: int = 2, seeds=None):
    model, tokenizer = qwen
    stop = tokenizer.eos_token_id
    generator = Scripted([[[5, stop]] * len(rows)] * turns, [stop], tokenizer.pad_token_id)
    return roll_out(model, tokenizer, generator, rows, [row["prompt"] for row in rows],
                    EpisodeLimits(1024, 1400, max_turns=turns, chat_template=True), source, seeds)


# ---------------------------------------------------------------- reward functions, as TRL calls them
def environments_only(environments, **kwargs):
    return [float(env.count) for env in environments]


def completions_and_environments(completions, environments, **kwargs):
    return [float(env.count) for env in environments]


def environments_with_a_default(environments=None, **kwargs):
    return [float(env.count) for env in environments]


def named_keywords_only(prompts, completions, environments=None):
    return [float(env.count) for env in environments]


def ppo_rlhf_style(prompts, responses, environments):
    return [float(env.count) for env in environments]


@pytest.mark.parametrize("function", [environments_only, completions_and_environments, environments_with_a_default,
                                      named_keywords_only, ppo_rlhf_style],
                         ids=lambda f: f.__name__)
def test_reward_functions_naming_environments_get_the_users_own_objects(qwen, function):
    source = environment_source("toy_envs:Counter", tool_parser=always_call("increment", {"by": 1}))
    rows = [{"prompt": "go", "target": 1}, {"prompt": "go", "target": 3}]
    episodes = counted_episodes(qwen, source, rows)
    seen = []

    @functools.wraps(function)
    def recording(*args, **kwargs):
        seen.append(kwargs.get("environments", args[2] if len(args) > 2 else None))
        return function(*args, **kwargs)

    total, parts = score_episodes(CombinedReward([FunctionReward(recording)]), rows, episodes)
    assert all(type(env) is Counter for env in seen[0])  # the user's objects, not ppo-rlhf's wrapper
    # One increment (the last turn's call is not run); the reward function's 1 beside get_reward's.
    assert parts["environment"].tolist() == [1.0, 0.0] and total.tolist() == [2.0, 1.0]


def test_trl_style_completions_carry_the_calls_the_turns_made(qwen):
    source = environment_source("toy_envs:Counter", tool_parser=always_call("increment", {"by": 2}))
    rows = [{"prompt": [{"role": "user", "content": "go"}], "target": 2}]
    episodes = counted_episodes(qwen, source, rows)
    seen = {}

    def reward(prompts, completions, completion_ids, target, **kwargs):
        seen.update(completions=completions, target=target, keys=set(kwargs))
        return [0.0]

    score_episodes(FunctionReward(reward), rows, episodes)
    call = {"type": "function", "function": {"name": "increment", "arguments": {"by": 2}}}
    assert [m["role"] for m in seen["completions"][0]] == ["assistant", "tool", "assistant"]
    assert seen["completions"][0][0]["tool_calls"] == [call] and seen["completions"][0][1]["content"] == "2"
    assert seen["completions"][0][2]["tool_calls"] == [call]  # read, though the last turn's call is not run
    assert seen["target"] == [2] and {"environments", "responses"} <= seen["keys"]


def test_none_scores_leave_a_row_to_the_other_rewards_and_a_row_none_scores_is_refused():
    # TRL's docs, "Multi-task reward functions": each reward scores its own task's rows.
    def math_reward_func(prompts, completions, task, **kwargs):
        return [1.0 if t == "math" else None for t in task]

    def coding_reward_func(prompts, completions, task, **kwargs):
        return [-1.0 if t == "coding" else None for t in task]

    rows = [{"prompt": "2+2?", "task": "math"}, {"prompt": "sum()", "task": "coding"}]
    ids = torch.ones(2, 3, dtype=torch.long)
    batch = ScoringBatch(rows, ["2+2?", "sum()"], ["4", "def"], [True, True], Sequences(ids, ids, ids, ids))
    reward = CombinedReward([FunctionReward(math_reward_func), FunctionReward(coding_reward_func)], [1.0, 2.0])
    assert reward(batch).tolist() == [1.0, -2.0]
    assert torch.isnan(reward.last_components["math_reward_func"][1])
    rows[1]["task"] = "poetry"  # a row neither scores
    batch = ScoringBatch(rows, ["2+2?", "a poem"], ["4", "roses"], [True, True], Sequences(ids, ids, ids, ids))
    with pytest.raises(RewardError, match="no reward scored row 1.*math_reward_func, coding_reward_func each returned "
                                          "None for it"):
        from ppo_rlhf.rollout.reward import refuse_unscored

        refuse_unscored(reward(batch), rows, reward.names)


# ---------------------------------------------------------------- factories and shapes
@pytest.mark.parametrize("factory", [lambda: Counter(), functools.partial(Counter), Counter],
                         ids=["lambda", "partial", "class"])
def test_any_callable_is_a_factory(qwen, factory):
    source = environment_source(factory, tool_parser=always_call("increment", {"by": 1}))
    assert [t["function"]["name"] for t in source.tools] == ["increment"]
    episodes = counted_episodes(qwen, source, [{"prompt": "go", "target": 1}])
    assert episodes.episode_rewards == [1.0]


def test_a_dict_of_environments_is_chosen_per_row_and_lists_only_its_own_tools(qwen):
    source = environment_source({"count": Counter, "walk": ToolsNamedLikeGym},
                                tool_parser=always_call("step", {"direction": "up"}))
    rows = [{"prompt": "go", "environment": "walk"}, {"prompt": "go", "environment": "count", "target": 1}]
    episodes = counted_episodes(qwen, source, rows)
    assert [type(env.instance).__name__ for env in episodes.environments] == ["ToolsNamedLikeGym", "Counter"]
    assert episodes.environments[0].instance.columns == {"prompt": "go"}  # the routing column is not reset's
    model, tokenizer = qwen
    prompts = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(episodes.sequences.prompt_ids,
                                                                        episodes.sequences.prompt_mask)]
    assert '"step"' in prompts[0] and '"increment"' not in prompts[0]
    assert '"increment"' in prompts[1] and '"step"' not in prompts[1]
    # The walker's step tool ran; the counter has no tool named step, and the model was told so.
    assert episodes.conversations[0][1]["content"] == "stepped up"
    assert "there is no tool named 'step'" in episodes.conversations[1][1]["content"]
    with pytest.raises(DataError, match="rows.jsonl:3: with several environments each row names its own in an "
                                        "'environment' column.*holds 'fly'.*'count', 'walk'"):
        source.check_rows([{"prompt": "x", "environment": "fly", "_source": "rows.jsonl:3"}])


def test_a_dict_of_environments_is_named_on_the_command_line_as_module_and_name():
    source = environment_source("toy_envs:ENVIRONMENTS")
    assert list(source.kinds) == ["count", "walk"] and source.routed
    assert source.description.startswith("per row by its 'environment' column: environment 'count' (Counter) (TRL's "
                                         "environment_factory shape: its methods are tools); environment 'walk'")


def test_the_shape_is_read_off_reset_not_guessed_from_method_names():
    trl_shaped = environment_source(ToolsNamedLikeGym).kinds[None]
    assert trl_shaped.answers == "tools"
    names = [t["function"]["name"] for t in environment_source(ToolsNamedLikeGym).tools]
    assert sorted(names) == ["close", "render", "step"]  # every public method but reset and get_reward (TRL's rule)
    assert environment_source(LetterGame).kinds[None].answers == "observations"  # reset(*, seed=, options=)


def test_a_trl_classs_reset_is_seeded_so_a_rows_episodes_start_alike(qwen):
    source = environment_source(DrawsItsTarget, tool_parser=lambda text: [])
    before = random.getstate(), numpy.random.get_state()[1].copy()
    episodes = counted_episodes(qwen, source, [{"prompt": "go"}] * 3, turns=1, seeds=[7, 7, 8])
    targets = [p[-1]["content"] for p in episodes.prompts]
    assert targets[0] == targets[1] != targets[2]  # the same seed, the same task
    assert random.getstate() == before[0] and (numpy.random.get_state()[1] == before[1]).all()  # put back
    again = counted_episodes(qwen, source, [{"prompt": "go"}], turns=1, seeds=[7])  # a resumed run replays it
    assert again.prompts[0][-1]["content"] == targets[0]
    seeded = environment_source(TakesASeed, tool_parser=lambda text: [])
    episodes = counted_episodes(qwen, seeded, [{"prompt": "go"}], turns=1, seeds=[11])
    assert episodes.environments[0].instance.seed == 11  # a reset that takes seed= gets it


# ---------------------------------------------------------------- TRL's own agent programs
@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    """A tiny model with Qwen3's template (the docs' Qwen/Qwen3-0.6B, tests/zoo.py)."""
    folder = family_model("qwen3", tmp_path_factory.mktemp("qwen3") / "model")
    return str(folder), AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def recorded(module, name: str, calls: list):
    """``module.name`` (a reward function) that keeps each call's keywords in ``calls``."""
    function = getattr(module, name)

    @functools.wraps(function)
    def recording(*args, **kwargs):
        calls.append(kwargs)
        return function(*args, **kwargs)

    setattr(module, name, recording)


def episodes_of(run) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts" / "iteration_0001.jsonl").read_text().splitlines()]


def scripted(monkeypatch, call: str) -> None:
    """The run's rollout engine writes ``call`` first in every episode (a tiny random model calls no
    tool of its own): TRL's trainer call takes no engine, so the engine the run builds is replaced."""
    from ppo_rlhf.trainers import ppo_setup

    monkeypatch.setattr(ppo_setup, "make_generator", lambda config, tokenizer, actor, accelerator:
                        CallsFirst(tokenizer, call))


def test_trls_environment_reading_its_task_from_the_data_set(qwen3_model, tmp_path, monkeypatch):
    from trl_examples import increment_dataset

    calls = []
    monkeypatch.setattr(increment_dataset, "format_reward", increment_dataset.format_reward)
    recorded(increment_dataset, "format_reward", calls)
    scripted(monkeypatch, '<tool_call>\n{"name": "increment", "arguments": {"step": "2"}}\n</tool_call>')
    increment_dataset.train(qwen3_model[0], str(tmp_path / "run"))
    seen = calls[0]
    completion = seen["completions"][0]
    assert completion[0]["role"] == "assistant" and completion[0]["content"] == ""
    assert completion[0]["tool_calls"] == [  # "2" written as text, cast to the int the tool's schema says
        {"type": "function", "function": {"name": "increment", "arguments": {"step": 2}}}]
    assert completion[1] == {"role": "tool", "name": "increment", "content": "2"}
    assert all(type(env).__name__ == "IncrementEnv" for env in seen["environments"])
    assert seen["target"] == [env.target for env in seen["environments"]]  # each row's own column reached reset()
    assert seen["trainer_state"].max_steps == 1 and callable(seen["log_metric"])  # the run's TrainerState
    for episode in episodes_of(tmp_path / "run"):
        assert episode["episode_reward"] == float(episode["prompt"][-1]["content"].endswith("to 2."))


def test_trls_several_environments_chosen_per_row(qwen3_model, tmp_path, monkeypatch):
    from trl_examples import multi_env

    calls = []
    monkeypatch.setattr(multi_env, "reward_func", multi_env.reward_func)
    recorded(multi_env, "reward_func", calls)
    scripted(monkeypatch, '<tool_call>\n{"name": "move", "arguments": {"action": "up"}}\n</tool_call>')
    multi_env.train(qwen3_model[0], str(tmp_path / "run"))
    kinds = [type(env).__name__ for env in calls[0]["environments"]]
    assert set(kinds) <= {"CodingEnv", "GameEnv"} and "environment" in calls[0]
    for episode, kind in zip(episodes_of(tmp_path / "run"), kinds):
        answer = episode["messages"][1]["content"]
        # The game's move tool answers (its body is the docs' "...": None); the coding rows have no move tool.
        assert answer == "None" if kind == "GameEnv" else "there is no tool named 'move'" in answer
        task = episode["prompt"][-1]["content"]  # reset() said it
        assert task == "Reach the goal tile." if kind == "GameEnv" else task.startswith("Compute the")


def test_trls_tools_with_an_async_one(qwen3_model, tmp_path, monkeypatch):
    from datasets import Dataset

    from trl_examples import tools

    calls = []
    for name in ("reward_func", "format_reward_func"):
        monkeypatch.setattr(tools, name, getattr(tools, name))
        recorded(tools, name, calls)
    scripted(monkeypatch, '<tool_call>\n{"name": "async_add", "arguments": {"a": 3, "b": 4}}\n</tool_call>')
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 3 + 4?"}]] * 2})
    tools.train(qwen3_model[0], rows, str(tmp_path / "run"))
    by_ids, by_format = calls[0], calls[1]
    assert by_format["completions"][0][1] == {"role": "tool", "name": "async_add", "content": "7"}
    # completion_ids: the whole completion, the model's tokens and the tool's (TRL's)
    assert len(by_ids["completion_ids"][0]) > len(qwen3_model[2](by_format["completions"][0][0]["tool_calls"][0]
                                                                  ["function"]["name"])["input_ids"])
    assert "environments" in by_ids and by_ids["environments"] == [None] * 4  # tools alone: no object of the user's
