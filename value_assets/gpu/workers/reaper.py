"""Ends the processes of a local Ray whose driver died without cleaning up.

A driver killed with SIGKILL runs no `finally`. Ray's kernel fate-sharing takes its GCS and raylet
along, but the raylet's agents (dashboard, runtime-env) then try to report the raylet's death to the
dead GCS with a 60 s timeout and linger that long; workers may wait for the GCS too. The driver
starts this process with the pids of the Ray processes it started and keeps a pipe to its stdin
open. Every second it records the descendants of those processes; when the pipe closes (the driver
exited, in any way) it kills what it recorded and is still running. Only processes recorded from
that tree are touched; psutil refuses a pid that was reused since (it compares creation times).

Usage: python -m value_assets.gpu.workers.reaper PID [PID ...]  (stdin: the driver's pipe)
"""

from __future__ import annotations

import os
import select
import sys

import psutil

POLL_S = 1.0


def _snapshot(roots: list[psutil.Process], seen: dict[int, psutil.Process]) -> None:
    for root in roots:
        try:
            family = [root, *root.children(recursive=True)]
        except psutil.Error:
            family = [root]
        for p in family:
            if p.pid != os.getpid():
                seen.setdefault(p.pid, p)


def main(argv: list[str]) -> int:
    roots = []
    for pid in argv:
        try:
            roots.append(psutil.Process(int(pid)))
        except psutil.Error:
            continue
    seen: dict[int, psutil.Process] = {}
    while True:
        _snapshot(roots, seen)
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # EOF: the driver is gone (or finished and closed the pipe)
    for p in seen.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(seen.values()), timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
