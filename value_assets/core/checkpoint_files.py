"""The contract's binding of a checkpoint's bytes (docs/rules.md#contract), and its verification.

A save is described file by file (relative path, size, sha256, sorted by path) once it is complete
and before its contract is published; the description goes into the contract as
`checkpoint_files`. Whoever loads a checkpoint (resume, evaluation, export, promotion, `value-assets
verify`) calls `verify_checkpoint` first: the torch_dist format unpickles `.metadata`, so no byte of
a save may be deserialized before every file matches. Torch-free, so the light CLI can use it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from value_assets.core.errors import InputError, show
from value_assets.core.hashing import is_sha, sha256_file
from value_assets.core.strict_json import is_int

# The contract itself sits in the step folder it binds; it is the one file not described.
CONTRACT_NAME = "value_pretrain_contract.json"
FIELD = "checkpoint_files"


def _walk(step_dir: Path) -> dict[str, os.stat_result]:
    """Every entry under `step_dir` (relative posix path -> lstat), symlinks not followed."""
    out: dict[str, os.stat_result] = {}
    stack = [step_dir]
    while stack:
        folder = stack.pop()
        with os.scandir(folder) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                rel = Path(entry.path).relative_to(step_dir).as_posix()
                if stat.S_ISDIR(st.st_mode):
                    stack.append(Path(entry.path))
                elif rel != CONTRACT_NAME:
                    out[rel] = st
    return out


def describe_folder(step_dir: str | Path) -> list[dict[str, Any]]:
    """[{path, size, sha256}] of every file of a save, sorted by path (the contract's binding).

    Refuses a save holding anything but regular files and folders (a symlink is never followed)."""
    root = Path(step_dir)
    if not root.is_dir() or root.is_symlink():
        raise InputError(str(root), "checkpoint folder does not exist (or is a symlink)")
    found = sorted(_walk(root).items())
    for rel, st in found:
        if not stat.S_ISREG(st.st_mode):
            raise InputError(str(root / rel), "a checkpoint may hold only regular files (a symlink is never followed)")
    shas = _sha256_files(root, [rel for rel, _ in found])
    return [{"path": rel, "size": int(st.st_size), "sha256": shas[rel]} for rel, st in found]


def hash_threads(files: int) -> int:
    """Threads for hashing `files` checkpoint files at once (hashlib and file reads release the
    GIL; one file's hash is sequential): one per file, at most one per core and 8."""
    return max(1, min(files, os.cpu_count() or 1, 8))


def _sha256_files(root: Path, rels: list[str]) -> dict[str, str]:
    """relative path -> sha256 of each file under `root`, hashed in parallel: a save is a few
    large files."""
    with ThreadPoolExecutor(max_workers=hash_threads(len(rels))) as pool:
        return dict(zip(rels, pool.map(lambda rel: sha256_file(root / rel), rels), strict=True))


def bound_files(contract: Mapping[str, Any], where: str) -> dict[str, tuple[int, str]]:
    """relative path -> (size, sha256) of every file the contract binds; InputError when the
    binding is absent or malformed."""
    files = contract.get(FIELD)
    if not isinstance(files, list) or not files:
        raise InputError(
            where, f"the contract binds no checkpoint files ({FIELD} = {show(files)}); it cannot be verified"
        )
    out: dict[str, tuple[int, str]] = {}
    for k, f in enumerate(files):
        ok = (
            isinstance(f, dict)
            and set(f) == {"path", "size", "sha256"}
            and isinstance(f["path"], str)
            and is_int(f["size"])
            and f["size"] >= 0
            and is_sha(f["sha256"])
        )
        p = PurePosixPath(f["path"]) if ok else None  # None exactly when not ok
        if (
            p is None
            or p.is_absolute()
            or ".." in p.parts
            or p.as_posix() != f["path"]
            or f["path"] in out
            or f["path"] == CONTRACT_NAME
        ):
            raise InputError(
                f"{where}: {FIELD}[{k}]",
                f"not a file entry {{path, size, sha256}} with a unique relative path: {show(f)}",
            )
        out[f["path"]] = (int(f["size"]), f["sha256"])
    return out


def checkpoint_differences(step_dir: str | Path, contract: Mapping[str, Any]) -> list[str]:
    """What differs between the save in `step_dir` and the files its contract binds ([] = match).

    Sizes and names are compared first; a file is hashed only when its size matches."""
    root = Path(step_dir)
    where = str(root / CONTRACT_NAME)
    bound = bound_files(contract, where)
    diffs = []
    named = contract.get("checkpoint")
    if not isinstance(named, str) or PurePosixPath(named).name != root.name:
        diffs.append(f"the contract binds checkpoint {show(named)}, but it sits in {root.name}")
    if not root.is_dir() or root.is_symlink():
        return diffs + [f"checkpoint folder {root} does not exist (or is a symlink)"]
    present = _walk(root)
    for rel in sorted(set(bound) - set(present)):
        diffs.append(f"missing file {rel}")
    for rel in sorted(set(present) - set(bound)):
        diffs.append(f"extra file {rel}")
    common = sorted(set(bound) & set(present))
    to_hash = [rel for rel in common if stat.S_ISREG(present[rel].st_mode) and present[rel].st_size == bound[rel][0]]
    actual = _sha256_files(root, to_hash)
    for rel in common:
        st = present[rel]
        size, sha = bound[rel]
        if not stat.S_ISREG(st.st_mode):
            diffs.append(f"{rel} is not a regular file")
        elif st.st_size != size:
            diffs.append(f"{rel}: size {st.st_size}, the contract binds {size}")
        elif actual[rel] != sha:
            diffs.append(f"{rel}: sha256 {actual[rel]}, the contract binds {sha}")
    return diffs


def verify_checkpoint(step_dir: str | Path, contract: Mapping[str, Any]) -> None:
    """Refuse (InputError naming every differing file) unless the save matches its contract."""
    diffs = checkpoint_differences(step_dir, contract)
    if diffs:
        raise InputError(
            str(step_dir),
            "checkpoint files do not match their contract; refusing to load any of them: " + "; ".join(diffs),
        )
