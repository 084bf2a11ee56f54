"""The local launcher's warm Ray cluster (core/warm_folder.py, gpu/workers/warm_helper.py): a
helper process owns it, jobs find it through a folder, it stays while a job holds it and ends
when idle, Ray processes included (when stopped: tests/dagster/test_dg_engine.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from value_assets.core.warm_folder import INFO_NAME, POOL_ENV, read_live, stop_warm_cluster, use_warm_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def ray_processes_of(address: str) -> list[int]:
    """Pids of the Ray server processes started for the cluster at `address` (its GCS port)."""
    import psutil

    port = address.rsplit(":", 1)[1]
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if ("gcs_server" in cmd or "raylet" in cmd) and port in cmd:
            found.append(proc.info["pid"])
    return found


def test_the_warm_cluster_is_shared_kept_while_used_and_ended_when_idle_or_stopped(tmp_path, monkeypatch):
    # Ray's temp folder holds the address of a `ray start` cluster that is gone: the helper
    # starts its own Ray all the same (ray.init without address="local" would try to join it).
    ray_tmp = Path(tempfile.mkdtemp(prefix="rtw", dir="/tmp"))  # short: Ray's socket paths are capped at 107 bytes
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        _warm_cluster_lifecycle(tmp_path / "warm")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _warm_cluster_lifecycle(folder):
    with use_warm_cluster(folder, python=sys.executable, idle_s=1.0) as first:
        assert json.loads((folder / INFO_NAME).read_text())["address"] == first.address
        assert first.job_env() == {"RAY_ADDRESS": first.address, POOL_ENV: "warm", "RAY_AUTH_MODE": "disabled"}
        assert ray_processes_of(first.address)
        time.sleep(3)  # longer than the idle limit, but a job holds it
        assert alive(first.pid) and read_live(folder) == first
        with use_warm_cluster(folder, python=sys.executable, idle_s=1.0) as second:
            assert second == first  # joined, not started again
    servers = ray_processes_of(first.address)
    assert wait_until(lambda: not alive(first.pid), 60), "the helper outlived its idle limit"
    assert not (folder / INFO_NAME).exists()
    assert wait_until(lambda: not any(alive(p) for p in servers), 30), "Ray outlived its helper"
    assert not stop_warm_cluster(folder)  # nothing serves now
    # Ended by `stop_warm_cluster` instead: tests/dagster/test_dg_engine.py, at the end of its two
    # lineages (a third cluster start here cost ~10 s).
