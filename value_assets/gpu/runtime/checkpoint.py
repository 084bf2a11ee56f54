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

import bisect
import contextlib
import dataclasses
import errno
import hashlib
import io
import os
from collections.abc import Generator, Iterator, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader

from value_assets.core.checkpoint_files import CONTRACT_NAME, bound_files
from value_assets.core.chunks import FileBinding, hash_threads, ordered_map, pread_full, read_chunk
from value_assets.core.errors import InputError

_CHUNK = 8 << 20  # bytes hashed per read of a file bound by its whole sha256


def _load_bytes_weights_only(self, read_item, value) -> None:
    obj = torch.load(value, weights_only=True)
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
    """`wanted` (sorted) cut from the chunks that cover them, each chunk checked before it is used,
    each span joined into one bytes object (`_checked_pieces`)."""
    return {span: b"".join(pieces) for span, pieces in _checked_pieces(path, fd, pin, wanted, pool, cache)}


def _checked_pieces(
    path: Path,
    fd: int,
    pin: FileBinding,
    wanted: list[Span],
    pool: Executor | None,
    cache: ChunkCache | None,
    *,
    check: bool = True,
) -> Iterator[tuple[Span, list[memoryview]]]:
    """(span, its bytes as pieces of checked chunks) for each of `wanted` (sorted), yielded as soon
    as the span's last chunk is checked. Chunks are read in order on `pool` (or a pool of its own)
    with a bounded number in flight, so reading and hashing go on while the consumer uses a span,
    and memory holds the spans not yet dropped plus a few chunks. A chunk `cache` holds is used as
    it is (it was checked when kept); a read of at most `cache.limit` chunks keeps them there.
    `check=False` (a folder no contract binds) reads the same way without hashing."""
    indices = sorted({i for off, n in wanted for i in pin.chunks_covering(off, n)})
    small = cache is not None and len(indices) <= cache.limit
    kept: dict[int, bytes] = {}

    def fetch(i: int) -> tuple[int, bytes, str | None]:
        held = cache.take(path, i) if cache is not None else None
        if held is not None:
            return i, held, pin.chunks[i] if check else None
        if not check:
            offset, length = pin.chunk_span(i)
            return i, pread_full(fd, length, offset), None
        return read_chunk(fd, pin, i)

    for span in wanted:
        if span[1] == 0:
            yield span, []
    live = [span for span in wanted if span[1] > 0]
    parts: dict[Span, list[memoryview]] = {span: [] for span in live}
    ends = sorted(live, key=lambda sp: sp[0] + sp[1])
    first = done = 0
    threads = hash_threads(len(indices))
    own = ThreadPoolExecutor(max_workers=threads) if pool is None else None
    try:
        for i, data, digest in ordered_map(own or pool, fetch, indices, 2 * threads):
            offset, length = pin.chunk_span(i)
            if check and len(data) != length:
                raise _changed(
                    path, f"chunk {i} of {len(pin.chunks)}: read {len(data)} bytes, the contract binds {length}"
                )
            if check and digest != pin.chunks[i]:
                raise _changed(
                    path,
                    f"chunk {i} of {len(pin.chunks)} (bytes {offset}..{offset + length - 1}): read sha256 {digest}, "
                    f"the contract binds {pin.chunks[i]}",
                )
            if small:
                kept[i] = data
                if len(kept) == len(indices) and cache is not None:  # before the last yield: the
                    cache.keep(path, kept)  # consumer may close this generator once it has its spans
            end = offset + len(data)
            first = _cut_spans(live, first, offset, memoryview(data), parts)
            while done < len(ends) and ends[done][0] + ends[done][1] <= end:
                span = ends[done]
                yield span, parts.pop(span)
                done += 1
        for span in ends[done:]:  # unchecked reads only: the file ended before these spans did
            yield span, parts.pop(span)
    finally:
        if own is not None:
            own.shutdown(cancel_futures=True)


class _PiecesFile(io.RawIOBase):
    """A read-only, seekable file over a span's pieces (memoryviews of checked chunks): torch.load
    reads the span from the chunk buffers themselves (readinto), never from a joined copy."""

    def __init__(self, pieces: list[memoryview]):
        super().__init__()
        self._pieces = pieces
        self._starts = [0]
        for piece in pieces:
            self._starts.append(self._starts[-1] + len(piece))
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._starts[-1]}[whence]
        if base + pos < 0:
            raise ValueError(f"negative seek position {base + pos}")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        got = 0
        j = bisect.bisect_right(self._starts, self._pos) - 1
        while got < len(out) and 0 <= j < len(self._pieces):
            piece, at = self._pieces[j], self._pos - self._starts[j]
            n = min(len(piece) - at, len(out) - got)
            out[got : got + n] = piece[at : at + n]
            got += n
            self._pos += n
            j += 1
        return got

    def readall(self) -> bytes:
        size = max(0, self._starts[-1] - self._pos)
        buf = bytearray(size)
        return bytes(buf[: self.readinto(buf)])


