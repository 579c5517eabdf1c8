"""What user code returns or does is checked (issue 24, item 2; docs/design.md, "Rewards").

A reward function returns one real number per response; one that raises or calls sys.exit is
reported by name with exit 2 and the run left resumable; a reward file named like a module it
would shadow (json.py) is loaded without replacing that module.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from ppo_rlhf.cli import main
from ppo_rlhf.rollout.reward import RewardError, load_function, validated_scores


@pytest.mark.parametrize("scores", [[1, 2.5, -3], (0.0, 1.0, 2.0), [True, False, True], np.array([1.0, 2.0, 3.0]),
                                    torch.tensor([1.0, 2.0, 3.0]), [np.float32(1), np.int64(2), 3]],
                         ids=["list", "tuple", "booleans", "numpy", "tensor", "numpy-scalars"])
def test_one_real_number_per_response_is_accepted(scores):
    out = validated_scores(scores, 3, "reward function f")
    assert out.dtype == torch.float32 and out.shape == (3,)
    assert out.tolist() == [float(s) for s in (scores.tolist() if hasattr(scores, "tolist") else scores)]


@pytest.mark.parametrize("scores, named", [
    ({"a": 1.0}, "dict"), ("1.0", "str"), ((s for s in [1.0, 2.0, 3.0]), "generator"), ({1.0, 2.0, 3.0}, "set"),
    (1.0, "float"), (None, "NoneType"), (["1", "2", "3"], "'1'"), ([1.0, None, 2.0], "None"),
    ([[1.0], [2.0], [3.0]], "[1.0]"), ([1j, 2, 3], "1j"), (torch.ones(3, 1), "Tensor"),
])
def test_anything_else_is_refused_naming_the_function_and_what_it_returned(scores, named):
    with pytest.raises(RewardError, match="reward function mod:f must return a list of numbers") as error:
        validated_scores(scores, 3, "reward function mod:f")
    assert named in str(error.value)


def test_a_reward_file_named_like_a_module_does_not_replace_it(tmp_path):
    real_json = sys.modules["json"]
    (tmp_path / "json.py").write_text("def score(prompts, responses):\n    return [1.0] * len(responses)\n")
    (tmp_path / "torch.py").write_text("def score(prompts, responses):\n    return [2.0] * len(responses)\n")
    assert load_function(f"{tmp_path}/json.py:score")(["p"], ["r"]) == [1.0]
    assert load_function(f"{tmp_path}/torch.py:score")(["p"], ["r"]) == [2.0]
    assert sys.modules["json"] is real_json and sys.modules["torch"] is torch
    assert json.dumps([1]) == "[1]"


def test_a_reward_file_with_a_free_name_keeps_it(tmp_path):
    (tmp_path / "my_unique_scores_24.py").write_text("def score(prompts, responses):\n    return [0.0]\n")
    function = load_function(f"{tmp_path}/my_unique_scores_24.py:score")
    assert function.__module__ == "my_unique_scores_24" and "my_unique_scores_24" in sys.modules


EXITS_ON_THIRD_CALL = '''
import os, sys

CALLS = []

def score(prompts, responses):
    CALLS.append(1)
    if os.environ.get("PPO_RLHF_TEST_EXIT") and len(CALLS) == 3:
        sys.exit(0)
    return [float(len(r)) for r in responses]
'''


def test_a_reward_that_calls_sys_exit_is_reported_and_the_run_resumes(zoo, tmp_path, capsys, monkeypatch):
    (tmp_path / "exits.py").write_text(EXITS_ON_THIRD_CALL)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"hello {i}"}) + "\n" for i in range(4)))
    out = tmp_path / "run"
    args = ["ppo", "--model", str(zoo["llama"]), "--prompts", str(tmp_path / "prompts.jsonl"), "--reward-fn",
            f"{tmp_path}/exits.py:score", "--iterations", "4", "--batch-size", "2", "--mini-batch-size", "2",
            "--ppo-epochs", "1", "--max-new-tokens", "4", "--max-length", "32", "--eval-every", "0",
            "--save-every", "1", "--sample-every", "0", "--out", str(out), "--num-threads", "1"]
    monkeypatch.setenv("PPO_RLHF_TEST_EXIT", "1")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "reward function" in err and "exits.py:score" in err and "SystemExit" in err and "Traceback" not in err
    last = out / "checkpoints" / "last"
    assert last.is_dir(), "the checkpoint of the iterations before the failure was lost"
    monkeypatch.delenv("PPO_RLHF_TEST_EXIT")
    assert main([*args, "--resume"]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary, summary
