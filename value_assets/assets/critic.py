"""GPU assets (training, canary, evaluation, through the launcher) and promotion.

Each GPU asset builds the job's config (`TrainJob` / `EvaluateJob`: the run config's settings,
unset ones taking the job config's defaults, plus the partition's facts), launches it through
`GpuJobLauncher` (the config crosses to the job as JSON in the Pipes extras), then
re-reads what the job published (contract, report) so that the recorded shas come from the
files on disk, not only from what the job said.
"""

import shlex
import shutil
from datetime import UTC, datetime
from typing import Any

from dagster import (
    AssetExecutionContext,
    AssetSpec,
    Config,
    DataVersion,
    Failure,
    MaterializeResult,
    MetadataValue,
    asset,
    multi_asset,
)

from value_assets.assets.common import (
    OWNERS,
    fail_on_bad_input,
    job_setting,
    partition_manifest,
    partition_spec,
    plot_metadata,
    spec_settings,
    to_metadata_value,
)
from value_assets.assets.data import PLAN_SETTINGS, batch_plan, heldout_dataset, train_dataset, value_manifest
from value_assets.core import vocabulary as v
from value_assets.core.checkpoint_files import verify_checkpoint
from value_assets.core.contract_lookup import ContractRef, resolve_latest_contract
from value_assets.core.errors import InputError
from value_assets.core.handoff import (
    HF_BUNDLE,
    MILES_BUNDLE,
    build_handoff,
    check_bundle_location,
    install_bundles,
    miles_bundle_record,
    model_identity,
    read_registry_record,
    record_rl_settings,
    reusable_handoff,
)
from value_assets.core.hashing import sha256_bytes, sha256_file
from value_assets.core.job_configs import EvaluateJob, HandoffJob, TrainJob
from value_assets.core.miles import build_miles_contract
from value_assets.core.plan import BatchPlan, load_published_plan
from value_assets.core.promotion import decide_reuse, lineage_report_sha, verify_promotion
from value_assets.core.publish import read_published
from value_assets.core.report import ev_summary, report_manifest_sha
from value_assets.core.strict_json import canonical_bytes
from value_assets.core.training_spec import TrainingSpec
from value_assets.lineage import Champion, Lineage, PublishedPlan
from value_assets.partitions import manifests_partitions
from value_assets.resources import ArtifactStore, GpuJobLauncher, ManifestInbox

GROUP = "critic"
GPU_POOL = "gpu"
# What the GPU job runs: a PyTorch model, Megatron-core parallelism, Ray workers.
TRAIN_KINDS = {"pytorch", "megatron", "ray"}


class TrainRunConfig(Config):
    """Run config of `critic_training` and `canary_receipt`: the `TrainJob` settings of the lineage's
    training spec, which a run may restate but not change (docs/rules.md#training-spec; unset:
    the spec's). The batch plan is the published one (`batch_plan`)."""

    backbone: str | None = job_setting(TrainJob, "backbone")
    gpus: int | None = job_setting(TrainJob, "gpus")
    tensor_parallel: int | None = job_setting(TrainJob, "tensor_parallel")
    pipeline_parallel: int | None = job_setting(TrainJob, "pipeline_parallel")
    save_interval: int | None = job_setting(TrainJob, "save_interval")
    lr: float | None = job_setting(TrainJob, "lr")
    warmup_steps: int | None = job_setting(TrainJob, "warmup_steps")
    micro_batch_tokens: int | None = job_setting(
        TrainJob, "micro_batch_tokens"
    )  # "auto" is command-line only (Dagster config has no int-or-string type)
    recompute: str | None = job_setting(TrainJob, "recompute")
    recompute_layers: int | None = job_setting(TrainJob, "recompute_layers")
    distributed_optimizer: bool | None = job_setting(TrainJob, "distributed_optimizer")
    sequence_parallel: bool | None = job_setting(TrainJob, "sequence_parallel")
    optimizer_offload: float | None = job_setting(TrainJob, "optimizer_offload")
    freeze: str | None = job_setting(TrainJob, "freeze")
    head_bias: str | None = job_setting(TrainJob, "head_bias")
    placement_strategy: str | None = job_setting(TrainJob, "placement_strategy")
    weight_decay: float | None = job_setting(TrainJob, "weight_decay")
    clip_grad: float | None = job_setting(TrainJob, "clip_grad")
    timeout_s: float | None = job_setting(TrainJob, "timeout_s")


