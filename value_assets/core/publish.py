"""Durable file publication, and reading back what was published.

* `atomic_write` replaces a file atomically (unique temp file, fsync file and folder, rename): for
  contracts and the `latest` pointer, which a later save legitimately supersedes.
* `publish_once` never replaces anything (exclusive temp file, fsync, hard link): for reports and
  receipts; `publish_all` publishes several such files together, all or nothing (a report and its
  plots). A hard link fails when the destination exists in any form, a symlink included, so a
  symlink planted at the destination is never followed. The sha is recorded beside the file as
  `<name>.sha256` in `sha256sum` format.
* `read_published` reads a publication's bytes once, checks them against the sidecar (and a sha
  the caller pins) and only then parses them.

Publication is all-or-nothing from the caller's view (issue 9, defect 7). Both the file and its
sidecar are fully written and fsynced as temp files before either name appears, so a full disk
(ENOSPC) or any other OSError while writing leaves nothing behind; if the second link fails, the
first one, made by this call, is taken back. A failure becomes `PublishError`, naming the path and
the cause. A file left without its sidecar (a crash between the two links, or older code) is not a
publication: `published_sha` says None, and publishing the identical bytes again completes it.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path
from typing import Any, cast

from value_assets.core.errors import InputError
from value_assets.core.hashing import is_sha, sha256_bytes


class PublishError(OSError):
    """Publication failed for an operating-system reason (full disk, permissions, I/O).

    Nothing was published by the failed call, so the identical retry can complete once the cause
    is fixed. Keeps the original errno.
    """

    def __init__(self, path: Path, exc: OSError):
        cause = exc.strerror or str(exc)
        super().__init__(
            exc.errno, f"{path}: could not publish ({cause}); nothing was published, retry once the cause is fixed"
        )
        self.path = Path(path)

    def __str__(self) -> str:
        return cast(str, self.strerror)  # __init__ always passes the message as strerror


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
            view = view[os.write(fd, view) :]
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


def write_new(path: str | Path, data: bytes) -> str:
    """Write `data` at `path`, which must not exist yet: complete and fsynced under a temporary name
    first, then linked into place in one step (a reader never sees a partial file; an existing
    file, or a symlink, is never replaced: InputError). Returns the sha. No sidecar: for files that
    others pick up by name, such as a manifest in the watched folder. An OSError (a full disk, a
    read-only folder) becomes `PublishError` naming `path`; nothing is left behind."""
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = _write_temp(p.parent, p.name, data)
        try:
            os.link(tmp, p, follow_symlinks=False)
        except FileExistsError:
            raise InputError(str(p), "already exists; it is never replaced") from None
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(p.parent)
    except OSError as exc:
        raise PublishError(p, exc) from exc
    return sha256_bytes(data)


def sha_sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _read_regular(path: Path) -> bytes | None:
    """The bytes of a regular file at `path`, never through a symlink; None if absent."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(str(path), f"unreadable or a symlink (never followed): {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise InputError(str(path), "is not a regular file")
        return f.read()


def publish_once(path: str | Path, data: bytes) -> str:
    """Publish `data` at `path` once and record its sha beside it; return the sha.

    Raises InputError if `path` (or its sidecar) already exists with other content or is not a
    regular file; PublishError on an OSError (nothing of this call is left behind). Publishing the
    identical bytes again is a no-op (a retried step), which also completes a publication whose
    sidecar is missing.
    """
    return publish_all([(path, data)])[0]


def publish_all(items: list[tuple[str | Path, bytes]]) -> list[str]:
    """`publish_once` for several files together, all or nothing: every file and sidecar is written
    and fsynced as a temp file before any name appears, and if any link fails, the names this call
    made are taken back (a report's plots never stay published without their report). Returns the
    shas in order."""
    temps: list[Path] = []
    linked: list[tuple[Path, Path]] = []
    plan: list[tuple[Path, bytes, str, bytes]] = []
    for path, data in items:
        p = Path(path)
        sha = sha256_bytes(data)
        plan.append((p, data, sha, f"{sha}  {p.name}\n".encode()))
    current = plan[0][0] if plan else Path(".")  # the file being written or linked, for the error
    try:
        # Everything that needs space first: all temps complete and fsynced before a name appears.
        for p, data, _sha, line in plan:
            current = p
            p.parent.mkdir(parents=True, exist_ok=True)
            temps.append(_write_temp(p.parent, p.name, data))
            temps.append(_write_temp(p.parent, sha_sidecar(p).name, line))
        for k, (p, data, sha, _line) in enumerate(plan):
            current = p
            for tmp, dest in zip(temps[2 * k : 2 * k + 2], (p, sha_sidecar(p)), strict=True):
                try:
                    os.link(tmp, dest, follow_symlinks=False)
                    linked.append((tmp, dest))
                except FileExistsError:
                    _same_or_refuse(dest, data if dest == p else None, sha)
        for folder in dict.fromkeys(p.parent for p, *_ in plan):
            _fsync_dir(folder)
    except BaseException as exc:
        for tmp, dest in linked:  # take back only names this call made, so a retry finds nothing
            try:
                if os.path.samestat(os.lstat(tmp), os.lstat(dest)):
                    dest.unlink()
            except OSError:
                pass
        if isinstance(exc, OSError) and not isinstance(exc, PublishError):
            raise PublishError(current, exc) from exc
        raise
    finally:
        for tmp in temps:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
    return [sha for _p, _d, sha, _l in plan]


def _same_or_refuse(dest: Path, data: bytes | None, sha: str) -> None:
    """An existing `dest` is accepted only when it already holds what this call publishes."""
    if dest.is_symlink() or not dest.is_file():
        raise InputError(
            str(dest),
            "refusing to publish: the destination exists and is not a regular file (a symlink is never followed)",
        )
    if data is not None:
        existing = sha256_bytes(dest.read_bytes())
        if existing != sha:
            raise InputError(
                str(dest), f"refusing to replace an existing file (sha256 {existing}); published files are write-once"
            )
    elif read_sidecar(dest) != sha:
        raise InputError(
            str(dest),
            f"refusing to replace an existing sha256 sidecar (records {read_sidecar(dest)}) "
            f"with {sha}; remove it if its file is gone",
        )


def read_sidecar(side: str | Path) -> str | None:
    try:
        text = Path(side).read_text(encoding="ascii").split()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return text[0] if text and is_sha(text[0]) else None


def publication_state(path: str | Path) -> str:
    """What lies at a write-once destination, without following symlinks:

    * ``absent``: neither the file nor its sidecar;
    * ``unfinished``: a regular file without its sidecar, or a sidecar without its file (a crash
      between the two links, or older code); publishing the identical bytes completes it;
    * ``published``: a regular file whose sidecar records its sha;
    * ``conflicting``: anything else (a symlink, another file type, a sidecar that disagrees).
    """
    p = Path(path)
    side = sha_sidecar(p)
    if (
        p.is_symlink()
        or side.is_symlink()
        or (p.exists() and not p.is_file())
        or (side.exists() and not side.is_file())
    ):
        return "conflicting"
    if not p.exists():
        return "unfinished" if side.exists() else "absent"
    if not side.exists():
        return "unfinished"
    return "published" if read_sidecar(side) == sha256_bytes(p.read_bytes()) else "conflicting"


def published_sha(path: str | Path) -> str | None:
    """The sha of a complete publication at `path` (see `publication_state`), else None."""
    p = Path(path)
    return sha256_bytes(p.read_bytes()) if publication_state(p) == "published" else None


def verify_published(path: str | Path, expected_sha: str | None = None) -> str:
    """Re-hash a published file; it must match its sidecar (and `expected_sha` if given)."""
    return _verified_bytes(Path(path), expected_sha)[1]


def _verified_bytes(p: Path, expected_sha: str | None) -> tuple[bytes, str]:
    if p.is_symlink():
        raise InputError(str(p), "is a symlink; published files are never followed")
    data = _read_regular(p)
    if data is None:
        raise InputError(str(p), "published file is missing: it does not exist")
    actual = sha256_bytes(data)
    recorded = read_sidecar(sha_sidecar(p))
    if recorded != actual:
        raise InputError(str(p), f"sha256 is {actual}, but its sidecar records {recorded}")
    if expected_sha is not None and actual != expected_sha:
        raise InputError(str(p), f"sha256 is {actual}, but {expected_sha} was expected")
    return data, actual


def read_json_object(path: str | Path, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise InputError(str(path), f"{what} does not exist") from None
    except (OSError, ValueError) as exc:
        raise InputError(str(path), f"{what} is unreadable: {exc}") from None
    if not isinstance(obj, dict):
        raise InputError(str(path), f"{what} is not a JSON object")
    return obj


def read_published(path: str | Path, what: str, expected_sha: str | None = None) -> tuple[dict[str, Any], str]:
    """A write-once JSON publication and its sha: the bytes are read once, checked against the
    ``.sha256`` beside it (and `expected_sha`, when the lineage recorded one), then parsed."""
    p = Path(path)
    try:
        data, sha = _verified_bytes(p, expected_sha)
    except InputError as exc:
        raise InputError(exc.where, f"{what}: {exc.message}") from None
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise InputError(str(p), f"{what} is unreadable: {exc}") from None
    if not isinstance(obj, dict):
        raise InputError(str(p), f"{what} is not a JSON object")
    return obj, sha
