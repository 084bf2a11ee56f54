"""A job driver's own local Ray ends with it, killed or not: each test runs a driver process that
starts a Ray of its own (GCS, raylet, workers), so each pays a full Ray start. The system tier (make
test-system, which CI runs after make test): they took 32 s of the CPU suite's 4-minute budget on 2
cores, and no other test can share their clusters."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from value_assets.core.contract import iter_dirname, load_contract
from value_assets.core.demo_data import make_demo_data

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("data"), rows=64, heldout_rows=32, seed=0)


def _survivors(procs: list, *, timeout_s: float) -> list:
    """Wait up to `timeout_s` for a driver's processes to end; kill those still running (only
    these, by pid) and return them."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return alive


def test_a_killed_driver_takes_its_local_ray_along(tmp_path):
    """SIGKILL runs no `finally`: the local Ray the driver started (GCS, raylet, workers, agents)
    must still go within seconds, not linger for a minute."""
    import psutil

    errors = tmp_path / "driver.stderr"
    with errors.open("w") as err:
        driver = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("killed_driver.py"))],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=dict(os.environ, RAY_ADDRESS=""),
        )
    try:
        line = driver.stdout.readline()
        assert line, (
            "the driver ended before it listed its processes (exit code "
            f"{driver.wait(timeout=30)}):\n{errors.read_text()[-3000:]}"
        )
        started = {int(pid): name for pid, name in json.loads(line).items()}
        assert len(started) >= 3, started  # gcs_server, raylet, a worker at least
        procs = []
        for pid in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                procs.append(psutil.Process(pid))
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    t0 = time.monotonic()
    alive = _survivors(procs, timeout_s=30)
    took = time.monotonic() - t0
    assert not alive, (
        f"still alive {took:.0f} s after the driver was killed: {[(p.pid, started[p.pid]) for p in alive]}"
    )


_OWN_RAY_DRIVER = """
import json, sys
from pathlib import Path

import psutil

from tests.job.jobtest_helpers import quiet, tiny_train_job
from value_assets.gpu.drivers.train import train

started = {}

def record(step, _metrics):
    if step == 1:  # Ray and its workers are up: everything this driver started
        for p in psutil.Process().children(recursive=True):
            try:  # Ray's short-lived helpers may end between the listing and the read
                started[p.pid] = [p.name(), p.create_time()]
            except psutil.NoSuchProcess:
                pass

result = train(tiny_train_job(Path(sys.argv[1]), Path(sys.argv[2]), gpus=1, stop_after=2), log=quiet, on_step=record)
print(json.dumps({"started": started, "steps": result.completed_steps, "contract": result.contract_sha256}), flush=True)
"""


def test_a_driver_that_ends_cleanly_ends_its_local_ray(manifest, tmp_path):
    """The job run by hand: no Ray given, so the driver starts a local one with fresh workers,
    trains, publishes, and ends that Ray with itself (the SIGKILL counterpart is the test above).

    Ray's temp folder holds the address an earlier `ray start` recorded (its cluster gone): the
    driver still starts its own Ray instead of joining, or failing on, that one."""
    import psutil

    from value_assets.core.warm_folder import POOL_ENV

    ray_tmp = Path(tempfile.mkdtemp(prefix="rtd", dir="/tmp"))  # short: Ray's socket paths are capped at 107 bytes
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # nothing listens there
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", POOL_ENV)}
    env["RAY_TMPDIR"] = str(ray_tmp)
    out = tmp_path / "critic"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _OWN_RAY_DRIVER, str(manifest), str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).resolve().parents[2],
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    started = {int(pid): name for pid, (name, _) in report["started"].items()}
    assert len(started) >= 3, started  # gcs_server, raylet, the worker at least
    assert report["steps"] == 2 and load_contract(out / iter_dirname(2))[1] == report["contract"]
    procs = []
    for pid, (_, created) in report["started"].items():
        with contextlib.suppress(psutil.NoSuchProcess):
            p = psutil.Process(int(pid))
            if p.create_time() == created:  # the same process, not a later one with its pid
                procs.append(p)
    alive = _survivors(procs, timeout_s=30)
    assert not alive, f"still alive after the driver ended: {[(p.pid, started[p.pid]) for p in alive]}"
