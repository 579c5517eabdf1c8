"""LoRA on one base (peft): every PPO role from one set of base weights.

The tiny zoo of tests/zoo.py goes through ``rm --lora`` and ``ppo --lora`` in each critic mode
and reward kind; then the single-base mechanics are checked against plain models: the
reference is exactly the base, the reward adapter on the shared base scores what the merged
reward model scores, the critic adapter starts as the reward, only the trained adapters move,
a killed run resumes to the same weights, and ``merge`` gives a full model computing the same
logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from safetensors.torch import load_file

from ppo_rlhf.config import build_config
from ppo_rlhf.core import masked_mean, policy_loss, value_loss
from ppo_rlhf.models import load_causal_lm, load_sequence_classifier
from ppo_rlhf.models.lora import AdapterCritic
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.logprobs import forward_response, logprobs_from_logits
from ppo_rlhf.rollout.passes import response_stats
from ppo_rlhf.rollout.responses import generate_responses
from ppo_rlhf.rollout.reward import ScoringBatch
from ppo_rlhf.rollout.sequences import position_ids_from_mask
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.trainers.roles import load_roles
from ppo_rlhf.trainers.ppo import PPOTrainer
from ppo_rlhf.trainers.ppo_config import PPOConfig
from zoo import PROMPTS, REWARDS_MODULE, THREADS, run, run_failing

LORA = ["--lora", "--lora-r", 4, "--lora-alpha", 8]
BUDGET = ["--iterations", 2, "--batch-size", 4, "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 8,
          "--max-length", 64, "--do-sample", "--lr", 1e-2, "--save-every", 0, *THREADS]


@pytest.fixture(scope="module")
def reward_adapters(zoo, learning_seed):
    """A pairwise reward adapter per architecture, trained on that architecture's base."""
    out = {}
    for arch in ("gpt2", "llama", "qwen2"):
        folder = zoo["root"] / f"rm_lora_{arch}"
        run(["rm", "--mode", "pairwise", "--model", zoo[arch], "--data", zoo["pairs"], "--prompt-field", "query",
             "--chosen-field", "good", "--rejected-field", "bad", "--steps", 15, "--batch-size", 8, "--lr", 1e-2,
             "--eval-fraction", 0.25, "--seed", learning_seed, "--out", folder, *LORA, *THREADS])
        out[arch] = folder / "checkpoints" / "reward"
    return out


def lora_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(folder) / "adapter_model.safetensors"))


@pytest.mark.learning
def test_rm_lora_writes_a_peft_folder_that_peft_loads(zoo, reward_adapters, record_outcome):
    for arch, folder in reward_adapters.items():
        summary = json.loads((folder.parent.parent / "summary.json").read_text())
        record_outcome(f"eval_accuracy/{arch}", summary["eval_accuracy"])
        assert summary["eval_accuracy"] >= 0.8, (arch, summary)
        assert not (folder / "config.json").exists()  # an adapter, not a copy of the base
        base = AutoModelForSequenceClassification.from_pretrained(zoo[arch], num_labels=1)
        model = PeftModel.from_pretrained(base, folder)
        assert any("lora_B" in k and v.abs().sum() > 0 for k, v in lora_tensors(folder).items()), arch
        assert any(k.endswith("score.weight") for k in lora_tensors(folder)), "the score head is saved with it"
        assert model.peft_config["default"].base_model_name_or_path == str(Path(zoo[arch]).resolve())


