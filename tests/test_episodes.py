"""Multi-turn episodes (docs/agents.md): token in, token out; the loss mask; limits; tools and
their errors; TRL's environment classes; gymnasium environments in text; the trainer on episodes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.core.normalize import RunningMoments
from ppo_rlhf.envs import EnvironmentFailed, environment_source
from ppo_rlhf.envs.options import check_template_renders_tools, tool_template_path
from ppo_rlhf.envs.parsers import ToolCall, parse_hermes
from ppo_rlhf.envs.tools import ToolBox, ToolEnvironment
from ppo_rlhf.envs.chat import ChatContinuation
from ppo_rlhf.rollout.episodes import EpisodeLimits, episode_seeds, roll_out
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.passes import response_stats
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from toy_envs import Counter, LetterGame, add, divide, sleepy
from zoo import PROMPTS, REWARDS_MODULE, THREADS, Scripted, run, run_failing, same_actor_as_straight_run, write_jsonl

TEMPLATE = str(tool_template_path())
# The zoo's models have 128 positions: prompt and episode fit in them.
BUDGET = ["--batch-size", 4, "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 6, "--max-length", 128,
          "--eval-every", 0, "--save-every", 0, "--sample-every", 0, *THREADS]


@pytest.fixture(scope="module")
def qwen(zoo):
    """The zoo's ChatML model (<|im_start|> / <|im_end|>), its tokenizer and the shipped tool template."""
    tokenizer = AutoTokenizer.from_pretrained(zoo["qwen2"])
    tokenizer.chat_template = tool_template_path().read_text()
    return AutoModelForCausalLM.from_pretrained(zoo["qwen2"]), tokenizer


def always_call(name: str, arguments: dict):
    """A parser that reads one call of ``name`` in every turn (tiny models write none of their own)."""
    return lambda text: [ToolCall(name, arguments, text=text)]


# ---------------------------------------------------------------- token in, token out
def test_the_tokens_trained_on_are_the_tokens_sampled_even_where_text_would_re_encode_otherwise(qwen):
    model, tokenizer = qwen
    # The model writes "good" one character at a time: decoded and encoded again, the text
    # becomes other ids (the BPE merges it), so a rollout that re-tokenized would train on tokens
    # the model never sampled.
    letters = [tokenizer.convert_tokens_to_ids(c) for c in "good"]
    assert tokenizer("good", add_special_tokens=False)["input_ids"] != letters
    stop = tokenizer.eos_token_id
    turns = [[letters + [stop]], [letters[::-1] + [stop]]]
    generator = Scripted(turns, [stop], tokenizer.pad_token_id)
    source = environment_source(tools=[add], tool_parser=lambda text: [ToolCall("add", {"a": 1, "b": 2})]
                                if len(text) and text == "good" else [])
    episodes = roll_out(model, tokenizer, generator, [{"prompt": "hello"}], ["hello"],
                        EpisodeLimits(1024, 1400, max_turns=4, chat_template=True), source)
    sequences = episodes.sequences
    ids, loss_mask = sequences.response_ids[0].tolist(), sequences.loss_mask[0].tolist()
    model_ids = [token for token, own in zip(ids, loss_mask) if own]
    assert model_ids == letters + [stop] + letters[::-1] + [stop]  # exactly what was sampled, both turns
    assert episodes.turns == [2] and episodes.conversations[0][1] == {"role": "tool", "name": "add", "content": "3"}
    # The second turn continued from the first turn's own ids, then the template's answer.
    second_context = generator.contexts[1][0]
    prompt = sequences.prompt_ids[0][sequences.prompt_mask[0].bool()].tolist()
    assert second_context[:len(prompt) + 5] == prompt + letters + [stop]
    answer = tokenizer.decode([token for token, own in zip(ids, loss_mask) if not own and token != tokenizer.pad_token_id])
    assert answer == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_turn_cut_by_its_token_limit_is_closed_as_the_template_closes_a_turn(qwen):
    model, tokenizer = qwen
    continuation = ChatContinuation(tokenizer, None)
    answer = [{"role": "user", "content": "again"}]
    stopped = tokenizer.decode(continuation.ids(answer, tokenizer.eos_token_id, stopped=True))
    cut = tokenizer.decode(continuation.ids(answer, 5, stopped=False))
    assert stopped == "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert cut == "<|im_end|>" + stopped  # the turn the model left open is closed first


def test_a_template_that_rewrites_earlier_turns_is_refused(qwen):
    _, tokenizer = qwen
    tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    # A template that writes only the last message: what came before changes as messages follow.
    tokenizer.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(ValueError, match="renders an assistant turn differently"):
        ChatContinuation(tokenizer, None).ids([{"role": "user", "content": "x"}], None, stopped=False)


# ---------------------------------------------------------------- limits
@pytest.mark.parametrize("limit, expected_turns, truncated", [
    (dict(max_turns=2), 2, True),  # the turn limit: the episode is cut short
    (dict(max_turns=8, max_episode_tokens="two turns"), 2, True),  # the token budget: no room for a third turn
    (dict(max_turns=8), 3, False),  # the environment ends it (2 calls of the add tool, then an answer)
], ids=["max-turns", "max-episode-tokens", "environment"])
def test_an_episode_ends_at_each_limit(qwen, limit, expected_turns, truncated):
    model, tokenizer = qwen
    stop = tokenizer.eos_token_id
    turns = [[[7, 8, stop]]] * 8
    if limit.get("max_episode_tokens") == "two turns":  # two turns and one answer fit, not another answer
        answer = ChatContinuation(tokenizer, ToolBox([add], 1.0).schemas).ids(
            [{"role": "tool", "name": "add", "content": "2"}], stop, stopped=True)
        limit = {**limit, "max_episode_tokens": 3 + len(answer) + 3 + 2}
    calls = iter([True, True, False, False, False, False, False, False])
    source = environment_source(tools=[add], tool_parser=lambda text: [ToolCall("add", {"a": 1, "b": 1})]
                                if next(calls) else [])
    limits = EpisodeLimits(1024, 1400, chat_template=True, **limit)
    episodes = roll_out(model, tokenizer, Scripted(turns, [stop], tokenizer.pad_token_id), [{"prompt": "hi"}], ["hi"],
                        limits, source)
    assert episodes.turns == [expected_turns] and episodes.truncated == [truncated]
    assert (episodes.sequences.response_mask.sum().item() <= limit["max_episode_tokens"]
            if "max_episode_tokens" in limit else True)
    # Every episode ends with the model's own turn: what the environment said last is not kept.
    assert episodes.sequences.loss_mask[0, episodes.sequences.response_mask[0].sum() - 1] == 1


