"""Validation throughput benchmark (not a test): prints a table.

Generates a JSONL dataset of about --gb gigabytes (and the same rows as Parquet), then measures,
each in a fresh process so peak memory (max RSS) is per measurement:

* `sha256sum` over each file (coreutils; the floor any validator that hashes must pay),
* our `validate_dataset` (hash + every docs/rules.md#dataset check),
* a plain-stdlib reference validator (json.loads per line, Python loops over every value),

Targets: JSONL <= 3x sha256sum, Parquet <= 1.5x, >= 5x faster than the stdlib reference, and peak
memory independent of file size (run with --gb 0.25 and --gb 1).

    python bench/validate.py --gb 0.25 --gb 1 [--workdir DIR] [--reference-mb 256]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def make_bodies(n: int, seed: int) -> list[str]:
    """Row bodies without sample_id: realistic lengths (prompt 64-1024, response 32-2048)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        plen = int(rng.integers(64, 1025))
        rlen = int(rng.integers(32, 2049))
        toks = rng.integers(0, 49152, size=plen + rlen).tolist()
        r = float(rng.integers(0, 2))
        body = (
            f'"tokens":[{",".join(map(str, toks))}],"response_length":{rlen},"returns":[{",".join([repr(r)] * rlen)}]'
        )
        if rng.random() < 0.5:
            mask = np.ones(rlen, dtype=int)
            s = int(rng.integers(1, rlen))
            mask[s : s + rlen // 4] = 0
            body += f',"loss_mask":[{",".join(map(str, mask.tolist()))}]'
        out.append(body)
    return out


def write_dataset(folder: Path, target_bytes: int) -> tuple[Path, Path, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    bodies = make_bodies(512, 0)
    jsonl = folder / "train.jsonl"
    n = 0
    size = 0
    schema = pa.schema(
        [
            ("sample_id", pa.string()),
            ("tokens", pa.list_(pa.int64())),
            ("response_length", pa.int64()),
            ("returns", pa.list_(pa.float64())),
            ("loss_mask", pa.list_(pa.int64())),
        ]
    )
    parsed = [json.loads("{" + b + "}") for b in bodies]
    with open(jsonl, "w") as f:
        while size < target_bytes:
            line = f'{{"sample_id":"row-{n:09d}",{bodies[n % len(bodies)]}}}\n'
            f.write(line)
            size += len(line)
            n += 1
    pqf = folder / "train.parquet"
    with pq.ParquetWriter(pqf, schema) as w:
        for start in range(0, n, 4096):
            idx = range(start, min(n, start + 4096))
            rows = [parsed[i % len(parsed)] for i in idx]
            w.write_table(
                pa.table(
                    {
                        "sample_id": [f"row-{i:09d}" for i in idx],
                        "tokens": [r["tokens"] for r in rows],
                        "response_length": [r["response_length"] for r in rows],
                        "returns": [r["returns"] for r in rows],
                        "loss_mask": [r.get("loss_mask", [1] * r["response_length"]) for r in rows],
                    },
                    schema=schema,
                )
            )
    return jsonl, pqf, n


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of a child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    # ru_maxrss of children is the max over all children so far: run each measurement in its own
    # grandchild via /usr/bin/time-like wrapper instead.
    return wall, before


def run_measure(kind: str, path: Path, n: int, limit_bytes: int | None = None) -> tuple[float, float]:
    code = f"""
import resource, sys, time, json
sys.path.insert(0, {str(HERE.parent)!r})
t = time.perf_counter()
kind = {kind!r}
if kind == "ours":
    from value_assets.core.dataset import validate_dataset
    from value_assets.core.manifest import DatasetRef
    from value_assets.core.objective import Objective
    from value_assets.core.hashing import sha256_file
    import pathlib
    p = pathlib.Path({str(path)!r})
    sha = open(str(p) + ".sha").read().strip()
    t = time.perf_counter()
    ds = validate_dataset(DatasetRef(split="train", path=p, declared_path=p.name, sha256=sha, num_samples={n}),
    Objective())
    assert len(ds) == {n}
else:
    sys.path.insert(0, {str(HERE)!r})
    from reference_validator import validate
    t = time.perf_counter()
    validate({str(path)!r}, limit_bytes={limit_bytes!r})
wall = time.perf_counter() - t
print(json.dumps({{"wall": wall, "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["wall"], res["maxrss_mib"]


def sha256sum_time(path: Path) -> float:
    best = math.inf
    for _ in range(2):
        t = time.perf_counter()
        subprocess.run(["sha256sum", str(path)], check=True, stdout=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, action="append", help="dataset size(s) in GB (default 0.25 and 1)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument(
        "--reference-mb",
        type=int,
        default=256,
        help="the stdlib reference runs on this many MB of the JSONL and is scaled linearly (it is O(bytes))",
    )
    args = ap.parse_args()
    sizes = args.gb or [0.25, 1.0]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="va-bench-"))
    rows = []
    for gb in sizes:
        folder = work / f"{gb:g}gb"
        folder.mkdir(parents=True, exist_ok=True)
        jsonl, pqf, n = write_dataset(folder, int(gb * 1e9))
        for p in (jsonl, pqf):
            Path(str(p) + ".sha").write_text(
                subprocess.run(["sha256sum", str(p)], capture_output=True, text=True, check=True).stdout.split()[0]
            )
        ref_bytes = min(jsonl.stat().st_size, args.reference_mb * 1_000_000)
        ref_wall, ref_rss = run_measure("reference", jsonl, n, limit_bytes=ref_bytes)
        ref_scaled = ref_wall * jsonl.stat().st_size / ref_bytes
        for fmt, p in (("jsonl", jsonl), ("parquet", pqf)):
            sha_t = sha256sum_time(p)
            ours_t, ours_rss = run_measure("ours", p, n)
            rows.append(
                {
                    "size": f"{gb:g} GB",
                    "format": fmt,
                    "file_mb": p.stat().st_size / 1e6,
                    "rows": n,
                    "sha256sum_s": sha_t,
                    "ours_s": ours_t,
                    "ratio": ours_t / sha_t,
                    "reference_s": ref_scaled if fmt == "jsonl" else None,
                    "speedup": ref_scaled / ours_t if fmt == "jsonl" else None,
                    "peak_mib": ours_rss,
                    "ref_peak_mib": ref_rss if fmt == "jsonl" else None,
                }
            )
        shutil.rmtree(folder, ignore_errors=True)
    hdr = (
        f"{'size':<8} {'format':<8} {'file MB':>8} {'rows':>8} {'sha256sum s':>11} {'ours s':>8} {'ours/sha':>8} "
        f"{'stdlib ref s':>12} {'speed-up':>8} {'peak MiB':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ref = f"{r['reference_s']:.1f}" if r["reference_s"] is not None else "-"
        sp = f"{r['speedup']:.1f}x" if r["speedup"] is not None else "-"
        print(
            f"{r['size']:<8} {r['format']:<8} {r['file_mb']:>8.0f} {r['rows']:>8} {r['sha256sum_s']:>11.2f} "
            f"{r['ours_s']:>8.2f} {r['ratio']:>7.2f}x {ref:>12} {sp:>8} {r['peak_mib']:>9.0f}"
        )
    print(
        f"\nstdlib reference measured on the first {args.reference_mb} MB of each JSONL and scaled to the file size;"
        " targets: JSONL <= 3x sha256sum, Parquet <= 1.5x, >= 5x faster than the reference, flat peak memory."
    )


if __name__ == "__main__":
    main()
