"""What a TRL program relies on, on every path of this project (issue 58): reward functions get the
run's ``trainer_state`` and TRL's ``log_metric`` / ``log_extra``; prompts may be data sets in
memory (Dataset, IterableDataset, DatasetDict) and be drawn in order; the chat template renders
with ``chat_template_kwargs``; tool arguments are cast to the tool's schema and a think block is
the turn's ``reasoning_content``, as TRL 1.16 reads a turn."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset
from transformers import AutoTokenizer, TrainerState

from ppo_rlhf import ConfigError, PPOConfig, PPOTrainer
from ppo_rlhf.envs.options import apply_chat_template_kwargs
from ppo_rlhf.envs.parsers import ToolCall, assistant_message, split_reasoning, typed_call
from ppo_rlhf.rollout.reward import CombinedReward, FunctionReward, RewardError, ScoringBatch
from ppo_rlhf.rollout.sequences import Sequences
from zoo import PROMPTS, CallsFirst, family_model

BUDGET = {"batch_size": 4, "mini_batch_size": 4, "ppo_epochs": 1, "max_new_tokens": 4, "max_length": 32,
          "save_every": 0, "eval_every": 0, "sample_every": 1, "num_threads": 1, "report_to": "none"}


def batch_of(rows: list[dict]) -> ScoringBatch:
    ids = torch.ones(len(rows), 3, dtype=torch.long)
    return ScoringBatch(rows, [row["prompt"] for row in rows], ["a"] * len(rows), [True] * len(rows),
                        Sequences(ids, ids, ids, ids))


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---------------------------------------------------------------- trainer_state, log_metric, log_extra
def test_a_trl_reward_function_gets_the_state_and_its_loggers():
    seen = {}

    def shaped(completions, trainer_state, log_metric, log_extra, **kwargs):
        seen["state"] = trainer_state
        log_metric("length", 2.0)
        log_metric("length", 4.0)
        log_extra("note", [f"n{i}" for i in range(len(completions))])
        return [1.0] * len(completions)

    reward = CombinedReward([FunctionReward(shaped)])
    state = TrainerState(max_steps=7)
    reward.follow_run(state)
    reward(batch_of([{"prompt": "a"}, {"prompt": "b"}]))
    assert seen["state"] is state
    assert reward.logged_metrics() == {"length": (6.0, 2)} and reward.last_extra == {"note": ["n0", "n1"]}
    reward.new_iteration()
    assert reward.logged_metrics() == {}


def test_log_metric_takes_one_finite_number():
    def logs_text(completions, log_metric, **kwargs):
        log_metric("length", "long")
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match="logs_text called log_metric.*'long'.*one finite number"):
        FunctionReward(logs_text)(batch_of([{"prompt": "a"}]))


STEPS = []


def stepwise(completions, trainer_state, log_metric, log_extra, **kwargs):
    """A reward shaped by the run's progress, as TRL's docs show: it reads trainer_state."""
    STEPS.append((trainer_state.global_step, trainer_state.max_steps))
    log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
    log_extra("step_seen", [trainer_state.global_step] * len(completions))
    return [float(len(c)) for c in completions]


def test_a_run_moves_the_state_and_logs_what_its_rewards_log(zoo, tmp_path):
    STEPS.clear()
    config = PPOConfig(model=str(zoo["llama"]), prompts=str(zoo["prompts"]), eval_prompts=str(zoo["prompts"]),
                       eval_size=2, eval_sampled=False, out=str(tmp_path / "run"), iterations=2, save_rollouts=1,
                       **BUDGET)
    PPOTrainer(config, reward=stepwise).train()
    training = [step for step in STEPS if step[1] == 2]
    assert (0, 2) in training and (1, 2) in training  # the iterations done when each batch was scored
    metrics = lines(tmp_path / "run" / "metrics.jsonl")
    assert [m["progress"] for m in metrics if "progress" in m] == [0.0, 0.5]
    assert "eval/progress" in metrics[-1]  # logged while scoring the held-out prompts too
    assert {sample["step_seen"] for sample in lines(tmp_path / "run" / "samples.jsonl")} == {0, 1}
    rollouts = lines(tmp_path / "run" / "rollouts" / "iteration_0002.jsonl")
    assert all(record["logged"] == {"step_seen": 1} for record in rollouts)


# ---------------------------------------------------------------- data sets in memory
SEEN_PROMPTS = []


def remember_prompts(prompts, responses):
    SEEN_PROMPTS.extend(prompts)
    return [1.0] * len(prompts)


def test_prompts_may_be_a_data_set_in_memory_and_the_config_records_it(zoo, tmp_path):
    dataset = Dataset.from_dict({"prompt": PROMPTS, "answer": list(range(len(PROMPTS)))})
    config = PPOConfig(model=str(zoo["llama"]), prompts=dataset, out=str(tmp_path / "run"), iterations=1, **BUDGET)
    assert config.prompts == "<in-memory Dataset: 6 rows, columns prompt, answer>"
    PPOTrainer(config, reward=remember_prompts).train()
    assert "<in-memory Dataset: 6 rows" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_streamed_data_set_is_read_in_order_and_only_as_far_as_the_run_draws(zoo, tmp_path):
    read = []

    def rows():
        for i in range(1000):
            read.append(i)
            yield {"prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}"}

    SEEN_PROMPTS.clear()
    config = PPOConfig(model=str(zoo["llama"]), prompts=IterableDataset.from_generator(rows), prompt_order="in-order",
                       out=str(tmp_path / "run"), iterations=2, **{**BUDGET, "batch_size": 2, "mini_batch_size": 2})
    PPOTrainer(config, reward=remember_prompts).train()
    assert [p.rsplit(" ", 1)[1] for p in SEEN_PROMPTS] == ["0", "1", "2", "3"]
    assert max(read) < 10  # the 4 rows two iterations draw (and what the generator's buffer reads ahead)


def test_a_data_set_dict_gives_its_split_and_a_missing_split_is_named(zoo, tmp_path):
    splits = DatasetDict({"train": Dataset.from_dict({"prompt": PROMPTS}),
                          "test": Dataset.from_dict({"prompt": PROMPTS[:2]})})
    config = PPOConfig(model=str(zoo["llama"]), prompts=splits, eval_prompts=splits, eval_sampled=False,
                       out=str(tmp_path / "run"), iterations=1, **BUDGET)
    summary = PPOTrainer(config, reward=remember_prompts).train()
    assert summary["after"]  # the held-out split was evaluated
    config = PPOConfig(model=str(zoo["llama"]), prompts=splits, data_split="validation", out=str(tmp_path / "other"),
                       iterations=1, **BUDGET)
    with pytest.raises(ValueError, match="DatasetDict given has no split 'validation' \\(its splits: train, test\\)"):
        PPOTrainer(config, reward=remember_prompts).train()


def test_in_order_draws_take_the_rows_in_turn_and_wrap_around(zoo, tmp_path):
    SEEN_PROMPTS.clear()
    config = PPOConfig(model=str(zoo["llama"]), prompts=str(zoo["prompts"]), prompt_order="in-order",
                       out=str(tmp_path / "run"), iterations=2, **BUDGET)
    PPOTrainer(config, reward=remember_prompts).train()
    assert SEEN_PROMPTS == [PROMPTS[i % 6] for i in range(8)]


# ---------------------------------------------------------------- chat_template_kwargs
FLAVOURED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
             "enable_thinking is false %}(no thinking){% endif %}{% endif %}")


def test_chat_template_kwargs_reach_every_rendering(zoo, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(zoo["qwen2"])
    apply_chat_template_kwargs(tokenizer, {"enable_thinking": False})
    question = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(question, chat_template=FLAVOURED, tokenize=False,
                                         add_generation_prompt=True).endswith("(no thinking)")
    template = tmp_path / "flavoured.jinja"
    template.write_text(FLAVOURED)
    config = PPOConfig(model=str(zoo["qwen2"]), prompts=str(zoo["chat"]), chat_template=True,
                       chat_template_file=str(template), chat_template_kwargs="enable_thinking=false",
                       out=str(tmp_path / "run"), iterations=1, save_rollouts=1, **BUDGET)
    PPOTrainer(config, reward=remember_prompts).train()
    record = lines(tmp_path / "run" / "rollouts" / "iteration_0001.jsonl")[0]
    assert tokenizer.decode(record["prompt_ids"]).endswith("(no thinking)")


def test_malformed_chat_template_kwargs_are_refused():
    with pytest.raises(ConfigError, match="'chat_template_kwargs'.*key=value"):
        PPOConfig(chat_template_kwargs="enable_thinking")


# ---------------------------------------------------------------- a turn read as TRL reads it
SCHEMA = [{"type": "function", "function": {"name": "increment", "parameters": {"type": "object", "properties": {
    "step": {"type": "integer"}, "label": {"type": "string"}, "scale": {"type": "number", "nullable": True},
    "flags": {"type": "array"}}}}}]


@pytest.mark.parametrize("written, cast", [
    ({"step": "3"}, {"step": 3}), ({"step": "3.0"}, {"step": 3}), ({"step": "three"}, {"step": "three"}),
    ({"label": "7"}, {"label": "7"}), ({"scale": "0.5"}, {"scale": 0.5}), ({"scale": "null"}, {"scale": None}),
    ({"flags": "[1, 2]"}, {"flags": [1, 2]}), ({"step": 4}, {"step": 4}), ({"other": "1"}, {"other": "1"})])
def test_tool_arguments_are_cast_to_the_tools_schema_as_trl_casts_them(written, cast):
    assert typed_call(ToolCall("increment", written), SCHEMA).arguments == cast
    assert typed_call(ToolCall("unknown", written), SCHEMA).arguments == written


def test_a_think_block_is_the_turns_reasoning_content():
    assert split_reasoning("<think>\nadd three\n</think>\n\nDone.") == ("add three", "Done.")
    assert split_reasoning("<think>\n\n</think>\n\nDone.") == (None, "Done.")  # enable_thinking=False's empty block
    assert split_reasoning("Done. <think>late</think>") == (None, "Done. <think>late</think>")
    call = ToolCall("increment", {"step": 3})
    assert assistant_message("<think>\nadd three\n</think>\n\n", [call]) == {
        "role": "assistant", "content": "", "reasoning_content": "add three",
        "tool_calls": [{"type": "function", "function": {"name": "increment", "arguments": {"step": 3}}}]}


class Counter:
    """TRL's environment shape: its tool adds an int, so a step written as text would fail."""

    def reset(self, **kwargs) -> None:
        self.counter = 0

    def get_reward(self) -> float:
        return float(self.counter)

    def increment(self, step: int) -> int:
        """
        Increment the counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The counter.
        """
        self.counter += step
        return self.counter


