"""Shared builders and naive references for the core test tier (imported by the test modules)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_file
from value_assets.core.manifest import DatasetRef
from value_assets.core.objective import Objective
from value_assets.core.rows import check_row, format_label

SHA_A = "a" * 64


def row(
    sid: str = "r0", tokens=(5, 6, 7, 8), rl: int = 2, returns=None, mask: Any = "absent", **extra
) -> dict[str, Any]:
    r: dict[str, Any] = {
        "sample_id": sid,
        "tokens": list(tokens),
        "response_length": rl,
        "returns": list(returns) if returns is not None else [1.0] * rl,
    }
    if mask != "absent":
        r["loss_mask"] = mask
    r.update(extra)
    return r


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def write_lines(path: Path, lines: list[bytes], trailing_newline: bool = True) -> Path:
    path.write_bytes(b"\n".join(lines) + (b"\n" if trailing_newline else b""))
    return path


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    return write_lines(path, [dumps(r) for r in rows])


def write_parquet(path: Path, rows: list[dict[str, Any]], with_mask: bool | None = None, schema=None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if with_mask is None:
        with_mask = any("loss_mask" in r for r in rows)
    fields = [
        ("sample_id", pa.string()),
        ("tokens", pa.list_(pa.int64())),
        ("response_length", pa.int64()),
        ("returns", pa.list_(pa.float64())),
    ]
    if with_mask:
        fields.append(("loss_mask", pa.list_(pa.int64())))
    schema = schema or pa.schema(fields)
    cols = {f.name: [r.get(f.name) for r in rows] for f in schema}
    pq.write_table(pa.table(cols, schema=schema), path)
    return path


def ref_for(path: Path, num_samples: int, *, sha: str | None = None, split: str = "train") -> DatasetRef:
    return DatasetRef(
        split=split, path=Path(path), declared_path=str(path), sha256=sha or sha256_file(path), num_samples=num_samples
    )


# ------------------------------------------------------------------------------------------------
# Naive reference for a JSONL file: Python's json (made strict here, independently of the product's
# strict_json) + rows.check_row, line by line.
# ------------------------------------------------------------------------------------------------


class _Bad(Exception):
    pass


def _pairs(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise _Bad("dup")
        out[k] = v
    return out


def _const(name):
    raise _Bad(name)


def _flt(text):
    v = float(text)
    if not math.isfinite(v):
        raise _Bad(text)
    return v


def _all_strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _all_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _all_strings(v)


def _depth(obj) -> int:
    if isinstance(obj, dict):
        return 1 + max(map(_depth, obj.values()), default=0)
    if isinstance(obj, list):
        return 1 + max(map(_depth, obj), default=0)
    return 0


def naive_parse(line: bytes) -> Any:
    """Python's json made strict; a string that is not valid Unicode (a lone surrogate escape) is
    refused like invalid UTF-8, nesting deeper than 256 levels too. Too-long ints raise ValueError,
    nesting beyond the recursion limit RecursionError."""
    text = line.decode("utf-8")  # raises UnicodeDecodeError
    obj = json.loads(text, object_pairs_hook=_pairs, parse_constant=_const, parse_float=_flt)
    for s in _all_strings(obj):
        s.encode("utf-8")  # raises UnicodeEncodeError (a ValueError)
    if _depth(obj) > 256:
        raise _Bad("too deep")
    return obj


def naive_validate(
    path: Path, objective: Objective, num_samples: int, vocab_size=None, max_seq_len=None
) -> dict[str, Any]:
    """Return {'ok', 'bad_lines' (rows failing rules 2-7 or duplicated ids), 'count_ok', 'rows'}."""
    data = Path(path).read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines = lines[:-1]
    bad: set[int] = set()
    rows: list[tuple[int, Any]] = []
    seen: dict[str, int] = {}
    for no, line in enumerate(lines, start=1):
        if line.strip(b" \t\r") == b"":  # JSON whitespace only (RFC 8259): not \f, \v or U+00A0
            continue
        try:
            obj = naive_parse(line)
            r = check_row(obj, f"{path}:{no}", objective, vocab_size=vocab_size, max_seq_len=max_seq_len)
        except (UnicodeDecodeError, ValueError, _Bad, InputError, RecursionError):
            bad.add(no)
            rows.append((no, None))
            continue
        if r.sample_id in seen:
            bad.add(no)
            bad.add(seen[r.sample_id])
        else:
            seen[r.sample_id] = no
        rows.append((no, r))
    count_ok = len(rows) == num_samples
    return {"ok": not bad and count_ok, "bad_lines": bad, "count_ok": count_ok, "rows": rows}


def naive_stats(rows) -> dict[str, Any]:
    labels: dict[str, int] = {}
    tokens = active = 0
    for r in rows:
        tokens += len(r.tokens)
        act = [float(v) for v, m in zip(r.returns, r.loss_mask, strict=True) if m == 1]
        active += len(act)
        if all(a == act[0] for a in act):
            key = format_label(act[0])
            labels[key] = labels.get(key, 0) + 1
    return {"rows": len(rows), "tokens": tokens, "active_targets": active, "label_counts": labels}


def rows_equal(a, b) -> bool:
    return (
        a.sample_id == b.sample_id
        and a.response_length == b.response_length
        and np.array_equal(a.tokens, b.tokens)
        and np.array_equal(a.returns, b.returns)
        and np.array_equal(a.loss_mask, b.loss_mask)
    )
