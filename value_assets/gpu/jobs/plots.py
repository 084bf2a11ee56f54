"""The two EV report plots: EV per batch (both weightings) and calibration (mean prediction vs mean
label in bins of predicted value). Rendered headless to PNG bytes."""

from __future__ import annotations

import io
from typing import Any, Sequence

import numpy as np


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def ev_per_batch_png(report: dict[str, Any]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = report["batches"]
    x = np.arange(len(batches))
    tok = [b["token"]["ev"] for b in batches]
    traj = [b["trajectory"]["ev"] for b in batches]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    w = 0.38
    ax.bar(x - w / 2, tok, w, label="token-weighted")
    ax.bar(x + w / 2, traj, w, label="trajectory-weighted")
    agg = report["aggregates"]
    ax.axhline(agg["token"]["ev"], color="C0", ls="--", lw=1, label=f"aggregate token EV {agg['token']['ev']:.3f}")
    ax.axhline(agg["trajectory"]["ev"], color="C1", ls="--", lw=1, label=f"aggregate trajectory EV {agg['trajectory']['ev']:.3f}")
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("evaluation batch")
    ax.set_ylabel("explained variance")
    ax.set_title(f"EV per batch ({report['split']}), gate {'PASSED' if report['passed'] else 'FAILED'}")
    ax.set_xticks(x)
    ax.legend(fontsize=7, loc="best")
    data = _png(fig)
    plt.close(fig)
    return data


def calibration_png(values: Sequence[float], labels: Sequence[float], reward_range: tuple[float, float], bins: int = 10) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = np.asarray(values, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    low, high = reward_range
    edges = np.linspace(low, high, bins + 1)
    idx = np.clip(np.digitize(v, edges) - 1, 0, bins - 1)
    mean_v, mean_y, count = [], [], []
    for b in range(bins):
        sel = idx == b
        if sel.any():
            mean_v.append(v[sel].mean())
            mean_y.append(y[sel].mean())
            count.append(int(sel.sum()))
    fig, ax = plt.subplots(figsize=(4.2, 4.0))
    ax.plot([low, high], [low, high], color="0.6", lw=1, ls="--", label="perfect calibration")
    ax.scatter(mean_v, mean_y, s=[12 + 4 * c for c in count], zorder=3, label="bins (size = rows)")
    ax.plot(mean_v, mean_y, zorder=2)
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("mean predicted value (trajectory)")
    ax.set_ylabel("mean label")
    ax.set_title("calibration")
    ax.legend(fontsize=7, loc="upper left")
    data = _png(fig)
    plt.close(fig)
    return data
