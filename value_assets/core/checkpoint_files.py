"""The contract's binding of a checkpoint's bytes (docs/rules.md#checkpoint-binding), and its verification.

A save is described file by file once it is complete and before its contract is published; the
description goes into the contract as `checkpoint_files`, sorted by path:
`{path, size, chunk_bytes, chunk_sha256: [sha of each chunk]}` (core/chunks.py). Contracts written
before chunk digests bind `{path, size, sha256}` (the whole file's sha); they are still read and
verified that way. Whoever loads a checkpoint (resume, evaluation, export, promotion, `value-assets
verify`) calls `verify_checkpoint` first: the torch_dist format unpickles `.metadata`, so no byte of
a save may be deserialized before every file matches. Chunks of every file are hashed at once on
all cores. Torch-free, so the light CLI can use it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from value_assets.core.chunks import (
    CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    FileBinding,
    ShortRead,
    chunk_count,
    describe_chunks,
    hash_threads,
    open_regular,
    read_chunk,
    sha256_fd,
)
from value_assets.core.errors import InputError, show
from value_assets.core.hashing import is_sha
from value_assets.core.strict_json import is_int

# The contract itself sits in the step folder it binds; it is the one file not described.
CONTRACT_NAME = "value_pretrain_contract.json"
FIELD = "checkpoint_files"
_WHOLE_KEYS = {"path", "size", "sha256"}  # contracts written before chunk digests
_CHUNK_KEYS = {"path", "size", "chunk_bytes", "chunk_sha256"}
# A file whose chunks differ is named with its first few chunk indices, not thousands of digests.
_NAMED_CHUNKS = 8


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


def describe_folder(step_dir: str | Path, chunk_bytes: int = CHUNK_BYTES) -> list[dict[str, Any]]:
    """[{path, size, chunk_bytes, chunk_sha256}] of every file of a save, sorted by path (the
    contract's binding). Every chunk of every file is hashed in parallel; the size bound is the
    size of the bytes hashed, so the contract never names a byte that was not hashed.

    Refuses a save holding anything but regular files and folders (a symlink is never followed),
    and a file that shrinks while it is described."""
    if not is_int(chunk_bytes) or not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {chunk_bytes!r}")
    root = Path(step_dir)
    if not root.is_dir() or root.is_symlink():
        raise InputError(str(root), "checkpoint folder does not exist (or is a symlink)")
    found = sorted(_walk(root).items())
    for rel, st in found:
        if not stat.S_ISREG(st.st_mode):
            raise InputError(str(root / rel), "a checkpoint may hold only regular files (a symlink is never followed)")
    fds: dict[str, int] = {}
    try:
        for rel, _ in found:
            try:
                fds[rel] = open_regular(root / rel)
            except OSError as exc:
                raise InputError(
                    str(root / rel), f"cannot be read ({exc.strerror}); a symlink is never followed"
                ) from None
        sizes = {rel: os.fstat(fd).st_size for rel, fd in fds.items()}
        total = sum(chunk_count(s, chunk_bytes) for s in sizes.values())
        out = []
        with ThreadPoolExecutor(max_workers=hash_threads(total)) as pool:
            for rel, _ in found:
                try:
                    digests = describe_chunks(fds[rel], sizes[rel], chunk_bytes, pool)
                except ShortRead as short:
                    raise InputError(
                        str(root / rel),
                        f"changed while it was described: {short.at} bytes, {sizes[rel]} a moment before",
                    ) from None
                out.append({"path": rel, "size": sizes[rel], "chunk_bytes": chunk_bytes, "chunk_sha256": digests})
        return out
    finally:
        for fd in fds.values():
            os.close(fd)


def bound_files(contract: Mapping[str, Any], where: str) -> dict[str, FileBinding]:
    """relative path -> FileBinding of every file the contract binds; InputError when the binding
    is absent or malformed (a chunk list that does not fit the size included)."""
    files = contract.get(FIELD)
    if not isinstance(files, list) or not files:
        raise InputError(
            where, f"the contract binds no checkpoint files ({FIELD} = {show(files)}); it cannot be verified"
        )
    out: dict[str, FileBinding] = {}
    for k, f in enumerate(files):
        binding = _entry(f)
        p = PurePosixPath(f["path"]) if binding is not None else None  # None exactly when malformed
        if (
            p is None
            or binding is None
            or p.is_absolute()
            or ".." in p.parts
            or p.as_posix() != f["path"]
            or f["path"] in out
            or f["path"] == CONTRACT_NAME
        ):
            raise InputError(
                f"{where}: {FIELD}[{k}]",
                "not a file entry {path, size, chunk_bytes, chunk_sha256} (one sha per chunk) or {path, size, "
                f"sha256}}, with a unique relative path: {show(f)}",
            )
        out[f["path"]] = binding
    return out


def _entry(f: object) -> FileBinding | None:
    if not isinstance(f, dict) or not isinstance(f.get("path"), str) or not is_int(f.get("size")) or f["size"] < 0:
        return None
    if set(f) == _WHOLE_KEYS and is_sha(f["sha256"]):
        return FileBinding(size=f["size"], sha256=f["sha256"])
    if set(f) != _CHUNK_KEYS:
        return None
    cb, shas = f["chunk_bytes"], f["chunk_sha256"]
    if not is_int(cb) or not 1 <= cb <= MAX_CHUNK_BYTES or not isinstance(shas, list):
        return None
    if len(shas) != chunk_count(f["size"], cb) or not all(is_sha(s) for s in shas):
        return None
    return FileBinding(size=f["size"], chunk_bytes=cb, chunks=tuple(shas))


def _chunk_words(indices: list[int], binding: FileBinding) -> str:
    n = len(binding.chunks)
    shown = ", ".join(str(i) for i in indices[:_NAMED_CHUNKS]) + (", ..." if len(indices) > _NAMED_CHUNKS else "")
    return f"chunk{'s' if len(indices) > 1 else ''} {shown} of {n} ({binding.chunk_bytes} bytes each)"


def checkpoint_differences(step_dir: str | Path, contract: Mapping[str, Any]) -> list[str]:
    """What differs between the save in `step_dir` and the files its contract binds ([] = match).

    Names and sizes are compared first; a file is hashed only when its size matches. A chunked
    binding names each differing chunk by index; a whole-file binding (an older contract) the file."""
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
    per_file: dict[str, list[str]] = {}
    fds: dict[str, int] = {}
    try:
        for rel in sorted(set(bound) & set(present)):
            binding, st = bound[rel], present[rel]
            if not stat.S_ISREG(st.st_mode):
                per_file[rel] = [f"{rel} is not a regular file"]
                continue
            try:
                fds[rel] = open_regular(root / rel)
                size = os.fstat(fds[rel]).st_size
            except (OSError, InputError):
                per_file[rel] = [f"{rel} is not a regular file"]
                continue
            if size != binding.size:
                per_file[rel] = [_size_difference(rel, size, binding)]
        per_file.update(_hash_differences({rel: fd for rel, fd in fds.items() if rel not in per_file}, bound))
    finally:
        for fd in fds.values():
            os.close(fd)
    return diffs + [d for rel in sorted(per_file) for d in per_file[rel]]


def _size_difference(rel: str, size: int, binding: FileBinding) -> str:
    text = f"{rel}: size {size}, the contract binds {binding.size}"
    if binding.chunked:
        assert binding.chunk_bytes is not None
        first = min(size, binding.size) // binding.chunk_bytes
        text += f" ({'truncated' if size < binding.size else 'grown'} from chunk {first} of {len(binding.chunks)} on)"
    return text


def _hash_differences(fds: Mapping[str, int], bound: Mapping[str, FileBinding]) -> dict[str, list[str]]:
    """Hash every chunk of the chunked files and every whole-file binding, all in one thread pool."""
    whole = [rel for rel in fds if not bound[rel].chunked]
    tasks: list[tuple[str, int]] = [(rel, -1) for rel in sorted(whole, key=lambda r: -bound[r].size)]
    tasks += [(rel, i) for rel in fds if bound[rel].chunked for i in range(len(bound[rel].chunks))]

    def check(task: tuple[str, int]) -> tuple[str, int, str | None]:
        rel, i = task
        binding = bound[rel]
        if i < 0:
            sha, read = sha256_fd(fds[rel])
            if read != binding.size:
                return rel, i, f"{rel}: read {read} bytes, the contract binds {binding.size}"
            return (
                rel,
                i,
                None if sha == binding.sha256 else f"{rel}: sha256 {sha}, the contract binds {binding.sha256}",
            )
        _, data, digest = read_chunk(fds[rel], binding, i)
        return rel, i, None if digest == binding.chunks[i] and len(data) == binding.chunk_span(i)[1] else digest

    bad: dict[str, list[tuple[int, str]]] = {}
    if tasks:
        with ThreadPoolExecutor(max_workers=hash_threads(len(tasks))) as pool:
            for rel, i, wrong in pool.map(check, tasks):
                if wrong is not None:
                    bad.setdefault(rel, []).append((i, wrong))
    out: dict[str, list[str]] = {}
    for rel, found in bad.items():
        binding = bound[rel]
        if not binding.chunked:
            out[rel] = [found[0][1]]
        elif len(found) == 1:
            i, digest = found[0]
            offset, length = binding.chunk_span(i)
            out[rel] = [
                f"{rel}: {_chunk_words([i], binding)}, bytes {offset}..{offset + length - 1}: sha256 {digest}, "
                f"the contract binds {binding.chunks[i]}"
            ]
        else:
            out[rel] = [f"{rel}: {_chunk_words([i for i, _ in found], binding)} differ from the contract's digests"]
    return out


def verify_checkpoint(step_dir: str | Path, contract: Mapping[str, Any]) -> None:
    """Refuse (InputError naming every differing file and chunk) unless the save matches its contract."""
    diffs = checkpoint_differences(step_dir, contract)
    if diffs:
        raise InputError(
            str(step_dir),
            "checkpoint files do not match their contract; refusing to load any of them: " + "; ".join(diffs),
        )
