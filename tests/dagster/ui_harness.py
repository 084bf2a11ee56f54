"""Helpers for the UI end-to-end test: `dagster dev` in its own process group, GraphQL over HTTP,
and a headless Chromium screenshot. Every wait has a deadline; everything started is ended by id."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
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


# A line of the UI's startup output that the project's entry point must not print: a dagster.yaml
# that "will not be used", the superseded `dagster dev`, dg's virtual-environment mismatch.
STARTUP_WARNING = re.compile(r"warn|will not be used|supersed|deprecat|does not match", re.IGNORECASE)


def _ignore_sigint() -> None:
    # POSIX sh starts an asynchronous command (`make ui &` in a script) with SIGINT ignored; Dagster's
    # dev command then ignored SIGTERM too (value_assets/devserver.py says why).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def processes_with_home(home: Path) -> dict[int, int]:
    """{pid: start time} of the live processes whose environment has DAGSTER_HOME=`home`: every
    process the UI started, whatever its session or parent."""
    needle = f"DAGSTER_HOME={home}".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in environ and (st := _proc_stat(int(name))) is not None:
            found[int(name)] = st[2]
    return found


class DagsterDev:
    """The project's UI entry point exactly as a script starts it: `make ui` (`dg dev` under
    value_assets/devserver.py) on 127.0.0.1 with `env`'s DAGSTER_HOME, in the background (its own
    session, SIGINT ignored, as a non-interactive shell's `make ui &` has it). The `$(STAMP)` install
    is never remade here (`--old-file`)."""

    GRACE_S = 8  # make ui's UI_GRACE: SIGINT, then SIGTERM/SIGKILL to what is left of the group

    def __init__(self, repo_root: Path, port: int, env: dict[str, str], log_path: Path):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.home = Path(env["DAGSTER_HOME"])
        self._log = open(log_path, "wb")
        env = {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "DAGSTER_HOME")}
        # the Makefile's $(STAMP), spelled as it spells it (make tells targets apart by name)
        cmd = ["make", "--no-print-directory", "--old-file=.venv/.installed", "ui"]
        cmd += [f"UI_PORT={port}", f"DAGSTER_HOME_DIR={self.home}", f"UI_GRACE={self.GRACE_S}"]
        self.proc = subprocess.Popen(
            cmd,
            cwd=repo_root,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_ignore_sigint,
        )
        self.pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        self.seen: dict[int, int] = family(self.pgid)

    def startup_warnings(self) -> list[str]:
        return [line for line in self.log_tail(200_000).splitlines() if STARTUP_WARNING.search(line)]

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
        """Ctrl-C: SIGINT to the group (the terminal signals the whole foreground group), wait for every
        process carrying this DAGSTER_HOME to end; return those still alive after `timeout_s` (none
        expected), then kill them by id."""
        self.seen.update(family(self.pgid))
        self.seen.update(processes_with_home(self.home))
        try:
            os.killpg(self.pgid, signal.SIGINT)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.proc.poll()
            self.seen.update({p: t for p, t in processes_with_home(self.home).items() if p not in self.seen})
            if not alive(self.seen):
                break
            time.sleep(0.2)
        left = alive(self.seen)
        kill(self.seen | processes_with_home(self.home))
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._log.close()
        return left


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
