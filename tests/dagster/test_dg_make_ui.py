"""`make ui` as a script starts it: the exact Makefile target (`dg dev` under value_assets/devserver.py)
on a free port with a fresh DAGSTER_HOME, in the background (SIGINT ignored, as a non-interactive
shell's `make ui &` has it). Its startup output holds no warning (no dagster.yaml that "will not be
used", no superseded `dagster dev`, no dg virtual-environment mismatch), and SIGINT to its process
group (Ctrl-C) ends every process it started within a bounded wait. Whatever outlives that is
killed by id before the test fails. The `$(STAMP)` install is never remade here (`--old-file`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.dagster.processes import free_port
from tests.dagster.ui_harness import _proc_stat, alive, kill

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120
GRACE_S = 8  # make ui's UI_GRACE: SIGINT, then SIGTERM/SIGKILL to what is left of the group
STOP_TIMEOUT_S = GRACE_S + 15
WARNING = re.compile(r"warn|will not be used|supersed|deprecat|does not match", re.IGNORECASE)


def _ignore_sigint() -> None:
    # POSIX sh starts an asynchronous command (`make ui &` in a script) with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def processes_with_home(home: Path) -> dict[int, int]:
    """{pid: start time} of the live processes whose environment has DAGSTER_HOME=`home`: every
    process `make ui` started, whatever its session or parent."""
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


def test_make_ui_starts_without_warnings_and_stops_every_process(tmp_path):
    port = free_port()
    home = tmp_path / "dagster_home"
    log_path = tmp_path / "make-ui.log"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "DAGSTER_HOME")}
    # the Makefile's $(STAMP), spelled as it spells it (make tells targets apart by name)
    cmd = ["make", "--no-print-directory", "--old-file=.venv/.installed", "ui"]
    cmd += [f"UI_PORT={port}", f"DAGSTER_HOME_DIR={home}", f"UI_GRACE={GRACE_S}"]
    with open(log_path, "wb") as log:
        make = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_ignore_sigint,
        )
    seen = {make.pid: _proc_stat(make.pid)[2]}
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert make.poll() is None, f"make ui exited with {make.returncode}:\n{log_path.read_text()[-4000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            assert time.monotonic() < deadline, f"no /server_info in {READY_TIMEOUT_S}s:\n{log_path.read_text()}"
            time.sleep(0.3)
        seen.update(processes_with_home(home))
        # the webserver, the daemon and the code servers all carry the instance
        assert len(seen) >= 5, sorted(seen)
        startup = log_path.read_text(errors="replace")
        warnings = [line for line in startup.splitlines() if WARNING.search(line)]
        assert not warnings, "\n".join(warnings)
        assert (home / "dagster.yaml").read_text() == (REPO_ROOT / "deploy" / "dagster.yaml").read_text()

        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the whole foreground group
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            make.poll()
            seen.update({p: s for p, s in processes_with_home(home).items() if p not in seen})
            if not alive(seen):
                break
            time.sleep(0.2)
        left = alive(seen)
        assert not left, (
            f"{len(left)} processes left {STOP_TIMEOUT_S}s after SIGINT: {sorted(left)}\n"
            + log_path.read_text(errors="replace")[-3000:]
        )
        assert make.poll() is not None
    finally:
        kill(seen | processes_with_home(home))
        if make.poll() is None:
            make.kill()
        make.wait(timeout=10)
