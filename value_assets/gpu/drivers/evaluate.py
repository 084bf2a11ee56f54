"""Forward-only evaluation and the EV report (docs/rules.md#evaluation).

No optimizer exists on the workers, no step is taken, dropout is off (eval mode). The workers are
data parallel, with tensor and pipeline parallelism inside each replica (any layout: the
checkpoint is re-sharded on load). Each data-parallel rank's last pipeline stage returns float64
sufficient statistics, totals and per row; the driver checks their coverage and that the rows add
up to the totals, sums, decides the gate (in `cfg.gate_mode`) and publishes the report write-once,
with its three plots (EV per batch, calibration, EV by response decile). A failing gate still
publishes.
Like training, `prepare` makes every CPU-side check before the cluster is reserved.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from value_assets.core.backbone import BackboneConfig
from value_assets.core.contract import load_verified, resolve_step_dir
from value_assets.core.dataset import Dataset, validate_dataset
from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_bytes
from value_assets.core.job_configs import EvaluateJob
from value_assets.core.manifest import Manifest, load_manifest
from value_assets.core.mixed import default_batch_size, mixed_label_batches
from value_assets.core.objective import Objective
from value_assets.core.plan import assign_to_ranks, data_parallel_size
from value_assets.core.publish import publication_state, publish_all
from value_assets.core.report import ChampionScores, build_report
from value_assets.core.stats import RankReport
from value_assets.core.strict_json import canonical_bytes


@dataclass
class EvalResult:
    report_path: str
    report_sha256: str
    passed: bool
    report: dict[str, Any]
    plots: dict[str, str]


def _check_writable(report_path: Path) -> None:
    """The report's folder must take a new file: found out here, not after the whole evaluation."""
    folder = report_path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # publish_all creates the missing part below the nearest existing folder
    probe = folder / f".{report_path.name}.{uuid.uuid4().hex}.probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as exc:
        raise InputError(
            str(report_path), f"cannot write the report: folder {folder} is not writable ({exc.strerror})"
        ) from None


@dataclass
class _Prepared:
    step_dir: Path
    contract: dict[str, Any]
    contract_sha256: str
    manifest: Manifest
    dataset: Dataset
    dp: int
    global_batch_size: int
    batches: list[tuple[int, ...]]
    micro_batch_tokens: int
    champion_dir: Path | None = None
    champion_contract: dict[str, Any] | None = None
    champion_sha256: str | None = None


def prepare(cfg: EvaluateJob, log: Callable[[str], None] = print) -> _Prepared:
    """Every CPU-side check of docs/rules.md#evaluation, before anything is reserved: the contract (pinned), the
    manifest and objective it binds, the split's data, the layout against the backbone, the
    batch selection and the write-once report path. Writes nothing. (The settings' own rules
    are `EvaluateJob`'s.)"""
    from value_assets.gpu.drivers.train import check_model_split

    step_dir, _ = resolve_step_dir(cfg.checkpoint)  # the caller's pin is the one that counts
    contract, contract_sha = load_verified(step_dir, pinned_sha256=cfg.contract_sha256)
    manifest = load_manifest(cfg.manifest, data_roots=cfg.data_roots)
    if contract["source_manifest_sha256"] != manifest.sha256:
        raise InputError(
            str(cfg.manifest),
            f"manifest sha256 {manifest.sha256} is not the one the contract binds "
            f"({contract['source_manifest_sha256']})",
        )
    if contract["objective"] != manifest.objective.canonical():
        raise InputError(str(cfg.manifest), "objective differs from the contract's")
    ref = manifest.heldout if cfg.split == "heldout" else manifest.train
    if ref is None:
        raise InputError(
            f"{manifest.path}: heldout",
            "the manifest has no heldout split: its critic can train but cannot be evaluated for promotion",
        )
    backbone = BackboneConfig.from_json(contract["backbone_config"])
    ds = validate_dataset(ref, manifest.objective, vocab_size=backbone.vocab_size, max_seq_len=backbone.max_seq_len)
    no_label = np.flatnonzero(np.isnan(ds.labels))
    if no_label.size:
        i = int(no_label[0])
        raise InputError(
            ds.location(i),
            "row has no single scalar active label (its active returns differ); EV batches need one label per row",
        )
    dp = data_parallel_size(
        total_gpus=cfg.gpus, tensor_parallel=cfg.tensor_parallel, pipeline_parallel=cfg.pipeline_parallel
    )
    check_model_split(backbone, cfg.tensor_parallel, cfg.pipeline_parallel)
    g = cfg.global_batch_size or default_batch_size(len(ds), cfg.num_batches, dp)
    if g < 2 or g % dp:
        raise InputError(
            "global_batch_size",
            f"{g} must be >= 2 and divisible by the data-parallel size {dp} ({len(ds)} rows, {cfg.num_batches} "
            "batches)",
        )
    batches = mixed_label_batches(ds.labels.tolist(), g, cfg.num_batches, cfg.seed)
    report_path = cfg.report
    # A report without its sidecar is an unfinished publication: the identical result completes it.
    if publication_state(report_path) not in ("absent", "unfinished"):
        raise InputError(str(report_path), "a report already exists here; reports are write-once")
    _check_writable(report_path)
    longest = int(ds.lengths.max()) - 1
    log(f"{cfg.split} data ok: {len(ds)} rows; {len(batches)} batches of {g} rows, data-parallel size {dp}")
    prep = _Prepared(
        step_dir, contract, contract_sha, manifest, ds, dp, g, batches, max(cfg.micro_batch_tokens, longest)
    )
    if cfg.champion_checkpoint is not None:
        _prepare_champion(cfg, prep)
    return prep


