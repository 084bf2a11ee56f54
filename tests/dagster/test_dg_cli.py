"""The command lines a user starts with: `dg check defs` / `dg list defs` (dagster-dg-cli, pinned
with the Dagster family, reading `[tool.dg]` in pyproject.toml) and `value-assets --version`."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
DG = Path(sys.executable).with_name("dg")


def dg(*args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "DAGSTER_DISABLE_TELEMETRY": "1",
        "VALUE_ASSETS_DEPLOYMENT": "local",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run([str(DG), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)


def test_dg_is_pinned_with_the_dagster_family():
    assert DG.is_file(), "dagster-dg-cli is in the dev extra"
    assert importlib.metadata.version("dagster-dg-cli") == importlib.metadata.version("dagster")


def test_dg_check_defs_loads_the_code_location():
    result = dg("check", "defs")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All definitions loaded successfully" in result.stdout + result.stderr


def test_dg_list_defs_names_the_graph():
    from value_assets.definitions import defs

    result = dg("list", "defs", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    repo = defs.get_repository_def()
    assert {a["asset_key"] for a in listed["assets"]} == {
        k.to_user_string() for k in repo.asset_graph.get_all_asset_keys()
    }
    assert {j["name"] for j in listed["jobs"]} == {"full", "evaluate", "canary"}
    assert [s["name"] for s in listed["sensors"]] == ["manifest_sensor"]
    assert {r["name"] for r in listed["resources"]} == {"artifacts", "inbox", "launcher"}
    assert len(listed["asset_checks"]) == len(list(repo.asset_checks_defs_by_key))


def test_version_prints_the_installed_distribution_version(capsys):
    from value_assets.cli import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"value-assets {importlib.metadata.version('value-assets')}"
