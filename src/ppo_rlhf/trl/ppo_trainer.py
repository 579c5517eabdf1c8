"""TRL's PPOTrainer (``trl.trainer.ppo_trainer`` up to 0.25, ``trl.experimental.ppo`` in 0.27-0.29)
in its signature over this project's PPO (docs/migrating_from_trl.md): a policy, a frozen reference
(a copy, or the LoRA base), a reward model and a value model, on pre-tokenized prompts.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

import ppo_rlhf.trl.configs as configs
from ppo_rlhf.config import ConfigError
from ppo_rlhf.distributed import is_main_process, world_size
from ppo_rlhf.models.value import ModelCritic, ValueHead, value_head_on
from ppo_rlhf.trl.datasets import one_split, ppo_rows
from ppo_rlhf.trl.trainer_base import TRLTrainer, check_args, lora_settings, refuse_given, wrapped_in_lora
from ppo_rlhf.trl.translate import ppo_settings


def value_critic(value_model, reward_model) -> tuple[ModelCritic, list[str]]:
    """TRL's value model (a sequence classifier, often the reward model's copy) as this project's
    critic, and the plan's note: its trunk, and a value head that starts from its score head as
    TRL's did -- unless that head is the reward model's own (TRL's scripts load both from
    ``reward_model_path``).  Then the head starts fresh, as this project's critics do: its values
    start near 0 and learn the returns, where the reward model's head predicts every prefix's score
    and the first updates chase that error.  On the built-in task TRL's own ppo.py learned in 3 of 8
    seeds with the reward model's head and in 7 of 8 with a fresh one (docs/benchmarks.md, "TRL's PPO
    script against ppo-rlhf's PPO")."""
    trunk = getattr(value_model, value_model.base_model_prefix, None)
    score = getattr(value_model, "score", None)
    if trunk is None or not isinstance(score, torch.nn.Linear) or score.out_features != 1:
        raise ConfigError(f"value_model is a {type(value_model).__name__}; TRL's PPOTrainer takes a sequence "
                          f"classifier with one label (AutoModelForSequenceClassification(..., num_labels=1))")
    if reward_heads_alike(score, getattr(reward_model, "score", None)):
        return ModelCritic(trunk, value_head_on(trunk)), [
            "value model: its trunk, and a fresh value head (values start near 0): its score head is the reward "
            "model's, from which TRL's started, and which learned less often here (docs/migrating_from_trl.md)"]
    head = ValueHead(score.in_features)
    with torch.no_grad():
        head.summary.weight.copy_(score.weight.float())
        head.summary.bias.zero_() if score.bias is None else head.summary.bias.copy_(score.bias.float())
    return ModelCritic(trunk, head), []


def reward_heads_alike(score: torch.nn.Linear, reward_score) -> bool:
    """Whether a value model's score head holds the reward model's own weights (both read from one
    folder; compared in float32, so one loaded in bf16 beside one in float32 from a bf16 file counts)."""
    def same(a, b) -> bool:
        return (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape and
                                             torch.equal(a.detach().float().cpu(), b.detach().float().cpu()))

    return isinstance(reward_score, torch.nn.Linear) and same(score.weight, reward_score.weight) and \
        same(score.bias, reward_score.bias)


def tokenizer_within_embeddings(tokenizer, model) -> tuple[object, list[str]]:
    """TRL's PPO scripts add a [PAD] token to the tokenizer and leave the model as it is: on a model
    with no embedding rows to spare (Llama-2's 32000), its id lies past them.  TRL never embeds a pad
    (it sets padding to id 0 before each forward pass), and nothing else writes [PAD]; this
    project refuses a tokenizer whose ids pass the embeddings.  So the run takes the tokenizer as
    its folder has it (the script's chat template and padding side kept), padding with its own pad
    token where that fits, else EOS -- padding the attention mask hides alike.  Returns (the
    tokenizer, the plan's notes)."""
    rows = model.get_input_embeddings().num_embeddings
    past = [i for i in range(rows, len(tokenizer))]
    if not past or past != [tokenizer.pad_token_id] or not Path(str(tokenizer.name_or_path)).is_dir():
        return tokenizer, []  # within the embeddings, or more than the pad past them: the project's check says so
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    own.chat_template, own.padding_side, own.truncation_side = (tokenizer.chat_template, tokenizer.padding_side,
                                                                tokenizer.truncation_side)
    if own.pad_token_id is None or own.pad_token_id >= rows:
        own.pad_token = own.eos_token
    return own, [f"padding: the script's pad token {tokenizer.pad_token} (id {tokenizer.pad_token_id}) lies past the "
                 f"model's {rows} embeddings, which TRL never fed it (it masks padding to id 0); the run pads with "
                 f"{own.pad_token}, its folder's tokenizer otherwise the script's"]


