"""Bad inputs, third pass (issue 47: nothing silent), none of them in the three earlier files; the
environments' own return values, tool lists cut from prompts, templates and constructors that
fail at start have their tests beside the episode code (tests/test_episodes.py).

The same rules as there: a refusal is exit 2 (a ConfigError from Python), no traceback, and a
message naming the culprit and a fix that works in that command.  The classes, each fixed where it
starts (docs/robustness.md):

- options that do nothing, refused by name: a clip range with SAPO's gate, importance weights with
  the torch engine, per-turn or weighted environment rewards with tools alone, an environment
  weighted 0 as the only reward, a chat template file the run never reads, --no-chat-template where
  the prompts are chat messages;
- advice that can work in that command: a failing environment no longer tells ``eval`` (or a run
  without a checkpoint) to resume; an optional choice's None is not listed as a choice and refused;
- the run's record: an environment given in Python recorded by import path, one without a path
  refused where a later run would load it or resume it, one given twice refused, another class on
  resume refused from Python as the command line refuses it, a tool's arguments recorded as the
  model wrote them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import yaml

from ppo_rlhf import ConfigError, PPOConfig, PPOTrainer
from ppo_rlhf.cli import build_parser
from ppo_rlhf.config import build_config, config_from_args
from test_bad_inputs import (  # noqa: F401 -- broken is a fixture the cases use
    PROMPT, ROW, Bad, assert_refused, broken, evaluate, fill, ppo, rows, sft, write_files,
)
from zoo import PROMPTS

PROMPTS_FILE = {"data.jsonl": rows(PROMPT)}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
BROKEN_TEMPLATE = "{% for m in messages %}{{ m['content'] }"  # a Jinja syntax error
GAME = "toy_envs:LetterGame"
TOOL = "toy_envs:add"


def ppo_on(*extra):
    """ppo on a chat model (the episodes' checks need a chat template)."""
    return [("{qwen2}" if a == "{llama}" else a) for a in ppo(*extra)]


def ppo_with_tools(*extra):
    """ppo with a tool, on a chat model with the template ppo-rlhf ships for tools: nothing else is wrong."""
    return ppo_on("--tool", TOOL, "--chat-template-file", "{tool_template}", *extra)


CASES = [
    # ------------------------------------------------------------ options that do nothing
    Bad("ppo-clip-ratio-with-sapo", ppo("--policy-loss", "sapo", "--clip-ratio", 0.3),
        ("'clip_ratio'", "--policy-loss sapo", "no clip range"), PROMPTS_FILE),
    Bad("ppo-clip-ratio-at-its-old-default-with-sapo", ppo("--policy-loss", "sapo", "--clip-ratio", 0.2),
        ("'clip_ratio'", "--policy-loss sapo"), PROMPTS_FILE),
    Bad("ppo-is-correction-with-the-torch-engine", ppo("--is-correction", "token-mask"),
        ("'is_correction'", "'token-mask'", "--rollout-engine torch", "no engine log-probs"), PROMPTS_FILE),
    Bad("ppo-is-correction-sequence-with-the-torch-engine", ppo("--is-correction", "sequence-truncate"),
        ("'is_correction'", "--rollout-engine torch"), PROMPTS_FILE),
    Bad("ppo-is-cap-with-the-torch-engine", ppo("--is-cap", 3), ("'is_cap'", "--rollout-engine torch"),
        PROMPTS_FILE),
    Bad("ppo-is-floor-with-the-torch-engine", ppo("--is-floor", 0.5), ("'is_floor'", "--rollout-engine torch"),
        PROMPTS_FILE),
    Bad("ppo-per-turn-rewards-with-tools-alone", ppo_with_tools("--turn-rewards", "per-turn"),
        ("'turn_rewards'", "--tool alone", "tools pay no rewards"), PROMPTS_FILE),
    Bad("ppo-environment-reward-weight-with-tools-alone", ppo_with_tools("--environment-reward-weight", 2),
        ("'environment_reward_weight'", "--tool alone"), PROMPTS_FILE),
    Bad("ppo-environment-weighted-zero-as-the-only-reward",
        ppo_on("--environment", GAME, "--reward-fn", "", "--environment-reward-weight", 0),
        ("'environment_reward_weight'", "only ones", "every score would be 0"), PROMPTS_FILE),
    Bad("ppo-chat-template-file-without-a-chat-template", ppo("--chat-template-file", "{tmp}/t.jinja"),
        ("'chat_template_file'", "without --chat-template"), {**PROMPTS_FILE, "t.jinja": TEMPLATE}),
    Bad("ppo-broken-chat-template-file-without-a-chat-template", ppo("--chat-template-file", "{tmp}/t.jinja"),
        ("'chat_template_file'", "without --chat-template"), {**PROMPTS_FILE, "t.jinja": BROKEN_TEMPLATE}),
    Bad("sft-chat-template-file-without-a-chat-template", sft("--chat-template-file", "{tmp}/t.jinja"),
        ("'chat_template_file'", "without --chat-template"), {"data.jsonl": rows(ROW), "t.jinja": TEMPLATE}),
    Bad("eval-chat-template-file-without-a-chat-template", evaluate("--chat-template-file", "{tmp}/t.jinja"),
        ("'chat_template_file'", "without --chat-template"), {**PROMPTS_FILE, "t.jinja": TEMPLATE}),
    Bad("ppo-no-chat-template-with-an-environment", ppo_on("--environment", GAME, "--no-chat-template"),
        ("'chat_template'", "--environment / --tool", "leave --no-chat-template out"), PROMPTS_FILE),
    Bad("ppo-no-chat-template-with-a-tool", ppo_with_tools("--no-chat-template"),
        ("'chat_template'", "--environment / --tool"), PROMPTS_FILE),
    Bad("eval-no-chat-template-with-an-environment",
        evaluate("--model", "{qwen2}", "--max-length", 64, "--environment", GAME, "--no-chat-template"),
        ("'chat_template'", "--environment / --tool"), PROMPTS_FILE),
    Bad("ppo-no-chat-template-with-a-reasoning-gym-task",
        ["ppo", "--model", "{qwen2}", "--task", "reasoning-gym:chain_sum", "--task-size", 8, "--task-eval-size", 2,
         "--no-chat-template", "--iterations", 1, "--batch-size", 2, "--mini-batch-size", 2, "--ppo-epochs", 1,
         "--max-new-tokens", 4, "--max-length", 128, "--eval-every", 0, "--save-every", 0, "--out", "{out}",
         "--num-threads", 1],
        ("'chat_template'", "--task reasoning-gym:chain_sum")),
    # ------------------------------------------------------------ advice that can work in that command
    Bad("ppo-loss-aggregation-not-a-choice", ppo("--loss-aggregation", "mean"),
        ("--loss-aggregation", "'mean'", "token-mean", "sequence-sum-norm"), PROMPTS_FILE),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_input_is_named_and_stops_the_run(case: Bad, zoo, tmp_path, capsys, monkeypatch):
    if "reasoning-gym" in " ".join(map(str, case.args)) and importlib.util.find_spec("reasoning_gym") is None:
        pytest.skip("reasoning-gym is not installed")
    monkeypatch.chdir(tmp_path)
    from ppo_rlhf.envs.options import tool_template_path

    places = {**{k: str(v) for k, v in zoo.items() if isinstance(v, (str, Path))}, "tmp": str(tmp_path),
              "out": str(tmp_path / "out"), "tool_template": str(tool_template_path())}
    write_files(tmp_path, case.files)
    assert_refused([fill(a, places) for a in case.args], case.expect, places, capsys)
    assert not (tmp_path / "out" / "checkpoints").exists()  # refused at start: nothing trained or saved


def test_the_choices_help_lists_are_the_words_a_flag_takes():
    """An optional choice's None was listed ({None,token-mean,...}) and then refused as text; it is
    left empty by "", none or null, as every optional field is."""
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    ppo_help = subparsers.choices["ppo"].format_help()
    assert "{token-mean,sequence-mean,sequence-sum-norm}" in ppo_help and "None," not in ppo_help
    for word in ("None", "none", "null", ""):
        args = parser.parse_args(["ppo", "--loss-aggregation", word, "--kl-estimator", word,
                                  "--dynamic-sampling-on", word])
        config = config_from_args(PPOConfig, args, {"task": "doubling"})
        assert (config.loss_aggregation, config.kl_estimator, config.dynamic_sampling_on) == ("token-mean", None, None)
    # A choice that is itself "none" stays that choice.
    args = parser.parse_args(["ppo", "--is-correction", "none", "--rollout-engine", "vllm"])
    assert config_from_args(PPOConfig, args, {"task": "doubling"}).is_correction == "none"


def test_eval_on_a_failing_environment_does_not_advise_a_resume(zoo, tmp_path, capsys):
    """eval has no --resume: the environment's failure is named, and nothing says to resume."""
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(PROMPT) + "\n" for _ in range(2)))
    code = run_failing_quietly(["eval", "--model", zoo["qwen2"], "--prompts", tmp_path / "data.jsonl",
                                "--environment", "toy_envs:RaisingStep", "--size", 2, "--max-new-tokens", 4,
                                "--max-length", 64, "--num-threads", 1])
    err = capsys.readouterr().err
    assert code == 2 and "environment RaisingStep: step() raised KeyError" in err, err
    assert "--resume" not in err and "checkpoint" not in err and "Traceback" not in err


