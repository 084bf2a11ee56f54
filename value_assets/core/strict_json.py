"""Strict JSON: duplicate keys, NaN and +-Infinity are errors (SPEC 1 and 2).

Python's `json` accepts all three by default; these wrappers refuse them. Bools are told apart from
numbers by the type checks of the callers (`is_int`, `is_number`), never here.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .errors import InputError


class _StrictError(ValueError):
    pass


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _StrictError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _constant(name: str) -> Any:
    raise _StrictError(f"{name} is not allowed")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        # 1e999 parses to inf in Python; a non-finite number is as bad as the literal.
        raise _StrictError(f"number {text} is not finite")
    return value


_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_constant, parse_float=_float)


def loads(text: str | bytes, where: str) -> Any:
    """Parse one JSON document strictly; errors become InputError(where, ...)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(where, f"invalid UTF-8 at byte {exc.start}: {exc.object[exc.start:exc.start + 4]!r}") from None
    try:
        return _DECODER.decode(text)
    except _StrictError as exc:
        raise InputError(where, f"invalid JSON: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(where, f"invalid JSON: {exc.msg} at column {exc.colno}") from None


def is_int(value: object) -> bool:
    """A JSON integer: int but never bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A JSON number (int or float), never bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def canonical_bytes(obj: Any) -> bytes:
    """Canonical JSON (SPEC 6): sorted keys, compact separators, UTF-8, trailing newline."""
    return (json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
