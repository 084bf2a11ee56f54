"""`value-assets run-manifests`, the command an operator runs, with the artifacts store on a full disk:
the real GPU job (local launcher, real Pipes, local Ray, the tiny backbone on CPU) is refused its
save, and the command exits 2 naming the partition, the save and the system's refusal, as for bad
input, with nothing published (docs/operations.md, exit codes). The refusal reaches the command
through the GPU job's "invalid input" log line (value_assets/run_inbox.py `run_refusal`), which no
other test drives with the real job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dagster.conftest import write_manifest
from tests.tmpfs import small_tmpfs

pytestmark = [pytest.mark.system, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def test_run_manifests_on_a_full_disk_exits_2_naming_the_save_and_publishes_nothing(tmp_path):
    manifests, artifacts, home = tmp_path / "manifests", tmp_path / "artifacts", tmp_path / "home"
    write_manifest(manifests, "full", rows=32, heldout_rows=16)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VALUE_ASSETS_DEPLOYMENT")}
    env.update(
        {
            "DAGSTER_HOME": str(home),
            "VALUE_ASSETS_ARTIFACTS": str(artifacts),
            "VALUE_ASSETS_MANIFESTS": str(manifests),
            "PYTHONPATH": str(ROOT),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_AUTH_MODE": "disabled",
        }
    )
    home.mkdir()
    # Room for the plan and the staging of a save, not for the save itself (a tiny critic's model
    # and Adam state take a few MB).
    with small_tmpfs(artifacts, "256k"):
        done = subprocess.run(
            [sys.executable, "-m", "value_assets.cli", "run-manifests", "--json"],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=240,
        )
        left = sorted(str(p.relative_to(artifacts)) for p in artifacts.rglob("*"))
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-3000:])
    err = done.stderr
    assert "value-assets: error: full-" in err, err[-3000:]
    assert "critic/iter_" in err and "no space left on device (ENOSPC)" in err, err[-3000:]
    assert "nothing was published" in err, err[-3000:]
    (state,) = json.loads(done.stdout)
    assert state["failed_steps"] == ["critic_training"] and not state["success"] and not state["promoted"], state
    assert state["registry_record"] is None, state
    # Nothing published: no contract, no latest pointer, no report, no registry record.
    assert not [p for p in left if p.endswith(("value_pretrain_contract.json", "latest")) or "/reports/" in p], left
    assert not [p for p in left if p.startswith("registry")], left
