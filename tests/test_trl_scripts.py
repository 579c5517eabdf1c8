"""TRL's own scripts run here with their imports changed to ppo_rlhf.trl and nothing else
(tests/trl_scripts/, issue 58): TRL 0.23's PPO example and the last one of TRL's PPO (trl.experimental.ppo),
TRL 1.16's GRPO and RLOO quick starts, its environment_factory example and its OpenEnv echo script.

Each copy carries TRL's import lines and the sha256 of TRL's text: the first test restores the
lines and checks the hash, so a script changed in any other way fails.  A script that names a
model or a data set on the Hub is given local tiny ones, as a user without a network would: on
its command line, or (a documentation snippet that writes them in) by those names replaced in
the copy the test runs; a run's length (the docs' max_steps=1000, the echo script's 3 epochs) is cut the
same way to a test's."""

from __future__ import annotations

import hashlib
import json
import re
import runpy
import sys
import types
from pathlib import Path

import datasets
import pytest

from zoo import PROMPTS, CallsFirst, family_model, pythia_like

SCRIPTS = Path(__file__).parent / "trl_scripts"
MODULES = {"trl": "ppo_rlhf.trl", "trl.trainer.utils": "ppo_rlhf.trl.utils", "trl.rewards": "ppo_rlhf.trl.rewards",
           "trl.experimental.ppo": "ppo_rlhf.trl"}
MARK = "# ---- TRL's text from here ----\n"


def trls_text(path: Path) -> tuple[str, str]:
    """(TRL's text, restored from the copy's recorded import lines; the sha256 the copy records)."""
    header, body = path.read_text().split(MARK, 1)
    digest = re.search(r"sha256 of TRL's text: (\w+)", header).group(1)
    lines = body.split("\n")
    for number, original in re.findall(r"#   line (\d+): (.*)", header):
        ours = lines[int(number) - 1]
        module = re.match(r"from ([\w.]+) import ", original).group(1)
        assert ours == original.replace(f"from {module} import", f"from {MODULES[module]} import", 1), ours
        lines[int(number) - 1] = original
    return "\n".join(lines), digest


@pytest.mark.parametrize("name", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_a_script_is_trls_but_for_its_imports(name):
    text, digest = trls_text(SCRIPTS / name)
    assert hashlib.sha256(text.encode()).hexdigest() == digest, f"{name} differs from TRL's beyond its imports"
    body = (SCRIPTS / name).read_text().split(MARK, 1)[1]
    assert not re.search(r"^\s*(from trl[. ]|import trl\b)", body, re.M), f"{name} still imports TRL"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """load_dataset reads local folders and caches them under the test's folder; the run's cwd is it."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def data_folder(folder: Path, splits: dict[str, list[dict]]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(folder)


def run_script(name: str, argv: list[str], monkeypatch, folder: Path, names: dict[str, str] | None = None) -> None:
    """The script as __main__ with ``argv``; ``names``: text the copy run replaces (Hub names, a
    run length), the stored copy staying TRL's."""
    path = SCRIPTS / name
    if names:
        text = path.read_text()
        for old, new in names.items():
            assert old in text, old
            text = text.replace(old, new)
        path = folder / name
        path.write_text(text)
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    runpy.run_path(str(path), run_name="__main__")


def metrics_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- TRL's PPO scripts
PPO_BUDGET = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--total_episodes", "4",
              "--response_length", "6", "--num_ppo_epochs", "1", "--local_rollout_forward_batch_size", "2",
              "--missing_eos_penalty", "1.0", "--report_to", "none"]


def test_trls_ppo_script_runs_as_written(offline, monkeypatch, capsys):
    model = str(pythia_like(offline / "pythia"))
    prompts = [{"prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}"} for i in range(104)]  # the script keeps 100 for eval
    data = data_folder(offline / "descriptiveness", {"train": prompts})
    out = offline / "ppo-run"
    run_script("ppo.py", ["--dataset_name", data, "--dataset_train_split", "train", "--output_dir", str(out),
                          "--learning_rate", "3e-6", "--model_name_or_path", model, "--sft_model_path", model,
                          "--reward_model_path", model, *PPO_BUDGET], monkeypatch, offline)
    metrics = metrics_of(out)
    assert len([m for m in metrics if "objective/kl" in m]) == 2  # 4 episodes, 2 a batch
    assert {"objective/scores", "objective/rlhf_reward", "policy/approxkl_avg", "loss/value_avg", "episode", "kl",
            "score"} <= set(metrics[-1])
    assert (out / "summary.json").is_file() and (out / "checkpoints" / "critic").is_dir()
    assert (out / "config.json").is_file()  # trainer.save_model(output_dir): the policy, as TRL saves it
    printed = capsys.readouterr().out
    assert "stop_token: a response ends at EOS here" in printed and "held-out completions" in printed


