"""Promotion writes the hand-off (issue 10 part 5), with real Dagster and the Pipes stand-in (its
bundles are fake-but-well-formed; tests/dagster/test_dg_engine.py checks a real export): the
record names each bundle with its files and the Miles contract sha, the metadata shows the RL-side
settings, re-promotion is idempotent, and a failed export writes no record."""

import json
from pathlib import Path

import pytest
from dagster import AssetKey

from value_assets.core.handoff import describe_bundle, verify_handoff
from value_assets.core.hashing import sha256_file
from value_assets.core.miles import read_miles_contract
from value_assets.core.strict_json import canonical_bytes
from value_assets.lineage import Lineage

pytestmark = pytest.mark.integration


def run(defs, instance, key, assets=None):
    if assets is None:
        return defs.resolve_job_def("full").execute_in_process(
            instance=instance, partition_key=key, raise_on_error=False
        )
    return defs.get_implicit_global_asset_job_def().execute_in_process(
        instance=instance, partition_key=key, asset_selection=[AssetKey(a) for a in assets], raise_on_error=False
    )


def test_promotion_records_the_bundles_and_shows_the_rl_settings(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register, monkeypatch
):
    from value_assets.cli import main

    path = write_manifest(manifests_dir, "mse", standin={"ev": 0.3}, objective={"loss_type": "mse"})
    (key,) = register(instance, test_resources, path)
    result = run(test_defs, instance, key)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    artifacts = tmp_path / "artifacts"
    record = json.loads((artifacts / "registry" / f"{key}.json").read_text())
    handoff = record["handoff"]
    miles_dir, hf_dir = artifacts / key / "handoff" / "miles", artifacts / key / "handoff" / "hf"
    contract, sha = read_miles_contract(miles_dir, pinned_sha256=handoff["miles"]["contract_sha256"])
    assert sha == sha256_file(miles_dir / "value_pretrain_contract.json")
    assert contract["model_identity"] == handoff["model_identity"] == f"value-assets:tiny@{record['contract_sha256']}"
    assert handoff["miles"] == {**describe_bundle(miles_dir), "contract_sha256": sha}
    assert handoff["hf"] == describe_bundle(hf_dir)
    verify_handoff(record, "record")
    assert not [p for p in (artifacts / key / "handoff").iterdir() if p.name.startswith(".staging")]

    meta = Lineage(instance, key).metadata("promoted_critic")
    assert meta["miles_contract_sha256"] == sha and meta["miles_files_sha256"] == handoff["miles"]["files_sha256"]
    record_path = artifacts / "registry" / f"{key}.json"
    assert meta["registry_record_sha256"] == sha256_file(record_path) == Lineage(instance, key).promoted_record_sha()
    assert f"value-assets handoff {record_path} --record-sha256 {sha256_file(record_path)}" in str(
        meta["handoff_command"]
    )
    assert str(meta["miles_bundle"]) == str(miles_dir) and str(meta["verl_critic_model_path"]) == str(hf_dir)
    # the tiny backbone has no tokenizer: the materialization says verl needs critic.model.tokenizer_path
    assert str(meta["verl_tokenizer_missing"]).startswith(f"{hf_dir} holds no tokenizer files")
    assert meta["rl_settings"]["verl"]["critic.model.tokenizer_path"] == "ACTOR_TOKENIZER_DIR"
    assert meta["rl_settings"]["miles_args"][:5] == [
        "--critic-load",
        str(miles_dir),
        "--critic-value-pretrain-contract-sha256",
        sha,
        "--no-load-optim",
    ]
    assert f"--critic-load {miles_dir}" in str(meta["miles_args"]) and meta["handoff_reused"] is False

    # Re-promotion of the same contract, a day later: nothing exported again, same record content
    # and version (the promotion time has one-second resolution: a day apart, a time in the record
    # could not hide).
    first_version = instance.get_latest_materialization_event(AssetKey("promoted_critic")).asset_materialization.tags
    before = {p: p.stat().st_mtime_ns for p in miles_dir.rglob("*")}
    record_mtime = record_path.stat().st_mtime_ns
    monkeypatch.setattr("value_assets.assets.critic.datetime", _ADayLater)
    again = run(test_defs, instance, key, ["promoted_critic"])
    assert again.success, [e.message for e in again.all_events if e.is_failure]
    assert Lineage(instance, key).metadata("promoted_critic")["handoff_reused"] is True
    assert {p: p.stat().st_mtime_ns for p in miles_dir.rglob("*")} == before
    second = json.loads((artifacts / "registry" / f"{key}.json").read_text())
    assert second == record and "promoted_at" not in record  # the time is the metadata's, not the record's
    second_version = instance.get_latest_materialization_event(AssetKey("promoted_critic")).asset_materialization.tags
    assert second_version["dagster/data_version"] == first_version["dagster/data_version"]
    # The pin handed to the RL side stays valid: the record was left as it was, byte for byte.
    assert Lineage(instance, key).promoted_record_sha() == sha256_file(record_path) == meta["registry_record_sha256"]
    assert record_path.stat().st_mtime_ns == record_mtime
    second_meta = Lineage(instance, key).metadata("promoted_critic")
    assert second_meta["promoted_at"][:10] != meta["promoted_at"][:10]  # promoted again, a day later
    # ... and the RL side's pin, given after the first promotion, still verifies (issue 33, defect 4).
    assert main(["handoff", str(record_path), "--record-sha256", meta["registry_record_sha256"]]) == 0


