"""Critic checkpoint IO with megatron `dist_checkpointing` (re-shardable across TP/PP/DP).

A checkpoint folder holds the model's sharded state dict (and optionally the optimizer's) in
megatron's torch_dist format; loading with a different tensor-parallel size re-shards. The
folder must exist and be empty before saving (megatron refuses otherwise). The files are written
in the saving process (`in_process_save_strategy`): no forked writer that a kill could leave the
save waiting on.

All ranks call `save_critic` / `load_critic` collectively. Only tensors are stored (the iteration
is a tensor too). Loading never runs pickled code and, given the contract, uses only bytes it has
checked itself (docs/rules.md#checkpoint-binding): the driver verifies the folder before it reserves
workers, but a file can change between that check and a worker's read, so each worker reads the
chunks that hold the bytes it needs, once, hashes each, and cuts the tensors' bytes from those
buffers only when the chunk's sha256 matches the contract's (`_CheckedReader`; a file an older
contract binds by its whole sha256 is read whole and hashed, as before). The index (`.metadata`)
is unpickled from those bytes with a restricted unpickler (torch's checkpoint index classes only;
gpu/runtime/safe_pickle.py), `common.pt` with `torch.load(weights_only=True)`, and byte entries
(megatron's `_extra_state`) with `weights_only=True` too (`safe_byte_entries`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import inspect
import io
import os
import pickle
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader

from value_assets.core.checkpoint_files import CONTRACT_NAME, bound_files
from value_assets.core.chunks import FileBinding, hash_threads, ordered_map, pread_full, preadv_full, sha256_views
from value_assets.core.errors import InputError

_CHUNK = 8 << 20  # bytes hashed per read of a file bound by its whole sha256


def _load_bytes_weights_only(self, read_item, value) -> None:
    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message names the global it refused (its last line names it as 'GLOBAL x.y').
        found = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        raise InputError(
            f"checkpoint entry {read_item.dest_index.fqn}",
            "holds a Python object other than tensors and plain values, which is never unpickled"
            + (f" ({found[-1]})" if found else ""),
        ) from None
    if self.flatten_state_dict:
        from torch.distributed.checkpoint._traverse import set_element

        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


def safe_byte_entries() -> None:
    """Make megatron's load planner read byte entries with `torch.load(weights_only=True)` (tensors,
    containers and plain values only; never arbitrary objects). Idempotent; megatron's planner only."""
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    MCoreLoadPlanner.load_bytes = _load_bytes_weights_only


# ---- reading only checked bytes ------------------------------------------------------------------


def _changed(path: Path, what: str) -> InputError:
    return InputError(str(path), f"{what}; the file changed after the checkpoint was verified, nothing of it was used")


Span = tuple[int, int]


# A load's small reads (megatron-core 0.19 reads the common state apart from the weights, from the
# same data file) keep the checked chunks they read, at most this many per load, for the load's later
# reads of the same file to use instead of reading and hashing them again.
KEPT_CHUNKS = 4


class ChunkCache:
    """Checked chunks of one load, by (file, chunk index): bytes already compared with the
    contract's digest and held in memory (never read again from disk), each used once."""

    def __init__(self, limit: int = KEPT_CHUNKS):
        self.limit = limit
        self._chunks: dict[tuple[str, int], bytes] = {}

    def take(self, path: Path, index: int) -> bytes | None:
        return self._chunks.pop((str(path), index), None)

    def keep(self, path: Path, chunks: dict[int, bytes]) -> None:
        if len(self._chunks) + len(chunks) <= self.limit:
            self._chunks.update(((str(path), i), data) for i, data in chunks.items())


def read_checked(
    path: Path,
    pin: FileBinding | None,
    spans: list[Span] | None = None,
    pool: Executor | None = None,
    cache: ChunkCache | None = None,
) -> dict[Span, bytes]:
    """The (offset, length) `spans` of `path` (all of it, as span (0, -1), when None), read once
    and returned only as checked against `pin`, the contract's binding of the file.

    A chunked pin: only the chunks that cover the spans are read (in threads, on `pool` or a pool of
    its own), each hashed and compared with its digest before any span is cut from it; a differing
    chunk is named. A whole-file pin (an older contract): the file is read whole, hashed, and the
    spans kept while reading. Without a pin (a backbone the user names, not a contracted save) the
    spans as read. `cache`: checked chunks an earlier read of the same load kept (used instead of
    reading them again), and where a small read keeps its own."""
    fd = _open_read(path, pinned=pin is not None)
    if pin is not None and not pin.chunked:
        return _read_whole_checked(path, fd, pin, spans)
    try:
        size = os.fstat(fd).st_size
        wanted = sorted(set(spans)) if spans is not None else [(0, size if pin is None else pin.size)]
        if pin is None:
            out = {span: pread_full(fd, span[1], span[0]) for span in wanted}
        else:
            _refuse_unfit(path, size, pin, wanted)
            out = _read_chunked(path, fd, pin, wanted, pool, cache)
    finally:
        os.close(fd)
    short = [span for span in wanted if len(out[span]) != span[1]]
    if short:
        end = max(off + len(out[(off, n)]) for off, n in short)
        raise InputError(str(path), f"ends at byte {end}, before the index's entry at (offset, length) {short[0]}")
    return {(0, -1): out[wanted[0]]} if spans is None else out