def _prepare_champion(cfg: EvaluateJob, prep: _Prepared) -> None:
    """The family champion (docs/rules.md#champion): its save verified against its pinned contract,
    a critic of the same backbone and objective as the one evaluated (so the same workers score it
    on the same batches)."""
    assert cfg.champion_checkpoint is not None and cfg.champion_contract_sha256 is not None
    step_dir, _ = resolve_step_dir(cfg.champion_checkpoint)
    contract, sha = load_verified(step_dir, pinned_sha256=cfg.champion_contract_sha256)
    where = f"champion_checkpoint {step_dir}"
    if contract.get("backbone_config") != prep.contract["backbone_config"]:
        raise InputError(where, "the champion's backbone differs from this critic's: it is not of the same family")
    if contract.get("objective") != prep.contract["objective"]:
        raise InputError(where, "the champion's objective differs from this critic's: it is not of the same family")
    prep.champion_dir, prep.champion_contract, prep.champion_sha256 = step_dir, contract, sha


def _score(cluster, batches, ds: Dataset, dp: int, mbt: int, log, what: str) -> list[list[RankReport]]:
    """The loaded critic's rank reports for every batch."""
    from value_assets.gpu.drivers.train import row_payload

    rank_reports = []
    for k, batch in enumerate(batches):
        per_dp = assign_to_ranks(batch, dp)
        calls = []
        for info in cluster.infos:
            rows = [row_payload(ds, i) for i in per_dp[info["dp_rank"]]]
            calls.append(((rows, mbt, info["dp_rank"]), {}))
        out = cluster.call_each("evaluate", calls)
        # One report per data-parallel rank: its last pipeline stage has the values, and
        # tensor-parallel peers there compute the same statistics.
        reps = [
            RankReport.from_json(o)
            for o, info in zip(out, cluster.infos, strict=True)
            if info["tp_rank"] == 0 and info["last_stage"]
        ]
        rank_reports.append(reps)
        log(f"evaluated {what}batch {k + 1}/{len(batches)}")
    return rank_reports


def _bounds(interval: dict[str, Any]) -> str:
    low, high = interval["low"], interval["high"]
    return "interval undefined" if low is None else f"[{low:.4f}, {high:.4f}]"


