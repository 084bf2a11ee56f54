"""Synthetic rollouts with a learnable value signal, for demos, tests and benchmarks.

Each prompt opens with one of eight *task* tokens; the task fixes the success probability p
(known to the generator). The reward is Bernoulli(p), broadcast to every response token (the
Monte-Carlo return with gamma = lambda = 1). Some response spans are masked out as tool
"observation" tokens. A critic can therefore learn V = p from the prompt, and the best possible
trajectory-weighted EV on the held-out split (predicting p exactly) is recorded in the manifest's
provenance. `shuffle_labels` permutes rewards across rows: the negative control, optimal EV ~ 0.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_file
from value_assets.core.manifest import SCHEMA
from value_assets.core.objective import Objective
from value_assets.core.paths import confined, new_folder, plain_name, staged_file
from value_assets.core.publish import PublishError

TASK_TOKENS = np.arange(1000, 1008)
TASK_P = np.linspace(0.05, 0.95, TASK_TOKENS.shape[0])
VOCAB = 49152
MAX_TOKENS = 511


def _rows(
    n: int, rng: np.random.Generator, split: str, seed: int
) -> tuple[list[dict[str, Any]], np.ndarray, np.ndarray]:
    rows = []
    task = rng.integers(0, TASK_TOKENS.shape[0], size=n)
    p = TASK_P[task]
    reward = (rng.random(n) < p).astype(np.float64)
    for i in range(n):
        plen = int(rng.integers(8, 49))
        rlen = int(rng.integers(8, 65))
        prompt = np.concatenate([[TASK_TOKENS[task[i]]], rng.integers(2000, VOCAB, size=plen - 1)])
        response = rng.integers(2000, VOCAB, size=rlen)
        row: dict[str, Any] = {
            "sample_id": f"{split}-{seed}-{i:06d}",
            "tokens": np.concatenate([prompt, response]).astype(int).tolist(),
            "response_length": rlen,
            "returns": [float(reward[i])] * rlen,
        }
        if rng.random() < 0.5:
            # An observation span (tool output) inside the response is not trained on.
            start = int(rng.integers(1, rlen))
            stop = min(rlen, start + int(rng.integers(1, max(2, rlen // 3))))
            mask = [1] * rlen
            mask[start:stop] = [0] * (stop - start)
            row["loss_mask"] = mask
        rows.append(row)
    return rows, p, reward


def trajectory_ev(labels: np.ndarray, predictions: np.ndarray) -> float | None:
    """Trajectory-weighted EV of `predictions` for per-row scalar `labels` (population variances);
    None where it is undefined (fewer than two rows, or all labels equal)."""
    if labels.size < 2 or labels.var() <= 1e-8:
        return None
    e = labels - predictions
    return float(1.0 - e.var() / labels.var())


def write_rows(path: Path, rows: list[dict[str, Any]], fmt: str, *, shown_as: Path | None = None) -> None:
    """Write the rows all-or-nothing (`paths.staged_file`): a failure leaves no partial file and
    raises PublishError naming `shown_as` (default `path`)."""
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"unknown format {fmt!r}")
    with staged_file(path, shown_as=shown_as) as f:
        if fmt == "jsonl":
            for r in rows:
                f.write((json.dumps(r, separators=(",", ":")) + "\n").encode("utf-8"))
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema(
            [
                ("sample_id", pa.string()),
                ("tokens", pa.list_(pa.int64())),
                ("response_length", pa.int64()),
                ("returns", pa.list_(pa.float64())),
                ("loss_mask", pa.list_(pa.int64())),
            ]
        )
        cols = {
            name: [r.get(name, [1] * r["response_length"] if name == "loss_mask" else None) for r in rows]
            for name in schema.names
        }
        try:
            pq.write_table(pa.table(cols, schema=schema), f)
        except pa.ArrowException as exc:  # pyarrow reports a failed write (ENOSPC) as its own error
            raise OSError(getattr(exc, "errno", None) or 5, str(exc)) from exc


# The demo's training spec: the tiny random backbone is the demo's explicit choice (a real manifest
# names its actor), and the stricter gate mode makes the shuffled control's refusal rest on its
# EV interval reaching below 0, not on the sign of a near-zero EV.
DEMO_TRAINING: dict[str, Any] = {"schema": "value-assets.training.v1", "backbone": "tiny", "gate": {"mode": "interval"}}


def make_demo_data(
    out_dir: str | Path,
    *,
    rows: int = 2048,
    heldout_rows: int = 256,
    seed: int = 0,
    shuffle_labels: bool = False,
    fmt: str = "jsonl",
    name: str | None = None,
    training: dict[str, Any] | None = None,
) -> Path:
    """Write `<out_dir>/<name>.json` (manifest) and `<out_dir>/<name>/{train,heldout}.<ext>`; return the manifest path.

    `name` defaults to "demo" ("demo-shuffled" for the negative control), so both fit one watched folder;
    a given name is a plain file name inside `out_dir` (`paths.plain_name`).
    The manifest's training spec (docs/rules.md#training-spec) is `training`, by default the demo's
    explicit choice `DEMO_TRAINING`: the random tiny backbone, gated in the stricter interval mode.

    Every file is first written whole into a staging folder beside them; only then are they renamed
    into place, data first and the manifest that pins them last. A failure (ENOSPC, EACCES) removes
    what was staged and names the path (`PublishError`); nothing is left half-written.
    """
    out = Path(out_dir)
    name = plain_name(name or ("demo-shuffled" if shuffle_labels else "demo"), "--name")
    data_dir, mpath = confined(out, name, "--name"), confined(out, f"{name}.json", "--name")
    for path in (data_dir, mpath):
        if path.is_symlink():
            raise InputError(str(path), "is a symlink: refusing to write through it")
    with new_folder(out):  # a failure removes `out` again if this call made it
        try:
            staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out))
        except OSError as exc:
            raise PublishError(out, exc) from exc
        try:
            return _write_demo(
                staging,
                data_dir,
                mpath,
                name,
                rows=rows,
                heldout_rows=heldout_rows,
                seed=seed,
                shuffle_labels=shuffle_labels,
                fmt=fmt,
                training=training,
            )
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _write_demo(
    staging: Path,
    data_dir: Path,
    mpath: Path,
    name: str,
    *,
    rows: int,
    heldout_rows: int,
    seed: int,
    shuffle_labels: bool,
    fmt: str,
    training: dict[str, Any] | None,
) -> Path:
    rng = np.random.default_rng(seed)
    ext = "jsonl" if fmt == "jsonl" else "parquet"
    splits = {}
    heldout_ev = None
    for split, n in (("train", rows), ("heldout", heldout_rows)):
        if n == 0:
            continue
        rs, p, reward = _rows(n, rng, split, seed)
        if shuffle_labels:
            perm = rng.permutation(n)
            reward = reward[perm]
            for r, new in zip(rs, reward, strict=True):
                r["returns"] = [float(new)] * r["response_length"]
        path = staging / f"{split}.{ext}"
        write_rows(path, rs, fmt, shown_as=data_dir / path.name)
        splits[split] = {"path": f"{name}/{split}.{ext}", "sha256": sha256_file(path), "num_samples": n}
        if split == "heldout":
            # With shuffled labels the reward no longer depends on the prompt: the best critic
            # predicts a constant, whose EV is 0 (where EV is defined at all).
            heldout_ev = trajectory_ev(reward, p)
            if shuffle_labels and heldout_ev is not None:
                heldout_ev = 0.0
    manifest = {
        "schema": SCHEMA,
        "train": splits["train"],
        "heldout": splits.get("heldout"),
        "objective": Objective().canonical(),
        "provenance": {
            "generator": "value_assets.core.demo_data",
            "seed": seed,
            "shuffle_labels": shuffle_labels,
            "task_success_probabilities": TASK_P.tolist(),
            "bayes_optimal_trajectory_ev_heldout": heldout_ev,
        },
        "training": dict(DEMO_TRAINING if training is None else training),
    }
    with staged_file(staging / mpath.name, shown_as=mpath) as f:
        f.write((json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    try:  # renames within one folder tree: nothing more to write; the manifest that pins the data last
        data_dir.mkdir(exist_ok=True)
        for split in splits:
            os.replace(staging / f"{split}.{ext}", data_dir / f"{split}.{ext}")
        os.replace(staging / mpath.name, mpath)
    except OSError as exc:
        raise PublishError(mpath, exc) from exc
    return mpath
