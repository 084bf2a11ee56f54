"""The EV report document (SPEC 7): per-batch statistics, aggregates, the gate and its criteria.

`decide_gate` is the one place the gate is decided: the report builder, the `ev_gate` check and
promotion all call it, and it never trusts a report's own verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .errors import InputError
from .stats import GATE_CRITERIA, RankReport, SuffStats, WeightingGate, auroc, check_rank_reports, gate_weighting

SCHEMA = "value-assets.ev-report.v1"
MIXED_ALGORITHM = "value-assets.mixed-label.v1"
GATE_SPLIT = "heldout"
WEIGHTINGS = ("token", "trajectory")
CRITERIA = {**GATE_CRITERIA, "split": f"{GATE_SPLIT} rows only; train-split EV is a fit diagnostic, never the gate"}


@dataclass(frozen=True, kw_only=True)
class GateDecision:
    """The gate over one report: recomputed per weighting, with every reason it fails."""

    passed: bool
    split: Any
    weightings: dict[str, WeightingGate]
    failures: tuple[str, ...]

    @property
    def applies(self) -> bool:
        return self.split == GATE_SPLIT

    def to_json(self) -> dict[str, Any]:
        return {
            "applies": self.applies,
            "reason": None if self.applies else f"split {self.split!r} is a fit diagnostic; only the {GATE_SPLIT} split can gate",
            "passed": self.passed,
            **{w: g.to_json() for w, g in self.weightings.items()},
            "criteria": dict(CRITERIA),
        }


def decide_gate(report: dict[str, Any]) -> GateDecision:
    """Decide the SPEC 7 gate from a report's split and per-batch sufficient statistics.

    Passes only on the heldout split when, for both weightings, the EV of the statistics summed over
    all batches is > 0 and positive-EV batches are a strict majority. Undefined statistics (n <= 1,
    Var(R) at the floor, non-finite) fail the gate with the reason, never as a zero or a None. A
    verdict or aggregate EV the report already states must agree with the recomputation, else the
    gate fails (the builder calls this before stating either).
    """
    split = report.get("split")
    failures: list[str] = []
    weightings: dict[str, WeightingGate] = {}
    if split != GATE_SPLIT:
        failures.append(f"split is {split!r}: only {GATE_SPLIT} rows gate (a manifest without {GATE_SPLIT} is not promotable)")
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
            failures.append(f"{weighting}-weighted: aggregate EV {gate.ev:.4g} (needs > 0), positive-EV batches "
                            f"{gate.positive_batches} of {gate.batches} (needs a strict majority)")
    aggregates = report.get("aggregates")
    if aggregates is not None:
        for weighting, gate in weightings.items():
            stated = ((aggregates if isinstance(aggregates, dict) else {}).get(weighting) or {}).get("ev")
            if isinstance(stated, bool) or not isinstance(stated, (int, float)) or abs(stated - gate.ev) > 1e-9 * max(1.0, abs(gate.ev)):
                failures.append(f"{weighting}-weighted: report's aggregate EV {stated!r} != recomputed {gate.ev!r}")
    if "passed" in report and report["passed"] is not (not failures):
        failures.append(f"report says passed={report['passed']!r}, recomputation says {not failures}")
    return GateDecision(passed=not failures, split=split, weightings=weightings, failures=tuple(failures))


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
    return out


def build_report(*, manifest_sha256: str, dataset_sha256: str, split: str, checkpoint: str, contract_sha256: str,
                 dp: int, seed: int, global_batch_size: int, batches: Sequence[Sequence[int]],
                 rank_reports: Sequence[Sequence[RankReport]], active_targets: Sequence[int],
                 labels: Sequence[float]) -> dict[str, Any]:
    """Check every batch's rank reports, compute EVs from summed statistics and decide the gate.

    `batches[k]` are the planned row indices of batch k, `rank_reports[k]` what the ranks returned
    for it, `active_targets[k]` its active tokens counted on the CPU, and `labels[i]` the scalar
    label of row i (indexed like the dataset).
    """
    if len(rank_reports) != len(batches) or len(active_targets) != len(batches):
        raise InputError("evaluation", f"{len(rank_reports)} reported batches for {len(batches)} planned")
    per_batch = []
    tok_parts: list[SuffStats] = []
    traj_parts: list[SuffStats] = []
    scores: list[float] = []
    score_labels: list[float] = []
    for k, (planned, reports, active) in enumerate(zip(batches, rank_reports, active_targets)):
        check_rank_reports(reports, dp=dp, planned_rows=planned, active_targets=active, where=f"evaluation batch {k}")
        tok = SuffStats.merge(r.token for r in reports)
        traj = SuffStats.merge(r.trajectory for r in reports)
        tok_parts.append(tok)
        traj_parts.append(traj)
        for r in reports:
            for i, v in zip(r.row_indices, r.row_values):
                scores.append(v)
                score_labels.append(float(labels[i]))
        per_batch.append({
            "index": k,
            "rows": list(planned),
            "token": {"stats": tok.to_json(), "ev": tok.ev(f"evaluation batch {k} (token-weighted)")},
            "trajectory": {"stats": traj.to_json(), "ev": traj.ev(f"evaluation batch {k} (trajectory-weighted)")},
        })
    tok_all, traj_all = SuffStats.merge(tok_parts), SuffStats.merge(traj_parts)
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "split": split,
        "source_manifest_sha256": manifest_sha256,
        "dataset_sha256": dataset_sha256,
        "checkpoint": checkpoint,
        "contract_sha256": contract_sha256,
        "execution": {"forward_only": True, "optimizer_steps": 0, "dp": dp},
        "batch_plan": {"algorithm": MIXED_ALGORITHM, "seed": seed, "global_batch_size": global_batch_size,
                       "num_batches": len(batches), "batches": [list(b) for b in batches]},
        "batches": per_batch,
    }
    decision = decide_gate(report)
    if set(decision.weightings) != set(WEIGHTINGS):
        raise InputError("evaluation", "; ".join(decision.failures))
    tok_gate, traj_gate = decision.weightings["token"], decision.weightings["trajectory"]

    def agg(s: SuffStats, g) -> dict[str, Any]:
        return {"stats": s.to_json(), "ev": g.ev, "r2": s.r2(), "bias": s.bias(), "positive_batches": g.positive_batches, "batches": g.batches}

    report["passed"] = decision.passed
    report["aggregates"] = {
        "token": agg(tok_all, tok_gate),
        "trajectory": agg(traj_all, traj_gate),
        "auroc": auroc(scores, score_labels),
    }
    report["gate"] = decision.to_json()
    return report
