"""The code location loads, per deployment, and its graph matches the saved snapshot.

A graph change (asset, dependency, check, job selection, code version) is a visible diff in
`graph_snapshot.json`; regenerate it with `VALUE_ASSETS_UPDATE_SNAPSHOT=1 pytest tests/dagster`.
"""

import json
import os
from pathlib import Path

import pytest
from dagster import Definitions

from value_assets.assets import ALL_ASSETS
from value_assets.checks import ALL_CHECKS
from value_assets.definitions import deployment_name, make_definitions, resources_for
from value_assets.resources import K8sPodLauncher, RayJobLauncher, SubprocessLauncher

pytestmark = pytest.mark.unit
SNAPSHOT = Path(__file__).with_name("graph_snapshot.json")


def graph_summary(defs: Definitions) -> dict:
    graph = defs.resolve_asset_graph()
    assets = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        assets[key.to_user_string()] = {
            "deps": sorted(p.to_user_string() for p in node.parent_keys),
            "group": node.group_name,
            "code_version": node.code_version,
            "partitions": getattr(node.partitions_def, "name", None),
            "kinds": sorted(node.kinds),
            "owners": list(node.owners),
        }
    checks = {}
    for checks_def in ALL_CHECKS:
        for spec in checks_def.check_specs:
            checks[f"{spec.asset_key.to_user_string()}:{spec.name}"] = {
                "blocking": spec.blocking,
                "partitions": getattr(spec.partitions_def, "name", None),
            }
    jobs = {}
    for name in ("full", "evaluate", "canary"):
        job = defs.resolve_job_def(name)
        jobs[name] = {
            "assets": sorted(k.to_user_string() for k in job.asset_layer.selected_asset_keys),
            "checks": sorted(
                f"{spec.asset_key.to_user_string()}:{spec.name}"
                for data in job.asset_layer.data
                for spec in data.assets_def.node_check_specs_by_output_name.values()
            ),
            "tags": dict(sorted(job.tags.items())),
        }
    pools = {a.op.name: a.op.pool for a in ALL_ASSETS if a.op.pool}
    sensors = {s.name: s.job_name for s in defs.sensors}
    return {
        "assets": assets,
        "checks": checks,
        "jobs": jobs,
        "pools": pools,
        "sensors": sensors,
        "resources": sorted(defs.resources),
    }


def test_graph_matches_snapshot(test_defs):
    summary = graph_summary(test_defs)
    if os.environ.get("VALUE_ASSETS_UPDATE_SNAPSHOT"):
        SNAPSHOT.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    assert summary == json.loads(SNAPSHOT.read_text())


@pytest.mark.parametrize(
    "deployment,launcher", [("local", SubprocessLauncher), ("ray", RayJobLauncher), ("kubernetes", K8sPodLauncher)]
)
def test_each_deployment_loads(deployment, launcher, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")
    monkeypatch.setenv("VALUE_ASSETS_GPU_IMAGE", "registry.example/value-assets-gpu:test")
    resources = resources_for(deployment)
    assert isinstance(resources["launcher"], launcher)
    defs = make_definitions(resources)
    Definitions.validate_loadable(defs)
    assert {"full", "evaluate", "canary"} <= {j.name for j in defs.resolve_all_job_defs()}


def test_deployment_is_chosen_by_one_env_var():
    assert deployment_name({}) == "local"
    assert deployment_name({"VALUE_ASSETS_DEPLOYMENT": "ray"}) == "ray"
    with pytest.raises(ValueError, match="VALUE_ASSETS_DEPLOYMENT"):
        deployment_name({"VALUE_ASSETS_DEPLOYMENT": "slurm"})


def test_module_level_defs_load():
    from value_assets.definitions import defs

    Definitions.validate_loadable(defs)
    assert set(defs.resolve_asset_graph().get_all_asset_keys())