COMPLETIONS = []


def completions_seen(completions, environments, **kwargs):
    COMPLETIONS.extend(completions)
    return [0.0] * len(completions)


def test_an_episode_gives_reward_functions_typed_calls_and_the_think_block_apart(tmp_path):
    folder = family_model("qwen3", tmp_path / "qwen3")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    call = ('<think>\nadd three\n</think>\n\n<tool_call>\n{"name": "increment", "arguments": {"step": "3"}}\n'
            '</tool_call>')
    config = PPOConfig(model=str(folder), prompts=[{"prompt": [{"role": "user", "content": "count"}]}] * 2,
                       out=str(tmp_path / "run"), iterations=1, estimator="grpo", samples_per_prompt=2,
                       max_turns=2, save_rollouts=1, **{**BUDGET, "max_new_tokens": 40, "max_length": 1024})
    COMPLETIONS.clear()
    PPOTrainer(config, reward=completions_seen, environment=Counter, model=model, tokenizer=tokenizer,
               generator=CallsFirst(tokenizer, call)).train()
    first = COMPLETIONS[0][0]
    assert first["reasoning_content"] == "add three" and first["content"] == ""
    assert first["tool_calls"][0]["function"]["arguments"] == {"step": 3}  # cast as TRL casts it
    assert COMPLETIONS[0][1]["content"] == "3"  # the tool added an int
    assert all(record["episode_reward"] == 3.0 for record in lines(tmp_path / "run" / "rollouts" /
                                                                   "iteration_0001.jsonl"))
