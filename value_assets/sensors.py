"""The manifest sensor: a folder of manifests becomes partitions and runs.

Per tick, every ``*.json`` file directly in the watched folder is hashed. A file whose
(path, sha) the cursor has not seen is loaded (manifest only, docs/rules.md#manifest: no dataset is read):
- valid: it is registered (snapshot + registration under the artifacts root), its partition
  ``<stem>-<sha12>`` is added, and a run of the full job is requested with run_key = partition
  key (so a lost cursor never starts a second run for the same content);
- invalid: nothing is started; the reason goes to the sensor log and the skip reason.
Each file is judged alone: whatever one file holds (a 5000-digit number, 100k-deep nesting, a NUL
in a path, or a failure nobody foresaw), it is skipped with its reason and the tick still
registers the valid manifests beside it. A symlinked manifest is resolved once: its bytes and the
base of its relative dataset paths come from the target, as when the assets load it later.
An edited file has a new sha, hence a new partition; the old partition and its lineage stay.
The cursor is JSON ``{"version": 1, "files": {path: sha}}`` and survives restarts.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dagster import (
    AddDynamicPartitionsRequest,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_bytes
from value_assets.core.registration import Registration, register_manifest
from value_assets.core.training_spec import DEFAULT_TRAINING_ENV, TrainingSpec
from value_assets.jobs import full_job
from value_assets.partitions import manifests_partitions, partition_key_for
from value_assets.resources import ArtifactStore, ManifestInbox

CURSOR_VERSION = 1


def parse_cursor(cursor: str | None) -> dict[str, str]:
    if not cursor:
        return {}
    try:
        obj = json.loads(cursor)
    except ValueError:
        return {}
    files = obj.get("files") if isinstance(obj, dict) and obj.get("version") == CURSOR_VERSION else None
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def dump_cursor(files: dict[str, str]) -> str:
    return json.dumps({"version": CURSOR_VERSION, "files": dict(sorted(files.items()))}, sort_keys=True)


@dataclass(frozen=True)
class Found:
    """A new valid manifest and the training spec it registers with."""

    path: Path
    real: Path
    sha256: str
    data: bytes
    spec: TrainingSpec

    @property
    def spec_base(self) -> Path:
        """The folder the spec's relative backbone paths resolve against (the manifest's, or the
        default spec file's)."""
        return self.spec.base


@dataclass
class Scan:
    """What one pass over the folder found."""

    new: list[Found] = field(default_factory=list)  # valid manifests with their training specs
    invalid: list[tuple[Path, str, str]] = field(default_factory=list)  # (path, sha, reason)
    seen: dict[str, str] = field(default_factory=dict)  # next cursor


MAX_REASON_CHARS = 1000  # a reason quoting a huge value must not flood the log or the skip message


def _judge(data: bytes, real: Path, data_roots: list[Path] | None, default_spec: Path | None) -> TrainingSpec | str:
    """The training spec of `data` (read from `real`) if it is a valid manifest with a valid spec of
    its own or a valid deployment default (docs/rules.md#training-spec), else why not."""
    from value_assets.core.manifest import parse_manifest
    from value_assets.core.training_spec import SECTION, load_spec_file, spec_of_manifest

    try:
        manifest = parse_manifest(data, real, data_roots=data_roots)
        spec = spec_of_manifest(manifest.raw, real)
        if spec is None and default_spec is not None:
            spec = load_spec_file(default_spec)
        if spec is None:
            raise InputError(
                f"{real}: {SECTION}",
                "the manifest names no training spec and the deployment sets no default "
                f"({DEFAULT_TRAINING_ENV}): say which actor its critic starts from, how it trains and how it is "
                "gated (docs/rules.md#training-spec)",
            )
        return spec
    except InputError as exc:
        reason = str(exc)
    except Exception as exc:  # noqa: BLE001 - one file's unforeseen failure must not stop the others
        reason = f"could not be loaded ({type(exc).__name__}: {exc})"
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