@pytest.mark.parametrize("arch, critic, reward", [
    ("llama", "lora", "adapter"),   # all four roles on one base; critic adapter from the reward adapter
    ("llama", "shared", "fn"),
    ("qwen2", "shared", "adapter"),
    ("qwen2", "separate", "adapter"),  # a separate critic beside a LoRA actor, from the merged reward adapter
    ("gpt2", "lora", "fn"),         # Conv1D layers; a fresh critic adapter
    ("gpt2", "shared", "model"),    # a full reward model of another architecture (re-encoded text)
])
def test_ppo_lora_in_each_critic_mode_and_reward_kind(zoo, reward_models, reward_adapters, tmp_path, arch, critic,
                                                      reward):
    reward_args = {"fn": ["--reward-fn", f"{REWARDS_MODULE}:length_score"],
                   "adapter": ["--reward-model", reward_adapters[arch]],
                   "model": ["--reward-model", reward_models["llama"] / "checkpoints" / "reward"]}[reward]
    out = tmp_path / "ppo"
    run(["ppo", "--model", zoo[arch], "--prompts", zoo["prompts"], *reward_args, "--critic", critic, *LORA, *BUDGET,
         "--eval-prompts", zoo["prompts"], "--eval-size", 3, "--out", out])
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    actor = Path(summary["checkpoints"]["actor"])
    assert (actor / "adapter_config.json").is_file() and not (actor / "config.json").exists()
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(zoo[arch]), actor)
    assert model.config.model_type == arch
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in lora_tensors(actor).items()), "the policy did not move"
    critic_folder = Path(summary["checkpoints"]["critic"])
    assert (critic_folder / "value_head.safetensors").is_file()
    assert (critic_folder / "adapter_config.json").is_file() == (critic == "lora")


def test_the_first_command_line_works_as_written(zoo, tmp_path):
    # ppo-rlhf ppo --model DIR --prompts FILE.jsonl --reward-fn module:function --lora --out RUN
    out = tmp_path / "run"
    run(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn", f"{REWARDS_MODULE}:length_score",
         "--lora", "--out", out, "--iterations", 1, "--batch-size", 4, "--mini-batch-size", 2, "--max-new-tokens", 4,
         *THREADS])
    actor = json.loads((out / "summary.json").read_text())["checkpoints"]["actor"]
    assert PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(zoo["llama"]), actor).config.model_type == "llama"
    # The actor folder is usable wherever a causal LM is: eval loads base + adapter.
    run(["eval", "--model", actor, "--prompts", zoo["prompts"], "--reward-fn", f"{REWARDS_MODULE}:length_score",
         "--size", 3, "--max-new-tokens", 4, "--max-length", 64, "--out", tmp_path / "eval", *THREADS])
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["prompts"] == 3


# ---------------------------------------------------------------- single-base mechanics
def single_base_trainer(zoo, reward_adapters, arch="llama", critic="lora", **overrides) -> PPOTrainer:
    config = build_config(PPOConfig, {
        "model": str(zoo[arch]), "reward_model": str(reward_adapters[arch]), "critic": critic, "lora": True,
        "lora_r": 4, "lora_alpha": 8, "batch_size": 4, "mini_batch_size": 2, "ppo_epochs": 2, "max_new_tokens": 6,
        "max_length": 64, "do_sample": True, "lr": 1e-2, **overrides})
    roles = load_roles(config, None)
    generator = TorchGenerator(roles.tokenizer.eos_token_id, roles.tokenizer.pad_token_id, config.max_new_tokens,
                               do_sample=True, seed=0)
    return PPOTrainer(config, roles.reward, model=roles.actor, ref=roles.ref, tokenizer=roles.tokenizer, generator=generator,
                      critic=roles.critic)


def rollout(trainer: PPOTrainer):
    return generate_responses(trainer.actor, trainer.tokenizer, trainer.generator, PROMPTS[:4], 56)


def test_one_base_in_memory_and_only_adapters_train(zoo, reward_adapters):
    trainer = single_base_trainer(zoo, reward_adapters)
    base_parameters = {id(p) for p in trainer.actor.get_base_model().parameters()}
    assert trainer.ref is None
    assert isinstance(trainer.critic, AdapterCritic)
    # Neither the reward nor the critic holds weights of its own beyond its head and adapter.
    assert all(id(p) in base_parameters for p in trainer.critic.adapter)
    assert list(trainer.reward.model.parameters()) == list(trainer.reward.model.score.parameters())
    names = {id(p): n for n, p in trainer.actor.named_parameters()}
    trained = [names[id(p)] for group in trainer.optimizer.param_groups for p in group["params"] if id(p) in names]
    assert trained and all("lora_" in n for n in trained)
    assert {n.split(".")[-2] for n in trained} == {"policy", "critic"}  # never the reward adapter, never the base
    actor_group, critic_group = ({id(p) for p in g["params"]} for g in trainer.optimizer.param_groups)
    assert not actor_group & critic_group


