"""The per-step metrics log: JSON lines and TensorBoard event files that TensorBoard reads back."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from value_assets.gpu.drivers.metrics_log import MetricsLog

pytestmark = pytest.mark.unit


def test_tensorboard_reads_back_every_logged_scalar_and_no_undefined_one(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path)
    log.write(1, {"loss": 2.5, "explained_variance": None, "grad_norm": 0.75, "lr": 1e-4, "rows": 32})
    log.write(2, {"loss": 1.25, "explained_variance": 0.5, "grad_norm": float("nan"), "lr": 1e-4})
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2] and lines[1]["grad_norm"] is None  # nan -> null

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"train/loss", "train/explained_variance", "train/grad_norm", "train/lr"}
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.5), (2, 1.25)]
    assert [(e.step, e.value) for e in acc.Scalars("train/explained_variance")] == [
        (2, 0.5)
    ]  # step 1 undefined: absent
    assert [e.step for e in acc.Scalars("train/lr")] == [1, 2]


def test_logging_metrics_imports_no_torch(tmp_path):
    code = (
        "import sys; from pathlib import Path; from value_assets.gpu.drivers.metrics_log import MetricsLog; "
        "log = MetricsLog(Path(sys.argv[1])); log.write(1, {'loss': 1.0}); log.close(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False"]


def test_a_metrics_line_the_disk_refuses_names_the_file(tmp_path):
    """Issue 33, defect 11: an OSError writing metrics.jsonl (ENOSPC) has no path of its own; it is
    raised as PublishError naming the file, so `train` exits 2 with it, not 1."""
    import errno

    from value_assets.core.publish import PublishError

    log = MetricsLog(tmp_path)
    log.write(1, {"loss": 1.0})

    class Full:
        def write(self, _text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass

    real, log._file = log._file, Full()
    with pytest.raises(PublishError, match=r"metrics.jsonl: could not publish \(No space left on device\)"):
        log.write(2, {"loss": 0.5})
    real.close()
    log.close()
