"""Strict JSON: duplicate keys, NaN and +-Infinity are errors (docs/rules.md#manifest and docs/rules.md#dataset).

Python's `json` accepts all three by default (keeping the last of duplicate keys, reading NaN and
1e999 as floats); these wrappers refuse them, so that what we accept reads the same in every
consumer, Miles' Python loader included. Bools are told apart from numbers by the type checks of
the callers (`is_int`, `is_number`), never here.

Whatever the input, `loads` either returns or raises `InputError`: integers too long for Python's
int parsing, nesting deeper than `MAX_DEPTH`, and strings holding a lone surrogate escape
(``"\\ud800"``: not Unicode, it cannot be written back as UTF-8, e.g. into a receipt) are refused
with the location like any other invalid JSON.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeGuard

from value_assets.core.errors import InputError, show


class _StrictError(ValueError):
    pass


# Python refuses int(str) beyond 4300 digits by default (CVE-2020-10735); no field of ours needs
# more than 20, so the same bound is applied whatever the interpreter's setting.
MAX_INT_DIGITS = 4300
# Deepest nesting accepted. Python's parser recurses once per level and fails near its recursion
# limit (1000 frames, minus whatever the caller's stack already holds: a Dagster sensor holds more
# than the command line). A fixed bound well below it gives every caller the same verdict; real
# manifests and rows nest fewer than 10 levels.
MAX_DEPTH = 256


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _StrictError(f"duplicate key {show(key)} (refused: Python's json keeps the last value silently)")
        out[key] = value
    return out


def _constant(name: str) -> Any:
    raise _StrictError(f"{name} is not allowed (refused: not JSON; Python's json would read it as a float)")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        # 1e999 parses to inf in Python; a non-finite number is as bad as the literal.
        raise _StrictError(f"number {show(text, 40)} is not finite (refused: Python's json reads it as {value})")
    return value


def _int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise _StrictError(
            f"integer {show(text, 40)} has {digits} digits, more than the {MAX_INT_DIGITS} Python parses"
        )
    try:
        return int(text)
    except ValueError as exc:  # a lower sys.set_int_max_str_digits() limit
        raise _StrictError(f"integer {show(text, 40)}: {exc}") from None


_TOO_DEEP = object()
_DECODER = json.JSONDecoder(object_pairs_hook=_pairs, parse_constant=_constant, parse_float=_float, parse_int=_int)
# Only a \\uD800-\\uDFFF escape can put a surrogate into a decoded string (raw surrogate bytes are
# invalid UTF-8 and refused before parsing); texts without one skip the walk below.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` levels in `obj`. Iterative, leaves never stacked."""
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, (dict, list)):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def _lone_surrogate(obj: Any) -> str | None:
    """The first string (key or value) of `obj` that is not valid Unicode, else None. Iterative:
    the depth is whatever the parser allowed."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            strings = (item,)
        elif isinstance(item, dict):
            strings = tuple(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
            continue
        else:
            continue
        for s in strings:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                return s
    return None


def _position(text: str, pos: int) -> str:
    """Where a syntax error is, as an editor counts: `column C` in a one-line text (a JSONL row,
    whose location already names the line), `line L column C` in a longer one. A text that ends
    too early (a truncated row: the parser stops after its trailing newline) is placed just after
    its last character, not at column 1 of the line after it."""
    end = len(text.rstrip(" \t\r\n"))
    cut = pos >= end
    pos = min(pos, end)
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    place = f"column {column}" if "\n" not in text[:end] else f"line {line} column {column}"
    return place + (" (the end of the text: it stops early)" if cut else "")


def loads(text: str | bytes, where: str) -> Any:
    """Parse one JSON document strictly; every refusal is InputError(where, ...)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(
                where, f"invalid UTF-8 at byte {exc.start}: {exc.object[exc.start : exc.start + 4]!r}"
            ) from None
    try:
        obj = _DECODER.decode(text)
    except _StrictError as exc:
        raise InputError(where, f"invalid JSON: {exc}") from None
    except json.JSONDecodeError as exc:
        msg = exc.msg.removesuffix(" at")  # "Unterminated string starting at", "Invalid control character at"
        raise InputError(where, f"invalid JSON: {msg} at {_position(text, exc.pos)}") from None
    except RecursionError:
        obj = _TOO_DEEP
    # Fewer brackets than MAX_DEPTH cannot nest deeper: the walk runs only for bracket-rich texts.
    if obj is _TOO_DEEP or (text.count("[") + text.count("{") > MAX_DEPTH and _deeper_than(obj, MAX_DEPTH)):
        raise InputError(where, f"invalid JSON: nested too deeply (more than {MAX_DEPTH} levels)")
    if _SURROGATE_ESCAPE.search(text):
        bad = _lone_surrogate(obj)
        if bad is not None:
            raise InputError(
                where,
                f"invalid JSON: string {show(bad)} holds a lone surrogate escape "
                "(not valid Unicode; it cannot be written as UTF-8)",
            )
    return obj


def is_int(value: object) -> TypeGuard[int]:
    """A JSON integer: int but never bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """A JSON number (int or float), never bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def finite_float(value: object) -> float | None:
    """`value` as a finite float when it is a JSON number (never bool), else None. An int beyond the
    float range (10**400) is not finite either: float() would raise OverflowError."""
    if not is_number(value):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def canonical_bytes(obj: Any) -> bytes:
    """Canonical JSON (docs/rules.md#contract): sorted keys, compact separators, UTF-8, trailing newline."""
    return (json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False) + "\n").encode(
        "utf-8"
    )
