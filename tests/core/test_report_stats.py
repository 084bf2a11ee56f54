"""The report's new statistics (docs/rules.md#ev-report): per-row statistics of a rank, their
refusals, the position table, the row bootstrap intervals and the two gate modes, against naive
references (Python loops over tokens and rows, float64) with stated tolerances; and the same on
real SmolLM2 text rollouts (tests/data/real_rollouts)."""

from __future__ import annotations

import copy
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from value_assets.core.errors import InputError
from value_assets.core.report import build_report, decide_gate
from value_assets.core.stats import RankReport, token_stats, trajectory_stats

pytestmark = pytest.mark.unit
DATA = Path(__file__).resolve().parents[1] / "data"
REL = 1e-9  # float64 sums in another order than the naive loop


def synthetic_rows(seed, noise, n_batches=4, g=8):
    """Rows (index, returns, values, mask) per batch: labels alternate 0/1, a critic V = 0.5 + 0.2 (R - 0.5)
    plus Gaussian noise of sd `noise`, the first response token inactive."""
    rng = np.random.default_rng(seed)
    labels = [float(i % 2) for i in range(n_batches * g)]
    batches = []
    for k in range(n_batches):
        rows = []
        for i in range(k * g, (k + 1) * g):
            L = int(rng.integers(5, 40))
            r = np.full(L, labels[i])
            v = np.clip(0.5 + 0.2 * (r - 0.5) + rng.normal(0, noise, L), 0, 1)
            m = np.ones(L, dtype=np.int64)
            m[0] = 0
            rows.append((i, r, v, m))
        batches.append(rows)
    return batches, labels


def report_of(batches, labels, *, dp=2, seed=0, mode="miles", tamper=None, min_ev=0.0):
    """build_report over `batches` with rows dealt to `dp` ranks round-robin; `tamper(report)` may
    alter each RankReport before the driver sees it."""
    rank_reports, active = [], []
    for rows in batches:
        reps = [RankReport.from_rows(rank, rows[rank::dp]) for rank in range(dp)]
        if tamper:
            reps = [tamper(r) for r in reps]
        rank_reports.append(reps)
        active.append(int(sum(m.sum() for _, _, _, m in rows)))
    return build_report(
        manifest_sha256="a" * 64,
        dataset_sha256="b" * 64,
        split="heldout",
        checkpoint="c",
        contract_sha256="c" * 64,
        dp=dp,
        seed=seed,
        global_batch_size=len(batches[0]),
        batches=[[i for i, *_ in rows] for rows in batches],
        rank_reports=rank_reports,
        active_targets=active,
        labels=labels,
        gate_mode=mode,
        gate_min_ev=min_ev,
    )


def naive_ev(r, e):
    """1 - Var(e) / Var(R), population variances, by Python loops; None where undefined."""
    n = len(r)
    if n <= 1:
        return None
    mr, me = math.fsum(r) / n, math.fsum(e) / n
    vr = math.fsum((x - mr) ** 2 for x in r) / n
    ve = math.fsum((x - me) ** 2 for x in e) / n
    return None if vr <= 1e-8 else 1 - ve / vr


