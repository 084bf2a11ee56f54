"""Output paths a user names, outputs written all-or-nothing, and output folders one run holds
(issue 33: defects 3, 10, 11).

* `plain_name` refuses a name that is not one ordinary path component (`../x`, `a/b`, `""`, `.x`):
  a `--name` names a file inside a folder the command chose, never a path of its own.
* `confined` joins such a name to its folder and checks that the result, symlinks resolved, is
  still directly inside the folder.
* `staged_file` writes a file beside its destination under a temporary name and renames it into
  place only once it is complete and fsynced: on any error (ENOSPC, EACCES, EFBIG, ...) the
  temporary file is removed and a `PublishError` names the destination; a killed process leaves
  at most a hidden `.<name>.*.tmp` file, never a partial file under the destination's name.
* `staged_folder` does the same for a new output folder (`--out` of import-rollouts, export-hf,
  export-miles): built under a hidden temporary name beside it, renamed into place when complete.
* `new_folder` creates an output folder and removes it again (where still empty) if the command
  fails: a refused write leaves no empty folder behind either.
* `exclusive_folder` holds an output folder for one run (flock on the folder itself, released
  however the run ends): a second run into the same folder is refused before it reads or writes
  anything there (two `train` runs into one `--output` interleaved their metrics, defect 10).
* `write_refusal` finds the system's refusal (a full disk, a file-size limit, permissions) behind
  the error of a writer that lost the OSError (safetensors, torch, torch_dist).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from value_assets.core.errors import InputError, show
from value_assets.core.publish import PublishError


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


@contextlib.contextmanager
def staged_file(path: str | os.PathLike[str], *, shown_as: str | os.PathLike[str] | None = None) -> Iterator[BinaryIO]:
    """A binary file object whose bytes appear at `path` only when the block completes: written to
    a temporary file in the same folder, fsynced, then renamed over `path`. An OSError becomes
    `PublishError` naming `shown_as` (default `path`: a file inside a staged folder is named where
    it will be published)."""
    p = Path(path)
    named = Path(shown_as) if shown_as is not None else p
    tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        raise PublishError(named, exc) from exc
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(exc, OSError) and not isinstance(exc, PublishError):
            raise PublishError(named, exc) from exc
        raise


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first."""
    missing = []
    probe = folder
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    return missing


def _remove_if_empty(made: list[Path]) -> None:
    for folder in made:  # deepest first
        try:
            folder.rmdir()
        except OSError:
            break  # not empty (something was written there) or gone


@contextlib.contextmanager
def new_folder(path: str | os.PathLike[str]) -> Iterator[Path]:
    """`path`, created (with its parents) if missing; if the block fails, the folders this call
    created are removed again where still empty, so a refused write leaves no empty output folder.
    Creating it fails as `PublishError(path)`."""
    folder = Path(path)
    missing = _missing_folders(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_if_empty(missing)
        raise PublishError(folder, exc) from exc
    try:
        yield folder
    except BaseException:
        _remove_if_empty(missing)
        raise


@contextlib.contextmanager
def exclusive_folder(path: str | os.PathLike[str], what: str) -> Iterator[Path]:
    """`path` (created if missing) held exclusively for the `with` block; InputError at once if
    another process holds it. Folders this call created are removed again if they are still empty
    at the end (a refused or failed run leaves nothing behind)."""
    folder = Path(path)
    missing = _missing_folders(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise PublishError(folder, exc) from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(
                str(folder),
                f"another {what} is writing into this folder now (it holds the folder's lock); two runs into one "
                "folder would mix their files: wait for it, or pick another folder",
            ) from None
        try:
            yield folder
        finally:
            _remove_if_empty(missing)
    finally:
        os.close(fd)


# What the system answers a write it refuses (not a bug: the command exits 2 naming the path).
REFUSED_WRITE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO}
)


# megatron-core 0.19's torch_dist writer logs its worker's error and raises one of these, without
# the error or its text: the cause is then judged from the file system and the process's limits.
LOST_CAUSE_MARKERS = ("An error is caught while starting worker", "Worker failure:")


def _file_size_limited() -> bool:
    """Whether this process may not write files past a size (RLIMIT_FSIZE: writes past it fail EFBIG)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return soft != resource.RLIM_INFINITY


def write_refusal(exc: BaseException, folder: str | os.PathLike[str]) -> OSError | None:
    """The system's refusal behind a failed write, as an OSError, or None (another failure).

    Writers in other languages lose the OSError: safetensors reports `... (os error 27)`, torch a
    short write as 'unexpected pos', torch_dist a CheckpointException holding the worker's
    traceback as text, and megatron-core 0.19's writer only that a worker failed. So the chain is
    searched for an OSError, then for an errno or its text; a failure on a file system that is now
    nearly full is taken for ENOSPC, and a cut-short or cause-less write failure under a file-size
    limit for EFBIG."""
    short = lost = False
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in REFUSED_WRITE_ERRNOS:
            return seen
        text = str(seen)
        for match in re.finditer(r"os error (\d+)|\[Errno (\d+)\]", text):
            code = int(match.group(1) or match.group(2))
            if code in REFUSED_WRITE_ERRNOS:
                return OSError(code, os.strerror(code))
        for code in REFUSED_WRITE_ERRNOS - {errno.EIO}:
            if os.strerror(code) in text:
                return OSError(code, os.strerror(code))
        short = short or "unexpected pos" in text
        lost = lost or any(marker in text for marker in LOST_CAUSE_MARKERS)
        seen = seen.__cause__ or seen.__context__
    try:
        if shutil.disk_usage(folder).free < (16 << 20):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        pass
    if (short or lost) and _file_size_limited():
        return OSError(errno.EFBIG, os.strerror(errno.EFBIG))
    if short:
        return OSError(errno.EIO, "a write was cut short (a full disk or a file-size limit)")
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike[str], what: str = "output folder") -> Iterator[Path]:
    """A new folder to fill; its contents appear at `out` (missing, or an empty folder) only when
    the block completes. On any error the staged folder is removed; an OSError, or a failure the
    system's refusal explains (`write_refusal`), becomes `PublishError(out)`. A killed process
    leaves at most the hidden `.<name>.*` folder beside `out`, never a partial `out`."""
    out = Path(out)
    if out.is_symlink():
        raise InputError(str(out), f"{what} is a symlink: never written through one")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(str(out), f"{what} exists and is not empty")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        os.chmod(tmp, 0o777 & ~_umask())  # as mkdir would make it (mkdtemp's is 0700)
    except OSError as exc:
        raise PublishError(out, exc) from exc
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (PublishError, InputError)):
            raise
        if isinstance(exc, OSError):
            raise PublishError(out, exc) from exc
        # torch_dist's CheckpointException is a BaseException: anything but an interruption counts.
        interrupted = isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))
        refused = None if interrupted else write_refusal(exc, out.parent)
        if refused is not None:
            raise PublishError(out, refused) from exc
        raise
