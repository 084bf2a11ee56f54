"""Warm workers (`cluster.WorkerPool`): jobs on a cluster that outlives them reuse the same worker
processes, and a reused worker trains bitwise like a fresh one. A failed job ends the pool (a
refusal raised by the driver between worker calls does not); a pool
another live job holds is waited for (and refused after the job's timeout); a job of another shape
replaces it. Faults in test_faults' style (issue 33): a driver SIGKILLed mid-run leaves workers the
next job resets; a worker SIGKILLed mid-run fails its job (exit 1, an infrastructure failure named)
and the next job gets new workers; a worker SIGKILLed between jobs is replaced (a SIGKILLed
warm-cluster helper: tests/job/test_warm_cluster.py)."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from tests.job.jobtest_helpers import tiny_train_job
from value_assets.core.demo_data import make_demo_data
from value_assets.core.errors import InputError
from value_assets.gpu.drivers.train import train
from value_assets.gpu.workers.cluster import POOL_ENV, POOL_NAMESPACE, WorkerPool
from value_assets.gpu.workers.worker import CriticWorker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


class Log(list):
    def __call__(self, message: str) -> None:
        self.append(message)

    def pids(self) -> list[int]:
        placement = [json.loads(m[len("placement ") :]) for m in self if m.startswith("placement ")]
        assert len(placement) == 1, self
        return [r["pid"] for r in placement[0]["ranks"]]

    def source(self) -> str:
        up = [m for m in self if m.startswith("workers up:")]
        assert len(up) == 1, self
        return up[0].split("pool ", 1)[1] if "pool " in up[0] else "fresh"


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return make_demo_data(tmp_path_factory.mktemp("data"), seed=0)


@pytest.fixture(scope="module")
def pool_name(ray_cluster):
    """One pool for the module: the first test makes it, the second starts on it (its first job
    reuses it, so it starts no processes of its own). Destroyed with the module."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    yield name
    WorkerPool.destroy(name)
    assert not pool_workers_alive(name)


@pytest.fixture
def pool(pool_name, monkeypatch):
    monkeypatch.setenv(POOL_ENV, pool_name)
    return pool_name


def run(manifest, out, log, **kw):
    return train(tiny_train_job(manifest, out, **({"save_interval": 32, "stop_after": 3} | kw)), log=log)


def pool_workers_alive(name: str) -> bool:
    import ray

    return any(
        e.get("namespace") == POOL_NAMESPACE and str(e.get("name", "")).startswith(f"{name}-w")
        for e in ray.util.list_named_actors(all_namespaces=True)
    )


_KILLED_DRIVER = """
import sys, time
from pathlib import Path
from tests.job.jobtest_helpers import tiny_train_job
from value_assets.gpu.drivers.train import train

def on_step(step, _metrics):
    print(step, flush=True)  # the workers are set up and have trained a step: SIGKILL now
    time.sleep(600)

job = tiny_train_job(Path(sys.argv[1]), Path(sys.argv[2]), save_interval=32, stop_after=3)
train(job, log=lambda _m: None, on_step=on_step)
"""


