"""Stand-in for `python -m value_assets.gpu.pipes_job`, used by the launcher tests.

A real subprocess speaking real Dagster Pipes. It writes what the GPU job writes, with the core's
own builders (contracts and the `latest` pointer, a write-once EV report with two PNG plots, a
canary receipt, fake-but-well-formed hand-off bundles whose Miles contract is core's), without any model, and reports
materializations with realistic metadata. Behaviour knobs come from the manifest's
`provenance.standin` (kept, not interpreted, by the product): `ev` (float, the EV it reports for
both weightings), `silent` (report nothing, exit 0), `exit_code` (fail after writing nothing),
`enospc_once` (a marker path: the first evaluation that finds no marker creates it and gets
ENOSPC from `os.write` when the report's `.sha256` sidecar is written: a disk that fills up
between report and sidecar).
"""

import errno
import json
import math
import os
import struct
import sys
import zlib
from pathlib import Path

from dagster_pipes import open_dagster_pipes

from value_assets.core.checkpoint_files import describe_folder
from value_assets.core.contract import (
    build_contract,
    build_receipt,
    iter_dirname,
    load_verified,
    resolve_step_dir,
    write_contract,
)
from value_assets.core.dataset import validate_dataset
from value_assets.core.job_configs import EvaluateJob, HandoffJob, TrainJob
from value_assets.core.manifest import load_manifest
from value_assets.core.mixed import default_batch_size, mixed_label_batches
from value_assets.core.plan import build_plan, load_published_plan
from value_assets.core.progress import TrainProgress
from value_assets.core.publish import atomic_write, publish_once
from value_assets.core.report import ChampionScores, build_report
from value_assets.core.stats import RankReport
from value_assets.core.strict_json import canonical_bytes


def png_1x1(rgb=(200, 30, 30)) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"\x00" + bytes(rgb)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def knobs(manifest_path: str) -> dict:
    return (json.loads(Path(manifest_path).read_text()).get("provenance") or {}).get("standin") or {}


def train(pipes, config, canary: bool):
    a = TrainJob.from_json(config)  # the job config crosses the boundary as data, like the real job
    assert a.canary == canary, (a.canary, canary)
    k = knobs(a.manifest)
    if k.get("exit_code"):
        print("stand-in failing on purpose", file=sys.stderr)
        sys.exit(k["exit_code"])
    if k.get("silent"):
        return
    manifest = load_manifest(a.manifest, pinned_sha256=a.manifest_sha256, data_roots=a.data_roots)
    # like the real job: the published plan when the asset passes one (read against its sha)
    plan = (
        load_published_plan(a.plan, a.plan_sha256)
        if a.plan is not None
        else build_plan(manifest.train.num_samples, a.global_batch_size, a.epochs, a.seed)
    )
    out = a.output
    if canary:
        train = validate_dataset(manifest.train, manifest.objective)
        ids = [row.sample_id for row in train.rows(plan.batch(1))]
        receipt = build_receipt(
            manifest_sha256=manifest.sha256, train_sha256=manifest.train.sha256, plan=plan, first_batch_sample_ids=ids
        )
        sha = publish_once(out / "canary_receipt.json", canonical_bytes(receipt))
        pipes.report_asset_materialization(
            asset_key="canary_receipt",
            data_version=sha,
            metadata={"receipt_sha256": sha, "executed_steps": 1, "final_loss": 1.9},
        )
        return
    steps = plan.num_steps
    warm_start = None
    if a.warm_start_checkpoint is not None:  # like the real job: the champion only against its pinned contract
        step_dir, _ = resolve_step_dir(a.warm_start_checkpoint)
        _, their_sha = load_verified(step_dir, pinned_sha256=a.warm_start_contract_sha256)
        warm_start = {"contract_sha256": their_sha, "checkpoint": str(step_dir)}
    save = out / iter_dirname(steps)
    save.mkdir(parents=True, exist_ok=True)
    (save / "model.safetensors").write_bytes(b"stand-in weights")
    losses = [round(2.0 / (1 + s), 4) for s in range(1, steps + 1)]
    # Progress through the real job's helper, so the tests prove the instance's event log gets it.
    progress = TrainProgress(pipes.log.info, steps)
    for step, loss in enumerate(losses, start=1):
        progress(step, {"loss": loss, "explained_variance": 1.0 - loss, "tokens_per_s": 1234.5})
    progress.finish()
    # What the real job writes beside the checkpoints, and its plot (the job renders it with matplotlib).
    (out / "tensorboard").mkdir(parents=True, exist_ok=True)
    curve_sha = publish_once(out / "training_curve.png", png_1x1((30, 30, 200)))
    contract = build_contract(
        manifest_sha256=manifest.sha256,
        train_sha256=manifest.train.sha256,
        objective=manifest.objective.canonical(),
        plan=plan,
        completed_steps=steps,
        model={"backbone": a.backbone, "manifest": str(a.manifest)},
        backbone_config={"name": "stand-in"},
        checkpoint=str(save),
        checkpoint_files=describe_folder(save),
        training_spec_sha256=a.training_spec_sha256,
        warm_start=warm_start,
    )
    sha = write_contract(out, contract)
    pipes.report_asset_materialization(
        asset_key="critic_checkpoint",
        data_version=sha,
        metadata={
            "steps": steps,
            "final_loss": losses[-1],
            "final_ev": 1.0 - losses[-1],
            "contract_sha256": sha,
            "tokens_per_s": 1234.5,
            "standin_config": {"raw_value": config, "type": "json"},
            "loss_summary": {
                "raw_value": {"logged_steps": steps, "first_loss": losses[0], "min_loss": min(losses)},
                "type": "json",
            },
            "plots": {
                "raw_value": {"training_curve": {"file": "training_curve.png", "sha256": curve_sha}},
                "type": "json",
            },
            "tensorboard": {"raw_value": str(out / "tensorboard"), "type": "path"},
        },
    )
    pipes.report_asset_materialization(
        asset_key="training_contract", data_version=sha, metadata={"contract_sha256": sha, "completed_steps": steps}
    )
    # A check no step declares: the launcher must drop it, not crash.
    pipes.report_asset_check(check_name="standin_undeclared", passed=True, asset_key="training_contract")