class PPOTrainer(TRLTrainer):
    """TRL's PPOTrainer (0.2x; ``trl.experimental.ppo`` in 0.27-0.29) over this project's PPO: a
    policy, a frozen reference (a copy, or the LoRA base), a reward model and a value model, on
    pre-tokenized prompts (``input_ids``)."""

    config_class = configs.PPOConfig
    metric_names = {"objective/kl": "kl", "objective/non_score_reward": "non_score_reward",
                    "objective/scores": "score", "policy/approxkl_avg": "approx_kl", "policy/clipfrac_avg": "clipfrac",
                    "loss/policy_avg": "pg_loss", "loss/value_avg": "vf_loss", "val/clipfrac_avg": "vf_clipfrac",
                    "policy/entropy_avg": "entropy"}

    def __init__(self, args, processing_class, model, ref_model, reward_model, train_dataset, value_model,
                 data_collator=None, eval_dataset=None, optimizers=(None, None), callbacks=None, peft_config=None):
        if ref_model is model:  # TRL's rule
            raise ValueError("`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the "
                             "same as `model`, you must make a copy of it, or `None` if you use peft.")
        check_args(args, configs.PPOConfig, "PPOTrainer")
        refuse_given({"optimizers": tuple(optimizers) != (None, None) and
                      "ppo-rlhf builds one AdamW over the policy and the value model (learning_rate, weight_decay, "
                      "adam_epsilon); leave optimizers out",
                      "data_collator": data_collator is not None and
                      type(data_collator).__name__ != "DataCollatorWithPadding" and
                      "ppo-rlhf pads the prompts itself (left, as TRL's DataCollatorWithPadding did for generation); "
                      "leave data_collator out"})
        if processing_class is None or not hasattr(processing_class, "decode"):
            raise ConfigError(f"processing_class must be the policy's tokenizer, got {type(processing_class).__name__}")
        processing_class, pad_note = tokenizer_within_embeddings(processing_class, model)
        rows = ppo_rows(train_dataset, processing_class, "train_dataset")
        eval_rows = (ppo_rows(one_split(eval_dataset, "eval_dataset"), processing_class, "eval_dataset")
                     if eval_dataset is not None else [])
        settings, notes = ppo_settings(args, len(rows), world_size())
        notes += pad_note
        lora = lora_settings(peft_config, getattr(model.config, "model_type", None))
        if args.stop_token == "eos":  # what TRL did to the policy
            model.generation_config.eos_token_id = processing_class.eos_token_id
        elif args.stop_token_id is not None:
            model.generation_config.eos_token_id = args.stop_token_id
        policy = wrapped_in_lora(model, lora)
        longest = max(len(processing_class(row["prompt"], add_special_tokens=True)["input_ids"])
                      for row in rows + eval_rows)
        folder = getattr(model.config, "_name_or_path", None)  # recorded as the run's model where it is a folder
        settings.update(lora, prompts=rows, prompt_field="prompt", chat_template=False, critic="separate",
                        model=folder if folder and Path(folder).is_dir() else None,
                        max_length=longest + args.response_length,
                        **({"eval_prompts": eval_rows, "eval_size": len(eval_rows)} if eval_rows else {}))
        args.world_size = world_size()  # the sizes TRL's trainer wrote into its config, for the script to read
        args.batch_size, args.mini_batch_size = settings["batch_size"], settings["mini_batch_size"]
        args.local_batch_size = settings["batch_size"] // args.world_size
        args.num_total_batches = settings["iterations"]
        args.local_mini_batch_size = settings["mini_batch_size"] // args.world_size
        args.micro_batch_size = args.per_device_train_batch_size * args.world_size
        self.eval_rows = eval_rows
        critic, critic_note = value_critic(value_model, reward_model)
        self.start(args, callbacks, settings, notes + critic_note, reward=reward_model, model=policy,
                   ref=None if lora else ref_model, tokenizer=processing_class, critic=critic)

    def extra_metrics(self, metrics: dict) -> dict:
        extra = {"episode": self.state.global_step * self.config.batch_size, "lr": self.config.lr}
        if "score" in metrics and "non_score_reward" in metrics:
            extra["objective/rlhf_reward"] = metrics.get("score_used", metrics["score"]) + metrics["non_score_reward"]
        if "score_used" in metrics:  # TRL's scores carry the missing-EOS penalty
            extra["objective/scores"] = metrics["score_used"]
        return extra

    def generate_completions(self, sampling: bool = False) -> list[dict]:
        """The held-out prompts answered greedily and scored by the reward model, the first five
        printed (TRL's table); returns every row."""
        if not self.eval_rows:
            return []
        run = self.run
        if getattr(run, "evaluator", None) is None:
            run.evaluator = run.make_evaluator(self.eval_rows[:run.config.batch_size] if sampling else self.eval_rows)
        metrics, samples = run.evaluate(sampled=False)
        table = [{"query": prompt, "model response": response} for prompt, response in samples]
        if is_main_process():
            print(f"held-out completions (greedy), mean score {metrics.get('eval/score', math.nan):.4g}:")
            for row in table[:5]:
                print(f"  {row['query']!r} -> {row['model response']!r}")
        return table