def test_trls_last_ppo_script_runs_with_lora_and_a_test_split(offline, monkeypatch):
    model = str(pythia_like(offline / "pythia"))
    rows = [{"prompt": f"SUBREDDIT: r/test\nPOST: {p}\nTL;DR:"} for p in PROMPTS]
    data = data_folder(offline / "tldr", {"train": rows, "validation": rows[:2]})
    out = offline / "tldr-run"
    run_script("ppo_tldr.py", ["--dataset_name", data, "--dataset_test_split", "validation", "--output_dir", str(out),
                               "--model_name_or_path", model, "--sft_model_path", model, "--reward_model_path", model,
                               "--stop_token", "eos", "--eval_strategy", "steps", "--eval_steps", "1", "--use_peft",
                               *PPO_BUDGET], monkeypatch, offline)
    metrics = metrics_of(out)
    assert sum("eval/score" in m for m in metrics) == 3  # before, and after each of the 2 iterations
    assert (out / "checkpoints" / "actor" / "adapter_config.json").is_file()  # peft_config: a LoRA policy


# ---------------------------------------------------------------- TRL 1.16's GRPO and RLOO programs
@pytest.fixture
def qwen3(tmp_path_factory) -> str:
    return str(family_model("qwen3", tmp_path_factory.mktemp("qwen3") / "model", positions=2048))


MATH = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? Answer in \\boxed{{}}."}], "solution": str(2 * i)}
        for i in range(1, 5)]


def test_trls_grpo_quick_start_runs_as_written(offline, monkeypatch, qwen3):
    data = data_folder(offline / "deepmath", {"train": MATH[:1]})
    run_script("grpo_quickstart.py", [], monkeypatch, offline,
               {"Qwen/Qwen2.5-0.5B-Instruct": qwen3, "trl-lib/DeepMath-103K": data})
    metrics = metrics_of(offline / "model-GRPO")  # TRL's default output_dir, named after the model (its folder here)
    assert len(metrics) == 3  # num_train_epochs 3 over one prompt, 8 completions a generation
    assert all("rewards/accuracy_reward/mean" in m for m in metrics)


def test_trls_rloo_quick_start_runs_as_written(offline, monkeypatch, qwen3):
    data = data_folder(offline / "deepmath", {"train": MATH})
    run_script("rloo_quickstart.py", [], monkeypatch, offline,
               {"Qwen/Qwen2-0.5B-Instruct": qwen3, "trl-lib/DeepMath-103K": data})
    metrics = metrics_of(offline / "model-RLOO")
    assert len(metrics) == 3 and metrics[0]["kl_coef"] == 0.05  # RLOO's beta


def scripted(monkeypatch, call: str) -> None:
    """The run's rollout engine writes ``call`` first in every episode: a tiny random model calls no
    tool of its own, and the programs' rewards read what the calls did."""
    from ppo_rlhf.trainers import ppo_setup

    monkeypatch.setattr(ppo_setup, "make_generator", lambda config, tokenizer, actor, accelerator:
                        CallsFirst(tokenizer, call))


def test_trls_environment_example_runs_as_written(offline, monkeypatch, qwen3, capsys):
    scripted(monkeypatch, '<tool_call>\n{"name": "increment", "arguments": {"step": 3}}\n</tool_call>')
    run_script("grpo_environment.py", [], monkeypatch, offline,
               {"Qwen/Qwen3-0.6B": qwen3, "max_steps=1000": "max_steps=1"})
    out = offline / "trainer_output"  # TRL's default output_dir of a GRPOConfig given
    assert len(metrics_of(out)) == 1
    plan = capsys.readouterr().out  # the run says what it does that TRL would not
    assert "reset() seeded per prompt group" in plan and "episodes render with ppo-rlhf's training template" in plan
    for sample in [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]:
        target = int(sample["prompt"][-1]["content"].split("by ")[1].rstrip("."))  # reset() drew it, said it
        assert "[tool] 3" in sample["response"] and sample["score"] == float(target == 3)  # get_reward


def test_trls_openenv_echo_script_runs_as_written(offline, monkeypatch, qwen3):
    """OpenEnv's Echo client answers in-process here (its package reaches a server)."""
    echo_env, models = types.ModuleType("echo_env"), types.ModuleType("echo_env.models")

    class EchoAction:
        def __init__(self, message):
            self.message = message

    class EchoEnv:
        def __init__(self, base_url):
            self.base_url = base_url

        def step(self, action):
            observation = types.SimpleNamespace(echoed_message=action.message, reward=len(action.message) / 10)
            return types.SimpleNamespace(observation=observation)

    echo_env.EchoEnv, models.EchoAction, echo_env.models = EchoEnv, EchoAction, models
    monkeypatch.setitem(sys.modules, "echo_env", echo_env)
    monkeypatch.setitem(sys.modules, "echo_env.models", models)
    scripted(monkeypatch, '<tool_call>\n{"name": "echo", "arguments": {"message": "Hello World!"}}\n</tool_call>')
    run_script("echo.py", ["--model", qwen3, "--env-host", "http://localhost:1"], monkeypatch, offline,
               {"logging_steps=2,": "logging_steps=2, max_steps=2,"})  # its 3 epochs cut to a test's 2 steps
    metrics = metrics_of(offline / "trainer_output")  # TRL's default output_dir
    assert len(metrics) == 2 and all(m["score"] == pytest.approx(1.2) for m in metrics)  # len("Hello World!") / 10
    rollouts = [json.loads(line) for line in (offline / "trainer_output" / "rollouts" / "iteration_0001.jsonl")
                .read_text().splitlines()]  # log_completions=True: each iteration's rollouts kept
    assert rollouts[0]["messages"][1] == {"role": "tool", "name": "echo", "content": "Hello World!"}
