"""The value objective (SPEC 1): loss type, value support and target distribution.

`Objective.from_json` applies the defaults and the strict type rules; `canonical()` is the
five-field form that contracts store and resume compares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import InputError, show
from .strict_json import is_int, is_number

LOSS_TYPES = ("classification", "mse")
TARGET_TYPES = ("hl_gauss", "two_hot")
FIELDS = ("loss_type", "num_bins", "reward_range", "target_type", "hl_gauss_sigma_ratio")


@dataclass(frozen=True, kw_only=True)
class Objective:
    loss_type: str = "classification"
    num_bins: int = 51
    reward_range: tuple[float, float] = (0.0, 1.0)
    target_type: str = "hl_gauss"
    hl_gauss_sigma_ratio: float = 0.75

    def __post_init__(self) -> None:
        where = "objective"
        if self.loss_type not in LOSS_TYPES:
            raise InputError(f"{where}.loss_type", f"must be one of {LOSS_TYPES}, got {show(self.loss_type)}")
        if not is_int(self.num_bins):
            raise InputError(f"{where}.num_bins", f"must be an integer, got {show(self.num_bins)}")
        if self.loss_type == "classification" and self.num_bins < 2:
            raise InputError(f"{where}.num_bins", f"must be >= 2 for classification, got {self.num_bins}")
        if self.num_bins < 1:
            raise InputError(f"{where}.num_bins", f"must be >= 1, got {self.num_bins}")
        rr = self.reward_range
        if not (isinstance(rr, (tuple, list)) and len(rr) == 2 and all(is_number(v) for v in rr)):
            raise InputError(f"{where}.reward_range", f"must be [low, high] numbers, got {show(rr)}")
        low, high = float(rr[0]), float(rr[1])
        if not (math.isfinite(low) and math.isfinite(high)):
            raise InputError(f"{where}.reward_range", f"must be finite, got {show(rr)}")
        if not low < high:
            raise InputError(f"{where}.reward_range", f"needs low < high, got {show(rr)}")
        object.__setattr__(self, "reward_range", (low, high))
        if self.target_type not in TARGET_TYPES:
            raise InputError(f"{where}.target_type", f"must be one of {TARGET_TYPES}, got {show(self.target_type)}")
        ratio = self.hl_gauss_sigma_ratio
        if not is_number(ratio) or not math.isfinite(ratio) or ratio <= 0:
            raise InputError(f"{where}.hl_gauss_sigma_ratio", f"must be a finite number > 0, got {show(ratio)}")
        object.__setattr__(self, "hl_gauss_sigma_ratio", float(ratio))

    @property
    def head_size(self) -> int:
        """Output width K of the value head: num_bins for classification, 1 for mse."""
        return self.num_bins if self.loss_type == "classification" else 1

    @classmethod
    def from_json(cls, obj: Any, where: str = "objective") -> "Objective":
        if not isinstance(obj, Mapping):
            raise InputError(where, f"must be an object, got {show(obj)}")
        unknown = sorted(set(obj) - set(FIELDS))
        if unknown:
            raise InputError(where, f"unknown field(s) {unknown}; allowed: {list(FIELDS)}")
        kwargs = dict(obj)
        if "reward_range" in kwargs and isinstance(kwargs["reward_range"], list):
            kwargs["reward_range"] = tuple(kwargs["reward_range"])
        try:
            return cls(**kwargs)
        except InputError as exc:
            # Re-anchor the field path at the caller's location (e.g. the manifest file).
            raise InputError(exc.where.replace("objective", where, 1), exc.message) from None

    def canonical(self) -> dict[str, Any]:
        return {
            "loss_type": self.loss_type,
            "num_bins": self.num_bins,
            "reward_range": [float(self.reward_range[0]), float(self.reward_range[1])],
            "target_type": self.target_type,
            "hl_gauss_sigma_ratio": float(self.hl_gauss_sigma_ratio),
        }