def kill_a_driver_mid_run(manifest, out) -> None:
    """A job on the pool (joined through RAY_ADDRESS, as a warm cluster's jobs are) whose driver is
    SIGKILLed after its first step, as the OOM killer or a terminated Dagster run would: it never
    releases its workers, whose process group and megatron state stay initialised."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import ray

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONPATH=str(root))
    driver = subprocess.Popen(
        [sys.executable, "-c", _KILLED_DRIVER, str(manifest), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=root,
    )
    try:
        assert driver.stdout.readline().strip() == "1", "the driver ended before its first step"
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)


def test_pooled_workers_are_reused_and_train_bitwise_like_fresh_ones(pool, manifest, tmp_path):
    """A new pool's first job runs on fresh processes; the next job reuses them and trains bitwise
    like it, also after a job whose driver was SIGKILLed mid-run (its lease passes on and the workers
    it left configured are reset, issue 33 defect 1: the next job failed, "data parallel group is
    already initialized"). (Jobs without a pool, their workers ended with them: the own-Ray drivers
    of tests/job/test_faults.py.)"""
    first_log, second_log = Log(), Log()
    first = run(manifest, tmp_path / "first", first_log)
    kill_a_driver_mid_run(manifest, tmp_path / "killed")
    second = run(manifest, tmp_path / "second", second_log)
    assert first_log.source() == f"{pool} (new)" and second_log.source() == f"{pool} (reused)"
    assert second_log.pids() == first_log.pids()
    assert second.losses == first.losses  # bitwise: nothing of the last job survives `release`
    assert second.state_sha256 == first.state_sha256
    assert pool_workers_alive(pool)  # kept for the next job (the next test's)


def test_a_worker_killed_mid_run_fails_the_job_cleanly_and_the_next_job_gets_fresh_workers(
    pool, manifest, tmp_path, monkeypatch, capsys
):
    """Issue 33: one pooled worker SIGKILLed mid-run (the OOM killer), through the command line. The
    job fails at once (its peer, in a collective with the dead rank, fails too) with exit 1, an
    infrastructure failure (docs/operations.md#exit-codes): not bad input, not a bug, and said so,
    naming the dead rank and its pid; nothing is published and nothing is left in the output, run log
    included. The surviving worker, in an unknown state, is ended, never reused: the next job gets
    a new pool and trains."""
    import signal

    import psutil

    from value_assets.cli import main as cli_main
    from value_assets.gpu.drivers import train as train_module

    seen, killed = Log(), []
    real_train = train_module.train

    def kill_rank_1(step, _metrics):
        if step == 1:  # workers set up, a step trained: the job is mid-run
            killed.append(seen.pids()[1])
            os.kill(killed[0], signal.SIGKILL)

    def train_and_kill(cfg, log=print):
        def both(message: str) -> None:
            seen(message)
            log(message)

        return real_train(cfg, log=both, on_step=kill_rank_1)

    monkeypatch.setattr(train_module, "train", train_and_kill)  # the CLI imports it when it runs
    out = tmp_path / "killed"
    argv = ["train", str(manifest), "--output", str(out), "--backbone", "tiny", "--global-batch-size", "32"]
    rc = cli_main([*argv, "--gpus", "2", "--save-interval", "32"])
    err = capsys.readouterr().err
    assert seen.source().startswith(pool) and killed
    assert rc == 1, err[-2000:]
    said = err.strip().splitlines()[-1]
    assert said.startswith("value-assets: infrastructure failure: ") and "please report" not in said, said
    assert f"worker rank 1 (pid {killed[0]}) died during train_step" in said, said
    assert said.endswith("this run published nothing"), said
    assert not out.exists()  # no save, no contract, no run log: nothing written
    survivor = [psutil.Process(pid) for pid in seen.pids()[:1] if psutil.pid_exists(pid)]
    _, alive = psutil.wait_procs(survivor, timeout=30)
    assert not alive, "the surviving worker of the failed job was kept"

    after = Log()
    run(manifest, tmp_path / "next", after)
    assert after.source() == f"{pool} (new)" and set(after.pids()).isdisjoint(seen.pids())


def test_a_pool_held_by_a_live_job_is_waited_for_another_shape_replaces_it_and_a_failed_job_ends_it(
    pool, manifest, tmp_path
):
    """One flow, so that each pool start (fresh processes importing torch and megatron) serves
    several checks: held -> waited for and refused; another shape -> replaced; a job refused by
    its driver -> kept; a failed job on that pool -> ended, and the next job starts fresh processes."""
    import socket

    import ray

    from value_assets.gpu.workers.cluster import ClusterError

    first = Log()
    run(manifest, tmp_path / "a", first)  # the two-worker pool, reused from the test above when it ran
    rank0 = ray.get_actor(f"{pool}-w0", namespace=POOL_NAMESPACE)
    other = {"token": "another-job", "pid": os.getpid(), "host": socket.gethostname()}  # a live holder
    assert ray.get(rank0.acquire_lease.remote(other))
    busy = Log()
    with pytest.raises(ClusterError, match=f"worker pool {pool} stayed in use by another job for 1 s"):
        run(manifest, tmp_path / "b", busy, timeout_s=1)
    assert any("is in use by another job: waiting up to 1 s" in m for m in busy)
    assert not (tmp_path / "b").exists()  # nothing written
    assert pool_workers_alive(pool) and ray.get(rank0.ping.remote()) == first.pids()[0]  # the holder's pool is intact
    ray.get(rank0.return_lease.remote("another-job"))
    one = Log()
    run(manifest, tmp_path / "d", one, gpus=1)
    assert one.source() == f"{pool} (new)" and len(one.pids()) == 1
    with pytest.raises(ValueError):
        ray.get_actor(f"{pool}-w1", namespace=POOL_NAMESPACE)  # the two-worker pool is gone

    # A refusal the driver raises between worker calls (as when the data changes mid-run) leaves
    # the workers as a clean job does: they are released and the pool is kept.
    def refuse(step, _metrics):
        if step == 2:
            raise InputError("step 2", "planted refusal")

    refused = Log()
    with pytest.raises(InputError, match="planted refusal"):
        train(tiny_train_job(manifest, tmp_path / "r", gpus=1, stop_after=3), log=refused, on_step=refuse)
    assert refused.source() == f"{pool} (reused)" and refused.pids() == one.pids()
    assert pool_workers_alive(pool)

    # A pool worker SIGKILLed between jobs (the OOM killer): Ray sees it die within a second (no
    # process its saves forked outlives it: one that did kept the worker's connection to Ray open,
    # and the next job waited 30 s for its lease call), and the next job replaces the pool.
    import signal

    os.kill(one.pids()[0], signal.SIGKILL)
    after = Log()
    run(manifest, tmp_path / "f", after, gpus=1)
    assert after.source() == f"{pool} (new)" and set(after.pids()).isdisjoint(one.pids())
    assert not any("GetTimeoutError" in m for m in after), after  # no 30 s wait on a dead worker

    # Any other failure ends the pool (here the one-worker pool it reused); the next job starts
    # fresh processes, as after the kill above.
    def fail(step, _metrics):
        if step == 2:
            raise RuntimeError("planted failure")

    failed = Log()
    with pytest.raises(RuntimeError, match="planted failure"):
        train(tiny_train_job(manifest, tmp_path / "e", gpus=1, stop_after=3), log=failed, on_step=fail)
    assert failed.source() == f"{pool} (reused)" and failed.pids() == after.pids()
    assert not pool_workers_alive(pool)


def test_the_lease_passes_on_only_when_its_holder_is_gone():
    worker = CriticWorker()
    live = {"token": "a", "pid": os.getpid(), "host": __import__("socket").gethostname()}
    assert worker.acquire_lease(live) and worker.acquire_lease(live)  # its own holder again
    assert not worker.acquire_lease({**live, "token": "b"})
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    worker.return_lease("a")
    assert worker.acquire_lease({**live, "token": "c", "pid": int(dead.stdout)})
    assert worker.acquire_lease({**live, "token": "d"})  # "c"'s process has exited
    worker.return_lease("wrong token")
    assert not worker.acquire_lease({**live, "token": "e"})
    # A holder is its pid and its start time: a pid that now names another process holds nothing
    # (the pool would otherwise wait on it forever; issue 33, defect 2).
    from value_assets.core.warm_folder import process_started

    worker.return_lease("d")
    started = process_started(os.getpid())
    assert worker.acquire_lease({**live, "token": "f", "started": started - 3600})
    assert worker.acquire_lease({**live, "token": "g", "started": started})  # "f"'s pid is another process now
    assert not worker.acquire_lease({**live, "token": "h"})  # "g" is this very process
