"""ppo_rlhf.trl (issue 58): TRL's configs and trainers over this project's PPO trainer -- TRL's
fields and defaults, its batch arithmetic, every field's fate (docs/migrating_from_trl.md's table
is the code's), the refusals at construction (a field without a counterpart, a data set without
its column, vLLM missing or in server mode, a peft config that is not LoRA), TRL's metric names,
callbacks, save_model and push_to_hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from ppo_rlhf.config import ConfigError
from ppo_rlhf.trl import GRPOConfig, GRPOTrainer, PPOConfig, RLOOConfig, RLOOTrainer
from ppo_rlhf.trl.fields import REFUSED, fates_of, tables
from ppo_rlhf.trl.translate import online_settings, ppo_settings
from zoo import PROMPTS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "migrating_from_trl.md"
CHAT = [[{"role": "user", "content": p}] for p in PROMPTS]


def grpo_args(tmp_path, **fields) -> GRPOConfig:
    values = dict(output_dir=str(tmp_path / "run"), num_generations=2, per_device_train_batch_size=4,
                  max_completion_length=4, max_steps=1, report_to="none", gradient_checkpointing=False)
    return GRPOConfig(**{**values, **fields})


def length(completions, **kwargs):
    return [float(len(c[0]["content"])) for c in completions]


# ---------------------------------------------------------------- TRL's fields and what they become
def test_the_configs_have_trls_defaults():
    grpo, rloo, ppo = GRPOConfig(), RLOOConfig(), PPOConfig()
    assert (grpo.beta, grpo.num_generations, grpo.loss_type, grpo.scale_rewards, grpo.learning_rate,
            grpo.max_completion_length, grpo.vllm_mode, grpo.disable_dropout) == (0.0, 8, "dapo", "group", 1e-6, 512,
                                                                                  "colocate", False)
    assert (rloo.beta, rloo.num_generations) == (0.05, 2)
    assert (ppo.kl_coef, ppo.lam, ppo.cliprange, ppo.vf_coef, ppo.temperature, ppo.response_length,
            ppo.learning_rate, ppo.num_ppo_epochs, ppo.stop_token) == (0.05, 0.95, 0.2, 0.1, 0.7, 53, 3e-6, 4, None)


@pytest.mark.parametrize("config_class", [PPOConfig, GRPOConfig, RLOOConfig], ids=lambda c: c.__name__)
def test_every_field_has_a_fate(config_class):
    fates = fates_of(config_class)
    assert fates and all(fate.text for fate in fates.values())


def test_the_migration_guide_holds_the_codes_table():
    text = DOCS.read_text()
    assert tables() in text, "docs/migrating_from_trl.md's field tables differ from ppo_rlhf.trl.fields: paste " \
                             "`python -c 'from ppo_rlhf.trl.fields import tables; print(tables())'`"


def test_trls_batch_arithmetic():
    settings, _ = ppo_settings(PPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                                         num_mini_batches=2, total_episodes=20), prompts=100)
    assert (settings["batch_size"], settings["mini_batch_size"], settings["train_micro_batch_size"],
            settings["iterations"]) == (8, 4, 4, 3)  # ceil(20 / 8)
    args = GRPOConfig(num_generations=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                      steps_per_generation=4, num_iterations=2, max_steps=16)
    settings, _ = online_settings(args, "grpo", prompts=100)
    assert (settings["batch_size"], settings["samples_per_prompt"], settings["mini_batch_size"],
            settings["ppo_epochs"], settings["iterations"]) == (8, 4, 4, 2, 2)  # 16 steps / (4 x 2)
    settings, _ = online_settings(GRPOConfig(num_generations=2, per_device_train_batch_size=4), "grpo", prompts=10)
    assert settings["iterations"] == 15  # 3 epochs x 10 prompts / 2 prompts a generation


@pytest.mark.parametrize("fields, estimator, aggregation, policy_loss", [
    ({}, "grpo", "token-mean", "clip"), ({"loss_type": "grpo"}, "grpo", "sequence-mean", "clip"),
    ({"loss_type": "dr_grpo", "scale_rewards": "none"}, "dr-grpo", "sequence-sum-norm", "clip"),
    ({"scale_rewards": False}, "dr-grpo", "token-mean", "clip"),
    ({"loss_type": "cispo"}, "grpo", "token-mean", "cispo")])
def test_grpos_loss_and_scaling(fields, estimator, aggregation, policy_loss):
    settings, _ = online_settings(GRPOConfig(num_generations=2, per_device_train_batch_size=2, **fields), "grpo", 4)
    assert (settings["estimator"], settings["loss_aggregation"], settings.get("policy_loss", "clip")) == (
        estimator, aggregation, policy_loss)
    assert (settings["kl_in"], settings["kl_estimator"], settings["kl_coef"]) == ("loss", "k3", 0.0)


# ---------------------------------------------------------------- refused at construction
@pytest.mark.parametrize("fields, named", [
    ({"top_p": 0.9}, "GRPOConfig.top_p=0.9: no counterpart in ppo-rlhf"),
    ({"lr_scheduler_type": "cosine"}, "lr_scheduler_type.*learning rate constant"),
    ({"mask_truncated_completions": True}, "mask_truncated_completions.*missing_eos_penalty"),
    ({"scale_rewards": "batch"}, "scale_rewards='batch'.*allowed: group, none"),
    ({"loss_type": "luspo"}, "loss_type='luspo'"),
    ({"vllm_mode": "server"}, "vllm_mode='server'.*not built yet: use vllm_mode='colocate'"),
    ({"push_to_hub": True}, "push_to_hub=True.*offline"),
    ({"model_init_kwargs": {"attn_implementation": "eager"}}, "model_init_kwargs.*attn_implementation")])
def test_a_field_without_a_counterpart_is_refused_by_name(zoo, tmp_path, fields, named):
    with pytest.raises(ConfigError, match=named):
        GRPOTrainer(model=str(zoo["qwen2"]), reward_funcs=length, args=grpo_args(tmp_path, **fields),
                    train_dataset=Dataset.from_dict({"prompt": CHAT}))


def test_use_vllm_without_vllm_says_how_to_install_it(zoo, tmp_path):
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed here (tests/test_vllm_engine.py runs it)")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="use_vllm=True.*vLLM is not installed.*leave use_vllm off"):
        GRPOTrainer(model=str(zoo["qwen2"]), reward_funcs=length, args=grpo_args(tmp_path, use_vllm=True),
                    train_dataset=Dataset.from_dict({"prompt": CHAT}))


def test_a_data_set_without_the_column_the_trainer_reads_is_refused(zoo, tmp_path):
    with pytest.raises(ConfigError, match="train_dataset has no column 'prompt' \\(its columns: question\\).*"
                                          "rename_column"):
        GRPOTrainer(model=str(zoo["qwen2"]), reward_funcs=length, args=grpo_args(tmp_path),
                    train_dataset=Dataset.from_dict({"question": PROMPTS}))


def test_a_peft_config_that_is_not_lora_is_refused(zoo, tmp_path):
    from peft import IA3Config, LoraConfig

    for peft_config, named in [(IA3Config(), "peft_config is a IA3Config: ppo-rlhf trains LoRA adapters only"),
                               (LoraConfig(use_dora=True), "peft_config.use_dora=True")]:
        with pytest.raises(ConfigError, match=named):
            GRPOTrainer(model=str(zoo["qwen2"]), reward_funcs=length, args=grpo_args(tmp_path),
                        train_dataset=Dataset.from_dict({"prompt": CHAT}), peft_config=peft_config)


def test_trainer_arguments_without_a_counterpart_are_refused(zoo, tmp_path):
    with pytest.raises(ConfigError, match="rollout_func: ppo-rlhf's rollouts are its own"):
        GRPOTrainer(model=str(zoo["qwen2"]), reward_funcs=length, args=grpo_args(tmp_path),
                    train_dataset=Dataset.from_dict({"prompt": CHAT}), rollout_func=lambda *a: None)


def test_ppo_reads_pre_tokenized_prompts_and_refuses_text(zoo, tmp_path):
    from ppo_rlhf.trl import PPOTrainer

    model = AutoModelForCausalLM.from_pretrained(zoo["gpt2"])
    tokenizer = AutoTokenizer.from_pretrained(zoo["gpt2"])
    with pytest.raises(ConfigError, match="train_dataset has no column 'input_ids' \\(its columns: prompt\\).*"
                                          "prepare_dataset"):
        PPOTrainer(args=PPOConfig(output_dir=str(tmp_path / "run")), processing_class=tokenizer, model=model,
                   ref_model=None, reward_model=None, value_model=None,
                   train_dataset=Dataset.from_dict({"prompt": PROMPTS}))


def test_ppo_trains_where_the_scripts_pad_token_lies_past_the_embeddings(zoo, tmp_path, capsys):
    """TRL's scripts add [PAD] to the tokenizer and leave the model as it is; zoo's GPT-2 has no spare row."""
    from transformers import AutoModelForSequenceClassification

    from ppo_rlhf.trl import PPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(zoo["gpt2"], padding_side="left")
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    policy = AutoModelForCausalLM.from_pretrained(zoo["gpt2"])
    critic, reward = (AutoModelForSequenceClassification.from_pretrained(zoo["gpt2"], num_labels=1) for _ in range(2))
    data = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in PROMPTS]})
    args = PPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, total_episodes=2,
                     response_length=4, num_ppo_epochs=1, report_to="none", gradient_checkpointing=False)
    PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward,
               train_dataset=data, value_model=critic).train()
    assert "lies past the model's 300 embeddings" in capsys.readouterr().out
    assert (tmp_path / "run" / "summary.json").is_file()


def test_a_value_model_that_is_the_reward_models_copy_starts_with_a_fresh_head(zoo):
    """TRL's scripts load the value model from reward_model_path: its score head is the reward
    model's, which learned less often here, so the critic's head starts fresh and the plan says so;
    a value model with a head of its own keeps it, as TRL's did."""
    import copy

    from transformers import AutoModelForSequenceClassification

    from ppo_rlhf.trl.ppo_trainer import value_critic

    reward = AutoModelForSequenceClassification.from_pretrained(zoo["gpt2"], num_labels=1)
    critic, note = value_critic(copy.deepcopy(reward), reward)
    assert not torch.equal(critic.value_head.summary.weight, reward.score.weight.float())
    assert critic.value_head.summary.weight.abs().max() < 0.1 and "a fresh value head" in note[0]
    own = copy.deepcopy(reward)
    with torch.no_grad():
        own.score.weight.add_(1.0)
    critic, note = value_critic(own, reward)
    torch.testing.assert_close(critic.value_head.summary.weight, own.score.weight.float())
    assert note == []


