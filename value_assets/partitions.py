"""The one partitioning of the asset graph: one dynamic partition per registered manifest.

A partition key is ``<manifest stem>-<sha12>``: readable in the UI, and unique per manifest
*content* (the first 12 hex digits of the manifest's sha). Editing a watched manifest therefore
gives a new partition; the old partition and everything materialized under it stay as they were.
"""

from __future__ import annotations

import re
from pathlib import Path

from dagster import DynamicPartitionsDefinition

from value_assets.core.hashing import is_sha

manifests_partitions = DynamicPartitionsDefinition(name="manifests")

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_KEY = re.compile(r"(?P<stem>[A-Za-z0-9_.-]+)-(?P<sha12>[0-9a-f]{12})")
STEM_MAX = 64


def partition_key_for(manifest_path: str | Path, manifest_sha256: str) -> str:
    """The partition key of a manifest file with the given content digest.

    The stem is reduced to ``[A-Za-z0-9_.-]`` (runs of anything else become ``_``) and cut to 64
    characters, so that keys are safe as folder names and in URLs.
    """
    if not is_sha(manifest_sha256):
        raise ValueError(f"not a sha256: {manifest_sha256!r}")
    stem = _UNSAFE.sub("_", Path(manifest_path).stem).strip("._-")[:STEM_MAX] or "manifest"
    return f"{stem}-{manifest_sha256[:12]}"


def sha12_of(partition_key: str) -> str:
    """The 12-hex manifest digest prefix a partition key ends with."""
    match = _KEY.fullmatch(partition_key)
    if match is None:
        raise ValueError(f"not a manifest partition key (<stem>-<sha12>): {partition_key!r}")
    return match["sha12"]