def _refuse_unfit(path: Path, size: int, pin: FileBinding | None, wanted: list[Span]) -> None:
    """Refuse, before anything is read, a file of another `size` than `pin` binds, and `wanted`
    spans that end past the file (its pinned size, else `size`)."""
    if pin is not None and size != pin.size:
        raise _changed(path, f"size {size}, the contract binds {pin.size}")
    end = size if pin is None else pin.size
    past = [span for span in wanted if span[0] + span[1] > end]
    if past:
        raise InputError(str(path), f"ends at byte {end}, before the index's entry at (offset, length) {past[0]}")


def _read_chunked(
    path: Path, fd: int, pin: FileBinding, wanted: list[Span], pool: Executor | None, cache: ChunkCache | None
) -> dict[Span, bytes]:
    """`wanted` (sorted) read through `_checked_spans`: each chunk checked before a span is used."""
    return {span: bytes(data) for span, data in _checked_spans(path, fd, pin, wanted, pool, cache)}


def read_chunk_into(fd: int, pin: FileBinding, index: int, views: list[memoryview]) -> int:
    """Chunk `index` of the file read into `views` (its bytes in order); the bytes read."""
    return preadv_full(fd, views, pin.chunk_span(index)[0])


def _span_buffer(length: int) -> memoryview:
    """A writable buffer of `length` bytes, left uninitialised (every byte is read into it)."""
    return memoryview(np.empty(length, dtype=np.uint8)).cast("B")


def _checked_spans(
    path: Path,
    fd: int,
    pin: FileBinding,
    wanted: list[Span],
    pool: Executor | None,
    cache: ChunkCache | None,
    *,
    check: bool = True,
) -> Iterator[tuple[Span, memoryview]]:
    """(span, its bytes) for each of `wanted` (sorted), yielded as soon as every chunk under the
    span matched its digest. Each run of spans (one span, or spans that overlap) is read from the
    file straight into a buffer of its own, a span being a view of its run's buffer (the bytes
    between runs go to scratch buffers, to be hashed), chunk by chunk on `pool` (or a pool of its
    own), in order with a bounded number of chunks in flight; a chunk is hashed over the buffers it
    was read into. So a byte is read once, into the memory the consumer decodes it from (no chunk
    buffer to copy out of), and reading and hashing go on while the consumer uses a span. A chunk
    `cache` holds is used as it is (it was checked when kept); a read of at most `cache.limit`
    chunks keeps its own there. `check=False` (a folder no contract binds) reads the same way
    without hashing."""
    for span in wanted:
        if span[1] == 0:
            yield span, memoryview(b"")
    runs: list[tuple[Span, list[Span]]] = []  # (offset, length) of each run, and its spans
    for span in (sp for sp in wanted if sp[1] > 0):
        if runs and span[0] < runs[-1][0][0] + runs[-1][0][1]:
            (off, n), members = runs[-1]
            runs[-1] = ((off, max(n, span[0] + span[1] - off)), [*members, span])
        else:
            runs.append((span, [span]))
    indices = sorted({i for (off, n), _ in runs for i in pin.chunks_covering(off, n)})
    small = cache is not None and len(indices) <= cache.limit
    kept: dict[int, bytes] = {}
    buffers: dict[Span, memoryview] = {}  # the runs begun and not yet handed out

    def plan() -> Iterator[tuple[int, list[memoryview]]]:
        # (chunk, the buffers its bytes go to, in file order), made in the consumer's thread
        j = 0
        for i in indices:
            lo, n = pin.chunk_span(i)
            hi, pos = lo + n, lo
            while j < len(runs) and runs[j][0][0] + runs[j][0][1] <= lo:
                j += 1
            views: list[memoryview] = []
            k = j
            while k < len(runs) and runs[k][0][0] < hi:
                (off, length), k = runs[k][0], k + 1
                if off > pos:
                    views.append(_span_buffer(off - pos))
                    pos = off
                buf = buffers.get((off, length))
                if buf is None:
                    buf = buffers[(off, length)] = _span_buffer(length)
                end = min(off + length, hi)
                views.append(buf[pos - off : end - off])
                pos = end
            if pos < hi:
                views.append(_span_buffer(hi - pos))
            yield i, views

    def fetch(item: tuple[int, list[memoryview]]) -> tuple[int, int, str | None, list[memoryview]]:
        i, views = item
        held = cache.take(path, i) if cache is not None else None
        if held is not None:
            at = 0
            for view in views:
                view[:] = held[at : at + len(view)]
                at += len(view)
            return i, len(held), pin.chunks[i] if check else None, views
        got = read_chunk_into(fd, pin, i, views)
        return i, got, sha256_views(views, got) if check else None, views

    ends = iter(runs)
    run = next(ends, None)
    threads = hash_threads(len(indices))
    own = ThreadPoolExecutor(max_workers=threads) if pool is None else None
    try:
        for i, got, digest, views in ordered_map(own or pool, fetch, plan(), 2 * threads):
            offset, length = pin.chunk_span(i)
            if got != length and check:
                raise _changed(path, f"chunk {i} of {len(pin.chunks)}: read {got} bytes, the contract binds {length}")
            if got != length:  # unchecked: the file ended early
                short = run[1][-1] if run is not None else None
                raise InputError(
                    str(path), f"ends at byte {offset + got}, before the index's entry at (offset, length) {short}"
                )
            if check and digest != pin.chunks[i]:
                raise _changed(
                    path,
                    f"chunk {i} of {len(pin.chunks)} (bytes {offset}..{offset + length - 1}): read sha256 {digest}, "
                    f"the contract binds {pin.chunks[i]}",
                )
            if small:
                kept[i] = b"".join(views)
                if len(kept) == len(indices) and cache is not None:  # before the last yield: the
                    cache.keep(path, kept)  # consumer may close this generator once it has its spans
            while run is not None and run[0][0] + run[0][1] <= offset + length:
                buf = buffers.pop(run[0])
                for span in run[1]:
                    yield span, buf[span[0] - run[0][0] : span[0] - run[0][0] + span[1]]
                run = next(ends, None)
    finally:
        if own is not None:
            own.shutdown(cancel_futures=True)