def naive_position(rows):
    """Per decile, the active tokens' (R, e) by a loop: token j of L is in decile floor(10 j / L)."""
    per = [([], []) for _ in range(10)]
    for _, r, v, m in rows:
        L = len(r)
        for j in range(L):
            if m[j]:
                per[(10 * j) // L][0].append(float(r[j]))
                per[(10 * j) // L][1].append(float(r[j]) - float(v[j]))
    return per


def naive_intervals(rows, seed, resamples=2000, level=0.95):
    """Percentile bootstrap over rows by a loop: each resample draws len(rows) rows with replacement
    (the same generator stream as the implementation) and computes both EVs from the drawn tokens.
    Each row's active tokens and per-row means are taken out once; a resample concatenates them."""
    rng = np.random.default_rng(seed)
    active = [(r[m.astype(bool)], (r - v)[m.astype(bool)]) for _, r, v, m in rows]
    per_row = np.array([[x.mean(), (x**2).mean(), e.mean(), (e**2).mean()] for x, e in active])
    tok, traj = [], []
    for _ in range(resamples):
        idx = rng.integers(0, len(rows), size=len(rows))
        r = np.concatenate([active[i][0] for i in idx])
        e = np.concatenate([active[i][1] for i in idx])
        if r.var() <= 1e-8:  # every drawn row has one label: EV undefined, the resample is dropped
            continue
        tok.append(1 - e.var() / r.var())
        means = per_row[idx]
        vr = means[:, 1].mean() - means[:, 0].mean() ** 2
        ve = means[:, 3].mean() - means[:, 2].mean() ** 2
        traj.append(1 - ve / vr)
    a = (1 - level) / 2
    return {"token": np.quantile(tok, [a, 1 - a]), "trajectory": np.quantile(traj, [a, 1 - a]), "defined": tok}


# ---- per-row statistics of a rank ------------------------------------------------------------


def test_rank_report_from_rows_matches_per_row_loops_and_round_trips():
    rows = synthetic_rows(0, 0.2)[0][0]
    rep = RankReport.from_rows(1, rows)
    assert rep.row_indices == [i for i, *_ in rows]
    for (_i, r, v, m), tok, traj, dec, value in zip(
        rows, rep.row_token, rep.row_trajectory, rep.row_deciles, rep.row_values, strict=True
    ):
        t, j = token_stats(r, v, m), trajectory_stats(r, v, m)
        assert tok == [t.n, t.sum_r, t.sum_r2, t.sum_e, t.sum_e2] and traj[0] == 1.0
        assert traj == pytest.approx([1.0, j.sum_r, j.sum_r2, j.sum_e, j.sum_e2], rel=REL)
        assert np.sum(dec, axis=0) == pytest.approx(tok, rel=REL, abs=1e-12)
        assert value == pytest.approx(float(v[m.astype(bool)].mean()), rel=REL)
    assert RankReport.from_json(rep.to_json()) == rep


@pytest.mark.parametrize(
    "tamper, needle",
    [
        (lambda r: replace(r, row_token=None), "per-row statistics are missing"),
        (lambda r: replace(r, row_deciles=r.row_deciles[1:]), "shapes"),
        (
            lambda r: replace(r, row_token=[[t[0], t[1] + 0.5, *t[2:]] for t in r.row_token]),
            "do not sum to the row's token",
        ),
        (
            lambda r: replace(
                r,
                row_token=[t[:4] + [t[4] * 0.5] for t in r.row_token],
                row_deciles=[[d[:4] + [d[4] * 0.5] for d in rd] for rd in r.row_deciles],
            ),
            "do not sum to the rank's token totals",
        ),
        (
            lambda r: replace(r, row_trajectory=[[2.0, *t[1:]] for t in r.row_trajectory]),
            "trajectory-weighted n is not 1",
        ),
        (
            lambda r: replace(r, row_trajectory=[t[:3] + [t[3] + 1.0, t[4]] for t in r.row_trajectory]),
            "trajectory totals",
        ),
        (lambda r: replace(r, row_token=[[math.nan] * 5 for _ in r.row_token]), "do not sum"),
    ],
)
def test_a_rank_report_whose_rows_do_not_add_up_is_refused(tamper, needle):
    batches, labels = synthetic_rows(1, 0.2)
    report_of(batches, labels)  # untampered: accepted
    with pytest.raises(InputError) as err:
        report_of(batches, labels, tamper=lambda r: tamper(r) if r.rank == 1 else r)
    assert err.value.where == "evaluation batch 0" and needle in err.value.message and "rank 1" in err.value.message


# ---- position table and intervals in the report ----------------------------------------------


def test_position_table_matches_a_token_loop_and_sums_to_the_aggregate():
    batches, labels = synthetic_rows(2, 0.2)
    report = report_of(batches, labels)
    per = naive_position([row for rows in batches for row in rows])
    deciles = report["position"]["deciles"]
    assert [d["decile"] for d in deciles] == list(range(10)) and report["position"]["weighting"] == "token"
    for d, (r, e) in zip(deciles, per, strict=True):
        assert d["n"] == len(r)
        assert d["ev"] == pytest.approx(naive_ev(r, e), rel=1e-9)
    table = np.array([[d["stats"][k] for k in ("n", "sum_r", "sum_r2", "sum_e", "sum_e2")] for d in deciles])
    agg = report["aggregates"]["token"]["stats"]
    assert table.sum(axis=0) == pytest.approx([agg[k] for k in ("n", "sum_r", "sum_r2", "sum_e", "sum_e2")], rel=REL)


def test_undefined_decile_ev_is_none_never_zero():
    # One row per label, responses of 3 tokens: deciles 0, 3 and 6 only; decile 6 has equal returns.
    rows = [
        (0, np.array([0.0, 0.0, 0.0]), np.array([0.1, 0.2, 0.3]), np.array([1, 1, 0])),
        (1, np.array([1.0, 1.0, 1.0]), np.array([0.9, 0.8, 0.7]), np.array([1, 1, 1])),
    ]
    report = report_of([rows], [0.0, 1.0], dp=1)
    evs = [d["ev"] for d in report["position"]["deciles"]]
    assert evs[0] is not None and evs[3] is not None
    assert all(evs[d] is None for d in (1, 2, 4, 5, 6, 7, 8, 9))  # 6: one active token (n <= 1)
    assert [d["n"] for d in report["position"]["deciles"]] == [2, 0, 0, 2, 0, 0, 1, 0, 0, 0]


def test_intervals_match_a_row_bootstrap_loop():
    batches, labels = synthetic_rows(3, 0.2, n_batches=2, g=6)  # 12 rows: a few resamples draw one label only
    report = report_of(batches, labels, seed=11)
    rows = [row for b in batches for row in b]
    want = naive_intervals(rows, seed=11)
    for w in ("token", "trajectory"):
        iv = report["intervals"][w]
        assert (iv["low"], iv["high"]) == pytest.approx(tuple(want[w]), rel=1e-9)
        assert iv["estimate"] == pytest.approx(report["aggregates"][w]["ev"], rel=1e-12)
        assert (iv["level"], iv["resamples"], iv["seed"], iv["units"], iv["unit"]) == (0.95, 2000, 11, 12, "row")
        assert iv["undefined_resamples"] == 2000 - len(want["defined"])


# ---- the gate modes --------------------------------------------------------------------------


def test_interval_mode_is_stricter_than_the_default_rule():
    batches, labels = synthetic_rows(2, 0.28)  # a weak critic: positive EV, interval reaching below 0
    miles, strict = report_of(batches, labels, seed=2), report_of(batches, labels, seed=2, mode="interval")
    assert miles["passed"] is True and miles["gate"]["mode"] == "miles" and decide_gate(miles).passed
    assert miles["intervals"]["token"]["low"] < 0 and miles["intervals"]["trajectory"]["low"] < 0
    assert strict["passed"] is False and strict["gate"]["mode"] == "interval"
    assert strict["gate"]["token"]["passed"] and strict["gate"]["trajectory"]["passed"]  # the default rule passes
    failures = decide_gate(strict).failures
    assert len(failures) == 2 and all("lower bound" in f and "interval mode" in f for f in failures)
    assert strict["gate"]["interval_low"] == {w: miles["intervals"][w]["low"] for w in ("token", "trajectory")}
    assert "interval" in strict["gate"]["criteria"] and "interval" not in miles["gate"]["criteria"]
    good = synthetic_rows(0, 0.1)
    passing = report_of(*good, mode="interval")
    assert passing["passed"] is True and decide_gate(passing).passed and passing["intervals"]["token"]["low"] > 0


def test_decide_gate_recomputes_intervals_and_refuses_forged_ones():
    batches, labels = synthetic_rows(2, 0.28)
    strict = report_of(batches, labels, seed=2, mode="interval")
    forged = copy.deepcopy(strict)
    for w in ("token", "trajectory"):
        forged["intervals"][w]["low"] = 0.01
    forged["passed"] = True
    forged["gate"]["passed"] = True
    decision = decide_gate(forged)
    assert not decision.passed
    assert any("report's interval" in f for f in decision.failures)
    assert any("lower bound" in f for f in decision.failures)  # decided from the per-row statistics
    # A stated interval must agree in the default mode too.
    miles = report_of(batches, labels, seed=2)
    assert decide_gate(miles).passed
    wrong = copy.deepcopy(miles)
    wrong["intervals"]["trajectory"]["high"] += 0.1
    assert [f for f in decide_gate(wrong).failures if "report's interval" in f]
    # Last-bit differences (another machine's float64 sums) are tolerated, to 1e-9 relative; a
    # changed count is not.
    ulp = copy.deepcopy(miles)
    ulp["intervals"]["token"]["low"] *= 1 + 1e-13
    assert decide_gate(ulp).passed
    recount = copy.deepcopy(miles)
    recount["intervals"]["token"]["resamples"] = 200
    assert not decide_gate(recount).passed
    # Per-row statistics that no longer sum to their batch's cannot back an interval.
    edited = copy.deepcopy(strict)
    del edited["passed"], edited["intervals"]
    edited["batches"][0]["token"]["row_stats"][0][4] *= 0.01
    assert any("do not sum to the batch's" in f for f in decide_gate(edited).failures)
    # Another seed than the batch plan's gives another interval: the stated one no longer agrees.
    reseeded = copy.deepcopy(miles)
    reseeded["batch_plan"]["seed"] = 3
    assert any("report's interval" in f for f in decide_gate(reseeded).failures)


def test_a_minimum_ev_raises_the_bar_in_both_modes_and_is_read_from_the_report():
    batches, labels = synthetic_rows(0, 0.1)
    base = report_of(batches, labels, mode="interval")
    ev = {w: base["aggregates"][w]["ev"] for w in ("token", "trajectory")}
    low = {w: base["intervals"][w]["low"] for w in ("token", "trajectory")}
    assert base["passed"] and base["gate"]["min_ev"] == 0.0 and 0 < min(low.values())
    # Miles' rule with a bar: the aggregate EV must be above it (between the lowest interval bound and
    # the lowest EV, the "miles" gate passes and the "interval" gate fails).
    bar = (max(low.values()) + min(ev.values())) / 2
    assert max(low.values()) < bar < min(ev.values())
    miles, strict = report_of(batches, labels, min_ev=bar), report_of(batches, labels, mode="interval", min_ev=bar)
    assert miles["passed"] and miles["gate"]["min_ev"] == bar and "min_ev" in miles["gate"]["criteria"]
    assert not strict["passed"]
    failures = decide_gate(strict).failures
    assert len(failures) == 2 and all(f"needs > {bar!r}" in f for f in failures)
    above = report_of(batches, labels, min_ev=min(ev.values()))  # not above the smaller EV: refused
    assert not above["passed"]
    assert any("minimum useful EV" in f for f in decide_gate(above).failures)
    # Read from the report: raising or lowering it there changes the decision; a bad one fails.
    raised = {k: v for k, v in base.items() if k != "passed"} | {"gate": {"mode": "interval", "min_ev": bar}}
    assert not decide_gate(raised).passed
    lowered = {k: v for k, v in strict.items() if k != "passed"} | {"gate": {"mode": "interval", "min_ev": 0.0}}
    assert decide_gate(lowered).passed
    for bad in (1.5, -0.1, True, "0.1", float("inf")):
        failures = decide_gate(
            {k: v for k, v in base.items() if k != "passed"} | {"gate": {"mode": "miles", "min_ev": bad}}
        ).failures
        assert any("gate.min_ev" in f and "[0, 1)" in f for f in failures), bad
    with pytest.raises(InputError, match="gate_min_ev"):
        report_of(batches, labels, min_ev=1.0)
    old = copy.deepcopy(base)  # a report written before the bar existed: 0
    del old["gate"]["min_ev"]
    assert decide_gate(old).passed and decide_gate(old).min_ev == 0.0


def test_gate_mode_is_read_from_the_report_and_old_reports_keep_the_default_rule():
    batches, labels = synthetic_rows(0, 0.1)
    report = report_of(batches, labels)
    old = copy.deepcopy(report)  # as written before per-row statistics, intervals and modes existed
    del old["intervals"], old["position"], old["gate"]["mode"]
    for b in old["batches"]:
        del b["token"]["row_stats"], b["trajectory"]["row_stats"]
    decision = decide_gate(old)
    assert decision.passed and decision.mode == "miles" and decision.intervals == {}
    as_interval = copy.deepcopy(old)
    as_interval["gate"]["mode"] = "interval"
    as_interval.pop("passed")
    assert any("cannot recompute the EV intervals" in f for f in decide_gate(as_interval).failures)
    unknown = copy.deepcopy(report)
    unknown["gate"]["mode"] = "lenient"
    assert any("gate mode 'lenient'" in f for f in decide_gate(unknown).failures)
    with pytest.raises(InputError, match="gate_mode"):
        report_of(batches, labels, mode="lenient")


# ---- real text -------------------------------------------------------------------------------


def test_position_and_intervals_on_real_smollm2_rollouts(tmp_path):
    """288 SmolLM2 rollouts imported with the real tokenizer; a simple critic (the train split's
    mean reward, moving linearly to the row's label along the response, plus noise); the report's
    statistics on the heldout rows against the naive loops."""
    from value_assets.core.dataset import validate_dataset
    from value_assets.core.manifest import load_manifest
    from value_assets.core.mixed import default_batch_size, mixed_label_batches
    from value_assets.core.rollouts import PRESETS, import_rollouts
    from value_assets.gpu.convert.tokenizer import HFTokenizer

    pytest.importorskip("transformers")
    res = import_rollouts(
        [DATA / "real_rollouts" / "rollouts.sample.jsonl"],
        HFTokenizer(DATA / "smollm2_tokenizer"),
        tmp_path / "ds",
        fields=replace(PRESETS["generic"], sample_id="id"),
        heldout_fraction=0.25,
        seed=0,
    )
    manifest = load_manifest(res.manifest)
    train = validate_dataset(manifest.train, manifest.objective)
    held = validate_dataset(manifest.heldout, manifest.objective)
    prior = float(np.mean(train.labels))
    rng = np.random.default_rng(0)
    g = default_batch_size(len(held), 4, 1)
    plan = mixed_label_batches(held.labels.tolist(), g, 4, 0)
    batches = []
    for planned in plan:
        rows = []
        for i, row in zip(planned, held.rows(planned), strict=True):
            L = row.returns.shape[0]
            frac = (np.arange(L) + 1) / L
            v = np.clip(prior + (row.returns - prior) * frac * 0.8 + rng.normal(0, 0.1, L), 0, 1)
            rows.append((int(i), row.returns, v, row.loss_mask))
        batches.append(rows)
    report = report_of(batches, held.labels.tolist(), seed=0)
    flat = [row for rows in batches for row in rows]
    assert len(flat) == g * 4 and min(len(r) for _, r, _, _ in flat) < 10 < max(len(r) for _, r, _, _ in flat)
    for d, (r, e) in zip(report["position"]["deciles"], naive_position(flat), strict=True):
        assert d["n"] == len(r)
        want = naive_ev(r, e)
        assert (d["ev"] is None) == (want is None) and (want is None or d["ev"] == pytest.approx(want, rel=1e-9))
    # Real responses are short (mostly 2-4 tokens with EOS): some deciles hold at most one active
    # token and have no EV (None, not 0); over the defined ones this critic improves along the response.
    defined = [d["ev"] for d in report["position"]["deciles"] if d["ev"] is not None]
    assert report["position"]["deciles"][1]["ev"] is None and len(defined) >= 3
    assert defined[-1] > defined[0]
    want = naive_intervals(flat, seed=0)
    for w in ("token", "trajectory"):
        iv = report["intervals"][w]
        assert (iv["low"], iv["high"]) == pytest.approx(tuple(want[w]), rel=1e-9)
        assert iv["low"] <= report["aggregates"][w]["ev"] <= iv["high"]
