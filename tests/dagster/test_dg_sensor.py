"""The manifest sensor, ticked for real against a tmp instance and folder."""

import json

import pytest
from dagster import SensorResult

from value_assets.core.hashing import sha256_file
from value_assets.partitions import partition_key_for, sha12_of
from value_assets.sensors import parse_cursor

pytestmark = pytest.mark.integration


def test_new_manifest_adds_partition_registers_and_requests_full_run(
    tick, write_manifest, instance, test_resources, manifests_dir, tmp_path
):
    path = write_manifest(manifests_dir, "alpha")
    result = tick(instance, test_resources)
    assert isinstance(result, SensorResult)
    (request,) = result.run_requests
    key = partition_key_for(path, sha256_file(path))
    assert request.partition_key == key and request.run_key == key
    assert key.startswith("alpha-") and sha12_of(key) == sha256_file(path)[:12]
    assert instance.get_dynamic_partitions("manifests") == [key]
    part = tmp_path / "artifacts" / key
    assert (part / "manifest.json").read_bytes() == path.read_bytes()
    registration = json.loads((part / "registration.json").read_text())
    assert registration["manifest_sha256"] == sha256_file(path)
    assert parse_cursor(result.cursor) == {str(path.resolve()): sha256_file(path)}


def test_unchanged_folder_starts_nothing(tick, write_manifest, instance, test_resources, manifests_dir):
    write_manifest(manifests_dir, "alpha")
    first = tick(instance, test_resources)
    second = tick(instance, test_resources, cursor=first.cursor)
    assert not second.run_requests and "no new manifests" in second.skip_reason.skip_message
    assert second.cursor == first.cursor


def test_restart_with_stored_cursor_starts_nothing_but_sees_new_files(
    tick, write_manifest, instance, test_resources, manifests_dir
):
    write_manifest(manifests_dir, "alpha")
    stored = tick(instance, test_resources).cursor
    # A restarted daemon builds a fresh context from the stored cursor string.
    write_manifest(manifests_dir, "beta")
    result = tick(instance, test_resources, cursor=stored)
    assert [r.partition_key.split("-")[0] for r in result.run_requests] == ["beta"]


def test_changed_manifest_is_a_new_partition_and_the_old_lineage_stays(
    tick, write_manifest, instance, test_resources, manifests_dir, tmp_path
):
    path = write_manifest(manifests_dir, "alpha")
    first = tick(instance, test_resources)
    old_key = first.run_requests[0].partition_key
    manifest = json.loads(path.read_text())
    manifest["objective"]["num_bins"] = 21
    path.write_text(json.dumps(manifest))
    second = tick(instance, test_resources, cursor=first.cursor)
    (request,) = second.run_requests
    assert request.partition_key != old_key and request.partition_key.startswith("alpha-")
    assert set(instance.get_dynamic_partitions("manifests")) == {old_key, request.partition_key}
    old_snapshot = json.loads((tmp_path / "artifacts" / old_key / "manifest.json").read_text())
    assert old_snapshot["objective"]["num_bins"] == 11  # the old lineage keeps its bytes


def test_invalid_manifest_starts_nothing_and_says_why(
    tick, write_manifest, instance, test_resources, manifests_dir, tmp_path
):
    (manifests_dir / "broken.json").write_text('{"schema": "miles.value-pretrain.v1", "train": 3}')
    result = tick(instance, test_resources)
    assert not result.run_requests
    assert "broken.json" in result.skip_reason.skip_message
    assert instance.get_dynamic_partitions("manifests") == []
    assert not (tmp_path / "artifacts").exists()
    # Not re-reported every tick, but a fixed file is picked up.
    again = tick(instance, test_resources, cursor=result.cursor)
    assert "broken.json" not in again.skip_reason.skip_message
    write_manifest(manifests_dir, "broken")
    fixed = tick(instance, test_resources, cursor=again.cursor)
    assert [r.partition_key.split("-")[0] for r in fixed.run_requests] == ["broken"]


def test_same_content_after_a_lost_cursor_reuses_the_run_key(
    tick, write_manifest, instance, test_resources, manifests_dir
):
    write_manifest(manifests_dir, "alpha")
    first = tick(instance, test_resources)
    again = tick(instance, test_resources, cursor=None)
    # Dagster drops a RunRequest whose run_key it has seen: the same content never runs twice.
    assert [r.run_key for r in again.run_requests] == [r.run_key for r in first.run_requests]


def test_missing_folder_is_a_skip(tick, write_manifest, instance, test_resources, manifests_dir):
    manifests_dir.rmdir()
    result = tick(instance, test_resources)
    assert "does not exist" in result.skip_message