def test_a_turn_past_the_token_budget_is_cut_and_counted_truncated(qwen):
    model, tokenizer = qwen
    stop = tokenizer.eos_token_id
    source = environment_source(tools=[add], tool_parser=lambda text: [])
    episodes = roll_out(model, tokenizer, Scripted([[[5] * 12 + [stop]]], [stop], tokenizer.pad_token_id),
                        [{"prompt": "hi"}], ["hi"], EpisodeLimits(1024, 1400, 4, 8, True), source)
    assert episodes.sequences.response_mask.sum().item() == 8 and episodes.truncated == [True]
    assert episodes.finished == [False]  # cut before its stop id


# ---------------------------------------------------------------- tools and their errors
def test_hermes_tool_calls_are_read_from_the_text():
    calls = parse_hermes('think <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
                         '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None),
                                                              ("add", {"a": 3, "b": 4}, None)]
    assert parse_hermes("no call here") == []
    assert parse_hermes('<tool_call>{"name": "add", "arguments": {"a": 1}')[0].error is not None  # cut: broken JSON


@pytest.mark.parametrize("text, outcome, says", [
    ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "ok", "5"),
    ('<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>', "errors", "not valid JSON"),
    ('<tool_call>["add"]</tool_call>', "errors", "a tool call is a JSON object"),
    ('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "errors", "there is no tool named 'mul'"),
    ('<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>', "errors", "wrong arguments for add"),
    ('<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>', "errors",
     "divide raised ZeroDivisionError"),
    ('<tool_call>{"name": "sleepy", "arguments": {"seconds": 5}}</tool_call>', "timeouts", "did not answer within"),
], ids=["ok", "broken-json", "not-an-object", "unknown-tool", "wrong-arguments", "raises", "timeout"])
def test_every_tool_call_error_is_told_to_the_model_and_counted(text, outcome, says):
    environment = ToolEnvironment(ToolBox([add, divide, sleepy], timeout=0.2), parse_hermes)
    environment.reset(seed=0, options={})
    observation, reward, terminated, truncated, _ = environment.step(text)
    assert not terminated and observation[0]["role"] == "tool" and says in observation[0]["content"]
    assert environment.tool_stats["calls"] == 1
    assert environment.tool_stats.get("errors", 0) == (outcome == "errors")
    assert environment.tool_stats.get("timeouts", 0) == (outcome == "timeouts")
    assert environment.tool_log[0]["outcome"] == {"ok": "ok", "errors": "error", "timeouts": "timeout"}[outcome]
    # A turn without a call is the answer: the episode ends.
    assert environment.step("the answer is 5")[2] is True


# ---------------------------------------------------------------- TRL's environment classes and gymnasium
def test_a_trl_environment_class_runs_unchanged(qwen):
    model, tokenizer = qwen
    source = environment_source("toy_envs:Counter", tool_parser=always_call("increment", {"by": 1}))
    assert [t["function"]["name"] for t in source.tools] == ["increment"]
    stop = tokenizer.eos_token_id
    episodes = roll_out(model, tokenizer, Scripted([[[5, stop]] * 2] * 3, [stop], tokenizer.pad_token_id),
                        [{"prompt": "go", "target": 2}, {"prompt": "go", "target": 3}], ["go", "go"],
                        EpisodeLimits(1024, 1400, max_turns=3, chat_template=True), source)
    # reset() got each row's own target and its string was appended to the prompt; get_reward() scored the end.
    assert [p[-1]["content"] for p in episodes.prompts] == ["go (count to 2)", "go (count to 3)"]
    # Three turns, but the last turn's call is not run (it ends the episode; TRL runs none): two
    # increments, right for target 2 only.
    assert episodes.episode_rewards == [1.0, 0.0]
    assert [c[1]["content"] for c in episodes.conversations] == ["1", "1"]
    assert [len(c) for c in episodes.conversations] == [5, 5]  # model, tool, model, tool, model


def test_frozen_lake_is_played_by_its_action_names(qwen):
    source = environment_source("gym:FrozenLake-v1", environment_config="is_slippery=false")
    environment = source.environments(1)[0]
    assert environment.action_names == ["left", "down", "right", "up"]
    # A row's own map: 2x2, the goal right of the start.
    observation, _ = environment.reset(seed=0, options={"desc": ["SG", "FF"]})
    assert "left, down, right, up" in observation and "\nSG\nFF\nYou are at row 1, column 1." in observation
    assert environment.step("I go nowhere")[:4] == (
        "That is not an action. Answer with one of: left, down, right, up.", 0.0, False, False)
    _, reward, terminated, _, _ = environment.step("Right!")
    assert reward == 1.0 and terminated and environment.tool_stats["invalid_actions"] == 1
    # Environments are pooled: the next row, naming no map, plays the run's (4x4) map, not the last row's.
    observation, _ = environment.reset(seed=0, options={})
    assert observation.endswith("\nSFFF\nFHFH\nFFFH\nHFFG\nYou are at row 1, column 1.") and "\x1b" not in observation


@pytest.mark.parametrize("environment, says", [
    ("toy_envs:NoReset", "has no reset()"),
    ("toy_envs:no_docstring", "cannot be made with no arguments"),
    ("gym:CartPole-v1", "have no names ppo-rlhf knows"),
    ("gym:Pendulum-v1", "not a discrete set"),
    ("gym:NoSuchGame-v0", "gym:NoSuchGame-v0"),
], ids=["no-reset", "a-function-that-makes-no-environment", "unnamed-actions", "continuous-actions", "unknown-id"])
def test_an_environment_that_cannot_play_is_refused_at_start(environment, says):
    with pytest.raises(ConfigError, match=says):
        environment_source(environment)


