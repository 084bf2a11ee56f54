"""Small Dagster-side helpers shared by assets and checks: error mapping, the partition's manifest,
run config, instance lookups (what the lineage recorded, handed to the rules in `value_assets.core`)."""

from __future__ import annotations

import base64
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from dagster import AssetCheckKey, AssetKey, AssetRecordsFilter, Config, DagsterInstance, Failure, MetadataValue
from pydantic import Field

from value_assets.core.errors import InputError
from value_assets.core.job_configs import field_default, field_doc
from value_assets.core.promotion import GateRecord, PromotionRefused, ReportRecord

INLINE_PLOT_MAX_BYTES = 512 * 1024
# One owner for every asset (the UI's owner filter and catalog); a team, not a person.
OWNERS = ["team:rl-infra"]


@contextmanager
def fail_on_bad_input(what: str) -> Iterator[None]:
    """Turn the domain's refusals into a step failure with the rule's own message, never retried."""
    try:
        yield
    except (InputError, PromotionRefused) as exc:
        raise Failure(description=f"{what}: {exc}", allow_retries=False) from None


def partition_manifest(context, artifacts, inbox):
    """The manifest the context's partition registered, loaded with its sha pinned."""
    from value_assets.core.registration import load_registered_manifest

    key = context.partition_key
    return load_registered_manifest(artifacts.partition_dir(key), key, inbox.roots())


def _values(metadata) -> dict[str, Any]:
    return {key: getattr(value, "value", value) for key, value in (metadata or {}).items()}


def job_setting(job_config: type, name: str) -> Any:
    """A Dagster run-config field standing for field `name` of a job config (`TrainJob`,
    `EvaluateJob`): unset (None) means the job config's default, and the description is the job
    config's own. The run config never holds a second copy of a default or of a rule: the job
    config validates what is given when the asset builds it."""
    try:
        default = field_default(job_config, name)
    except KeyError:
        default = None
    note = "" if default is None else f" Unset: {default!r}."
    return Field(default=None, description=field_doc(job_config, name) + note)


def given(config: Config) -> dict[str, Any]:
    """The run-config fields that were set (not None), as job-config keyword arguments."""
    return {name: getattr(config, name) for name in type(config).model_fields if getattr(config, name) is not None}


def latest_metadata(instance: DagsterInstance, asset_key: str, partition_key: str) -> dict[str, Any] | None:
    """Metadata values of the newest materialization of one partition of an asset, or None."""
    result = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey(asset_key), asset_partitions=[partition_key]), limit=1
    )
    if not result.records:
        return None
    materialization = result.records[0].asset_materialization
    if materialization is None:
        return None
    return _values(materialization.metadata)


def recorded_saves(instance: DagsterInstance, partition_key: str, critic_dir) -> tuple[str, ...]:
    """The contract shas of the saves into `critic_dir` that this partition's runs logged as they
    wrote them (`core.contract.saved_line`): the only saves a Dagster-launched resume may start from
    (docs/rules.md#resume). A run that failed after a save still logged it."""
    from dagster import RunsFilter

    from value_assets.core.contract import saved_contracts

    runs = instance.get_runs(filters=RunsFilter(tags={"dagster/partition": partition_key}))
    lines = (record.user_message for run in runs for record in instance.all_logs(run.run_id))
    return tuple(sorted(saved_contracts(lines, critic_dir)))


def promoted_record_sha(instance: DagsterInstance, partition_key: str) -> str:
    """The sha256 of the registry record the latest `promoted_critic` materialization of this
    partition wrote: the pin of `value-assets handoff --instance` (docs/rules.md#hand-off)."""
    from value_assets.core.errors import InputError
    from value_assets.core.hashing import is_sha

    meta = latest_metadata(instance, "promoted_critic", partition_key)
    if meta is None:
        raise InputError(f"partition {partition_key!r}", "has no promoted_critic materialization in the Dagster instance: nothing was promoted")
    sha = meta.get("registry_record_sha256")
    if not is_sha(sha):
        raise InputError(f"partition {partition_key!r}", "its latest promotion recorded no registry_record_sha256 (promoted before "
                         "records were pinned): materialize promoted_critic again")
    return sha


