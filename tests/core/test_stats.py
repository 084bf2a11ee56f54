"""docs/rules.md#evaluation statistics: mergeable float64 sums, EV against numpy/sklearn/naive references, rank-report
refusals, AUROC and the gate."""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from value_assets.core.errors import InputError
from value_assets.core.report import build_report
from value_assets.core.stats import (
    RankReport,
    SuffStats,
    WeightingGate,
    auroc,
    check_rank_reports,
    gate_weighting,
    token_stats,
    trajectory_stats,
)

pytestmark = pytest.mark.unit

finite = st.floats(-10, 10, allow_nan=False)


@st.composite
def token_rows(draw, min_rows=2, max_rows=12):
    out = []
    for _ in range(draw(st.integers(min_rows, max_rows))):
        k = draw(st.integers(1, 6))
        r = np.array(draw(st.lists(finite, min_size=k, max_size=k)))
        v = np.array(draw(st.lists(finite, min_size=k, max_size=k)))
        m = np.array(draw(st.lists(st.integers(0, 1), min_size=k, max_size=k)))
        m[draw(st.integers(0, k - 1))] = 1
        out.append((r, v, m))
    return out


def close(a: SuffStats, b: SuffStats):
    for x, y in zip(a.to_json().values(), b.to_json().values(), strict=True):
        assert math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9), (a, b)


@settings(max_examples=150, deadline=None)
@given(rows=token_rows(), cut=st.data())
def test_merge_shards_equals_union(rows, cut):
    k = cut.draw(st.integers(0, len(rows)))
    r = np.concatenate([x[0] for x in rows])
    v = np.concatenate([x[1] for x in rows])
    m = np.concatenate([x[2] for x in rows])
    union = token_stats(r, v, m)
    per_row = SuffStats.merge(token_stats(*x) for x in rows)
    close(per_row, union)
    left = SuffStats.merge(token_stats(*x) for x in rows[:k])
    right = SuffStats.merge(token_stats(*x) for x in rows[k:])
    close(left + right, union)
    close(right + left, union)
    assert union.n == m.sum()


