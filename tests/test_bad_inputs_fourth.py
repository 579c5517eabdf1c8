"""Bad inputs, fourth pass (issue 57: the new paths -- teachers, judges, templates, tool parsers),
none of them in the four earlier files; pass@k's preconditions are tested beside pass@k
(tests/test_pass_at_k.py).

The same rules as there: a refusal is exit 2 (a ConfigError, ModelError or RewardError from
Python), no traceback, and a message naming the culprit and a fix that works; each checked at start
(the config built, the trainer constructed), never mid-run, where the input alone can tell.  The
classes, each fixed where it starts (docs/robustness.md):

- a teacher that is not a language model, or is the student itself: a critic or reward adapter
  taken with --lora as "an adapter on the shared base", --teacher equal to --model;
- shapes checked at start: a teacher with fewer positions than --max-length, a local judge whose
  positions cannot hold its own template, an empty --chat-template-file, ``tools=`` given one
  function; and named where they can only break mid-run: a judge input longer than the judge's
  context, a tool's value that cannot be written as text;
- template advice that can work: the fix for the problem found, and only templates the tokenizer
  can run offered; a --tool-parser that reads another family's calls than the template teaches;
- a run folder where a model folder is expected, named with the model inside it whichever file of
  it is read first (its tokenizer: --teacher, rm --model, episodes' early template checks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from ppo_rlhf import ConfigError, PPOConfig, PPOTrainer
from ppo_rlhf.envs import environment_source
from ppo_rlhf.envs.calls import EnvironmentCalls
from ppo_rlhf.envs.chat import prepare_episode_chat
from ppo_rlhf.envs.options import tool_template_path
from ppo_rlhf.envs.parsers import ToolCall
from ppo_rlhf.envs.tools import ToolBox
from ppo_rlhf.models import load_tokenizer
from ppo_rlhf.rollout.reward import RewardError
from test_bad_inputs import (  # noqa: F401 -- broken is a fixture the cases use
    PAIR, PROMPT, Bad, assert_refused, broken, evaluate, fill, ppo, rm_pairs, rows, write_files,
)
from test_bad_inputs_second import folders, places_for  # noqa: F401 -- folders is a fixture the cases use
from toy_envs import add

PROMPTS_FILE = {"data.jsonl": rows(PROMPT)}
TOOL = "toy_envs:add"


def ppo_on(*extra):
    """ppo on a chat model (the episodes' checks need a chat template)."""
    return [("{qwen2}" if a == "{llama}" else a) for a in ppo(*extra)]


def ppo_of(model: str, *extra):
    return [(model if a == "{llama}" else a) for a in ppo(*extra)]


CASES = [
    # ------------------------------------------------------------ a teacher is a language model other than the student
    Bad("ppo-lora-teacher-a-critic-adapter", ppo("--lora", "--teacher", "{critic_adapter}"),
        ("--teacher", "{critic_adapter}", "critic", "neither writes nor scores answers"), PROMPTS_FILE),
    Bad("ppo-lora-teacher-a-reward-adapter", ppo("--lora", "--teacher", "{reward_adapter}"),
        ("--teacher {reward_adapter}", "reward adapter", "no log-probs of tokens"), PROMPTS_FILE),
    Bad("ppo-teacher-the-student-itself", ppo("--teacher", "{llama}"),
        ("'teacher'", "{llama}", "the student itself", "nothing to distil"), PROMPTS_FILE),
    Bad("ppo-lora-teacher-the-students-base", ppo("--lora", "--teacher", "{llama}"),
        ("'teacher'", "the student itself"), PROMPTS_FILE),
    # ------------------------------------------------------------ shapes checked at start
    Bad("ppo-teacher-with-fewer-positions-than-max-length", ppo_of("{gpt2}", "--teacher", "{short_positions}"),
        ("--teacher {short_positions}", "16 positions", "--max-length 32"), PROMPTS_FILE),
    Bad("ppo-local-judge-shorter-than-its-template", ppo("--reward-judge", "{short_positions}"),
        ("--reward-judge {short_positions}", "16 positions", "the judge's default template", "longer context"),
        PROMPTS_FILE),
    Bad("ppo-empty-chat-template-file", ppo_on("--chat-template", "--chat-template-file", "{tmp}/t.jinja"),
        ("'chat_template_file'", "t.jinja", "the file is empty"), {**PROMPTS_FILE, "t.jinja": ""}),
    Bad("eval-blank-chat-template-file", [("{qwen2}" if a == "{llama}" else a) for a in evaluate(
        "--chat-template", "--chat-template-file", "{tmp}/t.jinja")],
        ("'chat_template_file'", "the file is empty"), {**PROMPTS_FILE, "t.jinja": "\n  \n"}),
    Bad("ppo-chat-template-file-without-the-question",
        ppo_on("--chat-template", "--chat-template-file", "{tmp}/t.jinja"),
        ("'chat_template_file'", "leaves a user's question out"),
        {**PROMPTS_FILE, "t.jinja": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n<|im_end|>{% endfor %}"}),
    # ------------------------------------------------------------ advice that can work
    Bad("ppo-tool-parser-of-another-family-than-the-template",
        ppo_on("--tool", TOOL, "--chat-template-file", "{tool_template}", "--tool-parser", "llama3-json"),
        ("'tool_parser'", "'llama3-json'", "teaches hermes tool calls", "--tool-parser hermes"), PROMPTS_FILE),
    Bad("ppo-chatml-template-on-a-tokenizer-without-its-end-token",
        ppo("--tool", TOOL, "--chat-template-file", "{tool_template}"),
        ("ends an assistant turn with no token the tokenizer marks as special",
         "ends each assistant turn with a token the tokenizer marks as special", "do not run on this tokenizer"),
        PROMPTS_FILE),
    # ------------------------------------------------------------ a run folder named with the model inside it
    Bad("ppo-teacher-a-run-folder", ppo("--teacher", "{sft_run}"),
        ("--teacher", "{sft_run}", "run folder", "checkpoints/sft"), PROMPTS_FILE),
    Bad("rm-model-a-run-folder", rm_pairs("--model", "{sft_run}"),
        ("--model", "{sft_run}", "run folder", "checkpoints/sft"), {"data.jsonl": rows(PAIR)}),
    Bad("ppo-model-a-run-folder-with-tools", ppo("--model", "{ppo_run}", "--tool", TOOL),
        ("{ppo_run}", "run folder", "checkpoints/actor"), PROMPTS_FILE),
    Bad("eval-model-a-run-folder-with-tools", evaluate("--model", "{ppo_run}", "--tool", TOOL),
        ("{ppo_run}", "run folder", "checkpoints/actor"), PROMPTS_FILE),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_input_is_named_and_stops_the_run(case: Bad, zoo, broken, folders, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    places = {**places_for(zoo, broken, folders, tmp_path), "tool_template": str(tool_template_path())}
    write_files(tmp_path, case.files)
    assert_refused([fill(a, places) for a in case.args], case.expect, places, capsys)
    assert not (tmp_path / "out" / "checkpoints").exists()  # refused at start: nothing trained or saved


# ---------------------------------------------------------------- from Python, and what only the run can show
def test_a_single_function_as_tools_is_named_with_the_list_that_holds_it(zoo, tmp_path):
    """It ended in TypeError: 'function' object is not iterable, before the check that names it."""
    config = PPOConfig(model=str(zoo["qwen2"]), prompts=str(zoo["prompts"]), out=str(tmp_path / "run"),
                       reward_fn=[f"{__import__('zoo').REWARDS_MODULE}:length_score"])
    with pytest.raises(ConfigError, match=r"tools must be a list of functions, got a function.*tools=\[add\]"):
        PPOTrainer(config, tools=add)


class Unprintable:
    def __str__(self):
        raise ValueError("no text")


def unprintable(a: int) -> int:
    """Answers with a value that cannot be written as text.

    Args:
        a: a number
    """
    return Unprintable()


def test_a_tools_value_that_cannot_be_written_as_text_is_its_error_naming_it():
    """The value's ValueError escaped the tool's answer, named as the environment's step."""
    calls = EnvironmentCalls(workers=1)
    answer = calls.run(ToolBox([unprintable], timeout=5.0).answer(ToolCall("unprintable", {"a": 1}), calls))
    assert answer.outcome == "error"
    assert answer.message["content"] == ("Error: unprintable returned a value (Unprintable) that cannot be written as "
                                         "text (ValueError: no text)")


def test_the_template_advice_gives_the_fix_for_the_problem_found_and_no_template_that_fails_in_turn(zoo):
    """A turn that ends with no special token was told to "write earlier turns the same whatever follows
    them" and offered the shipped ChatML template, refused in its turn on a tokenizer without <|im_end|>."""
    tokenizer = load_tokenizer(zoo["llama"])  # <s> and </s> are its only special tokens
    tokenizer.chat_template = tool_template_path().read_text()
    source = environment_source(tools=[add])
    with pytest.raises(ConfigError) as refused:
        prepare_episode_chat(tokenizer, source, "the chat template of the zoo model")
    message = str(refused.value)
    assert "ends an assistant turn with no token the tokenizer marks as special" in message
    assert "ends each assistant turn with a token the tokenizer marks as special (its EOS token '</s>'" in message
    assert "writes earlier turns the same" not in message and str(tool_template_path()) not in message
    # On a tokenizer that marks <|im_end|> as special, the shipped templates are offered.
    chatml = load_tokenizer(zoo["qwen2"])
    chatml.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # lists no tools
    with pytest.raises(ConfigError, match=f"does not list the tools.*{tool_template_path()}"):
        prepare_episode_chat(chatml, environment_source(tools=[add]), "the chat template of the zoo model")


def test_a_local_judge_input_past_its_context_is_refused_naming_the_judge(zoo, tmp_path):
    """The template fits the judge; a prompt and response that do not were an IndexError of its
    position embeddings mid-run."""
    from ppo_rlhf.rollout.judge import JudgeScore, JudgeTemplate, LocalJudge

    judge_folder = tmp_path / "judge"
    torch.manual_seed(0)
    tokenizer = load_tokenizer(zoo["gpt2"])
    AutoModelForCausalLM.from_config(GPT2Config(vocab_size=len(tokenizer), n_embd=16, n_layer=1, n_head=2,
                                                n_positions=24)).save_pretrained(judge_folder)
    tokenizer.save_pretrained(judge_folder)
    template = tmp_path / "judge.jinja"
    template.write_text("Rate: {{ response }}")
    score = JudgeScore.parse("number:0:10")
    judge = LocalJudge(str(judge_folder), JudgeTemplate(str(template), score), score, max_new_tokens=4)
    judge.load()  # the template and the answer fit in 24 positions
    with pytest.raises(RewardError, match=f"the judge {judge_folder} has 24 positions, but its input for a response "
                                          f"here is [0-9]+ tokens and its answer up to 4 more"):
        judge.judge_all(["Rate: " + "the cat sat on the mat " * 8])
    # Its answer alone past its positions: refused at start.
    with pytest.raises(ConfigError, match="has 24 positions.*its answer up to 30 more"):
        LocalJudge(str(judge_folder), JudgeTemplate(str(template), score), score, max_new_tokens=30).load()


# Python cases of the classes above, counted with the table.
PYTHON_CASES = {
    "shapes: tools= one function, a tool's value without text, a judge input past its context, a judge answer "
    "past it": 4,
    "advice: the fix for a turn without a special end, and only runnable templates offered": 2,
}


def test_there_are_enough_new_bad_inputs():
    from test_bad_inputs import CASES as FIRST
    from test_bad_inputs_more import CASES as MORE
    from test_bad_inputs_second import CASES as SECOND
    from test_bad_inputs_third import CASES as THIRD

    ids = [case.id for case in CASES]
    assert len(set(ids)) == len(ids) and not set(ids) & {case.id for case in FIRST + MORE + SECOND + THIRD}
    assert len(ids) + sum(PYTHON_CASES.values()) >= 20
