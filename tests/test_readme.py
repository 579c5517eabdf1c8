"""The README's "Your own model" and LoRA commands run as written, on tiny models.

Each ``ppo-rlhf`` line of those two blocks runs in a folder holding what the README names
(``DIR``, ``sft.jsonl``, ``pairs.jsonl``, ``prompts.jsonl``, ``my_rewards.py``); only a small
budget is appended, so the test checks the commands, not the learning.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from zoo import PROMPTS, run, write_jsonl

README = Path(__file__).resolve().parents[1] / "README.md"
BUDGETS = {  # appended to each command: tiny, one thread
    "sft": ["--steps", 2, "--batch-size", 4],
    "rm": ["--steps", 2, "--batch-size", 4, "--eval-fraction", 0.25],
    "ppo": ["--iterations", 1, "--batch-size", 4, "--mini-batch-size", 2, "--ppo-epochs", 1, "--max-new-tokens", 4,
            "--max-length", 32, "--save-every", 0],
    "eval": ["--size", 2, "--max-new-tokens", 4, "--max-length", 32],
    "merge": [],
}


def readme_commands(after_heading: str) -> list[list[str]]:
    """The ``ppo-rlhf`` commands of the first bash block after ``after_heading``."""
    text = README.read_text()
    section = text[text.index(after_heading):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    block = block.replace("\\\n", " ")  # continued lines
    commands = []
    for line in block.splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("ppo-rlhf "):
            commands.append(shlex.split(line)[1:])
    return commands


@pytest.fixture
def user_folder(zoo, tmp_path, monkeypatch):
    """A working folder holding what the README's commands name."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "DIR").symlink_to(zoo["llama"], target_is_directory=True)
    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": p, "completion": " good answer"} for p in PROMPTS])
    write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": p, "chosen": " good answer", "rejected": " bad answer"}
                                           for p in PROMPTS] * 2)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in PROMPTS])
    (tmp_path / "my_rewards.py").write_text("def score(prompts, responses):\n"
                                            "    return [len(r) / 10 for r in responses]\n")
    return tmp_path


def test_the_readme_commands_run_as_written(user_folder):
    commands = readme_commands("### Your own model") + readme_commands("### LoRA: one base model")
    assert len(commands) >= 8, commands
    for command in commands:
        run([*command, *BUDGETS[command[0]], "--num-threads", 1] if command[0] != "merge" else command)
    assert (user_folder / "runs" / "my_merged" / "config.json").is_file()
    assert (user_folder / "runs" / "my_ppo_lora" / "checkpoints" / "actor" / "adapter_config.json").is_file()


def test_the_readme_python_example_runs_as_written(user_folder):
    from test_default_learning import users_tiny_model

    (user_folder / "DIR").unlink()
    users_tiny_model(user_folder / "DIR")  # 512 positions: room for the default 128 new tokens
    text = README.read_text()
    section = text[text.index("## From Python"):]  # the README's From Python section
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    torch.set_num_threads(1)
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 -- the README's own example
    summary = namespace["summary"]
    assert summary["iterations"] == 5 and (user_folder / "runs" / "from_python" / "checkpoints" / "actor").is_dir()
