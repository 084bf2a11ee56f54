"""Dataset validation (docs/rules.md#dataset) for JSONL and Parquet, streaming with bounded memory.

Two paths give the same verdict:

* the fast path parses each JSONL line with simdjson (strict JSON: no NaN/Infinity, valid UTF-8;
  duplicate top-level keys are visible in its key list) and takes the number arrays as flat
  buffers; Parquet columns come from pyarrow. The value rules then run with numpy over batches of
  rows (`check_columns`).
* the exact path (`rows.check_row` on the strict stdlib parse) is the reference. Any line the fast
  path cannot judge alone (keys beyond the known five, whose nested duplicates and values it does
  not inspect; anything simdjson rejects, lone surrogate escapes and integers beyond 64 bits
  included; nested brackets; a loss_mask value other than 0/1, 0.0/1.0 or false/true) goes to the
  exact path, and when a batch fails a numpy check, the exact path names the offending line and
  value. Masks of 0.0/1.0 and false/true (Miles accepts them) are read as 0/1 on both paths.

Memory: file bytes are never held beyond one batch (~16 MB) plus one row, and a row is at most
`max_row_bytes` (default 64 MiB): a longer JSONL line is refused after reading that many bytes of it,
never whole (for Parquet the limit applies to the decoded row, after pyarrow decoded its batch). Per row we keep a byte
offset (JSONL), the token length, the active-target count, the
scalar label and a 64-bit hash of the sample id (about 32 bytes a row).

Blank lines are lines of JSON whitespace only (space, tab, CR; RFC 8259): a line holding a form
feed or another Unicode space is not blank, and is refused as invalid JSON like any other line.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, SupportsInt, cast

import numpy as np
import numpy.typing as npt
import simdjson

from value_assets.core.errors import InputError, show
from value_assets.core.manifest import DatasetRef
from value_assets.core.objective import MAX_ABS_VALUE, Objective
from value_assets.core.rows import FIELDS, Row, check_row, format_label
from value_assets.core.strict_json import loads

# pyarrow is imported inside the Parquet functions below: a process that reads JSONL only (a GPU
# job's driver, a Pipes process, the CLI) is spared its ~0.25 s import.
if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

Progress = Callable[[str, int, int], None]  # (phase, done, total)
Facts = tuple[np.ndarray, np.ndarray, np.ndarray]  # per row of a batch: token lengths, active counts, labels

READ_CHUNK = 8 << 20
BATCH_BYTES = 16 << 20
BATCH_ROWS = 8192
PARQUET_BATCH = 2048  # rows; memory per batch stays bounded even for 4k-token rows
# The largest row accepted, in bytes: a JSONL line without its newline; for Parquet the decoded row
# (8 bytes per token, return and mask value, plus the sample_id's UTF-8 bytes). 64 MiB is ~8M tokens
# of JSON, far beyond any context length, while validation memory stays well under 1 GB.
DEFAULT_MAX_ROW_BYTES = 64 << 20
_FIELD_SET = frozenset(FIELDS)
_JSON_WHITESPACE = b" \t\r\n"


@dataclass
class DatasetStats:
    rows: int
    tokens: int
    active_targets: int
    label_counts: dict[str, int]
    max_tokens: int
    min_tokens: int
    mean_tokens: float
    length_quantiles: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "tokens": self.tokens,
            "active_targets": self.active_targets,
            "label_counts": dict(self.label_counts),
            "max_tokens": self.max_tokens,
            "min_tokens": self.min_tokens,
            "mean_tokens": self.mean_tokens,
            "length_quantiles": dict(self.length_quantiles),
        }


def _stats(lengths: np.ndarray, active: np.ndarray, labels: np.ndarray) -> DatasetStats:
    n = int(lengths.shape[0])
    have = labels[~np.isnan(labels)]
    uniq, counts = np.unique(have, return_counts=True)
    q = (
        {name: int(np.percentile(lengths, p, method="lower")) for name, p in (("p50", 50), ("p90", 90), ("p99", 99))}
        if n
        else {}
    )
    return DatasetStats(
        rows=n,
        tokens=int(lengths.sum(dtype=np.int64)),
        active_targets=int(active.sum(dtype=np.int64)),
        label_counts={format_label(u): int(c) for u, c in zip(uniq, counts, strict=True)},
        max_tokens=int(lengths.max()) if n else 0,
        min_tokens=int(lengths.min()) if n else 0,
        mean_tokens=float(lengths.mean()) if n else 0.0,
        length_quantiles=q,
    )


class Dataset:
    """A validated dataset: random access to rows by index, statistics and per-row facts.

    `lengths` (int32 tokens per row), `active_targets` (int32) and `labels` (float64, NaN where a
    row has no single scalar active label) are arrays of length `len(self)`.
    """

    def __init__(
        self,
        *,
        path: Path,
        sha256: str,
        fmt: str,
        objective: Objective,
        split: str,
        lengths: np.ndarray,
        active: np.ndarray,
        labels: np.ndarray,
        offsets: np.ndarray | None = None,
        line_numbers: np.ndarray | None = None,
        row_digests: np.ndarray | None = None,
    ):
        self.path = path
        self.sha256 = sha256
        self.format = fmt
        self.objective = objective
        self.split = split
        self.lengths = lengths
        self.active_targets = active
        self.labels = labels
        self._offsets = offsets
        self._line_numbers = line_numbers
        self._row_digests = row_digests  # JSONL: a digest of each validated line, checked on every read
        self._pq: pq.ParquetFile | None = None
        self._rg_starts: np.ndarray | None = None
        self._rg_cache: tuple[int, list[dict[str, Any]]] | None = None
        self.stats = _stats(lengths, active, labels)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def location(self, index: int) -> str:
        if self.format == "jsonl":
            assert self._line_numbers is not None  # set for every JSONL dataset
            return f"{self.path}:{int(self._line_numbers[index])}"
        return f"{self.path}:row {index}"

    def row(self, index: int) -> Row:
        if not 0 <= index < len(self):
            raise IndexError(f"row index {index} out of range for {self.path} ({len(self)} rows)")
        where = self.location(index)
        if self.format == "jsonl":
            assert self._offsets is not None  # set for every JSONL dataset
            with open(self.path, "rb") as f:
                f.seek(int(self._offsets[index]))
                line = f.readline()
            if self._row_digests is not None and _row_digest(line) != self._row_digests[index]:
                raise InputError(
                    where,
                    "row changed since the dataset was validated (the file was modified while in use); refusing to "
                    "read it",
                )
            return check_row(loads(line, where), where, self.objective)
        return check_row(self._parquet_row(index), where, self.objective)

    def rows(self, indices: Iterable[SupportsInt]) -> list[Row]:
        return [self.row(int(i)) for i in indices]

    def _parquet_row(self, index: int) -> dict[str, Any]:
        import pyarrow.parquet as pq

        if self._pq is None:
            self._pq = pq.ParquetFile(self.path)
            md = self._pq.metadata
            self._rg_starts = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)])
        rg_starts = self._rg_starts
        assert rg_starts is not None  # set with self._pq
        rg = int(np.searchsorted(rg_starts, index, side="right") - 1)
        if self._rg_cache is None or self._rg_cache[0] != rg:
            cols = [c for c in FIELDS if c in self._pq.schema_arrow.names]
            self._rg_cache = (rg, self._pq.read_row_group(rg, columns=cols).to_pylist())
        return self._rg_cache[1][index - int(rg_starts[rg])]


# ----------------------------------------------------------------------------------------------
# Column checks shared by both formats
# ----------------------------------------------------------------------------------------------


@dataclass
class Columns:
    """A batch of rows as flat numpy arrays. `*_len` are per-row lengths, `*_vals` the flat values.

    `mask_present[i]` is False where row i has no loss_mask (all ones).
    """

    ids: list[str]
    t_len: np.ndarray
    t_vals: np.ndarray
    rl: np.ndarray
    r_len: np.ndarray
    r_vals: np.ndarray
    mask_present: np.ndarray
    m_len: np.ndarray
    m_vals: np.ndarray


def _rows_with(flat_bad: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    row_of = np.repeat(np.arange(lengths.shape[0]), lengths)
    out = np.zeros(lengths.shape[0], dtype=bool)
    out[row_of[flat_bad]] = True
    return out


def check_columns(
    c: Columns, objective: Objective, vocab_size: int | None, max_seq_len: int | None
) -> tuple[int, None] | tuple[None, Facts]:
    """docs/rules.md#dataset rules 3-7 with numpy over a batch.

    Returns (first bad row or None, facts) with facts = (token lengths, active counts, labels).
    """
    n = c.rl.shape[0]
    bad = np.zeros(n, dtype=bool)
    bad |= np.fromiter((len(s) == 0 for s in c.ids), dtype=bool, count=n)
    bad |= c.t_len < 2
    tok_bad = c.t_vals < 0
    if vocab_size is not None:
        tok_bad |= c.t_vals >= vocab_size
    if tok_bad.any():
        bad |= _rows_with(tok_bad, c.t_len)
    if max_seq_len is not None:
        bad |= c.t_len > max_seq_len
    bad |= (c.rl < 1) | (c.rl >= c.t_len) | (c.r_len != c.rl)
    rbad = ~np.isfinite(c.r_vals)
    if objective.loss_type == "classification":
        low, high = objective.reward_range
        rbad |= (c.r_vals < low) | (c.r_vals > high)
    else:
        rbad |= np.abs(c.r_vals) > MAX_ABS_VALUE
    if rbad.any():
        bad |= _rows_with(rbad, c.r_len)
    if bad.any():
        return int(np.flatnonzero(bad)[0]), None
    # Present masks: right length, 0/1 values; absent masks are all ones.
    mbad = c.mask_present & (c.m_len != c.rl)
    if mbad.any():
        return int(np.flatnonzero(mbad)[0]), None
    vbad = (c.m_vals != 0) & (c.m_vals != 1)
    if vbad.any():
        return int(np.flatnonzero(_rows_with(vbad, c.m_len))[0]), None
    flat_mask = np.ones(c.r_vals.shape[0], dtype=np.int64)
    if c.mask_present.any():
        r_off = np.concatenate([[0], np.cumsum(c.r_len)])
        rows = np.flatnonzero(c.mask_present)
        lens = c.r_len[rows]
        # Flat positions of every present mask value inside the returns: one range per row.
        run_start = np.concatenate([[0], np.cumsum(lens)[:-1]])
        dst = np.repeat(r_off[rows] - run_start, lens) + np.arange(int(lens.sum()))
        flat_mask[dst] = c.m_vals
    starts = np.concatenate([[0], np.cumsum(c.r_len)[:-1]]).astype(np.int64)
    active = np.add.reduceat(flat_mask, starts) if n else np.zeros(0, dtype=np.int64)
    if np.any(active < 1):
        return int(np.flatnonzero(active < 1)[0]), None
    act = flat_mask.astype(bool)
    hi = np.maximum.reduceat(np.where(act, c.r_vals, -np.inf), starts) if n else np.zeros(0)
    lo = np.minimum.reduceat(np.where(act, c.r_vals, np.inf), starts) if n else np.zeros(0)
    labels = np.where(hi == lo, hi, np.nan)
    return None, (c.t_len, active, labels)


class _Accumulator:
    """Per-row facts of the validated rows, appended batch by batch."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, lengths: np.ndarray, active: np.ndarray, labels: np.ndarray, ids: Sequence[str]) -> None:
        # The ids' hashes find candidate duplicates (`_check_unique_ids` confirms each on the
        # strings). Python's own str hash: in memory only, never stored, so its per-process salt
        # does not matter; 10x faster than pandas' hash_array on 1M ids, and no pandas import.
        self.parts.append(
            (
                np.asarray(lengths, dtype=np.int32),
                np.asarray(active, dtype=np.int32),
                np.asarray(labels, dtype=np.float64),
                np.fromiter(map(hash, ids), dtype=np.int64, count=len(ids)),
            )
        )

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(lengths, active counts, labels, id hashes) of all rows."""
        if not self.parts:
            return np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float64), np.zeros(0, np.int64)
        lengths, active, labels, hashes = zip(*self.parts, strict=True)
        return np.concatenate(lengths), np.concatenate(active), np.concatenate(labels), np.concatenate(hashes)


def _row_facts(row: Row) -> tuple[int, int, float]:
    label = row.label
    return int(row.tokens.shape[0]), row.active_targets, (np.nan if label is None else label)


# ----------------------------------------------------------------------------------------------
# JSONL
# ----------------------------------------------------------------------------------------------


def _hash(path: Path, progress: Progress | None) -> str:
    size = os.path.getsize(path)
    h = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress("hash", done, size)
    return h.hexdigest()


class _JsonlBatch:
    """Rows of one batch: fast-parsed buffers, or exact rows for the lines the fast path deferred."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.toks: list[_Flat] = []
        self.rets: list[_Flat] = []
        self.masks: list[_Flat] = []
        self.rl: list[int] = []
        self.has_mask: list[bool] = []
        self.lines: list[int] = []  # line numbers
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.ids)

    def columns(self) -> Columns:
        def flat(bufs: list[_Flat], dtype: npt.DTypeLike) -> np.ndarray:
            return np.frombuffer(b"".join(bufs), dtype=dtype) if bufs else np.zeros(0, dtype=dtype)

        t_len = np.fromiter((len(b) for b in self.toks), dtype=np.int64, count=len(self.toks))
        r_len = np.fromiter((len(b) for b in self.rets), dtype=np.int64, count=len(self.rets))
        present = np.asarray(self.has_mask, dtype=bool)
        m_len = np.zeros(len(self.ids), dtype=np.int64)
        m_len[present] = [len(b) for b in self.masks]
        return Columns(
            ids=self.ids,
            t_len=t_len,
            t_vals=flat(self.toks, np.int64),
            rl=np.asarray(self.rl, dtype=np.int64),
            r_len=r_len,
            r_vals=flat(self.rets, np.float64),
            mask_present=present,
            m_len=m_len,
            m_vals=flat(self.masks, np.int64),
        )


