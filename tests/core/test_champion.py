"""The champion rule (docs/rules.md#champion) as a plain function over reports: a challenger
scored beside its family's champion on the same rows passes only if, for both weightings, the
lower bound of the paired bootstrap interval of EV(challenger) - EV(champion) is >= -tolerance.
Cases: better, worse, within tolerance, no champion, and a champion scored on other rows."""

from __future__ import annotations

import numpy as np
import pytest

from tests.core.test_report_stats import synthetic_rows
from value_assets.core.intervals import bootstrap_ev_difference
from value_assets.core.report import ChampionScores, build_report, decide_gate
from value_assets.core.stats import RankReport

pytestmark = pytest.mark.unit
DP = 2


def scored(batches, rows_values):
    """Rank reports of a critic whose values for row i are rows_values[i] (the returns and masks of `batches`)."""
    out = []
    for rows in batches:
        mine = [(i, r, rows_values[i], m) for i, r, _, m in rows]
        out.append([RankReport.from_rows(rank, mine[rank::DP]) for rank in range(DP)])
    return out


def critic(batches, noise, seed):
    """Values 0.5 + 0.2 (R - 0.5) plus noise of sd `noise` for every row (less noise: higher EV)."""
    rng = np.random.default_rng(seed)
    return {
        i: np.clip(0.5 + 0.2 * (r - 0.5) + rng.normal(0, noise, r.size), 0, 1)
        for rows in batches
        for i, r, _, _ in rows
    }


def report(batches, labels, mine, theirs=None, tolerance=0.0):
    active = [int(sum(m.sum() for _, _, _, m in rows)) for rows in batches]
    champion = None
    if theirs is not None:
        champion = ChampionScores(
            partition="champ-0123",
            contract_sha256="c" * 64,
            checkpoint="/ck",
            tolerance=tolerance,
            rank_reports=scored(batches, theirs),
        )
    return build_report(
        manifest_sha256="a" * 64,
        dataset_sha256="b" * 64,
        split="heldout",
        checkpoint="/x",
        contract_sha256="d" * 64,
        dp=DP,
        seed=3,
        global_batch_size=8,
        batches=[[i for i, *_ in rows] for rows in batches],
        rank_reports=scored(batches, mine),
        active_targets=active,
        labels=labels,
        champion=champion,
    )


@pytest.fixture(scope="module")
def data():
    batches, labels = synthetic_rows(0, 0.05, n_batches=6, g=16)
    return batches, labels, critic(batches, 0.05, 1), critic(batches, 0.15, 2)  # good, worse


def test_no_champion_is_the_gate_alone(data):
    batches, labels, good, _ = data
    rep = report(batches, labels, good)
    assert rep["passed"] and "champion" not in rep and decide_gate(rep).champion is None


def test_a_better_challenger_passes_and_a_worse_one_is_refused_by_name(data):
    batches, labels, good, worse = data
    better = report(batches, labels, good, theirs=worse)
    assert better["passed"], better["gate"]
    assert all(better["comparison"][w]["low"] > 0 for w in ("token", "trajectory"))
    assert better["champion"]["aggregates"]["token"]["ev"] < better["aggregates"]["token"]["ev"]
    worse_one = report(batches, labels, worse, theirs=good)
    decision = decide_gate(worse_one)
    assert not worse_one["passed"] and not decision.passed
    assert any("champion rule, token-weighted" in f and "champ-0123" in f for f in decision.failures)
    assert decision.weightings["token"].passed  # the gate itself passed: the champion rule refused


def test_within_tolerance_passes_beyond_it_is_refused(data):
    batches, labels, good, _ = data
    slightly = critic(batches, 0.058, 4)  # a little noisier than `good`
    delta = report(batches, labels, slightly, theirs=good, tolerance=0.5)["comparison"]
    lowest = min(delta[w]["low"] for w in ("token", "trajectory"))
    assert -0.5 < lowest < 0
    assert report(batches, labels, slightly, theirs=good, tolerance=-lowest + 1e-3)["passed"]
    assert not report(batches, labels, slightly, theirs=good, tolerance=max(0.0, -lowest - 1e-3))["passed"]
    same = report(batches, labels, good, theirs=good)  # the champion itself: the difference is exactly 0
    assert same["passed"] and same["comparison"]["token"]["low"] == 0.0 == same["comparison"]["token"]["high"]


def test_the_rule_cannot_be_stated_away(data):
    batches, labels, good, worse = data
    rep = report(batches, labels, worse, theirs=good)
    forged = {**rep, "passed": True, "comparison": report(batches, labels, good, theirs=worse)["comparison"]}
    assert not decide_gate(forged).passed
    # a champion scored on other rows (or other returns) proves nothing about this critic
    other = {**rep, "champion": {**rep["champion"], "batches": rep["champion"]["batches"][::-1]}}
    assert any("other rows" in f for f in decide_gate(other).failures)


def test_paired_difference_interval_against_a_loop():
    """bootstrap_ev_difference: the same resampled units for both critics, EV of summed statistics
    each, then the difference; checked against a plain loop with the same generator draws."""
    rng = np.random.default_rng(5)
    r = rng.integers(0, 2, 40).astype(float)
    a = np.stack([np.ones(40), r, r * r, r - 0.3 * r, (r - 0.3 * r) ** 2], axis=1)
    e_b = r - rng.uniform(0, 1, 40)
    b = np.stack([np.ones(40), r, r * r, e_b, e_b**2], axis=1)
    iv = bootstrap_ev_difference(a, b, resamples=200, seed=9)

    def ev(s):
        n = s[0]
        return 1 - (s[4] / n - (s[3] / n) ** 2) / (s[2] / n - (s[1] / n) ** 2)

    draws = np.random.default_rng(9).integers(0, 40, size=(200, 40))
    diffs = sorted(ev(a[d].sum(0)) - ev(b[d].sum(0)) for d in draws)
    assert iv.estimate == pytest.approx(ev(a.sum(0)) - ev(b.sum(0)), rel=1e-12)
    assert (iv.low, iv.high) == pytest.approx(tuple(np.quantile(diffs, [0.025, 0.975])), rel=1e-9)
