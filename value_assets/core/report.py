"""The EV report document (SPEC 7): per-batch statistics, aggregates, the gate and its criteria."""

from __future__ import annotations

from typing import Any, Sequence

from .errors import InputError
from .stats import GATE_CRITERIA, RankReport, SuffStats, auroc, check_rank_reports, gate_weighting

SCHEMA = "value-assets.ev-report.v1"
MIXED_ALGORITHM = "value-assets.mixed-label.v1"


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
    tok_gate = gate_weighting(tok_parts, "token-weighted EV")
    traj_gate = gate_weighting(traj_parts, "trajectory-weighted EV")
    tok_all, traj_all = SuffStats.merge(tok_parts), SuffStats.merge(traj_parts)
    gated = split == "heldout"
    passed = gated and tok_gate.passed and traj_gate.passed

    def agg(s: SuffStats, g) -> dict[str, Any]:
        return {"stats": s.to_json(), "ev": g.ev, "r2": s.r2(), "bias": s.bias(), "positive_batches": g.positive_batches, "batches": g.batches}

    return {
        "schema": SCHEMA,
        "passed": passed,
        "split": split,
        "source_manifest_sha256": manifest_sha256,
        "dataset_sha256": dataset_sha256,
        "checkpoint": checkpoint,
        "contract_sha256": contract_sha256,
        "execution": {"forward_only": True, "optimizer_steps": 0, "dp": dp},
        "batch_plan": {"algorithm": MIXED_ALGORITHM, "seed": seed, "global_batch_size": global_batch_size,
                       "num_batches": len(batches), "batches": [list(b) for b in batches]},
        "batches": per_batch,
        "aggregates": {
            "token": agg(tok_all, tok_gate),
            "trajectory": agg(traj_all, traj_gate),
            "auroc": auroc(scores, score_labels),
        },
        "gate": {
            "applies": gated,
            "reason": None if gated else f"split {split!r} is a fit diagnostic; only the heldout split can gate",
            "passed": passed,
            "token": tok_gate.to_json(),
            "trajectory": traj_gate.to_json(),
            "criteria": dict(GATE_CRITERIA),
        },
    }