def published_plan(lineage: Lineage) -> tuple[PublishedPlan, BatchPlan]:
    """The partition's published plan, read against the sha its materialization recorded: a plan
    file changed since is refused here, before anything is launched."""
    published = lineage.plan()
    return published, load_published_plan(published.path, published.sha256)


def train_job(
    config: TrainRunConfig,
    spec: TrainingSpec,
    manifest,
    output_dir,
    published: PublishedPlan,
    plan: BatchPlan,
    data_roots=None,
    canary: bool = False,
    resume_from: tuple[str, ...] | None = None,
    champion: Champion | None = None,
) -> TrainJob:
    """The training job of a partition: the lineage spec's settings (a run config may only restate
    them). The manifest sha is pinned, so the job trains on the very bytes this partition
    registered; the published plan is the job's plan (path and sha; the job reads it again and
    trains on exactly it); a resume may start only from a save the lineage recorded
    (`resume_from`); the spec's sha is recorded in the contract. With the spec's
    `champion.warm_start`, a fresh run starts from `champion`'s weights (docs/rules.md#champion)."""
    settings = spec_settings(
        {k: val for k, val in spec.train_settings().items() if k not in PLAN_SETTINGS}, config, TrainJob
    )
    return TrainJob(
        manifest=manifest.path,
        manifest_sha256=manifest.sha256,
        output=output_dir,
        plan=published.path,
        plan_sha256=published.sha256,
        global_batch_size=plan.global_batch_size,
        epochs=plan.epochs,
        seed=plan.seed,
        data_roots=data_roots,
        canary=canary,
        resume_from=resume_from,
        backbone_sha256=spec.backbone.sha256,
        training_spec_sha256=spec.sha256,
        warm_start_checkpoint=champion.checkpoint if champion and spec.champion.warm_start else None,
        warm_start_contract_sha256=champion.contract_sha256 if champion and spec.champion.warm_start else None,
        **settings,
    )


def _job_extras(context: AssetExecutionContext, manifest) -> dict[str, Any]:
    """What the job is for (its paths are in the job config the launcher adds)."""
    return {
        "partition_key": context.partition_key,
        v.MANIFEST_SHA256: manifest.sha256,
        "asset_keys": sorted(k.to_user_string() for k in context.selected_asset_keys),
    }


def materialization_of(results, task: str) -> MaterializeResult:
    """The (last) materialization a single-asset GPU task reported; `launch` guarantees one."""
    materializations = [r for r in results if isinstance(r, MaterializeResult)]
    if not materializations:
        raise Failure(description=f"GPU job {task} reported no materialization")
    return materializations[-1]


def with_plots(metadata, base) -> dict[str, Any]:
    """The job's metadata with its `plots` entry (``{name: {file, sha256}}`` under `base`) shown
    as the plots themselves (`plot_metadata`)."""
    metadata = dict(metadata or {})
    plots = metadata.pop("plots", None)
    return {**metadata, **plot_metadata(getattr(plots, "value", plots), base)} if plots is not None else metadata


def contract_metadata(ref: ContractRef) -> dict[str, Any]:
    contract = ref.contract
    return {
        v.CONTRACT_SHA256: ref.sha256,
        "contract_path": MetadataValue.path(str(ref.path)),
        "checkpoint": MetadataValue.path(str(ref.checkpoint_dir)),
        "completed_steps": to_metadata_value(contract.get("completed_steps")),
        "batch_plan_sha256": to_metadata_value(contract.get("batch_plan_sha256")),
        "source_manifest_sha256": to_metadata_value(contract.get("source_manifest_sha256")),
    }


