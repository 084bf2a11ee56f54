"""The gate on negative controls: verdicts under every rule, and how unusual each control's EV is.

    python bench/gate_controls.py REPORT.json... [--min-ev 0.005] [--permutations 5000] [--out TABLE.md]

For each EV report (e.g. the shuffled-reward controls that `bench/real_rollouts.py study
--shuffle-seeds ...` keeps under `reports/`), decides the gate again with `decide_gate` under the
`miles` rule, the `interval` rule and the `interval` rule with `--min-ev` (only the report's
`gate` block changes; everything is recomputed from its per-row statistics), and runs a
permutation test: the critic's per-row trajectory values are held fixed and the rows' returns are
permuted among the evaluated rows, so the p-value says how often a critic with exactly these
predictions would reach the report's trajectory EV against labels that carry no information.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from value_assets.core.intervals import ev_of_sums
from value_assets.core.report import decide_gate


def trajectory_rows(report: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per evaluated row (trajectory weighting: one unit per row, token terms averaged over the
    row): its return R, the mean value V and the mean squared value V2 of its response tokens,
    recovered from the row's statistics (sum e = R - V, sum e^2 = R^2 - 2 R V + V2)."""
    m = np.array([row for batch in report["batches"] for row in batch["trajectory"]["row_stats"]], dtype=np.float64)
    r = m[:, 1]
    v = r - m[:, 3]
    v2 = m[:, 4] - r**2 + 2 * r * v
    return r, v, v2


def ev(r: np.ndarray, v: np.ndarray, v2: np.ndarray) -> float:
    """The report's trajectory-weighted EV of returns `r` against these values (ev_of_sums)."""
    e, e2 = r - v, r**2 - 2 * r * v + v2
    stats = np.array([len(r), r.sum(), (r**2).sum(), e.sum(), e2.sum()])
    return float(ev_of_sums(stats))


def decide_under(report: dict, mode: str, min_ev: float):
    """The gate of `report` decided again under another rule: `decide_gate` recomputes everything
    from the per-row statistics, so only the `gate` block's mode and minimum EV change (the
    report's own verdict is dropped)."""
    again = {k: x for k, x in report.items() if k != "passed"}
    again["gate"] = {"mode": mode, "min_ev": min_ev}
    return decide_gate(again)


def verdict(report: dict, mode: str, min_ev: float) -> bool:
    return decide_under(report, mode, min_ev).passed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--min-ev", type=float, default=0.005)
    ap.add_argument("--permutations", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    word = {True: "PASSED", False: "FAILED"}
    lines = [
        "| report | rows | trajectory EV | corr(V, R) | permutation p | miles | interval | interval, min EV "
        f"{args.min_ev:g} |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for path in args.reports:
        report = json.loads(Path(path).read_text())
        r, v, v2 = trajectory_rows(report)
        obs = ev(r, v, v2)
        assert abs(obs - report["aggregates"]["trajectory"]["ev"]) < 1e-9, (
            obs,
            report["aggregates"]["trajectory"]["ev"],
        )
        rng = np.random.default_rng(args.seed)
        null = np.array([ev(rng.permutation(r), v, v2) for _ in range(args.permutations)])
        p = (1 + int((null >= obs).sum())) / (1 + args.permutations)
        corr = float(np.corrcoef(r, v)[0, 1])
        lines.append(
            f"| {Path(path).stem} | {len(r)} | {obs:.5f} | {corr:+.3f} | {p:.4f} | "
            f"{word[verdict(report, 'miles', 0.0)]} | "
            f"{word[verdict(report, 'interval', 0.0)]} | {word[verdict(report, 'interval', args.min_ev)]} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
