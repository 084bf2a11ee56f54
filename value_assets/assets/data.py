"""CPU assets: the registered manifest, its validated datasets and the published batch plan.

All run in the Dagster process, before any accelerator is reserved (docs/rules.md#training-run: a run on invalid data
never reserves one).
"""

from dagster import (
    AssetExecutionContext,
    Config,
    DataVersion,
    MaterializeResult,
    MetadataValue,
    TableColumn,
    TableRecord,
    TableSchema,
    asset,
)

from value_assets.assets.common import (
    OWNERS,
    fail_on_bad_input,
    job_setting,
    partition_manifest,
    partition_spec,
    spec_settings,
)
from value_assets.core import vocabulary as v
from value_assets.core.job_configs import TrainJob, field_default
from value_assets.partitions import manifests_partitions
from value_assets.resources import ArtifactStore, ManifestInbox

GROUP = "data"
# A kind is static and a manifest's dataset may be either format (docs/rules.md#dataset).
DATASET_KINDS = {"jsonl", "parquet"}


@asset(partitions_def=manifests_partitions, code_version="1", group_name=GROUP, owners=OWNERS, kinds={"json"})
def value_manifest(context: AssetExecutionContext, artifacts: ArtifactStore, inbox: ManifestInbox) -> MaterializeResult:
    """The registered manifest, re-loaded with its sha pinned: objective, dataset refs, provenance."""
    with fail_on_bad_input(v.VALUE_MANIFEST):
        manifest = partition_manifest(context, artifacts, inbox)
    return MaterializeResult(
        data_version=DataVersion(manifest.sha256),
        metadata={
            v.MANIFEST_SHA256: manifest.sha256,
            "manifest_path": MetadataValue.path(str(manifest.path)),
            "snapshot": MetadataValue.path(str(artifacts.manifest_snapshot_path(context.partition_key))),
            "train_sha256": manifest.train.sha256,
            "train_num_samples": manifest.train.num_samples,
            "heldout_sha256": manifest.heldout.sha256 if manifest.heldout else "absent",
            "objective": MetadataValue.json(manifest.objective.canonical()),
            "provenance": MetadataValue.json(manifest.provenance or {}),
        },
    )


def label_table(label_counts: dict[str, int]) -> MetadataValue:
    schema = TableSchema(columns=[TableColumn("label", "string"), TableColumn("count", "int")])
    records = [TableRecord({"label": str(label), "count": int(n)}) for label, n in sorted(label_counts.items())]
    return MetadataValue.table(records=records, schema=schema)


def dataset_result(dataset, split: str) -> MaterializeResult:
    stats = dataset.stats
    return MaterializeResult(
        data_version=DataVersion(dataset.sha256),
        metadata={
            "split": split,
            "dataset_sha256": dataset.sha256,
            "path": MetadataValue.path(str(dataset.path)),
            "rows": stats.rows,
            "tokens": stats.tokens,
            "active_targets": stats.active_targets,
            "max_tokens": stats.max_tokens,
            "label_counts": label_table(stats.label_counts or {}),
            "stats": MetadataValue.json(stats.to_json()),
        },
    )


def _validate(context, artifacts, inbox, split: str) -> MaterializeResult:
    from value_assets.core.dataset import validate_dataset

    with fail_on_bad_input(f"{split}_dataset"):
        manifest = partition_manifest(context, artifacts, inbox)
        ref = manifest.train if split == "train" else manifest.heldout
        if ref is None:
            # Not an error: such a critic trains, but ev_gate refuses it (no heldout split).
            return MaterializeResult(
                data_version=DataVersion("absent"),
                metadata={"split": split, "present": False, "note": "manifest has no heldout split: not promotable"},
            )
        dataset = validate_dataset(ref, manifest.objective)
    return dataset_result(dataset, split)


@asset(
    partitions_def=manifests_partitions,
    deps=[value_manifest],
    code_version="1",
    group_name=GROUP,
    owners=OWNERS,
    kinds=DATASET_KINDS,
)
def train_dataset(context: AssetExecutionContext, artifacts: ArtifactStore, inbox: ManifestInbox) -> MaterializeResult:
    """The train split, fully validated (docs/rules.md#dataset), with its statistics and label counts."""
    return _validate(context, artifacts, inbox, "train")


@asset(
    partitions_def=manifests_partitions,
    deps=[value_manifest],
    code_version="1",
    group_name=GROUP,
    owners=OWNERS,
    kinds=DATASET_KINDS,
)
def heldout_dataset(
    context: AssetExecutionContext, artifacts: ArtifactStore, inbox: ManifestInbox
) -> MaterializeResult:
    """The heldout split the gate evaluates on, fully validated; marked absent when the manifest has none."""
    return _validate(context, artifacts, inbox, "heldout")


PLAN_SETTINGS = ("global_batch_size", "epochs", "seed")


class PlanConfig(Config):
    """The batch plan (docs/rules.md#batch-plan): the lineage spec's plan settings (`TrainJob`'s, unset: its
    defaults); a run may restate them, not change them. Training trains on the published plan file itself
    (read against the sha recorded here), never on its own config."""

    global_batch_size: int | None = job_setting(TrainJob, "global_batch_size")
    epochs: int | None = job_setting(TrainJob, "epochs")
    seed: int | None = job_setting(TrainJob, "seed")


def plan_settings(spec_plan: dict, config: PlanConfig) -> tuple[int, int, int]:
    """(G, epochs, seed): the lineage spec's, else `TrainJob`'s defaults (checked by `build_plan`);
    the run config may only restate them (`spec_settings`)."""
    defaults = {name: field_default(TrainJob, name) for name in PLAN_SETTINGS}
    settings = defaults | spec_settings(spec_plan, config, TrainJob)
    return settings["global_batch_size"], settings["epochs"], settings["seed"]


@asset(
    partitions_def=manifests_partitions,
    deps=[train_dataset],
    code_version="1",
    group_name=GROUP,
    owners=OWNERS,
    kinds={"json"},
)
def batch_plan(
    context: AssetExecutionContext, config: PlanConfig, artifacts: ArtifactStore, inbox: ManifestInbox
) -> MaterializeResult:
    """The published batch plan: seed, G, epochs, step -> row indices, with its own sha."""
    from value_assets.core.plan import build_plan
    from value_assets.core.publish import publish_once

    with fail_on_bad_input(v.BATCH_PLAN):
        manifest = partition_manifest(context, artifacts, inbox)
        g, epochs, seed = plan_settings(dict(partition_spec(context, artifacts).plan), config)
        plan = build_plan(manifest.train.num_samples, g, epochs, seed)
        path = artifacts.plan_path(context.partition_key)
        # Write-once; the identical plan again is a no-op, a different one for this partition is
        # refused (its critic folder's contract binds the first plan).
        publish_once(path, plan.to_bytes())
    return MaterializeResult(
        data_version=DataVersion(plan.sha256),
        metadata={
            v.PLAN_SHA256: plan.sha256,
            v.PLAN_PATH: MetadataValue.path(str(path)),
            "steps": plan.num_steps,
            "global_batch_size": plan.global_batch_size,
            "epochs": plan.epochs,
            "seed": plan.seed,
            "rows": manifest.train.num_samples,
        },
    )
