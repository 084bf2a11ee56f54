"""A small tmpfs mounted for a test: a real full disk (ENOSPC) or a real read-only one (EROFS)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str = "64k", options: str = "") -> Iterator[Path]:
    """A tmpfs of `size` at `folder` (made if missing), mount `options` appended (",ro"); root
    only, else the test is skipped. Unmounted (lazily, so an open file cannot keep it) at exit."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(folder)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("needs a tmpfs mount (root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
