# Two entry points (see README): `make demo` and `make test`.
# Both create and reuse the project virtual environment in .venv.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export RAY_AUTH_MODE := disabled
export PYTHONUNBUFFERED := 1

.PHONY: demo ui tensorboard test test-fast test-system test-rl rl-deps test-miles test-mcore-next lint format lock lock-check venv bench clean clean-demo

# Installed from the lock (locks/dev.txt: every package at the version the tests ran with).
$(STAMP): pyproject.toml locks/dev.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c locks/dev.txt -e '.[gpu,dev]'
	@touch $(STAMP)

venv: $(STAMP)

# The locks (uv's pip-compatible compile, constraints files): locks/dev.txt for this environment
# (make, CI; universal: markers choose per Python and platform, e.g. megatron-core per Python),
# locks/code-location.txt (Python 3.11) and locks/gpu.txt (Python 3.12) for the two images
# (deploy/Dockerfile), both held to the dev lock's versions. `make lock` adds what pyproject.toml gained and keeps every
# other pin; `make lock UPGRADE=1` moves every pin to the newest release. `make lock-check` (CI)
# fails when a lock is not what `make lock` would write.
LOCK_COMPILE = $(CURDIR)/$(BIN)/uv pip compile --quiet --custom-compile-command 'make lock' $(if $(UPGRADE),--upgrade)
LINUX_311 = --python-version 3.11 --python-platform x86_64-manylinux_2_28
LINUX_312 = --python-version 3.12 --python-platform x86_64-manylinux_2_28
COMPILE_LOCKS = $(LOCK_COMPILE) --universal --python-version 3.11 pyproject.toml --extra gpu --extra dev -o locks/dev.txt \
	&& $(LOCK_COMPILE) $(LINUX_311) pyproject.toml --extra k8s -c locks/dev.txt -o locks/code-location.txt \
	&& $(LOCK_COMPILE) $(LINUX_312) pyproject.toml --extra gpu -c locks/dev.txt -o locks/gpu.txt

lock: $(STAMP)
	$(COMPILE_LOCKS)

lock-check: $(STAMP)
	rm -rf .lock-check && mkdir -p .lock-check && cp -r pyproject.toml locks .lock-check/
	cd .lock-check && $(COMPILE_LOCKS)
	diff -r locks .lock-check/locks || { echo "a lock is stale: run make lock and commit locks/"; exit 1; }
	rm -rf .lock-check

DAGSTER_HOME_DIR ?= $(CURDIR)/.dagster_home
UI_PORT ?= 3000

# The full asset graph through Dagster for a learnable manifest and its shuffled-label control.
demo: $(STAMP)
	DAGSTER_HOME=$(DAGSTER_HOME_DIR) $(BIN)/python -m value_assets.demo

# `dg dev` on 127.0.0.1 against the demo's instance: both lineages, checks, plots. The instance
# template deploy/dagster.yaml is copied in once (not kept at the root: Dagster warns about a
# dagster.yaml in the working folder that is not DAGSTER_HOME's). VIRTUAL_ENV: dg warns unless the
# project's .venv is the active one. value_assets/devserver.py runs it in its own process group and,
# on Ctrl-C / SIGTERM / make's exit, stops that whole group (SIGINT, then SIGTERM/SIGKILL after
# UI_GRACE seconds): Dagster's dev command, started with SIGINT ignored, ignores SIGTERM too.
UI_GRACE ?= 15

