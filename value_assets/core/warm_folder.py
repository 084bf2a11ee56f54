"""The local launcher's warm Ray cluster, found and shared through a folder (docs/operations.md#warm-workers).

On the embedded default every GPU step used to start Ray and fresh worker processes (each
importing torch and megatron) and end them again: most of a small lineage's time. Instead, the
first GPU job starts a helper process (`value_assets.gpu.workers.warm_helper`) that owns one local
Ray cluster; every later job of any run on the same instance joins it (`RAY_ADDRESS`) and takes its
workers from the cluster's worker pool (`$VALUE_ASSETS_WORKER_POOL`, `gpu/workers/cluster.py`).
The helper ends the cluster once no job has used it for `idle_s` seconds, on SIGTERM
(`stop_warm_cluster`), and, through its reaper, when it is killed.

Files in the folder:

- `cluster.json`: the helper's pid and the start time of that process, the cluster's address, the
  pool name and the cluster's Ray authentication mode (a job joining by address must be told it:
  Ray 2.60 turns token authentication on for a cluster it starts, never for a joining process);
  present while it serves.
- `helper.lock`: held exclusively by the helper for its whole life (the kernel releases it when the
  helper dies, SIGKILL included). A `cluster.json` is believed only while this lock is held and its
  pid is still the process that started at the recorded time: a helper killed without its `finally`
  leaves its `cluster.json`, and once its pid is reused by an unrelated process, liveness by pid
  alone would send every job to a dead Ray and `stop_warm_cluster` would signal that process. A
  stale `cluster.json` is removed, never trusted (issue 33, defect 2).
- `start.lock`: held exclusively to start a helper, to read `cluster.json`, and by the helper when it
  decides to end (so no job joins a cluster that is ending).
- `use.lock`: held shared by every job while it runs; its mtime is the end of the last job. The
  helper is idle when it can take it exclusively.
- `helper.log`: the helper's output.

This module starts the helper by its module name and imports neither Ray nor torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from value_assets.core.errors import InputError

HELPER_MODULE = "value_assets.gpu.workers.warm_helper"
POOL_ENV = "VALUE_ASSETS_WORKER_POOL"
POOL_NAME = "warm"
INFO_NAME = "cluster.json"
START_LOCK = "start.lock"
HELPER_LOCK = "helper.lock"
USE_LOCK = "use.lock"
AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_MODES = ("disabled", "token")
LOG_NAME = "helper.log"


@dataclass(frozen=True)
class WarmCluster:
    address: str
    pool: str
    pid: int
    started: float | None = None  # the helper process's start time (`process_started`)
    # The cluster's Ray authentication: Ray 2.60 gives a cluster that `ray.init` starts token
    # authentication unless RAY_AUTH_MODE says otherwise, but never turns it on in a process that
    # joins by address. The job must be told, or it is refused ("InvalidAuthToken"); the token
    # itself is where this user's Ray keeps it (~/.ray/auth_token, RAY_AUTH_TOKEN[_PATH]).
    auth_mode: str = "disabled"

    def job_env(self) -> dict[str, str]:
        """The environment that makes a GPU job join this cluster and its worker pool."""
        return {"RAY_ADDRESS": self.address, POOL_ENV: self.pool, AUTH_MODE_ENV: self.auth_mode}


def default_folder(instance_root: str | os.PathLike[str] | None) -> Path:
    """One folder per Dagster instance (by its root directory), under the system temp dir."""
    key = hashlib.sha256(str(Path(instance_root or Path.cwd()).resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / _base_name() / key


def _base_name() -> str:
    return f"value_assets-warm-{os.getuid()}"


def private_folder(folder: Path) -> Path:
    """`folder`, created for this user alone where it is missing, and refused where it is not a plain
    folder of this user that no one else may write. The cluster address read from it decides which
    Ray cluster runs the GPU jobs, and the shared temp dir is anyone's to plant a folder in: a
    planted `cluster.json` would send the jobs (and what they report) to another user's Ray. The
    default layout's per-user parent (`value_assets-warm-<uid>`) is held to the same rule."""
    levels = [folder.parent, folder] if folder.parent.name == _base_name() else [folder]
    levels[0].parent.mkdir(parents=True, exist_ok=True)
    for level in levels:
        with contextlib.suppress(FileExistsError):
            level.mkdir(mode=0o700)
        st = os.lstat(level)
        if not stat.S_ISDIR(st.st_mode):
            raise InputError(str(level), "warm-cluster folder is not a folder (a symlink is never followed): remove it")
        if st.st_uid != os.getuid():
            raise InputError(
                str(level),
                f"warm-cluster folder is owned by uid {st.st_uid}, not by this user "
                f"({os.getuid()}): refusing the Ray cluster it names; remove it or set another warm_dir",
            )
        if st.st_mode & 0o022:
            raise InputError(
                str(level),
                f"warm-cluster folder is writable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                "refusing the Ray cluster it names; chmod go-w it or remove it",
            )
    return folder