@settings(max_examples=150, deadline=None)
@given(rows=token_rows())
def test_token_ev_matches_numpy_and_sklearn(rows):
    from sklearn.metrics import explained_variance_score  # here, not at collection: ~2 s in every test process

    r = np.concatenate([x[0][x[2] == 1] for x in rows])
    v = np.concatenate([x[1][x[2] == 1] for x in rows])
    assume(r.size > 1 and r.var() > 1e-3)
    s = SuffStats.merge(token_stats(*x) for x in rows)
    ref = 1.0 - np.var(r - v) / np.var(r)
    assert math.isclose(s.ev(), ref, rel_tol=1e-7, abs_tol=1e-9)
    assert math.isclose(s.ev(), explained_variance_score(r, v), rel_tol=1e-7, abs_tol=1e-9)
    assert math.isclose(s.bias(), float(np.mean(r - v)), rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(s.r2(), 1.0 - np.mean((r - v) ** 2) / np.var(r), rel_tol=1e-7, abs_tol=1e-9)


@settings(max_examples=150, deadline=None)
@given(rows=token_rows())
def test_trajectory_ev_matches_naive_loop(rows):
    rbar, ebar = [], []
    for r, v, m in rows:
        act = [i for i in range(len(m)) if m[i] == 1]
        rbar.append(sum(r[i] for i in act) / len(act))
        ebar.append(
            (
                sum(r[i] - v[i] for i in act) / len(act),
                sum((r[i] - v[i]) ** 2 for i in act) / len(act),
                sum(r[i] ** 2 for i in act) / len(act),
            )
        )
    n = len(rows)
    s = SuffStats.merge(trajectory_stats(*x) for x in rows)
    assert s.n == n
    mean_r = sum(rbar) / n
    var_r = sum(e[2] for e in ebar) / n - mean_r**2
    mean_e = sum(e[0] for e in ebar) / n
    var_e = sum(e[1] for e in ebar) / n - mean_e**2
    assume(var_r > 1e-3)
    assert math.isclose(s.ev(), 1 - var_e / var_r, rel_tol=1e-7, abs_tol=1e-9)


def test_trajectory_weighting_weighs_rows_equally():
    # one long row, one short row: the token weighting follows the long row, the trajectory one does not
    long = (np.ones(9), np.ones(9), np.ones(9))
    short = (np.zeros(1), np.ones(1), np.ones(1))
    t = SuffStats.merge([trajectory_stats(*long), trajectory_stats(*short)])
    assert t.n == 2 and t.sum_r == 1.0 and t.sum_e == -1.0
    k = SuffStats.merge([token_stats(*long), token_stats(*short)])
    assert k.n == 10 and k.sum_r == 9.0


def test_ev_undefined_raises_not_zero():
    with pytest.raises(InputError, match="n = 1"):
        token_stats(np.array([0.3]), np.array([0.1]), np.array([1])).ev()
    with pytest.raises(InputError, match="n = 0"):
        SuffStats().ev()
    with pytest.raises(InputError, match="Var"):
        token_stats(np.full(5, 0.7), np.zeros(5), np.ones(5)).ev()
    with pytest.raises(InputError, match="Var"):  # just at the floor
        SuffStats(n=2, sum_r=0.0, sum_r2=2e-8, sum_e=0.0, sum_e2=0.0).ev()
    assert SuffStats(n=2, sum_r=0.0, sum_r2=2.1e-8, sum_e=0.0, sum_e2=0.0).ev() == 1.0
    with pytest.raises(InputError):
        SuffStats(n=2, sum_r=0.0, sum_r2=2.0, sum_e=0.0, sum_e2=float("inf")).ev()


def test_ev_combines_by_summing_not_averaging():
    a = token_stats(np.array([0.0, 1.0]), np.array([0.0, 1.0]), np.ones(2))  # EV 1
    b = token_stats(np.array([0.0, 1.0, 0.0, 1.0]), np.array([1.0, 0.0, 1.0, 0.0]), np.ones(4))  # EV ...
    r = np.array([0, 1, 0, 1, 0, 1.0])
    v = np.array([0, 1, 1, 0, 1, 0.0])
    assert math.isclose((a + b).ev(), 1 - np.var(r - v) / np.var(r))
    assert not math.isclose((a + b).ev(), (a.ev() + b.ev()) / 2)


def test_suffstats_json_round_trip():
    s = SuffStats(3.0, 1.5, 1.25, -0.5, 0.75)
    assert SuffStats.from_json(s.to_json()) == s
    rr = RankReport(1, [4, 2], s, s, [0.1, 0.9])
    assert RankReport.from_json(rr.to_json()) == rr


# --- rank reports -------------------------------------------------------------------------------


def _reports(batch, dp, rng):
    out = []
    for rank in range(dp):
        rows = list(batch[rank::dp])
        tok = SuffStats.merge(token_stats(rng.random(3), rng.random(3), np.ones(3)) for _ in rows)
        out.append(RankReport(rank, rows, tok, SuffStats(float(len(rows)), 0, 0, 0, 0)))
    return out


def test_rank_report_checks():
    rng = np.random.default_rng(0)
    batch = [5, 1, 9, 3]
    good = _reports(batch, 2, rng)
    check_rank_reports(good, dp=2, planned_rows=batch, active_targets=12, where="b0")
    msgs = set()

    def refuse(reports, needle, **kw):
        args = dict(dp=2, planned_rows=batch, active_targets=12, where="b0")
        args.update(kw)
        with pytest.raises(InputError) as ei:
            check_rank_reports(reports, **args)
        assert needle in str(ei.value) and ei.value.where == "b0"
        msgs.add(ei.value.message.split(":")[0].split(" ")[2])

    refuse([good[0]], "ranks [0]")
    refuse([good[0], RankReport(0, good[1].row_indices, good[1].token, good[1].trajectory)], "ranks [0, 0]")
    refuse([RankReport(2, good[0].row_indices, good[0].token, good[0].trajectory), good[1]], "ranks [1, 2]")
    refuse(good, "expected exactly 0..2", dp=3)
    dup = RankReport(1, [5, 3], good[1].token, good[1].trajectory)  # row 5 twice, row 1 missing
    refuse([good[0], dup], "missing [1]")
    refuse(good, "missing [7]", planned_rows=batch + [7])
    refuse(good, "13", active_targets=13)


def test_rank_report_multiset_counts_duplicates():
    s = SuffStats(2, 0, 0, 0, 0)
    reports = [RankReport(0, [1, 1], s, s), RankReport(1, [2], s, s)]
    with pytest.raises(InputError, match="unexpected"):
        check_rank_reports(reports, dp=2, planned_rows=[1, 2, 3], active_targets=4, where="b")
    check_rank_reports(reports, dp=2, planned_rows=[1, 2, 1], active_targets=4, where="b")


# --- AUROC ---------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    data=st.lists(
        st.tuples(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.sampled_from([0.0, 1.0])), min_size=2, max_size=40
    )
)
def test_auroc_matches_sklearn_with_ties(data):
    from sklearn.metrics import roc_auc_score

    scores = [s for s, _ in data]
    labels = [y for _, y in data]
    got = auroc(scores, labels)
    if len(set(labels)) != 2:
        assert got is None
        return
    assert math.isclose(got, roc_auc_score(labels, scores), rel_tol=1e-12, abs_tol=1e-12)


def test_auroc_positive_is_larger_label():
    assert auroc([0.1, 0.9], [2.0, 5.0]) == 1.0
    assert auroc([0.1, 0.9], [5.0, 2.0]) == 0.0
    assert auroc([0.1, 0.2, 0.3], [0, 1, 2]) is None


# --- gate ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ev, pos, batches, passed",
    [
        (0.1, 2, 3, True),
        (0.1, 1, 2, False),
        (0.1, 2, 4, False),
        (0.0, 3, 3, False),
        (-0.1, 3, 3, False),
        (1e-12, 1, 1, True),
        (0.5, 0, 1, False),
        (0.5, 3, 5, True),
    ],
)
def test_gate_truth_table(ev, pos, batches, passed):
    assert WeightingGate(ev=ev, positive_batches=pos, batches=batches).passed is passed


