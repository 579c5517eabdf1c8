"""Run folders never mix, nothing is lost: refusals, --overwrite, --resume and its checks,
recovery from what a kill leaves behind, strict JSON."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ppo_rlhf.checkpoint import atomic_write_json, recover_interrupted_writes
from ppo_rlhf.runlog import read_metrics
from zoo import RULE, TINY, run, run_failing


def sft_args(out, *extra):
    return ["sft", "--task", "doubling", "--steps", 4, "--batch-size", 16, "--eval-every", 0, "--out", out, *TINY, *extra]


def ppo_args(model, out, *extra):
    return ["ppo", "--task", "doubling", "--model", model, "--out", out, "--batch-size", 8, "--mini-batch-size", 4,
            "--ppo-epochs", 1, "--max-new-tokens", 7, "--max-length", 19, "--eval-every", 0, "--eval-size", 16,
            "--lr", 1e-4, "--num-threads", 1, *RULE, *extra]


def test_a_second_run_into_the_same_folder_is_refused_and_changes_nothing(tmp_path, capsys):
    out = tmp_path / "sft"
    run(sft_args(out))
    metrics = (out / "metrics.jsonl").read_text()
    err = run_failing(sft_args(out), capsys)
    assert f"--out {out} already holds a run" in err and "--overwrite" in err and "--resume" in err
    assert (out / "metrics.jsonl").read_text() == metrics
    run(sft_args(out, "--overwrite"))  # replaces it: one run's rows, not two
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [r["step"] for r in map(json.loads, metrics.splitlines())]


def test_resume_without_a_checkpoint_fails_clearly(tiny_sft_model, tmp_path, capsys):
    err = run_failing(ppo_args(tiny_sft_model, tmp_path / "new", "--iterations", 2, "--resume"), capsys)
    assert "nothing to resume" in err and "drop --resume" in err
    assert not (tmp_path / "new" / "metrics.jsonl").exists()
    err = run_failing(ppo_args(tiny_sft_model, tmp_path / "new", "--resume", "--overwrite"), capsys)
    assert "contradict" in err


def test_resume_refuses_changed_meaning_and_takes_a_new_learning_rate(tiny_sft_model, tmp_path, capsys):
    out = tmp_path / "ppo"
    run(ppo_args(tiny_sft_model, out, "--iterations", 1, "--save-every", 1))
    err = run_failing(ppo_args(tiny_sft_model, out, "--iterations", 2, "--resume", "--kl-coef", 0.9, "--critic", "separate"),
                capsys)
    assert "kl_coef: 0.05 -> 0.9" in err and "critic: 'shared' -> 'separate'" in err
    other_model = tmp_path / "other"
    shutil.copytree(tiny_sft_model, other_model)  # the same shape: it would silently swap the KL reference
    err = run_failing(ppo_args(other_model, out, "--iterations", 2, "--resume"), capsys)
    assert "model:" in err
    run(ppo_args(tiny_sft_model, out, "--iterations", 2, "--resume", "--lr", 5e-4))
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "after iteration 1 of 2" in printed and "lr 0.0005" in printed
    state = torch.load(out / "checkpoints" / "last" / "trainer_state.pt", weights_only=False)
    assert state["optimizer"]["param_groups"][0]["lr"] == 5e-4


def test_resume_keeps_the_starting_evaluation_and_drops_a_torn_line(tiny_sft_model, tmp_path, capsys):
    out = tmp_path / "ppo"
    run(ppo_args(tiny_sft_model, out, "--iterations", 2, "--save-every", 1, "--eval-every", 1))
    first = json.loads((out / "summary.json").read_text())
    # A kill mid-write leaves a torn last line; a kill between the two renames of the checkpoint
    # swap leaves the new checkpoint in staging and the old one moved aside.
    with (out / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 3, "sco')
    last = out / "checkpoints" / "last"
    shutil.copytree(last, out / "checkpoints" / ".last.tmp-abc")
    last.rename(out / "checkpoints" / ".last.old-123")
    run(ppo_args(tiny_sft_model, out, "--iterations", 3, "--save-every", 1, "--eval-every", 1, "--resume"))
    printed = capsys.readouterr().out
    assert "dropped a torn last line" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"] == first["before"]  # the SFT model's evaluation, not the resumed one's
    assert summary["ppo_seconds"] >= first["ppo_seconds"]
    assert summary["training_score"]["first"] == first["training_score"]["first"]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]


def test_recovery_of_an_interrupted_swap(tmp_path):
    (tmp_path / ".last.tmp-x").mkdir()
    (tmp_path / ".last.tmp-x" / "state").write_text("new")
    (tmp_path / ".last.old-1").mkdir()
    (tmp_path / ".other.tmp-y").mkdir()  # an unfinished write of a folder that still exists
    (tmp_path / "other").mkdir()
    notices = recover_interrupted_writes(tmp_path)
    assert (tmp_path / "last" / "state").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "other"]
    assert any("completed" in n for n in notices)


def test_a_mistyped_gym_env_removes_nothing(tmp_path, capsys):
    out = tmp_path / "gym"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    err = run_failing(["gym", "--env", "CartPole-v9", "--out", out, "--overwrite"], capsys)
    assert "unknown gymnasium environment 'CartPole-v9'" in err and "CartPole-v1" in err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_summaries_and_metrics_are_strict_json(tmp_path):
    atomic_write_json(tmp_path / "s.json", {"a": float("nan"), "b": [float("inf"), 1.0]})
    assert json.loads((tmp_path / "s.json").read_text(), parse_constant=lambda c: pytest.fail(c)) == \
        {"a": None, "b": [None, 1.0]}


def test_a_setting_newer_than_the_saved_run_counts_as_its_default():
    from ppo_rlhf.run_folder import changed_settings

    saved = {"lr": 1e-4, "model": "m"}  # written before "estimator" existed
    assert changed_settings(saved, {"lr": 1e-4, "model": "m", "estimator": "gae"}, frozenset(), {"estimator": "gae"}) == []
    assert changed_settings(saved, {"lr": 1e-4, "model": "m", "estimator": "grpo"}, frozenset(),
                            {"estimator": "gae"}) == ["estimator: 'gae' -> 'grpo'"]


def test_lora_settings_count_only_in_a_lora_run():
    from ppo_rlhf.run_folder import changed_settings

    saved = {"lora": False, "lora_target_modules": "all-linear"}  # a full-model run from before the new default
    assert changed_settings(saved, {"lora": False, "lora_target_modules": "all-linear+output"}, frozenset()) == []
    assert changed_settings({**saved, "lora": True}, {"lora": True, "lora_target_modules": "all-linear+output"},
                            frozenset()) == ["lora_target_modules: 'all-linear' -> 'all-linear+output'"]
    assert changed_settings(saved, {"lora": True, "lora_target_modules": "all-linear"}, frozenset()) == \
        ["lora: False -> True"]


# ------------------------------------------------------------------ --out never destroys an input
def test_ppo_refuses_an_out_that_holds_its_model_and_deletes_nothing(tiny_sft_model, capsys):
    sft_run = tiny_sft_model.parent.parent
    before = sorted(p.name for p in tiny_sft_model.iterdir())
    err = run_failing(ppo_args(tiny_sft_model, sft_run, "--iterations", 1, "--overwrite"), capsys)
    assert f"--out {sft_run} holds --model {tiny_sft_model}" in err and "Traceback" not in err
    assert sorted(p.name for p in tiny_sft_model.iterdir()) == before


@pytest.mark.parametrize("case", ["same", "inside-model", "trailing-slash-same", "relative-inside"])
def test_an_out_that_is_or_lies_inside_an_input_is_refused(case, tiny_sft_model, tmp_path, capsys, monkeypatch):
    out = {"same": str(tiny_sft_model), "inside-model": str(tiny_sft_model / "run"), "trailing-slash-same": f"{tiny_sft_model}/",
           "relative-inside": "model/x"}[case]
    if case == "relative-inside":
        monkeypatch.chdir(tiny_sft_model.parent)
        shutil.copytree(tiny_sft_model, tiny_sft_model.parent / "model", dirs_exist_ok=True)
        model = "model"
    else:
        model = tiny_sft_model
    err = run_failing(ppo_args(model, out, "--iterations", 1), capsys)
    assert "--out" in err and "--model" in err and "Traceback" not in err


def test_every_command_compares_out_with_its_inputs(tiny_sft_model, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = run_dir / "config.yaml"
    config.write_text("seed: 0\n")
    cases = [
        (["sft", "--model", tiny_sft_model, "--data", data, "--out", data, "--num-threads", "1"], "--data"),
        (["rm", "--model", tiny_sft_model, "--data", data, "--out", tiny_sft_model / "rm"], "--model"),
        (["eval", "--model", tiny_sft_model, "--task", "doubling", "--out", tiny_sft_model], "--model"),
        (["merge", "--adapter", tiny_sft_model, "--out", tiny_sft_model / "merged"], "--adapter"),
        (["demo", "--stages-config", config, "--out", run_dir, "--overwrite"], "--stages-config"),
        (["gym", "--config", config, "--out", run_dir, "--overwrite"], "--config"),
        (["sft", "--config", config, "--out", run_dir, "--overwrite", *TINY], "--config"),
    ]
    for args, flag in cases:
        err = run_failing(args, capsys)
        assert "--out" in err and flag in err and "Traceback" not in err, (args, err)
    assert config.read_text() == "seed: 0\n"


@pytest.mark.parametrize("command", [["sft"], ["rm"], ["ppo", *RULE], ["demo"]], ids=lambda c: c[0])
def test_an_empty_out_is_refused(command, capsys):
    err = run_failing([*command, "--out", " "], capsys)
    assert "--out is empty" in err


# ------------------------------------------------------------------ resume: the same run, by any path
def test_resume_takes_the_same_folder_by_another_path_and_refuses_fewer_iterations(tiny_sft_model, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_sft_model, tmp_path / "model")
    out = tmp_path / "ppo"
    run(ppo_args("model", "ppo", "--iterations", 2, "--save-every", 1))
    err = run_failing(ppo_args(tmp_path / "model", out, "--iterations", 1, "--resume"), capsys)
    assert "after iteration 2, past the 1 asked for" in err and "--iterations 2" in err
    moved = tmp_path / "elsewhere" / "ppo"
    shutil.move(out, moved)
    run(ppo_args(f"{tmp_path}/model/", f"{moved}/", "--iterations", 3, "--save-every", 1, "--resume"))
    assert [r["step"] for r in read_metrics(moved / "metrics.jsonl")] == [0, 1, 2, 3]


def test_a_run_stopped_before_its_first_step_is_restarted_without_overwrite(tiny_sft_model, tmp_path, capsys):
    out = tmp_path / "ppo"
    (out / "tb").mkdir(parents=True)
    (out / "config.yaml").write_text("seed: 0\n")
    (out / "metrics.jsonl").write_text('{"step": 0, "eval/score": 0.5}\n')
    err = run_failing(ppo_args(tiny_sft_model, out, "--iterations", 1, "--resume"), capsys)
    assert "drop --resume" in err and "--overwrite" not in err
    run(ppo_args(tiny_sft_model, out, "--iterations", 1))
    assert "stopped before its first step" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]
    # A folder with a step of work is not taken over: --overwrite, or --resume from a checkpoint.
    (tmp_path / "worked").mkdir()
    (tmp_path / "worked" / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    err = run_failing(ppo_args(tiny_sft_model, tmp_path / "worked", "--iterations", 1, "--resume"), capsys)
    assert "--overwrite" in err
    assert "already holds a run" in run_failing(ppo_args(tiny_sft_model, tmp_path / "worked", "--iterations", 1), capsys)


def test_rm_resumed_at_its_last_step_logs_its_final_evaluation_once(tmp_path):
    out = tmp_path / "rm"
    args = ["rm", "--task", "doubling", "--steps", 4, "--batch-size", 16, "--save-every", 2, "--out", out, *TINY]
    run(args)
    rows = read_metrics(out / "metrics.jsonl")
    run([*args, "--resume"])
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [r["step"] for r in rows]
    assert sum("eval_accuracy" in r for r in read_metrics(out / "metrics.jsonl")) == 1
