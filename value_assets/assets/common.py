"""Small Dagster-side helpers shared by assets and checks: error mapping, config, instance lookups."""

from __future__ import annotations

import base64
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from dagster import AssetKey, AssetRecordsFilter, DagsterInstance, Failure, MetadataValue

from value_assets.core.errors import InputError
from value_assets.assets.lineage import PromotionRefused

INLINE_PLOT_MAX_BYTES = 512 * 1024


@contextmanager
def fail_on_bad_input(what: str) -> Iterator[None]:
    """Turn the domain's refusals into a step failure with the rule's own message, never retried."""
    try:
        yield
    except (InputError, PromotionRefused) as exc:
        raise Failure(description=f"{what}: {exc}", allow_retries=False) from None


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
    return {key: getattr(value, "value", value) for key, value in materialization.metadata.items()}


def plot_metadata(paths: list[str] | None, base: Path, strip_prefix: str = "") -> dict[str, Any]:
    """Report plots inline (markdown data-URI images) when small, else as file paths.

    Keys are ``plot_<name>`` where name is the file stem without `strip_prefix`.
    """
    out: dict[str, Any] = {}
    for raw in paths or []:
        path = Path(raw) if Path(raw).is_absolute() else base / raw
        label = path.stem.removeprefix(strip_prefix) or path.stem
        name = f"plot_{label}"
        if not path.is_file():
            out[name] = MetadataValue.text(f"missing: {path}")
        elif path.stat().st_size <= INLINE_PLOT_MAX_BYTES and path.suffix.lower() == ".png":
            data = base64.b64encode(path.read_bytes()).decode("ascii")
            out[name] = MetadataValue.md(f"![{label}](data:image/png;base64,{data})")
        else:
            out[name] = MetadataValue.path(str(path))
    return out


def to_metadata_value(value: Any) -> Any:
    """Plain JSON values as Dagster metadata: numbers and strings as is, the rest as JSON."""
    if value is None:
        return MetadataValue.text("null")
    if isinstance(value, (bool, int, float, str)):
        return value
    return MetadataValue.json(value)