def _batch_stats(r, v):
    return token_stats(np.array(r, float), np.array(v, float), np.ones(len(r)))


def test_gate_weighting_counts_positive_batches_and_sums():
    good = _batch_stats([0, 1, 0, 1], [0.1, 0.9, 0.2, 0.8])
    bad = _batch_stats([0, 1, 0, 1], [0.9, 0.1, 0.8, 0.2])
    g = gate_weighting([good, good, bad], "w")
    assert (g.positive_batches, g.batches) == (2, 3)
    assert math.isclose(g.ev, SuffStats.merge([good, good, bad]).ev())
    with pytest.raises(InputError, match="w batch 1"):
        gate_weighting([good, _batch_stats([1, 1], [0, 0])], "w")


def _report(token_batches, traj_batches, split="heldout"):
    """Build a report with one rank whose token / trajectory statistics per batch are given as
    (returns, values) of four one-token rows: row j's token statistics are token j of the token
    spec, its trajectory statistics token j of the trajectory spec (so the two weightings can
    differ), all in decile 0."""
    batches, rank_reports, active = [], [], []
    for k, (tok, traj) in enumerate(zip(token_batches, traj_batches, strict=True)):
        rows = list(range(4 * k, 4 * k + 4))
        batches.append(rows)
        row_tok = [[1.0, r, r * r, r - v, (r - v) ** 2] for r, v in zip(*tok, strict=True)]
        row_traj = [[1.0, r, r * r, r - v, (r - v) ** 2] for r, v in zip(*traj, strict=True)]
        row_dec = [[t] + [[0.0] * 5] * 9 for t in row_tok]
        rank_reports.append(
            [
                RankReport(
                    0, rows, _batch_stats(*tok), _batch_stats(*traj), [0.2, 0.8, 0.2, 0.8], row_tok, row_traj, row_dec
                )
            ]
        )
        active.append(4)
    labels = [0.0, 1.0] * (2 * len(token_batches))
    return build_report(
        manifest_sha256="a" * 64,
        dataset_sha256="b" * 64,
        split=split,
        checkpoint="/c",
        contract_sha256="c" * 64,
        dp=1,
        seed=0,
        global_batch_size=4,
        batches=batches,
        rank_reports=rank_reports,
        active_targets=active,
        labels=labels,
    )


GOOD_RV = ([0.0, 1.0, 0.0, 1.0], [0.1, 0.9, 0.2, 0.8])
BAD_RV = ([0.0, 1.0, 0.0, 1.0], [0.5, 0.4, 0.5, 0.4])  # EV < 0, mildly
GOOD = _batch_stats(*GOOD_RV)
BAD = _batch_stats(*BAD_RV)


@pytest.mark.parametrize(
    "tok, traj, passed",
    [
        ([GOOD_RV, GOOD_RV, BAD_RV], [GOOD_RV, GOOD_RV, GOOD_RV], True),
        ([GOOD_RV, BAD_RV, BAD_RV], [GOOD_RV, GOOD_RV, GOOD_RV], False),  # token weighting fails the majority rule
        ([GOOD_RV, GOOD_RV, GOOD_RV], [BAD_RV, BAD_RV, GOOD_RV], False),  # trajectory weighting fails
        ([GOOD_RV, BAD_RV], [GOOD_RV, GOOD_RV], False),  # 1 * 2 > 2 is false
    ],
)
def test_report_gate_needs_both_weightings(tok, traj, passed):
    rep = _report(tok, traj)
    assert rep["passed"] is passed and rep["gate"]["passed"] is passed
    assert rep["gate"]["token"]["batches"] == len(tok)
    assert rep["execution"] == {"forward_only": True, "optimizer_steps": 0, "dp": 1}
    assert rep["aggregates"]["auroc"] == 1.0
    assert math.isclose(rep["aggregates"]["token"]["ev"], SuffStats.merge(_batch_stats(*t) for t in tok).ev())


def test_report_train_split_never_passes():
    rep = _report([GOOD_RV, GOOD_RV], [GOOD_RV, GOOD_RV], split="train")
    assert rep["passed"] is False and rep["gate"]["applies"] is False and "heldout" in rep["gate"]["reason"]


def test_report_refuses_bad_rank_reports_and_undefined_ev():
    with pytest.raises(InputError, match="evaluation batch 0"):
        build_report(
            manifest_sha256="a" * 64,
            dataset_sha256="b" * 64,
            split="heldout",
            checkpoint="/c",
            contract_sha256="c" * 64,
            dp=1,
            seed=0,
            global_batch_size=2,
            batches=[[0, 1]],
            rank_reports=[[RankReport(0, [0, 1], GOOD, GOOD)]],
            active_targets=[5],
            labels=[0.0, 1.0],
        )
    flat = ([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0])
    with pytest.raises(InputError, match="Var"):
        _report([flat], [GOOD_RV])
