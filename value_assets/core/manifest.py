"""The manifest (docs/rules.md#manifest): pins train/held-out datasets by sha and names the value objective.

Compatible with Miles `miles.value-pretrain.v1` manifests. Loading reads only the manifest file;
datasets are opened by `value_assets.core.dataset`.

A manifest path is resolved once (symlinks included): its bytes are read from the resolved file,
and relative dataset paths resolve against that file's folder, so a symlinked manifest means what
its target means. Unknown `objective` keys are ignored, as Miles' loader ignores them, and listed in
`Manifest.ignored_objective_keys`; what Miles would silently misread (duplicate keys, NaN) is refused.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from value_assets.core.errors import InputError, show
from value_assets.core.hashing import is_sha, require_sha, sha256_bytes
from value_assets.core.objective import Objective
from value_assets.core.strict_json import is_int, loads

SCHEMA = "miles.value-pretrain.v1"
SPLITS = ("train", "heldout")
MAX_NUM_SAMPLES = 2**63 - 1  # row indices are int64 everywhere downstream


@dataclass(frozen=True, kw_only=True)
class DatasetRef:
    """One split as the manifest pins it. `path` is resolved against the manifest's folder."""

    split: str
    path: Path
    declared_path: str
    sha256: str
    num_samples: int


@dataclass(frozen=True, kw_only=True)
class Manifest:
    path: Path
    sha256: str
    train: DatasetRef
    heldout: DatasetRef | None
    objective: Objective
    provenance: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    ignored_objective_keys: tuple[str, ...] = ()  # unknown objective keys, ignored as Miles ignores them

    @property
    def stem(self) -> str:
        return self.path.stem

    @property
    def partition_key(self) -> str:
        """`<stem>-<sha12>`: one manifest = one lineage."""
        return f"{self.stem}-{self.sha256[:12]}"

    def splits(self) -> list[DatasetRef]:
        return [r for r in (self.train, self.heldout) if r is not None]


def _inside(path: Path, root: Path) -> bool:
    # Component-wise comparison after resolution: "/data2" is not inside "/data".
    return path.parts[: len(root.parts)] == root.parts


def _realpath(path: str | Path, where: str) -> Path:
    try:
        return Path(os.path.realpath(path))
    except ValueError as exc:  # "embedded null byte": no file system path holds one
        raise InputError(where, f"path {show(str(path))} is not a valid file system path: {exc}") from None


def check_data_roots(path: Path, data_roots: Iterable[str | Path] | None, where: str) -> None:
    """Refuse `path` unless it lies inside one of `data_roots` (when any are configured)."""
    if data_roots is None:
        return
    roots = [_realpath(r, "data roots") for r in data_roots]
    real = _realpath(path, where)
    if not any(_inside(real, r) for r in roots):
        raise InputError(
            where,
            f"dataset path {show(str(path), 300)} resolves to {show(str(real), 300)}, outside the configured data "
            f"roots {show([str(r) for r in roots], 300)}",
        )


def _dataset_ref(split: str, obj: Any, base: Path, where: str, data_roots: Iterable[str | Path] | None) -> DatasetRef:
    loc = f"{where}: {split}"
    if not isinstance(obj, Mapping):
        raise InputError(loc, f"must be an object with path, sha256, num_samples; got {show(obj)}")
    for key in ("path", "sha256", "num_samples"):
        if key not in obj:
            raise InputError(loc, f"missing field {key!r}")
    declared = obj["path"]
    if not isinstance(declared, str) or not declared:
        raise InputError(f"{loc}.path", f"must be a non-empty string, got {show(declared)}")
    if "\x00" in declared:
        raise InputError(
            f"{loc}.path", f"must not contain a NUL character (no file system path does), got {show(declared)}"
        )
    sha = obj["sha256"]
    if not is_sha(sha):
        raise InputError(f"{loc}.sha256", f"expected a lowercase 64-hex SHA-256, got {show(sha)}")
    n = obj["num_samples"]
    if not is_int(n) or not 1 <= n <= MAX_NUM_SAMPLES:
        raise InputError(f"{loc}.num_samples", f"must be an integer from 1 to {MAX_NUM_SAMPLES} (int64), got {show(n)}")
    p = Path(declared)
    resolved = p if p.is_absolute() else base / p
    check_data_roots(resolved, data_roots, f"{loc}.path")
    return DatasetRef(
        split=split, path=Path(os.path.abspath(resolved)), declared_path=declared, sha256=sha, num_samples=n
    )


def parse_manifest(data: bytes, path: Path, *, data_roots: Iterable[str | Path] | None = None) -> Manifest:
    where = str(path)
    obj = loads(data, where)
    if not isinstance(obj, dict):
        raise InputError(where, f"manifest must be a JSON object, got {show(obj)}")
    if obj.get("schema") != SCHEMA:
        raise InputError(f"{where}: schema", f"must be {SCHEMA!r}, got {show(obj.get('schema'))}")
    if "train" not in obj or obj["train"] is None:
        raise InputError(f"{where}: train", "is required")
    if "objective" not in obj:
        raise InputError(f"{where}: objective", "is required")
    base = path.parent
    train = _dataset_ref("train", obj["train"], base, where, data_roots)
    heldout = None
    if obj.get("heldout") is not None:
        heldout = _dataset_ref("heldout", obj["heldout"], base, where, data_roots)
    objective = Objective.from_json(obj["objective"], where=f"{where}: objective", ignore_unknown=True)
    prov = obj.get("provenance")
    if prov is not None and not isinstance(prov, dict):
        raise InputError(f"{where}: provenance", f"must be an object when present, got {show(prov)}")
    return Manifest(
        path=path,
        sha256=sha256_bytes(data),
        train=train,
        heldout=heldout,
        objective=objective,
        provenance=prov,
        raw=obj,
        ignored_objective_keys=Objective.unknown_keys(obj["objective"]),
    )


def load_manifest(
    path: str | Path, *, pinned_sha256: str | None = None, data_roots: Iterable[str | Path] | None = None
) -> Manifest:
    """Load and check a manifest. A pinned digest is checked against the raw bytes before parsing."""
    if pinned_sha256 is not None:
        require_sha(pinned_sha256, "pinned manifest sha256")
    p = _realpath(path, "manifest")  # once: the bytes and the base of relative paths come from one file
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise InputError(str(p), "manifest file does not exist") from None
    except IsADirectoryError:
        raise InputError(str(p), "manifest path is a directory, expected a JSON file") from None
    except OSError as exc:
        raise InputError(str(p), f"cannot read the manifest: {exc.strerror or exc}") from None
    if pinned_sha256 is not None:
        actual = sha256_bytes(data)
        if actual != pinned_sha256:
            raise InputError(str(p), f"manifest sha256 is {actual}, but {pinned_sha256} was pinned")
    return parse_manifest(data, p, data_roots=data_roots)