def scan_folder(
    folder: Path, seen: dict[str, str], data_roots: list[Path] | None, default_spec: Path | None = None
) -> Scan:
    scan = Scan(seen=dict(seen))
    for path in sorted(p for p in folder.glob("*.json") if p.is_file()):
        real = Path(os.path.realpath(path))  # once: read the bytes and resolve relative paths from one file
        try:
            data = real.read_bytes()
        except OSError:
            continue  # vanished or unreadable this tick: look again next tick
        sha = sha256_bytes(data)
        if seen.get(str(path)) == sha:
            continue
        scan.seen[str(path)] = sha
        judged = _judge(data, real, data_roots, default_spec)
        if isinstance(judged, str):
            scan.invalid.append((path, sha, judged))
            continue
        scan.new.append(Found(path=path, real=real, sha256=sha, data=data, spec=judged))
    for gone in set(seen) - {str(p) for p in folder.glob("*.json")}:
        scan.seen.pop(gone, None)  # a deleted file that comes back is looked at again
    return scan


@sensor(
    job=full_job,
    minimum_interval_seconds=15,
    default_status=DefaultSensorStatus.RUNNING,
    description="Registers new or changed manifests as partitions and starts the full job for each.",
)
def manifest_sensor(context: SensorEvaluationContext, artifacts: ArtifactStore, inbox: ManifestInbox):
    folder = inbox.folder_path
    if not folder.is_dir():
        return SkipReason(f"manifest folder {folder} does not exist")
    scan = scan_folder(folder, parse_cursor(context.cursor), inbox.roots(), inbox.default_spec_path)
    for path, sha, reason in scan.invalid:
        context.log.warning(f"invalid manifest {path} (sha {sha[:12]}), nothing started: {reason}")
    keys, runs, already = [], [], []
    for found in scan.new:
        key = partition_key_for(found.path, found.sha256)
        registration = Registration(
            partition_key=key, source_path=found.real, manifest_sha256=found.sha256,
            training_spec=found.spec.raw, training_spec_base=found.spec_base,
        )  # fmt: skip
        try:
            register_manifest(artifacts.partition_dir(key), registration, found.data)
        except Exception as exc:  # noqa: BLE001 - retried next tick; the other manifests still register
            context.log.error(f"could not register {found.path} as {key}: {type(exc).__name__}: {exc}")
            scan.seen.pop(str(found.path), None)  # retried next tick
            continue
        keys.append(key)
        earlier = _runs_of(_instance_of(context), key)
        if earlier:
            # Materialized (or attempted) through another run already: the demo, the UI, GraphQL.
            # The lineage is the same bytes; starting it again would only repeat it.
            context.log.info(
                f"manifest {found.path} is partition {key}, which run {earlier[0]} already ran: not started again"
            )
            already.append(key)
            continue
        context.log.info(
            f"manifest {found.path} registered as partition {key} (training spec {found.spec.sha256[:12]})"
        )
        tags = {"value_assets/manifest": str(found.path), "value_assets/training_spec": found.spec.sha256[:12]}
        if found.spec.family:
            tags["value_assets/family"] = found.spec.family
        runs.append(RunRequest(run_key=key, partition_key=key, run_config=found.spec.run_config(), tags=tags))
    cursor = dump_cursor(scan.seen)
    if not runs:
        reasons = [f"{p.name}: {r}" for p, _, r in scan.invalid] + [f"{k}: already run" for k in already]
        return SensorResult(
            cursor=cursor,
            skip_reason=SkipReason(
                "invalid manifest(s), nothing started: " + " | ".join(reasons) if reasons else "no new manifests"
            ),
        )
    return SensorResult(
        run_requests=runs,
        dynamic_partitions_requests=[AddDynamicPartitionsRequest(manifests_partitions.name, keys)],
        cursor=cursor,
    )


def _instance_of(context: SensorEvaluationContext) -> Any:
    """The sensor's Dagster instance; None where a test ticks it without one."""
    try:
        return context.instance
    except Exception:  # noqa: BLE001 - build_sensor_context() without an instance raises on access
        return None


def _runs_of(instance: Any, partition_key: str) -> list[str]:
    """Ids of runs of this partition the instance holds (newest first), whatever launched them."""
    if instance is None:
        return []
    runs = instance.get_runs(filters=RunsFilter(tags={"dagster/partition": partition_key}), limit=1)
    return [run.run_id for run in runs]


ALL_SENSORS = [manifest_sensor]
