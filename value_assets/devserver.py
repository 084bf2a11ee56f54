"""`make ui`'s supervisor: runs a local Dagster UI command (`dg dev ...`) so that stopping it stops
every process it started.

    python -m value_assets.devserver [--grace S] -- dg dev -h 127.0.0.1 -p 3000

Why (docs/operations.md "Dagster notes"): Dagster's dev command maps SIGTERM onto whatever SIGINT
does (`dagster._utils.interrupts.setup_interrupt_handlers`), so when it inherits an ignored SIGINT,
as every command started in the background by a non-interactive shell does (`make ui &` in a
script), it ignores SIGTERM too, and it and its code server, gRPC server, webserver and daemon
stay up until SIGKILL. And `make`, stopped by SIGTERM, passes it to its direct child only (the
recipe's shell, unless the recipe `exec`s), never to what that started.

So the command runs in its own session (its process group: itself and the processes it starts)
with SIGINT and SIGTERM back at their defaults. SIGINT, SIGTERM or SIGHUP to this process, or the
death of its parent (`make`), is passed on as SIGINT to that group, which Dagster answers with an
orderly shutdown (about 3 s); whatever of the group is still alive after the grace period, or once
the command has exited on its own, gets SIGTERM and then SIGKILL. Standard library only, Linux.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

GRACE_S = 15.0
_PR_SET_PDEATHSIG = 1
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _reset_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux; else nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = open(f"/proc/{name}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            found.append(int(name))
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_group(proc: subprocess.Popen, deadline: float) -> bool:
    """Wait until the whole group of `proc` is gone or `deadline` (monotonic) passes; True if gone."""
    while True:
        proc.poll()  # reap the leader, else it lingers as a zombie
        if not group_members(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def supervise(command: Sequence[str], grace_s: float = GRACE_S) -> int:
    """Run `command` as above; its exit status (128 + signal when it was stopped by one)."""
    _die_with_parent()
    proc = subprocess.Popen(list(command), start_new_session=True, preexec_fn=_reset_signals)
    pgid = proc.pid  # the leader of a new session leads its process group
    stopping: list[int] = []

    def _forward(signum: int, _frame: object) -> None:
        if not stopping:
            stopping.append(signum)
            _signal_group(pgid, signal.SIGINT)  # Dagster shuts down in order on SIGINT

    for sig in _FORWARDED:
        signal.signal(sig, _forward)
    try:
        while proc.poll() is None and not stopping:
            time.sleep(0.2)
        if stopping and not _wait_group(proc, time.monotonic() + grace_s):
            print(f"devserver: still running {grace_s:g} s after SIGINT; terminating", file=sys.stderr, flush=True)
    finally:
        # The leader is gone or past its grace: end whatever of its group is left, by group id.
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if _wait_group(proc, time.monotonic()):
                break
            _signal_group(pgid, sig)
            _wait_group(proc, time.monotonic() + wait_s)
        if proc.poll() is None:
            proc.wait(timeout=5)
    if stopping:
        return 128 + stopping[0]
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m value_assets.devserver", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grace", type=float, default=GRACE_S, help="seconds between SIGINT and SIGTERM/SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")
    return supervise(command, args.grace)


if __name__ == "__main__":
    sys.exit(main())
