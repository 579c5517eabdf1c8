"""On-policy distillation (--teacher; trainers/teacher.py, docs/design.md "On-policy distillation"):
the per-token reverse KL worked by hand, where each estimator takes the teacher's reward, the
tokenizer checked at start, a LoRA teacher as an adapter on the shared base, and whole runs."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.core import aggregate_loss, full_kl, reward_to_go, shaped_rewards, teacher_reverse_kl
from ppo_rlhf.models import load_causal_lm
from ppo_rlhf.rollout.passes import PassPlan, response_stats
from ppo_rlhf.trainers.estimators import ESTIMATORS, score_advantages
from ppo_rlhf.trainers.ppo import PPOTrainer, old_logprobs_from_update
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.teacher import tokenizer_difference
from zoo import REWARDS_MODULE, make_tokenizer, run, run_failing


def test_teacher_reverse_kl_by_hand():
    # Two responses; the first wrote 2 tokens, the second 3 (the last column of the first is padding
    # holding inf, which must stay out).
    logprobs = torch.tensor([[-1.0, -2.0, float("inf")], [-0.5, -0.5, -3.0]])
    teacher = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -2.5, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # log pi - log teacher: [0.5, -1.0, pad 0], [0.0, 2.0, -2.0]
    reverse_kl = teacher_reverse_kl(logprobs, teacher, mask)
    assert reverse_kl.tolist() == [[0.5, -1.0, 0.0], [0.0, 2.0, -2.0]]
    # Per token in the rewards (gae, reinforce++, remax), teacher_coef 2, no KL to the reference,
    # scores 3 and 0 on each response's last token:
    #   rewards [-1, 2 + 3, 0] and [0, -4, 4 + 0]; reward-to-go (gamma 1) [4, 5, 0] and [0, 0, 4]
    rewards = shaped_rewards(torch.tensor([3.0, 0.0]), torch.zeros(2, 3), mask, 0.0, -2.0 * reverse_kl)
    assert rewards.tolist() == [[-1.0, 5.0, 0.0], [0.0, -4.0, 4.0]]
    assert reward_to_go(rewards, mask, 1.0).tolist() == [[4.0, 5.0, 0.0], [0.0, 0.0, 4.0]]
    # Summed into the score (the group estimators), one group of the two: 3 + (-2)(-0.5) = 4 and
    # 0 + (-2)(0) = 0; rloo: each less the other: 4 and -4.
    summed = torch.tensor([3.0, 0.0]) + (-2.0 * reverse_kl).sum(dim=1)
    assert summed.tolist() == [4.0, 0.0]
    assert score_advantages("rloo", summed, 2).tolist() == [4.0, -4.0]


def small_config(zoo, tmp_path, **overrides) -> PPOConfig:
    return build_config(PPOConfig, {
        "model": str(zoo["llama"]), "teacher": str(zoo["granite"]), "prompts": str(zoo["prompts"]),
        "reward_fn": f"{REWARDS_MODULE}:length_score", "samples_per_prompt": 2, "batch_size": 4,
        "mini_batch_size": 4, "ppo_epochs": 1, "max_new_tokens": 5, "max_length": 32, "kl_coef": 0.0,
        "teacher_coef": 0.5, "out": str(tmp_path / "run"), "num_threads": 1, **overrides})


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_every_estimator_takes_the_teachers_reward_where_it_belongs(zoo, tmp_path, estimator):
    """The rollout's rewards hold -teacher_coef * (log pi - log teacher) of the teacher's own forward
    pass: per token for gae, reinforce++ and remax; summed into the score for the group estimators."""
    trainer = PPOTrainer(small_config(zoo, tmp_path, estimator=estimator,
                                      samples_per_prompt=1 if estimator in ("gae", "remax") else 2))
    experience, metrics = trainer.make_experience(trainer.run_parts.train_rows[:2] * 2 if estimator in ("gae", "remax")
                                                  else [r for r in trainer.run_parts.train_rows[:2] for _ in (0, 1)])
    mask, sequences = experience.mask, experience.sequences
    granite = load_causal_lm(zoo["granite"])
    plan = PassPlan(pad_token_id=trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        teacher = response_stats(granite, sequences, plan).logprobs
        student = response_stats(trainer.actor.eval(), sequences, plan).logprobs  # no update yet: the old ones
    if trainer.old_logprobs_from_update:  # the reward read the sampler's log-probs: the same to round-off
        assert experience.logprobs.abs().max() == 0  # still to be filled in by the update
        torch.testing.assert_close(experience.engine_logprobs * mask, student * mask, atol=1e-5, rtol=0)
    else:
        torch.testing.assert_close(experience.logprobs * mask, student * mask, atol=1e-5, rtol=0)
    reverse_kl = torch.where(mask.bool(), student - teacher, torch.zeros(()))
    assert metrics["teacher/reverse_kl"] == pytest.approx(reverse_kl.sum(dim=1).mean().item(), abs=1e-4)
    teacher_rewards = -0.5 * reverse_kl
    scores = experience.raw_scores  # the length reward, no normalisation
    if estimator in ("grpo", "dr-grpo", "rloo"):
        torch.testing.assert_close(experience.scores, scores + teacher_rewards.sum(dim=1), atol=1e-4, rtol=0)
        expected = shaped_rewards(scores + teacher_rewards.sum(dim=1), torch.zeros_like(mask, dtype=torch.float32),
                                  mask, 0.0)
    else:
        torch.testing.assert_close(experience.scores, scores)
        expected = shaped_rewards(scores, torch.zeros_like(mask, dtype=torch.float32), mask, 0.0, teacher_rewards)
    torch.testing.assert_close(experience.rewards, expected, atol=1e-4, rtol=0)


def test_a_teacher_reads_the_samplers_logprobs_where_the_old_ones_come_from_the_update(zoo, tmp_path):
    """A teacher's reward needs the policy's log-probs before the update: from the built-in loop's
    own sampling, not a pass of their own; a sampler that keeps none (a generator given in Python)
    brings the old pass back."""
    plain = small_config(zoo, tmp_path, teacher=None, teacher_coef=None, estimator="grpo", kl_in="loss")
    assert old_logprobs_from_update(plain, None)
    distilling = small_config(zoo, tmp_path, estimator="grpo", kl_in="loss")
    assert old_logprobs_from_update(distilling, None, sampler_logprobs=True)
    assert not old_logprobs_from_update(distilling, None)
    trainer = PPOTrainer(distilling)
    assert trainer.generator.keeps_logprobs and trainer.old_logprobs_from_update
    old_passes = []
    trainer.policy_and_values = lambda part, run=trainer.policy_and_values: old_passes.append(part) or run(part)
    trainer.train()
    assert not old_passes  # the reference's and the teacher's passes only
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the sampler's log-probs and the update's agree to round-off (float32)
    assert all(m["rollout/logprob_diff_max"] < 1e-4 for m in metrics if "rollout/logprob_diff_max" in m)


def test_teacher_settings_that_do_nothing_or_cannot_work_are_refused(zoo, tmp_path):
    with pytest.raises(ConfigError, match="'teacher_coef'.*left out without --teacher"):
        small_config(zoo, tmp_path, teacher=None)
    with pytest.raises(ConfigError, match="'teacher_coef'.*> 0"):
        small_config(zoo, tmp_path, teacher_coef=0.0)
    with pytest.raises(ConfigError, match="'dynamic_sampling'.*off with --teacher"):
        small_config(zoo, tmp_path, estimator="grpo", dynamic_sampling=True)
    # A teacher is a reward of its own: alone, or with every other reward weighted 0.
    assert small_config(zoo, tmp_path, reward_fn=[]).teacher_coef == 0.5
    assert small_config(zoo, tmp_path, reward_weights=[0.0]).reward_weights == [0.0]
    assert small_config(zoo, tmp_path, teacher_coef=None).teacher_coef == 1.0


# ---------------------------------------------------------------- one tokenizer
def test_a_teacher_with_another_vocabulary_is_refused_before_any_model_loads(zoo, tmp_path, capsys):
    err = run_failing(["ppo", "--model", zoo["llama"], "--teacher", zoo["gpt2"], "--prompts", zoo["prompts"],
                       "--out", tmp_path / "run", "--num-threads", 1], capsys)
    assert f"--teacher {zoo['gpt2']} cannot score the student's tokens" in err
    assert "its tokenizer has 300 tokens, the student's 320" in err and "same tokenizer family" in err


def test_tokenizer_differences_are_named():
    llama = make_tokenizer("llama")
    assert tokenizer_difference(make_tokenizer("llama"), llama) is None
    other_eos = make_tokenizer("llama")
    other_eos.eos_token = "<s>"
    assert tokenizer_difference(other_eos, llama) == "its EOS token is '<s>' (id 0), the student's '</s>' (id 1)"
    # The same size and special tokens, two tokens at each other's ids.
    data = json.loads(llama.backend_tokenizer.to_str())
    (a, i), (b, j) = sorted(data["model"]["vocab"].items(), key=lambda item: item[1])[5:7]
    data["model"]["vocab"][a], data["model"]["vocab"][b] = j, i
    swapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(data)), bos_token="<s>",
                                      eos_token="</s>", pad_token="</s>")
    assert tokenizer_difference(swapped, llama) == f"token {a!r} is id {i} to the student and id {j} to the teacher"


# ---------------------------------------------------------------- LoRA: the teacher an adapter on the shared base
def test_a_lora_teacher_is_an_adapter_on_the_students_base_and_stays_frozen(zoo, tmp_path):
    """A --lora run's actor (an adapter on the zoo's llama) as the teacher of a --lora student on
    the same base: one base in memory, the teacher adapter's log-probs those of the adapter merged
    into its base, never trained, and not saved with the student."""
    teacher_run = tmp_path / "teacher"
    run(["ppo", "--model", zoo["llama"], "--lora", "--prompts", zoo["prompts"], "--reward-fn",
         f"{REWARDS_MODULE}:length_score", "--estimator", "grpo", "--samples-per-prompt", 2, "--batch-size", 4,
         "--mini-batch-size", 4, "--ppo-epochs", 1, "--max-new-tokens", 4, "--max-length", 32, "--iterations", 2,
         "--lr", 1e-2, "--eval-every", 0, "--save-every", 0, "--num-threads", 1, "--out", teacher_run])
    adapter = teacher_run / "checkpoints" / "actor"
    trainer = PPOTrainer(small_config(zoo, tmp_path, teacher=str(adapter), lora=True, estimator="grpo",
                                      reward_weights=[0.0]))
    assert trainer.teacher.model is None and "an adapter on the shared base" in trainer.teacher.description
    teacher_weights = {name: p.detach().clone() for name, p in trainer.actor.named_parameters() if ".teacher." in name}
    assert teacher_weights and not any(p.requires_grad for n, p in trainer.actor.named_parameters() if ".teacher." in n)
    rows = [r for r in trainer.run_parts.train_rows[:2] for _ in (0, 1)]
    experience, _ = trainer.make_experience(rows)
    with torch.no_grad():
        from_adapter = trainer.teacher_passes(experience.sequences)
        merged = load_causal_lm(adapter)  # the adapter folded into its base: the same model
        own = response_stats(merged, experience.sequences, PassPlan(pad_token_id=trainer.tokenizer.pad_token_id))
    torch.testing.assert_close(torch.where(experience.mask.bool(), from_adapter, 0.0),
                               torch.where(experience.mask.bool(), own.logprobs, 0.0), atol=1e-4, rtol=0)
    trainer.step(rows)
    for name, p in trainer.actor.named_parameters():
        if ".teacher." in name:
            assert torch.equal(p, teacher_weights[name]), name  # frozen
    assert trainer.actor.active_adapter == "policy"


def test_a_distillation_run_logs_the_reverse_kl_and_says_what_the_reward_is(zoo, tmp_path, capsys):
    run(["ppo", "--model", zoo["llama"], "--teacher", zoo["granite"], "--prompts", zoo["prompts"],
         "--estimator", "reinforce++", "--batch-size", 4, "--mini-batch-size", 4, "--ppo-epochs", 1,
         "--max-new-tokens", 4, "--max-length", 32, "--iterations", 2, "--eval-every", 0, "--save-every", 0,
         "--num-threads", 1, "--out", tmp_path / "run"])
    out = capsys.readouterr().out
    assert f"teacher:   {zoo['granite']}, frozen" in out
    assert "reward:    1 x -(log pi - log teacher) on each token the model wrote (on-policy distillation), per token" in out
    assert "warning: every response" not in out  # a score of 0 is no flat reward under a teacher
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["score"] == 0.0 and r["teacher/reverse_kl"] != 0.0 for r in records)


# ------------------------------------------------------------------ --teacher-in loss (GKD's divergence)
def test_teacher_in_loss_trains_on_the_exact_reverse_kl_and_adds_no_reward(zoo, tmp_path):
    """--teacher-in loss: the rollout's rewards hold no teacher term (its reverse KL is still
    logged), and the update's gradient is teacher_coef x the gradient of the exact reverse KL over
    the vocabulary, token-mean over the batch, on the student's own samples."""
    trainer = PPOTrainer(small_config(zoo, tmp_path, estimator="reinforce++", teacher_in="loss",
                                      reward_weights=[0.0], samples_per_prompt=1))
    experience, metrics = trainer.make_experience(trainer.run_parts.train_rows[:4])
    mask, sequences = experience.mask, experience.sequences
    assert metrics["teacher/reverse_kl"] != 0.0
    assert experience.rewards.abs().max() == 0 and experience.advantages.abs().max() == 0  # weight 0, no teacher term
    granite = load_causal_lm(zoo["granite"])
    plan = PassPlan(pad_token_id=trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        teacher_logits = response_stats(granite, sequences, plan).logits
    trainer.actor.train()
    student_logits = response_stats(trainer.actor, sequences, plan).logits
    expected = 0.5 * aggregate_loss(full_kl(student_logits, teacher_logits), mask, "token-mean")
    wanted = torch.autograd.grad(expected, [p for p in trainer.actor.parameters() if p.requires_grad])
    stats = trainer.accumulate_gradients(experience, torch.arange(4), warming_up=False)
    assert 0.5 * stats["teacher_loss"].item() == pytest.approx(expected.item(), rel=1e-5)
    got = [p.grad for p in trainer.actor.parameters() if p.requires_grad]
    for a, b in zip(got, wanted):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_the_exact_kl_between_two_output_paths_is_the_kl_of_their_logits(zoo):
    """A teacher of its own may keep the model's own logits where the policy takes the fused output
    layer (or the other way): the KL at the masked positions is the same either way."""
    from ppo_rlhf.rollout.passes import full_kl_between
    from ppo_rlhf.rollout.sequences import Sequences

    llama, granite = load_causal_lm(zoo["llama"]), load_causal_lm(zoo["granite"])
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 60, (2, 5), generator=generator)
    response_ids = torch.randint(3, 60, (2, 4), generator=generator)
    sequences = Sequences(prompt_ids, torch.ones_like(prompt_ids), response_ids,
                          torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    own, fused = PassPlan(pad_token_id=0), PassPlan(pad_token_id=0, fused=True)
    with torch.no_grad():
        both_own = full_kl_between(response_stats(llama, sequences, own), response_stats(granite, sequences, own),
                                   sequences.loss_mask)
        for policy_plan, other_plan in ((own, fused), (fused, own)):
            mixed = full_kl_between(response_stats(llama, sequences, policy_plan),
                                    response_stats(granite, sequences, other_plan), sequences.loss_mask)
            torch.testing.assert_close(mixed * sequences.loss_mask, both_own * sequences.loss_mask, atol=1e-5, rtol=1e-5)
    assert (both_own * sequences.loss_mask).sum() > 0


def test_teacher_in_loss_is_refused_without_a_teacher_and_said_in_the_plan(zoo, tmp_path):
    from ppo_rlhf.trainers.ppo_plan import teacher_reward

    with pytest.raises(ConfigError, match="'teacher_in'.*left out without --teacher"):
        small_config(zoo, tmp_path, teacher=None, teacher_coef=None, teacher_in="loss")
    line = teacher_reward(small_config(zoo, tmp_path, teacher_in="loss"))
    assert line.startswith("0.5 x the exact reverse KL to the teacher over the vocabulary") and "in the loss" in line
