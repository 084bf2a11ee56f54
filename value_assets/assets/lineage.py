"""Plain functions behind the assets: registration, contract lookup, report reading, promotion.

No Dagster here, so each rule is testable (and reusable from the command line) on its own.

Partition -> manifest mapping (decision). When the sensor first sees a manifest it writes, under
``<root>/<partition>/``, a byte-identical snapshot (``manifest.json``) and a registration record
naming the watched file and its full sha. Assets load the *watched file* with that sha pinned (so
relative dataset paths keep resolving against the manifest's own folder) and refuse if the file
changed: an edited manifest is a new partition, and the old partition can never silently pick up
new content. The snapshot keeps the exact bytes of every lineage for audit even after the watched
file is edited or deleted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from value_assets.core.errors import InputError
from value_assets.core.hashing import is_sha, sha256_bytes, sha256_file

REGISTRATION_SCHEMA = "value-assets.registration.v1"
PROMOTION_SCHEMA = "value-assets.promotion.v1"


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, compact separators, UTF-8, trailing newline (SPEC 6's canonical form)."""
    from value_assets.core.strict_json import canonical_bytes

    return canonical_bytes(obj)


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise InputError(str(path), f"{what} does not exist") from None
    except (OSError, ValueError) as exc:
        raise InputError(str(path), f"{what} is unreadable: {exc}") from None
    if not isinstance(obj, dict):
        raise InputError(str(path), f"{what} is not a JSON object")
    return obj


# ---------------------------------------------------------------- registration


@dataclass(frozen=True, kw_only=True)
class Registration:
    partition_key: str
    source_path: Path
    manifest_sha256: str

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": REGISTRATION_SCHEMA,
            "partition_key": self.partition_key,
            "source_path": str(self.source_path),
            "manifest_sha256": self.manifest_sha256,
        }


def register_manifest(partition_dir: Path, registration: Registration, manifest_bytes: bytes) -> bool:
    """Write the snapshot and registration of a partition; True when newly written.

    Idempotent for the same registration; a different one under the same folder is an error
    (two files with the same stem and sha12 prefix but other bytes: astronomically unlikely).
    """
    if sha256_bytes(manifest_bytes) != registration.manifest_sha256:
        raise InputError(str(registration.source_path), "manifest bytes do not match the registered sha")
    record = canonical_json(registration.to_json())
    reg_path = partition_dir / "registration.json"
    snap_path = partition_dir / "manifest.json"
    if reg_path.exists():
        existing = read_json_object(reg_path, "registration")
        if existing.get("manifest_sha256") != registration.manifest_sha256:
            raise InputError(str(reg_path), f"partition already registered to sha {existing.get('manifest_sha256')!r}")
        return False
    from value_assets.core.publish import atomic_write

    partition_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(snap_path, manifest_bytes)
    atomic_write(reg_path, record)  # last: its presence means the snapshot is complete
    return True


def read_registration(partition_dir: Path, partition_key: str) -> Registration:
    path = partition_dir / "registration.json"
    obj = read_json_object(path, f"registration of partition {partition_key!r} (was it added by the sensor?)")
    sha = obj.get("manifest_sha256")
    if obj.get("schema") != REGISTRATION_SCHEMA or not is_sha(sha) or obj.get("partition_key") != partition_key:
        raise InputError(str(path), f"not a registration of partition {partition_key!r}: {obj!r}")
    return Registration(partition_key=partition_key, source_path=Path(obj["source_path"]), manifest_sha256=sha)


def load_registered_manifest(partition_dir: Path, partition_key: str, data_roots: list[Path] | None = None):
    """The partition's manifest, loaded from the watched file with the registered sha pinned."""
    from value_assets.core.manifest import load_manifest

    reg = read_registration(partition_dir, partition_key)
    if not reg.source_path.exists():
        raise InputError(str(reg.source_path), f"the manifest of partition {partition_key} was removed; "
                         f"its registered bytes remain in {partition_dir / 'manifest.json'}")
    current = sha256_file(reg.source_path)
    if current != reg.manifest_sha256:
        raise InputError(str(reg.source_path), f"changed since partition {partition_key} was registered "
                         f"(sha {current} != {reg.manifest_sha256}); the new content is its own partition")
    return load_manifest(reg.source_path, pinned_sha256=reg.manifest_sha256, data_roots=data_roots)


# ---------------------------------------------------------------- contracts


@dataclass(frozen=True, kw_only=True)
class ContractRef:
    path: Path
    sha256: str
    contract: dict[str, Any]

    @property
    def checkpoint_dir(self) -> Path:
        """The save folder the contract sits in (SPEC 6: one contract next to each save)."""
        return self.path.parent