@multi_asset(
    specs=[
        AssetSpec(
            v.CRITIC_CHECKPOINT,
            deps=[batch_plan, train_dataset, value_manifest],
            code_version="1",
            group_name=GROUP,
            owners=OWNERS,
            kinds=TRAIN_KINDS,
            description="The trained critic: the latest contracted save.",
        ),
        AssetSpec(
            v.TRAINING_CONTRACT,
            deps=[v.CRITIC_CHECKPOINT],
            code_version="1",
            group_name=GROUP,
            owners=OWNERS,
            kinds=TRAIN_KINDS,
            description="The contract binding that save to manifest, dataset, objective and plan "
            "(docs/rules.md#contract).",
        ),
    ],
    partitions_def=manifests_partitions,
    pool=GPU_POOL,
    can_subset=False,
)
def critic_training(
    context: AssetExecutionContext,
    config: TrainRunConfig,
    artifacts: ArtifactStore,
    inbox: ManifestInbox,
    launcher: GpuJobLauncher,
):
    """Train (or resume) the critic with the GPU job; both assets are versioned by the contract sha."""
    key = context.partition_key
    lineage = Lineage(context.instance, key)
    output = artifacts.critic_dir(key)
    with fail_on_bad_input("critic_training"):
        manifest = partition_manifest(context, artifacts, inbox)
        published, plan = published_plan(lineage)
        spec = partition_spec(context, artifacts)
        champion = lineage.champion(spec.family) if spec.champion.warm_start else None
        if champion is not None:
            context.log.info(
                f"warm start from the {spec.family} champion {champion.partition_key} ({champion.contract_sha256[:12]})"
            )
        job = train_job(
            config, spec, manifest, output, published, plan, inbox.roots(), resume_from=lineage.saves(output),
            champion=champion,
        )  # fmt: skip
    results = launcher.launch(context, v.TRAIN, job, _job_extras(context, manifest))
    with fail_on_bad_input("critic_training: published contract"):
        ref = resolve_latest_contract(output)
    for result in results:
        if not isinstance(result, MaterializeResult):
            continue
        reported = result.metadata.get(v.CONTRACT_SHA256) if result.metadata else None
        reported = getattr(reported, "value", reported)
        if reported is not None and reported != ref.sha256:
            raise Failure(description=f"GPU job reported contract {reported} but {ref.path} hashes to {ref.sha256}")
        yield MaterializeResult(
            asset_key=result.asset_key,
            data_version=DataVersion(ref.sha256),
            metadata={**with_plots(result.metadata, output), **contract_metadata(ref)},
        )


@asset(
    partitions_def=manifests_partitions,
    deps=[batch_plan, train_dataset],
    code_version="1",
    group_name=GROUP,
    pool=GPU_POOL,
    owners=OWNERS,
    kinds=TRAIN_KINDS,
)
def canary_receipt(
    context: AssetExecutionContext,
    config: TrainRunConfig,
    artifacts: ArtifactStore,
    inbox: ManifestInbox,
    launcher: GpuJobLauncher,
) -> MaterializeResult:
    """One planned step end to end; writes a non-promotable receipt and no contract (docs/rules.md#training-run)."""
    key = context.partition_key
    output = artifacts.canary_dir(key, context.run.run_id)
    with fail_on_bad_input(v.CANARY_RECEIPT):
        manifest = partition_manifest(context, artifacts, inbox)
        published, plan = published_plan(Lineage(context.instance, key))
        spec = partition_spec(context, artifacts)
        job = train_job(config, spec, manifest, output, published, plan, inbox.roots(), canary=True)
    result = materialization_of(launcher.launch(context, v.CANARY, job, _job_extras(context, manifest)), v.CANARY.name)
    return MaterializeResult(
        data_version=result.data_version,
        metadata={**(result.metadata or {}), "promotable": False, "output_dir": MetadataValue.path(str(output))},
    )


class EvaluateRunConfig(Config):
    """Run config of `ev_report`: the `EvaluateJob` settings and gate policy of the lineage's training
    spec, which a run may restate but not change (the gate is fixed before any report exists:
    docs/rules.md#training-spec). Checkpoint, contract, manifest, split and report path are the
    partition's."""

    num_batches: int | None = job_setting(EvaluateJob, "num_batches")
    global_batch_size: int | None = job_setting(EvaluateJob, "global_batch_size")
    seed: int | None = job_setting(EvaluateJob, "seed")
    gpus: int | None = job_setting(EvaluateJob, "gpus")
    tensor_parallel: int | None = job_setting(EvaluateJob, "tensor_parallel")
    pipeline_parallel: int | None = job_setting(EvaluateJob, "pipeline_parallel")
    gate_mode: str | None = job_setting(EvaluateJob, "gate_mode")
    gate_min_ev: float | None = job_setting(EvaluateJob, "gate_min_ev")
    placement_strategy: str | None = job_setting(EvaluateJob, "placement_strategy")
    micro_batch_tokens: int | None = job_setting(EvaluateJob, "micro_batch_tokens")
    timeout_s: float | None = job_setting(EvaluateJob, "timeout_s")


