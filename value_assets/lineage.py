"""What the Dagster instance recorded for one lineage (one manifest's partition), read in one place.

Every fact the trust rules need from the instance (the published plan's sha, the contract and
report shas the lineage recorded, the last gate evaluation, the pinned registry record, the saves
a resume may start from) is read here, by `Lineage(instance, partition_key)`, and handed to the
rules in `value_assets.core` as plain values. Assets, checks, the demo and `value-assets handoff
--instance` use it; no other module knows which asset holds which fact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dagster import AssetCheckKey, AssetKey, AssetRecordsFilter, DagsterInstance, RunsFilter

from value_assets.core import vocabulary as v
from value_assets.core.errors import InputError
from value_assets.core.hashing import is_sha
from value_assets.core.promotion import GateRecord, ReportRecord


def _values(metadata: Any) -> dict[str, Any]:
    return {key: getattr(value, "value", value) for key, value in (metadata or {}).items()}


@dataclass(frozen=True)
class Champion:
    """A family's champion: the critic its latest promotion (in any partition) promoted."""

    partition_key: str
    contract_sha256: str
    checkpoint: Path
    registry_record_sha256: str | None


@dataclass(frozen=True)
class PublishedPlan:
    """Where the lineage's batch plan was published and the sha its materialization recorded."""

    path: Path
    sha256: str