def test_a_trl_class_with_no_tools_is_refused_at_start_unless_tools_are_given():
    """Its model could call nothing: every episode would end at its first turn (issue 47's options
    that do nothing).  With --tool functions it has tools to call."""
    with pytest.raises(ConfigError, match="environment toy_envs:NoTools: a class of TRL's environment_factory shape "
                                          "with no tools .* and no --tool: the model could call nothing.*give it "
                                          "tool methods .*or --tool functions.*gymnasium's shape"):
        environment_source("toy_envs:NoTools")
    assert [t["function"]["name"] for t in environment_source("toy_envs:NoTools", tools=[add]).tools] == ["add"]


@pytest.mark.parametrize("tool, says", [("toy_envs:no_hints", "type hint"), ("toy_envs:no_docstring", "docstring")])
def test_a_tool_without_type_hints_or_docstring_is_refused_by_name(tool, says):
    with pytest.raises(ConfigError, match=f"tool {tool.split(':')[1]}:.*{says}"):
        environment_source(tools=[tool])


def test_a_chat_template_that_cannot_show_tools_is_refused_saying_how_to_give_one(zoo):
    tokenizer = AutoTokenizer.from_pretrained(zoo["qwen2"])  # the zoo's plain ChatML: no tools
    schemas = ToolBox([add], 1.0).schemas
    with pytest.raises(ConfigError, match="does not list the tools.*--chat-template-file"):
        check_template_renders_tools(tokenizer, schemas, "the zoo model")
    tokenizer.chat_template = tool_template_path().read_text()
    check_template_renders_tools(tokenizer, schemas, "the zoo model")


# ---------------------------------------------------------------- the trainer on episodes
def letter_game_config(zoo, tmp_path, *extra) -> list:
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    return ["ppo", "--model", zoo["qwen2"], "--prompts", prompts, "--environment", "toy_envs:LetterGame",
            "--out", tmp_path / "run", *BUDGET, *extra]


def test_the_environments_tokens_get_no_gradient(zoo, monkeypatch):
    """The final hidden state at a position feeds only that position's logits and value, so a
    gradient there means some loss (policy, KL, entropy, value) reached an environment token."""
    config = build_config(PPOConfig, {"model": str(zoo["qwen2"]), "environment": "toy_envs:LetterGame",
                                      "estimator": "gae", "kl_in": "loss", "kl_coef": 0.5, "entropy_coef": 0.1,
                                      "batch_size": 4, "mini_batch_size": 4, "max_new_tokens": 6, "max_length": 128,
                                      "num_threads": 1, "out": "unused"})
    trainer = PPOTrainer(config, model=AutoModelForCausalLM.from_pretrained(zoo["qwen2"]),
                         tokenizer=AutoTokenizer.from_pretrained(zoo["qwen2"]))
    experience, _ = trainer.make_experience([{"prompt": p} for p in PROMPTS[:4]])
    loss_mask, response_mask = experience.sequences.loss_mask, experience.sequences.response_mask
    environment_tokens = response_mask.bool() & ~loss_mask.bool()
    assert environment_tokens.sum() > 10  # the environment spoke between the turns
    assert trainer.pass_plan.fused  # the policy, KL and entropy terms read these hidden states, as the value does
    caught = []

    def catching(*args, **kwargs):
        stats = response_stats(*args, **kwargs)
        stats.hidden.retain_grad()
        caught.append(stats.hidden)
        return stats

    monkeypatch.setattr("ppo_rlhf.trainers.ppo_update.response_stats", catching)
    trainer.actor.train()
    trainer.accumulate_gradients(experience, torch.arange(4), warming_up=False)
    hidden_grad = caught[0].grad  # (B, T, H): at the positions that predict each response token
    assert hidden_grad[environment_tokens].abs().max() == 0
    assert hidden_grad[loss_mask.bool()].abs().max() > 0


def test_ppo_on_episodes_logs_them_and_saves_what_happened(zoo, tmp_path, capsys):
    run(letter_game_config(zoo, tmp_path, "--iterations", 2, "--save-rollouts", 2, "--sample-every", 1,
                           "--turn-rewards", "per-turn"))
    printed = capsys.readouterr().out
    assert "episodes:  environment toy_envs:LetterGame" in printed and "[user] again, with more" in printed
    last = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert last["episode/turns"] == 2.0 and last["episode/tokens"] > last["response_length"]
    assert {"episode/truncated", "tools/calls", "reward/environment"} <= set(last)
    # where the update's credit falls, turn by turn: every episode plays both turns
    assert last["turns/reached_1"] == last["turns/reached_2"] == 1.0 and "turns/advantage_3" not in last
    assert last["turns/abs_advantage_1"] > 0 and last["turns/abs_advantage_2"] > 0
    # the reward less the score is the KL's share only: the per-turn rewards (up to 8 a turn) are not in it
    assert last["reward/environment"] > 0 and last["kl_coef"] > 0
    assert last["non_score_reward"] == pytest.approx(-last["kl_coef"] * last["kl"])
    assert not (tmp_path / "run" / "rollouts" / "iteration_0001.jsonl").exists()
    records = [json.loads(line) for line in (tmp_path / "run" / "rollouts" / "iteration_0002.jsonl").open()]
    assert len(records) == 4
    record = records[0]
    assert [m["role"] for m in record["messages"]] == ["assistant", "user", "assistant"]
    assert len(record["loss_mask"]) == len(record["response_ids"]) and 0 in record["loss_mask"]
    assert record["turn_rewards"] == [float(min(m["content"].count("e"), 8)) for m in record["messages"][::2]]


def test_turn_advantages_by_hand():
    from ppo_rlhf.trainers.ppo_metrics import turn_advantages

    # Episode 0: turn 1 is tokens 0-1, the environment's 2-3 (no mask), turn 2 is token 4, 5 is padding.
    # Episode 1: one turn, tokens 0-2.
    advantages = torch.tensor([[1.0, 3.0, 9.0, 9.0, -2.0, 7.0], [0.5, -0.5, 3.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]])
    metrics = turn_advantages(advantages, mask, [[1, 4], [2]])
    # turn 1: means 2 and 1 -> 1.5; |.| means 2 and 4/3 -> 5/3; both episodes reach it
    # turn 2: episode 0 alone: -2, |.| 2, half the episodes
    assert metrics == pytest.approx({"turns/advantage_1": 1.5, "turns/abs_advantage_1": 5 / 3, "turns/reached_1": 1.0,
                                     "turns/advantage_2": -2.0, "turns/abs_advantage_2": 2.0, "turns/reached_2": 0.5})


