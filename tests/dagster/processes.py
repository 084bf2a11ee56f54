"""Process helpers of the Dagster tests: free ports, the `ray` CLI, and stopping process trees by id."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

RAY = Path(sys.executable).with_name("ray")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def terminate_then_kill(procs: list, grace_s: float, kill_wait_s: float) -> list[int]:
    """SIGTERM `procs` (psutil.Process), SIGKILL what is left after `grace_s`; the pids still alive
    `kill_wait_s` after that."""
    import psutil

    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=kill_wait_s)
    return [p.pid for p in alive]


def processes_naming(root: str) -> list:
    """Processes whose command line names `root` (e.g. a Ray temp folder), and all their descendants."""
    import psutil

    found = {}
    for p in psutil.process_iter(["cmdline"]):
        if any(root in arg for arg in (p.info["cmdline"] or [])):
            found[p.pid] = p
            for child in p.children(recursive=True):
                found[child.pid] = child
    return list(found.values())


def stop_ray(root: str, deadline_s: float = 20.0) -> list[int]:
    """Stop, by id, every process of the Ray cluster whose temp folder is `root`; the pids that outlived SIGKILL."""
    return terminate_then_kill(processes_naming(root), deadline_s, deadline_s)
