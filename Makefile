# Two entry points (see README): `make demo` and `make test`.
# Both create and reuse the project virtual environment in .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export PYTHONUNBUFFERED := 1

.PHONY: demo ui tensorboard test test-fast lint format venv bench clean clean-demo

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[gpu,dev]'
	@touch $(STAMP)

venv: $(STAMP)

DAGSTER_HOME_DIR ?= $(CURDIR)/.dagster_home
UI_PORT ?= 3000

# The full asset graph through Dagster for a learnable manifest and its shuffled-label control.
demo: $(STAMP)
	DAGSTER_HOME=$(DAGSTER_HOME_DIR) $(BIN)/python -m value_assets.demo

# dagster dev on 127.0.0.1 against the demo's instance: both lineages, checks, plots.
ui: $(STAMP)
	mkdir -p $(DAGSTER_HOME_DIR) manifests
	test -f $(DAGSTER_HOME_DIR)/dagster.yaml || cp dagster.yaml $(DAGSTER_HOME_DIR)/dagster.yaml
	DAGSTER_HOME=$(DAGSTER_HOME_DIR) $(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p $(UI_PORT)

TB_PORT ?= 6006

# TensorBoard on 127.0.0.1 over every critic's event files (artifacts/<partition>/critic/tensorboard).
tensorboard: $(STAMP)
	$(BIN)/tensorboard --logdir artifacts --host 127.0.0.1 --port $(TB_PORT)

# Two test processes (pytest-xdist), a module per process at a time: much of the suite waits on
# Ray, subprocesses and daemons, so two share two cores well. TEST_WORKERS=0 runs in one process.
# Modules are handed out in collection order, the slowest first (tests/conftest.py SLOW_MODULES),
# not xdist's default of the most tests first, which left the long one-test modules for last.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The unit tier only (fast, self-contained; under a minute): see tests/test_tiers.py. Two processes
# like `test` (770 tests on 2 cores: 21-26 s; on a slower host 44 s, against 59-62 s in one).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m unit -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# ruff (lint and the format check, line length 120) over the repository; mypy, strict, on core/
# (configuration in pyproject.toml). .ci/run runs this before the tests.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Rewrites the tree into ruff's format (and applies ruff's safe fixes).
format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	$(BIN)/python bench/validate.py

clean-demo:
	rm -rf $(DAGSTER_HOME_DIR) artifacts manifests/demo.json manifests/demo manifests/demo-shuffled.json manifests/demo-shuffled

clean: clean-demo
	rm -rf $(VENV) .pytest_cache