def ev_report_records(instance: DagsterInstance, partition_key: str) -> Iterator[ReportRecord]:
    """Every `ev_report` materialization of one partition, newest first, as the rules read them."""
    records_filter = AssetRecordsFilter(asset_key=AssetKey("ev_report"), asset_partitions=[partition_key])
    cursor = None
    while True:
        result = instance.fetch_materializations(records_filter, limit=100, cursor=cursor)
        for record in result.records:
            meta = _values(record.asset_materialization.metadata if record.asset_materialization else None)
            yield ReportRecord(contract_sha256=meta.get("contract_sha256"), report_path=meta.get("report_path"),
                               report_sha256=meta.get("report_sha256"), evaluated=meta.get("reused") is not True)
        if not result.has_more:
            return
        cursor = result.cursor


def latest_gate_record(instance: DagsterInstance, partition_key: str) -> GateRecord | None:
    """The latest completed `ev_gate` evaluation of this partition only (never another's), or None."""
    # No public instance method filters check executions by partition in 1.13; the event log
    # storage's does (the same query the UI's partitioned check history uses).
    from dagster._core.event_api import PartitionKeyFilter
    from dagster._core.storage.asset_check_execution_record import COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES

    key = AssetCheckKey(AssetKey("ev_report"), "ev_gate")
    history = instance.event_log_storage.get_asset_check_execution_history(
        key, limit=1, status=set(COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES),
        partition_filter=PartitionKeyFilter(key=partition_key))
    evaluation = history[0].evaluation if history else None
    if evaluation is None:
        return None
    return GateRecord(partition_key=evaluation.partition, passed=evaluation.passed, blocking=evaluation.blocking,
                      report_sha256=_values(evaluation.metadata).get("report_sha256"), run_id=history[0].run_id)


def plot_files(plots: Any, base: Path, strip_prefix: str = "") -> list[tuple[str, Path, str | None]]:
    """(name, path, recorded sha) of a report's plots.

    Accepts the GPU job's form ``{name: {"file": ..., "sha256": ...}}`` as well as
    ``{name: path}`` and a plain list of paths (name = file stem without `strip_prefix`).
    """
    entries: list[tuple[str, Any, str | None]] = []
    if isinstance(plots, dict):
        for name, value in plots.items():
            if isinstance(value, dict):
                entries.append((str(name), value.get("file") or value.get("path"), value.get("sha256")))
            else:
                entries.append((str(name), value, None))
    elif isinstance(plots, list):
        for value in plots:
            stem = Path(str(value)).stem
            entries.append((stem.removeprefix(strip_prefix) or stem, value, None))
    out = []
    for name, raw, sha in entries:
        if isinstance(raw, str) and raw:
            out.append((name, Path(raw) if Path(raw).is_absolute() else base / raw, sha))
    return out


def plot_metadata(plots: Any, base: Path, strip_prefix: str = "") -> dict[str, Any]:
    """Report plots inline (markdown data-URI images) when small, else as file paths; a plot that
    no longer hashes to the sha the report recorded is flagged instead of shown."""
    from value_assets.core.hashing import sha256_file

    out: dict[str, Any] = {}
    for label, path, sha in plot_files(plots, base, strip_prefix):
        key = f"plot_{label}"
        if not path.is_file():
            out[key] = MetadataValue.text(f"missing: {path}")
        elif sha is not None and sha256_file(path) != sha:
            out[key] = MetadataValue.text(f"{path} does not hash to the report's recorded {sha}")
        elif path.stat().st_size <= INLINE_PLOT_MAX_BYTES and path.suffix.lower() == ".png":
            data = base64.b64encode(path.read_bytes()).decode("ascii")
            out[key] = MetadataValue.md(f"![{label}](data:image/png;base64,{data})")
        else:
            out[key] = MetadataValue.path(str(path))
    return out


def to_metadata_value(value: Any) -> Any:
    """Plain JSON values as Dagster metadata: numbers and strings as is, the rest as JSON."""
    if value is None:
        return MetadataValue.text("null")
    if isinstance(value, (bool, int, float, str)):
        return value
    return MetadataValue.json(value)