class _ViewFile(io.RawIOBase):
    """A read-only, seekable file over one span's bytes (no copy of them): what torch's zip
    reader reads a record's index from, and torch.load the record from where it cannot be mapped."""

    def __init__(self, data: memoryview):
        super().__init__()
        self._data, self._pos = data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        if base + pos < 0:
            raise ValueError(f"negative seek position {base + pos}")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        piece = self._data[self._pos : self._pos + len(out)]
        out[: len(piece)] = piece
        self._pos += len(piece)
        return len(piece)


def _mapped_load() -> Callable[..., Any] | None:
    """torch's own zip-record decoder, given the record's bytes as the storage its tensors view
    (what `torch.load(mmap=True)` does for a file): `torch.serialization._load` with
    `overall_storage`, where this torch has it; None where it does not."""
    load = getattr(torch.serialization, "_load", None)
    if load is None or not hasattr(torch.serialization, "_open_zipfile_reader"):
        return None
    try:
        parameters = inspect.signature(load).parameters
    except (TypeError, ValueError):
        return None
    return load if "overall_storage" in parameters else None


_MAPPED_LOAD = _mapped_load()


def decode_record(data: memoryview) -> Any:
    """The tensor a checkpoint record (one `torch.save` zip: a data file's span) holds, unpickled
    with torch's weights-only unpickler and `map_location="cpu"`, as `torch.load` would. Its
    storage is `data` itself where this torch allows (writable `data`: a span `_checked_spans`
    read), so a tensor's bytes are copied once, into the model (`target.copy_`), as megatron's own
    load copies them; else torch.load reads it (one copy more)."""
    if _MAPPED_LOAD is None or data.readonly or len(data) == 0:
        return torch.load(_ViewFile(data), map_location="cpu", weights_only=True)
    from torch import _weights_only_unpickler

    storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    with torch.serialization._open_zipfile_reader(_ViewFile(data)) as zip_file:
        try:
            return _MAPPED_LOAD(zip_file, "cpu", _weights_only_unpickler, overall_storage=storage, encoding="utf-8")
        except pickle.UnpicklingError as exc:  # as torch.load reports a refused global
            raise pickle.UnpicklingError(f"Weights only load failed: {exc}") from None


class _SpanSource:
    """The checked spans of one data file, in the order the load asks for them (by offset): each
    is taken from `_checked_spans` as it becomes ready; a span asked for again at once (two reads
    of one stored tensor) is handed out again, and a span is dropped once the load moves past it."""

    def __init__(self, path: Path, spans: Iterator[tuple[Span, memoryview]]):
        self._path, self._spans = path, spans
        self._ready: dict[Span, memoryview] = {}
        self._last: tuple[Span, memoryview] | None = None

    def open(self, span: Span) -> memoryview:
        if self._last is not None and self._last[0] == span:
            return self._last[1]
        self._last = None
        while span not in self._ready:
            got = next(self._spans, None)
            if got is None:
                raise RuntimeError(f"{self._path}: span {span} was not among the spans read")
            self._ready[got[0]] = got[1]
        data = self._ready.pop(span)
        self._last = (span, data)
        return data