def test_per_turn_rewards_land_on_each_turns_last_token(zoo):
    config = build_config(PPOConfig, {"model": str(zoo["qwen2"]), "environment": "toy_envs:LetterGame",
                                      "turn_rewards": "per-turn", "batch_size": 4, "mini_batch_size": 4,
                                      "max_new_tokens": 6, "max_length": 128, "num_threads": 1, "out": "unused",
                                      "kl_coef": 0.0})
    trainer = PPOTrainer(config, model=AutoModelForCausalLM.from_pretrained(zoo["qwen2"]),
                         tokenizer=AutoTokenizer.from_pretrained(zoo["qwen2"]))
    rows = [{"prompt": p} for p in PROMPTS[:4]]
    rollout = trainer.roll_out(rows, {"time/generate": 0.0, "time/score": 0.0})
    episodes = rollout.episodes
    for row in range(4):
        expected = torch.zeros_like(rollout.turn_rewards[row])
        for end, reward in zip(episodes.turn_ends[row], episodes.step_rewards[row]):
            expected[end] = reward
        assert torch.equal(rollout.turn_rewards[row], expected)
        assert rollout.scores[row] == 0  # nothing left for the episode's end
        assert rollout.raw_scores[row] == sum(episodes.step_rewards[row])


@pytest.mark.parametrize("extra", [
    ["--estimator", "grpo", "--samples-per-prompt", 2],
    ["--estimator", "rloo", "--samples-per-prompt", 2, "--dynamic-sampling"],
    ["--estimator", "remax"],
    ["--rollout-micro-batch-size", 1, "--train-micro-batch-size", 1],
    ["--lora", "--critic", "lora"],
], ids=["grpo", "dynamic-sampling", "remax", "micro-batches", "lora"])
def test_episodes_run_with_each_estimator_and_option(zoo, tmp_path, extra):
    run(letter_game_config(zoo, tmp_path, "--iterations", 1, *extra))
    assert read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]["episode/turns"] == 2.0


def test_a_run_on_episodes_resumes_to_the_weights_of_a_straight_run(zoo, tmp_path):
    run(letter_game_config(zoo, tmp_path / "straight", "--iterations", 3, "--save-every", 1))
    run(letter_game_config(zoo, tmp_path / "resumed", "--iterations", 2, "--save-every", 1))
    run(letter_game_config(zoo, tmp_path / "resumed", "--iterations", 3, "--save-every", 1, "--resume"))
    same_actor_as_straight_run(tmp_path / "straight" / "run", tmp_path / "resumed" / "run", zoo["qwen2"])


def test_an_environment_that_raises_stops_the_run_naming_it_and_the_row(zoo, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    err = run_failing(["ppo", "--model", zoo["qwen2"], "--prompts", prompts, "--environment", "toy_envs:RaisingStep",
                       "--out", tmp_path / "run", "--iterations", 2, *BUDGET], capsys)
    assert "environment RaisingStep: step() raised KeyError" in err and "prompts.jsonl:" in err
    # It failed in its first iteration, before any checkpoint: there is nothing to resume from.
    assert "no checkpoint" in err and "--overwrite" in err and "--resume" not in err and "Traceback" not in err


def test_a_run_stopped_by_its_environment_resumes_from_its_last_checkpoint(zoo, tmp_path, capsys, monkeypatch):
    import toy_envs

    monkeypatch.setattr(toy_envs.FailsOnTheThirdBatch, "resets", 0)
    monkeypatch.setenv("PPO_RLHF_TEST_ENV_FAILS", "1")
    args = letter_game_config(zoo, tmp_path, "--iterations", 3, "--save-every", 1)
    args[args.index("toy_envs:LetterGame")] = "toy_envs:FailsOnTheThirdBatch"
    err = run_failing(args, capsys)
    assert "environment FailsOnTheThirdBatch: reset() raised ConnectionError: the game server went away" in err
    assert "continue from its checkpoint after iteration 2" in err and "--resume" in err
    assert (tmp_path / "run" / "checkpoints" / "last").is_dir()  # iterations 1 and 2 are kept
    monkeypatch.delenv("PPO_RLHF_TEST_ENV_FAILS")
    run([*args, "--resume"])
    assert "after iteration 2 of 3" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


@pytest.fixture(scope="module")
def room_for_tools(tmp_path_factory):
    """The zoo's ChatML model with 1024 positions: the tool template's prompt is ~470 tokens in its
    tiny vocabulary, and a prompt cut would take the tools away (refused)."""
    from test_default_learning import users_tiny_model

    folder = tmp_path_factory.mktemp("room") / "model"
    users_tiny_model(folder, arch="qwen2", positions=1024)
    return str(folder)


def test_tools_from_python_and_the_shipped_template(room_for_tools, tmp_path):
    def doubled(prompts, responses, conversations, environments):
        assert all(c[0]["role"] == "assistant" for c in conversations) and len(environments) == len(responses)
        return [float(len(r) % 3) for r in responses]

    config = PPOConfig(model=room_for_tools, prompts=str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in
                                                                                           PROMPTS])),
                       chat_template_file=TEMPLATE, out=str(tmp_path / "api"), iterations=1, batch_size=4,
                       mini_batch_size=2, max_new_tokens=6, eval_every=0, save_every=0, num_threads=1)
    summary = PPOTrainer(config, reward=doubled, tools=[add]).train()
    assert summary["iterations"] == 1
    saved = AutoTokenizer.from_pretrained(Path(summary["checkpoints"]["actor"]))
    assert saved.chat_template == tool_template_path().read_text()  # the template trained with goes with the model


def test_episode_seeds_follow_the_prompt_group_and_the_batch_place():
    one_process = episode_seeds(0, 3, 1, 0, 4, 2)
    assert one_process[0] == one_process[1] and one_process[0] != one_process[2]  # a group shares its start
    assert episode_seeds(0, 3, 1, 2, 2, 2) == one_process[4:]  # a second process's half is the same
    assert episode_seeds(0, 4, 1, 0, 4, 2) != one_process  # another iteration, other episodes


GAME = {"environment": "toy_envs:LetterGame"}


