"""The warm cluster's folder (`core.warm_folder.private_folder`): its `cluster.json` names the Ray
cluster every GPU job of the instance joins, and its default place is the shared temp dir, so a
folder another user planted or may write is refused before anything in it is read. A `cluster.json`
is believed only while its helper lives: the helper's life-long `helper.lock` and its pid's start
time, never the pid alone (issue 33, defect 2)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from value_assets.core.errors import InputError
from value_assets.core.warm_folder import (
    INFO_NAME,
    default_folder,
    private_folder,
    read_live,
    stop_warm_cluster,
    use_warm_cluster,
    write_info,
)

pytestmark = pytest.mark.unit


def planted(folder: Path) -> Path:
    """A folder holding another cluster's address, served (as far as a reader can tell) by pid 1."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / INFO_NAME).write_text(json.dumps({"address": "203.0.113.7:6379", "pool": "warm", "pid": 1}))
    return folder


def join(folder: Path):
    # /bin/false as the helper's interpreter: a start would fail; the planted cluster must not be joined either
    with use_warm_cluster(folder, python="/bin/false", idle_s=1, start_timeout_s=1) as cluster:
        return cluster


def test_missing_folders_are_created_for_this_user_alone(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    folder = default_folder(tmp_path / "instance")
    assert folder.parent.name == f"value_assets-warm-{os.getuid()}"
    private_folder(folder)
    for level in (folder, folder.parent):
        assert stat.S_IMODE(os.stat(level).st_mode) == 0o700
    custom = private_folder(tmp_path / "deep" / "warm")  # a warm_dir of the user's: only the folder itself
    assert stat.S_IMODE(os.stat(custom).st_mode) == 0o700


@pytest.mark.parametrize(
    "how", ["writable by others", "parent writable by others", "owned by another user", "a symlink"]
)
def test_a_planted_folder_is_refused_before_its_cluster_is_joined(tmp_path, monkeypatch, how):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    folder = default_folder(tmp_path / "instance")
    if how == "a symlink":
        elsewhere = planted(tmp_path / "theirs")
        folder.parent.mkdir(mode=0o700)
        folder.symlink_to(elsewhere, target_is_directory=True)
    else:
        planted(folder)
    if how == "writable by others":
        folder.chmod(0o777)
    elif how == "parent writable by others":
        folder.parent.chmod(0o777)
    elif how == "owned by another user":
        # the folder's owner as another user sees it: this process's uid differs from the owner's
        owner = os.getuid()
        monkeypatch.setattr(os, "getuid", lambda: owner + 1)
        folder = folder.parent.parent / f"value_assets-warm-{owner + 1}" / folder.name
        folder.parent.mkdir(mode=0o700)
        planted(folder)
    with pytest.raises(InputError) as err:
        join(folder)
    needle = {
        "writable by others": "writable by others",
        "parent writable by others": "writable by others",
        "owned by another user": "not by this user",
        "a symlink": "not a folder",
    }[how]
    assert needle in err.value.message and err.value.where in (str(folder), str(folder.parent))
    with pytest.raises(InputError):
        stop_warm_cluster(folder)  # nor is the pid it names signalled


def test_a_serving_helpers_folder_is_joined(tmp_path):
    from value_assets.core.warm_folder import HELPER_LOCK

    folder = private_folder(tmp_path / "warm")
    with open(folder / HELPER_LOCK, "a+") as lock:  # this process stands in for a serving helper
        fcntl.flock(lock, fcntl.LOCK_EX)
        write_info(folder, "203.0.113.7:6379")
        assert join(folder).address == "203.0.113.7:6379"


@pytest.mark.parametrize("mode", ["token", "disabled"])
def test_a_job_is_told_the_clusters_ray_authentication(tmp_path, monkeypatch, mode):
    """Ray 2.60 starts a cluster with token authentication unless RAY_AUTH_MODE says otherwise, but
    a process joining by address never turns it on: without the mode in its environment the job
    was refused ("InvalidAuthToken"), and the README's walkthrough failed in a plain shell."""
    from value_assets.core.warm_folder import HELPER_LOCK

    folder = private_folder(tmp_path / "warm")
    with open(folder / HELPER_LOCK, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        monkeypatch.setenv("RAY_AUTH_MODE", mode)  # as the helper's ray.init left it
        write_info(folder, "127.0.0.1:1")
        monkeypatch.delenv("RAY_AUTH_MODE")  # the launcher's own environment says nothing
        env = join(folder).job_env()
        assert env["RAY_AUTH_MODE"] == mode and env["RAY_ADDRESS"] == "127.0.0.1:1"
        # a record naming a mode Ray does not know is as unreadable as a torn one: removed, not joined
        record = json.loads((folder / INFO_NAME).read_text())
        (folder / INFO_NAME).write_text(json.dumps({**record, "auth_mode": "none"}))
        assert read_live(folder) is None and not (folder / INFO_NAME).exists()
    monkeypatch.setenv("RAY_AUTH_MODE", "off")
    with pytest.raises(ValueError, match="RAY_AUTH_MODE='off'"):
        write_info(folder, "127.0.0.1:1")


def _record(folder: Path, pid: int, started: float | None) -> None:
    (folder / INFO_NAME).write_text(
        json.dumps({"address": "127.0.0.1:1", "pool": "warm", "pid": pid, "started": started})
    )


@pytest.mark.parametrize("how", ["no helper holds the lock", "the pid is another process now"])
def test_a_stale_cluster_file_with_a_reused_pid_is_removed_not_trusted(tmp_path, how):
    """A helper killed without its `finally` (SIGKILL, OOM) leaves its cluster.json; once its pid
    names an unrelated process, believing the pid sent every job to the dead Ray (it hung) and
    `stop_warm_cluster` sent SIGTERM to that process."""
    from value_assets.core.warm_folder import HELPER_LOCK, process_started  # (imported here: new names)

    folder = private_folder(tmp_path / "warm")
    unrelated = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with contextlib.ExitStack() as stack:
            if how == "no helper holds the lock":  # the dead helper's record, its pid now the unrelated process's
                started = process_started(unrelated.pid)
            else:  # a live helper holds the lock, but the record's pid is not the process that started then
                lock = stack.enter_context(open(folder / HELPER_LOCK, "a+"))
                fcntl.flock(lock, fcntl.LOCK_EX)
                started = process_started(unrelated.pid) - 3600
            _record(folder, unrelated.pid, started)
            assert read_live(folder) is None and not (folder / INFO_NAME).exists()
            _record(folder, unrelated.pid, started)
            with pytest.raises(subprocess.CalledProcessError):
                join(folder)  # not joined: a new helper is started (here /bin/false, which fails)
            _record(folder, unrelated.pid, started)
            assert stop_warm_cluster(folder) is False
        assert unrelated.poll() is None  # never signalled
    finally:
        unrelated.kill()
        unrelated.wait()


_HELPER = """
import sys, time
from pathlib import Path
from value_assets.core.warm_folder import hold_helper_lock, write_info
lock = hold_helper_lock(Path(sys.argv[1]))
write_info(Path(sys.argv[1]), "127.0.0.1:1")
print("serving", flush=True)
time.sleep(60)
"""


def test_a_helper_killed_outright_leaves_a_file_no_job_believes(tmp_path):
    """SIGKILL runs no `finally`: the helper's cluster.json stays, but the lock it held for its life
    is released by the kernel, so the next job removes the file and starts a cluster of its own
    (here /bin/false: the start fails, the dead address is never joined). The helper's Ray is ended
    by its reaper (tests/job/test_driver_ray.py::test_a_killed_driver_takes_its_local_ray_along). A real
    helper SIGKILLed and a real next job: tests/job/test_warm_cluster.py."""
    folder = private_folder(tmp_path / "warm")
    root = Path(__file__).resolve().parents[2]
    helper = subprocess.Popen(
        [sys.executable, "-c", _HELPER, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )
    try:
        assert helper.stdout.readline().strip() == "serving"
        live = read_live(folder)
        assert live is not None and live.pid == helper.pid  # while it lives, it is believed
    finally:
        helper.kill()
        helper.wait()
    assert (folder / INFO_NAME).exists()
    with pytest.raises(subprocess.CalledProcessError):
        join(folder)
    assert not (folder / INFO_NAME).exists() and stop_warm_cluster(folder) is False