def test_manifest_outside_the_data_roots_is_invalid(
    tick, write_manifest, instance, test_resources, manifests_dir, tmp_path
):
    from value_assets.resources import ManifestInbox

    write_manifest(manifests_dir, "outside", data_dir=tmp_path / "elsewhere")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    resources = {**test_resources, "inbox": ManifestInbox(folder=str(manifests_dir), data_roots=[str(allowed)])}
    result = tick(instance, resources)
    assert not result.run_requests
    assert "outside.json" in result.skip_reason.skip_message
    assert instance.get_dynamic_partitions("manifests") == []


POISON = {
    "int5000.json": b'{"schema": "miles.value-pretrain.v1", "n": ' + b"1" * 5000 + b"}",
    "deep.json": b'{"schema": "miles.value-pretrain.v1", "x": ' + b"[" * 100_000 + b"}",
    "nul.json": json.dumps(
        {
            "schema": "miles.value-pretrain.v1",
            "train": {"path": "a\u0000b.jsonl", "sha256": "a" * 64, "num_samples": 1},
            "objective": {},
        }
    ).encode(),
    "surrogate.json": b'{"schema": "miles.value-pretrain.v1", "x": "\\ud800"}',
}


def test_poisoned_manifests_are_skipped_alone_and_the_valid_one_beside_them_registers(
    tick, write_manifest, instance, manifests_dir, test_resources, tmp_path, capfd
):
    from value_assets.resources import ManifestInbox

    for name, data in POISON.items():
        (manifests_dir / name).write_bytes(data)
    write_manifest(manifests_dir, "alpha")
    # Data roots configured: the NUL path used to raise ValueError from realpath inside the tick.
    resources = {**test_resources, "inbox": ManifestInbox(folder=str(manifests_dir), data_roots=[str(tmp_path)])}
    capfd.readouterr()
    result = tick(instance, resources)
    (request,) = result.run_requests
    assert request.partition_key.startswith("alpha-")
    assert instance.get_dynamic_partitions("manifests") == [request.partition_key]
    logged = capfd.readouterr().err  # the sensor log (context.log) of a test context goes to stderr
    for name, needle in (
        ("int5000.json", "5000 digits"),
        ("deep.json", "nested too deeply"),
        ("nul.json", "NUL"),
        ("surrogate.json", "lone surrogate"),
    ):
        assert name in logged and needle in logged, (name, needle)
    assert len(logged) < 20_000, "a huge offending value must not flood the log"
    # Judged once: the next tick neither re-reports them nor fails.
    again = tick(instance, resources, cursor=result.cursor)
    assert not again.run_requests and "no new manifests" in again.skip_reason.skip_message
    assert set(parse_cursor(result.cursor)) == {str(manifests_dir / n) for n in [*POISON, "alpha.json"]}


def test_symlinked_manifest_is_judged_by_its_target_folder(
    tick, write_manifest, instance, test_resources, manifests_dir, tmp_path
):
    # The target's datasets sit beside the target, under the only data root; beside the link there
    # is nothing. Relative paths resolve against the file whose bytes are read (the target), in the
    # sensor as in the assets that load the registered manifest later.
    from value_assets.core.manifest import load_manifest
    from value_assets.resources import ManifestInbox

    elsewhere = tmp_path / "elsewhere"
    target = write_manifest(elsewhere, "beta")
    link = manifests_dir / "beta.json"
    link.symlink_to(target)
    resources = {**test_resources, "inbox": ManifestInbox(folder=str(manifests_dir), data_roots=[str(elsewhere)])}
    result = tick(instance, resources)
    (request,) = result.run_requests
    key = request.partition_key
    assert key.startswith("beta-") and sha12_of(key) == sha256_file(target)[:12]
    registration = json.loads((tmp_path / "artifacts" / key / "registration.json").read_text())
    assert registration["source_path"] == str(target.resolve())
    manifest = load_manifest(registration["source_path"], data_roots=[elsewhere])
    assert manifest.train.path == (elsewhere / "data" / "beta" / "train.jsonl").resolve()
    # With the link's folder as the only root, the same manifest is outside it: judged by its target.
    other = {**test_resources, "inbox": ManifestInbox(folder=str(manifests_dir), data_roots=[str(manifests_dir)])}
    refused = tick(instance, other, cursor=None)
    assert not refused.run_requests and "data roots" in refused.skip_reason.skip_message


def test_a_manifest_without_a_training_spec_is_refused_by_name_never_trained_on_tiny(
    tick, write_manifest, instance, test_resources, manifests_dir, tmp_path
):
    """docs/rules.md#training-spec: no spec of its own and no deployment default: nothing starts,
    and the reason names the manifest and the setting (the random tiny backbone is never a silent
    default for a real manifest)."""
    path = write_manifest(manifests_dir, "nospec", training=None)
    result = tick(instance, test_resources)
    assert not result.run_requests and instance.get_dynamic_partitions("manifests") == []
    message = result.skip_reason.skip_message
    assert f"{path.resolve()}: training" in message and "VALUE_ASSETS_DEFAULT_TRAINING" in message
    assert not (tmp_path / "artifacts").exists()