@pytest.mark.parametrize("values, says", [
    ({**GAME, "max_turns": 0}, "'max_turns'.*> 0"),
    ({**GAME, "action_names": ["a"]}, "'action_names'.*left out without --environment gym:ID"),
    ({**GAME, "turn_rewards": "per-turn", "estimator": "grpo", "samples_per_prompt": 2}, "gae or reinforce\\+\\+"),
    ({**GAME, "environment_config": "is_slippery"}, "key=value"),
    ({**GAME, "max_episode_tokens": 1024}, "'max_episode_tokens'.*< max_length \\(1024\\)"),
    ({**GAME, "overlong_buffer": 4}, "'overlong_buffer'.*a turn's limit"),
], ids=["zero-turns", "action-names-off-gym", "per-turn-with-a-group", "config",
        "episode-longer-than-max-length", "overlong-on-episodes"])
def test_episode_options_are_checked_at_start(values, says):
    with pytest.raises(ConfigError, match=says):
        build_config(PPOConfig, values)


@pytest.mark.parametrize("values, says", [
    ({"max_turns": 3}, "'max_turns'.*left out without --environment or --tool"),
    ({"environment_config": "is_slippery=false"}, "'environment_config'.*left out without"),
], ids=["turns-without-environment", "config-without-environment"])
def test_episode_options_without_episodes_are_refused_at_start(values, says):
    with pytest.raises(ConfigError, match=says):
        PPOTrainer(build_config(PPOConfig, values))  # refused before anything loads (no model is named)


def test_a_config_may_hold_episode_options_for_an_environment_given_in_python(zoo):
    config = build_config(PPOConfig, {"max_turns": 3, "turn_rewards": "per-turn"})  # no --environment: not refused
    with pytest.raises(ConfigError) as refused:  # past the episode checks, to what the run lacks (its prompts)
        PPOTrainer(config, environment=LetterGame)
    assert "max_turns" not in str(refused.value) and "turn_rewards" not in str(refused.value)


@pytest.mark.parametrize("given, says", [
    ({"environment": "toy_envs:Counter"}, "rewards no turn on its own"),
    ({"environment": Counter}, "rewards no turn on its own"),
    ({"tools": [add]}, "tools pay no rewards"),
], ids=["trl-class-named", "trl-class-in-python", "tools-in-python"])
def test_per_turn_rewards_where_no_turn_is_rewarded_are_refused_at_start(given, says):
    # TRL's classes and tools reward the finished episode only: per-turn would do what sum does (issue 63).
    named = {"environment": given["environment"]} if isinstance(given.get("environment"), str) else {}
    config = build_config(PPOConfig, {**named, "turn_rewards": "per-turn"})
    objects = {key: value for key, value in given.items() if key not in named}
    with pytest.raises(ConfigError, match=f"'turn_rewards': 'per-turn'.*{says}"):
        PPOTrainer(config, **objects)  # before any model loads (none is named)


@pytest.mark.learning
@pytest.mark.slow
def test_a_tiny_models_score_on_a_two_turn_game_rises(tmp_path, monkeypatch, learning_seed, record_outcome):
    """A user's random tiny model (tests/test_default_learning.py's, with ChatML tokens) plays
    LetterGame: two turns, each paid the number of 'e's it writes; the README's defaults (PPO with
    a critic), per-turn rewards."""
    from test_default_learning import users_tiny_model

    monkeypatch.chdir(tmp_path)
    # 1024 positions (rotary: the same weights as 512): an episode's default --max-length is 1024.
    users_tiny_model(tmp_path / "DIR", learning_seed, arch="qwen2", positions=1024)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    run(["ppo", "--model", "DIR", "--prompts", "prompts.jsonl", "--environment", "toy_envs:LetterGame",
         "--turn-rewards", "per-turn", "--max-new-tokens", 24, "--iterations", ITERATIONS, "--seed", learning_seed,
         "--out", "runs/game", "--num-threads", 1])
    scores = [row["score"] for row in read_metrics(tmp_path / "runs" / "game" / "metrics.jsonl") if "score" in row]
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    record_outcome("last_over_first", last / first)
    assert last > 2.5 * first, (first, last, scores)  # seeds 0-4 (the model and the run): 3.65-4.16x


ITERATIONS = 20


def test_a_textarena_game_is_played_through_the_protocol():
    pytest.importorskip("textarena")
    source = environment_source("textarena:GuessTheNumber-v0")
    game = source.environments(1)[0]
    observation, _ = game.reset(seed=3)
    assert "Guess The Number" in observation
    low, high, reward, terminated = 1, 20, 0.0, False
    for _ in range(10):  # a binary search, as the model is asked to play
        guess = (low + high) // 2
        observation, reward, terminated, _, _ = game.step(f"I guess [{guess}]")
        if terminated:
            break
        assert "[Player]" not in observation  # only what is new, its own move left out
        low, high = (guess + 1, high) if "higher" in observation else (low, guess - 1)
    assert terminated and reward == 1.0


def test_sft_trains_every_assistant_turn_of_a_trace_in_one_row_and_lists_its_tools(qwen):
    from ppo_rlhf.config import build_config as build
    from ppo_rlhf.formats import completion_rows
    from ppo_rlhf.trainers.sft import SFTConfig, sft_token_rows

    _, tokenizer = qwen
    schema = ToolBox([add], 1.0).schemas[0]
    trace = {"messages": [{"role": "user", "content": "1 + 2?"},
                          {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}'
                                                           '</tool_call>'},
                          {"role": "tool", "name": "add", "content": "3"},
                          {"role": "assistant", "content": "It is 3."}], "tools": [schema], "_source": "t.jsonl:1"}
    rows = completion_rows("prompt", "completion", True)([trace])
    assert len(rows) == 1  # one row: every assistant turn trained at once
    [(ids, labels)] = sft_token_rows(tokenizer, rows, build(SFTConfig, {"chat_template": True}))
    assert '"name": "add"' in tokenizer.decode(ids[:ids.index(tokenizer.convert_tokens_to_ids("<|im_end|>"))])
    learned = tokenizer.decode([token for token, label in zip(ids, labels) if label != -100])
    # the tool's answer: context; each turn ends at the template's end of turn, as an episode's turn does
    assert learned == trace["messages"][1]["content"] + "<|im_end|>It is 3.<|im_end|>"


