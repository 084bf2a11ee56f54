"""A plain-stdlib reference validator, written the way a reference implementation does it:
json.loads per line and Python loops over every value. Used only by bench/validate.py."""

from __future__ import annotations

import hashlib
import json
import math


def _pairs(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"duplicate key {k}")
        d[k] = v
    return d


def _const(name):
    raise ValueError(name)


def validate(path: str, low: float = 0.0, high: float = 1.0, limit_bytes: int | None = None) -> int:
    h = hashlib.sha256()
    seen = set()
    rows = 0
    done = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            h.update(raw)
            done += len(raw)
            if limit_bytes is not None and done > limit_bytes:
                break
            if not raw.strip():
                continue
            row = json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs, parse_constant=_const)
            sid = row["sample_id"]
            assert isinstance(sid, str) and sid and sid not in seen, lineno
            seen.add(sid)
            toks = row["tokens"]
            assert isinstance(toks, list) and len(toks) >= 2
            for t in toks:
                assert isinstance(t, int) and not isinstance(t, bool) and t >= 0, lineno
            rl = row["response_length"]
            assert isinstance(rl, int) and not isinstance(rl, bool) and 1 <= rl < len(toks)
            rets = row["returns"]
            assert len(rets) == rl
            for r in rets:
                assert isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and low <= r <= high
            mask = row.get("loss_mask", [1] * rl)
            assert len(mask) == rl and all(m in (0, 1) and not isinstance(m, bool) for m in mask) and any(mask)
            rows += 1
    return rows