@contextlib.contextmanager
def locked(path: Path, mode: int) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (one we may not signal counts as running). A pid
    alone does not say which process: see `process_alive`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


UNKNOWN_START = -1.0  # where the system has no /proc (macOS): the pid alone, and the helper's lock


def process_started(pid: int) -> float | None:
    """When process `pid` started (clock ticks since boot, from /proc/<pid>/stat), or None when
    there is no such process (or only its zombie: it has ended). With the pid it names one process:
    a pid reused later has another start time. (Read from /proc, not psutil: the core imports
    nothing it does not need.)"""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if not Path("/proc/self/stat").exists():
            return UNKNOWN_START if pid_alive(pid) else None
        return None
    except OSError:
        return None
    try:
        fields = text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces and ')'
        return None if fields[0] == "Z" else float(fields[19])
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, started: float | None) -> bool:
    """Whether the process that was `pid` when it started at `started` still runs. Without a
    recorded start time (a record written by older code) the pid alone decides."""
    if started is None:
        return pid_alive(pid)
    now = process_started(pid)
    return now is not None and now == started


def helper_running(folder: Path) -> bool:
    """Whether a helper holds the folder's `helper.lock` (taken for its whole life)."""
    try:
        handle = open(folder / HELPER_LOCK, "rb")
    except FileNotFoundError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def hold_helper_lock(folder: Path) -> TextIO:
    """The helper's life-long exclusive lock (keep the returned file open; closing it or dying
    releases it). Not inherited by processes the helper starts (Python opens files non-inheritable).
    BlockingIOError: another helper serves this folder."""
    handle = open(folder / HELPER_LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        handle.close()
        raise
    return handle


def read_live(folder: Path) -> WarmCluster | None:
    """The serving helper's cluster, or None (no file, unreadable, or its helper has exited). A
    `cluster.json` whose helper is gone (no one holds `helper.lock`, or its pid now names another
    process), or that is unreadable, is removed. Call with `start.lock` held."""
    cluster: WarmCluster | None
    try:
        info = json.loads((folder / INFO_NAME).read_text())
        started = info.get("started")
        auth_mode = info.get("auth_mode", "disabled")  # a helper before the field: Ray's default then
        if auth_mode not in AUTH_MODES:
            raise ValueError(f"auth_mode {auth_mode!r}")
        cluster = WarmCluster(
            address=str(info["address"]),
            pool=str(info["pool"]),
            pid=int(info["pid"]),
            started=None if started is None else float(started),
            auth_mode=auth_mode,
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        cluster = None  # unreadable: as stale as a dead helper's
    if (
        cluster is None
        or cluster.started is None
        or not helper_running(folder)
        or not process_alive(cluster.pid, cluster.started)
    ):
        with contextlib.suppress(OSError):
            (folder / INFO_NAME).unlink()
        return None
    return cluster


def write_info(folder: Path, address: str, pool: str = POOL_NAME, auth_mode: str | None = None) -> None:
    """Publish the helper's cluster (atomically: a reader sees the whole file or none). The caller
    holds `helper.lock` (`hold_helper_lock`). `auth_mode`: its Ray's, by default this process's
    RAY_AUTH_MODE as `ray.init` left it (it sets "token" where it turned authentication on)."""
    auth_mode = auth_mode or os.environ.get(AUTH_MODE_ENV) or "disabled"
    if auth_mode not in AUTH_MODES:
        raise ValueError(f"{AUTH_MODE_ENV}={auth_mode!r}: Ray knows {', '.join(AUTH_MODES)}")
    tmp = folder / f".{INFO_NAME}.{os.getpid()}"
    record = {
        "address": address,
        "pool": pool,
        "pid": os.getpid(),
        "started": process_started(os.getpid()),
        "auth_mode": auth_mode,
    }
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / INFO_NAME)


def _start(folder: Path, python: str, idle_s: float, num_cpus: int | None, timeout_s: float) -> WarmCluster:
    argv = [python, "-m", HELPER_MODULE, "--dir", str(folder), "--idle-s", str(idle_s), "--detach"]
    if num_cpus:
        argv += ["--num-cpus", str(num_cpus)]
    with contextlib.suppress(OSError):
        (folder / INFO_NAME).unlink()
    with open(folder / LOG_NAME, "ab") as log:
        # The helper forks away and this child exits at once, printing the helper's pid: the helper
        # belongs to no launcher (never its zombie) and, in its own session, no Ctrl-C to a
        # launcher's group ends a cluster that other runs use.
        forked = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
            check=True,
            timeout=60,
            text=True,
        )
    helper = int(forked.stdout.split()[-1])
    helper_started = process_started(helper)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process_alive(helper, helper_started):
        cluster = read_live(folder)
        if cluster is not None:
            return cluster
        time.sleep(0.2)
    tail = (folder / LOG_NAME).read_text(errors="replace")[-2000:]
    raise RuntimeError(
        f"the warm Ray cluster did not start within {timeout_s:.0f} s; {folder / LOG_NAME} ends with:\n{tail}"
    )


