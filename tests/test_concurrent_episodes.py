"""Episodes at the speed of their tools (docs/agents.md, "Tools that wait"; envs/calls.py): the
environment calls of a batch's episodes run at once -- plain defs on worker threads, async defs
awaited together on one event loop -- and nothing about the results changes; a tool past its
timeout retires its environment, an environment that raises stops the rollout naming its row, and
a tool that blocks forever or never awaits neither hangs a run nor its exit."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.envs import EnvironmentFailed, environment_source
from ppo_rlhf.envs.options import tool_template_path
from ppo_rlhf.envs.parsers import ToolCall
from ppo_rlhf.rollout.episodes import EpisodeLimits, roll_out
from ppo_rlhf.rollout.generation import TorchGenerator
from ppo_rlhf.trainers.ppo_config import PPOConfig
import toy_envs
from zoo import PROMPTS, THREADS, run, write_jsonl

TEMPLATE = str(tool_template_path())
TOY = str(Path(__file__).parent / "toy_envs.py")


@pytest.fixture(scope="module")
def qwen(zoo):
    """The zoo's ChatML model, its tokenizer given the shipped tool template."""
    tokenizer = AutoTokenizer.from_pretrained(zoo["qwen2"])
    tokenizer.chat_template = tool_template_path().read_text()
    return AutoModelForCausalLM.from_pretrained(zoo["qwen2"]), tokenizer


@pytest.fixture(scope="module")
def room_for_tools(tmp_path_factory):
    """A ChatML model with 1024 positions: the tool template's prompt is ~470 tokens in its vocabulary."""
    from test_default_learning import users_tiny_model

    folder = tmp_path_factory.mktemp("room") / "model"
    users_tiny_model(folder, arch="qwen2", positions=1024)
    return str(folder)


def always_call(name: str):
    return lambda text: [ToolCall(name, {}, text=text)]


def episodes_of(qwen, source, rows: list[dict], turns: int = 2):
    model, tokenizer = qwen
    generator = TorchGenerator([tokenizer.eos_token_id], tokenizer.pad_token_id, 4, do_sample=False)
    return roll_out(model, tokenizer, generator, rows, [row.get("prompt", "go") for row in rows],
                    EpisodeLimits(1024, 1400, max_turns=turns, chat_template=True), source, [0] * len(rows))


# ---------------------------------------------------------------- nothing about the results changes
def test_one_worker_or_eight_play_and_learn_the_same(room_for_tools, tmp_path, monkeypatch):
    """A tool that answers after random waits (so calls finish in another order each run), sampled
    rollouts, a PPO update: --env-workers 1 and 8 save the same episodes and the same weights."""
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p, "target": 1 + i % 2} for i, p in enumerate(PROMPTS)])
    for workers in (1, 8):
        monkeypatch.setattr(toy_envs, "TOOL_DELAYS", __import__("random").Random(workers))
        run(["ppo", "--model", room_for_tools, "--prompts", rows, "--environment", f"{TOY}:SlowCounter",
             "--tool-parser", f"{TOY}:calls_increment", "--chat-template-file", TEMPLATE, "--max-turns", 3,
             "--env-workers", workers, "--estimator", "grpo", "--samples-per-prompt", 2, "--batch-size", 8,
             "--mini-batch-size", 8, "--ppo-epochs", 1, "--max-new-tokens", 4, "--max-length", 1024, "--iterations", 2,
             "--save-rollouts", 1, "--eval-every", 0, "--save-every", 0, "--out", tmp_path / f"w{workers}", *THREADS])
    for iteration in (1, 2):
        one, eight = ([json.loads(line) for line in (tmp_path / name / f"rollouts/iteration_{iteration:04d}.jsonl")
                       .read_text().splitlines()] for name in ("w1", "w8"))
        assert one == eight
        assert all(r["tool_calls"] and r["tool_calls"][0]["outcome"] == "ok" for r in one)
    one, eight = (load_file(str(tmp_path / name / "checkpoints" / "actor" / "model.safetensors")) for name in ("w1", "w8"))
    assert all(torch.equal(one[key], eight[key]) for key in one)


def test_an_async_tool_and_an_async_step_are_awaited_together(qwen, monkeypatch):
    """One episode's async tool answers only once another episode's async step has: awaited one
    after the other (or each on a loop of its own) it never could, and its call would time out."""
    monkeypatch.setattr(toy_envs, "ASYNC_STATE", toy_envs.AsyncState())
    source = environment_source(toy_envs.ASYNC_ENVIRONMENTS)
    source.parser = always_call("relay")
    rows = [{"prompt": "pass it on", "environment": "relay"}, {"prompt": "play", "environment": "game"}]
    episodes = episodes_of(qwen, source, rows)
    # The order they finished in: the first turn's tool waited on the game's step; the game steps on
    # its second turn too, the relay's second turn ends its episode (its call not run).
    assert toy_envs.ASYNC_STATE.finished == ["step", "tool", "step"]
    assert episodes.tool_logs[0][0]["outcome"] == "ok" and episodes.conversations[0][1]["content"] == "passed"


