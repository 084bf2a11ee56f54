"""The Ray launcher for real: a local Ray cluster (`ray start`, owned by this test), a Ray job running the
Pipes stand-in, messages read back from the job logs by dagster-ray's reader."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from value_assets.assets.common import latest_metadata
from value_assets.definitions import make_definitions
from value_assets.resources import RayJobLauncher
from tests.dagster.processes import RAY, free_port, stop_ray

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().with_name("pipes_standin.py")

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def ray_dashboard():
    """A one-node Ray cluster with a dashboard, started with `ray start --head` in a private temp
    folder and on free ports (the dashboard agent's too: another local Ray, e.g. a parallel test
    worker's, must not take it), stopped by process id. This process never initializes Ray."""
    root = tempfile.mkdtemp(prefix="rdg", dir="/tmp")  # short: Ray's socket paths are capped at 107 bytes
    dashboard = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    gcs = f"127.0.0.1:{free_port()}"
    try:
        out = subprocess.run([str(RAY), "start", "--head", "--num-cpus", "2", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
                              "--port", gcs.rsplit(":", 1)[1], "--ray-client-server-port", str(free_port()), "--temp-dir", root, "--include-dashboard", "true",
                              "--dashboard-port", dashboard.rsplit(":", 1)[1], "--dashboard-agent-listen-port", str(free_port())],
                             env=env, capture_output=True, text=True, timeout=180)
        if out.returncode:
            pytest.fail(f"ray start --head failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        yield dashboard
    finally:
        left = stop_ray(root, gcs)
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"Ray processes that outlived SIGKILL: {left}"


def test_ray_job_launcher_runs_the_pipes_job(ray_dashboard, instance, test_resources, manifests_dir,
                                             write_manifest, register):
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    launcher = RayJobLauncher(address=ray_dashboard, command=[sys.executable, str(STANDIN)], env=env,
                              poll_interval_s=0.5, entrypoint_num_cpus=0)
    defs = make_definitions({**test_resources, "launcher": launcher})
    (key,) = register(instance, test_resources, write_manifest(manifests_dir, "onray", standin={"ev": 0.5}))
    result = defs.resolve_job_def("full").execute_in_process(instance=instance, partition_key=key,
                                                             raise_on_error=False)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    assert latest_metadata(instance, "critic_checkpoint", key)["steps"] == latest_metadata(instance, "batch_plan", key)["steps"] >= 1
    assert latest_metadata(instance, "ev_report", key)["token_ev"] == pytest.approx(0.5)
