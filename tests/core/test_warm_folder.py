"""The warm cluster's folder (`core.warm_folder.private_folder`): its `cluster.json` names the Ray
cluster every GPU job of the instance joins, and its default place is the shared temp dir, so a
folder another user planted or may write is refused before anything in it is read."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from value_assets.core.errors import InputError
from value_assets.core.warm_folder import INFO_NAME, default_folder, private_folder, stop_warm_cluster, use_warm_cluster

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


def test_this_users_folder_is_joined(tmp_path):
    folder = private_folder(tmp_path / "warm")
    planted(folder)  # the same file, in a folder of this user's: served by a live pid, so joined
    assert join(folder).address == "203.0.113.7:6379"
