"""Promotion re-verification (SPEC 8): every refusal, on files, without Dagster."""

import json
import os

import pytest

from value_assets.assets.lineage import (
    ContractRef,
    PromotionRefused,
    canonical_json,
    latest_contract_path,
    resolve_latest_contract,
    verify_promotion,
)
from value_assets.core.hashing import sha256_bytes

pytestmark = pytest.mark.unit
MANIFEST_SHA = "a" * 64


@pytest.fixture
def published(tmp_path):
    """A contracted save and a passing report naming it."""
    save = tmp_path / "critic" / "iter_0000004"
    save.mkdir(parents=True)
    contract_bytes = canonical_json({"schema": "value-assets.contract.v1", "source_manifest_sha256": MANIFEST_SHA,
                                     "completed_steps": 4})
    (save / "value_pretrain_contract.json").write_bytes(contract_bytes)
    (tmp_path / "critic" / "latest").write_text("iter_0000004\n")
    contract = ContractRef(path=save / "value_pretrain_contract.json", sha256=sha256_bytes(contract_bytes),
                           contract=json.loads(contract_bytes))
    report = tmp_path / "reports" / f"ev-{contract.sha256[:12]}.json"
    write_report(report, {"passed": True, "split": "heldout", "contract_sha256": contract.sha256,
                          "manifest_sha256": MANIFEST_SHA})
    return contract, report


def write_report(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    data = canonical_json(obj)
    path.write_bytes(data)
    path.with_name(path.name + ".sha256").write_text(sha256_bytes(data) + "\n")
    return sha256_bytes(data)


def promote(contract, report, recorded=None, manifest_sha=MANIFEST_SHA):
    return verify_promotion(partition_key="p-000000000000", manifest_sha256=manifest_sha, contract=contract,
                            report_path=report, recorded_report_sha256=recorded)


def test_passing_report_gives_the_record_the_rl_job_pins(published):
    contract, report = published
    record = promote(contract, report, recorded=sha256_bytes(report.read_bytes()))
    assert record["checkpoint"] == str(contract.checkpoint_dir)
    assert record["contract_sha256"] == contract.sha256
    assert record["report_sha256"] == sha256_bytes(report.read_bytes())
    assert record["manifest_sha256"] == MANIFEST_SHA


def test_missing_report_is_refused(published):
    contract, report = published
    report.unlink()
    with pytest.raises(PromotionRefused, match="does not exist"):
        promote(contract, report)


def test_report_that_no_longer_hashes_to_its_recorded_sha_is_refused(published):
    contract, report = published
    report.write_bytes(report.read_bytes().replace(b'"passed":true', b'"passed":true '))
    with pytest.raises(PromotionRefused, match="not its recorded sha"):
        promote(contract, report)


def test_report_other_than_the_one_ev_report_recorded_is_refused(published):
    contract, report = published
    with pytest.raises(PromotionRefused, match="ev_report recorded"):
        promote(contract, report, recorded="b" * 64)


def test_failed_gate_is_refused(published):
    contract, report = published
    report.unlink()
    write_report(report, {"passed": False, "split": "heldout", "contract_sha256": contract.sha256,
                          "manifest_sha256": MANIFEST_SHA})
    with pytest.raises(PromotionRefused, match="did not pass"):
        promote(contract, report)


def test_report_of_a_different_contract_is_refused(published):
    contract, report = published
    report.unlink()
    write_report(report, {"passed": True, "split": "heldout", "contract_sha256": "c" * 64,
                          "manifest_sha256": MANIFEST_SHA})
    with pytest.raises(PromotionRefused, match="not the one being promoted"):
        promote(contract, report)


def test_report_of_another_manifest_is_refused(published):
    contract, report = published
    with pytest.raises(PromotionRefused, match="names manifest"):
        promote(contract, report, manifest_sha="d" * 64)


def test_train_split_report_is_refused(published):
    contract, report = published
    report.unlink()
    write_report(report, {"passed": True, "split": "train", "contract_sha256": contract.sha256,
                          "manifest_sha256": MANIFEST_SHA})
    with pytest.raises(PromotionRefused, match="only heldout"):
        promote(contract, report)


def test_symlinked_report_is_refused(published, tmp_path):
    contract, report = published
    real = tmp_path / "elsewhere.json"
    os.replace(report, real)
    report.symlink_to(real)
    with pytest.raises(PromotionRefused, match="symlink"):
        promote(contract, report)


@pytest.mark.parametrize("pointer", ["iter_0000004", "iter_0000004/value_pretrain_contract.json",
                                     '{"iteration": 4}', '{"path": "iter_0000004"}'])
def test_latest_pointer_forms(published, pointer):
    contract, _ = published
    (contract.path.parent.parent / "latest").write_text(pointer)
    assert latest_contract_path(contract.path.parent.parent) == contract.path
    assert resolve_latest_contract(contract.path.parent.parent).sha256 == contract.sha256
