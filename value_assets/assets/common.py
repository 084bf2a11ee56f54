"""Small Dagster-side helpers shared by assets and checks: error mapping, the partition's manifest,
run config, metadata values. What the instance recorded is read through `value_assets.lineage`."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dagster import Config, Failure, MetadataValue
from pydantic import Field

from value_assets.core.errors import InputError
from value_assets.core.job_configs import field_default, field_doc
from value_assets.core.promotion import PromotionRefused
from value_assets.core.publish import PublishError

INLINE_PLOT_MAX_BYTES = 512 * 1024
# One owner for every asset (the UI's owner filter and catalog); a team, not a person.
OWNERS = ["team:rl-infra"]


# Marks a step failure that is a refusal (bad input, or a write the system refused), not a bug:
# `value-assets run-manifests` exits 2 on it (run_inbox.py).
REFUSAL_METADATA_KEY = "value_assets/refusal"


@contextmanager
def fail_on_bad_input(what: str) -> Iterator[None]:
    """Turn the domain's refusals into a step failure with the rule's own message, never retried:
    bad input, a refused promotion, and a write the system refused (full disk, permissions)."""
    try:
        yield
    except (InputError, PromotionRefused, PublishError) as exc:
        raise Failure(
            description=f"{what}: {exc}", allow_retries=False, metadata={REFUSAL_METADATA_KEY: True}
        ) from None


def partition_manifest(context, artifacts, inbox):
    """The manifest the context's partition registered, loaded with its sha pinned."""
    from value_assets.core.registration import load_registered_manifest

    key = context.partition_key
    return load_registered_manifest(artifacts.partition_dir(key), key, inbox.roots())


def partition_spec(context, artifacts):
    """The training spec the context's partition registered (docs/rules.md#training-spec)."""
    from value_assets.core.registration import load_registered_spec

    key = context.partition_key
    return load_registered_spec(artifacts.partition_dir(key), key)


def spec_settings(spec_settings: dict[str, Any], config: Config, job_config: type) -> dict[str, Any]:
    """The lineage spec's settings for one job. A run config may restate them, never change them:
    the lineage trains and is gated as its spec says, fixed before any result exists
    (docs/rules.md#training-spec). A set run-config field that differs is refused by name."""
    for name, value in given(config).items():
        expected = spec_settings[name] if name in spec_settings else _default(job_config, name)
        if value != expected:
            raise InputError(
                f"run config {name}",
                f"{value!r} differs from the lineage's training spec ({expected!r}): a lineage trains and is gated as "
                "its spec says; register a manifest with another spec for other settings",
            )
    return dict(spec_settings)


def _default(job_config: type, name: str) -> Any:
    try:
        return field_default(job_config, name)
    except KeyError:
        return None


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