def _mask_buffer(arr: simdjson.Array) -> bytes | None:
    """A loss_mask array as int64 bytes; 0.0/1.0 and false/true read as 0/1 (Miles' loader does).
    None (exact path) when it holds anything else but ints: ints are judged by `check_columns`."""
    # Dispatch on the first element: a failed as_buffer costs as much as a successful one.
    first = type(arr[0]) if len(arr) else int
    if first is int:
        try:
            return bytes(arr.as_buffer(of_type="i"))
        except TypeError:
            pass  # ints mixed with floats or bools
    vals: np.ndarray | None = None
    if first is not bool:
        try:
            vals = np.frombuffer(arr.as_buffer(of_type="d"), dtype=np.float64)
        except TypeError:
            pass
    if vals is None:  # bools, or bools mixed with numbers; strings and nulls give other dtypes
        vals = np.asarray(arr.as_list())
        if vals.dtype.kind not in "biuf":
            return None
    if np.any((vals != 0) & (vals != 1)):
        return None  # 0.5, 2.0, NaN: the exact path names the value
    return vals.astype(np.int64).tobytes()


def _fast_parse(line: bytes) -> tuple[str, bytes, int, bytes, bytes | None] | None:
    """(sample_id, tokens, response_length, returns, mask or None) as buffers, or None to defer to the exact path."""
    if line[:1] != b"{":
        return None  # leading whitespace, a BOM or not an object: rare, judged exactly
    try:
        # A document that starts with "{" and parses is an object.
        obj = cast(simdjson.Object, simdjson.Parser().parse(line))
        keys = obj.keys()
        key_list = list(keys)
        if len(key_list) != len(set(key_list)) or not _FIELD_SET.issuperset(key_list):
            return None  # duplicates or extra keys: the exact path judges the whole line
        has_mask = "loss_mask" in key_list
        if line.count(b"[") != 2 + has_mask:
            return None  # nested arrays, or brackets inside strings
        sid = obj["sample_id"]
        rl = obj["response_length"]
        if type(sid) is not str or type(rl) is not int:
            return None
        # Only an Array has as_buffer: any other value raised AttributeError here, i.e. gave None.
        tok_arr = obj["tokens"]
        if not isinstance(tok_arr, simdjson.Array):
            return None
        toks = bytes(tok_arr.as_buffer(of_type="i"))
        ret_arr = obj["returns"]
        if not isinstance(ret_arr, simdjson.Array):
            return None
        rets = bytes(ret_arr.as_buffer(of_type="d"))
        mask = None
        if has_mask:
            mask_arr = obj["loss_mask"]
            if not isinstance(mask_arr, simdjson.Array):
                return None  # _mask_buffer of any other value raises or returns None
            mask = _mask_buffer(mask_arr)
            if mask is None:
                return None
        return sid, toks, rl, rets, mask
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, UnicodeDecodeError):
        return None


