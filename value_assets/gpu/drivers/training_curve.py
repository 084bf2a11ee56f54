"""The training run at a glance, from the driver's ``metrics.jsonl``: a loss / in-batch EV plot
(PNG, the evaluation plots' style) and the final figures the checkpoint's materialization shows."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from value_assets.gpu.drivers.plots import _png

PLOT_NAME = "training_curve.png"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """One record per step, in step order. The log is appended to across resumes, so a step run
    again after a crash appears twice: the later record (the run that was kept) wins."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def curve_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Final loss and in-batch EV, first and lowest loss, mean tokens/s, steps logged."""
    losses = [x for r in records if (x := _finite(r.get("loss"))) is not None]
    speeds = [x for r in records if (x := _finite(r.get("tokens_per_s"))) is not None]
    last = records[-1] if records else {}
    return {
        "logged_steps": len(records),
        "final_loss": _finite(last.get("loss")),
        "final_ev": _finite(last.get("explained_variance")),
        "first_loss": losses[0] if losses else None,
        "min_loss": min(losses) if losses else None,
        "mean_tokens_per_s": sum(speeds) / len(speeds) if speeds else None,
    }


def training_curve_png(records: list[dict[str, Any]]) -> bytes:
    """Loss (left) and in-batch explained variance (right) per step; undefined EVs are gaps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in records]
    loss = [_finite(r.get("loss")) for r in records]
    ev = [_finite(r.get("explained_variance")) for r in records]
    fig, (ax_loss, ax_ev) = plt.subplots(1, 2, figsize=(9.6, 3.6), layout="constrained")
    ax_loss.plot(steps, [float("nan") if v is None else v for v in loss], color="C0", lw=1.2)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    ax_loss.set_title("loss")
    ax_ev.plot(steps, [float("nan") if v is None else v for v in ev], color="C1", lw=1.2, label="in-batch EV")
    ax_ev.axhline(0.0, color="k", lw=0.8)
    ax_ev.set_xlabel("step")
    ax_ev.set_ylabel("explained variance")
    ax_ev.set_title("in-batch EV (training batches)")
    ax_ev.legend(fontsize=7, loc="best")
    summary = curve_summary(records)
    final = "n/a" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"
    fig.suptitle(f"training: {len(records)} steps, final loss {final}", fontsize=10)
    data = _png(fig)
    plt.close(fig)
    return data


def write_training_curve(critic_dir: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Render ``critic_dir/training_curve.png`` from ``critic_dir/metrics.jsonl`` (replacing the
    previous run's); returns (summary, plots entry ``{"training_curve": {file, sha256}}``), or None
    when no step was logged."""
    from value_assets.core.publish import atomic_write

    log = critic_dir / "metrics.jsonl"
    records = read_metrics(log) if log.is_file() else []
    if not records:
        return None
    data = training_curve_png(records)
    sha = atomic_write(critic_dir / PLOT_NAME, data)
    return curve_summary(records), {"training_curve": {"file": PLOT_NAME, "sha256": sha}}