def report_metadata(report: dict[str, Any], report_sha: str, report_path) -> dict[str, Any]:
    summary = ev_summary(report)
    metadata: dict[str, Any] = {
        v.REPORT_SHA256: report_sha,
        v.REPORT_PATH: MetadataValue.path(str(report_path)),
        v.CONTRACT_SHA256: to_metadata_value(report.get("contract_sha256")),
        v.MANIFEST_SHA256: to_metadata_value(report_manifest_sha(report)),
        "dataset_sha256": to_metadata_value(report.get("dataset_sha256")),
        **{k: to_metadata_value(v) for k, v in summary.items()},
    }
    metadata.update(plot_metadata(report.get("plots"), report_path.parent, strip_prefix=report_path.stem + "-"))
    return metadata


@asset(
    partitions_def=manifests_partitions,
    deps=[v.TRAINING_CONTRACT, v.CRITIC_CHECKPOINT, heldout_dataset],
    code_version="1",
    group_name=GROUP,
    pool=GPU_POOL,
    owners=OWNERS,
    kinds={"pytorch", "ray"},
)
def ev_report(
    context: AssetExecutionContext,
    config: EvaluateRunConfig,
    artifacts: ArtifactStore,
    inbox: ManifestInbox,
    launcher: GpuJobLauncher,
) -> MaterializeResult:
    """Forward-only EV evaluation of the latest contracted critic on heldout rows (docs/rules.md#evaluation).

    A failing gate still materializes its report; `ev_gate` (blocking) then stops promotion.
    A published report is reused instead of re-evaluated only when its sha is the one an evaluation
    of this lineage recorded for this contract (docs/rules.md#promotion); any other report at the path is refused
    with a message naming it (`core.promotion.decide_reuse`).
    """
    key = context.partition_key
    lineage = Lineage(context.instance, key)
    with fail_on_bad_input(v.EV_REPORT):
        manifest = partition_manifest(context, artifacts, inbox)
        ref = resolve_latest_contract(artifacts.critic_dir(key), pinned_sha256=lineage.contract_sha())
        report_path = artifacts.report_path(key, ref.sha256)
        recorded_sha = lineage_report_sha(lineage.reports(), contract_sha256=ref.sha256, report_path=report_path)
        reuse = decide_reuse(report_path, recorded_sha)
    extra: dict[str, Any] = {v.REUSED: reuse}
    if reuse:
        context.log.info(
            f"{report_path} was published for contract {ref.sha256} with the sha this lineage recorded "
            f"({recorded_sha}): reused, not re-evaluated"
        )
    else:
        split = "heldout" if manifest.heldout is not None else "train"
        with fail_on_bad_input("ev_report: config"):
            spec = partition_spec(context, artifacts)
            champion = lineage.champion(spec.family)
            if champion is not None:
                context.log.info(f"the {spec.family} champion {champion.partition_key} is scored beside this critic")
            job = EvaluateJob(
                checkpoint=ref.checkpoint_dir,
                manifest=manifest.path,
                contract_sha256=ref.sha256,
                report=report_path,
                split=split,
                data_roots=inbox.roots(),
                training_spec_sha256=spec.sha256,
                champion_checkpoint=champion.checkpoint if champion else None,
                champion_contract_sha256=champion.contract_sha256 if champion else None,
                champion_partition=champion.partition_key if champion else None,
                champion_tolerance=spec.champion.tolerance,
                **spec_settings(spec.evaluate_settings(), config, EvaluateJob),
            )
        result = materialization_of(
            launcher.launch(context, v.EVALUATE, job, _job_extras(context, manifest)), v.EVALUATE.name
        )
        extra.update(result.metadata or {})
    with fail_on_bad_input("ev_report: published report"):
        report, report_sha = read_published(report_path, "EV report", expected_sha=recorded_sha if reuse else None)
    reported = getattr(extra.get(v.REPORT_SHA256), "value", extra.get(v.REPORT_SHA256))
    if not reuse and reported is not None and reported != report_sha:
        raise Failure(
            description=f"the evaluation job reported report {reported} but {report_path} hashes to {report_sha}"
        )
    if report.get("contract_sha256") != ref.sha256:
        raise Failure(
            description=f"{report_path} names contract {report.get('contract_sha256')!r}, expected {ref.sha256}"
        )
    return MaterializeResult(
        data_version=DataVersion(report_sha), metadata={**extra, **report_metadata(report, report_sha, report_path)}
    )