def test_a_trl_environment_class_given_in_python(room_for_tools, tmp_path):
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p, "target": 1} for p in PROMPTS])
    config = PPOConfig(model=room_for_tools, prompts=str(rows), chat_template_file=TEMPLATE, out=str(tmp_path / "run"),
                       iterations=1, batch_size=4, mini_batch_size=4, max_new_tokens=4, eval_every=0, save_every=0,
                       num_threads=1)
    assert config.max_length == 256  # no --environment in the config: a single turn's default, so far
    summary = PPOTrainer(config, environment=Counter).train()  # its get_reward() is the run's only reward
    assert config.max_length == 1024  # an environment given in Python: an episode's default
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    # No call is ever read from a tiny model's text: the counter stays 0, short of the target.
    assert summary["iterations"] == 1 and metrics["score"] == metrics["reward/environment"] == 0.0


def test_frozen_lake_in_a_ppo_run(tmp_path):
    from test_default_learning import users_tiny_model

    users_tiny_model(tmp_path / "model", arch="qwen2", positions=1024)
    rows = write_jsonl(tmp_path / "maps.jsonl", [{"prompt": "Reach G.", "desc": desc} for desc in
                                                  (["SF", "HG"], ["SH", "FG"], ["SF", "FG"], ["SG", "FF"])])
    run(["ppo", "--model", tmp_path / "model", "--prompts", rows, "--environment", "gym:FrozenLake-v1",
         "--environment-config", "is_slippery=false", "--max-turns", 3, "--turn-rewards", "per-turn",
         "--out", tmp_path / "run", "--iterations", 1, "--batch-size", 4, "--mini-batch-size", 4, "--ppo-epochs", 1,
         "--max-new-tokens", 4, "--max-length", 1000, "--eval-every", 0, "--save-every", 0, *THREADS])
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    assert 1 <= metrics["episode/turns"] <= 3 and "env/invalid_actions" in metrics


# ---------------------------------------------------------------- limits as documented
def test_each_turn_asks_for_no_more_than_the_room_its_episode_has_left(qwen):
    model, tokenizer = qwen
    stop = tokenizer.eos_token_id
    generator = Scripted([[[7, 8, stop]]] * 3, [stop], tokenizer.pad_token_id)
    generator.max_new_tokens = 50
    source = environment_source(tools=[add], tool_parser=always_call("add", {"a": 1, "b": 1}))
    answer = len(ChatContinuation(tokenizer, source.tools).ids([{"role": "tool", "name": "add", "content": "2"}], stop,
                                                             stopped=True))
    roll_out(model, tokenizer, generator, [{"prompt": "hi"}], ["hi"],
             EpisodeLimits(1024, 1400, max_turns=3, max_episode_tokens=3 + answer + 20, chat_template=True), source)
    assert generator.limits[:2] == [[50], [20]]  # the second turn: the 20 tokens its episode has left, not 50


def test_a_model_whose_positions_an_episode_could_outrun_is_refused_at_start(zoo, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    err = run_failing(["ppo", "--model", zoo["qwen2"], "--prompts", prompts, "--environment", "toy_envs:LetterGame",
                       "--out", tmp_path / "run", *THREADS], capsys)
    assert ("the model has 128 positions but sequences here reach 1024 tokens (an episode's prompt and turns, up to "
            "--max-length 1024 (1024 by default with --environment or --tool) or --max-episode-tokens); lower it") in err


def test_a_later_turn_never_runs_past_the_positions_of_a_model_with_learned_positions(zoo):
    """GPT-2's n_positions equals --max-length here: a turn asking --max-new-tokens whatever room
    is left ran past it (an IndexError in the position embedding)."""
    from ppo_rlhf.rollout.sequences import stop_token_ids

    model, tokenizer = AutoModelForCausalLM.from_pretrained(zoo["gpt2"]), AutoTokenizer.from_pretrained(zoo["gpt2"])
    assert model.config.n_positions == 128
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    generator = TorchGenerator(stop_token_ids(tokenizer, model), tokenizer.pad_token_id, 60, do_sample=True, seed=0)
    episodes = roll_out(model, tokenizer, generator, [{"prompt": "hello"}] * 2, ["hello"] * 2,
                        EpisodeLimits(20, 128, max_turns=4, chat_template=True), environment_source(LetterGame))
    lengths = episodes.sequences.prompt_mask.sum(dim=1) + episodes.sequences.response_mask.sum(dim=1)
    assert lengths.max() <= 128 and max(episodes.turns) == 2


def test_the_calls_of_a_turn_that_ends_the_episode_are_not_run(qwen):
    model, tokenizer = qwen
    stop = tokenizer.eos_token_id
    source = environment_source(tools=[add], tool_parser=always_call("add", {"a": 1, "b": 2}))
    episodes = roll_out(model, tokenizer, Scripted([[[7, stop]]], [stop], tokenizer.pad_token_id), [{"prompt": "hi"}],
                        ["hi"], EpisodeLimits(1024, 1400, max_turns=1, chat_template=True), source)
    assert episodes.stats["calls"] == 0 and episodes.tool_logs == [[]]  # not run: the model would never read it
    assert episodes.conversations[0] == [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}]
    assert episodes.truncated == [True]  # ended by --max-turns while it still called a tool


def test_an_empty_turn_keeps_its_per_turn_reward(qwen):
    model, tokenizer = qwen
    stop = tokenizer.eos_token_id
    # An engine may return nothing for a turn.
    generator = Scripted([[[7, 8, stop]], [[]], [[9, stop]]], [stop], tokenizer.pad_token_id)
    episodes = roll_out(model, tokenizer, generator, [{"prompt": "hi"}], ["hi"],
                        EpisodeLimits(128, 400, max_turns=3, chat_template=True),
                        environment_source("toy_envs:PaysEachTurn"))
    first, second, third = episodes.turn_ends[0]
    # The empty turn's reward lands on the turn before it.
    assert first == second == 2 and episodes.step_rewards[0] == [1.0, 1.0, 1.0]
    config = build_config(PPOConfig, {"environment": "toy_envs:PaysEachTurn", "turn_rewards": "per-turn"})
    trainer = SimpleNamespace(config=config, device="cpu")
    score, placed = PPOTrainer.place_turn_rewards(trainer, torch.tensor([3.0]), episodes)
    assert placed[0, 2] == 2.0 and placed[0, third] == 1.0 and score.item() == 0.0


