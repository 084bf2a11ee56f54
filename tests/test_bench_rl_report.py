"""bench/_rl_report.py, the issue-28 report, on runs gathered from several device sessions: every
session retrains the critics, so each seed's runs carry their own critic and gate EV; the table
takes the mean over the runs (not the last session's plan), pairs differences by seed, and refuses
runs made with other settings, and a seed whose arms ran on other cards or micro-batches. Checked
against sums done by hand here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPORT = Path(__file__).resolve().parents[1] / "bench" / "_rl_report.py"


@pytest.fixture(scope="module")
def rl_report():
    spec = importlib.util.spec_from_file_location("rl_report_under_test", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SETTINGS = {"steps": 10, "batch": 256}


def write_run(root: Path, arm: str, seed: int, heldout: list[float], gate_ev: float | None, settings=SETTINGS, **extra):
    d = root / f"{arm}-s{seed}"
    d.mkdir(parents=True)
    steps = [{"step": 5 * i, "heldout": {"sampled": h, "greedy": h}} for i, h in enumerate(heldout)]
    steps[1:1] = [{"step": 1, "adv_mean": -0.5 if gate_ev is None else 0.0, "value_ev_outcome": 0.1}]
    (d / "steps.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    spec = {"kind": "fresh"} if gate_ev is None else {
        "kind": "record", "gate_passed": True, "gate_ev": {"token": gate_ev, "trajectory": gate_ev + 0.01},
        "gate_ev_interval": {"token": [gate_ev - 0.1, gate_ev + 0.1]},
    }  # fmt: skip
    meta = {"status": "done", "settings": settings, "spec": spec, "value_check": {"max_abs_diff": 1e-6}, **extra}
    (d / "done.json").write_text(json.dumps(meta))


def test_runs_of_two_sessions_each_with_its_own_critics(rl_report, tmp_path):
    # session 1 (seed 0) and session 2 (seed 1): the critics were retrained, their gate EVs differ
    write_run(tmp_path, "a", 0, [0.1, 0.5, 0.7], None)
    write_run(tmp_path, "a", 1, [0.1, 0.4, 0.6], None)
    write_run(tmp_path, "b", 0, [0.1, 0.6, 0.9], 0.30)
    write_run(tmp_path, "b", 1, [0.1, 0.5, 0.8], 0.20)
    write_run(tmp_path, "c", 0, [0.1, 0.5, 0.75], 0.10)
    write_run(tmp_path, "c", 1, [0.1, 0.4, 0.65], 0.12)
    # the plan left by the last session names other EVs: the runs' own are the ones reported
    plan = {"arms": {"b": {"gate_ev": {"token": 0.99}}, "c": {"gate_ev": {"token": 0.98}}}}
    out = rl_report.summarize(rl_report.load_runs(tmp_path), plan, "a", 5)
    b, c = out["arms"]["b"], out["arms"]["c"]
    assert b["seeds_done"] == [0, 1]
    assert b["gate_ev"]["token"] == pytest.approx(0.25) and c["gate_ev"]["token"] == pytest.approx(0.11)
    assert b["gate_ev_interval"] is None  # two critics: no single interval
    # paired by seed: b - a final = 0.2 (s0) and 0.2 (s1)
    assert b["final_minus_reference"][0] == pytest.approx(0.2)
    # AUC over (0, 5, 10): b - a = (1.6 - 1.3) / 3 (s0), (1.4 - 1.1) / 3 (s1)
    assert b["auc_minus_reference"][0] == pytest.approx(0.1)
    assert out["ranking"]["by_gate_token_ev"] == ["b", "c"] and out["ranking"]["by_rl_benefit_auc"] == ["b", "c"]


def test_a_single_run_keeps_its_critics_interval_and_other_settings_are_refused(rl_report, tmp_path):
    write_run(tmp_path, "a", 0, [0.1, 0.7], None)
    write_run(tmp_path, "b", 0, [0.1, 0.9], 0.3)
    out = rl_report.summarize(rl_report.load_runs(tmp_path), {}, "a", 5)
    assert out["arms"]["b"]["gate_ev_interval"] == {"token": [pytest.approx(0.2), pytest.approx(0.4)]}
    write_run(tmp_path, "b", 1, [0.1, 0.9], 0.3, settings={**SETTINGS, "steps": 50})
    with pytest.raises(SystemExit, match="different settings"):
        rl_report.summarize(rl_report.load_runs(tmp_path), {}, "a", 5)


H200 = {"versions": {"cuda": "NVIDIA H200"}}
H100 = {"versions": {"cuda": "NVIDIA H100 80GB HBM3"}}


def test_a_seed_is_one_block_sessions_may_differ_a_seeds_arms_may_not(rl_report, tmp_path):
    # seed 0 on an H200 in one micro-batch (no `execution` recorded yet), seed 1 on an H100 in two
    write_run(tmp_path, "a", 0, [0.1, 0.7], None, **H200)
    write_run(tmp_path, "b", 0, [0.1, 0.9], 0.3, **H200)
    write_run(tmp_path, "a", 1, [0.1, 0.6], None, **H100, execution={"micro_batches": 2})
    write_run(tmp_path, "b", 1, [0.1, 0.7], 0.3, **H100, execution={"micro_batches": 2})
    out = rl_report.summarize(rl_report.load_runs(tmp_path), {}, "a", 5)
    assert out["seeds"] == {
        0: {"device": "NVIDIA H200", "micro_batches": 1},
        1: {"device": "NVIDIA H100 80GB HBM3", "micro_batches": 2},
    }
    assert out["arms"]["b"]["final_minus_reference"][0] == pytest.approx(0.15)  # (0.2 + 0.1) / 2
    assert "seed 1: NVIDIA H100 80GB HBM3, 2 micro-batches" in rl_report.table(out, 5)
    # arm c of seed 0 run later on the H100 with two micro-batches: not paired with seed 0's a and b
    write_run(tmp_path, "c", 0, [0.1, 0.8], 0.2, **H100, execution={"micro_batches": 2})
    with pytest.raises(SystemExit, match=r"seed 0: its arms ran in different ways.*\['c'\]"):
        rl_report.summarize(rl_report.load_runs(tmp_path), {}, "a", 5)


def test_a_seed_rerun_another_way_is_a_block_of_its_own_from_another_folder(rl_report, tmp_path):
    """Seed 0's arms a-c ran on an H200 in one micro-batch; its arm d and a second arm a later on an
    H100 in two, in a folder of their own (`--also`): d - a pairs within that folder only, a's
    second run enters no column twice, and d's absolute columns take its one seed-0 run."""
    main, h100 = tmp_path / "runs", tmp_path / "runs-h100-s0"
    for seed, (a, b) in enumerate([(0.7, 0.9), (0.6, 0.7)]):
        write_run(main, "a", seed, [0.1, a], None, **H200)
        write_run(main, "b", seed, [0.1, b], 0.3, **H200)
    write_run(main, "d", 1, [0.1, 0.65], 0.0, **H200)
    write_run(h100, "a", 0, [0.1, 0.5], None, **H100, execution={"micro_batches": 2})
    write_run(h100, "d", 0, [0.1, 0.8], 0.0, **H100, execution={"micro_batches": 2})
    extra = {"runs-h100-s0": rl_report.load_runs(h100)}
    out = rl_report.summarize(rl_report.load_runs(main), {}, "a", 5, extra)
    a, b, d = (out["arms"][k] for k in "abd")
    # d - a: 0.65 - 0.6 (seed 1, main) and 0.8 - 0.5 (seed 0, H100 folder), never 0.8 - 0.7
    assert d["paired_blocks"] == 2 and d["final_minus_reference"][0] == pytest.approx((0.05 + 0.3) / 2)
    assert d["seeds_done"] == [0, 1] and d["final_heldout_sampled"][0] == pytest.approx((0.8 + 0.65) / 2)
    assert a["paired_blocks"] == 2 and a["final_heldout_sampled"][0] == pytest.approx((0.7 + 0.6) / 2)
    assert b["paired_blocks"] == 2 and b["final_minus_reference"][0] == pytest.approx((0.2 + 0.1) / 2)
    assert out["extra_blocks"] == {"runs-h100-s0": {0: {"device": "NVIDIA H100 80GB HBM3", "micro_batches": 2}}}
    assert "runs-h100-s0, seed 0: NVIDIA H100 80GB HBM3, 2 micro-batches (a block of its own)" in rl_report.table(
        out, 5
    )
    # without the extra folder, seed 0's d cannot be paired: it is not in the main folder at all
    alone = rl_report.summarize(rl_report.load_runs(main), {}, "a", 5)
    assert alone["arms"]["d"]["paired_blocks"] == 1
    # an extra folder's seed must itself be one block
    write_run(h100, "b", 0, [0.1, 0.9], 0.3, **H200)
    with pytest.raises(SystemExit, match=r"seed 0: its arms ran in different ways"):
        rl_report.summarize(rl_report.load_runs(main), {}, "a", 5, {"x": rl_report.load_runs(h100)})


