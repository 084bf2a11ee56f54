"""core/handoff.py and `value-assets handoff`: bundle records, verification, RL-side settings."""

import json

import pytest

from value_assets.cli import main
from value_assets.core.errors import InputError
from value_assets.core.handoff import (
    build_handoff,
    describe_bundle,
    model_identity,
    objective_flags,
    record_rl_settings,
    reusable_handoff,
    verify_handoff,
)
from value_assets.core.hashing import sha256_file
from value_assets.core.miles import MILES_CONTRACT_NAME, MILES_TRACKER_NAME, build_miles_contract
from value_assets.core.strict_json import canonical_bytes

SHA_A, SHA_B, SHA_C = "a" * 64, "b" * 64, "c" * 64
CLASSIFICATION = {
    "loss_type": "classification",
    "num_bins": 11,
    "reward_range": [0.0, 1.0],
    "target_type": "hl_gauss",
    "hl_gauss_sigma_ratio": 0.75,
}
MSE = {"loss_type": "mse"}

pytestmark = pytest.mark.unit


def contract(objective):
    return {
        "source_manifest_sha256": SHA_A,
        "train_dataset_sha256": SHA_B,
        "objective": objective,
        "batch_plan": {"seed": 3, "global_batch_size": 8, "drop_incomplete_batch": True, "algorithm": "x"},
        "completed_steps": 4,
        "model": {"backbone": "tiny"},
    }


def bundles(tmp_path, objective, tokenizer=True):
    """Installed bundles as the export writes them (fake weights; the actor's tokenizer files in the
    Hugging Face folder unless `tokenizer` is False) and the registry record."""
    c = contract(objective)
    miles = build_miles_contract(c, model_identity(c, SHA_C))
    root = tmp_path / "handoff"
    (root / "miles" / "iter_0000004").mkdir(parents=True)
    (root / "miles" / "iter_0000004" / "common.pt").write_bytes(b"weights")
    (root / "miles" / MILES_TRACKER_NAME).write_text("4\n")
    (root / "miles" / MILES_CONTRACT_NAME).write_bytes(canonical_bytes(miles))
    scalar = objective["loss_type"] == "mse"
    if scalar:
        (root / "hf").mkdir()
        (root / "hf" / "model.safetensors").write_bytes(b"hf")
        if tokenizer:
            (root / "hf" / "tokenizer.json").write_text("{}")
            (root / "hf" / "tokenizer_config.json").write_text("{}")
    record = {
        "schema": "value-assets.promotion.v1",
        "partition_key": "demo-1",
        "contract_sha256": SHA_C,
        "handoff": build_handoff(handoff_dir=root, miles_contract=miles, objective=objective, scalar_hf=scalar),
    }
    path = tmp_path / "registry.json"
    path.write_bytes(canonical_bytes(record))
    return record, path, miles


def test_model_identity_is_deterministic_and_names_the_bootstrap_and_contract():
    assert model_identity(contract(MSE), SHA_C) == f"value-assets:tiny@{SHA_C}" == model_identity(contract(MSE), SHA_C)


def test_bundle_record_lists_every_file_with_its_sha(tmp_path):
    record, _, _ = bundles(tmp_path, CLASSIFICATION)
    miles = record["handoff"]["miles"]
    assert [f["path"] for f in miles["files"]] == ["iter_0000004/common.pt", MILES_TRACKER_NAME, MILES_CONTRACT_NAME]
    assert miles == {**describe_bundle(tmp_path / "handoff" / "miles"), "contract_sha256": miles["contract_sha256"]}
    assert record["handoff"]["hf"] is None
    verify_handoff(record, "record")


def test_objective_flags_follow_miles_arguments():
    assert objective_flags(MSE) == ["--value-loss-type", "mse"]
    assert objective_flags(CLASSIFICATION) == [
        "--value-loss-type",
        "classification",
        "--value-num-bins",
        "11",
        "--value-reward-range",
        "0.0",
        "1.0",
        "--value-target-type",
        "hl_gauss",
        "--hl-gauss-sigma-ratio",
        "0.75",
    ]
    two_hot = {**CLASSIFICATION, "target_type": "two_hot"}
    assert "--hl-gauss-sigma-ratio" not in objective_flags(two_hot)