class _SpanSource:
    """The checked spans of one data file, in the order the load asks for them (by offset): each
    is taken from `_checked_pieces` as it becomes ready and handed out as a `_PiecesFile`; a span
    asked for again at once (two reads of one stored tensor) is handed out again, and a span is
    dropped once the load moves past it."""

    def __init__(self, path: Path, pieces: Iterator[tuple[Span, list[memoryview]]]):
        self._path, self._pieces = path, pieces
        self._ready: dict[Span, list[memoryview]] = {}
        self._last: tuple[Span, list[memoryview]] | None = None

    def open(self, span: Span) -> _PiecesFile:
        if self._last is not None and self._last[0] == span:
            return _PiecesFile(self._last[1])
        while span not in self._ready:
            got = next(self._pieces, None)
            if got is None:
                raise RuntimeError(f"{self._path}: span {span} was not among the spans read")
            self._ready[got[0]] = got[1]
        pieces = self._ready.pop(span)
        have = sum(len(p) for p in pieces)
        if have != span[1]:
            raise InputError(
                str(self._path), f"ends at byte {span[0] + have}, before the index's entry at (offset, length) {span}"
            )
        self._last = (span, pieces)
        return _PiecesFile(pieces)


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
    slices the load asks for are read and hashed on every core ahead of torch's decoding (tensors
    with weights_only), which takes each slice from the chunk buffers as soon as every chunk it
    needs matched its digest (`_SpanSource`); a file an older contract binds by its whole sha256 is
    read whole and matched before any of it is decoded. A file the contract does not bind is never
    read."""

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
        self._source: _SpanSource | None = None  # the data file being decoded (`_read_data`)
        self._source_rel: str | None = None
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
        if not isinstance(file, _Unread) or self._source is None or self._source_rel != file.relative_path:
            raise TypeError("checkpoint data is read through _CheckedReader only")
        return self._source.open((sinfo.offset, sinfo.length))

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            return self._read_data(plan, planner)
        except InputError as exc:
            raise self._refused(exc) from exc.__cause__

    def _read_data(self, plan: Any, planner: Any) -> Any:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)

        fut = None
        # A file the contract binds by chunks (or none binds) is streamed: its chunks are read and
        # hashed on every core ahead of torch's decoding, which takes each tensor's bytes from the
        # checked chunks as they become ready, in file order. A file an older contract binds by its
        # whole sha256 is read whole and checked before any of it is decoded (one file per thread,
        # read ahead).
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
                    items = sorted(items, key=lambda i: self.storage_data[i.storage_index].offset)
                    if rel in ahead:
                        kept = ahead.pop(rel).result()
                        pieces = ((span, [memoryview(data)]) for span, data in kept.items())
                    else:
                        pieces = self._streamed(rel, pins[rel], sorted(set(spans[rel])), chunk_pool)
                    self._source, self._source_rel = _SpanSource(self._root / rel, pieces), rel
                    try:
                        fut = super().read_data(dataclasses.replace(plan, items=items), planner)
                        fut.wait()
                    finally:
                        self._source = self._source_rel = None
                        pieces.close()
            finally:
                for later in ahead.values():
                    later.cancel()
        if fut is None:
            fut = super().read_data(plan, planner)
        return fut

    def _whole_file(self, rel: str, pin: FileBinding, spans: list[Span]) -> dict[Span, bytes]:
        try:
            return read_checked(self._root / rel, pin, spans)
        except FileNotFoundError:
            raise _changed(self._root / rel, "missing") from None

    def _streamed(
        self, rel: str, pin: FileBinding | None, wanted: list[Span], pool: Executor
    ) -> Generator[tuple[Span, list[memoryview]], None, None]:
        """`_checked_pieces` of the data file `rel`, opened (and its size and spans checked) when
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
            yield from _checked_pieces(path, fd, binding, wanted, pool, self._cache, check=pin is not None)
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
    import inspect

    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint.api import CheckpointException

    pins = None if contract is None else bound_files(contract, str(Path(path) / CONTRACT_NAME))
    if not hasattr(mcore_torch, "_get_filesystem_reader") or not hasattr(FileSystemReader, "_slice_file"):
        raise RuntimeError(
            "this megatron-core / torch reads torch_dist checkpoints through other functions than the "
            "checked reader replaces (strategies.torch._get_filesystem_reader, FileSystemReader._slice_file)"
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
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=False, metadata=_OPTIMIZER_METADATA)
    return state


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
    it = loaded.get("iteration")
    return int(it) if it is not None else 0


def _own_adam_steps(optimizer: Any) -> None:
    """Restore torch Adam's per-parameter step count under megatron's distributed optimizer
    (without Transformer Engine / Apex). megatron keeps the step in the checkpoint's param groups
    and writes it into the parameter states as ONE shared tensor, which its 'dp_reshardable'
    parameter-state copy then overwrites with the fresh optimizer's count; torch's Adam also
    increments each state's step in place, so a shared tensor would advance once per parameter.
    Every parameter gets its own tensor holding its group's saved step."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "step" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))


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
