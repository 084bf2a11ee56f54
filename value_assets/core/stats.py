"""Explained variance from float64 sufficient statistics, rank-report checks and the gate (SPEC 7).

Statistics are summed across rows, ranks and batches, and divided once at the end; EVs are never
averaged.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from .errors import InputError

VAR_FLOOR = 1e-8


@dataclass(frozen=True)
class SuffStats:
    """n, sum R, sum R^2, sum e, sum e^2 (e = R - V), all float64."""

    n: float = 0.0
    sum_r: float = 0.0
    sum_r2: float = 0.0
    sum_e: float = 0.0
    sum_e2: float = 0.0

    def __add__(self, other: "SuffStats") -> "SuffStats":
        return SuffStats(self.n + other.n, self.sum_r + other.sum_r, self.sum_r2 + other.sum_r2,
                         self.sum_e + other.sum_e, self.sum_e2 + other.sum_e2)

    @staticmethod
    def merge(parts: Iterable["SuffStats"]) -> "SuffStats":
        total = SuffStats()
        for p in parts:
            total = total + p
        return total

    def to_json(self) -> dict[str, float]:
        return {"n": self.n, "sum_r": self.sum_r, "sum_r2": self.sum_r2, "sum_e": self.sum_e, "sum_e2": self.sum_e2}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "SuffStats":
        return cls(*(float(obj[k]) for k in ("n", "sum_r", "sum_r2", "sum_e", "sum_e2")))

    def var_r(self) -> float:
        m = self.sum_r / self.n
        return self.sum_r2 / self.n - m * m

    def var_e(self) -> float:
        m = self.sum_e / self.n
        return self.sum_e2 / self.n - m * m

    def ev(self, where: str = "explained variance") -> float:
        """1 - Var(e) / Var(R), population variances. n <= 1, Var(R) <= 1e-8 or a non-finite result raise."""
        if not self.n > 1:
            raise InputError(where, f"undefined: n = {self.n} (needs n > 1)")
        vr = self.var_r()
        if not math.isfinite(vr) or vr <= VAR_FLOOR:
            raise InputError(where, f"undefined: Var(R) = {vr!r} <= {VAR_FLOOR} (all returns equal)")
        value = 1.0 - self.var_e() / vr
        if not math.isfinite(value):
            raise InputError(where, f"non-finite EV {value!r}")
        return value

    def r2(self) -> float:
        """Coefficient of determination 1 - mean(e^2) / Var(R) (includes the bias, unlike EV)."""
        return 1.0 - (self.sum_e2 / self.n) / self.var_r()

    def bias(self) -> float:
        """Mean residual R - V."""
        return self.sum_e / self.n


def token_stats(returns: np.ndarray, values: np.ndarray, mask: np.ndarray) -> SuffStats:
    """Token-weighted statistics of one row or many: arrays of equal shape, mask 0/1."""
    m = np.asarray(mask).astype(bool).reshape(-1)
    r = np.asarray(returns, dtype=np.float64).reshape(-1)[m]
    e = r - np.asarray(values, dtype=np.float64).reshape(-1)[m]
    return SuffStats(float(r.size), float(r.sum()), float((r * r).sum()), float(e.sum()), float((e * e).sum()))


def trajectory_stats(returns: np.ndarray, values: np.ndarray, mask: np.ndarray) -> SuffStats:
    """One row's trajectory-weighted contribution: n = 1, means over its active tokens."""
    m = np.asarray(mask).astype(bool).reshape(-1)
    r = np.asarray(returns, dtype=np.float64).reshape(-1)[m]
    e = r - np.asarray(values, dtype=np.float64).reshape(-1)[m]
    return SuffStats(1.0, float(r.mean()), float((r * r).mean()), float(e.mean()), float((e * e).mean()))


@dataclass
class RankReport:
    """What one data-parallel rank returns for one evaluation batch."""

    rank: int
    row_indices: list[int]
    token: SuffStats
    trajectory: SuffStats
    row_values: list[float] = field(default_factory=list)  # mean predicted value per row (for AUROC)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "row_indices": list(self.row_indices), "token": self.token.to_json(),
                "trajectory": self.trajectory.to_json(), "row_values": list(self.row_values)}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "RankReport":
        return cls(int(obj["rank"]), [int(i) for i in obj["row_indices"]], SuffStats.from_json(obj["token"]),
                   SuffStats.from_json(obj["trajectory"]), [float(v) for v in obj.get("row_values", [])])


def check_rank_reports(reports: Sequence[RankReport], *, dp: int, planned_rows: Sequence[int], active_targets: int, where: str) -> None:
    """Refuse reports whose ranks are not exactly 0..dp-1, whose rows differ (as a multiset) from the
    plan, or whose token count differs from the active targets counted on the CPU."""
    ranks = sorted(r.rank for r in reports)
    if ranks != list(range(dp)):
        raise InputError(where, f"rank reports came from ranks {ranks}, expected exactly 0..{dp - 1}")
    got = Counter(i for r in reports for i in r.row_indices)
    want = Counter(int(i) for i in planned_rows)
    if got != want:
        missing = sorted((want - got).elements())[:8]
        extra = sorted((got - want).elements())[:8]
        raise InputError(where, f"rank reports cover other rows than planned: missing {missing}, unexpected {extra}")
    n = sum(r.token.n for r in reports)
    if n != active_targets:
        raise InputError(where, f"rank reports count {n:g} active tokens, the CPU counted {active_targets}")


def auroc(scores: Sequence[float], labels: Sequence[float]) -> float | None:
    """AUROC of scores against binary labels (the larger label is positive); None unless exactly two labels."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    uniq = np.unique(y)
    if uniq.size != 2:
        return None
    pos = y == uniq[1]
    # Mann-Whitney U with average ranks for ties.
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(s.size, dtype=np.float64)
    sorted_s = s[order]
    i = 0
    while i < s.size:
        j = i
        while j + 1 < s.size and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


@dataclass(frozen=True)
class WeightingGate:
    ev: float
    positive_batches: int
    batches: int

    @property
    def passed(self) -> bool:
        return self.ev > 0 and self.positive_batches * 2 > self.batches

    def to_json(self) -> dict[str, Any]:
        return {"ev": self.ev, "positive_batches": self.positive_batches, "batches": self.batches, "passed": self.passed}


GATE_CRITERIA = {
    "aggregate_ev": "aggregate EV > 0, from statistics summed over all batches",
    "positive_batches": "positive-EV batches x 2 > batches",
    "weightings": "both token- and trajectory-weighted must pass",
}


def gate_weighting(batch_stats: Sequence[SuffStats], where: str) -> WeightingGate:
    evs = [s.ev(f"{where} batch {k}") for k, s in enumerate(batch_stats)]
    total = SuffStats.merge(batch_stats).ev(f"{where} aggregate")
    return WeightingGate(ev=total, positive_batches=sum(e > 0 for e in evs), batches=len(evs))
