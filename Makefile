# `make demo` and `make test` each set up .venv on a fresh machine: the demo installs the
# package alone (what a CPU needs), the tests add the extras (triton, optuna, ray, notebooks).
# torch is pinned and installed first so that no range pulls a CUDA build.
PY      ?= python3
VENV    := .venv
PIP     := $(VENV)/bin/pip
PYTHON  := $(VENV)/bin/python
TORCH   ?= torch==2.13.0

.PHONY: venv demo test bench-cpu assets clean

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/lora-sweep demo

test: $(VENV)/.installed-test
	$(PYTHON) -m pytest -q tests

bench-cpu: venv
	$(PYTHON) -m benchmarks.engine_cpu

# Rebuild the bundled tiny model and task (a few minutes on CPU); the result is committed.
assets: venv
	$(PYTHON) scripts/make_tiny_assets.py

clean:
	rm -rf $(VENV) lora_sweep_runs .pytest_cache