class _ADayLater:
    """`datetime` in assets/critic.py, one day ahead."""

    @staticmethod
    def now(tz=None):
        from datetime import datetime, timedelta

        return datetime.now(tz) + timedelta(days=1)


def test_re_promotion_reuses_only_bundles_of_the_record_the_instance_pinned(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register
):
    """Re-promotion reuses the previous bundles when they still match the previous record. That
    record is read from the artifacts folder, so it counts only if it is the one the last promotion
    wrote (its pin in the instance): a record rewritten to match swapped weights would otherwise be
    reused, and then pinned afresh by the new promotion."""
    from value_assets.core.handoff import describe_bundle

    (key,) = register(instance, test_resources, write_manifest(manifests_dir, "reuse", standin={"ev": 0.3}))
    assert run(test_defs, instance, key).success
    record_path = tmp_path / "artifacts" / "registry" / f"{key}.json"
    record = json.loads(record_path.read_text())
    miles_dir = Path(record["handoff"]["miles"]["dir"])
    (victim,) = [miles_dir / f["path"] for f in record["handoff"]["miles"]["files"] if f["path"].endswith("common.pt")]
    genuine = victim.read_bytes()
    victim.write_bytes(b"the attacker's weights")
    record["handoff"]["miles"].update(describe_bundle(miles_dir))
    record_path.write_bytes(canonical_bytes(record))

    again = run(test_defs, instance, key, ["promoted_critic"])
    assert again.success, [e.message for e in again.all_events if e.is_failure]
    meta = Lineage(instance, key).metadata("promoted_critic")
    assert meta["handoff_reused"] is False  # exported again, not reused
    assert victim.read_bytes() == genuine
    assert meta["registry_record_sha256"] == sha256_file(record_path)
    verify_handoff(json.loads(record_path.read_text()), "record")


def test_handoff_cli_pins_the_record_through_the_dagster_instance(
    tmp_path, test_defs, test_resources, manifests_dir, write_manifest, register, monkeypatch, capsys
):
    """`value-assets handoff --instance` in another process's place: it reads the promotion from the
    instance on disk at $DAGSTER_HOME, so a record rewritten in the artifacts folder (with bundles to
    match) or a record of a partition that was never promoted is refused."""
    from dagster import DagsterInstance

    from value_assets.cli import main
    from value_assets.core.handoff import describe_bundle

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with DagsterInstance.get() as instance:  # SQLite on disk, as `make demo` and `dagster dev` keep it
        (key,) = register(instance, test_resources, write_manifest(manifests_dir, "pinned", standin={"ev": 0.3}))
        result = run(test_defs, instance, key)
        assert result.success, [e.message for e in result.all_events if e.is_failure]
    record_path = tmp_path / "artifacts" / "registry" / f"{key}.json"
    assert main(["handoff", str(record_path), "--instance"]) == 0
    assert f"pinned by the Dagster instance ({home})" in capsys.readouterr().out
    # The README's relative DAGSTER_HOME=.dagster_home is read from the working directory (Dagster
    # itself refuses it: exit 1 before, DagsterInvariantViolationError); a missing folder or one
    # with no instance is exit 2, named, and nothing is created there.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DAGSTER_HOME", "home")
    assert main(["handoff", str(record_path), "--instance"]) == 0
    assert f"pinned by the Dagster instance ({home})" in capsys.readouterr().out
    for missing in ("nowhere", "artifacts"):
        monkeypatch.setenv("DAGSTER_HOME", missing)
        assert main(["handoff", str(record_path), "--instance"]) == 2
        assert f"--instance: DAGSTER_HOME={missing}: {tmp_path / missing} " in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "artifacts" / "storage").exists()
    monkeypatch.setenv("DAGSTER_HOME", str(home))

    record = json.loads(record_path.read_text())
    miles_dir = Path(record["handoff"]["miles"]["dir"])
    (miles_dir / "latest_checkpointed_iteration.txt").write_text("9\n")
    record["handoff"]["miles"].update(describe_bundle(miles_dir))
    record_path.write_bytes(canonical_bytes(record))
    assert main(["handoff", str(record_path), "--instance"]) == 2
    assert "was pinned" in capsys.readouterr().err

    elsewhere = record_path.with_name("never-promoted.json")
    elsewhere.write_bytes(record_path.read_bytes())
    assert main(["handoff", str(elsewhere), "--instance"]) == 2
    assert "has no promoted_critic materialization" in capsys.readouterr().err


def test_classification_critic_has_no_hf_bundle(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register
):
    path = write_manifest(manifests_dir, "cls", standin={"ev": 0.3})
    (key,) = register(instance, test_resources, path)
    assert run(test_defs, instance, key).success
    record = json.loads((tmp_path / "artifacts" / "registry" / f"{key}.json").read_text())
    assert record["handoff"]["hf"] is None and not (tmp_path / "artifacts" / key / "handoff" / "hf").exists()
    assert "--value-num-bins" in Lineage(instance, key).metadata("promoted_critic")["rl_settings"]["miles_args"]


def test_a_failed_export_writes_no_record(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register
):
    path = write_manifest(manifests_dir, "broken", standin={"ev": 0.3, "handoff_exit_code": 3})
    (key,) = register(instance, test_resources, path)
    result = run(test_defs, instance, key)
    assert not result.success
    assert {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()} >= {"ev_report"}
    assert "promoted_critic" not in {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert not (tmp_path / "artifacts" / "registry" / f"{key}.json").exists()
    handoff = tmp_path / "artifacts" / key / "handoff"
    assert not (handoff / "miles").exists() and not [p for p in handoff.iterdir() if p.name.startswith(".staging")]
