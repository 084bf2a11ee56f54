"""Uncertainty and position statistics of explained variance (docs/rules.md#explained-variance).

- `bootstrap_ev_interval`: a percentile bootstrap over *units* (rows, or prompt groups when rows of
  one prompt are not independent): each unit carries its float64 sufficient statistics, a
  resample sums the drawn units' statistics and computes EV once, exactly as the report's aggregate
  is computed (sums first, one division). Resamples whose returns have no variance are dropped and
  counted; the interval is None when fewer than half the resamples are defined.
- `ev_by_position`: token-weighted EV per decile of the response (a token's decile is
  floor(10 j / L) for response token j of a response of length L), so a reader sees whether the
  critic improves as the response unfolds.

Pure numpy; the unit of resampling and the seed are arguments so results are reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from value_assets.core.stats import VAR_FLOOR, SuffStats, decile_stats, position_deciles

__all__ = [
    "Interval",
    "bootstrap_ev_difference",
    "bootstrap_ev_interval",
    "decile_stats",
    "ev_by_position",
    "ev_of_sums",
    "position_deciles",
    "stats_matrix",
]

FIELDS = ("n", "sum_r", "sum_r2", "sum_e", "sum_e2")


def stats_matrix(parts: Sequence[SuffStats]) -> np.ndarray:
    """[units, 5] float64 matrix of (n, sum R, sum R^2, sum e, sum e^2)."""
    return np.array([[p.n, p.sum_r, p.sum_r2, p.sum_e, p.sum_e2] for p in parts], dtype=np.float64).reshape(-1, 5)


def ev_of_sums(s: np.ndarray) -> np.ndarray:
    """EV of summed statistics, vectorised over leading axes; NaN where undefined (n <= 1 or
    Var(R) <= the floor)."""
    n = s[..., 0]
    with np.errstate(invalid="ignore", divide="ignore"):
        var_r = s[..., 2] / n - (s[..., 1] / n) ** 2
        var_e = s[..., 4] / n - (s[..., 3] / n) ** 2
        ev = 1.0 - var_e / var_r
    return np.where((n > 1) & (var_r > VAR_FLOOR) & np.isfinite(ev), ev, np.nan)


@dataclass(frozen=True)
class Interval:
    estimate: float | None
    low: float | None
    high: float | None
    level: float
    resamples: int
    undefined_resamples: int
    units: int

    def to_json(self) -> dict[str, Any]:
        return {
            "estimate": self.estimate,
            "low": self.low,
            "high": self.high,
            "level": self.level,
            "resamples": self.resamples,
            "undefined_resamples": self.undefined_resamples,
            "units": self.units,
        }


def _percentile_bootstrap(
    statistic: Callable[[np.ndarray], np.ndarray],
    units: int,
    point: float,
    *,
    resamples: int,
    level: float,
    seed: int,
) -> Interval:
    """The percentile interval of `statistic(idx)` over resamples of `units` units: `idx` is an
    [r, units] array of drawn unit indices and `statistic` returns r values (NaN where undefined).
    Resamples whose value is undefined are dropped and counted; fewer than half defined: no
    interval."""
    estimate = None if np.isnan(point) else float(point)
    if units < 2:
        return Interval(estimate, None, None, level, resamples, resamples, units)
    rng = np.random.default_rng(seed)
    values = np.empty(resamples)
    chunk = max(1, 2_000_000 // units)  # memory stays bounded for many units
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        values[start:stop] = statistic(rng.integers(0, units, size=(stop - start, units)))
    defined = values[~np.isnan(values)]
    undefined = resamples - defined.size
    if defined.size < resamples / 2:
        return Interval(estimate, None, None, level, resamples, undefined, units)
    alpha = (1.0 - level) / 2.0
    low, high = np.quantile(defined, [alpha, 1.0 - alpha])
    return Interval(estimate, float(low), float(high), level, resamples, undefined, units)


def bootstrap_ev_interval(
    parts: Sequence[SuffStats], *, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> Interval:
    """Percentile bootstrap interval of the EV of summed `parts` (one SuffStats per unit)."""
    m = stats_matrix(parts)
    units = m.shape[0]
    point = float(ev_of_sums(m.sum(axis=0))) if units else float("nan")
    return _percentile_bootstrap(
        lambda idx: ev_of_sums(m[idx].sum(axis=1)), units, point, resamples=resamples, level=level, seed=seed
    )


def bootstrap_ev_difference(
    a: np.ndarray, b: np.ndarray, *, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> Interval:
    """Paired percentile bootstrap interval of EV(a) - EV(b), where `a` and `b` are the [units, 5]
    statistics of two critics on the same units (the same returns, other predictions): every
    resample draws the same units for both, so what the units share cancels and the interval is of
    the difference, not of two independent estimates."""
    units = a.shape[0]
    if b.shape != a.shape:
        raise ValueError(f"paired statistics of other shapes: {a.shape} and {b.shape}")
    point = float(ev_of_sums(a.sum(axis=0)) - ev_of_sums(b.sum(axis=0))) if units else float("nan")
    return _percentile_bootstrap(
        lambda idx: ev_of_sums(a[idx].sum(axis=1)) - ev_of_sums(b[idx].sum(axis=1)),
        units, point, resamples=resamples, level=level, seed=seed,
    )  # fmt: skip


def ev_by_position(per_row: Sequence[np.ndarray]) -> list[float | None]:
    """Token-weighted EV per response decile from summed `decile_stats` of many rows; None where
    undefined."""
    total = np.sum(np.stack(list(per_row)), axis=0) if len(per_row) else np.zeros((10, 5))
    evs = ev_of_sums(total)
    return [None if np.isnan(x) else float(x) for x in evs]
