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

    alive = list(procs)
    for signal_, wait_s in (("terminate", grace_s), ("kill", kill_wait_s)):
        for p in alive:
            try:
                getattr(p, signal_)()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(alive, timeout=wait_s)
    return [p.pid for p in alive]


def processes_naming(*needles: str) -> list:
    """Processes whose command line names one of `needles` (e.g. a Ray temp folder, a GCS address), and all their
    descendants."""
    import psutil

    found = {}
    for p in psutil.process_iter(["cmdline"]):
        if any(n in arg for arg in (p.info["cmdline"] or []) for n in needles):
            found[p.pid] = p
            for child in p.children(recursive=True):
                found[child.pid] = child
    return list(found.values())


def stop_ray(root: str, gcs_address: str, grace_s: float = 1.0, kill_wait_s: float = 20.0) -> list[int]:
    """Stop, by id, every process of the Ray cluster whose temp folder is `root`; the pids that outlived SIGKILL.

    The head's Ray client server names only the GCS address (`--address=host:port`), not the
    folder, and is nobody's child once `ray start` has exited: hence `gcs_address` too.
    A short grace: Ray's GCS server ignores SIGTERM and its raylets drain for ~10 s, so a longer
    one only waits for the SIGKILL that follows it anyway."""
    return terminate_then_kill(processes_naming(root, f"={gcs_address}"), grace_s, kill_wait_s)