def run_failing_quietly(args) -> int:
    from ppo_rlhf.cli import main

    return main([str(a) for a in args])


# ---------------------------------------------------------------- the run's record, from Python
BUDGET = {"batch_size": 2, "mini_batch_size": 2, "ppo_epochs": 1, "max_new_tokens": 4, "max_length": 64,
          "eval_every": 0, "num_threads": 1, "iterations": 1}


def game_config(zoo, tmp_path, **changes) -> PPOConfig:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return PPOConfig(model=str(zoo["qwen2"]), prompts=str(prompts), out=str(tmp_path / "run"), **{**BUDGET, **changes})


def test_an_environment_given_in_python_is_recorded_by_its_import_path(zoo, tmp_path):
    import toy_envs

    config = game_config(zoo, tmp_path, save_every=1)
    PPOTrainer(config, environment=toy_envs.LetterGame).train()
    assert config.environment == GAME and config.chat_template is True
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["environment"] == GAME
    saved = json.loads((tmp_path / "run" / "checkpoints" / "last" / "run_config.json").read_text())
    assert saved["environment"] == GAME


def test_resuming_from_python_with_another_environment_class_is_refused(zoo, tmp_path):
    """The command line refused it (--environment is a setting of the run); from Python the class
    went unrecorded and any other was taken."""
    import toy_envs

    PPOTrainer(game_config(zoo, tmp_path, save_every=1), environment=toy_envs.LetterGame).train()
    with pytest.raises(ConfigError, match=r"--resume.*environment: 'toy_envs:LetterGame' -> 'toy_envs:RaisingStep'"):
        PPOTrainer(game_config(zoo, tmp_path, save_every=1, iterations=2, resume=True),
                   environment=toy_envs.RaisingStep)


