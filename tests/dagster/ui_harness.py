"""Helpers for the UI end-to-end test: `dagster dev` in its own process group, GraphQL over HTTP,
and a headless Chromium screenshot. Every wait has a deadline; everything started is ended by id."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
# docs/operations.md: these flags render the Dagster UI headless in this container.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TERMINAL_RUN_STATUSES = {"SUCCESS", "FAILURE", "CANCELED"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reset_signals() -> None:
    # docs/operations.md: started from a script, `dagster dev` inherits ignored SIGINT/SIGTERM and then
    # never stops on them; reset them before exec.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, start time) of a live process, None when it is gone (zombies count as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def family(root: int) -> dict[int, int]:
    """{pid: start time} of live processes in `root`'s process group and of every live descendant
    of `root` (a child that started its own session is still found through its parent). The start
    time tells a process from a later one that reuses its pid."""
    stats = {pid: st for pid in _all_pids() if (st := _proc_stat(pid)) is not None}
    found = {pid: st[2] for pid, st in stats.items() if st[1] == root}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, start) in stats.items():
            if ppid == parent and pid not in found:
                found[pid] = start
                frontier.append(pid)
    if root in stats:
        found[root] = stats[root][2]
    return found


def alive(procs: dict[int, int]) -> set[int]:
    """The pids of `procs` still running as the same processes."""
    return {pid for pid, start in procs.items() if (st := _proc_stat(pid)) is not None and st[2] == start}


def kill(procs: dict[int, int], sig: int = signal.SIGKILL) -> None:
    for pid in alive(procs):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


class DagsterDev:
    """`dagster dev -w workspace.yaml` on 127.0.0.1 in its own session (process group = its pid)."""

    def __init__(self, repo_root: Path, port: int, env: dict[str, str], log_path: Path):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [dagster_cli(), "dev", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(port)],
            cwd=repo_root,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_reset_signals,
        )
        self.pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        self.seen: dict[int, int] = family(self.pgid)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> float:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dagster dev exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/server_info", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"dagster dev did not answer /server_info within {timeout_s}s:\n{self.log_tail()}")

    def graphql(self, query: str, variables: dict[str, Any] | None = None, timeout_s: float = 60) -> dict[str, Any]:
        body = json.dumps({"query": query, "variables": variables or {}}).encode()
        req = urllib.request.Request(f"{self.url}/graphql", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out = json.loads(r.read())
        if out.get("errors"):
            raise AssertionError(f"GraphQL errors: {out['errors']}")
        return out["data"]

    def stop(self, timeout_s: float = 30) -> set[int]:
        """SIGTERM the group, wait, then SIGKILL whatever is left; return the pids still alive (none expected)."""
        self.seen.update(family(self.pgid))
        try:
            os.killpg(self.pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive(self.seen):
            time.sleep(0.5)
        kill(self.seen)
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        self._log.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and alive(self.seen):
            time.sleep(0.2)
        return alive(self.seen)


def dagster_cli() -> str:
    """The `dagster` script beside the running interpreter (the project venv)."""
    return str(Path(sys.executable).parent / "dagster")


def screenshot(
    url: str, out: Path, profile: Path, timeout_s: float = 120, size=(1600, 1000), virtual_time_ms: int = 15000
) -> subprocess.CompletedProcess:
    """Headless Chromium screenshot of `url` into `out`; Chromium runs in its own process group,
    which is killed by id when it overruns."""
    cmd = [
        CHROMIUM,
        *CHROMIUM_FLAGS,
        f"--user-data-dir={profile}",
        f"--window-size={size[0]},{size[1]}",
        f"--virtual-time-budget={virtual_time_ms}",
        f"--screenshot={out}",
        url,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout.decode(errors="replace"), "")
    finally:
        # Chromium's helpers (zygote, renderer, gpu) are its descendants; end any that are left.
        kill(family(proc.pid))
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