def test_reference_is_the_base_and_the_first_ratio_is_one(zoo, reward_adapters):
    trainer = single_base_trainer(zoo, reward_adapters)
    sequences = rollout(trainer).sequences
    plain = load_causal_lm(zoo["llama"]).eval()
    mask = sequences.response_mask.bool()

    def logprobs(model):
        return logprobs_from_logits(forward_response(model, sequences).logits, sequences.response_ids)[mask]

    with torch.no_grad():
        expected = logprobs(plain)
        reference = trainer.reference_stats(sequences).logprobs[mask]
        actor = logprobs(trainer.actor)  # LoRA B starts at 0: the actor is the base
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actor, expected, atol=1e-5, rtol=1e-5)
    trainer.step([{"prompt": p} for p in PROMPTS[:4]])
    with torch.no_grad():
        moved = logprobs(trainer.actor)
        reference_after = trainer.reference_stats(sequences).logprobs[mask]
    assert not torch.allclose(moved, expected, atol=1e-4)  # the policy moved ...
    torch.testing.assert_close(reference_after, expected, atol=1e-5, rtol=1e-5)  # ... the reference did not


def test_reward_adapter_on_the_shared_base_scores_like_the_merged_reward_model(zoo, reward_adapters):
    trainer = single_base_trainer(zoo, reward_adapters)
    responses = rollout(trainer)
    batch = ScoringBatch([{}] * 4, PROMPTS[:4], responses.texts, responses.finished, responses.sequences)
    shared = trainer.reward(batch)
    merged = load_sequence_classifier(reward_adapters["llama"]).eval()  # base + adapter folded into one model
    from ppo_rlhf.rollout.reward import ModelReward

    torch.testing.assert_close(shared, ModelReward(merged)(batch), atol=1e-4, rtol=1e-4)
    # ... and the critic adapter starts as that reward model: its value at the last token is the score.
    with torch.no_grad():
        values = trainer.critic(responses.sequences.input_ids, responses.sequences.attention_mask,
                                position_ids_from_mask(responses.sequences.attention_mask))
    last = responses.sequences.attention_mask.shape[1] - 1 - responses.sequences.attention_mask.flip(1).argmax(1)
    torch.testing.assert_close(values[torch.arange(4), last], shared, atol=1e-4, rtol=1e-4)


def test_reward_adapter_scores_in_eval_mode_whatever_mode_the_actor_is_in(zoo, reward_adapters):
    # GPT-2's dropout (0.1) left on in the shared base: after an update the actor is in train mode.
    trainer = single_base_trainer(zoo, reward_adapters, arch="gpt2", disable_dropout=False)
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in trainer.actor.modules())
    responses = rollout(trainer)
    batch = ScoringBatch([{}] * 4, PROMPTS[:4], responses.texts, responses.finished, responses.sequences)
    trainer.actor.train()
    first, second = trainer.reward(batch), trainer.reward(batch)
    assert torch.equal(first, second)
    merged = load_sequence_classifier(reward_adapters["gpt2"]).eval()
    from ppo_rlhf.rollout.reward import ModelReward

    torch.testing.assert_close(first, ModelReward(merged)(batch), atol=1e-4, rtol=1e-4)
    assert trainer.actor.training and all(m.training for m in trainer.actor.modules())  # its mode is given back


def test_lora_dropout_is_kept_in_training_and_other_dropout_is_off(zoo, reward_adapters):
    trainer = single_base_trainer(zoo, reward_adapters, arch="gpt2", lora_dropout=0.5)
    lora_dropouts = [m for n, m in trainer.actor.named_modules() if n.endswith("lora_dropout.policy")]
    assert lora_dropouts and all(isinstance(m, torch.nn.Dropout) and m.p == 0.5 for m in lora_dropouts)
    others = [m for m in trainer.actor.modules() if isinstance(m, torch.nn.Dropout) and not any(m is d for d in lora_dropouts)]
    assert others and all(m.p == 0.0 for m in others)


def test_reward_adapter_never_moves(zoo, reward_adapters):
    trainer = single_base_trainer(zoo, reward_adapters)
    reward_before = {n: p.detach().clone() for n, p in trainer.actor.named_parameters() if ".reward." in n}
    base_before = {n: p.detach().clone() for n, p in trainer.actor.named_parameters() if "lora_" not in n}
    critic_before = [p.detach().clone() for p in trainer.critic.adapter]
    for _ in range(2):
        trainer.step([{"prompt": p} for p in PROMPTS[:4]])
    parameters = dict(trainer.actor.named_parameters())
    assert all(torch.equal(parameters[n], v) for n, v in reward_before.items())
    assert all(torch.equal(parameters[n], v) for n, v in base_before.items())
    assert any(not torch.equal(p, v) for p, v in zip(trainer.critic.adapter, critic_before)), "the critic did not train"


