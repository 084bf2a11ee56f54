"""Trust in a published EV report: when it is reused, and when its critic is promoted (docs/rules.md#promotion).

Plain rules over what the lineage recorded (passed in by the Dagster layer, which reads them from
its instance) and the files on disk. A file that merely agrees with its own `.sha256` sidecar proves
nothing: only a sha the lineage recorded when an evaluation of this lineage published the report
is trusted, and promotion also needs the partition's own blocking `ev_gate` to have passed on that
very sha.

Forged report at the report path (decision). Reports are write-once and named by the contract's
sha12, so a file the lineage did not record that occupies the path blocks re-evaluation. It is
neither reused nor overwritten: `decide_reuse` refuses with a message naming the file and telling
the operator to remove it (and its sidecar) and re-run. Publishing under a content-addressed name
instead would keep the pipeline moving but leave the forged file beside the real one, and change
the layout that other readers rely on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from value_assets.core.contract_lookup import ContractRef
from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_bytes
from value_assets.core.publish import publication_state, read_published, sha_sidecar
from value_assets.core.report import decide_gate, report_manifest_sha

PROMOTION_SCHEMA = "value-assets.promotion.v1"

VerifyCheckpoint = Callable[[Path, dict[str, Any]], Any]
"""`verify_checkpoint(step_dir, contract)`: raises InputError unless every file of the save matches
the contract (docs/rules.md#contract). Provided by the checkpoint-binding work; promotion calls it when given."""


class PromotionRefused(Exception):
    """Promotion re-verification failed; the message says which rule and the values."""


@dataclass(frozen=True, kw_only=True)
class ReportRecord:
    """One `ev_report` materialization of a partition, as the instance stored it."""

    contract_sha256: Any
    report_path: Any
    report_sha256: Any
    evaluated: bool  # its run evaluated and published the report; False when it reused one


@dataclass(frozen=True, kw_only=True)
class GateRecord:
    """The latest completed `ev_gate` evaluation of a partition, as the instance stored it."""

    partition_key: str | None
    passed: bool
    blocking: bool | None
    report_sha256: Any
    run_id: str | None = None


def lineage_report_sha(records: Iterable[ReportRecord], *, contract_sha256: str, report_path: Path) -> str | None:
    """The report sha the lineage recorded when it published this contract's report at this path.

    `records` newest first. Only a record whose run evaluated counts: a reuse repeats a sha and
    cannot originate one (older code recorded whatever file it found).
    """
    for record in records:
        if (
            record.evaluated
            and record.contract_sha256 == contract_sha256
            and str(record.report_path) == str(report_path)
            and isinstance(record.report_sha256, str)
        ):
            return record.report_sha256
    return None


def decide_reuse(report_path: Path, recorded_sha256: str | None) -> bool:
    """True: reuse the published report; False: evaluate (nothing there, or an unfinished
    publication that an identical result completes). Refuses (InputError) a report at the path
    whose sha the lineage did not record, naming the file and what to do."""
    state = publication_state(report_path)
    if state in ("absent", "unfinished"):
        return False
    if state == "published":
        sha = sha256_bytes(Path(report_path).read_bytes())
        if recorded_sha256 is not None and sha == recorded_sha256:
            return True
        what = f"holds a report (sha256 {sha}) that this lineage did not record (recorded: {recorded_sha256 or 'none'})"
    else:
        what = "holds a file this lineage cannot trust (a symlink, or a file that disagrees with its sidecar)"
    raise InputError(
        str(report_path),
        f"{what}; a file that agrees with its own sidecar proves nothing, and reports "
        f"are write-once, so it is neither reused nor replaced. Remove it and "
        f"{sha_sidecar(Path(report_path)).name}, then re-run to evaluate again",
    )


def verify_promotion(
    *,
    partition_key: str,
    manifest_sha256: str,
    contract: ContractRef,
    report_path: Path,
    recorded_report_sha256: str | None,
    gate: GateRecord | None,
    verify_checkpoint: VerifyCheckpoint | None = None,
) -> dict[str, Any]:
    """Re-verify at promotion time (docs/rules.md#promotion) and return the registry record; refuse otherwise.

    `recorded_report_sha256` is the sha `ev_report` recorded for this contract's report, `gate` the
    latest `ev_gate` evaluation of this partition. The gate must be this partition's, blocking,
    passed, on that very sha; the report must hash to it (and to its sidecar), pass `decide_gate`,
    and name the contract being promoted and this partition's manifest; and, when
    `verify_checkpoint` is given, the save's files must match the contract.
    """
    if recorded_report_sha256 is None:
        raise PromotionRefused(f"{report_path}: ev_report recorded no evaluated report for contract {contract.sha256}")
    if gate is None:
        raise PromotionRefused(f"partition {partition_key}: ev_gate has no evaluation; run it on the report first")
    if gate.partition_key != partition_key:
        raise PromotionRefused(
            f"partition {partition_key}: the ev_gate evaluation given is partition "
            f"{gate.partition_key!r}'s; another manifest's result never stands for this one"
        )
    if gate.blocking is not True:
        raise PromotionRefused(
            f"partition {partition_key}: the ev_gate evaluation was not blocking (blocking={gate.blocking!r})"
        )
    if not gate.passed:
        raise PromotionRefused(f"partition {partition_key}: the latest ev_gate evaluation failed (run {gate.run_id})")
    if gate.report_sha256 != recorded_report_sha256:
        raise PromotionRefused(
            f"partition {partition_key}: ev_gate passed on report {gate.report_sha256!r}, but "
            f"ev_report recorded {recorded_report_sha256}"
        )
    try:
        report, report_sha = read_published(report_path, "EV report", expected_sha=recorded_report_sha256)
    except InputError as exc:
        raise PromotionRefused(f"{exc} (ev_report recorded and ev_gate passed {recorded_report_sha256})") from None
    decision = decide_gate(report)
    if not decision.passed:
        raise PromotionRefused(f"{report_path}: the EV gate did not pass: {'; '.join(decision.failures)}")
    if report.get("contract_sha256") != contract.sha256:
        raise PromotionRefused(
            f"{report_path}: names contract {report.get('contract_sha256')!r}, not the one being promoted "
            f"{contract.sha256}"
        )
    if report_manifest_sha(report) != manifest_sha256:
        raise PromotionRefused(f"{report_path}: names manifest {report_manifest_sha(report)!r}, not {manifest_sha256}")
    if contract.contract.get("source_manifest_sha256") != manifest_sha256:
        raise PromotionRefused(
            f"{contract.path}: contract is for manifest {contract.contract.get('source_manifest_sha256')!r}"
        )
    if verify_checkpoint is not None:
        try:
            verify_checkpoint(contract.checkpoint_dir, contract.contract)
        except InputError as exc:
            raise PromotionRefused(f"checkpoint does not match its contract: {exc}") from None
    return {
        "schema": PROMOTION_SCHEMA,
        "partition_key": partition_key,
        "checkpoint": str(contract.checkpoint_dir),
        "contract_path": str(contract.path),
        "contract_sha256": contract.sha256,
        "report_path": str(report_path),
        "report_sha256": report_sha,
        "manifest_sha256": manifest_sha256,
        "completed_steps": contract.contract.get("completed_steps"),
    }
