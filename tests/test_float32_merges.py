"""Issue 57: an adapter trained on a 16-bit base keeps its update wherever it is merged.

Such an adapter holds float32 weights, and its update is smaller than half a bf16 ulp of most of
the weights it changes: merged into the base and held in bf16, it is rounded away.  Every path
that merges an adapter goes through ``models/loading.py`` (``load_adapter_as_model``, the merge
``merge_in_float32``), which holds it in float32 at ``--dtype auto``: checked here against peft's
own merge into the base read in float32, for ``merge`` (and the dtype it saves), a ``--teacher``
on another base, a reward model, ``--model`` and a local ``--reward-judge``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from ppo_rlhf.config import build_config
from ppo_rlhf.models import load_causal_lm
from ppo_rlhf.rollout.judge import make_judge
from ppo_rlhf.trainers.ppo_config import PPOConfig
from ppo_rlhf.trainers.roles import load_roles
from zoo import REWARDS_MODULE, run, run_failing

Q = "model.layers.0.self_attn.q_proj.weight"


def adapter_on(base: Path, folder: Path, task_type: str) -> Path:
    """A LoRA adapter on the bf16 ``base`` with float32 weights of about 0.002: an update of about
    1e-5, under half a bf16 ulp of most weights (as after a short run), saved with the tokenizer."""
    if task_type == "SEQ_CLS":
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                            task_type=task_type))
    torch.manual_seed(0)
    for name, parameter in peft.named_parameters():
        if "lora_" in name:
            parameter.data = torch.randn_like(parameter, dtype=torch.float32) * 0.002
    peft.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapters(zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16_adapters")
    return {"policy": adapter_on(zoo["llama_bf16"], root / "policy", "CAUSAL_LM"),
            "reward": adapter_on(zoo["llama_bf16"], root / "reward", "SEQ_CLS")}


def float32_merge(zoo, adapter: Path) -> dict[str, torch.Tensor]:
    """peft's merge of ``adapter`` into its base read in float32 (bf16 -> float32 is exact)."""
    if json.loads((adapter / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS":
        base = AutoModelForSequenceClassification.from_pretrained(zoo["llama_bf16"], num_labels=1, dtype=torch.float32)
    else:
        base = AutoModelForCausalLM.from_pretrained(zoo["llama_bf16"], dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).merge_and_unload().state_dict()


def assert_float32_merge(weights: dict[str, torch.Tensor], zoo, adapter: Path, dtype=torch.float32) -> None:
    """``weights`` are the float32 merge of ``adapter``, held in ``dtype`` (rounded once to it)."""
    expected = float32_merge(zoo, adapter)
    assert set(weights) == set(expected)
    for name, tensor in weights.items():  # the values first: a merge held in bf16 differs at the adapted weights
        torch.testing.assert_close(tensor.float(), expected[name].to(dtype).float(), rtol=0, atol=0, msg=name)
    assert {name: tensor.dtype for name, tensor in weights.items()} == dict.fromkeys(weights, dtype)


def small_config(zoo, **overrides) -> PPOConfig:
    return build_config(PPOConfig, {
        "model": str(zoo["llama"]), "prompts": str(zoo["prompts"]), "reward_fn": f"{REWARDS_MODULE}:length_score",
        "estimator": "grpo", "samples_per_prompt": 2, "batch_size": 4, "mini_batch_size": 4, "max_new_tokens": 4,
        "max_length": 32, "num_threads": 1, **overrides})


def test_the_update_is_one_that_a_bf16_merge_loses(zoo, adapters):
    """The premise of every test here: the update moves nearly every adapted weight, and a merge
    held in bf16 keeps under half of those moves."""
    bf16 = AutoModelForCausalLM.from_pretrained(zoo["llama_bf16"], dtype=torch.bfloat16).state_dict()[Q].float()
    merged = float32_merge(zoo, adapters["policy"])[Q]
    assert (merged != bf16).float().mean() > 0.99
    assert (merged.to(torch.bfloat16).float() != bf16).float().mean() < 0.5


def test_merge_saves_the_float32_merge_unless_asked_otherwise(zoo, adapters, tmp_path, capsys):
    run(["merge", "--adapter", adapters["policy"], "--out", tmp_path / "merged"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["dtype"] == "float32" and summary["base"] == str(zoo["llama_bf16"])
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "float32"
    assert_float32_merge(load_file(str(tmp_path / "merged" / "model.safetensors")), zoo, adapters["policy"])
    # A reward adapter merges into a float32 classifier the same way.
    run(["merge", "--adapter", adapters["reward"], "--out", tmp_path / "merged_rm"])
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"
    assert_float32_merge(load_file(str(tmp_path / "merged_rm" / "model.safetensors")), zoo, adapters["reward"])
    # Asked for bf16 (or the base's own dtype, bf16 here): the float32 merge rounded once.
    for dtype in ("bfloat16", "auto"):
        out = tmp_path / f"merged_{dtype}"
        run(["merge", "--adapter", adapters["policy"], "--out", out, "--dtype", dtype])
        assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
        assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
        assert_float32_merge(load_file(str(out / "model.safetensors")), zoo, adapters["policy"], torch.bfloat16)


@pytest.mark.parametrize("lora", [False, True])
def test_a_teacher_adapter_on_another_base_is_merged_in_float32(zoo, adapters, lora):
    # The student is the zoo's float32 Llama; the teacher an adapter on its bf16 copy (same tokenizer).
    roles = load_roles(small_config(zoo, teacher=str(adapters["policy"]), teacher_coef=0.5, lora=lora), None)
    assert roles.teacher.model is not None  # a model of its own, not an adapter on the student's base
    assert_float32_merge(roles.teacher.model.state_dict(), zoo, adapters["policy"])


@pytest.mark.parametrize("lora", [False, True])
def test_a_reward_adapter_on_another_base_is_merged_in_float32(zoo, adapters, lora):
    roles = load_roles(small_config(zoo, reward_model=str(adapters["reward"]), reward_fn=[], lora=lora), None)
    model_reward = roles.reward.parts[0]
    assert_float32_merge(model_reward.model.state_dict(), zoo, adapters["reward"])


def test_an_adapter_given_as_the_model_is_merged_in_float32(zoo, adapters):
    roles = load_roles(small_config(zoo, model=str(adapters["policy"])), None)
    assert_float32_merge(roles.actor.state_dict(), zoo, adapters["policy"])
    assert_float32_merge(roles.ref.state_dict(), zoo, adapters["policy"])


def test_a_local_judge_adapter_is_merged_in_float32(zoo, adapters):
    # token: scoring, whose template and --max-length fit the zoo model's 128 positions with no answer to write
    judge = make_judge(small_config(zoo, reward_judge=str(adapters["policy"]), judge_score="token:the"))
    judge.load()
    assert_float32_merge(judge.model.state_dict(), zoo, adapters["policy"])


def test_a_dtype_given_by_name_holds_the_float32_merge_rounded_once(zoo, adapters):
    assert_float32_merge(load_causal_lm(adapters["policy"], torch.bfloat16).state_dict(), zoo, adapters["policy"],
                         torch.bfloat16)


def test_merge_onto_a_base_that_is_no_model_names_the_base_the_adapter_records(zoo, adapters, tmp_path, capsys):
    err = run_failing(["merge", "--adapter", adapters["policy"], "--base", tmp_path / "nowhere", "--out",
                       tmp_path / "out"], capsys)
    assert f"--base {tmp_path / 'nowhere'} is not a model folder" in err
    assert f"records its base as {zoo['llama_bf16']}" in err and "leave --base out" in err
    assert "was trained on" not in err  # it was trained on the base it records, not on the one given


def test_the_plan_names_every_adapter_held_and_merged_in_float32(zoo, adapters):
    """The run's plan says which adapters are held in float32 (twice their base's memory) and how
    to keep them in bf16; a --lora run's own adapters on its shared base are not merged."""
    from ppo_rlhf.trainers.roles import float32_merge_note, float32_merges

    config = small_config(zoo, teacher=str(adapters["policy"]), reward_judge=str(adapters["policy"]))
    merges = float32_merges(config)
    assert merges == [str(adapters["policy"])]
    assert "merged in float32" in float32_merge_note(merges) and "--dtype bfloat16" in float32_merge_note(merges)
    assert float32_merges(small_config(zoo)) == []