def a_local_environment():
    import toy_envs

    class Local(toy_envs.LetterGame):
        pass

    return Local


def test_an_environment_without_an_import_path_is_recorded_as_such_and_refused_on_resume(zoo, tmp_path):
    local = a_local_environment()
    config = game_config(zoo, tmp_path, save_every=1)
    PPOTrainer(config, environment=local).train()
    assert config.environment.startswith("<python object ") and "Local" in config.environment
    with pytest.raises(ConfigError, match=r"--resume.*Local.*without an import path.*top level of a module"):
        PPOTrainer(game_config(zoo, tmp_path, save_every=1, iterations=2, resume=True), environment=local)


def test_a_config_recording_an_environment_without_an_import_path_asks_for_it_again(zoo, tmp_path):
    local = a_local_environment()
    config = game_config(zoo, tmp_path)
    PPOTrainer(config, environment=local)  # records it
    with pytest.raises(ConfigError, match=r"environment <python object .*Local.*give it again.*environment=\.\.\."):
        PPOTrainer(config)


def test_an_environment_given_in_the_config_and_as_an_argument_is_refused(zoo, tmp_path):
    import toy_envs

    config = game_config(zoo, tmp_path, environment=GAME)
    with pytest.raises(ConfigError, match=r"two environments.*'toy_envs:LetterGame'.*'toy_envs:RaisingStep'"):
        PPOTrainer(config, environment=toy_envs.RaisingStep)
    assert PPOTrainer(config, environment=toy_envs.LetterGame).config.environment == GAME  # the same one: fine


