"""The code location as the Dagster CLI loads it: `dagster definitions validate -w workspace.yaml`
in a subprocess (moved from test_dg_definitions.py, whose tests are all unit)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_workspace_validates_with_the_dagster_cli(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-m", "dagster", "definitions", "validate", "-w", "workspace.yaml"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "All code locations passed validation" in out.stdout + out.stderr