ui: $(STAMP)
	mkdir -p $(DAGSTER_HOME_DIR) manifests
	test -f $(DAGSTER_HOME_DIR)/dagster.yaml || cp deploy/dagster.yaml $(DAGSTER_HOME_DIR)/dagster.yaml
	DAGSTER_HOME=$(DAGSTER_HOME_DIR) VIRTUAL_ENV=$(CURDIR)/$(VENV) exec $(BIN)/python -m value_assets.devserver \
		--grace $(UI_GRACE) -- $(CURDIR)/$(BIN)/dg dev -h 127.0.0.1 -p $(UI_PORT)

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
	$(BIN)/python -m pytest -q -m "not gpu and not rl and not system and not miles" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The `system` tier: the deployment end to end (`make ui` on a Postgres server with a headless
# browser: Debian chromium, which .ci/run installs; a two-node Ray cluster through Ray Jobs;
# run-manifests with the real GPU job on a full disk; the README's bring-your-own walkthrough and a
# Qwen3.5 critic trained, evaluated and exported, through the commands; a driver's own Ray and the warm
# cluster ending with their owners). About three and a half minutes on 2 cores; .ci/run
# runs it after `make test`.
test-system: $(STAMP)
	$(BIN)/python -m pytest -q -m system -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The unit tier only (fast, self-contained; under a minute): see tests/test_tiers.py. Two processes
# like `test` (894 tests on 2 cores: 26 s; 770 tests: 21-26 s, on a slower host 44 s, against 59-62 s in one).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m unit -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

# The RL trainers' own loaders on this product's exports (tests/rl; README "Hand-off to RL"), kept
# out of `make test`; .ci/run runs it after. Installed outside the venv, under .rl/ (gitignored):
# - .rl/site: verl 0.9.1, OpenRLHF 0.11.2 and the light dependencies they import on CPU, pinned
#   (requirements-rl.txt, --no-deps); on PYTHONPATH of the pytest process.
# - .rl/megatron-lm: Megatron-LM's megatron/training, which no megatron-core 0.16.1 wheel or sdist
#   holds; the first release whose training code is on PyPI is megatron-core 0.17.0 (its wheel ships
#   megatron/training as tagged core_v0.17.0). The whole cp312 wheel (core 0.17.0 + training 0.17.0,
#   pure Python apart from a datasets helper the tier does not load) is checked against its pinned
#   sha256 and unpacked here; it runs on this Python 3.11 and torch. Only the Megatron-LM side of the
#   tier (tests/rl/megatron_lm_side.py, a subprocess) puts it first on PYTHONPATH; the product
#   (megatron-core 0.16.1) runs in the pytest process as installed.
RL_DIR := .rl
MEGATRON_LM_VERSION := 0.17.0
MEGATRON_LM_WHEEL := megatron_core-0.17.0-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
MEGATRON_LM_WHEEL_SHA256 := 0cbacf043603f9dc2735310e1b1dcd5c076c02caab13849c2d2fe6a99cbea4f6
RL_STAMP := $(RL_DIR)/.installed-$(MEGATRON_LM_WHEEL_SHA256)

$(RL_STAMP): requirements-rl.txt $(STAMP)
	rm -rf $(RL_DIR)
	DS_BUILD_OPS=0 $(BIN)/python -m pip install -q --no-deps --no-build-isolation --target $(RL_DIR)/site -r requirements-rl.txt
	rm -rf $(RL_DIR)/site/tests $(RL_DIR)/site/scripts $(RL_DIR)/site/bin  # verl's wheel ships top-level tests/ and scripts/
	$(BIN)/python -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 -d $(RL_DIR)/wheel megatron-core==$(MEGATRON_LM_VERSION)
	echo "$(MEGATRON_LM_WHEEL_SHA256)  $(RL_DIR)/wheel/$(MEGATRON_LM_WHEEL)" | sha256sum --check --quiet
	$(BIN)/python -m zipfile -e $(RL_DIR)/wheel/$(MEGATRON_LM_WHEEL) $(RL_DIR)/megatron-lm
	@touch $(RL_STAMP)

rl-deps: $(RL_STAMP)

# One process, so the tier's fixtures (two tiny actors, four trained critics, every export, one
# Megatron-LM subprocess) are built once.
test-rl: $(RL_STAMP)
	PYTHONPATH=$(CURDIR)/$(RL_DIR)/site $(BIN)/python -m pytest -q -m rl -p no:cacheprovider tests/rl

# Miles' own Qwen3.5 plugin on the product's Qwen3.5 Miles bundle (tests/rl/test_miles_qwen3_5.py,
# the `miles` tier). Miles is on neither PyPI nor a registry CI reaches, so this is opt-in, from a
# local clone of github.com/radixark/miles that has the pinned commit:
#   make test-miles MILES_SRC=path/to/miles      (a work tree or a bare repository)
# `miles` and `miles_plugins` of exactly MILES_COMMIT are taken from it (git archive), with the
# flash-linear-attention Miles' docker/Dockerfile pins and the triton fla imports (import only: its
# kernels need a GPU), into .rl/miles, which only the Miles side process puts on its PYTHONPATH.
MILES_COMMIT := 31f1ca961a94cb860cec3b2dea34ec332bfa8f76
MILES_PACKAGES := flash-linear-attention==0.4.2 fla-core==0.4.2 triton==3.6.0
MILES_STAMP := $(RL_DIR)/miles/.installed-$(MILES_COMMIT)

$(MILES_STAMP): $(RL_STAMP)
	@test -n "$(MILES_SRC)" || { echo "set MILES_SRC to a clone of github.com/radixark/miles"; exit 2; }
	git -C "$(MILES_SRC)" cat-file -e $(MILES_COMMIT)^{commit} || { echo "$(MILES_SRC) lacks commit $(MILES_COMMIT)"; exit 2; }
	rm -rf $(RL_DIR)/miles
	$(BIN)/python -m pip install -q --no-deps --target $(RL_DIR)/miles $(MILES_PACKAGES)
	git -C "$(MILES_SRC)" archive $(MILES_COMMIT) miles miles_plugins | tar -x -C $(RL_DIR)/miles
	@touch $(MILES_STAMP)

test-miles: $(MILES_STAMP)
	PYTHONPATH=$(CURDIR)/$(RL_DIR)/site $(BIN)/python -m pytest -q -m miles -p no:cacheprovider tests/rl/test_miles_qwen3_5.py

# The GPU code paths on megatron-core 0.19.2 as well: the release the GPU image and every GPU figure
# use (Python 3.12). The rest of the CPU suite runs 0.16.1, the newest release for Python 3.11
# (pyproject.toml's markers pin one release per Python). 0.19.2's cp312 wheel is pure Python apart
# from helpers the critic does not load: checked against its pinned sha256 and unpacked under
# .mcore/ (gitignored), with the triton that torch pins (0.19 imports it in its MoE module, on CPU
# too), it runs on this Python 3.11 and torch, first on PYTHONPATH; the engine, hf and job tests run
# against it (tests/conftest.py checks the version they import). .ci/run runs it after test-rl.
MCORE_NEXT_VERSION := 0.19.2
MCORE_NEXT_WHEEL := megatron_core-0.19.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
MCORE_NEXT_SHA256 := 8e3e486f13f559450415b9b9dc0ff3331a0bb83dd154553f7f350a75ff9c42b5
MCORE_DIR := .mcore
MCORE_STAMP := $(MCORE_DIR)/.installed-$(MCORE_NEXT_SHA256)

$(MCORE_STAMP): $(STAMP) locks/dev.txt
	rm -rf $(MCORE_DIR)
	$(BIN)/python -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
		--platform manylinux_2_28_x86_64 -d $(MCORE_DIR)/wheel megatron-core==$(MCORE_NEXT_VERSION)
	echo "$(MCORE_NEXT_SHA256)  $(MCORE_DIR)/wheel/$(MCORE_NEXT_WHEEL)" | sha256sum --check --quiet
	$(BIN)/python -m zipfile -e $(MCORE_DIR)/wheel/$(MCORE_NEXT_WHEEL) $(MCORE_DIR)/site
	$(BIN)/python -m pip install -q --no-deps --target $(MCORE_DIR)/triton "$$(grep -o '^triton==[^ ;]*' locks/dev.txt)"
	@touch $(MCORE_STAMP)

test-mcore-next: $(MCORE_STAMP)
	PYTHONPATH=$(CURDIR)/$(MCORE_DIR)/site:$(CURDIR)/$(MCORE_DIR)/triton VALUE_ASSETS_EXPECT_MEGATRON=$(MCORE_NEXT_VERSION) \
		$(BIN)/python -m pytest -q -m "not gpu and not rl" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		tests/engine tests/hf tests/job

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
	rm -rf $(VENV) .pytest_cache $(RL_DIR) $(MCORE_DIR)