def test_an_async_reset_without_a_seed_parameter_is_seeded_around_each_of_its_steps(qwen):
    """Two async resets drawing from Python's and numpy's generators between awaits, interleaved on
    one loop: each draws from its own seeded states, so a row's episodes start alike."""
    source = environment_source(toy_envs.DrawsAcrossAwaits)
    episodes = episodes_of(qwen, source, [{"prompt": "go"}] * 4, turns=1)
    source_again = environment_source(toy_envs.DrawsAcrossAwaits, env_workers=1)
    again = episodes_of(qwen, source_again, [{"prompt": "go"}] * 4, turns=1)
    targets = [p[-1]["content"] for p in episodes.prompts]
    assert len(set(targets)) == 1 and [p[-1]["content"] for p in again.prompts] == targets


# ---------------------------------------------------------------- timeouts, failures
def test_a_tool_past_its_timeout_answers_so_and_its_environment_is_not_used_again(qwen, monkeypatch):
    """Four episodes at once; the first one's tool call sleeps past --tool-timeout: it is told so,
    the others are answered, and its object -- which the abandoned call goes on changing -- is
    replaced in the pool by a fresh one for the next batch."""
    release = threading.Event()
    monkeypatch.setattr(toy_envs.StuckAfterATimeout, "release", release)
    source = environment_source(toy_envs.StuckAfterATimeout, tool_timeout=0.3, env_workers=4)
    source.parser = always_call("work")
    rows = [{"prompt": "work", "slow": i == 0} for i in range(4)]
    episodes = episodes_of(qwen, source, rows)
    assert [log[0]["outcome"] for log in episodes.tool_logs] == ["timeout", "ok", "ok", "ok"]
    assert "did not answer within 0.3 seconds" in episodes.conversations[0][1]["content"]
    stuck = episodes.environments[0]
    following = source.environments(rows)
    assert following[0] is not stuck and following[1:] == episodes.environments[1:]
    release.set()  # the abandoned call finishes, on the retired object only
    for _ in range(100):
        if stuck.instance.log:
            break
        threading.Event().wait(0.05)
    assert stuck.instance.log == ["worked"] and not hasattr(following[0].instance, "log")


def test_an_environment_that_raises_stops_the_rollout_naming_its_row_and_cancels_the_others(qwen, monkeypatch):
    monkeypatch.setattr(toy_envs.FailsOnOneRow, "state", toy_envs.FailState())
    source = environment_source(toy_envs.FailsOnOneRow)
    rows = [{"prompt": "go", "id": i, "_source": f"rows.jsonl:{i + 1}"} for i in range(4)]
    with pytest.raises(EnvironmentFailed, match="FailsOnOneRow: step\\(\\) raised ConnectionError: the sandbox died "
                                                "\\(on rows.jsonl:3\\)"):
        episodes_of(qwen, source, rows)
    state = toy_envs.FailsOnOneRow.state
    assert state.finished == [1] and sorted(state.cancelled) == [0, 3]  # the others finished, or were cancelled

    async def still_pending():
        return [task for task in asyncio.all_tasks()
                if task is not asyncio.current_task() and task.get_name() != "ppo-rlhf heartbeat"]

    assert source.calls.run(still_pending()) == []  # nothing of the stopped rollout left on the loop
    assert source.kinds[None].pool == [None] * 4  # every object of the stopped rollout retired


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("workers", [0, -3])
def test_env_workers_below_one_are_refused_naming_the_option(workers):
    with pytest.raises(ConfigError, match=f"invalid value for 'env_workers': {workers}; allowed: >= 1"):
        build_config(PPOConfig, {"tool": ["toy_envs:add"], "env_workers": workers})


def eval_in_a_process(model, tmp_path, environment: str, parser: str) -> subprocess.CompletedProcess:
    """``ppo-rlhf eval`` of two episodes in a process of its own (how it exits is what is tested)."""
    rows = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    command = [sys.executable, "-m", "ppo_rlhf.cli", "eval", "--model", model, "--prompts", rows, "--environment",
               f"{TOY}:{environment}", "--tool-parser", f"{TOY}:{parser}", "--chat-template-file", TEMPLATE,
               "--tool-timeout", 0.5, "--max-turns", 2, "--max-new-tokens", 4, "--max-length", 1024,
               "--out", tmp_path / "eval", *THREADS]
    return subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_sync_tool_that_blocks_forever_is_answered_by_its_timeout_and_the_run_exits(room_for_tools, tmp_path):
    done = eval_in_a_process(room_for_tools, tmp_path, "WaitsForever", "calls_wait")
    assert done.returncode == 0, done.stderr[-2000:]  # and it exited: the blocked threads are daemons
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["tools/timeouts"] == 1.0 and summary["samples"][0]["tool_calls"][0]["outcome"] == "timeout"


