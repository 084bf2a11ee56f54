"""The Ray launcher for real: a local Ray cluster (owned by this test), a Ray job running the
Pipes stand-in, messages read back from the job logs by dagster-ray's reader."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from value_assets.assets.common import latest_metadata
from value_assets.definitions import make_definitions
from value_assets.resources import RayJobLauncher

ROOT = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().with_name("pipes_standin.py")

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
def ray_dashboard():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray session is already active in this process")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths are capped at 107 bytes
    try:
        try:
            context = ray.init(num_cpus=2, include_dashboard=True, dashboard_port=0, log_to_driver=False,
                               _temp_dir=temp_dir)
        except Exception as exc:  # no dashboard support in this install: nothing to test here
            pytest.skip(f"local Ray with dashboard unavailable: {exc}")
        try:
            yield f"http://{context.dashboard_url}"
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


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