def _row_digest(line: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(line, digest_size=8).digest(), "little")


def _too_long(where: str, max_row_bytes: int, what: str) -> InputError:
    return InputError(
        where,
        f"{what} is longer than the maximum row size of {max_row_bytes} bytes ({max_row_bytes / 2**20:g} MiB); "
        "raise the limit with max_row_bytes= (command line: --max-row-bytes) if such rows are intended",
    )


def _validate_jsonl(
    path: Path,
    objective: Objective,
    vocab_size: int | None,
    max_seq_len: int | None,
    max_row_bytes: int,
    progress: Progress | None,
) -> tuple[_Accumulator, np.ndarray, np.ndarray, np.ndarray]:
    acc = _Accumulator()
    offsets: list[int] = []
    digests: list[int] = []
    line_numbers: list[int] = []
    size = os.path.getsize(path)

    def exact(line: bytes, lineno: int) -> Row:
        where = f"{path}:{lineno}"
        return check_row(loads(line, where), where, objective, vocab_size=vocab_size, max_seq_len=max_seq_len)

    def flush(batch: _JsonlBatch, lines_by_index: list[bytes]) -> None:
        if not len(batch):
            return
        bad, facts = check_columns(batch.columns(), objective, vocab_size, max_seq_len)
        if bad is not None:
            exact(lines_by_index[bad], batch.lines[bad])
            raise InputError(f"{path}:{batch.lines[bad]}", "row breaks a dataset rule (columnar check)")
        assert facts is not None  # check_columns gives facts whenever no row is bad
        acc.add(*facts, batch.ids)

    batch = _JsonlBatch()
    raw: list[bytes] = []
    pos = 0
    lineno = 0
    with open(path, "rb") as f:
        # readline(limit + 1): a line of at most max_row_bytes plus its "\n" is read whole; a longer
        # one is refused after max_row_bytes + 1 bytes, without reading the rest of it.
        while line := f.readline(max_row_bytes + 1):
            lineno += 1
            if len(line) > max_row_bytes and line[-1:] != b"\n":
                raise _too_long(f"{path}:{lineno}", max_row_bytes, "line")
            start = pos
            pos += len(line)
            if line[:1] != b"{" and not line.strip(_JSON_WHITESPACE):
                continue  # blank lines are skipped and not counted
            offsets.append(start)
            digests.append(_row_digest(line))
            line_numbers.append(lineno)
            mask: bytes | None
            parsed = _fast_parse(line)
            if parsed is None:
                row = exact(line, lineno)  # raises with the located message, or accepts the row
                sid, toks, rl, rets = row.sample_id, row.tokens.tobytes(), row.response_length, row.returns.tobytes()
                mask = row.loss_mask.astype(np.int64).tobytes()
            else:
                sid, toks, rl, rets, mask = parsed
            batch.ids.append(sid)
            batch.toks.append(_Flat(toks, 8))
            batch.rets.append(_Flat(rets, 8))
            batch.rl.append(rl)
            batch.has_mask.append(mask is not None)
            if mask is not None:
                batch.masks.append(_Flat(mask, 8))
            batch.lines.append(lineno)
            raw.append(line)
            batch.nbytes += len(line)
            if batch.nbytes >= BATCH_BYTES or len(batch) >= BATCH_ROWS:
                flush(batch, raw)
                batch, raw = _JsonlBatch(), []
                if progress:
                    progress("validate", pos, size)
    flush(batch, raw)
    if progress:
        progress("validate", size, size)
    return (
        acc,
        np.asarray(offsets, dtype=np.int64),
        np.asarray(line_numbers, dtype=np.int64),
        np.asarray(digests, dtype=np.uint64),
    )


