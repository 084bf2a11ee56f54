"""Stand-in for `python -m value_assets.gpu.pipes_job`, used by the launcher tests.

A real subprocess speaking real Dagster Pipes. It writes what the GPU job writes (contracts and a
`latest` pointer, a write-once EV report with two PNG plots, a canary receipt) without any model,
and reports materializations with realistic metadata. Behaviour knobs come from the manifest's
`provenance.standin` (kept, not interpreted, by the product): `ev` (float, the EV it reports for
both weightings), `silent` (report nothing, exit 0), `exit_code` (fail after writing nothing).
"""

import argparse
import json
import os
import struct
import sys
import zlib
from pathlib import Path

from dagster_pipes import open_dagster_pipes

from value_assets.core.hashing import sha256_bytes, sha256_file
from value_assets.core.objective import Objective
from value_assets.core.plan import build_plan


def canonical(obj) -> bytes:
    return (json.dumps(obj, sort_keys=True, separators=(",", ":")) + "\n").encode()


def png_1x1(rgb=(200, 30, 30)) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    raw = b"\x00" + bytes(rgb)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def write_once(path: Path, data: bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "xb") as f:
        f.write(data)
    sha = sha256_bytes(data)
    path.with_name(path.name + ".sha256").write_text(sha + "\n")
    return sha


def knobs(manifest_path: str) -> dict:
    return (json.loads(Path(manifest_path).read_text()).get("provenance") or {}).get("standin") or {}


def train(pipes, argv, canary: bool):
    p = argparse.ArgumentParser()
    p.add_argument("manifest")
    for flag in ("--output", "--backbone", "--lr"):
        p.add_argument(flag)
    for flag in ("--global-batch-size", "--epochs", "--seed", "--gpus", "--save-interval", "--micro-batch-tokens"):
        p.add_argument(flag, type=int)
    p.add_argument("--canary", action="store_true")
    a = p.parse_args(argv)
    k = knobs(a.manifest)
    if k.get("exit_code"):
        print("stand-in failing on purpose", file=sys.stderr)
        sys.exit(k["exit_code"])
    if k.get("silent"):
        return
    mpath = Path(a.manifest)
    manifest = json.loads(mpath.read_text())
    train_ref = manifest["train"]
    plan = build_plan(train_ref["num_samples"], a.global_batch_size, a.epochs, a.seed)
    steps = 1 if canary else plan.steps
    out = Path(a.output)
    save = out / f"iter_{steps:07d}"
    save.mkdir(parents=True, exist_ok=True)
    (save / "model.safetensors").write_bytes(b"stand-in weights")
    losses = [round(2.0 / (1 + s), 4) for s in range(1, steps + 1)]
    base = {"manifest_sha256": sha256_file(mpath), "train_dataset_sha256": train_ref["sha256"],
            "batch_plan_sha256": plan.sha256}
    if canary:
        receipt = canonical({"schema": "value-assets.canary-receipt.v1", **base, "executed_steps": 1,
                             "first_batch_sample_ids_sha256": sha256_bytes(repr(plan.to_json()).encode())})
        sha = write_once(out / "canary_receipt.json", receipt)
        pipes.report_asset_materialization(asset_key="canary_receipt", data_version=sha,
                                           metadata={"receipt_sha256": sha, "executed_steps": 1, "final_loss": losses[-1]})
        return
    contract = canonical({
        "schema": "value-assets.contract.v1",
        "source_manifest_sha256": base["manifest_sha256"],
        "train_dataset_sha256": base["train_dataset_sha256"],
        "objective": Objective.from_json(manifest["objective"]).canonical(),
        "batch_plan": {"seed": a.seed, "global_batch_size": a.global_batch_size,
                       "drop_incomplete_batch": True, "algorithm": "miles"},
        "batch_plan_sha256": plan.sha256,
        "completed_steps": steps,
        "model": {"backbone": a.backbone},
        "checkpoint": str(save),
    })
    (save / "value_pretrain_contract.json").write_bytes(contract)
    (out / "latest").write_text(save.name + "\n")
    sha = sha256_bytes(contract)
    pipes.report_asset_materialization(
        asset_key="critic_checkpoint", data_version=sha,
        metadata={"steps": steps, "final_loss": losses[-1], "loss_curve": losses, "contract_sha256": sha,
                  "tokens_per_s": 1234.5})
    pipes.report_asset_materialization(asset_key="training_contract", data_version=sha,
                                       metadata={"contract_sha256": sha, "completed_steps": steps})
    # A check no step declares: the launcher must drop it, not crash.
    pipes.report_asset_check(check_name="standin_undeclared", passed=True, asset_key="training_contract")


def evaluate(pipes, argv):
    p = argparse.ArgumentParser()
    for flag in ("--checkpoint", "--manifest", "--contract-sha256", "--report", "--split"):
        p.add_argument(flag)
    p.add_argument("--num-batches", type=int)
    p.add_argument("--global-batch-size", type=int)
    a = p.parse_args(argv)
    k = knobs(a.manifest)
    if k.get("silent"):
        return
    ev = float(k.get("ev", 0.4))
    batches = a.num_batches
    positive = batches if ev > 0 else 0
    agg = {"ev": ev, "positive_batches": positive, "batches": batches}
    passed = ev > 0 and positive * 2 > batches and a.split == "heldout"
    report_path = Path(a.report)
    plots = []
    for name in ("calibration", "ev_per_batch"):
        plot = report_path.with_name(f"{report_path.stem}-{name}.png")
        plot.parent.mkdir(parents=True, exist_ok=True)
        plot.write_bytes(png_1x1())
        plots.append(str(plot))
    report = {
        "schema": "value-assets.ev-report.v1", "passed": passed, "split": a.split,
        "manifest_sha256": sha256_file(a.manifest), "contract_sha256": a.contract_sha256,
        "checkpoint": a.checkpoint, "execution": {"forward_only": True, "optimizer_steps": 0, "dp": 1},
        "aggregates": {"token": dict(agg), "trajectory": dict(agg)},
        "r2": ev - 0.01, "auroc": 0.5 + max(ev, 0) / 2, "plots": plots,
    }
    sha = write_once(report_path, canonical(report))
    pipes.report_asset_materialization(
        asset_key="ev_report", data_version=sha,
        metadata={"report_sha256": sha, "token_ev": ev, "trajectory_ev": ev, "passed": passed})


def main():
    with open_dagster_pipes() as pipes:
        extras = pipes.extras
        pipes.log.info(f"stand-in task {extras['task']} for partition {extras.get('partition_key')} (pid {os.getpid()})")
        if extras["task"] == "evaluate":
            evaluate(pipes, extras["argv"])
        else:
            train(pipes, extras["argv"], canary=extras["task"] == "canary")


if __name__ == "__main__":
    main()