def _cut_spans(spans: list[Span], first: int, offset: int, buf: Any, parts: dict[Span, list[Any]]) -> int:
    """Append to `parts[span]` the piece of `buf` (the file's bytes from `offset` on) that each
    span of `spans` (sorted by offset) overlaps, starting at `spans[first]`; returns the new
    `first`: the spans wholly before `buf` are complete and never looked at again."""
    end = offset + len(buf)
    while first < len(spans) and spans[first][0] + spans[first][1] <= offset:
        first += 1
    j = first
    while j < len(spans) and spans[j][0] < end:
        off, n = spans[j]
        lo, hi = max(off, offset), min(off + n, end)
        if lo < hi:
            parts[spans[j]].append(buf[lo - offset : hi - offset])
        j += 1
    return first


def _open_read(path: Path, *, pinned: bool) -> int:
    """A read-only descriptor of `path`. A file a contract pins is never reached through a link: a
    contracted save holds only regular files (describe_folder), so a link there is a change."""
    nofollow = getattr(os, "O_NOFOLLOW", 0) if pinned else 0
    try:
        return os.open(path, os.O_RDONLY | nofollow | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise _changed(path, "a symlink now (never followed)") from None


def _read_whole_checked(path: Path, fd: int, pin: FileBinding, spans: list[Span] | None) -> dict[Span, bytes]:
    """A file a contract binds by its whole sha256 (written before chunk digests), open at `fd`
    (closed here): read whole, once, hashed, keeping the spans; returned only when what was read
    matches the pin."""
    wanted = sorted(set(spans)) if spans is not None else None
    parts: dict[Span, list[bytes]] = {span: [] for span in wanted or []}
    whole: list[bytes] = []
    digest = hashlib.sha256()
    pos, first = 0, 0
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            end = pos + len(chunk)
            if wanted is None:
                whole.append(chunk)
            else:
                first = _cut_spans(wanted, first, pos, chunk, parts)
            pos = end
    if pos != pin.size:
        raise _changed(path, f"read {pos} bytes, the contract binds {pin.size}")
    if digest.hexdigest() != pin.sha256:
        raise _changed(path, f"read sha256 {digest.hexdigest()}, the contract binds {pin.sha256}")
    if wanted is None:
        return {(0, -1): b"".join(whole)}
    out = {span: b"".join(p) for span, p in parts.items()}
    short = [span for span, data in out.items() if len(data) != span[1]]
    if short:
        raise InputError(str(path), f"ends at byte {pos}, before the index's entry at (offset, length) {short[0]}")
    return out


class _Unread:
    """What `_CheckedReader` hands torch instead of an open file: only the checked slices are read."""

    def __init__(self, relative_path: str):
        self.relative_path = relative_path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CheckedFileSystem:
    """torch's FileSystem, except that opening a data file gives an `_Unread` (the bytes come from
    `_CheckedReader`'s checked slices)."""

    def __init__(self, fs: Any, root: Path):
        self._fs, self._root = fs, root

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    def create_stream(self, path: Any, mode: str):
        if mode != "rb":
            raise PermissionError(f"{path}: a checkpoint is only read")
        return _Unread(Path(path).relative_to(self._root).as_posix())


class _CheckedReader(FileSystemReader):
    """torch's file-system reader for a save whose files are `pins` (relative path -> FileBinding,
    the contract's binding; None for an unpinned backbone folder).

    `.metadata` is read whole, checked, and unpickled from those bytes with the restricted
    unpickler; the data files are read file by file, each chunk once: the chunks that hold the
    records the load asks for are read (each record into a buffer of its own) and hashed on every
    core ahead of the decoding, which decodes each record in place (`decode_record`: torch's
    weights-only unpickler) as soon as every chunk under it matched its digest (`_SpanSource`) and
    copies it into its target, as torch's own `read_data` does; a file an older contract binds by
    its whole sha256 is read whole and matched before any of it is decoded. A file the contract
    does not bind is never read."""

    def __init__(
        self,
        path: str | os.PathLike,
        pins: Mapping[str, FileBinding] | None,
        refusals: list[InputError] | None = None,
        cache: ChunkCache | None = None,
    ):
        super().__init__(path)
        self._cache = cache
        self._root = Path(path)
        self._pins = pins
        self.fs = _CheckedFileSystem(self.fs, self._root)
        # Every refusal this reader raised, for the load to raise as itself: megatron-core 0.19
        # catches a failed index read and raises its own AssertionError with the message as text.
        self.refusals = [] if refusals is None else refusals

    def _refused(self, exc: InputError) -> InputError:
        self.refusals.append(exc)
        return exc

    def _pin(self, rel: str) -> FileBinding | None:
        if self._pins is None:
            return None
        if rel not in self._pins:
            raise InputError(str(self._root / rel), "the contract does not bind this file; it is not read")
        return self._pins[rel]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._read_metadata(*args, **kwargs)
        except InputError as exc:
            raise self._refused(exc) from exc.__cause__

    def _read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        from value_assets.gpu.runtime.safe_pickle import loads_dcp_metadata

        rel = Path(self._get_metadata_path(kwargs.get("rank"))).relative_to(self._root).as_posix()
        path = self._root / rel
        try:
            data = read_checked(path, self._pin(rel))[(0, -1)]
        except FileNotFoundError:
            if self._pins is not None:
                raise _changed(path, "missing") from None
            raise InputError(str(path), "missing: not a torch_dist checkpoint folder") from None
        metadata = loads_dcp_metadata(data, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file: Any, sinfo: Any) -> io.RawIOBase:
        raise TypeError("checkpoint data is read through _CheckedReader.read_data only")

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            return self._read_data(plan, planner)
        except InputError as exc:
            raise self._refused(exc) from exc.__cause__

    def _read_data(self, plan: Any, planner: Any) -> Any:
        from torch.futures import Future

        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)

        # A file the contract binds by chunks (or none binds) is streamed: its chunks are read and
        # hashed on every core ahead of the decoding, which takes each record from the checked
        # spans as they become ready, in file order. A file an older contract binds by its whole
        # sha256 is read whole and checked before any of it is decoded (one file per thread, read
        # ahead).
        pins = {rel: self._pin(rel) for rel in per_file}
        whole = [rel for rel, pin in pins.items() if pin is not None and not pin.chunked]
        with (
            ThreadPoolExecutor(max_workers=hash_threads(1 << 30)) as chunk_pool,
            ThreadPoolExecutor(max_workers=hash_threads(len(whole) or 1)) as whole_pool,
        ):
            spans = {
                rel: [(m.offset, m.length) for m in (self.storage_data[i.storage_index] for i in items)]
                for rel, items in per_file.items()
            }
            ahead = {rel: whole_pool.submit(self._whole_file, rel, pins[rel], spans[rel]) for rel in whole}
            try:
                for rel, items in per_file.items():
                    if rel in ahead:
                        kept = ahead.pop(rel).result()
                        got: Iterator[tuple[Span, memoryview]] = ((s, memoryview(d)) for s, d in kept.items())
                    else:
                        got = self._streamed(rel, pins[rel], sorted(set(spans[rel])), chunk_pool)
                    try:
                        self._decode_file(rel, items, _SpanSource(self._root / rel, got), planner)
                    finally:
                        got.close()
            finally:
                for later in ahead.values():
                    later.cancel()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _decode_file(self, rel: str, items: list[Any], source: _SpanSource, planner: Any) -> None:
        """What torch's `FileSystemReader.read_data` does with one file's read items, in file order,
        each record decoded from its checked span (`decode_record`) and copied into its target."""
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType

        for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
            info = self.storage_data[item.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise InputError(
                    str(self._root / rel),
                    f"the record at (offset, length) {(info.offset, info.length)} is stored transformed "
                    f"({list(info.transform_descriptors)}); only plain records are read",
                )
            data = source.open((info.offset, info.length))
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(data))
                continue
            tensor = narrow_tensor_by_index(decode_record(data), item.storage_offsets, item.lengths)
            target = planner.resolve_tensor(item).detach()
            if target.size() != tensor.size():
                raise InputError(
                    str(self._root / rel),
                    f"the record at (offset, length) {(info.offset, info.length)} holds shape "
                    f"{tuple(tensor.size())}, the load expects {tuple(target.size())}",
                )
            target.copy_(tensor)
            planner.commit_tensor(item, target)

    def _whole_file(self, rel: str, pin: FileBinding, spans: list[Span]) -> dict[Span, bytes]:
        try:
            return read_checked(self._root / rel, pin, spans)
        except FileNotFoundError:
            raise _changed(self._root / rel, "missing") from None

    def _streamed(
        self, rel: str, pin: FileBinding | None, wanted: list[Span], pool: Executor
    ) -> Generator[tuple[Span, memoryview], None, None]:
        """`_checked_spans` of the data file `rel`, opened (and its size and spans checked) when
        the load asks for its first span, closed with this generator."""
        path = self._root / rel
        try:
            fd = _open_read(path, pinned=self._pins is not None)
        except FileNotFoundError:
            raise _changed(path, "missing") from None
        try:
            size = os.fstat(fd).st_size
            _refuse_unfit(path, size, pin, wanted)
            binding = pin if pin is not None else FileBinding(size=size, chunk_bytes=_CHUNK)
            yield from _checked_spans(path, fd, binding, wanted, pool, self._cache, check=pin is not None)
        finally:
            os.close(fd)