def evaluate(pipes, config):
    """A real core report from synthetic values V = a*R + (1-a)/2, whose EV is exactly 1 - (1-a)^2."""
    a = EvaluateJob.from_json(config)
    k = knobs(a.manifest)
    if k.get("silent"):
        return
    if k.get("enospc_once") and not Path(k["enospc_once"]).exists():
        Path(k["enospc_once"]).write_text("")
        real_write = os.write

        def full_disk(fd, data):
            if bytes(data[-6:]) == b".json\n":  # the report's sidecar line "<sha>  ev-<sha12>.json\n"
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        os.write = full_disk
    ev_target = float(k.get("ev", 0.4))
    slope = 1.0 - math.sqrt(1.0 - ev_target)
    manifest = load_manifest(a.manifest)
    ref = manifest.heldout if a.split == "heldout" else manifest.train
    data = validate_dataset(ref, manifest.objective)
    g = a.global_batch_size or default_batch_size(len(data), a.num_batches, a.gpus)
    batches = mixed_label_batches(list(data.labels), g, a.num_batches, a.seed)
    rank_reports, active = [], []
    for batch in batches:
        rank_reports.append(
            [
                RankReport.from_rows(
                    0,
                    [
                        (i, row.returns, slope * row.returns + (1.0 - slope) / 2, row.loss_mask)
                        for i, row in zip(batch, data.rows(batch), strict=True)
                    ],
                )
            ]
        )
        active.append(int(sum(data.active_targets[i] for i in batch)))
    champion = None
    if a.champion_checkpoint is not None:
        # Like the real job: the champion's save only against its pinned contract; its values are
        # V = a'R + (1-a')/2 with a' from the `ev` knob of the manifest it was trained on.
        step_dir, _ = resolve_step_dir(a.champion_checkpoint)
        their_contract, their_sha = load_verified(step_dir, pinned_sha256=a.champion_contract_sha256)
        their_slope = 1.0 - math.sqrt(1.0 - float(knobs(their_contract["model"]["manifest"]).get("ev", 0.4)))
        champion = ChampionScores(
            partition=a.champion_partition,
            contract_sha256=their_sha,
            checkpoint=str(step_dir),
            tolerance=a.champion_tolerance,
            rank_reports=[
                [
                    RankReport.from_rows(
                        0,
                        [
                            (i, row.returns, their_slope * row.returns + (1.0 - their_slope) / 2, row.loss_mask)
                            for i, row in zip(batch, data.rows(batch), strict=True)
                        ],
                    )
                ]
                for batch in batches
            ],
        )
    report = build_report(
        champion=champion,
        training_spec_sha256=a.training_spec_sha256,
        manifest_sha256=manifest.sha256,
        dataset_sha256=data.sha256,
        split=a.split,
        checkpoint=str(a.checkpoint),
        contract_sha256=a.contract_sha256,
        dp=1,
        seed=a.seed,
        global_batch_size=g,
        batches=batches,
        rank_reports=rank_reports,
        active_targets=active,
        labels=list(data.labels),
        gate_mode=a.gate_mode,
        gate_min_ev=a.gate_min_ev,
    )
    report_path = a.report
    # Like the GPU job: plots published first, then the report naming them {name: {file, sha256}}.
    report["plots"] = {}
    for name in ("ev_per_batch", "calibration", "ev_by_position"):
        plot = report_path.with_name(f"{report_path.stem}-{name}.png")
        report["plots"][name] = {"file": plot.name, "sha256": publish_once(plot, png_1x1())}
    sha = publish_once(report_path, canonical_bytes(report))
    pipes.report_asset_materialization(
        asset_key="ev_report",
        data_version=sha,
        metadata={"report_sha256": sha, "token_ev": report["aggregates"]["token"]["ev"], "passed": report["passed"]},
    )


