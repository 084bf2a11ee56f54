"""Asset checks: dataset integrity, contract integrity and the EV gate, all blocking and partitioned.

Each check is a plain function over files (returning passed + metadata) wrapped by
`@asset_check`. Every check carries `partitions_def` so that one manifest's result never stands
for another's (docs/operations.md: without it a pass leaks across partitions).
"""

import warnings
from pathlib import Path
from typing import Any

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    MetadataValue,
    asset_check,
)

from value_assets.assets import batch_plan, ev_report, heldout_dataset, train_dataset
from value_assets.assets.common import partition_manifest, to_metadata_value
from value_assets.core import vocabulary as v
from value_assets.core.contract_lookup import contract_disagreements, resolve_latest_contract
from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_file
from value_assets.core.publish import read_published
from value_assets.core.report import GATE_MODES, criteria, decide_gate, ev_summary
from value_assets.lineage import Lineage
from value_assets.partitions import manifests_partitions
from value_assets.resources import ArtifactStore, ManifestInbox

# Partitioned checks are "preview" in 1.13 but required here: without them one manifest's pass
# would stand for every manifest (docs/operations.md). Known and intended, so not repeated on every load.
warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec")


def _failed(message: str, **metadata: Any) -> AssetCheckResult:
    return AssetCheckResult(
        passed=False,
        severity=AssetCheckSeverity.ERROR,
        description=message,
        metadata={k: to_metadata_value(v) for k, v in metadata.items()},
    )


# ---------------------------------------------------------------- dataset_integrity


def dataset_integrity_result(ref, split: str) -> AssetCheckResult:
    """Re-hash a dataset file against the manifest's sha."""
    if ref is None:
        return AssetCheckResult(passed=True, metadata={"split": split, "present": False})
    path = Path(ref.path)
    if not path.is_file():
        return _failed(f"{path}: {split} dataset is missing", split=split, path=str(path))
    actual = sha256_file(path)
    if actual != ref.sha256:
        return _failed(
            f"{path}: hashes to {actual}, manifest says {ref.sha256}",
            split=split,
            expected_sha256=ref.sha256,
            actual_sha256=actual,
        )
    return AssetCheckResult(
        passed=True, metadata={"split": split, "sha256": actual, "path": MetadataValue.path(str(path))}
    )


def _dataset_check(context, artifacts, inbox, split: str) -> AssetCheckResult:
    try:
        manifest = partition_manifest(context, artifacts, inbox)
    except InputError as exc:
        return _failed(str(exc), split=split)
    return dataset_integrity_result(manifest.train if split == "train" else manifest.heldout, split)


@asset_check(
    asset=train_dataset,
    name=v.DATASET_INTEGRITY,
    blocking=True,
    partitions_def=manifests_partitions,
    description="The train file still hashes to the manifest's sha.",
)
def train_dataset_integrity(context: AssetCheckExecutionContext, artifacts: ArtifactStore, inbox: ManifestInbox):
    return _dataset_check(context, artifacts, inbox, "train")


@asset_check(
    asset=heldout_dataset,
    name=v.DATASET_INTEGRITY,
    blocking=True,
    partitions_def=manifests_partitions,
    description="The heldout file still hashes to the manifest's sha.",
)
def heldout_dataset_integrity(context: AssetCheckExecutionContext, artifacts: ArtifactStore, inbox: ManifestInbox):
    return _dataset_check(context, artifacts, inbox, "heldout")


# ---------------------------------------------------------------- contract_integrity


@asset_check(
    asset=v.TRAINING_CONTRACT,
    name=v.CONTRACT_INTEGRITY,
    blocking=True,
    partitions_def=manifests_partitions,
    additional_deps=[batch_plan],
    description="The latest contract re-hashes to its recorded sha and agrees with manifest, dataset, "
    "objective and the published plan it was trained on.",
)
def contract_integrity(context: AssetCheckExecutionContext, artifacts: ArtifactStore, inbox: ManifestInbox):
    key = context.partition_key
    lineage = Lineage(context.instance, key)
    try:
        manifest = partition_manifest(context, artifacts, inbox)
        plan_sha = lineage.plan().sha256
        ref = resolve_latest_contract(artifacts.critic_dir(key), pinned_sha256=lineage.contract_sha())
    except InputError as exc:
        return _failed(str(exc))
    # Training read the published plan against this sha, so the contract names it by construction;
    # this re-reads the files the lineage points at (a contract or manifest changed since).
    problems = contract_disagreements(ref.contract, manifest=manifest, plan_sha256=plan_sha)
    meta = {
        v.CONTRACT_SHA256: ref.sha256,
        "contract_path": str(ref.path),
        v.MANIFEST_SHA256: manifest.sha256,
        v.PLAN_SHA256: plan_sha,
    }
    if problems:
        return _failed(f"{ref.path}: " + "; ".join(problems), problems=problems, **meta)
    return AssetCheckResult(passed=True, metadata={k: to_metadata_value(v) for k, v in meta.items()})


# ---------------------------------------------------------------- ev_gate


def gate_result(report: dict[str, Any], report_sha: str) -> AssetCheckResult:
    """Record `decide_gate` over the report (docs/rules.md#evaluation), naming the report sha it was decided on.

    The report's own `passed` is not trusted: the gate is recomputed from the per-batch sufficient
    statistics, and a stated verdict or aggregate that disagrees fails it. Promotion requires this
    result, on the same sha, for the same partition.
    """
    decision = decide_gate(report)
    metadata = {
        v.REPORT_SHA256: report_sha,
        "criteria": criteria(decision.mode if decision.mode in GATE_MODES else "miles"),
        "recomputed": {w: g.to_json() for w, g in decision.weightings.items()},
        "recomputed_intervals": {w: iv.to_json() for w, iv in decision.intervals.items()},
        **ev_summary(report),
    }
    if not decision.passed:
        return _failed("; ".join(decision.failures), failures=list(decision.failures), **metadata)
    return AssetCheckResult(passed=True, metadata={k: to_metadata_value(v) for k, v in metadata.items()})


@asset_check(
    asset=ev_report,
    name=v.EV_GATE,
    blocking=True,
    partitions_def=manifests_partitions,
    description="docs/rules.md#evaluation gate on heldout EV (token and trajectory); blocks promotion.",
)
def ev_gate(context: AssetCheckExecutionContext):
    recorded = next(Lineage(context.instance, context.partition_key).reports(), None)
    if recorded is None or not isinstance(recorded.report_path, str):
        return _failed(f"{v.EV_REPORT} has no materialization for this partition")
    try:
        report, sha = read_published(Path(recorded.report_path), "EV report")
    except InputError as exc:
        return _failed(str(exc), recorded_report_sha256=recorded.report_sha256)
    if sha != recorded.report_sha256:
        return _failed(
            f"report hashes to {sha}, {v.EV_REPORT} recorded {recorded.report_sha256}",
            report_sha256=sha,
            recorded_report_sha256=recorded.report_sha256,
        )
    return gate_result(report, sha)


ALL_CHECKS = [train_dataset_integrity, heldout_dataset_integrity, contract_integrity, ev_gate]
