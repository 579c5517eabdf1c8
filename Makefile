# Two commands for a fresh machine:  `make demo`  and  `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast bench bench-gym clean

# torch==2.13.0 goes in first: it is a local CPU build here, and the project's torch range is
# satisfied by it, so pip never pulls the multi-GB CUDA build on top.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/ppo-rlhf demo

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

bench: install
	$(PY) benchmarks/bench_pipeline.py

bench-gym: install
	$(PY) -m pip install -q -e ".[dev,bench]"
	$(PY) benchmarks/bench_gym.py

clean:
	rm -rf $(VENV) runs