def test_actor_then_critic_backward_gives_the_gradients_of_the_summed_loss(zoo, reward_adapters):
    # The update runs the actor's backward pass before building the critic's graph (memory);
    # the gradients must be those of one backward pass of pg_loss + vf_coef * vf_loss - c * entropy.
    trainer = single_base_trainer(zoo, reward_adapters, ppo_epochs=1, mini_batch_size=4, lr=1e-30, critic_lr=1e-30,
                                  max_grad_norm=1e9, entropy_coef=0.01, vf_coef=0.5, cliprange_value=None)
    experience, _ = trainer.make_experience([{"prompt": p} for p in PROMPTS[:4]])
    trainer.update(experience)  # one minibatch: the whole batch (in another order; the losses are means)
    update_grads = [p.grad.clone() for p in trainer.trainable_parameters]
    trainer.optimizer.zero_grad(set_to_none=True)
    stats = response_stats(trainer.actor, experience.sequences, trainer.pass_plan, entropy=True, entropy_grad=True)
    values = trainer.critic.values(experience.sequences, stats.hidden)
    mask = experience.mask
    pg_loss, _ = policy_loss(stats.logprobs, experience.logprobs, experience.advantages, mask, 0.2)
    vf_loss, _ = value_loss(values, experience.values, experience.returns, mask, None)
    (pg_loss + 0.5 * vf_loss - 0.01 * masked_mean(stats.entropy, mask)).backward()
    assert any(g.abs().sum() > 0 for g in update_grads[:5]) and any(g.abs().sum() > 0 for g in update_grads[-5:])
    for parameter, expected in zip(trainer.trainable_parameters, update_grads):
        torch.testing.assert_close(parameter.grad, expected, atol=1e-6, rtol=1e-4)


def test_gradient_checkpointing_gives_the_same_gradients(zoo, reward_adapters):
    settings = dict(ppo_epochs=1, mini_batch_size=4, lr=1e-30, critic_lr=1e-30, max_grad_norm=1e9)
    torch.manual_seed(0)  # the same random LoRA A matrices in both
    plain = single_base_trainer(zoo, reward_adapters, **settings)
    torch.manual_seed(0)
    checkpointed = single_base_trainer(zoo, reward_adapters, gradient_checkpointing=True, **settings)
    experience, _ = plain.make_experience([{"prompt": p} for p in PROMPTS[:4]])
    torch.manual_seed(0)
    plain.update(experience)
    torch.manual_seed(0)  # the same minibatch order
    checkpointed.update(experience)
    assert checkpointed.actor.get_base_model().is_gradient_checkpointing
    for expected, parameter in zip(plain.trainable_parameters, checkpointed.trainable_parameters):
        torch.testing.assert_close(parameter.grad, expected.grad, atol=1e-6, rtol=1e-4)