# ---------------------------------------------------------------- training through them
class Recorder(TrainerCallback):
    def __init__(self):
        self.events, self.logs = [], []

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append("begin")

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))

    def on_train_end(self, args, state, control, **kwargs):
        self.events.append("end")


def test_grpo_trains_a_model_object_with_lora_and_tells_its_callbacks(zoo, tmp_path, capsys):
    from peft import LoraConfig

    recorder = Recorder()
    model = AutoModelForCausalLM.from_pretrained(zoo["qwen2"])
    trainer = GRPOTrainer(model=model, reward_funcs=[length], args=grpo_args(tmp_path, max_steps=2),
                          train_dataset=Dataset.from_dict({"prompt": CHAT}), callbacks=[recorder],
                          peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    output = trainer.train()
    assert output.global_step == 2 and recorder.events == ["begin", "end"]
    assert [step for step, _ in recorder.logs] == [1, 2]
    logs = recorder.logs[-1][1]
    assert logs["reward"] == logs["score"] and "rewards/length/mean" in logs and "completions/mean_length" in logs
    assert logs["frac_reward_zero_std"] == logs["groups/zero_std"]
    out = tmp_path / "run"
    assert (out / "checkpoints" / "actor" / "adapter_config.json").is_file()
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "adapter_config.json").is_file()
    assert "where this run differs from TRL's" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="push_to_hub: ppo-rlhf runs offline"):
        trainer.push_to_hub()


