"""Device and precision: a checkpoint stored in bfloat16 (as most hub models are) through ``sft``,
``rm`` and ``ppo`` in every critic mode, with and without bf16 autocast; value heads on a bf16
trunk; ``--device cpu`` against the default; the settings refused at start.

What must hold in a bf16 run: every tensor an optimizer steps (weights and Adam moments) is
float32 -- AdamW on bf16 weights drops the updates smaller than bf16's spacing -- while the
frozen roles (reference, reward model, the LoRA base) stay in the bf16 they were stored in.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from safetensors.torch import load_file
from transformers import AutoModel

from ppo_rlhf.config import ConfigError
from ppo_rlhf.hardware import check_launch, resolve_device
from ppo_rlhf.models.lora import AdapterRewardModel
from ppo_rlhf.models.value import ModelCritic, ValueHead
from ppo_rlhf.runlog import read_metrics
from ppo_rlhf.trainers.ppo import PPOTrainer
from zoo import REWARDS_MODULE, THREADS, run, run_failing, weights_changed

torch.set_num_threads(1)

MIXED = {"fp32": [], "bf16-autocast": ["--mixed-precision", "bf16"]}
LORA = ["--lora", "--lora-r", 4, "--lora-alpha", 8]
PAIRWISE = ["--mode", "pairwise", "--prompt-field", "query", "--chosen-field", "good", "--rejected-field", "bad",
            "--steps", 6, "--batch-size", 8, "--lr", 1e-2, "--eval-fraction", 0.25, *THREADS]
PPO_BUDGET = ["--iterations", 2, "--batch-size", 4, "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 8,
              "--max-length", 64, "--do-sample", "--lr", 1e-2, "--save-every", 0, *THREADS]


def stored_dtypes(folder: Path, weights: str = "model.safetensors") -> set[torch.dtype]:
    return {t.dtype for t in load_file(str(Path(folder) / weights)).values() if t.is_floating_point()}


@pytest.fixture
def trained_dtypes():
    """The dtypes of every tensor an optimizer steps during the test: weights and their state."""
    seen: set[torch.dtype] = set()

    def record(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                seen.add(parameter.dtype)
                seen.update(v.dtype for v in optimizer.state.get(parameter, {}).values()
                            if torch.is_tensor(v) and v.is_floating_point())

    handle = register_optimizer_step_pre_hook(record)
    yield seen
    handle.remove()


@pytest.fixture
def frozen_dtypes(monkeypatch):
    """The dtypes of PPO's frozen roles as each rollout begins: the reference (with LoRA, the
    base under the adapters) and a reward model of its own."""
    seen: dict[str, set[torch.dtype]] = {"ref": set(), "reward": set()}
    make_experience = PPOTrainer.make_experience

    def recording(self, rows, draw_more=None):
        if self.ref is not None:
            seen["ref"].update(p.dtype for p in self.ref.parameters())
        else:
            seen["ref"].update(p.dtype for name, p in self.actor.named_parameters() if "lora_" not in name)
        reward_model = getattr(self.reward, "model", None)
        if reward_model is not None and not isinstance(reward_model, AdapterRewardModel):
            seen["reward"].update(p.dtype for p in reward_model.parameters())
        return make_experience(self, rows, draw_more)

    monkeypatch.setattr(PPOTrainer, "make_experience", recording)
    return seen


@pytest.fixture(scope="module")
def bf16_rewards(zoo):
    """A pairwise reward model and a reward adapter, both trained on the bf16 llama."""
    root = zoo["root"]
    run(["rm", "--model", zoo["llama_bf16"], "--data", zoo["pairs"], "--out", root / "rm_bf16", *PAIRWISE])
    run(["rm", "--model", zoo["llama_bf16"], "--data", zoo["pairs"], "--out", root / "rm_lora_bf16", *PAIRWISE, *LORA])
    return {"model": root / "rm_bf16" / "checkpoints" / "reward",
            "adapter": root / "rm_lora_bf16" / "checkpoints" / "reward"}


# ---------------------------------------------------------------- heads
def test_value_head_on_a_bf16_trunk_gives_float32_values_and_gradients():
    head = ValueHead(8)
    hidden = torch.randn(2, 5, 8, dtype=torch.bfloat16, requires_grad=True)  # (B, T, H) of a bf16 trunk
    for autocast in (False, True):
        head.zero_grad()
        hidden.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            values = head(hidden)
        assert values.shape == (2, 5) and values.dtype == torch.float32
        values.sum().backward()
        assert head.summary.weight.dtype == torch.float32 and head.summary.weight.grad.abs().sum() > 0
        assert hidden.grad.dtype == torch.bfloat16 and hidden.grad.abs().sum() > 0


def test_critic_on_a_bf16_trunk(zoo):
    critic = ModelCritic(AutoModel.from_pretrained(zoo["llama_bf16"]))
    assert critic.backbone.dtype == torch.bfloat16 and critic.value_head.summary.weight.dtype == torch.float32
    ids = torch.tensor([[1, 5, 7, 9]])
    values = critic(ids, torch.ones_like(ids), torch.arange(4)[None])
    assert values.shape == (1, 4) and values.dtype == torch.float32
    values.sum().backward()
    assert critic.value_head.summary.weight.grad is not None


# ---------------------------------------------------------------- the three commands on a bf16 checkpoint
@pytest.mark.parametrize("mixed", MIXED)
def test_sft_on_a_bf16_checkpoint(zoo, tmp_path, trained_dtypes, mixed):
    out = tmp_path / "sft"
    run(["sft", "--model", zoo["llama_bf16"], "--data", zoo["data"]["jsonl"], "--prompt-field", "question",
         "--completion-field", "answer", "--steps", 3, "--batch-size", 4, "--lr", 1e-2, "--out", out, *THREADS,
         *MIXED[mixed]])
    assert trained_dtypes == {torch.float32}
    checkpoint = out / "checkpoints" / "sft"
    assert stored_dtypes(checkpoint) == {torch.bfloat16}  # saved as it came in
    assert weights_changed(zoo["llama_bf16"], checkpoint)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("mixed", MIXED)
def test_pairwise_rm_on_a_bf16_checkpoint(zoo, tmp_path, trained_dtypes, mixed, lora):
    out = tmp_path / "rm"
    run(["rm", "--model", zoo["llama_bf16"], "--data", zoo["pairs"], "--out", out, *PAIRWISE, *MIXED[mixed],
         *(LORA if lora else [])])
    assert trained_dtypes == {torch.float32}
    assert math.isfinite(json.loads((out / "summary.json").read_text())["eval_accuracy"])
    checkpoint = out / "checkpoints" / "reward"
    if lora:  # adapter and score head: float32, as trained
        assert stored_dtypes(checkpoint, "adapter_model.safetensors") == {torch.float32}
    else:
        assert stored_dtypes(checkpoint) == {torch.bfloat16}


@pytest.mark.parametrize("critic, lora", [("shared", False), ("separate", False), ("shared", True), ("lora", True)],
                         ids=["shared", "separate", "lora-shared", "lora-lora"])
@pytest.mark.parametrize("mixed", MIXED)
def test_ppo_on_a_bf16_checkpoint_in_each_critic_mode(zoo, bf16_rewards, tmp_path, trained_dtypes, frozen_dtypes,
                                                       mixed, critic, lora):
    out = tmp_path / "ppo"
    reward = bf16_rewards["adapter" if lora else "model"]
    run(["ppo", "--model", zoo["llama_bf16"], "--prompts", zoo["prompts"], "--reward-model", reward,
         "--critic", critic, "--out", out, *PPO_BUDGET, *MIXED[mixed], *(LORA if lora else [])])
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for key in ("score", "kl", "pg_loss", "vf_loss", "entropy"):
        assert all(math.isfinite(r[key]) for r in records), key
    assert trained_dtypes == {torch.float32}
    assert frozen_dtypes["ref"] == {torch.bfloat16}
    if not lora:
        assert frozen_dtypes["reward"] == {torch.bfloat16}
        actor = Path(json.loads((out / "summary.json").read_text())["checkpoints"]["actor"])
        assert stored_dtypes(actor) == {torch.bfloat16}  # saved as it came in
        assert weights_changed(zoo["llama_bf16"], actor)


def test_a_bf16_run_killed_midway_resumes_to_the_same_float32_weights(zoo, bf16_rewards, tmp_path):
    common = ["ppo", "--model", zoo["llama_bf16"], "--prompts", zoo["prompts"], "--reward-model", bf16_rewards["model"],
              "--critic", "separate", *PPO_BUDGET, "--save-every", 1, "--mixed-precision", "bf16"]
    run([*common, "--iterations", 3, "--out", tmp_path / "straight"])
    run([*common, "--iterations", 2, "--out", tmp_path / "resumed"])
    run([*common, "--iterations", 3, "--out", tmp_path / "resumed", "--resume"])
    last = [load_file(str(tmp_path / run_name / "checkpoints" / "last" / "trained.safetensors"))
            for run_name in ("straight", "resumed")]
    for role in ("actor", "critic"):
        assert any(k.startswith(f"{role}.") for k in last[0]), role
    assert {t.dtype for t in last[0].values()} == {torch.float32}  # the resume checkpoint keeps what trains
    assert last[0].keys() == last[1].keys() and all(torch.equal(last[0][k], last[1][k]) for k in last[0])


def test_eval_on_a_bf16_checkpoint_with_autocast(zoo, bf16_rewards, tmp_path):
    run(["eval", "--model", zoo["llama_bf16"], "--prompts", zoo["prompts"], "--reward-model", bf16_rewards["model"],
         "--max-new-tokens", 6, "--max-length", 32, "--mixed-precision", "bf16", "--out", tmp_path / "eval", *THREADS])
    assert math.isfinite(json.loads((tmp_path / "eval" / "summary.json").read_text())["score"])


# ---------------------------------------------------------------- the default device
def test_device_cpu_is_what_auto_picks_here_and_changes_nothing(zoo, tmp_path):
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("auto picks an accelerator on this machine")
    assert resolve_device("auto") == "cpu"
    args = ["ppo", "--model", zoo["llama"], "--prompts", zoo["prompts"], "--reward-fn",
            f"{REWARDS_MODULE}:length_score", *PPO_BUDGET]
    run([*args, "--out", tmp_path / "auto"])
    run([*args, "--out", tmp_path / "cpu", "--device", "cpu"])
    timing = ("time/", "tokens_per_s", "generated_tokens_per_s")
    auto, cpu = ([{k: v for k, v in r.items() if not k.startswith(timing)} for r in read_metrics(tmp_path / name / "metrics.jsonl")]
                 for name in ("auto", "cpu"))
    assert auto == cpu


# ---------------------------------------------------------------- settings refused at start
def refused(args, capsys, setting: str) -> str:
    err = run_failing(args, capsys)
    assert f"'{setting}'" in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("stage", ["sft", "rm", "ppo", "eval"])
def test_cuda_without_a_gpu_is_refused(tmp_path, capsys, stage):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "CUDA" in refused([stage, "--device", "cuda", "--out", tmp_path], capsys, "device")


def test_mps_without_apple_silicon_is_refused(tmp_path, capsys):
    if torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    assert "MPS" in refused(["ppo", "--device", "mps", "--out", tmp_path], capsys, "device")


def test_fp16_mixed_precision_on_a_cpu_is_refused(tmp_path, capsys):
    err = refused(["sft", "--device", "cpu", "--mixed-precision", "fp16", "--out", tmp_path], capsys, "mixed_precision")
    assert "bf16" in err  # what to use instead


def test_bf16_mixed_precision_on_a_gpu_without_bf16_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    err = refused(["ppo", "--device", "cuda", "--mixed-precision", "bf16", "--out", tmp_path], capsys,
                  "mixed_precision")
    assert "fp16" in err  # what to use instead


@pytest.mark.parametrize("distributed_type", ["FSDP", "DEEPSPEED", "MEGATRON_LM"])
def test_a_launch_that_shards_the_models_is_refused_by_name(distributed_type):
    with pytest.raises(ConfigError, match=f"distributed_type {distributed_type} shards the models.*MULTI_GPU"):
        check_launch(distributed_type)


@pytest.mark.parametrize("distributed_type", ["NO", "MULTI_CPU", "MULTI_GPU"])
def test_data_parallel_launches_are_accepted(distributed_type):
    check_launch(distributed_type)


def test_sft_rm_and_ppo_take_an_fsdp_launch_and_the_other_stages_refuse_it(monkeypatch):
    check_launch("FSDP", shards=True)
    # On a CPU accelerate reports an FSDP launch as MULTI_CPU: its environment gives it away.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="distributed_type FSDP shards the models.*sft, rm and ppo"):
        check_launch("MULTI_CPU")
    for refused_anyway in ("DEEPSPEED", "MEGATRON_LM"):
        with pytest.raises(ConfigError, match=refused_anyway):
            check_launch(refused_anyway, shards=True)


@pytest.mark.parametrize("stage, variable, value, message", [
    ("sft", "FSDP_VERSION", "1", "fsdp_version 1.*allowed fsdp_version: 2"),
    ("sft", "FSDP_OFFLOAD_PARAMS", "true", "fsdp_offload_params is true.*allowed false"),
    ("rm", "FSDP_ACTIVATION_CHECKPOINTING", "true", "fsdp_activation_checkpointing is true.*allowed false"),
    ("rm", "FSDP_SHARDING_STRATEGY", "HYBRID_SHARD", "fsdp_sharding_strategy HYBRID_SHARD.*FULL_SHARD or SHARD_GRAD_OP"),
])
def test_an_fsdp_setting_ppo_rlhf_does_not_follow_is_named_at_start(tmp_path, capsys, monkeypatch, stage, variable,
                                                                    value, message):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv(variable, value)
    err = run_failing([stage, "--out", tmp_path / "run"], capsys)
    assert re.search(message, err) and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("stage", ["rm", "ppo"])
def test_lora_under_an_fsdp_launch_is_refused(tmp_path, capsys, monkeypatch, stage):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    err = refused([stage, "--model", tmp_path, "--lora", "--out", tmp_path / "run"], capsys, "lora")
    assert "gpus_ddp.yaml" in err
