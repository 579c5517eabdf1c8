"""The chat templates of the models people train, across an episode's turns (docs/agents.md, "Chat
templates"): Qwen3's, GPT-OSS's, Llama 3's JSON calls, tool-call tags that are special tokens,
SentencePiece's prefix space -- each on a tokenizer trained here carrying that family's template
(tests/zoo.py, ``family_tokenizer``) -- and the checks that run at start, before any model loads."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.envs import environment_source
from ppo_rlhf.envs.chat import ChatContinuation, TemplateProblem, prepare_episode_chat, qwen3_training_template_path
from ppo_rlhf.envs.parsers import ResponseTemplateParser, parse_gpt_oss, parse_hermes, parse_llama3_json
from ppo_rlhf.rollout.episodes import EpisodeLimits, roll_out
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from toy_envs import add
from zoo import QWEN3_TEMPLATE, REWARDS_MODULE, Scripted, family_tokenizer, write_jsonl

TOOL_ANSWER = [{"role": "tool", "name": "add", "content": "3"}]


@pytest.fixture(scope="module")
def model(zoo):
    """Any tiny model: the Scripted generator writes the turns, the runner only reads its device."""
    return AutoModelForCausalLM.from_pretrained(zoo["qwen2"])


def prepared(tokenizer, tool_parser="auto"):
    source = environment_source(tools=[add], tool_parser=tool_parser)
    prepare_episode_chat(tokenizer, source, "the chat template of the zoo model")
    return source


def play(model, tokenizer, turns: list[str], stop: int, source, max_turns: int = 3):
    """One episode whose model turns are ``turns`` (text, each ended by ``stop``)."""
    ids = [[tokenizer(text, add_special_tokens=False)["input_ids"] + [stop]] for text in turns]
    generator = Scripted(ids, [stop], tokenizer.pad_token_id)
    episodes = roll_out(model, tokenizer, generator, [{"prompt": "1 + 2?"}], ["1 + 2?"],
                        EpisodeLimits(2000, 3000, max_turns=max_turns, chat_template=True), source)
    return episodes, generator


# ---------------------------------------------------------------- Qwen3
def test_qwen3s_template_is_swapped_for_the_training_template_that_keeps_earlier_turns(model):
    tokenizer = family_tokenizer("qwen3")
    # Qwen3's own template writes the empty think block only while the assistant turn is last:
    # an episode could not continue from what the model wrote.
    with pytest.raises(TemplateProblem, match="renders an assistant turn differently"):
        ChatContinuation(tokenizer, None).ids(TOOL_ANSWER, tokenizer.eos_token_id, stopped=True)
    source = prepared(tokenizer)
    assert source.chat_template == qwen3_training_template_path().read_text()
    assert "Qwen3's writes a turn's think block only while the turn is last" in source.notes[0]
    assert source.parser is parse_hermes and tokenizer.chat_template == QWEN3_TEMPLATE  # the tokenizer's own is kept
    stop = tokenizer.eos_token_id
    episodes, generator = play(model, tokenizer, ['<think>\n\n</think>\n\n<tool_call>\n{"name": "add", "arguments": '
                                                  '{"a": 1, "b": 2}}\n</tool_call>', "It is 3."], stop, source)
    assert episodes.conversations[0][1] == {"role": "tool", "name": "add", "content": "3"}
    answer = tokenizer.decode(generator.contexts[1][0][len(generator.contexts[0][0]):])
    assert answer.endswith("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n")


def test_a_template_that_rewrites_earlier_turns_is_refused_at_start_naming_it_and_the_fix():
    tokenizer = family_tokenizer("qwen3")
    tokenizer.chat_template = QWEN3_TEMPLATE.replace("last_query_index", "last_question")  # not Qwen3's any more
    with pytest.raises(ConfigError, match="the chat template of the zoo model renders an assistant turn differently"
                                          ".*--chat-template-file.*qwen3_training.jinja"):
        prepared(tokenizer)


def test_the_template_checks_run_before_any_model_loads(zoo, tmp_path, monkeypatch):
    folder = tmp_path / "model"
    tokenizer = AutoTokenizer.from_pretrained(zoo["qwen2"])
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no turn ends at all
    tokenizer.save_pretrained(folder)
    AutoModelForCausalLM.from_pretrained(zoo["qwen2"]).save_pretrained(folder)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the chat template was checked")

    monkeypatch.setattr("ppo_rlhf.trainers.roles.load_causal_lm", no_model)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}] * 4)
    config = build_config(PPOConfig, {"model": str(folder), "prompts": str(prompts), "tool": ["toy_envs:add"],
                                      "reward_fn": [f"{REWARDS_MODULE}:length_score"],
                                      "out": str(tmp_path / "run"), "batch_size": 4, "mini_batch_size": 4})
    with pytest.raises(ConfigError, match=f"the chat template of {folder} does not list the tools"):
        PPOTrainer(config)


# ---------------------------------------------------------------- GPT-OSS
def test_gpt_oss_tool_answers_follow_a_stand_in_turn_that_made_the_call(model):
    tokenizer = family_tokenizer("gpt_oss")
    source = prepared(tokenizer)
    assert source.parser is parse_gpt_oss
    call, stop = tokenizer.convert_tokens_to_ids("<|call|>"), tokenizer.convert_tokens_to_ids("<|return|>")
    ids = [[tokenizer('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1, "b": 2}',
                      add_special_tokens=False)["input_ids"] + [call]],
           [tokenizer("<|channel|>final<|message|>3", add_special_tokens=False)["input_ids"] + [stop]]]
    generator = Scripted(ids, [stop, call], tokenizer.pad_token_id)
    episodes = roll_out(model, tokenizer, generator, [{"prompt": "1 + 2?"}], ["1 + 2?"],
                        EpisodeLimits(2000, 3000, max_turns=3, chat_template=True), source)
    assert episodes.conversations[0][0]["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    answer = tokenizer.decode(generator.contexts[1][0][len(generator.contexts[0][0]) + len(ids[0][0]):])
    assert answer == '<|start|>functions.add to=assistant<|channel|>commentary<|message|>"3"<|end|><|start|>assistant'


# ---------------------------------------------------------------- Llama 3
def test_llama3_json_calls_are_read_by_the_parser_auto_chooses(model):
    tokenizer = family_tokenizer("llama3")
    source = prepared(tokenizer)
    assert source.parser is parse_llama3_json and source.parser_name == "auto: llama3-json"
    episodes, generator = play(model, tokenizer, ['{"name": "add", "parameters": {"a": 1, "b": 2}}', "It is 3."],
                               tokenizer.convert_tokens_to_ids("<|eot_id|>"), source)
    assert episodes.conversations[0][:2] == [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
        {"role": "tool", "name": "add", "content": "3"}]
    answer = tokenizer.decode(generator.contexts[1][0][len(generator.contexts[0][0]):])
    assert answer.endswith("<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n3<|eot_id|>"
                           "<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("text, expected", [
    ('{"name": "add", "parameters": {"a": 1}}', [("add", {"a": 1}, None)]),
    ('<|python_tag|>{"name": "add", "arguments": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}',
     [("add", {"a": 1}, None), ("add", {"a": 2}, None)]),
    ('{"name": "add", "parameters": {"a": 1', [(None, {}, "not valid JSON")]),
    ("It is 3.", []),
], ids=["one", "two-tagged", "broken", "an-answer"])
def test_llama3_json_calls(text, expected):
    calls = parse_llama3_json(text)
    assert [(c.name, c.arguments, c.error and expected[i][2]) for i, c in enumerate(calls)] == [
        (name, arguments, error) for name, arguments, error in expected]
    assert all(expected[i][2] in c.error for i, c in enumerate(calls) if c.error)


def test_a_template_auto_cannot_read_is_refused_naming_the_parsers(zoo):
    tokenizer = AutoTokenizer.from_pretrained(zoo["qwen2"])
    tokenizer.chat_template = (tokenizer.chat_template.replace("{% for m in messages %}",
                                                               "{% for t in tools or [] %}{{ t | tojson }}{% endfor %}"
                                                               "{% for m in messages %}"))
    with pytest.raises(ConfigError, match="--tool-parser auto cannot tell.*--tool-parser hermes / llama3-json / "
                                          "gpt-oss"):
        prepared(tokenizer)


def test_a_tokenizers_response_template_is_what_auto_reads_calls_with(monkeypatch):
    tokenizer = family_tokenizer("qwen3")
    tokenizer.response_template = {"stand-in": "a response template of the tokenizer's own"}
    seen = {}

    def parse_response(text, prefix=None, tools=None):
        seen.update(text=text, prefix=prefix, tools=tools)
        return {"role": "assistant", "content": "let me add",
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}

    monkeypatch.setattr(tokenizer, "parse_response", parse_response, raising=False)
    source = prepared(tokenizer)
    assert isinstance(source.parser, ResponseTemplateParser)
    content, calls = source.parser.read("let me add <call>", prefix="<|im_start|>assistant\n")
    assert (content, [(c.name, c.arguments) for c in calls]) == ("let me add", [("add", {"a": 1, "b": 2})])
    assert seen["prefix"] == "<|im_start|>assistant\n" and seen["tools"][0]["function"]["name"] == "add"


# ---------------------------------------------------------------- special tokens, SentencePiece
def test_tool_call_tags_that_are_special_tokens_are_read(model):
    tokenizer = family_tokenizer("special_tags")
    assert tokenizer.convert_ids_to_tokens(tokenizer("<tool_call>", add_special_tokens=False)["input_ids"]) == [
        "<tool_call>"]
    source = prepared(tokenizer)
    episodes, _ = play(model, tokenizer, ['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
                                          "It is 3."], tokenizer.eos_token_id, source)
    # decode(..., skip_special_tokens=True) would have dropped the tags: no call, the episode over.
    assert episodes.turns == [2] and episodes.conversations[0][1]["content"] == "3"
    assert episodes.stats["calls"] == 1 and not episodes.stats["errors"]


def test_environment_text_gets_no_stray_prefix_space_on_a_sentencepiece_tokenizer():
    tokenizer = family_tokenizer("sentencepiece")
    continuation = ChatContinuation(tokenizer, None)
    answer = [{"role": "user", "content": "again"}]
    ids = continuation.ids(answer, tokenizer.eos_token_id, stopped=True)
    text = "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    alone = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(alone)[0] == "▁"  # what tokenizing the text on its own would add
    assert tokenizer.convert_ids_to_tokens(ids)[0] == "\n" and ids == alone[1:]
    assert tokenizer.decode(ids) == text
