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

from dagster import (
    AddDynamicPartitionsRequest,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)

from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_bytes
from value_assets.core.registration import Registration, register_manifest
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


@dataclass
class Scan:
    """What one pass over the folder found."""

    new: list[tuple[Path, Path, str, bytes]] = field(
        default_factory=list
    )  # (path, resolved path, sha, bytes) of valid manifests
    invalid: list[tuple[Path, str, str]] = field(default_factory=list)  # (path, sha, reason)
    seen: dict[str, str] = field(default_factory=dict)  # next cursor


MAX_REASON_CHARS = 1000  # a reason quoting a huge value must not flood the log or the skip message


def _judge(data: bytes, real: Path, data_roots: list[Path] | None) -> str | None:
    """None if `data` (read from `real`) is a valid manifest, else why not."""
    from value_assets.core.manifest import parse_manifest

    try:
        parse_manifest(data, real, data_roots=data_roots)
    except InputError as exc:
        reason = str(exc)
    except Exception as exc:  # noqa: BLE001 - one file's unforeseen failure must not stop the others
        reason = f"could not be loaded ({type(exc).__name__}: {exc})"
    else:
        return None
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


def scan_folder(folder: Path, seen: dict[str, str], data_roots: list[Path] | None) -> Scan:
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
        reason = _judge(data, real, data_roots)
        if reason is not None:
            scan.invalid.append((path, sha, reason))
            continue
        scan.new.append((path, real, sha, data))
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
    scan = scan_folder(folder, parse_cursor(context.cursor), inbox.roots())
    for path, sha, reason in scan.invalid:
        context.log.warning(f"invalid manifest {path} (sha {sha[:12]}), nothing started: {reason}")
    keys, runs = [], []
    for path, real, sha, data in scan.new:
        key = partition_key_for(path, sha)
        try:
            register_manifest(
                artifacts.partition_dir(key),
                Registration(partition_key=key, source_path=real, manifest_sha256=sha),
                data,
            )
        except Exception as exc:  # noqa: BLE001 - retried next tick; the other manifests still register
            context.log.error(f"could not register {path} as {key}: {type(exc).__name__}: {exc}")
            scan.seen.pop(str(path), None)  # retried next tick
            continue
        context.log.info(f"manifest {path} registered as partition {key}")
        keys.append(key)
        runs.append(RunRequest(run_key=key, partition_key=key, tags={"value_assets/manifest": str(path)}))
    cursor = dump_cursor(scan.seen)
    if not runs:
        reasons = [f"{p.name}: {r}" for p, _, r in scan.invalid]
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


ALL_SENSORS = [manifest_sensor]