def test_grpo_reads_a_streamed_data_set_in_order_and_rloo_trains(zoo, tmp_path):
    seen = []

    def remember(prompts, completions, **kwargs):
        seen.extend(p[-1]["content"] for p in prompts)
        return [0.0] * len(prompts)

    def rows():
        for i in range(100):
            yield {"prompt": [{"role": "user", "content": f"row {i}"}]}

    GRPOTrainer(model=str(zoo["qwen2"]), reward_funcs=remember, args=grpo_args(tmp_path, max_steps=2),
                train_dataset=IterableDataset.from_generator(rows)).train()
    assert seen == [f"row {i}" for i in (0, 0, 1, 1, 2, 2, 3, 3)]
    splits = DatasetDict({"test": Dataset.from_dict({"prompt": CHAT[:2]})})
    args = RLOOConfig(output_dir=str(tmp_path / "rloo"), per_device_train_batch_size=4, max_completion_length=4,
                      max_steps=1, report_to="none", gradient_checkpointing=False)
    RLOOTrainer(model=str(zoo["qwen2"]), reward_funcs=length, args=args, train_dataset=Dataset.from_dict(
        {"prompt": CHAT}), eval_dataset=splits).train()
    metrics = [json.loads(line) for line in (tmp_path / "rloo" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["kl_coef"] == 0.05 and "eval/score" in metrics[-1]


def test_refused_fields_are_held_to_trls_default_only():
    refused = [name for name, fate in fates_of(GRPOConfig).items() if fate.kind == REFUSED]
    assert {"top_p", "top_k", "lr_scheduler_type", "deepspeed", "push_to_hub", "mask_truncated_completions"} <= set(
        refused)