def resolve_latest_contract(critic_dir: Path, pinned_sha256: str | None = None) -> ContractRef:
    """The contract ``<critic>/latest`` names, loaded with the pointer's sha pinned.

    `pinned_sha256`, when given (e.g. the sha a materialization recorded), must agree too: the
    newest save is promoted or evaluated only if it is the one the lineage recorded.
    """
    from value_assets.core.contract import CONTRACT_NAME, load_contract, read_latest

    latest = read_latest(critic_dir)
    if latest is None:
        raise InputError(str(Path(critic_dir) / "latest"), "no contracted save: the latest pointer does not exist")
    step_dir, pointer_sha = latest
    if pinned_sha256 is not None and pinned_sha256 != pointer_sha:
        raise InputError(str(Path(critic_dir) / "latest"),
                         f"names contract {pointer_sha}, but the lineage recorded {pinned_sha256}")
    contract, sha = load_contract(step_dir / CONTRACT_NAME, pinned_sha256=pointer_sha)
    return ContractRef(path=step_dir / CONTRACT_NAME, sha256=sha, contract=contract)


def contract_disagreements(contract: dict[str, Any], *, manifest, plan_sha256: str | None) -> list[str]:
    """Every way a contract disagrees with its partition's manifest, datasets, objective and plan."""
    problems = []
    if contract.get("source_manifest_sha256") != manifest.sha256:
        problems.append(f"source_manifest_sha256 {contract.get('source_manifest_sha256')!r} != manifest {manifest.sha256}")
    if contract.get("train_dataset_sha256") != manifest.train.sha256:
        problems.append(f"train_dataset_sha256 {contract.get('train_dataset_sha256')!r} != manifest train {manifest.train.sha256}")
    if contract.get("objective") != manifest.objective.canonical():
        problems.append(f"objective {contract.get('objective')!r} != manifest {manifest.objective.canonical()}")
    if plan_sha256 is not None and contract.get("batch_plan_sha256") != plan_sha256:
        problems.append(f"batch_plan_sha256 {contract.get('batch_plan_sha256')!r} != published plan {plan_sha256}")
    return problems


# ---------------------------------------------------------------- reports


def read_published(path: Path, what: str) -> tuple[dict[str, Any], str]:
    """A write-once JSON publication and its sha, verified against the ``.sha256`` beside it."""
    from value_assets.core.publish import verify_published

    path = Path(path)
    if path.is_symlink():
        raise InputError(str(path), f"{what} is a symlink; published files are never followed")
    if not path.exists():
        raise InputError(str(path), f"{what} does not exist")
    sha = verify_published(path)
    return read_json_object(path, what), sha


def report_manifest_sha(report: dict[str, Any]) -> Any:
    return report.get("source_manifest_sha256", report.get("manifest_sha256"))


def ev_summary(report: dict[str, Any]) -> dict[str, Any]:
    """The gate-relevant numbers of an EV report (core/report.py layout), flat for metadata."""
    aggregates = report.get("aggregates") or {}
    out: dict[str, Any] = {"passed": report.get("passed") is True, "split": report.get("split")}
    for weighting in ("token", "trajectory"):
        agg = aggregates.get(weighting) or {}
        for field in ("ev", "positive_batches", "batches", "r2", "bias"):
            out[f"{weighting}_{field}"] = agg.get(field)
    out["auroc"] = aggregates.get("auroc")
    return out


# ---------------------------------------------------------------- promotion


class PromotionRefused(Exception):
    """Promotion re-verification failed; the message says which rule and the values."""


def verify_promotion(
    *,
    partition_key: str,
    manifest_sha256: str,
    contract: ContractRef,
    report_path: Path,
    recorded_report_sha256: str | None,
) -> dict[str, Any]:
    """Re-verify at promotion time (SPEC 8) and return the registry record; refuse otherwise.

    The report must exist, hash to its recorded sha (the ``.sha256`` beside it and, when given,
    the sha recorded in the ev_report materialization), have passed on the heldout split, and
    name the contract being promoted and this partition's manifest.
    """
    try:
        report, report_sha = read_published(report_path, "EV report")
    except InputError as exc:
        raise PromotionRefused(str(exc)) from None
    if recorded_report_sha256 is not None and report_sha != recorded_report_sha256:
        raise PromotionRefused(f"{report_path}: hashes to {report_sha}, but ev_report recorded {recorded_report_sha256}")
    if report.get("passed") is not True:
        raise PromotionRefused(f"{report_path}: the EV gate did not pass (passed={report.get('passed')!r})")
    if report.get("contract_sha256") != contract.sha256:
        raise PromotionRefused(
            f"{report_path}: names contract {report.get('contract_sha256')!r}, not the one being promoted {contract.sha256}")
    if report_manifest_sha(report) != manifest_sha256:
        raise PromotionRefused(f"{report_path}: names manifest {report_manifest_sha(report)!r}, not {manifest_sha256}")
    if report.get("split") != "heldout":
        raise PromotionRefused(f"{report_path}: evaluated on split {report.get('split')!r}; only heldout gates")
    if contract.contract.get("source_manifest_sha256") != manifest_sha256:
        raise PromotionRefused(f"{contract.path}: contract is for manifest {contract.contract.get('source_manifest_sha256')!r}")
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
        "promoted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