def test_an_async_tool_that_never_awaits_stops_the_run_naming_it(room_for_tools, tmp_path):
    done = eval_in_a_process(room_for_tools, tmp_path, "HogsTheLoop", "calls_hog")
    assert done.returncode == 2, done.stderr[-2000:]  # and it exited: the loop it blocks runs in a daemon thread
    assert ("tool hog (on " in done.stderr and "is an async def that held the event loop for more than 0.5 seconds "
            "without awaiting" in done.stderr and "make it a plain def" in done.stderr), done.stderr[-2000:]
    assert "Traceback" not in done.stderr


class FakeLaunch:
    """Two processes' all-reduce (a sum of tuples), for threads standing in for them: a process
    that reduces while the other has stopped reducing waits out the barrier and fails -- where
    real processes would wait for ever."""

    def __init__(self, processes: int = 2):
        self.barrier = threading.Barrier(processes, timeout=5)
        self.values: list = [None] * processes
        self.reductions = [0] * processes

    def all_reduce(self, rank: int, value: tuple) -> tuple:
        self.values[rank] = value
        self.reductions[rank] += 1
        self.barrier.wait()
        total = tuple(sum(values[i] for values in self.values) for i in range(len(value)))
        self.barrier.wait()
        return total


class FakeEngineRequests:
    """An engine that steps with the other processes' (as vLLM's data parallel does: each step is
    a collective) and answers every pending request in one step; ``waits``: the wait each of its
    server's ``take`` calls was given."""

    def __init__(self, rank: int, launch: FakeLaunch):
        self.rank, self.launch, self.pending = rank, launch, []

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def add(self, row, turn, ids, limit) -> str:
        self.pending.append(f"{row}/{turn}")
        return self.pending[-1]

    def step(self) -> list:
        if not self.launch.all_reduce(self.rank, (len(self.pending),))[0]:
            return []
        done, self.pending = self.pending, []
        return [(key, ([7], None)) for key in done]

    def anyone_working(self, running: bool, busy: bool) -> tuple[bool, bool]:
        anyone_running, anyone_busy = self.launch.all_reduce(self.rank, (int(running or busy), int(busy)))
        return anyone_running > 0, anyone_busy > 0

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_processes_leave_the_serving_loop_together_when_one_still_reads_its_reward():
    """Two processes serving their episodes' turns on engines that step together: the first's
    episode plays two turns and reads a slow reward after its last; the second's plays one.  Each
    keeps serving while any process has an episode running -- reading its reward included -- so
    both make the same collectives and leave in the same round.  (Leaving as soon as no episode
    was playing, the first asked once more, alone, and waited for ever.)"""
    from ppo_rlhf.envs.calls import EnvironmentCalls
    from ppo_rlhf.rollout.turns import ContinuousTurns

    launch, errors, turns_played = FakeLaunch(), [], [0, 0]

    def process(rank: int) -> None:
        turns = ContinuousTurns(FakeEngineRequests(rank, launch), episodes=1)

        async def episode():
            try:
                for _ in range(2 if rank == 0 else 1):
                    await turns.ask(0, [1], None)
                    turns_played[rank] += 1
            finally:
                turns.ended(0)
            if rank == 0:
                await asyncio.sleep(0.3)  # the environment's reward, read after the episode's last turn

        try:
            EnvironmentCalls(workers=2).run(episode(), turns)
        except BaseException as error:  # noqa: BLE001 -- reported by the test
            errors.append(error)

    threads = [threading.Thread(target=process, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert turns_played == [2, 1]
    assert launch.reductions[0] == launch.reductions[1]


def test_an_idle_process_waits_for_no_ask_while_another_process_engine_is_busy():
    """A process with no request of its own takes the asks that are there without waiting for one
    while any process's engine has work: its engine's step is a collective, and a wait before it
    would hold every other engine's step (about 20 steps a second)."""
    from ppo_rlhf.rollout.turns import ContinuousTurns

    class OthersBusy(FakeEngineRequests):
        def anyone_working(self, running, busy):
            return True, True  # another process's engine has requests

        def step(self):
            return []

    turns = ContinuousTurns(OthersBusy(0, FakeLaunch(1)), episodes=1)
    waits = []
    turns.take = lambda wait: waits.append(wait) or []
    assert turns.serving(running=False)
    turns.serve(0.05)
    assert waits == [0]
