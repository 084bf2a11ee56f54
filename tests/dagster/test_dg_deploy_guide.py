"""deploy/README.md walks from nothing to a first run: every file it names exists, every Helm
values key it names is in deploy/helm/values.yaml, every variable it names is read by the code
location and documented, and its commands name the chart version, secret and files the
repository uses. (Nothing is applied to a cluster here.)"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "deploy/README.md").read_text()
VALUES = yaml.safe_load((ROOT / "deploy/helm/values.yaml").read_text())


def code_spans(text: str) -> list[str]:
    """Inline code and fenced blocks' lines."""
    fenced = re.findall(r"^```\n(.*?)^```", text, flags=re.S | re.M)
    inline = re.findall(r"`([^`\n]+)`", re.sub(r"^```\n.*?^```", "", text, flags=re.S | re.M))
    return inline + [line for block in fenced for line in block.splitlines()]


def test_every_file_it_names_exists():
    paths = {
        token.rstrip(".,:;)")
        for span in code_spans(GUIDE)
        for token in re.findall(
            r"(?<!logs )(?:deploy|docs|locks|value_assets|tests)/[\w./-]+", span
        )  # not `kubectl logs deploy/NAME`
    }
    assert "deploy/pvc.yaml" in paths and "locks/gpu.txt" in paths  # the scan finds them
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == []


def lookup(values, dotted: str):
    node = values
    for part in re.findall(r"[\w-]+|\[\d+\]", dotted):
        node = node[int(part[1:-1])] if part.startswith("[") else node[part]
    return node


def test_every_values_key_it_names_is_in_the_values_file():
    tops = tuple(VALUES)
    keys = {s for s in code_spans(GUIDE) if re.fullmatch(r"[\w-]+(\.[\w-]+|\[\d+\])+", s) and s.startswith(tops)}
    assert {"postgresql.postgresqlHost", "global.postgresqlSecretName"} <= keys
    for key in sorted(keys):
        try:
            lookup(VALUES, key)
        except (KeyError, IndexError, TypeError):
            pytest.fail(f"deploy/README.md names {key!r}, which deploy/helm/values.yaml does not have")


def test_every_variable_it_names_is_read_and_documented():
    names = set(re.findall(r"\b(VALUE_ASSETS_[A-Z0-9_]+|RAY_ADDRESS)\b", GUIDE))
    assert len(names) >= 10
    operations = (ROOT / "docs/operations.md").read_text()
    source = "\n".join(p.read_text() for p in (ROOT / "value_assets").rglob("*.py"))
    for name in sorted(names):
        assert f"| `{name}` |" in operations, f"{name}: not in docs/operations.md's variable table"
        assert f'"{name}"' in source, f"{name}: nothing in value_assets reads it"
    # the Helm values set the code location's variables the guide lists for the kubernetes launcher
    (deployment,) = VALUES["dagster-user-deployments"]["deployments"]
    set_there = {e["name"] for e in deployment["env"]}
    assert {n for n in names if n.startswith("VALUE_ASSETS_K8S_")} <= set_there


def test_its_commands_use_the_repositorys_chart_version_secret_and_sensor():
    dagster = next(
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("dagster==")
    )
    assert f"dagster/dagster --version {dagster.split('==')[1]} " in GUIDE
    secret = VALUES["global"]["postgresqlSecretName"]
    assert f"create secret generic {secret} --from-literal=postgresql-password=" in GUIDE
    assert VALUES["generatePostgresqlPasswordSecret"] is False
    sensors = (ROOT / "value_assets/sensors.py").read_text()
    for sensor in re.findall(r"sensor `(\w+)`", GUIDE):
        assert f"def {sensor}(" in sensors or f'name="{sensor}"' in sensors, sensor
    for target in re.findall(r"--target ([\w-]+)", GUIDE):
        assert f" AS {target}" in (ROOT / "deploy/Dockerfile").read_text(), target
