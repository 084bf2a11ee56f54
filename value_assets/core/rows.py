"""One trajectory row (docs/rules.md#dataset) and the exact, per-row rules.

`check_row` is the reference implementation of the row rules: the fast columnar validator in
`dataset.py` must accept exactly what this accepts, and it falls back to this function to name the
first offending value when a columnar check fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from value_assets.core.errors import InputError, show
from value_assets.core.objective import MAX_ABS_VALUE, Objective
from value_assets.core.strict_json import finite_float, is_int

INT64_MAX = 2**63 - 1
FIELDS = ("sample_id", "tokens", "response_length", "returns", "loss_mask")
_MASK_TYPES = (int, float, bool)  # the JSON numbers and booleans a parsed mask value can be


@dataclass(frozen=True)
class Row:
    """A validated trajectory. Arrays: tokens int64 (T,), returns float64 (R,), loss_mask int8 (R,)."""

    sample_id: str
    tokens: np.ndarray
    response_length: int
    returns: np.ndarray
    loss_mask: np.ndarray

    @property
    def prompt_length(self) -> int:
        return int(self.tokens.shape[0]) - self.response_length

    @property
    def active_targets(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def label(self) -> float | None:
        """The row's scalar label: the one value all active returns share, else None."""
        active = self.returns[self.loss_mask.astype(bool)]
        first = active[0]
        return float(first) if bool(np.all(active == first)) else None


def format_label(value: float) -> str:
    """Labels are keyed by the float's shortest repr ('0.0', '1.0', '0.25')."""
    return repr(float(value))


def check_row(
    obj: Any, where: str, objective: Objective, *, vocab_size: int | None = None, max_seq_len: int | None = None
) -> Row:
    """Apply docs/rules.md#dataset rules 3-7 to one parsed JSON row; raise InputError(where, ...) on the first break."""
    if not isinstance(obj, dict):
        raise InputError(where, f"row must be a JSON object, got {show(obj)}")
    sid = obj.get("sample_id")
    if "sample_id" not in obj:
        raise InputError(where, "missing field 'sample_id'")
    if not isinstance(sid, str) or sid == "":
        raise InputError(where, f"sample_id must be a non-empty string, got {show(sid)}")
    try:
        sid.encode("utf-8")  # receipts and reports write ids as UTF-8
    except UnicodeEncodeError:
        raise InputError(
            where, f"sample_id {show(sid)} is not valid Unicode (a lone surrogate): it cannot be written as UTF-8"
        ) from None
    if "tokens" not in obj:
        raise InputError(where, "missing field 'tokens'")
    tokens = obj["tokens"]
    if not isinstance(tokens, list):
        raise InputError(where, f"tokens must be a list of ints, got {show(tokens)}")
    if len(tokens) < 2:
        raise InputError(where, f"tokens must hold at least 2 ids, got {len(tokens)}")
    for i, t in enumerate(tokens):
        if not is_int(t):
            raise InputError(where, f"tokens[{i}] must be an int token id, got {show(t)}")
        if t < 0:
            raise InputError(where, f"tokens[{i}] = {t} is negative")
        if t > INT64_MAX:
            raise InputError(where, f"tokens[{i}] = {t} does not fit in int64")
        if vocab_size is not None and t >= vocab_size:
            raise InputError(where, f"tokens[{i}] = {t} is >= the vocabulary size {vocab_size}")
    if max_seq_len is not None and len(tokens) > max_seq_len:
        raise InputError(where, f"len(tokens) = {len(tokens)} exceeds the maximum sequence length {max_seq_len}")
    if "response_length" not in obj:
        raise InputError(where, "missing field 'response_length'")
    rl = obj["response_length"]
    if not is_int(rl) or rl < 1:
        raise InputError(where, f"response_length must be an int >= 1, got {show(rl)}")
    if rl >= len(tokens):
        raise InputError(
            where, f"response_length = {rl} must be < len(tokens) = {len(tokens)} (at least one prompt token)"
        )
    if "returns" not in obj:
        raise InputError(where, "missing field 'returns'")
    rets = obj["returns"]
    if not isinstance(rets, list):
        raise InputError(where, f"returns must be a list of numbers, got {show(rets)}")
    if len(rets) != rl:
        raise InputError(where, f"returns has {len(rets)} values, expected response_length = {rl}")
    low, high = objective.reward_range
    classification = objective.loss_type == "classification"
    for i, r in enumerate(rets):
        value = finite_float(r)
        if value is None:
            raise InputError(where, f"returns[{i}] must be a finite number, got {show(r)}")
        if classification and not (low <= value <= high):
            raise InputError(where, f"returns[{i}] = {show(r)} is outside reward_range [{low}, {high}]")
        if not classification and abs(value) > MAX_ABS_VALUE:
            raise InputError(
                where,
                f"returns[{i}] = {show(r)} is beyond +-{MAX_ABS_VALUE:g}, the largest mse return accepted "
                "((V - R)^2 is float32 on the GPU; rescale the rewards)",
            )
    if "loss_mask" in obj:
        mask = obj["loss_mask"]
        if not isinstance(mask, list):
            raise InputError(
                where, f"loss_mask must be a list of 0/1 (absent means all ones; null is not absent), got {show(mask)}"
            )
        if len(mask) != rl:
            raise InputError(where, f"loss_mask has {len(mask)} values, expected response_length = {rl}")
        for i, m in enumerate(mask):
            # As Miles' loader: 0/1, 0.0/1.0 and false/true, all read as 0/1 (docs/rules.md#dataset item 7).
            if type(m) not in _MASK_TYPES or m not in (0, 1):
                raise InputError(
                    where, f"loss_mask[{i}] must be 0 or 1 (0.0/1.0 and false/true are read as 0/1), got {show(m)}"
                )
        if not any(mask):
            raise InputError(where, "loss_mask has no 1: the row has no active target")
        mask_arr = np.asarray(mask, dtype=np.int8)
    else:
        mask_arr = np.ones(rl, dtype=np.int8)
    return Row(
        sample_id=sid,
        tokens=np.asarray(tokens, dtype=np.int64),
        response_length=rl,
        returns=np.asarray(rets, dtype=np.float64),
        loss_mask=mask_arr,
    )