def export_handoff(
    context: AssetExecutionContext,
    artifacts: ArtifactStore,
    launcher: GpuJobLauncher,
    ref: ContractRef,
    previous: dict[str, Any] | None,
    extras: dict[str, Any],
) -> tuple[dict[str, Any], bool]:
    """(the record's `handoff`, whether it was reused). Exports through the GPU job (torch stays
    out of this process) into a staging folder, installs the bundles under `handoff/`, then reads
    them back; a failure leaves no record behind (the caller writes it only after this returns)."""
    key = context.partition_key
    objective = ref.contract["objective"]
    scalar_hf = objective.get("loss_type") == "mse"
    with fail_on_bad_input("promoted_critic: hand-off"):
        miles_contract = build_miles_contract(ref.contract, model_identity(ref.contract, ref.sha256))
    reused = reusable_handoff(previous, contract_sha256=ref.sha256, miles_contract=miles_contract, scalar_hf=scalar_hf)
    if reused is not None:
        context.log.info(f"hand-off bundles for contract {ref.sha256} already match the registry record: reused")
        return reused, True
    with fail_on_bad_input("promoted_critic: hand-off folder"):
        check_bundle_location(artifacts.handoff_dir(key) / MILES_BUNDLE, itself=False)  # never exported through a link
    staging = artifacts.handoff_staging_dir(key, context.run.run_id)
    if staging.exists():
        shutil.rmtree(staging)
    staging.parent.mkdir(parents=True, exist_ok=True)
    try:
        with fail_on_bad_input("promoted_critic: hand-off config"):
            job = HandoffJob(
                checkpoint=ref.checkpoint_dir,
                contract_sha256=ref.sha256,
                out_dir=staging,
                model_identity=miles_contract["model_identity"],
                scalar_hf=scalar_hf,
            )
        result = materialization_of(launcher.launch(context, v.HANDOFF, job, extras), v.HANDOFF.name)
        names = (MILES_BUNDLE, HF_BUNDLE) if scalar_hf else (MILES_BUNDLE,)
        with fail_on_bad_input("promoted_critic: exported bundles"):
            miles_bundle_record(staging / MILES_BUNDLE, miles_contract)  # before anything is replaced
            install_bundles(staging, artifacts.handoff_dir(key), names)
            handoff = build_handoff(
                handoff_dir=artifacts.handoff_dir(key),
                miles_contract=miles_contract,
                objective=objective,
                scalar_hf=scalar_hf,
            )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    reported = getattr((result.metadata or {}).get(v.MILES_CONTRACT_SHA256), "value", None)
    if reported is not None and reported != handoff[MILES_BUNDLE]["contract_sha256"]:
        raise Failure(
            description=f"the hand-off job reported Miles contract {reported}, but the installed one hashes "
            f"to {handoff[MILES_BUNDLE]['contract_sha256']}"
        )
    return handoff, False


def handoff_metadata(handoff: dict[str, Any], reused: bool) -> dict[str, Any]:
    """The bundles and the exact RL-side settings, as shown on the materialization."""
    settings = record_rl_settings({"handoff": handoff})
    hf = handoff[HF_BUNDLE]
    return {
        "handoff_reused": reused,
        "model_identity": handoff["model_identity"],
        "miles_bundle": MetadataValue.path(handoff[MILES_BUNDLE]["dir"]),
        v.MILES_CONTRACT_SHA256: handoff[MILES_BUNDLE]["contract_sha256"],
        "miles_files_sha256": handoff[MILES_BUNDLE]["files_sha256"],
        "hf_bundle": MetadataValue.path(hf["dir"]) if hf else None,
        "hf_files_sha256": hf["files_sha256"] if hf else None,
        "miles_args": MetadataValue.md("```\n" + shlex.join(settings["miles_args"]) + "\n```"),
        "verl_critic_model_path": MetadataValue.path(hf["dir"]) if hf else None,
        # the critic folder carries no tokenizer files: verl needs critic.model.tokenizer_path
        "verl_tokenizer_missing": settings.get("verl_tokenizer_missing"),
        "rl_settings": MetadataValue.json(settings),
    }


