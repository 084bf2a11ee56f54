"""End to end through the real UI server: `dagster dev` on 127.0.0.1, the manifest sensor ticked by
its daemon, the local deployment's GPU command (here the Pipes stand-in, tests/dagster/pipes_standin.py:
a real subprocess speaking real Pipes, writing real contracts and reports, without a model), runs and
check results read over GraphQL, and a headless Chromium screenshot of the asset graph.

What this covers is the UI server, its daemon and GraphQL; the real engine inside Dagster is
tests/dagster/test_dg_engine.py, the engine itself tests/job/test_job.py.

Flow: a learnable demo manifest in a tmp watched folder -> `dagster dev` (own process group) ->
GraphQL: the sensor is RUNNING (started if not) -> its tick requests the `full` run for the
manifest's partition -> it ends in SUCCESS -> read its `ev_gate`, `dataset_integrity` and
`contract_integrity` executions for the partition -> launch the `canary` job for the partition over
GraphQL -> it ends in SUCCESS -> screenshot `/asset-groups` (groups expanded) -> stop every process started, by id.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from .ui_harness import CHROMIUM, TERMINAL_RUN_STATUSES, DagsterDev, free_port, screenshot

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO_ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().with_name("pipes_standin.py")
# Where to keep a copy of the screenshot (CI artifact, manual look); unset: only the pytest tmp.
SCREENSHOT_COPY_ENV = "VALUE_ASSETS_UI_SCREENSHOT"

REPOSITORIES = """
query {
  repositoriesOrError {
    __typename
    ... on RepositoryConnection { nodes { name location { name } sensors { name } jobs { name } } }
    ... on PythonError { message }
  }
}"""

SENSOR = """
query ($selector: SensorSelector!) {
  sensorOrError(sensorSelector: $selector) {
    __typename
    ... on Sensor { name minIntervalSeconds sensorState { status } }
    ... on Error { message }
  }
}"""

START_SENSOR = """
mutation ($selector: SensorSelector!) {
  startSensor(sensorSelector: $selector) {
    __typename
    ... on Sensor { name sensorState { status } }
    ... on Error { message }
  }
}"""

RUNS = """
query ($filter: RunsFilter!) {
  runsOrError(filter: $filter) {
    __typename
    ... on Runs { results { runId jobName status tags { key value } } }
    ... on Error { message }
  }
}"""

RUN = """
query ($runId: ID!) {
  runOrError(runId: $runId) {
    __typename
    ... on Run { runId jobName status tags { key value } }
    ... on Error { message }
  }
}"""

RUN_ERRORS = """
query ($runId: ID!) {
  runOrError(runId: $runId) {
    ... on Run { eventConnection(limit: 1000) { events { ... on MessageEvent { level stepKey message } } } }
  }
}"""

LAUNCH_RUN = """
mutation ($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId status } }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on Error { message }
  }
}"""

CHECK_EXECUTIONS = """
query ($assetKey: AssetKeyInput!, $checkName: String!, $partition: String) {
  assetCheckExecutions(assetKey: $assetKey, checkName: $checkName, partition: $partition, limit: 10) {
    runId status partition
    evaluation {
      success severity description partition
      metadataEntries {
        label
        ... on FloatMetadataEntry { floatValue }
        ... on IntMetadataEntry { intValue }
        ... on TextMetadataEntry { text }
      }
    }
  }
}"""

# (asset, check) pairs the full job evaluates for a manifest with a heldout split.
FULL_JOB_CHECKS = [("train_dataset", "dataset_integrity"), ("heldout_dataset", "dataset_integrity"),
                   ("training_contract", "contract_integrity"), ("ev_report", "ev_gate")]


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")


def run_status(dev: DagsterDev, run_id: str) -> dict:
    run = dev.graphql(RUN, {"runId": run_id})["runOrError"]
    assert run["__typename"] == "Run", run
    return run


def wait_run(dev: DagsterDev, run_id: str, timeout_s: float) -> dict:
    run = wait_for(lambda: (r := run_status(dev, run_id))["status"] in TERMINAL_RUN_STATUSES and r,
                   timeout_s, f"run {run_id} to finish")
    if run["status"] != "SUCCESS":
        events = dev.graphql(RUN_ERRORS, {"runId": run_id})["runOrError"]["eventConnection"]["events"]
        errors = [f"{e.get('stepKey')}: {e['message']}" for e in events if e.get("level") in ("ERROR", "CRITICAL")]
        pytest.fail(f"run {run_id} ({run['jobName']}) ended {run['status']}: {errors[-10:]}")
    return run


def check_results(dev: DagsterDev, partition: str, run_id: str) -> dict[tuple[str, str], dict]:
    """The evaluation of each full-job check in `run_id` for `partition`, read over GraphQL."""
    found = {}
    for asset, check in FULL_JOB_CHECKS:
        executions = dev.graphql(CHECK_EXECUTIONS, {"assetKey": {"path": [asset]}, "checkName": check,
                                                    "partition": partition})["assetCheckExecutions"]
        mine = [e for e in executions if e["runId"] == run_id]
        assert mine, f"{asset}/{check}: no execution in run {run_id} for {partition}: {executions}"
        found[(asset, check)] = mine[0]
    return found


def asset_graph_url(base: str, repository: str, location: str) -> str:
    """The global asset lineage page with both groups expanded (collapsed, it shows two boxes).

    `expanded` takes group ids; the UI uses `global@global:<group>`, or `<repo>@<location>:<group>`
    behind a feature flag: both are given, an unknown id is ignored."""
    ids = [f"{prefix}:{group}" for group in ("data", "critic")
           for prefix in ("global@global", f"{repository}@{location}")]
    return f"{base}/asset-groups?" + urllib.parse.urlencode({"expanded": ",".join(ids)})


def colours(png: Path) -> int:
    from PIL import Image

    with Image.open(png) as im:
        return len(im.convert("RGB").getcolors(maxcolors=1 << 24) or [])


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is not installed (.ci/run installs it)")
def test_dagster_dev_sensor_run_checks_and_asset_graph_screenshot(tmp_path):
    from value_assets.core.demo_data import make_demo_data
    from value_assets.core.hashing import sha256_file
    from value_assets.partitions import partition_key_for

    home, manifests, artifacts = tmp_path / "dagster_home", tmp_path / "manifests", tmp_path / "artifacts"
    home.mkdir()
    shutil.copy(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")  # telemetry and nux off
    # The stand-in reports EV 0.4 (its default): the gate passes.
    manifest = make_demo_data(manifests, rows=128, heldout_rows=64, seed=0)
    partition = partition_key_for(manifest, sha256_file(manifest))

    env = {k: v for k, v in os.environ.items() if k not in ("VALUE_ASSETS_GPU_COMMAND", "VALUE_ASSETS_DATA_ROOTS")}
    env.update({
        "DAGSTER_HOME": str(home), "VALUE_ASSETS_DEPLOYMENT": "local",
        "VALUE_ASSETS_MANIFESTS": str(manifests), "VALUE_ASSETS_ARTIFACTS": str(artifacts),
        "VALUE_ASSETS_GPU_COMMAND": shlex.join([sys.executable, str(STANDIN)]),
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
        "DAGSTER_DISABLE_TELEMETRY": "1", "PYTHONUNBUFFERED": "1",
    })
    t0 = time.monotonic()
    dev = DagsterDev(REPO_ROOT, free_port(), env, tmp_path / "dagster_dev.log")
    try:
        dev.wait_ready(timeout_s=180)

        # The code location and its sensor.
        repos = dev.graphql(REPOSITORIES)["repositoriesOrError"]
        assert repos["__typename"] == "RepositoryConnection", repos
        (repo,) = [r for r in repos["nodes"] if any(s["name"] == "manifest_sensor" for s in r["sensors"])]
        assert repo["location"]["name"] == "value_assets"
        assert {"full", "evaluate", "canary"} <= {j["name"] for j in repo["jobs"]}
        selector = {"repositoryName": repo["name"], "repositoryLocationName": repo["location"]["name"]}
        sensor_selector = {**selector, "sensorName": "manifest_sensor"}
        sensor = dev.graphql(SENSOR, {"selector": sensor_selector})["sensorOrError"]
        assert sensor["__typename"] == "Sensor", sensor
        if sensor["sensorState"]["status"] != "RUNNING":
            sensor = dev.graphql(START_SENSOR, {"selector": sensor_selector})["startSensor"]
            assert sensor["__typename"] == "Sensor", sensor
        assert sensor["sensorState"]["status"] == "RUNNING", sensor

        # The daemon's tick registers the manifest and requests the full run (run_key = partition).
        partition_tag = {"key": "dagster/partition", "value": partition}

        def sensor_runs():
            runs = dev.graphql(RUNS, {"filter": {"pipelineName": "full", "tags": [partition_tag]}})["runsOrError"]
            assert runs["__typename"] == "Runs", runs
            return runs["results"]

        (full,) = wait_for(sensor_runs, 180, f"the sensor to request the full run for {partition}")
        tags = {t["key"]: t["value"] for t in full["tags"]}
        assert tags.get("dagster/sensor_name") == "manifest_sensor" and tags.get("dagster/run_key") == partition, tags

        full = wait_run(dev, full["runId"], timeout_s=420)

        # Checks of the full run, read back over GraphQL for this partition.
        results = check_results(dev, partition, full["runId"])
        for (asset, check), execution in results.items():
            assert execution["status"] == "SUCCEEDED" and execution["evaluation"]["success"], (asset, check, execution)
            assert execution["partition"] == partition
        gate = {m["label"]: m.get("floatValue", m.get("intValue")) for m in
                results[("ev_report", "ev_gate")]["evaluation"]["metadataEntries"]
                if "floatValue" in m or "intValue" in m}
        assert gate["token_ev"] > 0 and gate["trajectory_ev"] > 0, gate

        # A run launched over GraphQL: the canary (one training step) for the registered partition.
        # Launched after the full run: beside it, its GPU step could take the `gpu` pool first and
        # hold it up. In-process executor: no step subprocesses (~10 s each on 2 busy cores).
        launched = dev.graphql(LAUNCH_RUN, {"params": {
            "selector": {**selector, "jobName": "canary"},
            "runConfigData": {"execution": {"config": {"in_process": {}}}},
            "executionMetadata": {"tags": [partition_tag]},
        }})["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched

        canary = wait_run(dev, launched["run"]["runId"], timeout_s=240)
        assert {t["key"]: t["value"] for t in canary["tags"]}["dagster/partition"] == partition

        # The asset lineage graph, rendered headless.
        png = tmp_path / "graph.png"
        shot = screenshot(asset_graph_url(dev.url, repo["name"], repo["location"]["name"]), png, tmp_path / "chromium-profile")
        assert shot.returncode == 0 and png.is_file(), shot.stdout[-2000:]
        if os.environ.get(SCREENSHOT_COPY_ENV):
            shutil.copy(png, os.environ[SCREENSHOT_COPY_ENV])
        assert png.stat().st_size > 30_000, png.stat().st_size
        assert colours(png) > 200, "the screenshot is (nearly) blank"
        print(f"\nui e2e: partition {partition}, full {full['runId']}, canary {canary['runId']}, gate {gate}, "
              f"{time.monotonic() - t0:.0f}s")
    finally:
        left = dev.stop(timeout_s=30)
    assert not left, f"processes still alive after stopping dagster dev: {sorted(left)}"
