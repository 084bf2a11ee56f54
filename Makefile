# Two entry points (see README): `make demo` and `make test`.
# Both create and reuse the project virtual environment in .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export PYTHONUNBUFFERED := 1

.PHONY: demo test venv bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[gpu,dev]'
	@touch $(STAMP)

venv: $(STAMP)

DEMO_DIR ?= demo_data

demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	$(BIN)/value-assets make-demo-data $(DEMO_DIR) --seed 0
	$(BIN)/value-assets make-demo-data $(DEMO_DIR) --seed 0 --shuffle-labels
	$(BIN)/value-assets validate $(DEMO_DIR)/demo.json
	$(BIN)/value-assets validate $(DEMO_DIR)/demo-shuffled.json
	$(BIN)/value-assets plan $(DEMO_DIR)/demo.json --global-batch-size 16 --epochs 2
	$(BIN)/value-assets plan $(DEMO_DIR)/demo.json --gpus 2 --max-global-batch-size 64

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not gpu" tests

bench: $(STAMP)
	$(BIN)/python bench/validate.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache
