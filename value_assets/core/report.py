"""The EV report document (docs/rules.md#evaluation): per-batch statistics, aggregates, EV by response position,
bootstrap intervals, the gate and its criteria.

`decide_gate` is the one place the gate is decided: the report builder, the `ev_gate` check and
promotion all call it, and it never trusts a report's own verdict or stated interval.

Schema `value-assets.ev-report.v1` throughout: `position`, `intervals`, `gate.mode` and the per-row
statistics (`batches[k][weighting]["row_stats"]`) are additions that older readers ignore; a report
without them (written before they existed) is decided by the default rule (`gate.mode` "miles").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from value_assets.core.errors import InputError, show
from value_assets.core.intervals import Interval, bootstrap_ev_difference, bootstrap_ev_interval, ev_of_sums
from value_assets.core.stats import (
    GATE_CRITERIA,
    RankReport,
    SuffStats,
    WeightingGate,
    auroc,
    check_rank_reports,
    check_row_stats,
    gate_weighting,
    stats_row,
    sums_agree,
)

SCHEMA = "value-assets.ev-report.v1"
MIXED_ALGORITHM = "value-assets.mixed-label.v1"
GATE_SPLIT = "heldout"
WEIGHTINGS = ("token", "trajectory")
CRITERIA = {**GATE_CRITERIA, "split": f"{GATE_SPLIT} rows only; train-split EV is a fit diagnostic, never the gate"}
GATE_MODES = ("miles", "interval")  # "miles": the Miles-compatible rule above (the default); "interval": stricter
GATE_MODE_DEFAULT = "miles"  # also the mode of a report written before reports stated theirs
INTERVAL_CRITERION = (
    "the lower bound of the bootstrap 95% interval of the aggregate EV (over rows) is > 0, for both weightings"
)
MIN_EV_DEFAULT = 0.0  # Miles' rule: any positive EV passes
CHAMPION_CRITERION = (
    "the lower bound of the paired bootstrap 95% interval of EV(this critic) - EV(the family champion), over the "
    "same rows, is >= -tolerance, for both weightings"
)
INTERVAL_LEVEL = 0.95
INTERVAL_RESAMPLES = 2000
INTERVAL_UNIT = "row"
POSITION_DEFINITION = (
    "response token j of a response of length L is in decile floor(10 j / L); token-weighted, active tokens"
)


def criteria(mode: str, min_ev: float = MIN_EV_DEFAULT) -> dict[str, str]:
    """The gate's criteria in words for `mode` and the minimum EV."""
    out = {**CRITERIA, "interval": INTERVAL_CRITERION} if mode == "interval" else dict(CRITERIA)
    if min_ev != MIN_EV_DEFAULT:
        what = "the lower bound of each aggregate EV's interval" if mode == "interval" else "each aggregate EV"
        out["min_ev"] = f"{what} is > {min_ev!r} (the minimum useful EV), for both weightings"
    return out


def check_min_ev(value: Any, name: str = "gate_min_ev") -> float:
    """A minimum EV: a finite number in [0, 1) (0 is Miles' rule)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value < 1:
        raise InputError(
            name,
            f"must be a number in [0, 1) (the least aggregate EV that passes; 0 is Miles' rule), got {show(value)}",
        )
    return float(value)


@dataclass(frozen=True, kw_only=True)
class GateDecision:
    """The gate over one report: recomputed per weighting, with every reason it fails.

    `intervals` are the bootstrap intervals recomputed from the report's per-row statistics (empty
    when the report has none: a report written before they existed, decided in "miles" mode)."""

    passed: bool
    split: object  # the report's split as stated: any JSON value
    mode: Any
    weightings: dict[str, WeightingGate]
    intervals: dict[str, Interval]
    failures: tuple[str, ...]
    min_ev: float = MIN_EV_DEFAULT
    champion: dict[str, Interval] | None = None
    """Per weighting, the paired interval of EV(this critic) - EV(the family champion) on the same
    rows, when the report scores a champion (docs/rules.md#champion); None when it does not."""
    champion_tolerance: float | None = None

    @property
    def applies(self) -> bool:
        return self.split == GATE_SPLIT

    def to_json(self) -> dict[str, Any]:
        out = {
            "applies": self.applies,
            "reason": None
            if self.applies
            else f"split {self.split!r} is a fit diagnostic; only the {GATE_SPLIT} split can gate",
            "passed": self.passed,
            "mode": self.mode,
            "min_ev": self.min_ev,
            **{w: g.to_json() for w, g in self.weightings.items()},
            "criteria": criteria(self.mode, self.min_ev),
        }
        if self.mode == "interval":
            out["interval_low"] = {w: (iv.low if iv is not None else None) for w, iv in self.intervals.items()}
        if self.champion is not None:
            out["champion_tolerance"] = self.champion_tolerance
            out["champion_criterion"] = CHAMPION_CRITERION
            out["champion_delta_low"] = {w: iv.low for w, iv in self.champion.items()}
        return out


def _row_parts(batches: Any) -> tuple[dict[str, np.ndarray] | None, str | None]:
    """Per weighting, the [rows, 5] statistics of every evaluated row (batch order, then planned row
    order), checked to sum to each batch's statistics; or None and why not."""
    if not isinstance(batches, list) or not batches:
        return None, "the report has no per-batch statistics"
    out: dict[str, list[np.ndarray]] = {w: [] for w in WEIGHTINGS}
    try:
        for k, batch in enumerate(batches):
            rows = batch["rows"]
            for weighting in WEIGHTINGS:
                raw = batch[weighting].get("row_stats")
                if raw is None:
                    return None, f"batch {k} has no per-row {weighting}-weighted statistics"
                parts = np.asarray(raw, dtype=np.float64).reshape(-1, 5)
                if parts.shape[0] != len(rows):
                    return (
                        None,
                        f"batch {k}: {parts.shape[0]} per-row {weighting}-weighted statistics for {len(rows)} rows",
                    )
                total = np.asarray(stats_row(SuffStats.from_json(batch[weighting]["stats"])))
                if not sums_agree(parts, total) or (weighting == "trajectory" and not np.all(parts[:, 0] == 1.0)):
                    return None, f"batch {k}: per-row {weighting}-weighted statistics do not sum to the batch's"
                out[weighting].append(parts)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        return None, f"malformed per-row statistics: {exc!r}"
    return {w: np.concatenate(p) for w, p in out.items()}, None


def _interval_seed(report: dict[str, Any]) -> int | None:
    seed = (report.get("batch_plan") or {}).get("seed") if isinstance(report.get("batch_plan"), dict) else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def row_intervals(parts: dict[str, np.ndarray], seed: int) -> dict[str, Interval]:
    """Per weighting, the percentile bootstrap interval of the aggregate EV over rows (units)."""
    return {
        w: bootstrap_ev_interval(
            [SuffStats(*row) for row in parts[w].tolist()],
            resamples=INTERVAL_RESAMPLES,
            level=INTERVAL_LEVEL,
            seed=seed,
        )
        for w in WEIGHTINGS
    }


def interval_json(iv: Interval, seed: int) -> dict[str, Any]:
    return {**iv.to_json(), "seed": seed, "unit": INTERVAL_UNIT}


def _same_interval(stated: Any, recomputed: dict[str, Any]) -> bool:
    """Whether a stated interval is the recomputed one: the same keys, counts and seed exactly, the
    bounds to 1e-9 relative (the bootstrap's float64 sums may differ in the last bits between the
    machine that evaluated and the one that decides), None exactly where recomputed is None."""
    if not isinstance(stated, dict) or set(stated) != set(recomputed):
        return False
    for key, want in recomputed.items():
        got = stated[key]
        if isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
            if abs(got - want) > 1e-9 * max(1.0, abs(want)):
                return False
        elif type(got) is not type(want) or got != want:
            return False
    return True


def decide_gate(report: dict[str, Any]) -> GateDecision:
    """Decide the docs/rules.md#evaluation gate from a report's split, gate mode and per-batch sufficient statistics.

    Passes only on the heldout split when, for both weightings, the EV of the statistics summed over
    all batches is > 0 and positive-EV batches are a strict majority. In mode "interval" (read from
    `gate.mode`; absent: "miles"), the lower bound of the bootstrap interval over rows, recomputed
    from the per-row statistics (which must sum to each batch's), must also be > 0 for both
    weightings. Undefined statistics (n <= 1, Var(R) at the floor, non-finite) fail the gate with
    the reason, never as a zero or a None. A verdict, aggregate EV or interval the report already
    states must agree with the recomputation, else the gate fails (the builder calls this before
    stating any).
    """
    split = report.get("split")
    failures: list[str] = []
    weightings: dict[str, WeightingGate] = {}
    gate_json = report.get("gate")
    mode = gate_json.get("mode", GATE_MODE_DEFAULT) if isinstance(gate_json, dict) else GATE_MODE_DEFAULT
    if mode not in GATE_MODES:
        failures.append(f"gate mode {mode!r} is not one of {', '.join(GATE_MODES)}")
    min_ev = gate_json.get("min_ev", MIN_EV_DEFAULT) if isinstance(gate_json, dict) else MIN_EV_DEFAULT
    try:
        min_ev = check_min_ev(min_ev, "gate.min_ev")
    except InputError as exc:
        failures.append(str(exc))
        min_ev = MIN_EV_DEFAULT
    if split != GATE_SPLIT:
        failures.append(
            f"split is {split!r}: only {GATE_SPLIT} rows gate (a manifest without {GATE_SPLIT} is not promotable)"
        )
    batches = report.get("batches")
    for weighting in WEIGHTINGS:
        try:
            if not isinstance(batches, list) or not batches:
                raise InputError("report", "has no per-batch statistics")
            parts = [SuffStats.from_json(batch[weighting]["stats"]) for batch in batches]
            gate = gate_weighting(parts, f"{weighting}-weighted EV")
        except (InputError, KeyError, TypeError, ValueError) as exc:
            failures.append(f"{weighting}-weighted: cannot recompute the gate: {exc}")
            continue
        weightings[weighting] = gate
        if not gate.passed:
            failures.append(
                f"{weighting}-weighted: aggregate EV {gate.ev:.4g} (needs > 0), positive-EV batches "
                f"{gate.positive_batches} of {gate.batches} (needs a strict majority)"
            )
        elif mode == "miles" and not gate.ev > min_ev:
            failures.append(
                f"{weighting}-weighted: aggregate EV {gate.ev:.4g} is not above the minimum useful EV {min_ev!r} "
                "(gate.min_ev)"
            )
    aggregates = report.get("aggregates")
    if aggregates is not None:
        for weighting, gate in weightings.items():
            stated = ((aggregates if isinstance(aggregates, dict) else {}).get(weighting) or {}).get("ev")
            if (
                isinstance(stated, bool)
                or not isinstance(stated, (int, float))
                or abs(stated - gate.ev) > 1e-9 * max(1.0, abs(gate.ev))
            ):
                failures.append(f"{weighting}-weighted: report's aggregate EV {stated!r} != recomputed {gate.ev!r}")
    # Intervals are recomputed whenever the per-row statistics allow; missing ones fail the gate
    # only in interval mode or when the report states intervals it cannot back.
    intervals: dict[str, Interval] = {}
    stated_intervals = report.get("intervals")
    row_parts, problem = _row_parts(batches)
    seed = _interval_seed(report)
    if row_parts is not None and seed is None:
        row_parts, problem = None, "the batch plan states no integer seed for the bootstrap"
    if row_parts is not None:
        assert seed is not None  # without a seed, row_parts was dropped just above
        intervals = row_intervals(row_parts, seed)
    elif mode == "interval" or stated_intervals is not None:
        failures.append(f"cannot recompute the EV intervals: {problem}")
    if mode == "interval":
        for weighting, iv in intervals.items():
            if iv.low is None or not iv.low > min_ev:
                failures.append(
                    f"{weighting}-weighted: lower bound of the {iv.level:.0%} interval of the aggregate EV "
                    f"is {iv.low!r} (needs > {min_ev!r}; interval mode)"
                )
    if stated_intervals is not None:
        for weighting, iv in intervals.items():
            assert seed is not None  # intervals are recomputed only with a seed
            stated = (stated_intervals if isinstance(stated_intervals, dict) else {}).get(weighting)
            if not _same_interval(stated, interval_json(iv, seed)):
                failures.append(
                    f"{weighting}-weighted: report's interval {stated!r} != recomputed {interval_json(iv, seed)!r}"
                )
    champion, tolerance = _champion_rule(report, row_parts, problem, seed, failures)
    if "passed" in report and report["passed"] is not (not failures):
        failures.append(f"report says passed={report['passed']!r}, recomputation says {not failures}")
    return GateDecision(
        passed=not failures,
        split=split,
        mode=mode,
        weightings=weightings,
        intervals=intervals,
        failures=tuple(failures),
        min_ev=min_ev,
        champion=champion,
        champion_tolerance=tolerance,
    )


def _champion_rule(
    report: dict[str, Any],
    row_parts: dict[str, np.ndarray] | None,
    problem: str | None,
    seed: int | None,
    failures: list[str],
) -> tuple[dict[str, Interval] | None, float | None]:
    """docs/rules.md#champion: when the report scores the family champion on the same rows, this
    critic passes only if, for both weightings, the lower bound of the paired bootstrap interval of
    EV(this) - EV(champion) is >= -tolerance. The champion's statistics must be of exactly the rows
    this critic was scored on, with the same returns; stated aggregates and intervals must be the
    recomputed ones. Appends the failures; returns the intervals and the tolerance."""
    champion = report.get("champion")
    if champion is None:
        return None, None
    gate_json = report.get("gate")
    tolerance = gate_json.get("champion_tolerance") if isinstance(gate_json, dict) else None
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        failures.append(f"champion rule: gate.champion_tolerance must be a number in [0, 1), got {tolerance!r}")
        return {}, None
    tolerance = float(tolerance)
    if not isinstance(champion, dict):
        failures.append("champion rule: the report's champion section is not an object")
        return {}, tolerance
    if row_parts is None or seed is None:
        failures.append(f"champion rule: cannot recompute the comparison: {problem or 'no seed'}")
        return {}, tolerance
    theirs, their_problem = _row_parts(champion.get("batches"))
    mine_rows = [b.get("rows") for b in report.get("batches") or []]
    their_rows = [b.get("rows") if isinstance(b, dict) else None for b in champion.get("batches") or []]
    if theirs is None:
        failures.append(f"champion rule: cannot recompute the champion's statistics: {their_problem}")
        return {}, tolerance
    if their_rows != mine_rows or any(
        not np.allclose(theirs[w][:, :3], row_parts[w][:, :3], rtol=1e-9, atol=0.0) for w in WEIGHTINGS
    ):
        failures.append("champion rule: the champion was scored on other rows or returns than this critic")
        return {}, tolerance
    intervals: dict[str, Interval] = {}
    for weighting in WEIGHTINGS:
        iv = bootstrap_ev_difference(
            row_parts[weighting], theirs[weighting], resamples=INTERVAL_RESAMPLES, level=INTERVAL_LEVEL, seed=seed
        )
        intervals[weighting] = iv
        if iv.low is None or iv.low < -tolerance:
            bounds = "undefined" if iv.low is None else f"[{iv.low:.4g}, {iv.high:.4g}]"
            failures.append(
                f"champion rule, {weighting}-weighted: EV(this) - EV(champion {champion.get('partition')!r}) is "
                f"{iv.estimate!r}, {iv.level:.0%} interval {bounds}; its lower bound must be >= -{tolerance!r}"
            )
    stated = report.get("comparison")
    if stated is not None:
        for weighting, iv in intervals.items():
            want = interval_json(iv, seed)
            if not _same_interval((stated if isinstance(stated, dict) else {}).get(weighting), want):
                failures.append(f"champion rule, {weighting}-weighted: report's comparison != recomputed {want!r}")
    return intervals, tolerance


def report_manifest_sha(report: dict[str, Any]) -> Any:
    return report.get("source_manifest_sha256", report.get("manifest_sha256"))


def ev_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The gate-relevant numbers an EV report states, flat for metadata (not re-decided here)."""
    aggregates = report.get("aggregates") or {}
    out: dict[str, Any] = {"passed": report.get("passed") is True, "split": report.get("split")}
    for weighting in WEIGHTINGS:
        agg = aggregates.get(weighting) or {}
        for field in ("ev", "positive_batches", "batches", "r2", "bias"):
            out[f"{weighting}_{field}"] = agg.get(field)
    out["auroc"] = aggregates.get("auroc")
    intervals = report.get("intervals")
    if not isinstance(intervals, dict):
        intervals = {}
    for weighting in WEIGHTINGS:
        iv = intervals.get(weighting) or {}
        out[f"{weighting}_ev_low"] = iv.get("low")
        out[f"{weighting}_ev_high"] = iv.get("high")
    gate = report.get("gate")
    if not isinstance(gate, dict):
        gate = {}
    out["gate_mode"] = gate.get("mode", GATE_MODE_DEFAULT)
    out["gate_min_ev"] = gate.get("min_ev", MIN_EV_DEFAULT)
    champion = report.get("champion")
    if isinstance(champion, dict):  # the family champion beside this critic (docs/rules.md#champion)
        out["champion_partition"] = champion.get("partition")
        out["champion_contract_sha256"] = champion.get("contract_sha256")
        out["champion_tolerance"] = gate.get("champion_tolerance")
        aggregates_raw, comparison_raw = champion.get("aggregates"), report.get("comparison")
        theirs: dict[str, Any] = aggregates_raw if isinstance(aggregates_raw, dict) else {}
        comparison: dict[str, Any] = comparison_raw if isinstance(comparison_raw, dict) else {}
        for weighting in WEIGHTINGS:
            out[f"champion_{weighting}_ev"] = (theirs.get(weighting) or {}).get("ev")
            delta = comparison.get(weighting) or {}
            out[f"vs_champion_{weighting}_ev_delta"] = delta.get("estimate")
            out[f"vs_champion_{weighting}_ev_delta_low"] = delta.get("low")
    return out


def position_table(deciles: np.ndarray) -> dict[str, Any]:
    """The `position` section from summed token-weighted decile statistics [10, 5]: per decile its
    statistics, n and EV (None where undefined: n <= 1 or no return variance; never 0)."""
    evs = ev_of_sums(deciles)
    rows = []
    for d in range(10):
        stats = SuffStats(*deciles[d].tolist())
        rows.append(
            {
                "decile": d,
                "range": [d / 10, (d + 1) / 10],
                "n": stats.n,
                "stats": stats.to_json(),
                "ev": None if np.isnan(evs[d]) else float(evs[d]),
            }
        )
    return {"weighting": "token", "definition": POSITION_DEFINITION, "deciles": rows}


@dataclass(frozen=True, kw_only=True)
class ChampionScores:
    """The family champion scored on the challenger's evaluation batches (docs/rules.md#champion)."""

    partition: str | None
    contract_sha256: str
    checkpoint: str
    tolerance: float
    rank_reports: Sequence[Sequence[RankReport]]


@dataclass
class _Scored:
    """One critic's statistics over the evaluation batches (see `build_report`)."""

    per_batch: list[dict[str, Any]]
    token: list[SuffStats]
    trajectory: list[SuffStats]
    deciles: np.ndarray
    scores: list[float]
    score_labels: list[float]


def _score_batches(
    batches: Sequence[Sequence[int]],
    rank_reports: Sequence[Sequence[RankReport]],
    active_targets: Sequence[int],
    labels: Sequence[float],
    *,
    dp: int,
    where: str,
) -> _Scored:
    """Check every batch's rank reports (coverage, totals, per-row statistics) and lay them out
    per batch: statistics, EV and per-row statistics for both weightings."""
    if len(rank_reports) != len(batches) or len(active_targets) != len(batches):
        raise InputError("evaluation", f"{len(rank_reports)} reported batches for {len(batches)} planned")
    out = _Scored([], [], [], np.zeros((10, 5)), [], [])
    for k, (planned, reports, active) in enumerate(zip(batches, rank_reports, active_targets, strict=True)):
        at = f"{where} {k}"
        check_rank_reports(reports, dp=dp, planned_rows=planned, active_targets=active, where=at)
        for r in reports:
            check_row_stats(r, at)
        tok = SuffStats.merge(r.token for r in reports)
        traj = SuffStats.merge(r.trajectory for r in reports)
        out.token.append(tok)
        out.trajectory.append(traj)
        # Per-row statistics in planned row order (rows of a batch are distinct; a duplicate takes
        # the reported entries in turn).
        reported: dict[int, list[tuple[list[float], list[float]]]] = {}
        for r in reports:
            assert r.row_token is not None and r.row_trajectory is not None  # check_row_stats refused None above
            for i, t, j in zip(r.row_indices, r.row_token, r.row_trajectory, strict=True):
                reported.setdefault(i, []).append((t, j))
            out.deciles += np.asarray(r.row_deciles, dtype=np.float64).reshape(-1, 10, 5).sum(axis=0)
            for i, v in zip(r.row_indices, r.row_values, strict=True):
                out.scores.append(v)
                out.score_labels.append(float(labels[i]))
        ordered = [reported[int(i)].pop(0) for i in planned]
        out.per_batch.append(
            {
                "index": k,
                "rows": list(planned),
                "token": {
                    "stats": tok.to_json(),
                    "ev": tok.ev(f"{at} (token-weighted)"),
                    "row_stats": [t for t, _ in ordered],
                },
                "trajectory": {
                    "stats": traj.to_json(),
                    "ev": traj.ev(f"{at} (trajectory-weighted)"),
                    "row_stats": [j for _, j in ordered],
                },
            }
        )
    return out


def build_report(
    *,
    manifest_sha256: str,
    dataset_sha256: str,
    split: str,
    checkpoint: str,
    contract_sha256: str,
    dp: int,
    seed: int,
    global_batch_size: int,
    batches: Sequence[Sequence[int]],
    rank_reports: Sequence[Sequence[RankReport]],
    active_targets: Sequence[int],
    labels: Sequence[float],
    gate_mode: str = GATE_MODE_DEFAULT,
    gate_min_ev: float = MIN_EV_DEFAULT,
    training_spec_sha256: str | None = None,
    champion: ChampionScores | None = None,
) -> dict[str, Any]:
    """Check every batch's rank reports, compute EVs from summed statistics and decide the gate.

    `batches[k]` are the planned row indices of batch k, `rank_reports[k]` what the ranks returned
    for it, `active_targets[k]` its active tokens counted on the CPU, and `labels[i]` the scalar
    label of row i (indexed like the dataset). Every rank report must carry per-row statistics that
    add up to its totals (`check_row_stats`); they give the position table and, with the seed, the
    bootstrap intervals. `gate_mode` is "miles" (the default rule) or "interval" (stricter);
    `gate_min_ev` raises the bar from > 0 to > it (the aggregate EV in "miles", the interval's lower
    bound in "interval"). `champion`: the family champion's rank reports on the same batches; the
    report then holds its statistics beside this critic's and the gate also applies the champion
    rule (docs/rules.md#champion).
    """
    if gate_mode not in GATE_MODES:
        raise InputError("gate_mode", f"must be one of {', '.join(GATE_MODES)}, got {gate_mode!r}")
    gate_min_ev = check_min_ev(gate_min_ev)
    if len(rank_reports) != len(batches) or len(active_targets) != len(batches):
        raise InputError("evaluation", f"{len(rank_reports)} reported batches for {len(batches)} planned")
    scored = _score_batches(batches, rank_reports, active_targets, labels, dp=dp, where="evaluation batch")
    per_batch, tok_parts, traj_parts = scored.per_batch, scored.token, scored.trajectory
    deciles, scores, score_labels = scored.deciles, scored.scores, scored.score_labels
    tok_all, traj_all = SuffStats.merge(tok_parts), SuffStats.merge(traj_parts)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "split": split,
        "source_manifest_sha256": manifest_sha256,
        "dataset_sha256": dataset_sha256,
        "checkpoint": checkpoint,
        "contract_sha256": contract_sha256,
        "execution": {"forward_only": True, "optimizer_steps": 0, "dp": dp},
        "batch_plan": {
            "algorithm": MIXED_ALGORITHM,
            "seed": seed,
            "global_batch_size": global_batch_size,
            "num_batches": len(batches),
            "batches": [list(b) for b in batches],
        },
        "batches": per_batch,
        "gate": {"mode": gate_mode, "min_ev": gate_min_ev},
    }
    if training_spec_sha256 is not None:
        report["training_spec_sha256"] = training_spec_sha256
    if champion is not None:
        theirs = _score_batches(batches, champion.rank_reports, active_targets, labels, dp=dp, where="champion batch")
        report["champion"] = {
            "partition": champion.partition,
            "contract_sha256": champion.contract_sha256,
            "checkpoint": champion.checkpoint,
            "batches": theirs.per_batch,
            "aggregates": {
                "token": {"stats": SuffStats.merge(theirs.token).to_json(), "ev": SuffStats.merge(theirs.token).ev()},
                "trajectory": {
                    "stats": SuffStats.merge(theirs.trajectory).to_json(),
                    "ev": SuffStats.merge(theirs.trajectory).ev(),
                },
            },
        }
        report["gate"]["champion_tolerance"] = champion.tolerance
    decision = decide_gate(report)
    if set(decision.weightings) != set(WEIGHTINGS) or set(decision.intervals) != set(WEIGHTINGS):
        raise InputError("evaluation", "; ".join(decision.failures))
    tok_gate, traj_gate = decision.weightings["token"], decision.weightings["trajectory"]

    def agg(s: SuffStats, g: WeightingGate) -> dict[str, Any]:
        return {
            "stats": s.to_json(),
            "ev": g.ev,
            "r2": s.r2(),
            "bias": s.bias(),
            "positive_batches": g.positive_batches,
            "batches": g.batches,
        }

    report["passed"] = decision.passed
    report["aggregates"] = {
        "token": agg(tok_all, tok_gate),
        "trajectory": agg(traj_all, traj_gate),
        "auroc": auroc(scores, score_labels),
    }
    report["intervals"] = {w: interval_json(decision.intervals[w], seed) for w in WEIGHTINGS}
    if decision.champion is not None:
        report["comparison"] = {w: interval_json(iv, seed) for w, iv in decision.champion.items()}
    report["position"] = position_table(deciles)
    report["gate"] = decision.to_json()
    return report
