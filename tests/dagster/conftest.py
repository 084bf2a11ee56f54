"""Fixtures for the Dagster tier: a tmp Dagster instance, manifests with real datasets on disk,
and resources wired to the Pipes stand-in (a real subprocess speaking real Pipes)."""

import json
import os
import sys
from pathlib import Path

import pytest

from value_assets.core.hashing import sha256_file

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "pipes_standin.py"

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")


def write_dataset(path: Path, rows: int, seed: int = 0) -> Path:
    """Miles-format JSONL rows: half labelled 1.0, half 0.0 (scalar label broadcast per token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(rows):
        label = float((i + seed) % 2)
        response_length = 2 + i % 3
        tokens = [1 + (i * 7 + j) % 50 for j in range(3 + response_length)]
        lines.append(
            json.dumps(
                {
                    "sample_id": f"s{seed}-{i}",
                    "tokens": tokens,
                    "response_length": response_length,
                    "returns": [label] * response_length,
                    "loss_mask": [1] * response_length,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


TINY_SPEC = {"schema": "value-assets.training.v1", "backbone": "tiny"}


def write_manifest(
    folder: Path,
    name: str,
    *,
    rows: int = 32,
    heldout_rows: int | None = 32,
    standin: dict | None = None,
    data_dir: Path | None = None,
    objective: dict | None = None,
    training: dict | None = TINY_SPEC,
) -> Path:
    """A manifest with datasets in `data_dir` (default: beside it, referenced by relative paths) and
    the training spec `training` (default: the tiny backbone; None: none)."""
    data_dir = data_dir or folder / "data" / name
    train = write_dataset(data_dir / "train.jsonl", rows, seed=0)
    manifest = {
        "schema": "miles.value-pretrain.v1",
        "train": {"path": os.path.relpath(train, folder), "sha256": sha256_file(train), "num_samples": rows},
        "objective": objective or {"loss_type": "classification", "num_bins": 11},
        "provenance": {"producer": "tests", "standin": standin or {}},
    }
    if training is not None:
        manifest["training"] = training
    if heldout_rows:
        held = write_dataset(data_dir / "heldout.jsonl", heldout_rows, seed=1)
        manifest["heldout"] = {
            "path": os.path.relpath(held, folder),
            "sha256": sha256_file(held),
            "num_samples": heldout_rows,
        }
    path = folder / f"{name}.json"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest, indent=1))
    return path


@pytest.fixture
def instance(tmp_path):
    """A real Dagster instance with in-memory run, event-log and schedule storage (what
    `materialize` uses by default): a fresh SQLite instance per test cost ~0.3 s to create and a
    file (with its schema) per run, ~40 CPU-s over the suite. Persistent storage is tested where it
    matters: `dagster dev` and its daemon on Postgres (test_dg_ui.py), step processes on a local
    SQLite instance (test_dg_executor.py)."""
    from dagster import DagsterInstance

    home = tmp_path / "dagster_home"
    home.mkdir()
    inst = DagsterInstance.ephemeral(tempdir=str(home))
    try:
        yield inst
    finally:
        inst.dispose()


@pytest.fixture
def manifests_dir(tmp_path) -> Path:
    path = tmp_path / "manifests"
    path.mkdir()
    return path


@pytest.fixture
def test_resources(tmp_path, manifests_dir):
    from value_assets.resources import ArtifactStore, ManifestInbox, SubprocessLauncher

    return {
        "artifacts": ArtifactStore(root=str(tmp_path / "artifacts")),
        "inbox": ManifestInbox(folder=str(manifests_dir)),
        "launcher": SubprocessLauncher(command=[sys.executable, str(STANDIN)]),
    }


@pytest.fixture
def test_defs(test_resources):
    from value_assets.definitions import make_definitions

    return make_definitions(test_resources)


@pytest.fixture(name="tick")
def tick_fixture():
    return tick


@pytest.fixture(name="write_manifest")
def write_manifest_fixture():
    return write_manifest


@pytest.fixture(name="register")
def register_fixture():
    return register


def tick(instance, resources, cursor=None):
    """One sensor evaluation, applying its partition requests to the instance like the daemon does."""
    from dagster import build_sensor_context

    from value_assets.sensors import manifest_sensor

    context = build_sensor_context(instance=instance, cursor=cursor, resources=resources)
    result = manifest_sensor(context)
    for request in getattr(result, "dynamic_partitions_requests", None) or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result


def register(instance, resources, *paths) -> list[str]:
    """Register manifests through the real sensor; return their partition keys in path order."""
    result = tick(instance, resources)
    keys = {r.tags["value_assets/manifest"]: r.partition_key for r in result.run_requests}
    return [keys[str(Path(p).resolve())] for p in paths]