class _Flat(bytes):
    """Raw little-endian 8-byte values whose len() is the element count."""

    _n: int

    def __new__(cls, data: bytes, itemsize: int) -> _Flat:
        obj = super().__new__(cls, data)
        obj._n = len(data) // itemsize
        return obj

    def __len__(self) -> int:  # element count, used for per-row lengths
        return self._n


# ----------------------------------------------------------------------------------------------
# Parquet
# ----------------------------------------------------------------------------------------------


def _decoded_type(t: pa.DataType) -> pa.DataType:
    """The value type of a dictionary-encoded column (pandas categorical); any other type as is."""
    import pyarrow as pa

    return t.value_type if pa.types.is_dictionary(t) else t


def _parquet_schema_error(schema: pa.Schema) -> str | None:
    import pyarrow as pa

    def list_of(t: pa.DataType, *kinds: Callable[[pa.DataType], bool]) -> bool:
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
            return False
        return any(kind(t.value_type) for kind in kinds)

    names = schema.names
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        return (
            f"duplicate column name(s) {show(dups)} (refused: a reader picking one of them would silently ignore the "
            "other)"
        )
    for req in ("sample_id", "tokens", "response_length", "returns"):
        if req not in names:
            return f"missing column {req!r} (columns: {show(names, 200)})"
    t = _decoded_type(schema.field("sample_id").type)
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        return f"column sample_id must be string, got {schema.field('sample_id').type}"
    if not list_of(schema.field("tokens").type, pa.types.is_integer):
        return f"column tokens must be list<int> (floats are never token ids), got {schema.field('tokens').type}"
    if not pa.types.is_integer(_decoded_type(schema.field("response_length").type)):
        return f"column response_length must be int, got {schema.field('response_length').type}"
    if not list_of(schema.field("returns").type, pa.types.is_integer, pa.types.is_floating):
        return f"column returns must be list<float>, got {schema.field('returns').type}"
    # Miles reads 0.0/1.0 and false/true as 0/1: float and bool masks are accepted, values checked.
    if "loss_mask" in names and not list_of(
        schema.field("loss_mask").type, pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean
    ):
        return (
            "column loss_mask must be list<int> (or list<bool>, list<float> of 0/1), got "
            f"{schema.field('loss_mask').type}"
        )
    return None


