"""The value objective (docs/rules.md#manifest): loss type, value support and target distribution.

`Objective.from_json` applies the defaults and the strict type rules; `canonical()` is the
five-field form that contracts store and resume compares. Besides the types, construction refuses
what would only fail later, in training: a support that is not finite or not strictly increasing, a
head too wide to train, values too large for float32 arithmetic (`MAX_ABS_VALUE`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from value_assets.core.errors import InputError, show
from value_assets.core.strict_json import finite_float, is_int, is_number

LOSS_TYPES = ("classification", "mse")
TARGET_TYPES = ("hl_gauss", "two_hot")
FIELDS = ("loss_type", "num_bins", "reward_range", "target_type", "hl_gauss_sigma_ratio")

# Widest value head accepted. HL-Gauss critics use tens to a few hundred bins (Miles defaults to 51);
# the head's logits and the target distributions are float32 [tokens, K] per micro-batch, so
# K = 4096 already costs 16 KiB a token (512 MiB for a 32k-token micro-batch). Beyond it a typo
# (num_bins: 1000000000) would pass validation and fail only when the GPUs allocate.
MAX_NUM_BINS = 4096

# Largest |value| the critic is asked to represent: every reward_range bound, and every mse return.
# Values, supports and (V - R)^2 are float32 on the GPU (max 3.4e38): with |R|, |V| <= 1e6 a squared
# error is <= 4e12 and a sum over 1e12 tokens still fits, and float32 still resolves 0.06 at 1e6.
# Larger returns are unscaled rewards: rescale them before pretraining a critic.
MAX_ABS_VALUE = 1e6


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
        if self.num_bins > MAX_NUM_BINS:
            raise InputError(
                f"{where}.num_bins",
                f"must be <= {MAX_NUM_BINS} (the widest value head accepted), got {show(self.num_bins)}",
            )
        rr = self.reward_range
        if not (isinstance(rr, (tuple, list)) and len(rr) == 2 and all(is_number(v) for v in rr)):
            raise InputError(f"{where}.reward_range", f"must be [low, high] numbers, got {show(rr)}")
        low, high = finite_float(rr[0]), finite_float(rr[1])
        if low is None or high is None:
            raise InputError(f"{where}.reward_range", f"must be finite, got {show(rr)}")
        if not low < high:
            raise InputError(f"{where}.reward_range", f"needs low < high, got {show(rr)}")
        if max(abs(low), abs(high)) > MAX_ABS_VALUE:
            raise InputError(
                f"{where}.reward_range",
                f"bounds must lie within +-{MAX_ABS_VALUE:g} (values are float32 on the GPU; "
                f"rescale the rewards), got {show(rr)}",
            )
        object.__setattr__(self, "reward_range", (low, high))
        if self.target_type not in TARGET_TYPES:
            raise InputError(f"{where}.target_type", f"must be one of {TARGET_TYPES}, got {show(self.target_type)}")
        ratio = finite_float(self.hl_gauss_sigma_ratio)
        if ratio is None or ratio <= 0:
            raise InputError(
                f"{where}.hl_gauss_sigma_ratio", f"must be a finite number > 0, got {show(self.hl_gauss_sigma_ratio)}"
            )
        object.__setattr__(self, "hl_gauss_sigma_ratio", ratio)
        if self.loss_type == "classification":
            self._check_support(where)

    def _check_support(self, where: str) -> None:
        """The support linspace(low, high, K), its bin width and the HL-Gauss sigma, as docs/rules.md#critic derives
        them, must be finite, positive and strictly increasing: a range too narrow for K float bins
        gives equal centres and zero-width bins (division by zero in the targets)."""
        low, high = self.reward_range
        width = (high - low) / (self.num_bins - 1)
        sigma = self.hl_gauss_sigma_ratio * width
        centres = [low + k * width for k in range(self.num_bins - 1)] + [high]
        increasing = all(b > a for a, b in pairwise(centres))
        if not (math.isfinite(width) and width > 0 and increasing):
            raise InputError(
                f"{where}.reward_range",
                f"{show(self.reward_range)} with num_bins = {self.num_bins} gives bins of "
                f"width {width!r}: the bin centres must be finite and strictly increasing",
            )
        if self.target_type == "hl_gauss" and not (math.isfinite(sigma) and sigma > 0):
            raise InputError(
                f"{where}.hl_gauss_sigma_ratio",
                f"{self.hl_gauss_sigma_ratio!r} x bin width {width!r} gives sigma = "
                f"{sigma!r}; it must be finite and > 0",
            )

    @property
    def head_size(self) -> int:
        """Output width K of the value head: num_bins for classification, 1 for mse."""
        return self.num_bins if self.loss_type == "classification" else 1

    @staticmethod
    def unknown_keys(obj: Mapping[str, Any]) -> tuple[str, ...]:
        """The keys of an objective object that are none of the five fields, sorted."""
        return tuple(sorted(set(obj) - set(FIELDS)))

    @classmethod
    def from_json(cls, obj: Any, where: str = "objective", *, ignore_unknown: bool = False) -> Objective:
        """Build from a JSON object. Unknown keys are refused, except with `ignore_unknown` (a Miles
        manifest: Miles' loader ignores them, docs/rules.md#hand-off); contracts keep exactly the five fields."""
        if not isinstance(obj, Mapping):
            raise InputError(where, f"must be an object, got {show(obj)}")
        unknown = cls.unknown_keys(obj)
        if unknown and not ignore_unknown:
            raise InputError(where, f"unknown field(s) {show(list(unknown))}; allowed: {list(FIELDS)}")
        kwargs = {k: v for k, v in obj.items() if k in FIELDS}
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