class Lineage:
    """One partition's recorded facts. Methods that the rules depend on raise `InputError` (a
    located, non-retried refusal) when the fact was never recorded."""

    def __init__(self, instance: DagsterInstance, partition_key: str):
        self.instance = instance
        self.partition_key = partition_key

    def _where(self) -> str:
        return f"partition {self.partition_key!r}"

    def metadata(self, asset: str) -> dict[str, Any] | None:
        """Metadata values of the newest materialization of `asset` (a `core.vocabulary` name) in
        this partition, or None."""
        result = self.instance.fetch_materializations(
            AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[self.partition_key]), limit=1
        )
        if not result.records or result.records[0].asset_materialization is None:
            return None
        return _values(result.records[0].asset_materialization.metadata)

    def _recorded_sha(self, asset: str, key: str, hint: str) -> str:
        sha = (self.metadata(asset) or {}).get(key)
        if not is_sha(sha):
            raise InputError(
                self._where(), f"{asset} has no materialization with a {key} in the Dagster instance: {hint}"
            )
        return sha

    def plan(self) -> PublishedPlan:
        """The published batch plan: what training must train on (docs/rules.md#plan-artifact)."""
        meta = self.metadata(v.BATCH_PLAN) or {}
        sha, path = meta.get(v.PLAN_SHA256), meta.get(v.PLAN_PATH)
        if not is_sha(sha) or not isinstance(path, str):
            raise InputError(
                self._where(), f"{v.BATCH_PLAN} has no materialization with its path and sha: materialize it first"
            )
        return PublishedPlan(Path(path), sha)

    def contract_sha(self) -> str:
        """The sha of the contract training published last (training_contract's data version)."""
        return self._recorded_sha(v.TRAINING_CONTRACT, v.CONTRACT_SHA256, "train first")

    def reports(self) -> Iterator[ReportRecord]:
        """Every ev_report materialization of this partition, newest first, as the rules read them."""
        records_filter = AssetRecordsFilter(asset_key=AssetKey(v.EV_REPORT), asset_partitions=[self.partition_key])
        cursor = None
        while True:
            result = self.instance.fetch_materializations(records_filter, limit=100, cursor=cursor)
            for record in result.records:
                meta = _values(record.asset_materialization.metadata if record.asset_materialization else None)
                yield ReportRecord(
                    contract_sha256=meta.get(v.CONTRACT_SHA256),
                    report_path=meta.get(v.REPORT_PATH),
                    report_sha256=meta.get(v.REPORT_SHA256),
                    evaluated=meta.get(v.REUSED) is not True,
                )
            if not result.has_more:
                return
            cursor = result.cursor

    def last_gate(self) -> GateRecord | None:
        """The latest completed ev_gate evaluation of this partition only (never another's), or None."""
        # No public instance method filters check executions by partition in 1.13; the event log
        # storage's does (the same query the UI's partitioned check history uses).
        from dagster._core.event_api import PartitionKeyFilter
        from dagster._core.storage.asset_check_execution_record import COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES

        key = AssetCheckKey(AssetKey(v.EV_REPORT), v.EV_GATE)
        history = self.instance.event_log_storage.get_asset_check_execution_history(
            key,
            limit=1,
            status=set(COMPLETED_ASSET_CHECK_EXECUTION_RECORD_STATUSES),
            partition_filter=PartitionKeyFilter(key=self.partition_key),
        )
        evaluation = history[0].evaluation if history else None
        if evaluation is None:
            return None
        return GateRecord(
            partition_key=evaluation.partition,
            passed=evaluation.passed,
            blocking=evaluation.blocking,
            report_sha256=_values(evaluation.metadata).get(v.REPORT_SHA256),
            run_id=history[0].run_id,
        )

    def promoted_record_sha(self) -> str:
        """The sha256 of the registry record the latest promoted_critic materialization wrote: the
        pin of `value-assets handoff --instance` (docs/rules.md#hand-off)."""
        meta = self.metadata(v.PROMOTED_CRITIC)
        if meta is None:
            raise InputError(
                self._where(),
                f"has no {v.PROMOTED_CRITIC} materialization in the Dagster instance: nothing was promoted",
            )
        sha = meta.get(v.REGISTRY_RECORD_SHA256)
        if not is_sha(sha):
            raise InputError(
                self._where(),
                f"its latest promotion recorded no {v.REGISTRY_RECORD_SHA256} (promoted before "
                f"records were pinned): materialize {v.PROMOTED_CRITIC} again",
            )
        return sha

    def champion(self, family: str | None) -> Champion | None:
        """The family's champion (docs/rules.md#champion): the critic, in another partition, that
        recorded this family and was promoted most recently *for the first time*; None when the
        family has none yet (or no family is named). A critic is its (partition, contract): promoting
        it again (a re-materialization, which is idempotent) does not make it newer, so re-promoting a
        lineage that a later challenger has beaten does not bring it back as the champion."""
        if family is None:
            return None
        records_filter = AssetRecordsFilter(asset_key=AssetKey(v.PROMOTED_CRITIC))
        newest: Champion | None = None
        seen: set[tuple[str, str]] = set()
        cursor = None
        while True:  # oldest first: a critic's first promotion decides its place
            result = self.instance.fetch_materializations(records_filter, limit=100, cursor=cursor, ascending=True)
            for record in result.records:
                materialization = record.asset_materialization
                if materialization is None or materialization.partition == self.partition_key:
                    continue
                meta = _values(materialization.metadata)
                if meta.get(v.FAMILY) != family or not is_sha(meta.get(v.CONTRACT_SHA256)):
                    continue
                critic = (str(materialization.partition), str(meta[v.CONTRACT_SHA256]))
                if critic in seen:
                    continue
                seen.add(critic)
                newest = Champion(
                    partition_key=critic[0],
                    contract_sha256=critic[1],
                    checkpoint=Path(str(meta.get("checkpoint"))),
                    registry_record_sha256=meta.get(v.REGISTRY_RECORD_SHA256),
                )
            if not result.has_more:
                return newest
            cursor = result.cursor

    def saves(self, critic_dir: Path) -> tuple[str, ...]:
        """The contract shas of the saves into `critic_dir` that this partition's runs logged as they
        wrote them (`core.contract.saved_line`): the only saves a Dagster-launched resume may start
        from (docs/rules.md#resume). A run that failed after a save still logged it."""
        from value_assets.core.contract import saved_contracts

        runs = self.instance.get_runs(filters=RunsFilter(tags={"dagster/partition": self.partition_key}))
        lines = (record.user_message for run in runs for record in self.instance.all_logs(run.run_id))
        return tuple(sorted(saved_contracts(lines, critic_dir)))