@contextlib.contextmanager
def use_warm_cluster(
    folder: Path, *, python: str, idle_s: float, num_cpus: int | None = None, start_timeout_s: float = 300.0
) -> Iterator[WarmCluster]:
    """The folder's warm cluster (started if none serves), held in use for the `with` block."""
    private_folder(folder)
    with open(folder / USE_LOCK, "a+") as use:
        with locked(folder / START_LOCK, fcntl.LOCK_EX):
            cluster = read_live(folder) or _start(folder, python, idle_s, num_cpus, start_timeout_s)
            fcntl.flock(use, fcntl.LOCK_SH)
        try:
            yield cluster
        finally:
            os.utime(folder / USE_LOCK)  # the idle time counts from here
            fcntl.flock(use, fcntl.LOCK_UN)


def stop_warm_cluster(folder: Path, timeout_s: float = 60.0) -> bool:
    """End the folder's helper (SIGTERM; it ends its cluster) and wait for it; False if none served."""
    if not folder.is_dir():
        return False
    private_folder(folder)
    with locked(folder / START_LOCK, fcntl.LOCK_EX):
        cluster = read_live(folder)
        if cluster is None:
            return False
        if process_alive(cluster.pid, cluster.started):  # the helper itself, not a process that took its pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(cluster.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while process_alive(cluster.pid, cluster.started) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not process_alive(cluster.pid, cluster.started)


def pipes_python(command: Sequence[str], module: str) -> str | None:
    """The interpreter of a `<python> -m <module>` command line, else None (the warm cluster needs
    the GPU job's own environment)."""
    return command[0] if len(command) == 3 and list(command[1:]) == ["-m", module] else None