def test_the_figure_shows_the_runs_the_absolute_columns_use(rl_report, tmp_path, monkeypatch):
    """With `--also`, the figure's curves come from the same runs as the absolute columns: the main
    folder's, plus an extra folder's seed the main folder lacks (seed 0's d), never a second run of
    a seed the main folder has (seed 0's H100 a)."""
    main, h100 = tmp_path / "runs", tmp_path / "runs-h100-s0"
    write_run(main, "a", 0, [0.1, 0.7], None, **H200)
    write_run(main, "d", 1, [0.1, 0.65], 0.0, **H200)
    write_run(main, "a", 1, [0.1, 0.6], None, **H200)
    write_run(h100, "a", 0, [0.1, 0.5], None, **H100, execution={"micro_batches": 2})
    write_run(h100, "d", 0, [0.1, 0.8], 0.0, **H100, execution={"micro_batches": 2})
    plotted = {}
    monkeypatch.setattr(rl_report, "plot", lambda runs, path: plotted.update(runs))
    rl_report.report(main, tmp_path / "out", "a", 5, [h100])
    finals = {
        arm: {s: r["steps"][-1]["heldout"]["sampled"] for s, r in seeds.items()} for arm, seeds in plotted.items()
    }
    assert finals == {"a": {0: 0.7, 1: 0.6}, "d": {0: 0.8, 1: 0.65}}