def test_rl_settings_of_an_mse_critic_name_verl_path(tmp_path):
    record, _, _ = bundles(tmp_path, MSE)
    s = record_rl_settings(record)
    miles_dir = str(tmp_path / "handoff" / "miles")
    assert s["miles_args"][:5] == [
        "--critic-load",
        miles_dir,
        "--critic-value-pretrain-contract-sha256",
        record["handoff"]["miles"]["contract_sha256"],
        "--no-load-optim",
    ]
    assert "--finetune" not in s["miles_args"]
    assert s["verl"] == {"critic.model.path": str(tmp_path / "handoff" / "hf")}
    assert "verl_tokenizer_missing" not in s


def test_rl_settings_of_a_critic_folder_without_tokenizer_tell_verl_where_it_is(tmp_path, capsys):
    """verl reads the tokenizer from critic.model.path by default: from a folder without tokenizer
    files it builds an empty one. Such a hand-off names critic.model.tokenizer_path, to be filled."""
    record, path, _ = bundles(tmp_path, MSE, tokenizer=False)
    s = record_rl_settings(record)
    hf = str(tmp_path / "handoff" / "hf")
    assert s["verl"] == {"critic.model.path": hf, "critic.model.tokenizer_path": "ACTOR_TOKENIZER_DIR"}
    assert s["verl_tokenizer_missing"].startswith(f"{hf} holds no tokenizer files")
    assert main(["handoff", str(path), *pin(path)]) == 0
    out = capsys.readouterr().out
    assert f"# {hf} holds no tokenizer files: set critic.model.tokenizer_path" in out
    assert f"critic.model.path={hf} critic.model.tokenizer_path=ACTOR_TOKENIZER_DIR" in out


def test_reusable_handoff_only_for_the_same_contract_with_intact_bundles(tmp_path):
    record, _, miles = bundles(tmp_path, CLASSIFICATION)
    assert reusable_handoff(record, contract_sha256=SHA_C, miles_contract=miles, scalar_hf=False) == record["handoff"]
    assert reusable_handoff(record, contract_sha256=SHA_A, miles_contract=miles, scalar_hf=False) is None
    assert reusable_handoff(record, contract_sha256=SHA_C, miles_contract=miles, scalar_hf=True) is None
    (tmp_path / "handoff" / "miles" / "iter_0000004" / "common.pt").write_bytes(b"tampered")
    assert reusable_handoff(record, contract_sha256=SHA_C, miles_contract=miles, scalar_hf=False) is None


def pin(path) -> list[str]:
    return ["--record-sha256", sha256_file(path)]


