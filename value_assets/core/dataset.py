"""Dataset validation (SPEC 2) for JSONL and Parquet, streaming with bounded memory.

Two paths give the same verdict:

* the columnar path (pyarrow) checks whole batches with numpy: this is what runs normally;
* the exact path (`rows.check_row` on strictly parsed JSON) is the reference. The columnar path
  falls back to it to name the offending line and value whenever a batch fails a check, and for
  the few lines the columnar reader cannot judge on its own (lines with keys beyond the known five,
  whose duplicates and NaNs pyarrow ignores; lines containing NaN/Infinity literals; explicit
  `"loss_mask": null`, which pyarrow cannot tell from an absent mask).

Memory: file bytes are never held; per row we keep a byte offset (JSONL), the token length, the
active-target count, the scalar label and a 64-bit hash of the sample id (about 32 bytes a row).
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from .errors import InputError, show
from .manifest import DatasetRef
from .objective import Objective
from .rows import FIELDS, Row, check_row, format_label
from .strict_json import loads

Progress = Callable[[str, int, int], None]  # (phase, done_bytes, total_bytes)

READ_CHUNK = 8 << 20
ARROW_BLOCK = 8 << 20
PARQUET_BATCH = 32768

_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("tokens", pa.list_(pa.int64())),
        ("response_length", pa.int64()),
        ("returns", pa.list_(pa.float64())),
        ("loss_mask", pa.list_(pa.int64())),
    ]
)
_REQUIRED_KEYS = 4  # sample_id, tokens, response_length, returns; loss_mask adds one


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


class _Columns:
    """Per-row facts gathered during validation, appended batch by batch."""

    def __init__(self) -> None:
        self.lengths: list[np.ndarray] = []
        self.active: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []
        self.id_hashes: list[np.ndarray] = []

    def add(self, lengths, active, labels, ids: np.ndarray) -> None:
        self.lengths.append(np.asarray(lengths, dtype=np.int32))
        self.active.append(np.asarray(active, dtype=np.int32))
        self.labels.append(np.asarray(labels, dtype=np.float64))
        self.id_hashes.append(pd.util.hash_array(np.asarray(ids, dtype=object)))

    def finish(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        def cat(parts, dtype):
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        return cat(self.lengths, np.int32), cat(self.active, np.int32), cat(self.labels, np.float64), cat(self.id_hashes, np.uint64)


class Dataset:
    """A validated dataset: random access to rows by index, statistics, per-row facts.

    `lengths` (int32), `active_targets` (int32) and `labels` (float64, NaN where a row has no single
    scalar label) are arrays of length `len(self)`.
    """

    def __init__(self, *, path: Path, sha256: str, fmt: str, objective: Objective, split: str,
                 lengths: np.ndarray, active: np.ndarray, labels: np.ndarray,
                 offsets: np.ndarray | None = None, line_numbers: np.ndarray | None = None):
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
        self._pq: pq.ParquetFile | None = None
        self._rg_cache: tuple[int, list[dict]] | None = None
        self._rg_starts: np.ndarray | None = None
        self.stats = _stats(lengths, active, labels)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def location(self, index: int) -> str:
        if self.format == "jsonl":
            return f"{self.path}:{int(self._line_numbers[index])}"
        return f"{self.path}:row {index}"

    def row(self, index: int) -> Row:
        if not 0 <= index < len(self):
            raise IndexError(f"row index {index} out of range for {self.path} ({len(self)} rows)")
        if self.format == "jsonl":
            with open(self.path, "rb") as f:
                f.seek(int(self._offsets[index]))
                line = f.readline()
            return check_row(loads(line, self.location(index)), self.location(index), self.objective)
        return check_row(self._parquet_row(index), self.location(index), self.objective)

    def rows(self, indices) -> list[Row]:
        return [self.row(int(i)) for i in indices]

    def _parquet_row(self, index: int) -> dict:
        if self._pq is None:
            self._pq = pq.ParquetFile(self.path)
            md = self._pq.metadata
            self._rg_starts = np.cumsum([0] + [md.row_group(i).num_rows for i in range(md.num_row_groups)])
        rg = int(np.searchsorted(self._rg_starts, index, side="right") - 1)
        if self._rg_cache is None or self._rg_cache[0] != rg:
            cols = [c for c in FIELDS if c in self._pq.schema_arrow.names]
            self._rg_cache = (rg, self._pq.read_row_group(rg, columns=cols).to_pylist())
        return self._rg_cache[1][index - int(self._rg_starts[rg])]


def _stats(lengths: np.ndarray, active: np.ndarray, labels: np.ndarray) -> DatasetStats:
    n = int(lengths.shape[0])
    have = labels[~np.isnan(labels)]
    uniq, counts = np.unique(have, return_counts=True)
    q = {}
    if n:
        for name, p in (("p50", 50), ("p90", 90), ("p99", 99)):
            q[name] = int(np.percentile(lengths, p, method="lower"))
    return DatasetStats(
        rows=n,
        tokens=int(lengths.sum(dtype=np.int64)),
        active_targets=int(active.sum(dtype=np.int64)),
        label_counts={format_label(u): int(c) for u, c in zip(uniq, counts)},
        max_tokens=int(lengths.max()) if n else 0,
        min_tokens=int(lengths.min()) if n else 0,
        mean_tokens=float(lengths.mean()) if n else 0.0,
        length_quantiles=q,
    )


def _row_facts(row: Row) -> tuple[int, int, float]:
    label = row.label
    return int(row.tokens.shape[0]), row.active_targets, (np.nan if label is None else label)


def sniff_format(path: Path) -> str:
    with open(path, "rb") as f:
        head = f.read(4)
    return "parquet" if head == b"PAR1" else "jsonl"


# ----------------------------------------------------------------------------------------------
# JSONL
# ----------------------------------------------------------------------------------------------


@dataclass
class _Scan:
    """What the first (hashing) pass learns about a JSONL file."""

    sha256: str
    size: int
    offsets: np.ndarray  # byte offset of every non-blank line, int64
    line_numbers: np.ndarray  # its 1-based line number, int64
    utf8_error: int | None  # byte offset of the first invalid UTF-8 sequence
    colons: int
    loss_mask_literals: int
    constant_positions: list[int] = field(default_factory=list)  # NaN / Infinity literals


def _scan_jsonl(path: Path, progress: Progress | None) -> _Scan:
    size = os.path.getsize(path)
    h = hashlib.sha256()
    starts: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
    firsts: list[np.ndarray] = []
    pending = True  # the first byte of the line starting at `pos` is in the next chunk
    colons = 0
    mask_lits = 0
    consts: list[int] = []
    utf8_error = None
    decoder = None
    pos = 0
    tail = b""
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            h.update(chunk)
            arr = np.frombuffer(chunk, dtype=np.uint8)
            if pending:
                firsts.append(arr[:1])
                pending = False
            nl = np.flatnonzero(arr == 10)
            inner = nl[nl + 1 < arr.shape[0]]
            starts.append(inner.astype(np.int64) + 1 + pos)
            firsts.append(arr[inner + 1])
            if nl.shape[0] and nl[-1] == arr.shape[0] - 1:
                starts.append(np.array([pos + arr.shape[0]], dtype=np.int64))
                pending = True
            colons += chunk.count(b":")
            # Literals split across chunk boundaries are found in the stitched window.
            window = tail + chunk[:16]
            mask_lits += chunk.count(b'"loss_mask"') + window.count(b'"loss_mask"')
            for lit in (b"NaN", b"Infinity"):
                for buf, base in ((chunk, pos), (window, pos - len(tail))):
                    i = buf.find(lit)
                    while i != -1:
                        consts.append(base + i)
                        i = buf.find(lit, i + 1)
            if utf8_error is None and (decoder is not None or not chunk.isascii()):
                if decoder is None:
                    decoder = codecs.getincrementaldecoder("utf-8")()
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as exc:
                    utf8_error = max(pos + exc.start, 0)
            tail = chunk[-16:]
            pos += len(chunk)
            if progress:
                progress("hash", pos, size)
        if decoder is not None and utf8_error is None:
            try:
                decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                utf8_error = max(pos - 1, 0)
    all_starts = np.concatenate(starts)
    if pending:  # the file ends with a newline (or is empty): no line starts at `size`
        all_starts = all_starts[:-1]
    first = np.concatenate(firsts) if firsts else np.zeros(0, dtype=np.uint8)
    line_numbers = np.arange(1, all_starts.shape[0] + 1, dtype=np.int64)
    keep = np.ones(all_starts.shape[0], dtype=bool)
    # Lines that start with '{' are not blank; the rare others are read to tell.
    suspicious = np.flatnonzero(first != ord("{"))
    if suspicious.size:
        with open(path, "rb") as f:
            for k in suspicious:
                f.seek(int(all_starts[k]))
                if f.readline().strip() == b"":
                    keep[k] = False
    return _Scan(
        sha256=h.hexdigest(), size=size, offsets=all_starts[keep], line_numbers=line_numbers[keep],
        utf8_error=utf8_error, colons=colons, loss_mask_literals=mask_lits,
        constant_positions=sorted(set(consts)),
    )

class _JsonlValidator:
    def __init__(self, path: Path, objective: Objective, vocab_size, max_seq_len, scan: _Scan, progress):
        self.path = path
        self.objective = objective
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.scan = scan
        self.progress = progress

    def where(self, k: int) -> str:
        return f"{self.path}:{int(self.scan.line_numbers[k])}"

    def read_line(self, k: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(int(self.scan.offsets[k]))
            return f.readline()

    def exact_row(self, k: int) -> Row:
        where = self.where(k)
        return check_row(loads(self.read_line(k), where), where, self.objective, vocab_size=self.vocab_size, max_seq_len=self.max_seq_len)

    def line_of_byte(self, offset: int) -> int:
        return int(np.searchsorted(self.scan.offsets, offset, side="right") - 1)

    def exact_all(self) -> _Columns:
        """The reference path: every line strictly parsed and checked in Python."""
        cols = _Columns()
        buf: list[tuple] = []
        for k in range(self.scan.offsets.shape[0]):
            row = self.exact_row(k)
            buf.append((*_row_facts(row), row.sample_id))
            if len(buf) >= 4096:
                cols.add(*map(list, zip(*buf)))
                buf = []
        if buf:
            cols.add(*map(list, zip(*buf)))
        return cols

    def run(self) -> _Columns:
        if self.scan.utf8_error is not None:
            k = max(self.line_of_byte(self.scan.utf8_error), 0)
            self.exact_row(k)  # names the line; the decoder found bad bytes in it
            raise InputError(self.where(k), f"invalid UTF-8 at byte offset {self.scan.utf8_error}")
        # Lines the columnar reader cannot judge alone get the strict parser first.
        for pos in self.scan.constant_positions:
            k = self.line_of_byte(pos)
            if k >= 0:
                loads(self.read_line(k), self.where(k))
        try:
            cols, nonnull_masks, null_mask_rows = self.columnar()
        except _Anomaly as anomaly:
            return self.resolve(anomaly)
        n = self.scan.offsets.shape[0]
        expected_colons = _REQUIRED_KEYS * n + nonnull_masks
        if self.scan.colons != expected_colons:
            self.check_extra_keys()
        if self.scan.loss_mask_literals != nonnull_masks:
            for k in null_mask_rows:
                self.exact_row(int(k))
        return cols

    def resolve(self, anomaly: "_Anomaly") -> _Columns:
        # Candidate lines are checked exactly first: a real error there is a real error wherever
        # batch boundaries fell. Then the rest of the file from the failing batch, then all of it
        # (an earlier line holding two JSON values shifts rows against lines).
        n = self.scan.offsets.shape[0]
        for k in anomaly.candidates():
            if 0 <= k < n:
                self.exact_row(k)
        if anomaly.row is not None:
            for k in range(max(anomaly.row, 0), n):
                self.exact_row(k)
        return self.exact_all()

    def check_extra_keys(self) -> None:
        """Strictly parse the lines that hold colons beyond their known keys (extra keys)."""
        per_line = np.zeros(self.scan.offsets.shape[0], dtype=np.int64)
        with open(self.path, "rb") as f:
            pos = 0
            while chunk := f.read(READ_CHUNK):
                c = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 58) + pos
                idx = np.searchsorted(self.scan.offsets, c, side="right") - 1
                np.add.at(per_line, idx[idx >= 0], 1)
                pos += len(chunk)
        for k in np.flatnonzero(per_line > _REQUIRED_KEYS):
            line = self.read_line(int(k))
            if per_line[k] > _REQUIRED_KEYS + (1 if b'"loss_mask"' in line else 0):
                loads(line, self.where(int(k)))

    def columnar(self) -> tuple[_Columns, int, list[int]]:
        ropts = pj.ReadOptions(block_size=ARROW_BLOCK, use_threads=True)
        popts = pj.ParseOptions(explicit_schema=_SCHEMA, unexpected_field_behavior="ignore")
        cols = _Columns()
        row0 = 0
        nonnull_masks = 0
        null_mask_rows: list[int] = []
        try:
            reader = pj.open_json(self.path, read_options=ropts, parse_options=popts)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise _Anomaly(0, str(exc)) from None
        n_lines = self.scan.offsets.shape[0]
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, UnicodeDecodeError) as exc:
                raise _Anomaly(row0, str(exc), batch_start=row0) from None
            if row0 + batch.num_rows > n_lines:
                raise _Anomaly(None, "more JSON values than lines")
            facts, bad, msg = check_batch(batch, self.objective, self.vocab_size, self.max_seq_len)
            if bad is not None:
                raise _Anomaly(row0 + bad, msg)
            lengths, active, labels, ids, mask_null = facts
            nonnull_masks += int(batch.num_rows - mask_null.sum())
            null_mask_rows.extend((np.flatnonzero(mask_null) + row0).tolist())
            cols.add(lengths, active, labels, ids)
            row0 += batch.num_rows
            if self.progress:
                self.progress("validate", int(self.scan.offsets[min(row0, n_lines - 1)]) if n_lines else 0, self.scan.size)
        if row0 != n_lines:
            raise _Anomaly(None, f"{row0} JSON values for {n_lines} lines")
        return cols, nonnull_masks, null_mask_rows


class _Anomaly(Exception):
    """The columnar path could not accept a batch; `row` is the first row of concern."""

    def __init__(self, row: int | None, message: str, batch_start: int | None = None):
        self.row = row
        self.message = message
        self.batch_start = batch_start

    def candidates(self) -> list[int]:
        out = [] if self.row is None else [self.row]
        m = re.search(r"in row (\d+)", self.message)
        if m and self.batch_start is not None:
            out.append(self.batch_start + int(m.group(1)))
        return out


def _list_parts(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(lengths int64, flat values, value nulls, row nulls) of a list array."""
    arr = arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr
    offsets = arr.offsets.to_numpy()
    lengths = np.diff(offsets).astype(np.int64)
    flat = arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    return lengths, flat, flat.null_count, arr.null_count


