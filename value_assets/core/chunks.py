"""Fixed-size chunk digests of a file, read and hashed on every core (docs/rules.md#checkpoint-binding).

sha256 of a whole file is one sequential pass (about 1.2-1.8 GB/s on one core). A file cut into
chunks of `chunk_bytes` (the last one shorter) has one sha256 per chunk, and the chunks are hashed
in threads: hashlib and `os.pread` release the GIL, so a thread pool uses every core. A reader that
needs only some byte ranges reads and checks only the chunks that cover them.

Chunks are read with `os.pread` from one descriptor per file, opened without following a symlink,
so a name swapped for a link after the folder was listed is refused rather than followed.
Torch-free: the light CLI, the driver and the GPU workers share it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from value_assets.core.errors import InputError, show

# 16 MiB: hashing one chunk takes about 10 ms on one core, so a 20 GB save is over a thousand tasks
# (every core busy, the last file's tail no straggler); a loader that needs a few tensors reads at
# most one chunk too many on each side of a contiguous range; and a contract lists about 4 KB of
# digests per GB of checkpoint (90 KB for a 1.5B critic with Adam state, 400 KB for 7B).
CHUNK_BYTES = 16 << 20
# A contract naming bigger chunks is refused: each reading thread holds one chunk in memory.
MAX_CHUNK_BYTES = 1 << 30
THREADS_ENV = "VALUE_ASSETS_HASH_THREADS"

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class FileBinding:
    """How a contract binds one file: its size and its chunk digests (`chunk_bytes`, `chunks`),
    or, in a contract written before chunk digests existed, one whole-file `sha256`."""

    size: int
    sha256: str | None = None
    chunk_bytes: int | None = None
    chunks: tuple[str, ...] = ()

    @property
    def chunked(self) -> bool:
        return self.chunk_bytes is not None

    def chunk_span(self, index: int) -> tuple[int, int]:
        """(offset, length) of chunk `index`."""
        cb = self._cb()
        offset = index * cb
        return offset, min(cb, self.size - offset)

    def chunks_covering(self, offset: int, length: int) -> range:
        """Indices of the chunks that hold bytes [offset, offset + length)."""
        cb = self._cb()
        if length <= 0:
            return range(0)
        return range(offset // cb, (offset + length - 1) // cb + 1)

    def _cb(self) -> int:
        if self.chunk_bytes is None:
            raise ValueError("a whole-file binding has no chunks")
        return self.chunk_bytes


def chunk_count(size: int, chunk_bytes: int) -> int:
    """Chunks of a file of `size` bytes (an empty file has none: its size binds it)."""
    return -(-size // chunk_bytes)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def hash_threads(tasks: int) -> int:
    """Threads for `tasks` independent hashing tasks: one per core this process may run on (or
    `$VALUE_ASSETS_HASH_THREADS`), never more than the tasks."""
    env = os.environ.get(THREADS_ENV, "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise InputError(THREADS_ENV, f"expected a positive integer, got {show(env)}")
        cores = int(env)
    else:
        cores = available_cores()
    return max(1, min(tasks, cores))


def open_regular(path: str | Path) -> int:
    """A read-only descriptor of the regular file at `path`; a symlink there is never followed
    (OSError), anything but a regular file is refused (InputError)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(str(path), "is not a regular file")
    return fd


def pread_full(fd: int, length: int, offset: int) -> bytes:
    """`length` bytes at `offset`, fewer only at the end of the file."""
    data = os.pread(fd, length, offset)
    if len(data) == length or not data:
        return data
    parts, got = [data], len(data)
    while got < length and (more := os.pread(fd, length - got, offset + got)):
        parts.append(more)
        got += len(more)
    return b"".join(parts)


_IOV_MAX = 1024  # buffers per preadv call (Linux's IOV_MAX)


def preadv_full(fd: int, buffers: list[memoryview], offset: int) -> int:
    """Fill `buffers` (writable, in order) with the file's bytes from `offset` on, each byte read
    straight into its buffer; returns the bytes read, fewer only at the end of the file."""
    got, i, at = 0, 0, 0  # bytes read; the buffer being filled and how far
    while i < len(buffers):
        views = [buffers[i][at:], *buffers[i + 1 : i + _IOV_MAX]]
        n = os.preadv(fd, views, offset + got)
        if n == 0:
            break
        got += n
        n += at
        while i < len(buffers) and n >= len(buffers[i]):
            n -= len(buffers[i])
            i += 1
        at = n
    return got


def sha256_views(views: list[memoryview], length: int) -> str:
    """sha256 of the first `length` bytes of `views` joined (hashlib releases the GIL on each)."""
    h = hashlib.sha256()
    for view in views:
        if length <= 0:
            break
        h.update(view[:length])
        length -= len(view)
    return h.hexdigest()


def sha256_fd(fd: int, block: int = 8 << 20) -> tuple[str, int]:
    """(sha256, bytes read) of a whole file, sequentially (a whole-file binding)."""
    h, pos = hashlib.sha256(), 0
    while data := os.pread(fd, block, pos):
        h.update(data)
        pos += len(data)
    return h.hexdigest(), pos


def ordered_map(pool: Executor, fn: Callable[[T], R], items: Iterable[T], window: int) -> Iterator[R]:
    """`fn` over `items` on `pool`, results in order, at most `window` in flight (so at most
    `window` chunks are held in memory however large the file). Unstarted work is cancelled when
    the consumer stops early."""
    it = iter(items)
    pending: deque[Future[R]] = deque(pool.submit(fn, x) for _, x in zip(range(max(1, window)), it, strict=False))
    try:
        while pending:
            result = pending.popleft().result()
            for x in it:
                pending.append(pool.submit(fn, x))
                break
            yield result
    finally:
        for fut in pending:
            fut.cancel()


def read_chunk(fd: int, binding: FileBinding, index: int) -> tuple[int, bytes, str]:
    """(index, bytes, sha256 of those bytes) of one chunk; the bytes may be short if the file shrank."""
    offset, length = binding.chunk_span(index)
    data = pread_full(fd, length, offset)
    return index, data, hashlib.sha256(data).hexdigest()


def describe_chunks(fd: int, size: int, chunk_bytes: int, pool: Executor) -> list[str]:
    """The chunk digests of the first `size` bytes of `fd`; InputError-free, but raises
    `ShortRead` when the file holds fewer bytes than `size` (it changed while being described)."""
    binding = FileBinding(size=size, chunk_bytes=chunk_bytes)

    def one(i: int) -> str:
        _, data, digest = read_chunk(fd, binding, i)
        if len(data) != binding.chunk_span(i)[1]:
            raise ShortRead(i, binding.chunk_span(i)[0] + len(data))
        return digest

    return list(pool.map(one, range(chunk_count(size, chunk_bytes))))


class ShortRead(Exception):
    """A chunk ended early: the file is shorter than its size said (`at` = bytes present)."""

    def __init__(self, index: int, at: int):
        super().__init__(index, at)
        self.index, self.at = index, at
