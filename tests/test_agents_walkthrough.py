"""docs/agents.md's walk from a user's own environment to a trained agent runs as written (issue 63):
its environment class and reward, its script that writes TRL-format traces, then each command --
``sft --recipe agents-warm-up``, ``eval``, ``ppo --recipe agents-grpo`` and ``agents-ppo``,
``merge`` -- on a tiny model, with only a small budget appended (flags given after a recipe win
over its settings), so the test checks the commands and the data, not the learning."""

from __future__ import annotations

import json
import re
import runpy
import shlex
import shutil
from pathlib import Path

import pytest

from ppo_rlhf.envs.options import tool_template_path
from zoo import run

AGENTS = Path(__file__).resolve().parents[1] / "docs" / "agents.md"
SECTION = "## From your own environment to a trained agent"
EPISODE = ["--max-new-tokens", 8, "--max-turns", 2]
BUDGETS = {  # appended to each command: tiny, one thread
    "sft": ["--steps", 2, "--batch-size", 2],
    "eval": ["--size", 2, *EPISODE],
    "ppo": ["--iterations", 1, "--batch-size", 4, "--samples-per-prompt", 2, "--mini-batch-size", 4, "--eval-size", 2,
            "--save-every", 0, *EPISODE],
    "merge": [],
}


def walkthrough() -> tuple[list[str], list[list[str]]]:
    """The section's Python blocks, and the ``ppo-rlhf`` commands of its bash block."""
    text = AGENTS.read_text()
    section = text[text.index(SECTION):]
    section = section[:section.find("\n## ", 1)] if "\n## " in section[1:] else section
    code = re.findall(r"```python\n(.*?)```", section, re.S)
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [shlex.split(line)[1:] for line in block.splitlines() if line.startswith("ppo-rlhf ")]
    return code, commands


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_walk_from_a_trl_environment_to_a_trained_agent_runs_as_written(tmp_path, monkeypatch, capsys):
    from test_default_learning import users_tiny_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    users_tiny_model(tmp_path / "DIR", arch="qwen2", positions=1024)  # room for the tools' prompt
    shutil.copy(tool_template_path(), tmp_path / "TEMPLATE")
    code, commands = walkthrough()
    files = {block.splitlines()[0].removeprefix("# "): block for block in code}
    assert set(files) == {"my_env.py", "traces.py"}, list(files)
    for name, block in files.items():
        (tmp_path / name).write_text(block)
    runpy.run_path("traces.py", run_name="__main__")
    traces = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert len(traces) == 20 and traces[0]["messages"][1]["tool_calls"][0]["function"]["name"] == "guess"
    assert [c[0] for c in commands] == ["sft", "eval", "ppo", "ppo", "merge"], commands
    for command in commands:
        run([*command, *BUDGETS[command[0]], *(["--num-threads", 1] if command[0] != "merge" else [])])
    printed = capsys.readouterr().out
    assert "ppo-rlhf sft: recipe agents-warm-up (--chat-template --steps 16" in printed
    assert "given over it: --steps 2, --batch-size 2" in printed  # the budget's flags win over the recipe's
    assert "recipe:    agents-grpo" in printed and "recipe:    agents-ppo" in printed
    summary = json.loads((tmp_path / "runs" / "warm" / "summary.json").read_text())
    assert summary["rows"] == 19  # one row a conversation; --eval-fraction's one held out
    assert (tmp_path / "runs" / "agent" / "config.json").is_file()
    assert (tmp_path / "runs" / "ppo" / "checkpoints" / "critic").is_dir()
