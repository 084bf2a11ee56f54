"""Bootstrap EV intervals and EV by response position against naive references."""

from __future__ import annotations

import numpy as np
import pytest

from value_assets.core.intervals import (
    bootstrap_ev_interval,
    decile_stats,
    ev_by_position,
    ev_of_sums,
    position_deciles,
)
from value_assets.core.stats import token_stats, trajectory_stats

pytestmark = pytest.mark.unit


def _rows(n, seed, noise=0.3):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        L = int(rng.integers(3, 30))
        r = np.full(L, float(rng.random() < 0.5))
        v = np.clip(r + rng.normal(0, noise, L), 0, 1)
        mask = (rng.random(L) < 0.8).astype(np.int64)
        mask[0] = 1
        rows.append((r, v, mask))
    return rows


def test_point_estimate_is_the_ev_of_summed_statistics():
    rows = _rows(200, 0)
    parts = [trajectory_stats(r, v, m) for r, v, m in rows]
    iv = bootstrap_ev_interval(parts, resamples=200, seed=1)
    # naive, as the rules define trajectory weighting: each row contributes its means over active
    # tokens of R, R^2, e and e^2; population variances of the summed statistics.
    act = [m.astype(bool) for r, v, m in rows]
    mr = np.mean([r[a].mean() for (r, v, m), a in zip(rows, act, strict=True)])
    mr2 = np.mean([(r[a] ** 2).mean() for (r, v, m), a in zip(rows, act, strict=True)])
    me = np.mean([(r - v)[a].mean() for (r, v, m), a in zip(rows, act, strict=True)])
    me2 = np.mean([((r - v)[a] ** 2).mean() for (r, v, m), a in zip(rows, act, strict=True)])
    assert iv.estimate == pytest.approx(1 - (me2 - me**2) / (mr2 - mr**2), rel=1e-12)
    assert iv.low < iv.estimate < iv.high and iv.units == 200 and iv.undefined_resamples == 0


def test_bootstrap_matches_a_loop_reference():
    rows = _rows(40, 3)
    parts = [token_stats(r, v, m) for r, v, m in rows]
    iv = bootstrap_ev_interval(parts, resamples=300, seed=9, level=0.9)
    rng = np.random.default_rng(9)
    evs = []
    for _ in range(300):
        idx = rng.integers(0, 40, size=40)
        r = np.concatenate([rows[i][0][rows[i][2].astype(bool)] for i in idx])
        e = np.concatenate([(rows[i][0] - rows[i][1])[rows[i][2].astype(bool)] for i in idx])
        evs.append(1 - e.var() / r.var())
    lo, hi = np.quantile(evs, [0.05, 0.95])
    assert iv.low == pytest.approx(lo, rel=1e-9) and iv.high == pytest.approx(hi, rel=1e-9)


def test_interval_width_shrinks_with_more_units_and_undefined_cases():
    small = bootstrap_ev_interval([trajectory_stats(*row) for row in _rows(30, 5)], resamples=400)
    large = bootstrap_ev_interval([trajectory_stats(*row) for row in _rows(600, 5)], resamples=400)
    assert (large.high - large.low) < (small.high - small.low)
    one = bootstrap_ev_interval([trajectory_stats(*_rows(1, 0)[0])], resamples=10)
    assert one.low is None and one.high is None
    # constant returns: EV undefined everywhere -> no interval, estimate None (never 0)
    const = [trajectory_stats(np.ones(4), np.full(4, 0.5), np.ones(4)) for _ in range(10)]
    iv = bootstrap_ev_interval(const, resamples=50)
    assert iv.estimate is None and iv.low is None and iv.undefined_resamples == 50


def test_position_deciles_and_ev_by_position():
    assert position_deciles(10).tolist() == list(range(10))
    assert position_deciles(3).tolist() == [0, 3, 6]
    assert position_deciles(20).tolist() == [k // 2 for k in range(20)]
    rows = _rows(300, 11)
    # A critic that improves along the response: error shrinks with position.
    improved = []
    for r, _v, m in rows:
        L = r.shape[0]
        frac = np.arange(L) / L
        improved.append((r, 0.5 + (r - 0.5) * frac, m))
    evs = ev_by_position([decile_stats(*row) for row in improved])
    defined = [e for e in evs if e is not None]
    assert len(defined) == 10 and defined[-1] > defined[0]
    # naive reference for decile 4
    rs, es = [], []
    for r, v, m in improved:
        d = position_deciles(r.shape[0])
        sel = (d == 4) & m.astype(bool)
        rs.append(r[sel])
        es.append((r - v)[sel])
    rs, es = np.concatenate(rs), np.concatenate(es)
    assert evs[4] == pytest.approx(1 - es.var() / rs.var(), rel=1e-10)
    # decile sums add up to the row's token statistics
    r, v, m = rows[0]
    ds = decile_stats(r, v, m).sum(axis=0)
    ts = token_stats(r, v, m)
    assert ds.tolist() == pytest.approx([ts.n, ts.sum_r, ts.sum_r2, ts.sum_e, ts.sum_e2], rel=1e-12)
    assert np.isnan(ev_of_sums(np.zeros(5)))
