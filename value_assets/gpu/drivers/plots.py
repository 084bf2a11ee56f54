"""The three EV report plots: EV per batch (both weightings), calibration (mean prediction vs mean
label in bins of predicted value) and EV by response decile (token-weighted). Rendered headless to
PNG bytes; they draw what the report states and compute no statistic of their own."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

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
    ax.axhline(
        agg["trajectory"]["ev"],
        color="C1",
        ls="--",
        lw=1,
        label=f"aggregate trajectory EV {agg['trajectory']['ev']:.3f}",
    )
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("evaluation batch")
    ax.set_ylabel("explained variance")
    ax.set_title(f"EV per batch ({report['split']}), gate {'PASSED' if report['passed'] else 'FAILED'}")
    ax.set_xticks(x)
    ax.legend(fontsize=7, loc="best")
    data = _png(fig)
    plt.close(fig)
    return data


def calibration_png(
    values: Sequence[float], labels: Sequence[float], reward_range: tuple[float, float], bins: int = 10
) -> bytes:
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


def ev_by_position_png(report: dict[str, Any]) -> bytes:
    """Token-weighted EV per response decile (the report's `position` table); undefined deciles are
    marked, not drawn as 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deciles = report["position"]["deciles"]
    x = np.arange(len(deciles))
    evs = [d["ev"] for d in deciles]
    defined = [i for i, e in enumerate(evs) if e is not None]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar([x[i] for i in defined], [evs[i] for i in defined], 0.7, color="C0", label="token-weighted EV")
    for i, e in enumerate(evs):
        if e is None:
            ax.text(x[i], 0.0, "n/a", ha="center", va="bottom", fontsize=7, color="0.4")
    agg = report["aggregates"]["token"]["ev"]
    ax.axhline(agg, color="C0", ls="--", lw=1, label=f"aggregate token EV {agg:.3f}")
    iv = (report.get("intervals") or {}).get("token") or {}
    if iv.get("low") is not None:
        ax.axhspan(
            iv["low"], iv["high"], color="C0", alpha=0.12, label=f"95% interval [{iv['low']:.3f}, {iv['high']:.3f}]"
        )
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xticks(x)
    ax.set_xticklabels([f"{10 * d['decile']}-{10 * d['decile'] + 10}%\n{int(d['n'])}" for d in deciles], fontsize=7)
    ax.set_xlabel("position in the response (decile; active tokens below)")
    ax.set_ylabel("explained variance")
    ax.set_title(f"EV by response position ({report['split']})")
    ax.legend(fontsize=7, loc="best")
    data = _png(fig)
    plt.close(fig)
    return data