def test_the_deployment_default_spec_is_snapshotted_when_the_manifest_registers(
    tick, write_manifest, instance, test_resources, manifests_dir, tmp_path
):
    """A manifest without a spec takes the deployment's default (a spec file; its relative backbone
    paths resolve against that file's folder). The spec in force is written into the registration:
    a later change of the default changes no registered lineage."""
    from value_assets.core.registration import load_registered_spec
    from value_assets.resources import ManifestInbox

    default = tmp_path / "deploy" / "default-training.json"
    default.parent.mkdir()
    spec = {
        "schema": "value-assets.training.v1",
        "backbone": "tiny",
        "plan": {"global_batch_size": 8},
        "gate": {"mode": "interval"},
    }
    default.write_text(json.dumps(spec))
    resources = {**test_resources, "inbox": ManifestInbox(folder=str(manifests_dir), default_training=str(default))}
    write_manifest(manifests_dir, "nospec", training=None)
    (request,) = tick(instance, resources).run_requests
    key = request.partition_key
    assert request.run_config["ops"]["batch_plan"] == {"config": {"global_batch_size": 8}}
    assert request.run_config["ops"]["ev_report"]["config"]["gate_mode"] == "interval"
    partition = tmp_path / "artifacts" / key
    default.write_text(json.dumps({**spec, "plan": {"global_batch_size": 16}}))  # the deployment changes its default
    registered = load_registered_spec(partition, key)
    assert dict(registered.plan) == {"global_batch_size": 8} and registered.base == default.parent
    assert json.loads((partition / "registration.json").read_text())["training_spec_sha256"] == registered.sha256
    # an invalid default is the reason the next spec-less manifest is skipped
    default.write_text(json.dumps({**spec, "plan": {"epochs": 0}}))
    write_manifest(manifests_dir, "nospec2", training=None)
    again = tick(instance, resources)
    assert not again.run_requests and f"{default}: training" not in again.skip_reason.skip_message
    assert f"{default}.plan.epochs" in again.skip_reason.skip_message


def test_a_partition_some_run_already_ran_is_not_started_again(
    tick, write_manifest, instance, test_resources, test_defs, manifests_dir
):
    """`make demo` then `make ui`: the daemon's sensor never saw the demo's runs (the demo ticks its
    own context). A partition the instance already ran, by any run, gets no second run request."""
    write_manifest(manifests_dir, "once", standin={"ev": 0.3})
    (request,) = tick(instance, test_resources).run_requests
    assert (
        test_defs.resolve_job_def("full")
        .execute_in_process(instance=instance, partition_key=request.partition_key, run_config=request.run_config)
        .success
    )
    fresh_cursor = tick(instance, test_resources)  # as a daemon with no cursor would tick
    assert not fresh_cursor.run_requests
    assert f"{request.partition_key}: already run" in fresh_cursor.skip_reason.skip_message


def test_run_manifests_exits_2_naming_a_refused_input_and_the_run(tmp_path, monkeypatch, capsys):
    """`value-assets run-manifests` on a manifest whose dataset no longer hashes to its pin: the run
    stops at train_dataset (before any GPU step), and the command exits 2 naming the file and the run
    (it exited 1, "failed (run None)": a refusal read as a bug; the run id was never passed on).
    The GPU job's own refusals (a full disk at its save) take the same path through its
    "invalid input" log line: tests/dagster/test_dg_full_disk.py (the `system` tier)."""
    from tests.dagster.conftest import write_manifest
    from value_assets.cli import main as cli_main

    manifests = tmp_path / "manifests"
    write_manifest(manifests, "bad")
    train = manifests / "data" / "bad" / "train.jsonl"
    train.write_text(train.read_text().replace("\n", "\n\n", 1))  # other bytes, the same rows
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VALUE_ASSETS_ARTIFACTS", str(tmp_path / "artifacts"))
    monkeypatch.setenv("VALUE_ASSETS_MANIFESTS", str(manifests))
    monkeypatch.delenv("VALUE_ASSETS_DEPLOYMENT", raising=False)
    assert cli_main(["run-manifests"]) == 2
    captured = capsys.readouterr()
    assert "value-assets: error: bad-" in captured.err and f"train_dataset: {train}: sha256 is" in captured.err
    (line,) = [ln for ln in captured.out.splitlines() if ln.startswith("bad-")]
    assert line.endswith(")") and "(run None)" not in line and "failed (run " in line