def check_batch(batch: pa.RecordBatch, objective: Objective, vocab_size, max_seq_len):
    """Columnar SPEC 2 rules 3-7 on one batch.

    Returns (facts, bad_row, message): facts = (lengths, active, labels, sample ids, mask-is-null),
    or bad_row = the index within the batch of the first row a rule rejects (None when all pass).
    """
    n = batch.num_rows
    bad = np.zeros(n, dtype=bool)
    names = batch.schema.names

    def col(name):
        return batch.column(names.index(name))

    sid = col("sample_id")
    if sid.null_count:
        bad |= sid.is_null().to_numpy(zero_copy_only=False)
    sid_filled = sid.fill_null("")
    bad |= pc.equal(pc.utf8_length(sid_filled), 0).to_numpy(zero_copy_only=False)

    tok = col("tokens")
    if tok.null_count:
        return None, int(np.flatnonzero(tok.is_null().to_numpy(zero_copy_only=False))[0]), "tokens is null or missing"
    t_len, t_vals, t_vnull, _ = _list_parts(tok)
    if t_vnull:
        return None, _first_row_with(t_vals.is_null().to_numpy(zero_copy_only=False), t_len), "null token id"
    tv = t_vals.to_numpy()
    bad |= t_len < 2
    tok_bad = tv < 0
    if vocab_size is not None:
        tok_bad |= tv >= vocab_size
    if tok_bad.any():
        bad |= _rows_with(tok_bad, t_len)
    if max_seq_len is not None:
        bad |= t_len > max_seq_len

    rl_arr = col("response_length")
    if rl_arr.null_count:
        return None, int(np.flatnonzero(rl_arr.is_null().to_numpy(zero_copy_only=False))[0]), "response_length is null or missing"
    rl = rl_arr.to_numpy()
    bad |= (rl < 1) | (rl >= t_len)

    ret = col("returns")
    if ret.null_count:
        return None, int(np.flatnonzero(ret.is_null().to_numpy(zero_copy_only=False))[0]), "returns is null or missing"
    r_len, r_vals, r_vnull, _ = _list_parts(ret)
    if r_vnull:
        return None, _first_row_with(r_vals.is_null().to_numpy(zero_copy_only=False), r_len), "null return"
    bad |= r_len != rl
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        return None, k, "row rule broken"
    rv = r_vals.to_numpy()
    rbad = ~np.isfinite(rv)
    if objective.loss_type == "classification":
        low, high = objective.reward_range
        rbad |= (rv < low) | (rv > high)
    if rbad.any():
        return None, _first_row_with(rbad, r_len), "return out of range or not finite"

    if "loss_mask" in names:
        m = col("loss_mask")
        mask_null = m.is_null().to_numpy(zero_copy_only=False)
        m_len, m_vals, m_vnull, _ = _list_parts(m.fill_null([]) if m.null_count else m)
        if m_vnull:
            return None, _first_row_with(m_vals.is_null().to_numpy(zero_copy_only=False), m_len), "null in loss_mask"
        mv = m_vals.to_numpy()
        present = ~mask_null
        if np.any(present & (m_len != rl)):
            return None, int(np.flatnonzero(present & (m_len != rl))[0]), "loss_mask length"
        mbad = (mv != 0) & (mv != 1)
        if mbad.any():
            return None, _first_row_with(mbad, m_len), "loss_mask value"
        # Absent masks are all ones: build one flat mask aligned with the returns.
        flat_mask = np.ones(rv.shape[0], dtype=np.int64)
        r_off = np.concatenate([[0], np.cumsum(r_len)])
        m_off = np.concatenate([[0], np.cumsum(m_len)])
        pres_idx = np.flatnonzero(present)
        if pres_idx.size:
            dst = np.concatenate([np.arange(r_off[i], r_off[i + 1]) for i in pres_idx]) if pres_idx.size < 64 else _gather_ranges(r_off, pres_idx)
            src = _gather_ranges(m_off, pres_idx)
            flat_mask[dst] = mv[src]
    else:
        mask_null = np.ones(n, dtype=bool)
        flat_mask = np.ones(rv.shape[0], dtype=np.int64)

    r_starts = np.concatenate([[0], np.cumsum(r_len)[:-1]]).astype(np.int64)
    active = np.add.reduceat(flat_mask, r_starts) if n else np.zeros(0, dtype=np.int64)
    if np.any(active < 1):
        return None, int(np.flatnonzero(active < 1)[0]), "loss_mask has no 1"
    act = flat_mask.astype(bool)
    hi = np.maximum.reduceat(np.where(act, rv, -np.inf), r_starts) if n else np.zeros(0)
    lo = np.minimum.reduceat(np.where(act, rv, np.inf), r_starts) if n else np.zeros(0)
    labels = np.where(hi == lo, hi, np.nan)
    ids = sid.to_numpy(zero_copy_only=False)
    return (t_len, active, labels, ids, mask_null), None, ""