def handoff(pipes, config):
    """Bundles without weights: the Miles layout (tracker, iter folder, contract built by core from
    the promoted contract) and, for mse, an `hf/` folder. Knob `handoff_exit_code`: fail instead."""
    from value_assets.core.contract import load_contract
    from value_assets.core.miles import (
        MILES_CONTRACT_NAME,
        MILES_TRACKER_NAME,
        build_miles_contract,
        miles_iter_dirname,
    )

    a = HandoffJob.from_json(config)
    contract, _ = load_contract(a.checkpoint, a.contract_sha256)
    if knobs(load_manifest_path(contract)).get("handoff_exit_code"):
        (a.out_dir / "miles").mkdir(parents=True, exist_ok=True)  # a half-written export
        print("stand-in hand-off failing on purpose", file=sys.stderr)
        sys.exit(knobs(load_manifest_path(contract))["handoff_exit_code"])
    miles = build_miles_contract(contract, a.model_identity)
    out = a.out_dir / "miles"
    n = miles["completed_steps"]
    (out / miles_iter_dirname(n)).mkdir(parents=True)
    (out / miles_iter_dirname(n) / "common.pt").write_bytes(b"stand-in megatron checkpoint")
    (out / MILES_TRACKER_NAME).write_text(f"{n}\n")
    sha = atomic_write(out / MILES_CONTRACT_NAME, canonical_bytes(miles))
    if a.scalar_hf:
        (a.out_dir / "hf").mkdir()
        (a.out_dir / "hf" / "config.json").write_text('{"num_labels": 1}\n')
        (a.out_dir / "hf" / "model.safetensors").write_bytes(b"stand-in hf weights")
    pipes.report_asset_materialization(
        asset_key="promoted_critic", data_version=sha, metadata={"miles_contract_sha256": sha}
    )


def load_manifest_path(contract) -> str:
    """The manifest the stand-in's training recorded (in the contract's `model`) for its knobs."""
    return contract["model"]["manifest"]


def main():
    with open_dagster_pipes() as pipes:
        extras = pipes.extras
        pipes.log.info(
            f"stand-in task {extras['task']} for partition {extras.get('partition_key')} (pid {os.getpid()})"
        )
        if extras["task"] == "evaluate":
            evaluate(pipes, extras["config"])
        elif extras["task"] == "handoff":
            handoff(pipes, extras["config"])
        else:
            train(pipes, extras["config"], canary=extras["task"] == "canary")


if __name__ == "__main__":
    main()