@asset(
    partitions_def=manifests_partitions,
    deps=[ev_report, v.TRAINING_CONTRACT],
    code_version="2",
    group_name=GROUP,
    pool=GPU_POOL,
    owners=OWNERS,
    kinds={"json"},
)
def promoted_critic(
    context: AssetExecutionContext, artifacts: ArtifactStore, inbox: ManifestInbox, launcher: GpuJobLauncher
) -> MaterializeResult:
    """The registry record the online RL job pins: checkpoint + contract sha (docs/rules.md#promotion), and the
    hand-off bundles with their shas and the RL-side settings (docs/rules.md#hand-off, docs/rules.md#hand-off).

    The decision is `ev_gate`'s (blocking) and the rules are `core.promotion.verify_promotion`'s:
    this asset reads what the lineage recorded (the contract, the report sha `ev_report` recorded
    for it, this partition's latest `ev_gate` evaluation) and hands it to them with the files.
    Then the GPU job exports the bundles (`export_handoff`); only after they are installed and read
    back is the record written: a failed export writes no record.
    """
    from value_assets.core.publish import atomic_write

    key = context.partition_key
    lineage = Lineage(context.instance, key)
    with fail_on_bad_input("promoted_critic refused"):
        manifest = partition_manifest(context, artifacts, inbox)
        spec = partition_spec(context, artifacts)
        ref = resolve_latest_contract(artifacts.critic_dir(key), pinned_sha256=lineage.contract_sha())
        report_path = artifacts.report_path(key, ref.sha256)
        record = verify_promotion(
            partition_key=key,
            manifest_sha256=manifest.sha256,
            contract=ref,
            report_path=report_path,
            recorded_report_sha256=lineage_report_sha(
                lineage.reports(), contract_sha256=ref.sha256, report_path=report_path
            ),
            gate=lineage.last_gate(),
            # Every file of the promoted save against its contract (docs/rules.md#checkpoint-binding).
            verify_checkpoint=verify_checkpoint,
        )
    registry_path = artifacts.registry_path(key)
    previous = previous_record(context, lineage, registry_path)
    record["handoff"], reused = export_handoff(
        context, artifacts, launcher, ref, previous, _job_extras(context, manifest)
    )
    if spec.family is not None:
        record["family"] = spec.family
    record["training_spec_sha256"] = spec.sha256
    data = canonical_bytes(record)
    # The record's bytes depend only on what was promoted (no timestamp: it is the metadata's), so
    # promoting the same contract and report again leaves the pinned record as it is and its pin
    # valid (docs/rules.md#hand-off). A file that is not the pinned record is replaced.
    if previous is not None and canonical_bytes(previous) == data and sha256_file(registry_path) == sha256_bytes(data):
        record_sha256 = sha256_bytes(data)
        context.log.info(f"{registry_path} already holds this promotion's record: left as it is")
    else:
        record_sha256 = atomic_write(registry_path, data)
    return MaterializeResult(
        data_version=DataVersion(record_sha256),
        metadata={
            "promoted_at": datetime.now(UTC).isoformat(timespec="seconds"),
            v.FAMILY: spec.family,
            v.TRAINING_SPEC_SHA256: spec.sha256,
            "registry_record": MetadataValue.path(str(registry_path)),
            # The pin that makes the record (and through it every bundle byte) trustworthy: the
            # artifacts folder alone cannot vouch for itself (docs/rules.md#hand-off).
            v.REGISTRY_RECORD_SHA256: record_sha256,
            "handoff_command": MetadataValue.md(
                "```\n"
                + shlex.join(["value-assets", "handoff", str(registry_path), "--record-sha256", record_sha256])
                + "\n```"
            ),
            "checkpoint": MetadataValue.path(record["checkpoint"]),
            v.CONTRACT_SHA256: record["contract_sha256"],
            v.REPORT_SHA256: record["report_sha256"],
            v.MANIFEST_SHA256: record["manifest_sha256"],
            **handoff_metadata(record["handoff"], reused),
            "record": MetadataValue.json(record),
        },
    )


def previous_record(context: AssetExecutionContext, lineage: Lineage, registry_path) -> dict[str, Any] | None:
    """The registry record the last promotion of this partition wrote, read from `registry_path`
    under the pin it recorded in the instance; None when there is none, or when the file is no
    longer that record (the hand-off is then exported again rather than reused: a record rewritten
    in the artifacts folder to match swapped bundles would otherwise be reused and pinned anew)."""
    try:
        sha = lineage.promoted_record_sha()
    except InputError:
        return None  # never promoted (or promoted before records were pinned)
    try:
        return read_registry_record(registry_path, sha)[0]
    except InputError as exc:
        context.log.warning(f"{exc}: not the record the last promotion wrote; the hand-off is exported again")
        return None