@contextlib.contextmanager
def checked_reads(path: str | os.PathLike, contract: Mapping[str, Any] | None) -> Iterator[dict[str, Any]]:
    """Keyword arguments for `dist_checkpointing.load` under which every byte megatron loads from
    `path` comes through `_CheckedReader` (and a `common.pt` through `_load_common`).

    megatron-core opens a torch_dist folder through `strategies.torch._get_filesystem_reader` (0.19
    also through the copy of that name in `serialization`, and reads a legacy `common.pt` through
    `serialization.load_common`; 0.16 reads `common.pt` through the load's common strategy): each of
    these present in this version is replaced for the load. Fails closed when none is found."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint.api import CheckpointException

    pins = None if contract is None else bound_files(contract, str(Path(path) / CONTRACT_NAME))
    if not hasattr(mcore_torch, "_get_filesystem_reader"):
        raise RuntimeError(
            "this megatron-core reads torch_dist checkpoints through other functions than the checked "
            "reader replaces (strategies.torch._get_filesystem_reader)"
        )

    refusals: list[InputError] = []
    cache = ChunkCache()  # one load's readers: 0.19 reads the common state apart from the weights

    def reader(checkpoint_dir: str | os.PathLike, *_args: Any, **_kwargs: Any) -> _CheckedReader:
        return _CheckedReader(checkpoint_dir, pins, refusals, cache)

    replaced = [
        (module, "_get_filesystem_reader", reader)
        for module in (mcore_torch, serialization)
        if hasattr(module, "_get_filesystem_reader")
    ]
    if hasattr(serialization, "load_common"):  # 0.19: a legacy common.pt
        replaced.append((serialization, "load_common", lambda checkpoint_dir: _load_common(checkpoint_dir, pins)))
    kwargs: dict[str, Any] = {"sharded_strategy": mcore_torch.TorchDistLoadShardedStrategy()}
    if "common_strategy" in inspect.signature(serialization.load).parameters:  # 0.16
        kwargs["common_strategy"] = _common_strategy(pins)
    originals = [(module, name, getattr(module, name)) for module, name, _ in replaced]
    for module, name, fn in replaced:
        setattr(module, name, fn)
    try:
        yield kwargs
    except CheckpointException as exc:  # torch gathers each rank's read error; a refusal is raised as itself
        gathered = [err for err, _ in exc.failures.values() if isinstance(err, InputError)]
        if gathered or refusals:
            raise (gathered or refusals)[0] from None
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception:  # megatron-core 0.19 reports a refused index read as its own AssertionError
        if refusals:
            raise refusals[0] from None
        raise
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


def _load_common(checkpoint_dir: str | os.PathLike, pins: Mapping[str, FileBinding] | None) -> Any:
    """`common.pt` read whole, checked against its pin, then `torch.load(weights_only=True)`."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    name = "common.pt"
    path = Path(checkpoint_dir) / name
    if pins is not None and name not in pins:
        raise InputError(str(path), "the contract does not bind this file; it is not read")
    try:
        data = read_checked(path, None if pins is None else pins[name])[(0, -1)]
    except FileNotFoundError as exc:
        raise CheckpointingException(f"Common file {path} does not exist") from exc
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _common_strategy(pins: Mapping[str, FileBinding] | None) -> Any:
    """megatron-core 0.16's common load strategy, reading through `_load_common`."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class _CheckedCommon(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: str | Path) -> Any:
            return _load_common(checkpoint_dir, pins)

        def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: str | Path) -> Any:
            raise InputError(
                str(checkpoint_dir), "this checkpoint stores objects as separate pickles; they are not read"
            )

    return _CheckedCommon()


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def _model_sharded_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    sd = _unwrap(model).sharded_state_dict(prefix="")
    # megatron marks output_layer.* shape-mismatch-tolerant for vocab padding; for the value
    # head a shape mismatch means a different objective (K) and must fail loudly.
    for key in ("output_layer.weight", "output_layer.bias"):
        if key in sd:
            sd[key].allow_shape_mismatch = False
    return sd


# The distributed optimizer's sharded format: each rank writes its own shard of the fp32 master
# weights and Adam moments, with no gather ('fully_reshardable' would gather the whole optimizer
# state on one rank; megatron 0.16's default format is refused by its own checkpointing). It
# re-shards over data-parallel sizes only, so a resume keeps tp and pp. Ignored by the plain
# optimizer.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _state(model: torch.nn.Module, optimizer: Any, iteration: int) -> dict[str, Any]:
    model_sd = _model_sharded_state_dict(model)
    state: dict[str, Any] = {"model": model_sd, "iteration": torch.tensor(iteration, dtype=torch.int64)}
    if optimizer is not None:
        sd = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=_OPTIMIZER_METADATA)
        state["optimizer"] = without_classes(sd)
    return state


def without_classes(tree: Any) -> Any:
    """The optimizer's sharded state with every class-valued entry of its param groups left out.

    megatron-core's HybridDeviceOptimizer (`--optimizer-offload`) keeps its sub-optimizers' classes
    in every param group (`cpu_optimizer_cls`, `gpu_optimizer_cls`, its constructor's defaults); the
    distributed optimizer saves the groups as one pickled entry. A class is code, not state: the
    checked loader reads entries with `torch.load(weights_only=True)` and refuses it, and a
    checkpoint naming Transformer Engine's FusedAdam would not even load where TE is absent. Nothing
    reads them back (the optimizer keeps its own classes; megatron's load merges the saved groups'
    values into the live ones), so they are not saved. A new tree: the live groups keep theirs."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(tree, ShardedObject):
        data = without_classes(tree.data)
        if data is tree.data:
            return tree
        return dataclasses.replace(tree, data=data)
    if isinstance(tree, dict):
        out = {k: without_classes(v) for k, v in tree.items()}
        groups = tree.get("param_groups")
        if isinstance(groups, list) and any(
            isinstance(g, dict) and any(isinstance(v, type) for v in g.values()) for g in groups
        ):
            out["param_groups"] = [
                {k: v for k, v in g.items() if not isinstance(v, type)} if isinstance(g, dict) else g for g in groups
            ]
        changed = any(out[k] is not v for k, v in tree.items())
        return out if changed else tree
    return tree


def save_critic(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any = None, iteration: int = 0) -> None:
    """Save model (and optimizer) to `path`, an existing empty folder. Collective."""
    from megatron.core import dist_checkpointing

    p = Path(path)
    if torch.distributed.get_rank() == 0:
        if not p.is_dir():
            raise FileNotFoundError(f"checkpoint folder {p} must exist (and be empty)")
        if any(p.iterdir()):
            raise FileExistsError(f"checkpoint folder {p} is not empty")
    torch.distributed.barrier()
    dist_checkpointing.save(_state(model, optimizer, iteration), str(p), sharded_strategy=in_process_save_strategy())
    torch.distributed.barrier()


def in_process_save_strategy() -> Any:
    """megatron's torch_dist save strategy, writing in this process, in this thread.

    megatron's own forks a writer process per file (megatron-core 0.16; on CPU also a manager
    process for their results, gpu/runtime/compat.py) and waits for them without a deadline: a
    writer killed mid-save (the OOM killer, SIGXFSZ) hung the save for good. In a training job
    the worker then never answered, its driver waited out the job's deadline (`timeout_s`, 900 s
    by default) and a further minute for the worker's shutdown; `export-miles` hung for good.
    torch's own `FileSystemWriter` with one thread writes the same format (the `.metadata` index
    and one `__<rank>_0.distcp` per rank, fsynced; megatron-core 0.19's default layout), read by
    megatron's own `dist_checkpointing.load`; its errors are raised in the caller, which maps the
    system's refusal to exit 2 and removes what it staged (train's `_save`, export's
    `staged_folder`)."""
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    class Writer(FileSystemWriter):
        @property
        def checkpoint_id(self) -> str:  # the index records it: a str, as megatron's writer records it
            return str(self.path)  # (a Path is no class the checkpoint index may hold: safe_pickle.py)

        def write_data(self, plan: Any, planner: Any) -> Any:
            if plan.items:
                return super().write_data(plan, planner)
            # A rank with nothing of its own to write (a replica: dp > 1) writes no file, as
            # megatron's writer does, rather than an empty one.
            from torch.futures import Future

            done: Future[list[Any]] = Future()
            done.set_result([])
            return done

    class InProcessSave(TorchDistSaveShardedStrategy):  # type: ignore[misc]  # megatron is untyped
        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dedup = not self.keep_only_main_replica
            dcp_save(
                mcore_to_pyt_state_dict(flat, False),
                storage_writer=Writer(str(checkpoint_dir), thread_count=1, sync_files=True),
                planner=MCoreSavePlanner(dedup_replicated_tensors=dedup, flatten_state_dict=False),
            )

    return InProcessSave("torch_dist", 1)


def load_critic(
    path: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any = None,
    strict: bool = True,
    contract: Mapping[str, Any] | None = None,
) -> int:
    """Load model (and optimizer when given) from `path` into the already-built modules, for any
    TP size. Returns the stored iteration. Collective. With the save's `contract`, every byte used
    is checked against it (see the module docstring)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    safe_byte_entries()
    m = _unwrap(model)
    model_sd = _model_sharded_state_dict(m)
    state: dict[str, Any] = {"model": model_sd, "iteration": torch.tensor(0, dtype=torch.int64)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=_OPTIMIZER_METADATA)
    with checked_reads(path, contract) as strategies:
        loaded = dist_checkpointing.load(
            state, str(path), strict=StrictHandling.RAISE_ALL if strict else StrictHandling.LOG_UNEXPECTED, **strategies
        )
    m.load_state_dict(loaded["model"], strict=strict)
    if optimizer is not None:
        with torch.no_grad():  # the distributed optimizer copies into views of fp32 parameters
            optimizer.load_state_dict(loaded["optimizer"])
        _own_adam_steps(optimizer)
        place_offloaded_state(optimizer)
    it = loaded.get("iteration")
    return int(it) if it is not None else 0


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The optimizers megatron's optimizer wraps, one per chained optimizer (torch's Adam, or
    megatron-core's HybridDeviceOptimizer with `--optimizer-offload`); those without one left out."""
    chain = getattr(optimizer, "chained_optimizers", [optimizer])
    return [inner for opt in chain if (inner := getattr(opt, "optimizer", None)) is not None]


def step_on_device(group: Mapping[str, Any]) -> bool:
    """Whether torch's Adam keeps this param group's step count on the parameter's device (fused or
    capturable) rather than on the CPU."""
    return bool(group.get("fused") or group.get("capturable"))


def _own_adam_steps(optimizer: Any) -> None:
    """Restore torch Adam's per-parameter step count under megatron's distributed optimizer
    (without Transformer Engine / Apex). megatron keeps the step in the checkpoint's param groups
    and writes it into the parameter states as ONE shared tensor, which its 'dp_reshardable'
    parameter-state copy then overwrites with the fresh optimizer's count; torch's Adam also
    increments each state's step in place, so a shared tensor would advance once per parameter.
    Every parameter gets its own tensor holding its group's saved step.

    With optimizer offload the inner optimizer is megatron-core's HybridDeviceOptimizer: the saved
    step rides on its param groups and its sub-optimizers' (torch AdamW) states got the shared
    tensor; each of those gets its own tensor of that step (place_offloaded_state then puts it where
    its group keeps it). Left shared, the counts of a resumed offloaded run drifted apart and its
    first save failed in megatron's one-step check (`assert len(steps) == 1`; found on an H100)."""
    for inner in inner_optimizers(optimizer):
        subs = getattr(inner, "sub_optimizers", None)
        if subs is not None:
            saved = sorted({float(g["step"]) for g in inner.param_groups if "step" in g})
            if len(saved) > 1:
                raise ValueError(f"the offloaded optimizer's param groups hold different steps: {saved}")
            states = [state for sub in subs for state in sub.state.values() if "step" in state] if saved else []
            for state in states:
                state["step"] = torch.tensor(saved[0], dtype=torch.float32)
            continue
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))