def test_handoff_cli_prints_the_settings(tmp_path, capsys):
    record, path, _ = bundles(tmp_path, MSE)
    assert main(["handoff", str(path), *pin(path)]) == 0
    out = capsys.readouterr().out
    assert f"--critic-load {tmp_path / 'handoff' / 'miles'}" in out and "--no-load-optim --value-loss-type mse" in out
    assert f"critic.model.path={tmp_path / 'handoff' / 'hf'}" in out
    assert f"registry record {sha256_file(path)} pinned by --record-sha256" in out
    assert main(["handoff", str(path), "--json", *pin(path)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["registry_record_sha256"] == sha256_file(path)
    assert shown["contract_sha256_to_pin"] == record["handoff"]["miles"]["contract_sha256"]
    assert (
        shown["critic_load"] == str(tmp_path / "handoff" / "miles")
        and shown["model_identity"] == f"value-assets:tiny@{SHA_C}"
    )


@pytest.mark.parametrize("tamper", ["changed", "extra", "missing"])
def test_handoff_cli_refuses_a_tampered_bundle_with_the_difference(tmp_path, capsys, tamper):
    _, path, _ = bundles(tmp_path, CLASSIFICATION)
    weights = tmp_path / "handoff" / "miles" / "iter_0000004" / "common.pt"
    if tamper == "changed":
        weights.write_bytes(b"weightz")
    elif tamper == "extra":
        (weights.parent / "more.distcp").write_bytes(b"")
    else:
        weights.unlink()
    assert main(["handoff", str(path), *pin(path)]) == 2
    err = capsys.readouterr().err
    assert {
        "changed": "changed iter_0000004/common.pt",
        "extra": "unexpected iter_0000004/more.distcp",
        "missing": "missing iter_0000004/common.pt",
    }[tamper] in err


def test_handoff_cli_refuses_a_record_without_bundles(tmp_path, capsys):
    path = tmp_path / "old.json"
    path.write_bytes(canonical_bytes({"schema": "value-assets.promotion.v1", "contract_sha256": SHA_C}))
    assert main(["handoff", str(path), *pin(path)]) == 2
    assert "no hand-off bundles" in capsys.readouterr().err


def test_handoff_cli_vouches_only_for_a_pinned_record(tmp_path, capsys, monkeypatch):
    """Whoever can write the artifacts folder can swap a bundle's weights and rewrite the record's
    file list and shas to match: the bundles then agree with the record. Only the record's pin, held
    outside that folder (the promotion's metadata in the Dagster instance), tells them apart."""
    record, path, _ = bundles(tmp_path, CLASSIFICATION)
    genuine = sha256_file(path)
    weights = tmp_path / "handoff" / "miles" / "iter_0000004" / "common.pt"
    weights.write_bytes(b"the attacker's weights")
    forged = {
        **record,
        "handoff": {
            **record["handoff"],
            "miles": {**record["handoff"]["miles"], **describe_bundle(tmp_path / "handoff" / "miles")},
        },
    }
    verify_handoff(forged, "forged")  # self-consistent: the bundle matches the rewritten record
    path.write_bytes(canonical_bytes(forged))

    assert main(["handoff", str(path), "--record-sha256", genuine]) == 2
    captured = capsys.readouterr()
    assert f"record sha256 is {sha256_file(path)}, but {genuine} was pinned" in captured.err and captured.out == ""
    assert main(["handoff", str(path)]) == 2  # unpinned: refused, nothing printed for the RL side
    captured = capsys.readouterr()
    assert "the registry record is not pinned" in captured.err and "--critic-load" not in captured.out
    assert main(["handoff", str(path), "--record-sha256", "not-a-sha"]) == 2
    assert "--record-sha256" in capsys.readouterr().err
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert main(["handoff", str(path), "--instance"]) == 2
    assert "DAGSTER_HOME is not set" in capsys.readouterr().err


def test_verify_refuses_an_edited_file_list(tmp_path):
    record, _, _ = bundles(tmp_path, CLASSIFICATION)
    record["handoff"]["miles"]["files"] = record["handoff"]["miles"]["files"][1:]
    with pytest.raises(InputError, match="does not hash to its files_sha256"):
        verify_handoff(record, "record")


@pytest.mark.parametrize("linked", ["miles", "handoff"])
def test_a_bundle_folder_that_is_a_symlink_is_refused_however_identical(tmp_path, capsys, linked):
    """Issue 33, defect 5: `handoff/miles` (or `handoff/` itself) pointing at an identical copy
    outside the store: every file matches the record, but --critic-load would resolve to a folder the
    store's permissions do not cover. `value-assets handoff` verified it and re-promotion re-pinned
    it; now it is refused, not reused, and promotion never installs bundles through the link."""
    import shutil

    from value_assets.core.handoff import install_bundles

    record, path, miles = bundles(tmp_path, CLASSIFICATION)
    real = tmp_path / "handoff" / "miles" if linked == "miles" else tmp_path / "handoff"
    outside = tmp_path / "elsewhere" / real.name
    outside.parent.mkdir()
    shutil.copytree(real, outside)
    shutil.rmtree(real)
    real.symlink_to(outside, target_is_directory=True)
    assert main(["handoff", str(path), *pin(path)]) == 2
    assert f"{real}: is a symlink" in capsys.readouterr().err
    assert reusable_handoff(record, contract_sha256=SHA_C, miles_contract=miles, scalar_hf=False) is None
    if linked == "handoff":
        (tmp_path / "staging" / "miles").mkdir(parents=True)
        with pytest.raises(InputError, match="is a symlink"):
            install_bundles(tmp_path / "staging", real, ("miles",))
        assert (tmp_path / "staging" / "miles").is_dir() and (outside / "miles").is_dir()  # nothing moved
        assert not (tmp_path / "staging" / "replaced-miles").exists()