def _gather_ranges(offsets: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Concatenated index ranges offsets[r]:offsets[r+1] for r in rows."""
    lens = offsets[rows + 1] - offsets[rows]
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(offsets[rows] - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return starts + np.arange(total)


def _rows_with(flat_bad: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    row_of = np.repeat(np.arange(lengths.shape[0]), lengths)
    out = np.zeros(lengths.shape[0], dtype=bool)
    out[row_of[flat_bad]] = True
    return out


def _first_row_with(flat_bad: np.ndarray, lengths: np.ndarray) -> int:
    return int(np.flatnonzero(_rows_with(flat_bad, lengths))[0])


# ----------------------------------------------------------------------------------------------
# Parquet
# ----------------------------------------------------------------------------------------------

def _parquet_schema_error(path: Path, schema: pa.Schema) -> str | None:
    def elem_ok(t, want_int: bool) -> bool:
        if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
            return False
        v = t.value_type
        return pa.types.is_integer(v) if want_int else (pa.types.is_integer(v) or pa.types.is_floating(v))

    names = schema.names
    for req in ("sample_id", "tokens", "response_length", "returns"):
        if req not in names:
            return f"missing column {req!r} (columns: {names})"
    t = schema.field("sample_id").type
    if not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        return f"column sample_id must be string, got {t}"
    if not elem_ok(schema.field("tokens").type, True):
        return f"column tokens must be list<int> (floats are never token ids), got {schema.field('tokens').type}"
    if not pa.types.is_integer(schema.field("response_length").type):
        return f"column response_length must be int, got {schema.field('response_length').type}"
    if not elem_ok(schema.field("returns").type, False):
        return f"column returns must be list<float>, got {schema.field('returns').type}"
    if "loss_mask" in names and not elem_ok(schema.field("loss_mask").type, True):
        return f"column loss_mask must be list<int>, got {schema.field('loss_mask').type}"
    return None


def _validate_parquet(path: Path, objective: Objective, vocab_size, max_seq_len, progress) -> _Columns:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(str(path), f"not a readable Parquet file: {exc}") from None
    schema = pf.schema_arrow
    err = _parquet_schema_error(path, schema)
    if err:
        raise InputError(str(path), err)
    cols_present = [c for c in FIELDS if c in schema.names]
    target = pa.schema([f for f in _SCHEMA if f.name in cols_present])
    cols = _Columns()
    row0 = 0
    total = pf.metadata.num_rows
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH, columns=cols_present):
        try:
            cast = batch.cast(target, safe=True)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise InputError(str(path), f"row batch starting at row {row0} does not fit the expected types: {exc}") from None
        facts, bad, msg = check_batch(cast, objective, vocab_size, max_seq_len)
        if bad is not None:
            k = row0 + bad
            where = f"{path}:row {k}"
            check_row(batch.slice(bad, 1).to_pylist()[0], where, objective, vocab_size=vocab_size, max_seq_len=max_seq_len)
            raise InputError(where, msg)
        lengths, active, labels, ids, mask_null = facts
        if "loss_mask" in cols_present and mask_null.any():
            # A present column with a null cell is an explicit null, not an absent mask.
            k = row0 + int(np.flatnonzero(mask_null)[0])
            check_row(batch.slice(k - row0, 1).to_pylist()[0], f"{path}:row {k}", objective)
        cols.add(lengths, active, labels, ids)
        row0 += batch.num_rows
        if progress:
            progress("validate", row0, total)
    return cols


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def validate_dataset(ref: DatasetRef, objective: Objective, *, vocab_size: int | None = None,
                     max_seq_len: int | None = None, progress: Progress | None = None) -> Dataset:
    """Run every SPEC 2 check on one split; return the validated dataset or raise InputError."""
    path = ref.path
    if not path.exists():
        raise InputError(f"{path}", f"{ref.split} dataset does not exist (manifest path {ref.declared_path!r})")
    if not path.is_file():
        raise InputError(f"{path}", f"{ref.split} dataset is not a regular file")
    fmt = sniff_format(path)
    if fmt == "jsonl":
        scan = _scan_jsonl(path, progress)
        sha = scan.sha256
    else:
        from .hashing import sha256_file

        sha = sha256_file(path)
    if sha != ref.sha256:
        raise InputError(str(path), f"sha256 is {sha}, but the manifest pins {ref.sha256} for {ref.split}")
    if fmt == "jsonl":
        v = _JsonlValidator(path, objective, vocab_size, max_seq_len, scan, progress)
        cols = v.run()
        lengths, active, labels, hashes = cols.finish()
        ds = Dataset(path=path, sha256=sha, fmt=fmt, objective=objective, split=ref.split, lengths=lengths,
                     active=active, labels=labels, offsets=scan.offsets, line_numbers=scan.line_numbers)
    else:
        cols = _validate_parquet(path, objective, vocab_size, max_seq_len, progress)
        lengths, active, labels, hashes = cols.finish()
        ds = Dataset(path=path, sha256=sha, fmt=fmt, objective=objective, split=ref.split, lengths=lengths,
                     active=active, labels=labels)
    _check_unique_ids(ds, hashes)
    if len(ds) != ref.num_samples:
        raise InputError(str(path), f"has {len(ds)} rows, but the manifest says num_samples = {ref.num_samples} for {ref.split}")
    return ds


def _check_unique_ids(ds: Dataset, hashes: np.ndarray) -> None:
    if hashes.shape[0] < 2:
        return
    order = np.argsort(hashes, kind="stable")
    sh = hashes[order]
    same = np.flatnonzero(sh[1:] == sh[:-1])
    if same.size == 0:
        return
    # Hash collisions are confirmed on the exact strings; report the earliest later duplicate.
    first_seen: dict[str, int] = {}
    candidates = sorted(set(order[same].tolist()) | set(order[same + 1].tolist()))
    for i in candidates:
        sid = ds.row(i).sample_id
        if sid in first_seen:
            raise InputError(ds.location(i), f"duplicate sample_id {show(sid)} (first at {ds.location(first_seen[sid])})")
        first_seen[sid] = i


def validate_manifest_datasets(manifest, *, vocab_size=None, max_seq_len=None, progress=None) -> dict[str, Dataset]:
    """Validate every split the manifest names, in order (train, then heldout)."""
    return {ref.split: validate_dataset(ref, manifest.objective, vocab_size=vocab_size, max_seq_len=max_seq_len, progress=progress)
            for ref in manifest.splits()}
