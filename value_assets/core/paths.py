"""Output paths a user names (issue 33, defect 3).

* `plain_name` refuses a name that is not one ordinary path component (`../x`, `a/b`, `""`, `.x`):
  a `--name` names a file inside a folder the command chose, never a path of its own.
* `confined` joins such a name to its folder and checks that the result, symlinks resolved, is
  still directly inside the folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from value_assets.core.errors import InputError, show


def plain_name(name: object, where: str) -> str:
    """`name` if it is one ordinary, visible path component; else an InputError naming `where`."""
    if not isinstance(name, str) or not name.strip():
        raise InputError(where, f"must be a non-empty file name, got {show(name)}")
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or name.startswith("."):
        raise InputError(
            where,
            f"must be a plain file name (no folder part, not hidden), got {show(name)}: the file is written "
            "inside the output folder, never elsewhere",
        )
    return name


def confined(folder: str | os.PathLike[str], name: str, where: str) -> Path:
    """`folder / name`, refused unless it resolves (symlinks and `..` included) to an entry directly
    inside `folder` (resolved likewise)."""
    path = Path(folder) / plain_name(name, where)
    base = Path(folder).resolve()
    if path.resolve().parent != base:
        raise InputError(where, f"{path} resolves to {path.resolve()}, outside the output folder {base}")
    return path