def test_lora_run_killed_midway_resumes_to_the_same_weights(zoo, reward_adapters, tmp_path):
    common = ["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-model", reward_adapters["llama"],
              "--critic", "lora", *LORA, *BUDGET[2:-4], "--save-every", 1, *THREADS]
    run([*common, "--iterations", 3, "--out", tmp_path / "straight"])
    run([*common, "--iterations", 2, "--out", tmp_path / "resumed"])
    run([*common, "--iterations", 3, "--out", tmp_path / "resumed", "--resume"])
    for role in ("actor", "critic"):
        straight = lora_tensors(tmp_path / "straight" / "checkpoints" / role)
        resumed = lora_tensors(tmp_path / "resumed" / "checkpoints" / role)
        assert straight.keys() == resumed.keys()
        for key in straight:
            torch.testing.assert_close(resumed[key], straight[key], atol=1e-6, rtol=1e-5, msg=f"{role} {key}")
    steps = [r["step"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")]
    assert steps == [1, 2, 3]


def merges_to_the_same_logits(adapter: Path, base: Path, out: Path) -> None:
    """`ppo-rlhf merge` of the adapter gives a full model whose logits are the adapter's on its base."""
    run(["merge", "--adapter", adapter, "--out", out])
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=1e-5)


def test_merge_gives_a_full_model_with_the_same_logits(zoo, reward_adapters, tmp_path):
    out = tmp_path / "ppo"
    run(["ppo", "--model", zoo["qwen2"], "--prompts", zoo["prompts"], "--reward-fn", f"{REWARDS_MODULE}:length_score",
         *LORA, *BUDGET, "--out", out])
    actor = out / "checkpoints" / "actor"
    merges_to_the_same_logits(actor, zoo["qwen2"], tmp_path / "merged")
    # A reward adapter merges into a sequence classifier.
    run(["merge", "--adapter", reward_adapters["qwen2"], "--out", tmp_path / "merged_rm"])
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged_rm")
    assert classifier.config.num_labels == 1 and classifier.config.pad_token_id is not None


def test_the_default_targets_adapt_an_untied_output_layer_and_merge_it(zoo, tmp_path):
    # llama's output layer is its own, qwen2's is its input embeddings (tied): the policy adapter
    # takes the first and leaves the second (a merge would change the embeddings), and a critic
    # adapter, which never reaches the logits, leaves both.
    for arch, adapted in (("llama", True), ("qwen2", False)):
        out = tmp_path / arch
        run(["ppo", "--model", zoo[arch], "--prompts", zoo["prompts"], "--reward-fn",
             f"{REWARDS_MODULE}:length_score", "--critic", "lora", *LORA, *BUDGET, "--out", out])
        policy, critic = ({name.rsplit(".", 1)[-1] for name in json.loads(
            (out / "checkpoints" / role / "adapter_config.json").read_text())["target_modules"]}
            for role in ("actor", "critic"))
        assert ("lm_head" in policy) == adapted and {"q_proj", "down_proj"} <= policy, policy
        assert "lm_head" not in critic and {"q_proj", "down_proj"} <= critic, critic
    actor = tmp_path / "llama" / "checkpoints" / "actor"
    saved = lora_tensors(actor)
    assert any("lm_head.lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())
    assert all("lora_" in k for k in saved), sorted(saved)  # the adapter alone, not the frozen output weights
    merges_to_the_same_logits(actor, zoo["llama"], tmp_path / "merged")


def test_target_modules_other_than_the_default_pass_through():
    from ppo_rlhf.models.lora import target_modules

    assert target_modules("all-linear", None) == "all-linear"
    assert target_modules(" q_proj, v_proj ,", None) == ["q_proj", "v_proj"]
    assert target_modules("all-linear+output", None) == "all-linear"  # no model to look at: peft's


# ---------------------------------------------------------------- bad input
def test_critic_lora_needs_lora(zoo, tmp_path, capsys):
    err = run_failing(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn",
                       f"{REWARDS_MODULE}:length_score", "--critic", "lora", "--out", tmp_path], capsys)
    assert "critic" in err and "--lora" in err


def test_a_reward_adapter_is_not_taken_for_a_policy(zoo, reward_adapters, tmp_path, capsys):
    err = run_failing(["ppo", "--model", reward_adapters["llama"], "--prompts", zoo["prompts"], "--reward-fn",
                       f"{REWARDS_MODULE}:length_score", "--out", tmp_path], capsys)
    assert str(reward_adapters["llama"]) in err and "reward adapter" in err


def test_sft_lora_trains_an_adapter_that_peft_loads_and_resumes_to_the_same_weights(zoo, tmp_path):
    """sft --lora: only the adapter moves; the checkpoint is a peft folder naming its base, which
    every stage reads as the merged model (ppo --lora starts from it); a killed run resumes to the
    straight run's adapter."""
    common = ["sft", "--model", zoo["llama"], "--data", zoo["data"]["jsonl"], "--prompt-field", "question",
              "--completion-field", "answer", "--batch-size", 4, "--lr", 1e-2, "--eval-fraction", 0, "--seed", 3,
              "--save-every", 1, "--max-length", 64, *LORA, *THREADS]
    run([*common, "--steps", 4, "--out", tmp_path / "straight"])
    adapter = tmp_path / "straight" / "checkpoints" / "sft"
    assert not (adapter / "config.json").exists() and (adapter / "tokenizer_config.json").is_file()
    tensors = lora_tensors(adapter)
    assert tensors and all("lora_" in k for k in tensors) and any(
        "lora_B" in k and v.abs().sum() > 0 for k, v in tensors.items())
    base = AutoModelForCausalLM.from_pretrained(zoo["llama"]).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(zoo["llama"]), adapter).eval()
    assert adapted.peft_config["default"].base_model_name_or_path == str(Path(zoo["llama"]).resolve())
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    with torch.no_grad():
        merged = load_causal_lm(adapter).eval()  # how ppo, eval and --teacher read it
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(base(ids).logits, adapted(ids).logits, atol=1e-4)
    run([*common, "--steps", 2, "--out", tmp_path / "resumed"])
    run([*common, "--steps", 4, "--out", tmp_path / "resumed", "--resume"])
    resumed = lora_tensors(tmp_path / "resumed" / "checkpoints" / "sft")
    assert resumed.keys() == tensors.keys()
    for key in tensors:
        torch.testing.assert_close(resumed[key], tensors[key], atol=1e-6, rtol=1e-5, msg=key)
    run(["ppo", "--model", adapter, "--prompts", zoo["prompts"], "--reward-fn", f"{REWARDS_MODULE}:length_score",
         *LORA, *BUDGET, "--out", tmp_path / "ppo"])
    assert (tmp_path / "ppo" / "checkpoints" / "actor" / "adapter_config.json").is_file()