def test_no_chat_template_with_an_environment_given_in_python_is_refused(zoo, tmp_path):
    import toy_envs

    with pytest.raises(ConfigError, match="'chat_template'.*--environment / --tool"):
        PPOTrainer(game_config(zoo, tmp_path, chat_template=False), environment=toy_envs.LetterGame)


def test_a_chat_template_file_of_a_run_without_a_template_is_refused_from_python(zoo, tmp_path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    with pytest.raises(ConfigError, match="'chat_template_file'.*without --chat-template"):
        PPOTrainer(game_config(zoo, tmp_path, chat_template_file=str(tmp_path / "t.jinja")),
                   reward=lambda prompts, responses, **columns: [0.0] * len(responses))


def test_a_chat_template_file_serves_tools_given_in_python(zoo, tmp_path):
    """The same file with tools given in Python: the template is then used, and accepted (a model
    with room for the prompt the template writes, its tools listed: ~470 tokens)."""
    import toy_envs
    from ppo_rlhf.envs.options import tool_template_path
    from test_default_learning import users_tiny_model

    users_tiny_model(tmp_path / "model", arch="qwen2", positions=1024)
    config = game_config({"qwen2": tmp_path / "model"}, tmp_path, chat_template_file=str(tool_template_path()),
                         max_length=600)
    trainer = PPOTrainer(config, reward=lambda prompts, responses, **columns: [0.0] * len(responses),
                         tools=[toy_envs.add])
    assert trainer.config.tool == [TOOL] and trainer.config.chat_template is True


def test_sapo_records_no_clip_range_and_a_clip_range_given_with_it_is_refused(tmp_path):
    assert build_config(PPOConfig, {"task": "doubling", "policy_loss": "sapo"}).clip_ratio is None
    assert build_config(PPOConfig, {"task": "doubling"}).clip_ratio == 0.2
    with pytest.raises(ConfigError, match="'clip_ratio'.*--policy-loss sapo"):
        PPOTrainer(PPOConfig(task="doubling", policy_loss="sapo", clip_ratio=0.2, out=str(tmp_path / "o")))


def test_a_tool_that_changes_its_arguments_leaves_the_record_as_the_model_wrote_it():
    from ppo_rlhf.envs.calls import EnvironmentCalls
    from ppo_rlhf.envs.parsers import ToolCall
    from ppo_rlhf.envs.tools import ToolBox

    def append_one(items: list) -> int:
        """Appends 1 to the list and returns its length.

        Args:
            items: a list of numbers
        """
        items.append(1)
        return len(items)

    call = ToolCall(name="append_one", arguments={"items": [5, 6]}, text="")
    calls = EnvironmentCalls(workers=1)
    answer = calls.run(ToolBox([append_one], timeout=5.0).answer(call, calls))
    assert answer.message["content"] == "3" and call.arguments == {"items": [5, 6]}


# Python and start-time cases of the classes above, counted with the table.
PYTHON_CASES = {
    "record: an environment given in Python recorded by import path, another class on resume, no import path "
    "on resume, no import path asked for again, an environment given twice": 5,
    "options: --no-chat-template with an environment from Python, an unused template file from Python, SAPO with "
    "a clip range from Python (and the template file taken where tools given in Python use it)": 4,
    "advice: eval on a failing environment, an optional choice's None listed and refused": 2,
    "record: a tool that changes its arguments": 1,
}


def test_there_are_enough_new_bad_inputs():
    from test_bad_inputs import CASES as FIRST
    from test_bad_inputs_more import CASES as MORE
    from test_bad_inputs_second import CASES as SECOND

    ids = [case.id for case in CASES]
    assert len(set(ids)) == len(ids) and not set(ids) & {case.id for case in FIRST + MORE + SECOND}
    assert len(ids) + sum(PYTHON_CASES.values()) >= 25