def place_offloaded_state(optimizer: Any) -> None:
    """Put every sub-optimizer's state of megatron-core's HybridDeviceOptimizer (`--optimizer-offload`)
    on its parameter's device after a load. Its own placement after a load tells CPU from GPU
    sub-optimizers by class (`isinstance(opt, cpu_optimizer_cls)`); without Transformer Engine or
    Apex both are torch's AdamW, so the GPU part's moments were moved to the host and the first
    step after a resume failed ('exp_avgs is on cpu, different from other tensors on cuda:0'; found
    on an H100). The step count stays where torch's Adam keeps it: on the parameter's device for a
    fused or capturable group, else on the CPU. The state dicts are shared with the hybrid
    optimizer's own `state`, so both see the move."""
    for inner in inner_optimizers(optimizer):
        for sub in getattr(inner, "sub_optimizers", None) or []:
            for group in sub.param_groups:
                on_device = step_on_device(group)
                for p in group["params"]:
                    state = sub.state.get(p)
                    if not state:
                        continue
                    for k, v in list(state.items()):
                        if not isinstance(v, torch.Tensor) or (k == "step" and not on_device):
                            continue
                        if v.device != p.device:
                            state[k] = v.to(p.device)


def load_model_weights(
    path: str | os.PathLike, model: torch.nn.Module, contract: Mapping[str, Any] | None = None
) -> int:
    """Load only the model's tensors (forward-only use, export); every one must be in the
    checkpoint, its optimizer state is left unread. Returns the stored iteration. Collective.
    `contract` as for `load_critic`."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    safe_byte_entries()
    m = _unwrap(model)
    state = {"model": _model_sharded_state_dict(m), "iteration": torch.tensor(0, dtype=torch.int64)}
    with checked_reads(path, contract) as strategies:
        loaded = dist_checkpointing.load(state, str(path), strict=StrictHandling.RAISE_UNEXPECTED, **strategies)
    m.load_state_dict(loaded["model"], strict=True)
    return int(loaded["iteration"])