def test_per_turn_rewards_go_through_the_scores_normalisation_and_clip():
    config = build_config(PPOConfig, {"environment": "toy_envs:LetterGame", "turn_rewards": "per-turn",
                                      "score_norm": True, "score_clip": 1.5})
    trainer = SimpleNamespace(config=config, score_moments=RunningMoments())
    scores, turns = torch.tensor([1.0, 0.0]), torch.tensor([[0.0, 4.0, 0.0], [2.0, 0.0, 0.0]])
    normalised, turn_rewards = PPOTrainer.normalise_scores(trainer, scores, turns)
    returns = torch.tensor([5.0, 2.0])  # the moments are of each episode's whole return
    assert trainer.score_moments.mean.item() == pytest.approx(returns.mean().item(), rel=1e-3)
    std = trainer.score_moments.std.item()
    torch.testing.assert_close(turn_rewards, (turns / std).clamp(-1.5, 1.5))
    mean = trainer.score_moments.mean.item()
    torch.testing.assert_close(normalised, ((scores - mean) / std).clamp(-1.5, 1.5))


@pytest.mark.parametrize("environment, option", [
    ("gym:FrozenLake-v1", {"tool_parser": "hermes"}),
    ("toy_envs:LetterGame", {"tool_timeout": 5.0}),
], ids=["gym-tool-parser", "gymnasium-class-tool-timeout"])
def test_tool_options_are_refused_where_no_tool_is_called(environment, option):
    name = next(iter(option))
    flag = name.replace("_", "-")
    with pytest.raises(ConfigError, match=f"invalid value for '{name}'.*calls no tool.*leave --{flag} out"):
        environment_source(environment, **option)


def test_blackjack_plays_its_observation_said_in_words():
    environment = environment_source("gym:Blackjack-v1").environments(1)[0]
    observation, _ = environment.reset(seed=0, options={})
    assert "stick, hit" in observation and "Your cards add up to 11; the dealer shows a 10." in observation
    observation, reward, terminated, _, _ = environment.step("hit")
    assert observation == "Your cards add up to 12; the dealer shows a 10." and not terminated


def test_an_environment_that_draws_no_text_is_refused_naming_observation_text():
    with pytest.raises(ConfigError, match="gym:CartPole-v1 draws no text.*--observation-text module:function"):
        environment_source("gym:CartPole-v1", action_names=["left", "right"])


def test_the_adapters_instructions_are_a_paragraph_of_their_own(qwen):
    model, tokenizer = qwen
    stop = tokenizer.eos_token_id
    source = environment_source("gym:FrozenLake-v1", environment_config="is_slippery=false")
    episodes = roll_out(model, tokenizer, Scripted([[[7, stop]]], [stop], tokenizer.pad_token_id),
                        [{"prompt": "Reach G."}], ["Reach G."], EpisodeLimits(128, 400, chat_template=True), source)
    assert episodes.prompts[0][-1]["content"].startswith("Reach G.\n\nYou are playing FrozenLake.")


@pytest.mark.parametrize("environment, says", [
    ("toy_envs:OldGymStep", "step\\(\\) returned 4 values \\(observation, reward, done, info\\), the old gym "
                            "API.*split done into terminated"),
    ("toy_envs:TextReward", "step\\(\\) returned the reward '1.0' \\(str\\); a reward is a finite number"),
], ids=["old-gym-4-tuple", "text-reward"])
def test_what_an_environment_hands_back_is_checked_naming_it_the_method_and_the_row(qwen, environment, says):
    model, tokenizer = qwen
    stop = tokenizer.eos_token_id
    with pytest.raises(EnvironmentFailed, match=f"environment {environment.split(':')[1]}: {says}.*rows.jsonl:4"):
        roll_out(model, tokenizer, Scripted([[[7, stop]]], [stop], tokenizer.pad_token_id),
                 [{"prompt": "hi", "_source": "rows.jsonl:4"}], ["hi"], EpisodeLimits(128, 400, chat_template=True),
                 environment_source(environment))


# ---------------------------------------------------------------- evaluation shows episodes
def test_ppos_held_out_evaluation_of_episodes_shows_progress_as_eval_does(room_for_tools, tmp_path, capsys):
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p, "target": 1} for p in PROMPTS[:4]])
    run(["ppo", "--model", room_for_tools, "--prompts", rows, "--eval-prompts", rows, "--environment",
         "toy_envs:Counter", "--chat-template-file", TEMPLATE, "--max-turns", 2, "--iterations", 1, "--batch-size", 4,
         "--mini-batch-size", 4, "--ppo-epochs", 1, "--max-new-tokens", 4, "--max-length", 1024, "--eval-every", 0,
         "--no-eval-sampled", "--save-every", 0, "--out", tmp_path / "run", *THREADS])
    err = capsys.readouterr().err
    # the evaluation before the first iteration and after the last: a bar of the 4 episodes each
    assert err.count("eval:   0%") == 2 and "eval: 100%" in err and "4/4" in err and "episode" in err, err


def test_eval_with_an_environment_keeps_whole_episodes_reports_them_and_shows_progress(room_for_tools, tmp_path,
                                                                                      capsys):
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p, "target": 1} for p in PROMPTS[:4]])
    run(["eval", "--model", room_for_tools, "--prompts", rows, "--environment", "toy_envs:Counter",
         "--tool-parser", "toy_envs:calls_increment", "--chat-template-file", TEMPLATE, "--max-turns", 2,
         "--max-new-tokens", 4, "--max-length", 1024, "--out", tmp_path / "eval", *THREADS])
    captured = capsys.readouterr()
    assert "eval: 100%" in captured.err and "4/4" in captured.err  # the bar of the episodes played
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["episode/turns"] == 2.0 and summary["tools/calls"] == 1.0 and summary["tools/errors"] == 0.0
    assert summary["episode/success"] == 1.0 and summary["score"] == 1.0  # one increment reaches the target 1
    sample = summary["samples"][0]
    assert [m["role"] for m in sample["messages"]] == ["assistant", "tool", "assistant"]
    assert sample["messages"][0]["tool_calls"][0]["function"] == {"name": "increment", "arguments": {"by": 1}}
    assert sample["messages"][1] == {"role": "tool", "name": "increment", "content": "1"}
    assert sample["tool_calls"][0]["outcome"] == "ok" and sample["turns"] == 2 and sample["truncated"]
    assert "[tool] 1" in sample["response"]