def test_sft_lora_needs_a_base(tmp_path, capsys):
    err = run_failing(["sft", "--lora", "--out", tmp_path], capsys)
    assert "lora" in err and "--model" in err


def test_rm_lora_needs_a_base(tmp_path, capsys):
    err = run_failing(["rm", "--lora", "--out", tmp_path], capsys)
    assert "lora" in err and "--model" in err


def test_an_adapter_on_a_bf16_base_is_merged_where_its_update_is_kept(zoo, tmp_path):
    """An adapter trained on a base stored in bf16 holds float32 weights; its update, under half a
    bf16 ulp of most weights, is rounded away by a bf16 merge.  At --dtype auto, it is merged and
    held in float32 (adapter_merge_dtype), and the merged model computes what the unmerged one does;
    a dtype given by name is kept (tests/test_float32_merges.py: every path that merges)."""
    from peft import LoraConfig, get_peft_model

    from ppo_rlhf.models import adapter_merge_dtype

    base = AutoModelForCausalLM.from_pretrained(zoo["llama_bf16"], dtype=torch.bfloat16)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    for name, parameter in peft.named_parameters():
        if "lora_" in name:  # float32, as training keeps them; the update about 1e-5: under half a bf16 ulp of most weights
            parameter.data = torch.randn_like(parameter, dtype=torch.float32) * 0.002
    peft.save_pretrained(tmp_path / "adapter")
    merged_base = AutoModelForCausalLM.from_pretrained(zoo["llama_bf16"], dtype=torch.float32)  # bf16 read exactly

    assert adapter_merge_dtype(tmp_path / "adapter", "auto") == torch.float32
    assert adapter_merge_dtype(tmp_path / "adapter", torch.bfloat16) == torch.bfloat16  # as asked
    assert adapter_merge_dtype(zoo["llama_bf16"], "auto") == "auto"  # a full model: as stored
    faithful = load_causal_lm(tmp_path / "adapter", adapter_merge_dtype(tmp_path / "adapter", "auto"))
    assert load_causal_lm(tmp_path / "adapter", "auto").dtype == torch.float32  # every path: float32 at auto
    rounded = load_causal_lm(tmp_path / "adapter", torch.bfloat16)
    assert faithful.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    q = "model.layers.0.self_attn.q_proj.weight"
    moved = (faithful.state_dict()[q] != merged_base.state_dict()[q]).float().mean()
    kept_in_bf16 = (rounded.state_dict()[q].float() != merged_base.state_dict()[q]).float().mean()
    assert moved > 0.99 and kept_in_bf16 < 0.5  # the bf16 merge drops most of the update
    layer = peft.base_model.model.model.layers[0].self_attn.q_proj
    update = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(faithful.state_dict()[q], merged_base.state_dict()[q] + update, rtol=0, atol=1e-6)
