# Quick start: `make demo` and `make test`. Both create .venv on first use.
# An already-installed torch (>= 2.5) is kept; otherwise the CPU build of torch is installed first so
# pip never pulls a multi-GB CUDA build on a machine without a GPU.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 5))" 2>/dev/null || \
		$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/demo.py

# Plan quality, compile time, runtime overhead, cost-model fidelity -> benchmarks/RESULTS.md.
# Quick mode (~10 min on 2 cores); BENCH_FLAGS=--full for the larger models.
bench: $(VENV)/.installed
	$(PY) benchmarks/run_all.py $(BENCH_FLAGS)

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

lint: $(VENV)/.installed
	$(PY) -m ruff check hetcc tests benchmarks examples

.PHONY: venv demo test lint bench
