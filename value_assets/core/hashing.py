"""SHA-256 helpers: file and byte digests, and validation of pinned digests."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TypeGuard

from value_assets.core.errors import InputError, show

_SHA_RE = re.compile(r"[0-9a-f]{64}")
CHUNK = 1 << 22


def is_sha(value: object) -> TypeGuard[str]:
    """True for a lowercase 64-hex SHA-256 string (a sha (docs/rules.md#terms))."""
    return isinstance(value, str) and _SHA_RE.fullmatch(value) is not None


def require_sha(value: object, where: str) -> str:
    """Return `value` if it is a valid sha, else raise an InputError naming it and `where`."""
    if not is_sha(value):
        raise InputError(where, f"expected a lowercase 64-hex SHA-256, got {show(value)}")
    return value


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_pinned(path: Path, pinned_sha256: str | None, what: str) -> tuple[bytes, str]:
    """(bytes, sha) of a small document, with a pinned sha checked before anything parses it.
    `what` names the document in the errors ("contract", "Miles contract")."""
    if pinned_sha256 is not None:
        require_sha(pinned_sha256, f"pinned {what} sha256")
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(str(path), f"{what} file does not exist") from None
    sha = sha256_bytes(data)
    if pinned_sha256 is not None and sha != pinned_sha256:
        raise InputError(str(path), f"{what.split()[-1]} sha256 is {sha}, but {pinned_sha256} was pinned")
    return data, sha