def evaluate(cfg: EvaluateJob, log: Callable[[str], None] = print) -> EvalResult:
    """`prepare` (every refusal), then forward passes on the reserved workers, then publication."""
    from value_assets.gpu.drivers.plots import calibration_png, ev_by_position_png, ev_per_batch_png
    from value_assets.gpu.workers.cluster import start_workers

    prep = prepare(cfg, log)
    step_dir, contract, contract_sha, manifest, ds = (
        prep.step_dir,
        prep.contract,
        prep.contract_sha256,
        prep.manifest,
        prep.dataset,
    )
    dp, g, batches, mbt, report_path = (
        prep.dp,
        prep.global_batch_size,
        prep.batches,
        prep.micro_batch_tokens,
        cfg.report,
    )

    # --- forward-only on the cluster -------------------------------------------------------------
    rank_reports: list[list[RankReport]] = []
    spec = cfg.worker_spec(
        BackboneConfig.from_json(contract["backbone_config"]), Objective.from_json(contract["objective"])
    )
    with start_workers(
        spec, ray_address=cfg.ray_address, timeout_s=cfg.timeout_s, placement_strategy=cfg.placement_strategy, log=log
    ) as cluster:
        # The files may have changed since `prepare` verified them: the workers use only bytes that
        # match the contract (gpu/runtime/checkpoint.py).
        loaded = cluster.call_all("load", str(step_dir), False, contract)
        if sorted(set(loaded)) != [contract["completed_steps"]]:
            raise InputError(
                str(step_dir), f"ranks loaded iterations {loaded}, the contract says {contract['completed_steps']}"
            )
        rank_reports = _score(cluster, batches, ds, dp, mbt, log, "")
        if prep.champion_dir is not None:
            # The champion on the same workers and batches (same backbone and objective: checked in
            # `prepare`); only bytes matching its contract are used.
            assert prep.champion_contract is not None
            loaded = cluster.call_all("load", str(prep.champion_dir), False, prep.champion_contract)
            if sorted(set(loaded)) != [prep.champion_contract["completed_steps"]]:
                raise InputError(str(prep.champion_dir), f"ranks loaded iterations {loaded} of the champion, its "
                                 f"contract says {prep.champion_contract['completed_steps']}")  # fmt: skip
            champion_reports = _score(cluster, batches, ds, dp, mbt, log, "champion ")
    champion = None
    if prep.champion_dir is not None:
        assert prep.champion_sha256 is not None
        champion = ChampionScores(
            partition=cfg.champion_partition,
            contract_sha256=prep.champion_sha256,
            checkpoint=str(prep.champion_dir),
            tolerance=cfg.champion_tolerance,
            rank_reports=champion_reports,
        )
    report = build_report(
        manifest_sha256=manifest.sha256,
        dataset_sha256=ds.sha256,
        split=cfg.split,
        checkpoint=str(step_dir),
        contract_sha256=contract_sha,
        dp=dp,
        seed=cfg.seed,
        global_batch_size=g,
        batches=batches,
        rank_reports=rank_reports,
        active_targets=[int(ds.active_targets[list(b)].sum()) for b in batches],
        labels=ds.labels.tolist(),
        gate_mode=cfg.gate_mode,
        gate_min_ev=cfg.gate_min_ev,
        training_spec_sha256=cfg.training_spec_sha256,
        champion=champion,
    )
    # --- publication: plots first, then the report that names them -----------------------------------
    values = [v for reps in rank_reports for r in reps for v in r.row_values]
    labels = [float(ds.labels[i]) for reps in rank_reports for r in reps for i in r.row_indices]
    stem = report_path.name[:-5] if report_path.name.endswith(".json") else report_path.name
    images = [
        (name, report_path.with_name(f"{stem}-{name}.png"), data)
        for name, data in (
            ("ev_per_batch", ev_per_batch_png(report)),
            ("calibration", calibration_png(values, labels, tuple(manifest.objective.reward_range))),
            ("ev_by_position", ev_by_position_png(report)),
        )
    ]
    plots = {name: {"file": path.name, "sha256": sha256_bytes(data)} for name, path, data in images}
    report["plots"] = plots
    # The plots and the report that names them, all or nothing (a full disk leaves none of them).
    sha = publish_all([(path, data) for _name, path, data in images] + [(report_path, canonical_bytes(report))])[-1]
    agg = report["aggregates"]
    iv = report["intervals"]
    log(
        f"report {report_path} sha256 {sha}: token EV {agg['token']['ev']:.4f} (95% {_bounds(iv['token'])}), "
        f"trajectory EV {agg['trajectory']['ev']:.4f} (95% {_bounds(iv['trajectory'])}), gate "
        f"({report['gate']['mode']}) {'PASSED' if report['passed'] else 'FAILED'}"
    )
    return EvalResult(
        report_path=str(report_path),
        report_sha256=sha,
        passed=bool(report["passed"]),
        report=report,
        plots={k: str(report_path.with_name(v["file"])) for k, v in plots.items()},
    )
