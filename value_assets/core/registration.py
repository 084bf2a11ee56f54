"""Registration of a manifest as a partition, and loading the manifest a partition registered.

Partition -> manifest mapping (decision). When the sensor first sees a manifest it writes, under
``<root>/<partition>/``, a byte-identical snapshot (``manifest.json``) and a registration record
naming the watched file and its full sha. Assets load the *watched file* with that sha pinned (so
relative dataset paths keep resolving against the manifest's own folder) and refuse if the file
changed: an edited manifest is a new partition, and the old partition can never silently pick up
new content. The snapshot keeps the exact bytes of every lineage for audit even after the watched
file is edited or deleted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from value_assets.core.errors import InputError
from value_assets.core.hashing import is_sha, sha256_bytes, sha256_file
from value_assets.core.publish import atomic_write, read_json_object
from value_assets.core.strict_json import canonical_bytes

if TYPE_CHECKING:
    from value_assets.core.manifest import Manifest
    from value_assets.core.training_spec import TrainingSpec

REGISTRATION_SCHEMA = "value-assets.registration.v1"


@dataclass(frozen=True, kw_only=True)
class Registration:
    partition_key: str
    source_path: Path
    manifest_sha256: str
    training_spec: Mapping[str, Any] | None = None
    """The lineage's training spec as registered (the manifest's own, else the deployment default
    then in force): docs/rules.md#training-spec. None in registrations older than specs."""
    training_spec_base: Path | None = None
    """The folder its relative backbone paths resolve against."""

    @property
    def training_spec_sha256(self) -> str | None:
        return None if self.training_spec is None else sha256_bytes(canonical_bytes(dict(self.training_spec)))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema": REGISTRATION_SCHEMA,
            "partition_key": self.partition_key,
            "source_path": str(self.source_path),
            "manifest_sha256": self.manifest_sha256,
        }
        if self.training_spec is not None:
            out["training_spec"] = dict(self.training_spec)
            out["training_spec_base"] = str(self.training_spec_base)
            out["training_spec_sha256"] = self.training_spec_sha256
        return out


def register_manifest(partition_dir: Path, registration: Registration, manifest_bytes: bytes) -> bool:
    """Write the snapshot and registration of a partition; True when newly written.

    Idempotent for the same registration; a different one under the same folder is an error
    (two files with the same stem and sha12 prefix but other bytes: astronomically unlikely).
    """
    if sha256_bytes(manifest_bytes) != registration.manifest_sha256:
        raise InputError(str(registration.source_path), "manifest bytes do not match the registered sha")
    record = canonical_bytes(registration.to_json())
    reg_path = partition_dir / "registration.json"
    snap_path = partition_dir / "manifest.json"
    if reg_path.exists():
        existing = read_json_object(reg_path, "registration")
        if existing.get("manifest_sha256") != registration.manifest_sha256:
            raise InputError(str(reg_path), f"partition already registered to sha {existing.get('manifest_sha256')!r}")
        return False
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
    spec, base = obj.get("training_spec"), obj.get("training_spec_base")
    if spec is not None and (not isinstance(spec, dict) or not isinstance(base, str)):
        raise InputError(str(path), "training_spec must be an object with its training_spec_base folder")
    reg = Registration(
        partition_key=partition_key, source_path=Path(obj["source_path"]), manifest_sha256=sha, training_spec=spec,
        training_spec_base=Path(base) if isinstance(base, str) else None,
    )  # fmt: skip
    if spec is not None and obj.get("training_spec_sha256") != reg.training_spec_sha256:
        raise InputError(str(path), f"training_spec hashes to {reg.training_spec_sha256}, the registration recorded "
                                    f"{obj.get('training_spec_sha256')!r}")  # fmt: skip
    return reg


def load_registered_spec(partition_dir: Path, partition_key: str) -> TrainingSpec:
    """The training spec the partition registered (docs/rules.md#training-spec)."""
    from value_assets.core.training_spec import parse_training_spec

    reg = read_registration(partition_dir, partition_key)
    where = f"{partition_dir / 'registration.json'}: training_spec"
    if reg.training_spec is None or reg.training_spec_base is None:
        raise InputError(
            where,
            f"partition {partition_key} was registered without a training spec (before specs existed): give its "
            "manifest a `training` object (a new partition) to train it",
        )
    return parse_training_spec(reg.training_spec, base=reg.training_spec_base, where=where)


def load_registered_manifest(partition_dir: Path, partition_key: str, data_roots: list[Path] | None = None) -> Manifest:
    """The partition's manifest, loaded from the watched file with the registered sha pinned."""
    from value_assets.core.manifest import load_manifest

    reg = read_registration(partition_dir, partition_key)
    if not reg.source_path.exists():
        raise InputError(
            str(reg.source_path),
            f"the manifest of partition {partition_key} was removed; "
            f"its registered bytes remain in {partition_dir / 'manifest.json'}",
        )
    current = sha256_file(reg.source_path)
    if current != reg.manifest_sha256:
        raise InputError(
            str(reg.source_path),
            f"changed since partition {partition_key} was registered "
            f"(sha {current} != {reg.manifest_sha256}); the new content is its own partition",
        )
    return load_manifest(reg.source_path, pinned_sha256=reg.manifest_sha256, data_roots=data_roots)
