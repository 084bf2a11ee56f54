"""Durable file publication.

* `atomic_write` replaces a file atomically (unique temp file, fsync file and folder, rename): for
  contracts and the `latest` pointer, which a later save legitimately supersedes.
* `publish_once` never replaces anything (exclusive temp file, fsync, hard link): for reports and
  receipts. A hard link fails when the destination exists in any form, a symlink included, so a
  symlink planted at the destination is never followed. The sha is recorded beside the file as
  `<name>.sha256` in `sha256sum` format.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from .errors import InputError
from .hashing import is_sha, sha256_bytes


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_temp(folder: Path, name: str, data: bytes) -> Path:
    tmp = folder / f".{name}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return tmp


def atomic_write(path: str | Path, data: bytes) -> str:
    """Write `data` to `path` atomically, replacing any previous file; return its sha."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(p.parent, p.name, data)
    try:
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(p.parent)
    return sha256_bytes(data)


def _link_once(tmp: Path, dest: Path) -> bool:
    try:
        os.link(tmp, dest, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def sha_sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def publish_once(path: str | Path, data: bytes) -> str:
    """Publish `data` at `path` once and record its sha beside it; return the sha.

    Raises InputError if `path` (or its sidecar) already exists with other content or is a
    symlink. Publishing the identical bytes again is a no-op (a retried step), which also completes
    a sidecar that a crash left unwritten.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    sha = sha256_bytes(data)
    if not _link_once(_write_temp(p.parent, p.name, data), p):
        if p.is_symlink() or not p.is_file():
            raise InputError(str(p), "refusing to publish: the destination exists and is not a regular file (a symlink is never followed)")
        existing = sha256_bytes(p.read_bytes())
        if existing != sha:
            raise InputError(str(p), f"refusing to replace an existing file (sha256 {existing}); published files are write-once")
    side = sha_sidecar(p)
    line = f"{sha}  {p.name}\n".encode()
    if not _link_once(_write_temp(p.parent, side.name, line), side):
        if side.is_symlink() or read_sidecar(side) != sha:
            raise InputError(str(side), "refusing to replace an existing sha256 sidecar with another digest")
    _fsync_dir(p.parent)
    return sha


def read_sidecar(side: str | Path) -> str | None:
    try:
        text = Path(side).read_text(encoding="ascii").split()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return text[0] if text and is_sha(text[0]) else None


def verify_published(path: str | Path, expected_sha: str | None = None) -> str:
    """Re-hash a published file; it must match its sidecar (and `expected_sha` if given)."""
    p = Path(path)
    if p.is_symlink() or not p.is_file():
        raise InputError(str(p), "published file is missing or not a regular file")
    actual = sha256_bytes(p.read_bytes())
    recorded = read_sidecar(sha_sidecar(p))
    if recorded != actual:
        raise InputError(str(p), f"sha256 is {actual}, but its sidecar records {recorded}")
    if expected_sha is not None and actual != expected_sha:
        raise InputError(str(p), f"sha256 is {actual}, but {expected_sha} was expected")
    return actual