# ---------------------------------------------------------------- what environments, tools and templates hand back
NO_CALLS = {"tool_parser": lambda text: []}  # a TRL class's episode: turns without calls


@pytest.mark.parametrize("environment, options, method, says", [
    ("toy_envs:ResetEndsWithTheReply", {}, "reset", "returned messages that end with an assistant message as the "
                                                    "prompt"),
    ("toy_envs:ResetReturnsText", {}, "reset", "returned 'a bare string, not \\(observation, info\\)'; gymnasium's "
                                               "reset returns \\(observation, info\\)"),
    ("toy_envs:RewardIsNaN", NO_CALLS, "get_reward", "returned the reward nan \\(float\\); a reward is a finite number"),
    ("toy_envs:ResetLikeGymnasium", NO_CALLS, "reset", "raised TypeError: it returned a tuple \\(observation, "
                                                       "info\\), gymnasium's shape, but its reset does not take seed= "
                                                       "and options="),
], ids=["reset-ends-with-the-reply", "reset-bare-string", "nan-get-reward", "trl-reset-returns-a-tuple"])
def test_an_environment_handing_back_what_none_may_is_named(qwen, environment, options, method, says):
    model, tokenizer = qwen
    stop = tokenizer.eos_token_id
    with pytest.raises(EnvironmentFailed, match=f"environment {environment.split(':')[1]}: {method}\\(\\) {says}"
                                                f".*rows.jsonl:2"):
        roll_out(model, tokenizer, Scripted([[[7, stop]]], [stop], tokenizer.pad_token_id),
                 [{"prompt": "hi", "_source": "rows.jsonl:2"}], ["hi"], EpisodeLimits(1024, 1400, chat_template=True),
                 environment_source(environment, **options))


@pytest.mark.parametrize("options, says", [
    (dict(observation_text="toy_envs:says_nothing"), "reset\\(\\) raised TypeError: its observation text function "
                                                     "says_nothing returned None \\(NoneType\\); it must return the "
                                                     "text the model reads \\(--observation-text\\)"),
    (dict(environment_config="desc=[SX,FG]"), "reset\\(\\) raised ValueError: the map holds tiles FrozenLake does "
                                              "not know \\(X\\)"),
], ids=["observation-text-none", "unknown-tile"])
def test_a_gym_environments_observation_that_cannot_be_read_is_named(options, says):
    source = environment_source("gym:FrozenLake-v1", **options)
    environment = source.environments(1)[0]
    runner = SimpleNamespace(calls=source.calls)
    with pytest.raises(EnvironmentFailed, match=f"environment gym:FrozenLake-v1: {says}.*maps.jsonl:7"):
        from ppo_rlhf.rollout.episodes import EpisodeRunner

        source.calls.run(EpisodeRunner.call(runner, environment, "reset", {"_source": "maps.jsonl:7"}, seed=0,
                                            options={}))


@pytest.mark.parametrize("arguments, says", [
    (dict(environment="gym:FrozenLake-v1", environment_config="desc=[SFFF,FHFH"),
     "invalid value for 'environment_config'.*a bracket opened in 'desc=\\[SFFF,FHFH' is never closed"),
    (dict(environment="gym:FrozenLake-v1", environment_config="map_name=5x5"),
     "environment gym:FrozenLake-v1: making it with \\{'map_name': '5x5'\\} raised KeyError: '5x5'"),
    (dict(environment="toy_envs:BrokenConstructor"),
     "environment toy_envs:BrokenConstructor: making it raised RuntimeError: the game server is down"),
    (dict(tools=add), "tools must be a list of functions, got a function.*give tools=\\[add\\]"),
], ids=["config-unclosed-bracket", "gymnasium-constructor-key-error", "constructor-raises", "tools-a-function"])
def test_start_time_inputs_that_cannot_make_an_environment_are_named(arguments, says):
    with pytest.raises(ConfigError, match=says):
        environment_source(**arguments)


def test_a_chat_template_file_with_a_syntax_error_is_refused_naming_it(zoo, tmp_path):
    from ppo_rlhf.envs.options import apply_chat_template_file

    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }}")  # the for is never closed
    with pytest.raises(ConfigError, match=f"invalid value for 'chat_template_file': '{broken}'; the template does not "
                                          f"render a user's question \\(TemplateSyntaxError"):
        apply_chat_template_file(AutoTokenizer.from_pretrained(zoo["qwen2"]), str(broken))


@pytest.mark.parametrize("parser, says", [
    ("raising_parser", "the tool-call parser raising_parser raised KeyError: 'name' on a turn"),
    ("parser_of_strings", "the tool-call parser parser_of_strings returned \\['add'\\]; a parser returns a list of "
                          "ppo_rlhf.envs.parsers.ToolCall"),
], ids=["raises", "returns-strings"])
def test_a_broken_tool_parser_is_named_as_the_parser(room_for_tools, tmp_path, capsys, parser, says):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    err = run_failing(["ppo", "--model", room_for_tools, "--prompts", prompts, "--tool", "toy_envs:add",
                       "--tool-parser", f"toy_envs:{parser}", "--chat-template-file", TEMPLATE,
                       "--reward-fn", f"{REWARDS_MODULE}:length_score", "--out", tmp_path / "run",
                       "--batch-size", 4, "--mini-batch-size", 4, "--max-new-tokens", 6, "--max-length", 1024,
                       "--eval-every", 0, "--save-every", 0, *THREADS], capsys)
    assert re.search(says, err) and "step()" not in err and "Traceback" not in err


def test_a_prompt_whose_cut_would_take_its_tools_away_is_refused_at_start(room_for_tools, tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    err = run_failing(["ppo", "--model", room_for_tools, "--prompts", prompts, "--tool", "toy_envs:add",
                       "--chat-template-file", TEMPLATE, "--reward-fn", f"{REWARDS_MODULE}:length_score",
                       "--max-length", 256, "--max-new-tokens", 16, "--out", tmp_path / "run", *THREADS], capsys)
    assert re.search(r"the prompt of .*prompts.jsonl:1 is \d+ tokens once the chat template lists its tools, more "
                     r"than --max-length minus --max-new-tokens \(240\).*raise --max-length to at least", err)
