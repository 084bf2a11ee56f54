"""Training progress lines (every K steps, first and last) and the training-curve summary."""

import json

import pytest

from value_assets.core.progress import TrainProgress, parse_progress, progress_line, report_every

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("steps", [1, 5, 40, 41, 64, 96, 1000, 1001, 123457])
def test_a_run_shows_at_most_forty_updates_and_at_least_twenty_when_long(steps):
    lines = []
    progress = TrainProgress(lines.append, steps)
    for step in range(1, steps + 1):
        progress(step, {"loss": 1.0 / step, "explained_variance": None, "tokens_per_s": 10.0})
    progress.finish()
    reported = [parse_progress(line)["step"] for line in lines]
    assert reported[0] == 1 and reported[-1] == steps and reported == sorted(set(reported))
    assert min(steps, 20) <= len(reported) <= 41  # K-th steps plus the first
    assert report_every(steps) == max(1, -(-steps // 40))


def test_a_resumed_or_stopped_run_reports_its_own_first_and_last_step():
    lines = []
    progress = TrainProgress(lines.append, 100)  # K = 3
    for step in range(51, 60):  # resumed at 50, stopped after 9 steps
        progress(step, {"loss": 0.5})
    progress.finish()
    progress.finish()  # idempotent
    assert [parse_progress(line)["step"] for line in lines] == [51, 54, 57, 59]


def test_the_line_round_trips_and_an_undefined_ev_stays_undefined():
    line = progress_line(12, 64, {"loss": 0.6931471, "explained_variance": float("nan"), "tokens_per_s": 1234.56})
    assert line == "train progress: step=12/64 loss=0.693147 ev=n/a tokens_per_s=1234.6"
    assert parse_progress(line) == {
        "step": 12,
        "planned_steps": 64,
        "loss": 0.693147,
        "ev": None,
        "tokens_per_s": 1234.6,
    }
    assert parse_progress("step 12/64 loss 0.69") is None


def test_training_curve_reads_the_kept_record_of_a_repeated_step_and_renders_a_png(tmp_path):
    from value_assets.gpu.drivers.training_curve import PLOT_NAME, write_training_curve

    assert write_training_curve(tmp_path) is None  # nothing logged
    records = [
        {"step": 1, "loss": 2.0, "explained_variance": None, "tokens_per_s": 100.0},
        {"step": 2, "loss": 1.5, "explained_variance": 0.1, "tokens_per_s": 300.0},
        {"step": 2, "loss": 1.4, "explained_variance": 0.2, "tokens_per_s": 200.0},  # re-run after a resume
        {"step": 3, "loss": 1.0, "explained_variance": 0.3, "tokens_per_s": None},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary, plots = write_training_curve(tmp_path)
    assert summary == {
        "logged_steps": 3,
        "final_loss": 1.0,
        "final_ev": 0.3,
        "first_loss": 2.0,
        "min_loss": 1.0,
        "mean_tokens_per_s": pytest.approx(150.0),
    }
    png = (tmp_path / PLOT_NAME).read_bytes()
    assert png.startswith(b"\x89PNG") and plots == {
        "training_curve": {"file": PLOT_NAME, "sha256": plots["training_curve"]["sha256"]}
    }
    from value_assets.core.hashing import sha256_bytes

    assert plots["training_curve"]["sha256"] == sha256_bytes(png)
