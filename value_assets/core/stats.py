"""Explained variance from float64 sufficient statistics, rank-report checks and the gate (docs/rules.md#evaluation).

Statistics are summed across rows, ranks and batches, and divided once at the end; EVs are never
averaged.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from value_assets.core.errors import InputError

VAR_FLOOR = 1e-8


@dataclass(frozen=True)
class SuffStats:
    """n, sum R, sum R^2, sum e, sum e^2 (e = R - V), all float64."""

    n: float = 0.0
    sum_r: float = 0.0
    sum_r2: float = 0.0
    sum_e: float = 0.0
    sum_e2: float = 0.0

    def __add__(self, other: SuffStats) -> SuffStats:
        return SuffStats(
            self.n + other.n,
            self.sum_r + other.sum_r,
            self.sum_r2 + other.sum_r2,
            self.sum_e + other.sum_e,
            self.sum_e2 + other.sum_e2,
        )

    @staticmethod
    def merge(parts: Iterable[SuffStats]) -> SuffStats:
        total = SuffStats()
        for p in parts:
            total = total + p
        return total

    def to_json(self) -> dict[str, float]:
        return {"n": self.n, "sum_r": self.sum_r, "sum_r2": self.sum_r2, "sum_e": self.sum_e, "sum_e2": self.sum_e2}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SuffStats:
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

    def ev_or_none(self) -> float | None:
        """`ev`, or None where it is undefined (n <= 1, Var(R) <= 1e-8, a non-finite result): the
        in-batch EV of the training metrics, which is reported, never gated (docs/rules.md#critic-metrics)."""
        try:
            return self.ev()
        except InputError:
            return None

    def r2(self) -> float:
        """Coefficient of determination 1 - mean(e^2) / Var(R) (includes the bias, unlike EV)."""
        return 1.0 - (self.sum_e2 / self.n) / self.var_r()

    def bias(self) -> float:
        """Mean residual R - V."""
        return self.sum_e / self.n


def position_deciles(response_length: int) -> np.ndarray:
    """Decile (0..9) of each response token j = 0..L-1: floor(10 j / L)."""
    j = np.arange(response_length)
    return (10 * j) // response_length


def decile_stats(returns: np.ndarray, values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[10, 5] token-weighted sufficient statistics of one row by response decile (active tokens)."""
    returns = np.asarray(returns, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    active = np.asarray(mask).astype(bool)
    d = position_deciles(returns.shape[0])[active]
    r, e = returns[active], (returns - values)[active]
    out = np.zeros((10, 5))
    np.add.at(out[:, 0], d, 1.0)
    np.add.at(out[:, 1], d, r)
    np.add.at(out[:, 2], d, r * r)
    np.add.at(out[:, 3], d, e)
    np.add.at(out[:, 4], d, e * e)
    return out


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


def stats_row(s: SuffStats) -> list[float]:
    """[n, sum R, sum R^2, sum e, sum e^2] of `s`, the row layout of the per-row statistics."""
    return [s.n, s.sum_r, s.sum_r2, s.sum_e, s.sum_e2]


@dataclass
class RankReport:
    """What one data-parallel rank returns for one evaluation batch.

    Besides the rank's totals, the per-row statistics the report's intervals and position table
    need, aligned with `row_indices` (plain nested lists of float64 values; None when a caller
    only checks coverage): `row_token` and `row_trajectory` [rows][5] (`stats_row` layout),
    `row_deciles` [rows][10][5] (token-weighted, by response decile, `intervals.decile_stats`).
    """

    rank: int
    row_indices: list[int]
    token: SuffStats
    trajectory: SuffStats
    row_values: list[float] = field(default_factory=list)  # mean predicted value per row (for AUROC)
    row_token: list[list[float]] | None = None
    row_trajectory: list[list[float]] | None = None
    row_deciles: list[list[list[float]]] | None = None

    @classmethod
    def from_rows(cls, rank: int, rows: Sequence[tuple[int, np.ndarray, np.ndarray, np.ndarray]]) -> RankReport:
        """The report of `rows` = (row index, returns [L], values [L], loss mask [L]) over each row's
        response (L tokens; returns and values float64, mask 0/1)."""

        tok, traj = SuffStats(), SuffStats()
        indices, values, row_tok, row_traj, row_dec = [], [], [], [], []
        for index, ret, val, mask in rows:
            t, j = token_stats(ret, val, mask), trajectory_stats(ret, val, mask)
            tok, traj = tok + t, traj + j
            indices.append(int(index))
            values.append(float(np.asarray(val, dtype=np.float64)[np.asarray(mask).astype(bool)].mean()))
            row_tok.append(stats_row(t))
            row_traj.append(stats_row(j))
            row_dec.append(decile_stats(ret, val, mask).tolist())
        return cls(rank, indices, tok, traj, values, row_tok, row_traj, row_dec)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "row_indices": list(self.row_indices),
            "token": self.token.to_json(),
            "trajectory": self.trajectory.to_json(),
            "row_values": list(self.row_values),
            "row_token": self.row_token,
            "row_trajectory": self.row_trajectory,
            "row_deciles": self.row_deciles,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RankReport:
        def floats(x: Any) -> Any:
            return None if x is None else np.asarray(x, dtype=np.float64).tolist()

        return cls(
            int(obj["rank"]),
            [int(i) for i in obj["row_indices"]],
            SuffStats.from_json(obj["token"]),
            SuffStats.from_json(obj["trajectory"]),
            [float(v) for v in obj.get("row_values", [])],
            floats(obj.get("row_token")),
            floats(obj.get("row_trajectory")),
            floats(obj.get("row_deciles")),
        )


def sums_agree(parts: np.ndarray, total: np.ndarray, rtol: float = 1e-9) -> bool:
    """Whether `parts` [k, ...] sum to `total` [...] up to float64 summation order: each component
    within `rtol` x the sum of the parts' magnitudes (n, an integer count, then exactly)."""
    parts, total = np.asarray(parts, dtype=np.float64), np.asarray(total, dtype=np.float64)
    if not (np.isfinite(parts).all() and np.isfinite(total).all()):
        return False
    return bool(np.all(np.abs(parts.sum(axis=0) - total) <= rtol * np.abs(parts).sum(axis=0)))


def check_row_stats(report: RankReport, where: str) -> None:
    """Refuse a rank report whose per-row statistics are missing, misshapen, or do not add up: per
    row, trajectory n = 1 and the deciles sum to the row's token statistics; over the rows, the
    token and trajectory statistics sum to the rank's totals."""
    rows = len(report.row_indices)
    if report.row_token is None or report.row_trajectory is None or report.row_deciles is None:
        raise InputError(where, f"rank {report.rank}: per-row statistics are missing")
    try:
        tok = np.asarray(report.row_token, dtype=np.float64).reshape(-1, 5)
        traj = np.asarray(report.row_trajectory, dtype=np.float64).reshape(-1, 5)
        dec = np.asarray(report.row_deciles, dtype=np.float64)
        dec = dec.reshape(-1, 10, 5) if dec.size == 0 else dec
    except (TypeError, ValueError):
        raise InputError(where, f"rank {report.rank}: per-row statistics are not numeric arrays") from None
    if tok.shape != (rows, 5) or traj.shape != (rows, 5) or dec.shape != (rows, 10, 5):
        raise InputError(
            where,
            f"rank {report.rank}: per-row statistics have shapes {tok.shape}, {traj.shape}, {dec.shape}; "
            f"expected ({rows}, 5), ({rows}, 5), ({rows}, 10, 5)",
        )
    if rows and not np.all(traj[:, 0] == 1.0):
        raise InputError(where, f"rank {report.rank}: a row's trajectory-weighted n is not 1")
    if not all(sums_agree(dec[i], tok[i]) for i in range(rows)):
        raise InputError(
            where, f"rank {report.rank}: per-row decile statistics do not sum to the row's token statistics"
        )
    if not sums_agree(tok, np.asarray(stats_row(report.token))):
        raise InputError(where, f"rank {report.rank}: per-row token statistics do not sum to the rank's token totals")
    if not sums_agree(traj, np.asarray(stats_row(report.trajectory))):
        raise InputError(
            where, f"rank {report.rank}: per-row trajectory statistics do not sum to the rank's trajectory totals"
        )


def check_rank_reports(
    reports: Sequence[RankReport], *, dp: int, planned_rows: Sequence[int], active_targets: int, where: str
) -> None:
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
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
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
        return {
            "ev": self.ev,
            "positive_batches": self.positive_batches,
            "batches": self.batches,
            "passed": self.passed,
        }


GATE_CRITERIA = {
    "aggregate_ev": "aggregate EV > 0, from statistics summed over all batches",
    "positive_batches": "positive-EV batches x 2 > batches",
    "weightings": "both token- and trajectory-weighted must pass",
}


def gate_weighting(batch_stats: Sequence[SuffStats], where: str) -> WeightingGate:
    evs = [s.ev(f"{where} batch {k}") for k, s in enumerate(batch_stats)]
    total = SuffStats.merge(batch_stats).ev(f"{where} aggregate")
    return WeightingGate(ev=total, positive_batches=sum(e > 0 for e in evs), batches=len(evs))
