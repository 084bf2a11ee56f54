"""Fixtures of the RL tier (`make test-rl`), built once per session: for a tiny Qwen2 and a tiny
Llama actor, the product's critics and exports (tests/rl/rltest_helpers.py), and the Megatron-LM
side process (tests/rl/megatron_lm_side.py), started as soon as the actors exist: it saves an actor
checkpoint of each actor's weights while this process trains and exports the critics, then loads
the Miles bundles."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.rl import harness
from tests.rl.rltest_helpers import FAMILIES, make_actor, megatron_lm_job, train_and_export


@pytest.fixture(scope="session")
def rl_session(ray_cluster, tmp_path_factory):
    """(critics {family: {name: path}}, the Megatron-LM side process, its job file), built once.

    The Megatron-LM side starts as soon as the actors exist: it saves the actor checkpoints while
    this process trains and exports the critics, then loads the bundles; meanwhile this process
    imports verl's and OpenRLHF's modules (S1 applied)."""
    harness.require_installed()
    root = tmp_path_factory.mktemp("rl")
    critics = {family: make_actor(root / family, family) for family in FAMILIES}
    job = megatron_lm_job(root, critics)
    side = harness.start_megatron_lm_side(job)
    try:
        for family, paths in critics.items():
            train_and_export(family, paths)
        (root / "bundles-ready").touch()
        harness.import_openrlhf()
        harness.import_verl()
        yield critics, side, job
    finally:
        if side.poll() is None:
            side.kill()
            side.wait()


@pytest.fixture(scope="session")
def critics(rl_session) -> dict[str, dict[str, Path]]:
    """{family: {name: path}}: the actor, the manifest, the critics and their exports (module docstring)."""
    return rl_session[0]


@pytest.fixture(scope="session")
def megatron_lm_results(rl_session) -> dict:
    """What the Megatron-LM side reported, with its job (a failure there fails the tests that need
    it, with its traceback)."""
    _, side, job = rl_session
    try:
        side.wait(timeout=300)
    except subprocess.TimeoutExpired:
        side.kill()
        pytest.fail("the Megatron-LM side process ran past 300 s")
    spec = json.loads(job.read_text())
    result_file = Path(spec["result"])
    if not result_file.is_file():
        pytest.fail(f"the Megatron-LM side process wrote no result (exit {side.returncode}): {side.log.read_text()}")
    result = json.loads(result_file.read_text())
    if "error" in result:
        pytest.fail(f"the Megatron-LM side process failed:\n{result['error']}")
    result["job"] = spec
    return result
