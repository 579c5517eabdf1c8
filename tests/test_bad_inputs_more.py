"""More bad inputs (issue 24: nothing lost, nothing silent), none of them in test_bad_inputs.py.

Same rules: exit 2, no traceback, the culprit named.  They cover the declared ranges of the
numeric options (including values no per-field check caught: seeds, thread counts, widths,
non-finite numbers), YAML that loses or bends a value (a key given twice, a boolean given as a
number or a string, a number given as a boolean), options that do nothing in the chosen mode,
what a reward function returns or does, and library errors (peft, transformers, the file system)
that must come out as a message naming the flag, folder or file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from test_bad_inputs import (  # noqa: F401 -- broken is a fixture the cases use
    PROMPT, ROW, TEXT, Bad, assert_refused, broken, evaluate, fill, gym, ppo, rm_classes, rows, sft, write_files,
)

REWARD_RETURNS = '''
def a_dict(prompts, responses):
    return {"score": [1.0] * len(responses)}

def a_generator(prompts, responses):
    return (1.0 for _ in responses)

def numbers_as_text(prompts, responses):
    return ["1.5"] * len(responses)

def nothing(prompts, responses):
    return None

def nested(prompts, responses):
    return [[1.0] for _ in responses]

def one_number(prompts, responses):
    return 1.0

def a_set(prompts, responses):
    return {float(i) for i in range(len(responses))}

def exits(prompts, responses):
    import sys
    sys.exit(0)

def exits_with_code(prompts, responses):
    raise SystemExit(3)

def complex_numbers(prompts, responses):
    return [1j] * len(responses)
'''

DATA = {"data.jsonl": rows(ROW)}
PROMPTS = {"data.jsonl": rows(PROMPT)}
TEXTS = {"data.jsonl": rows(TEXT)}


def reward(name):
    return {"data.jsonl": rows(PROMPT), "returns.py": REWARD_RETURNS}, ["--reward-fn", "{tmp}/returns.py:" + name]


def ppo_reward(case_id, name, expect):
    files, flags = reward(name)
    return Bad(case_id, ppo(*flags), (name, *expect), files)


def yaml_case(case_id, base, text, expect):
    files = {sft: DATA, ppo: PROMPTS, gym: {}}[base]
    return Bad(case_id, base("--config", "{tmp}/config.yaml"), expect, {**files, "config.yaml": text})


def scratch_sft(*extra):
    """sft building its own tiny model for the built-in task (no --model, no --data)."""
    return ["sft", "--steps", 1, "--batch-size", 2, "--eval-every", 0, "--save-every", 0, "--out", "{out}",
            "--num-threads", 1, *extra]


def demo(*extra):
    return ["demo", "--out", "{out}", "--num-threads", 1, "--sft-steps", 1, "--rm-steps", 1, "--ppo-iterations", 1,
            *extra]


CASES = [
    # ------------------------------------------------------------ declared ranges: sft
    Bad("sft-seed-negative", sft("--seed", -1), ("'seed'", "0 <= seed <= 4294967295"), DATA),
    Bad("sft-num-threads-negative", sft("--num-threads", -1), ("'num_threads'", ">= 0"), DATA),
    Bad("sft-n-layer-zero", scratch_sft("--n-layer", 0), ("'n_layer'", "> 0")),
    Bad("sft-n-head-negative", scratch_sft("--n-head", -2), ("'n_head'", "> 0")),
    Bad("sft-n-embd-zero", scratch_sft("--n-embd", 0), ("'n_embd'", "> 0")),
    Bad("sft-weight-decay-negative", sft("--weight-decay", -0.1), ("'weight_decay'", ">= 0"), DATA),
    Bad("sft-lr-infinite", sft("--lr", "inf"), ("'lr'", "finite"), DATA),
    Bad("sft-max-grad-norm-nan", sft("--max-grad-norm", "nan"), ("'max_grad_norm'",), DATA),
    Bad("sft-eval-every-negative", sft("--eval-every", -5), ("'eval_every'", ">= 0"), DATA),
    Bad("sft-save-every-negative", sft("--save-every", -1), ("'save_every'", ">= 0"), DATA),
    Bad("sft-max-bad-steps-zero", sft("--max-bad-steps", 0), ("'max_bad_steps'", ">= 1"), DATA),
    Bad("sft-min-lr-ratio-above-one", sft("--min-lr-ratio", 1.5), ("'min_lr_ratio'",), DATA),
    Bad("sft-eval-fraction-negative", sft("--eval-fraction", -0.1), ("'eval_fraction'",), DATA),
    # ------------------------------------------------------------ declared ranges: rm
    Bad("rm-seed-negative", rm_classes("--seed", -3), ("'seed'",), TEXTS),
    Bad("rm-warmup-negative", rm_classes("--warmup-steps", -1), ("'warmup_steps'",), TEXTS),
    Bad("rm-max-length-zero", rm_classes("--max-length", 0), ("'max_length'",), TEXTS),
    Bad("rm-lora-r-zero", rm_classes("--lora", "--lora-r", 0), ("'lora_r'",), TEXTS),
    # ------------------------------------------------------------ declared ranges: ppo
    Bad("ppo-seed-negative", ppo("--seed", -1), ("'seed'", "0 <= seed <= 4294967295"), PROMPTS),
    Bad("ppo-num-threads-negative", ppo("--num-threads", -4), ("'num_threads'",), PROMPTS),
    Bad("ppo-lora-dropout-one", ppo("--lora", "--lora-dropout", 1), ("'lora_dropout'",), PROMPTS),
    Bad("ppo-lora-alpha-negative", ppo("--lora", "--lora-alpha", -1), ("'lora_alpha'",), PROMPTS),
    Bad("ppo-weight-decay-negative", ppo("--weight-decay", -1), ("'weight_decay'",), PROMPTS),
    Bad("ppo-kl-horizon-zero", ppo("--kl-horizon", 0), ("'kl_horizon'",), PROMPTS),
    Bad("ppo-lam-negative", ppo("--lam", -0.5), ("'lam'",), PROMPTS),
    Bad("ppo-reward-timeout-zero", ppo("--reward-timeout", 0), ("'reward_timeout'",), PROMPTS),
    Bad("ppo-reward-retries-negative", ppo("--reward-retries", -1), ("'reward_retries'",), PROMPTS),
    Bad("ppo-reward-backoff-negative", ppo("--reward-backoff", -1), ("'reward_backoff'",), PROMPTS),
    Bad("ppo-task-size-zero", ppo("--task-size", 0), ("'task_size'",), PROMPTS),
    Bad("ppo-format-reward-negative", ppo("--format-reward", -1), ("'format_reward'",), PROMPTS),
    Bad("ppo-task-reward-unknown", ppo("--task-reward", "partial"), ("--task-reward", "'score', 'exact'"), PROMPTS),
    Bad("ppo-clip-ratio-zero", ppo("--clip-ratio", 0), ("'clip_ratio'",), PROMPTS),
    Bad("ppo-clip-ratio-one", ppo("--clip-ratio", 1), ("'clip_ratio'",), PROMPTS),
    Bad("ppo-samples-per-prompt-zero", ppo("--samples-per-prompt", 0), ("'samples_per_prompt'",), PROMPTS),
    Bad("ppo-rollout-micro-batch-zero", ppo("--rollout-micro-batch-size", 0), ("'rollout_micro_batch_size'",), PROMPTS),
    Bad("ppo-vf-coef-negative", ppo("--vf-coef", -1), ("'vf_coef'",), PROMPTS),
    Bad("ppo-max-resample-rounds-negative", ppo("--max-resample-rounds", -1), ("'max_resample_rounds'",), PROMPTS),
    Bad("ppo-temperature-nan", ppo("--temperature", "nan"), ("'temperature'",), PROMPTS),
    Bad("ppo-kl-coef-infinite", ppo("--kl-coef", "inf"), ("'kl_coef'",), PROMPTS),
    Bad("ppo-entropy-coef-nan", ppo("--entropy-coef", "nan"), ("'entropy_coef'",), PROMPTS),
    Bad("ppo-max-new-tokens-zero", ppo("--max-new-tokens", 0), ("'max_new_tokens'",), PROMPTS),
    Bad("ppo-reward-weights-negative-infinity", ppo("--reward-weights=-inf"), ("'reward_weights'",), PROMPTS),
    # ------------------------------------------------------------ options that do nothing in the chosen mode
    Bad("ppo-critic-model-without-separate-critic", ppo("--critic-model", "{gpt2}"), ("critic_model", "separate"),
        PROMPTS),
    Bad("ppo-target-kl-with-kl-coef-zero", ppo("--target-kl", 0.1, "--kl-coef", 0), ("target_kl", "kl_coef"), PROMPTS),
    Bad("ppo-show-samples-without-eval-prompts", ppo("--show-samples", 2), ("show_samples", "--eval-prompts"), PROMPTS),
    # ------------------------------------------------------------ eval, demo, gym, convert-gguf
    Bad("eval-seed-negative", evaluate("--seed", -1), ("'seed'",), PROMPTS),
    Bad("eval-show-negative", evaluate("--show", -1), ("'show'",), PROMPTS),
    Bad("eval-max-new-tokens-zero", evaluate("--max-new-tokens", 0), ("'max_new_tokens'",), PROMPTS),
    Bad("eval-temperature-infinite", evaluate("--do-sample", "--temperature", "inf"), ("'temperature'",), PROMPTS),
    Bad("eval-temperature-without-do-sample", evaluate("--temperature", 0.5), ("'temperature'", "--do-sample"), PROMPTS),
    Bad("demo-seed-negative", demo("--seed", -1), ("'seed'",)),
    Bad("demo-show-samples-negative", demo("--show-samples", -1), ("'show_samples'",)),
    Bad("demo-num-threads-negative", demo("--num-threads", -1), ("'num_threads'",)),
    Bad("gym-seed-negative", gym("--seed", -1), ("'seed'",)),
    Bad("gym-lr-infinite", gym("--lr", "inf"), ("'lr'",)),
    Bad("gym-log-std-init-nan", gym("--log-std-init", "nan"), ("'log_std_init'",)),
    Bad("gym-hidden-size-zero", gym("--hidden-sizes", "64,0"), ("'hidden_sizes'",)),
    Bad("gym-eval-seed-negative", ["gym-eval", "{tmp}", "--seed", -1], ("'seed'",)),
    Bad("convert-gguf-num-threads-negative", ["convert-gguf", "--num-threads", -1, "--out", "{out}"],
        ("'num_threads'",)),
    # ------------------------------------------------------------ YAML that loses or bends a value
    yaml_case("sft-yaml-key-twice", sft, "steps: 1\nlr: 0.001\nsteps: 100000\n", ("steps", "twice")),
    yaml_case("ppo-yaml-key-twice", ppo, "kl_coef: 0.1\nkl_coef: 0.2\n", ("kl_coef", "twice")),
    yaml_case("gym-yaml-key-twice", gym, "lr: 0.001\nlr: 0.01\n", ("lr", "twice")),
    yaml_case("sft-yaml-bool-as-number", sft, "chat_template: 1\n", ("chat_template", "true or false")),
    yaml_case("ppo-yaml-bool-as-string", ppo, "score_norm: \"yes\"\n", ("score_norm", "true or false")),
    yaml_case("gym-yaml-bool-as-string", gym, "norm_adv: \"no\"\n", ("norm_adv", "true or false")),
    yaml_case("sft-yaml-number-as-bool", sft, "warmup_steps: true\n", ("'warmup_steps'",)),
    yaml_case("ppo-yaml-number-as-bool", ppo, "lr: false\n", ("'lr'",)),
    # ------------------------------------------------------------ what a reward function returns or does
    ppo_reward("ppo-reward-returns-a-dict", "a_dict", ("dict",)),
    ppo_reward("ppo-reward-returns-a-generator", "a_generator", ("generator",)),
    ppo_reward("ppo-reward-returns-numbers-as-text", "numbers_as_text", ("'1.5'",)),
    ppo_reward("ppo-reward-returns-none", "nothing", ("NoneType",)),
    ppo_reward("ppo-reward-returns-nested-lists", "nested", ("[1.0]",)),
    ppo_reward("ppo-reward-returns-one-number", "one_number", ("float",)),
    ppo_reward("ppo-reward-returns-a-set", "a_set", ("set",)),
    ppo_reward("ppo-reward-calls-sys-exit", "exits", ("SystemExit",)),
    ppo_reward("ppo-reward-raises-system-exit-3", "exits_with_code", ("SystemExit",)),
    ppo_reward("ppo-reward-returns-complex", "complex_numbers", ("1j",)),
    # ------------------------------------------------------------ library errors, translated
    Bad("ppo-lora-target-modules-match-nothing", ppo("--lora", "--lora-target-modules", "no_such_proj"),
        ("--lora-target-modules", "no_such_proj", "q_proj"), PROMPTS),
    Bad("rm-lora-target-modules-match-nothing", rm_classes("--lora", "--lora-target-modules", "attn.c_nothing"),
        ("--lora-target-modules", "attn.c_nothing"), TEXTS),
    Bad("merge-adapter-onto-wrong-base", ["merge", "--adapter", "{adapter}", "--base", "{gpt2}", "--out", "{out}"],
        ("{adapter}", "{gpt2}")),
    Bad("rm-tokenizer-without-pad-or-eos", rm_classes(), ("{no_pad_no_eos}", "pad"), TEXTS),
    Bad("sft-out-unwritable", sft(), ("--out", "/proc/ppo-rlhf-out"), DATA),
    Bad("sft-heads-do-not-divide-width-from-scratch", scratch_sft("--n-embd", 10, "--n-head", 4),
        ("n_head", "n_embd")),
    Bad("sft-model-heads-do-not-divide-width", sft(), ("{odd_heads}", "config.json"), DATA),
    Bad("eval-model-heads-do-not-divide-width", evaluate(), ("{odd_heads}", "config.json"), PROMPTS),
]

# Cases whose command line names a different model or --out than their base command.
OVERRIDES = {
    "rm-tokenizer-without-pad-or-eos": {"{llama}": "{no_pad_no_eos}"},
    "sft-out-unwritable": {"{out}": "/proc/ppo-rlhf-out"},
    "sft-model-heads-do-not-divide-width": {"{gpt2}": "{odd_heads}"},
    "eval-model-heads-do-not-divide-width": {"{llama}": "{odd_heads}"},
}


@pytest.fixture(scope="module")
def more_broken(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("more_broken")
    folders = {}
    folders["no_pad_no_eos"] = Path(shutil.copytree(zoo["gpt2"], root / "no_pad_no_eos"))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = folders["no_pad_no_eos"] / name
        if path.exists():
            path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items()
                                        if k not in ("eos_token", "pad_token", "bos_token", "unk_token")}))
    folders["odd_heads"] = Path(shutil.copytree(zoo["gpt2"], root / "odd_heads"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=300, n_embd=16, n_layer=1, n_head=2))
    model.save_pretrained(folders["odd_heads"])
    config = json.loads((folders["odd_heads"] / "config.json").read_text())
    (folders["odd_heads"] / "config.json").write_text(json.dumps({**config, "n_head": 3}))
    return folders


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_input_is_named_and_stops_the_run(case: Bad, zoo, broken, more_broken, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    places = {**{k: str(v) for k, v in zoo.items() if isinstance(v, (str, Path))},
              **{k: str(v) for k, v in broken.items()}, **{k: str(v) for k, v in more_broken.items()},
              "tmp": str(tmp_path), "out": str(tmp_path / "out")}
    write_files(tmp_path, case.files)
    args = [str(a) for a in case.args]
    for old, new in OVERRIDES.get(case.id, {}).items():
        args = [new if a == old else a for a in args]
    args = [fill(a, places) for a in args]
    assert_refused(args, case.expect, places, capsys)


def test_there_are_at_least_60_new_bad_inputs():
    from test_bad_inputs import CASES as EARLIER

    ids = {case.id for case in CASES}
    assert len(ids) == len(CASES) >= 60
    assert not ids & {case.id for case in EARLIER}