def _list_np(
    arr: pa.Array, dtype: npt.DTypeLike | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(row lengths, flat values, row-is-null or None, value-is-null or None) of a list column.
    `dtype` None keeps the column's own value type."""
    import pyarrow as pa

    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    offsets = arr.offsets.to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    flat = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    vnull = flat.is_null().to_numpy(zero_copy_only=False) if flat.null_count else None
    rnull = arr.is_null().to_numpy(zero_copy_only=False) if arr.null_count else None
    if flat.null_count:
        flat = flat.fill_null(0)
    if not len(flat):
        return lengths, np.zeros(0, dtype=dtype or np.int64), rnull, vnull
    vals = flat.to_numpy(zero_copy_only=False)
    return lengths, (vals if dtype is None else vals.astype(dtype, copy=False)), rnull, vnull


def _sample_ids(col: pa.Array, path: Path, row0: int) -> list[str | None]:
    """The column's values: strings, None for a null cell."""
    import pyarrow as pa

    try:
        return cast("list[str | None]", col.to_pylist())  # a string column (_parquet_schema_error)
    except UnicodeDecodeError:  # Parquet does not guarantee valid UTF-8 in a string column
        for k in range(len(col)):
            try:
                col[k].as_py()
            except UnicodeDecodeError:
                raw = col.slice(k, 1).cast(pa.binary())[0].as_py()
                raise InputError(f"{path}:row {row0 + k}", f"sample_id is not valid UTF-8: {show(raw)}") from None
        raise


def _iter_parquet(pf: pq.ParquetFile, path: Path, columns: list[str]) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(first row, batch) of the file in PARQUET_BATCH-row batches; a page that cannot be read or
    decoded (corrupt bytes under a matching sha) is a located InputError, not a pyarrow exception."""
    import pyarrow as pa

    batches = pf.iter_batches(batch_size=PARQUET_BATCH, columns=columns)
    row0 = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as exc:
            raise InputError(
                f"{path}:row {row0}",
                f"cannot read the Parquet data from this row on (corrupt file?): "
                f"{type(exc).__name__}: {show(str(exc), 200)}",
            ) from None
        yield row0, batch
        row0 += batch.num_rows


def _validate_parquet(
    path: Path,
    objective: Objective,
    vocab_size: int | None,
    max_seq_len: int | None,
    max_row_bytes: int,
    progress: Progress | None,
) -> _Accumulator:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(
            str(path), f"not a readable Parquet file: {type(exc).__name__}: {show(str(exc), 200)}"
        ) from None
    err = _parquet_schema_error(pf.schema_arrow)
    if err:
        raise InputError(str(path), err)
    present_cols = [c for c in FIELDS if c in pf.schema_arrow.names]
    acc = _Accumulator()
    total = pf.metadata.num_rows

    def exact(batch: pa.RecordBatch, k: int) -> NoReturn:
        where = f"{path}:row {row0 + k}"
        check_row(batch.slice(k, 1).to_pylist()[0], where, objective, vocab_size=vocab_size, max_seq_len=max_seq_len)
        raise InputError(where, "row breaks a dataset rule (columnar check)")

    for row0, batch in _iter_parquet(pf, path, present_cols):
        n = batch.num_rows
        col = {name: batch.column(i) for i, name in enumerate(batch.schema.names)}
        for name in ("sample_id", "response_length"):
            if pa.types.is_dictionary(col[name].type):
                col[name] = col[name].dictionary_decode()
        maybe_ids = _sample_ids(col["sample_id"], path, row0)
        # Rows the columns cannot judge alone (nulls, non-0/1 float masks) go to the exact check.
        nulls = np.zeros(n, dtype=bool)
        for name in ("sample_id", "response_length"):
            if col[name].null_count:
                nulls |= col[name].is_null().to_numpy(zero_copy_only=False)
        t_len, t_vals, t_rn, t_vn = _list_np(col["tokens"], np.int64)
        r_len, r_vals, r_rn, r_vn = _list_np(col["returns"], np.float64)
        for rn, vn, lens in ((t_rn, t_vn, t_len), (r_rn, r_vn, r_len)):
            if rn is not None:
                nulls |= rn
            if vn is not None:
                nulls |= _rows_with(vn, lens)
        if "loss_mask" in col:
            # A null cell in a present column is an explicit null, not an absent mask.
            m_len, m_vals, m_rn, m_vn = _list_np(col["loss_mask"], None)
            if m_rn is not None:
                nulls |= m_rn
            if m_vn is not None:
                nulls |= _rows_with(m_vn, m_len)
            if m_vals.dtype.kind == "f":
                nonbinary = (m_vals != 0) & (m_vals != 1)  # 0.5 must not truncate to 0
                nulls |= _rows_with(nonbinary, m_len)
                m_vals = np.where(nonbinary, 0, m_vals)
            m_vals = m_vals.astype(np.int64)
            present = np.ones(n, dtype=bool)
        else:
            m_len, m_vals, present = np.zeros(n, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(n, dtype=bool)
        if nulls.any():
            exact(batch, int(np.flatnonzero(nulls)[0]))
        ids = cast("list[str]", maybe_ids)  # a row with a null sample_id was refused just above
        id_bytes = pc.binary_length(col["sample_id"]).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        too_big = 8 * (t_len + r_len + m_len) + id_bytes > max_row_bytes
        if too_big.any():
            raise _too_long(f"{path}:row {row0 + int(np.flatnonzero(too_big)[0])}", max_row_bytes, "the decoded row")
        rl_arr = col["response_length"].to_numpy().astype(np.int64)
        bad, facts = check_columns(
            Columns(
                ids=ids,
                t_len=t_len,
                t_vals=t_vals,
                rl=rl_arr,
                r_len=r_len,
                r_vals=r_vals,
                mask_present=present,
                m_len=m_len,
                m_vals=m_vals,
            ),
            objective,
            vocab_size,
            max_seq_len,
        )
        if bad is not None:
            exact(batch, bad)
        assert facts is not None  # check_columns gives facts whenever no row is bad
        acc.add(*facts, ids)
        if progress:
            progress("validate", row0 + n, total)
    return acc


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def sniff_format(path: Path) -> str:
    with open(path, "rb") as f:
        return "parquet" if f.read(4) == b"PAR1" else "jsonl"


def validate_dataset(
    ref: DatasetRef,
    objective: Objective,
    *,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    progress: Progress | None = None,
) -> Dataset:
    """Run every docs/rules.md#dataset check on one split; return the validated dataset or raise InputError.

    `max_row_bytes` bounds one row (see DEFAULT_MAX_ROW_BYTES); a longer row is refused, located.
    """
    if not (isinstance(max_row_bytes, int) and not isinstance(max_row_bytes, bool) and max_row_bytes >= 1):
        raise InputError("max_row_bytes", f"must be an integer >= 1, got {show(max_row_bytes)}")
    path = ref.path
    try:
        return _validate(ref, objective, vocab_size, max_seq_len, max_row_bytes, progress)
    except OSError as exc:  # permission denied, a name too long, an I/O error: the file cannot be read
        raise InputError(str(path), f"cannot read the {ref.split} dataset: {exc.strerror or exc}") from None


def _validate(
    ref: DatasetRef,
    objective: Objective,
    vocab_size: int | None,
    max_seq_len: int | None,
    max_row_bytes: int,
    progress: Progress | None,
) -> Dataset:
    path = ref.path
    if not path.exists():
        raise InputError(
            str(path), f"{ref.split} dataset does not exist (manifest path {show(ref.declared_path, 200)})"
        )
    if not path.is_file():
        raise InputError(str(path), f"{ref.split} dataset is not a regular file")
    sha = _hash(path, progress)
    if sha != ref.sha256:
        raise InputError(str(path), f"sha256 is {sha}, but the manifest pins {ref.sha256} for {ref.split}")
    fmt = sniff_format(path)
    offsets: np.ndarray | None = None
    line_numbers: np.ndarray | None = None
    digests: np.ndarray | None = None
    if fmt == "jsonl":
        acc, offsets, line_numbers, digests = _validate_jsonl(
            path, objective, vocab_size, max_seq_len, max_row_bytes, progress
        )
    else:
        acc = _validate_parquet(path, objective, vocab_size, max_seq_len, max_row_bytes, progress)
    lengths, active, labels, hashes = acc.finish()
    ds = Dataset(
        path=path,
        sha256=sha,
        fmt=fmt,
        objective=objective,
        split=ref.split,
        lengths=lengths,
        active=active,
        labels=labels,
        offsets=offsets,
        line_numbers=line_numbers,
        row_digests=digests,
    )
    _check_unique_ids(ds, hashes)
    if len(ds) != ref.num_samples:
        raise InputError(
            str(path), f"has {len(ds)} rows, but the manifest says num_samples = {ref.num_samples} for {ref.split}"
        )
    return ds


def _check_unique_ids(ds: Dataset, hashes: np.ndarray) -> None:
    if hashes.shape[0] < 2:
        return
    order = np.argsort(hashes, kind="stable")
    sh = hashes[order]
    same = np.flatnonzero(sh[1:] == sh[:-1])
    if same.size == 0:
        return
    # Hash matches are confirmed on the exact strings; the later row of a pair is reported.
    first_seen: dict[str, int] = {}
    for i in sorted(set(order[same].tolist()) | set(order[same + 1].tolist())):
        sid = ds.row(i).sample_id
        if sid in first_seen:
            raise InputError(
                ds.location(i), f"duplicate sample_id {show(sid)} (first at {ds.location(first_seen[sid])})"
            )
        first_seen[sid] = i
