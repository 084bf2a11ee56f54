"""The warm cluster's helper: owns one local Ray cluster for the GPU jobs of an instance
(value_assets/core/warm_folder.py describes the folder it serves through).

Usage: python -m value_assets.gpu.workers.warm_helper --dir DIR --idle-s SECONDS [--num-cpus N] [--detach]

It takes DIR/helper.lock for its whole life (its identity: a cluster.json is believed only while
that lock is held and its pid is still the process that started at the recorded time), starts Ray,
publishes the address in DIR/cluster.json and serves until no job has held DIR/use.lock for
SECONDS, or until SIGTERM/SIGINT; then it withdraws cluster.json (under start.lock, so no job joins
an ending cluster) and shuts Ray down, detached workers included. If it is killed outright, its
reaper ends the Ray processes it started (workers/reaper.py), and the kernel releases its lock.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import signal
import sys
import time
from pathlib import Path

from value_assets.core.warm_folder import (
    INFO_NAME,
    LOG_NAME,
    POOL_NAME,
    START_LOCK,
    USE_LOCK,
    hold_helper_lock,
    locked,
    write_info,
)

POLL_S = 0.5


def _idle_for(folder: Path, since: float) -> float | None:
    """Seconds since the last job ended, or None while a job holds the cluster."""
    with open(folder / USE_LOCK, "a+") as use:
        try:
            fcntl.flock(use, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        try:
            return time.time() - max(since, os.stat(folder / USE_LOCK).st_mtime)
        finally:
            fcntl.flock(use, fcntl.LOCK_UN)


def serve(folder: Path, idle_s: float, num_cpus: int | None) -> int:
    try:
        identity = hold_helper_lock(folder)  # released by the kernel when this process ends, however it ends
    except BlockingIOError:
        print("another helper holds this folder's helper.lock: not starting a second cluster", flush=True)
        return 1
    try:
        return _serve(folder, idle_s, num_cpus)
    finally:
        identity.close()


def _serve(folder: Path, idle_s: float, num_cpus: int | None) -> int:
    import ray

    from value_assets.gpu.workers.cluster import _start_reaper

    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(True))
    cpus = num_cpus or max(os.cpu_count() or 1, 8)  # logical slots: a job may ask for more workers than cores
    # "local": its own Ray, never one whose address an earlier `ray start` left in Ray's temp folder.
    ctx = ray.init(address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    reaper = _start_reaper()
    started = time.time()
    try:
        # Without start.lock: the launcher that started this helper holds it while it waits for this file.
        write_info(folder, ctx.address_info["gcs_address"], POOL_NAME)
        print(f"warm cluster {ctx.address_info['gcs_address']} serving {folder} (idle limit {idle_s:g} s)", flush=True)
        while not stop:
            time.sleep(POLL_S)
            with locked(folder / START_LOCK, fcntl.LOCK_EX):
                idle = _idle_for(folder, started)
                if idle is not None and idle > idle_s:
                    print(f"idle for {idle:.0f} s: ending", flush=True)
                    break
    finally:
        with locked(folder / START_LOCK, fcntl.LOCK_EX):
            with contextlib.suppress(OSError):
                (folder / INFO_NAME).unlink()
        ray.shutdown()
        if reaper is not None:
            reaper.stdin.close()
            reaper.wait(timeout=30)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--idle-s", type=float, required=True)
    ap.add_argument("--num-cpus", type=int, default=None)
    ap.add_argument("--detach", action="store_true", help="fork; the parent prints the helper's pid and exits at once")
    args = ap.parse_args(argv)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    if args.detach:
        pid = os.fork()
        if pid > 0:
            print(pid, flush=True)  # the launcher waits for this helper by pid
            os._exit(0)
        log = os.open(folder / LOG_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(log, 1)  # off the launcher's pipe, which then closes
        os.dup2(log, 2)
        os.close(log)
    return serve(folder, args.idle_s, args.num_cpus)


if __name__ == "__main__":
    sys.exit(main())
