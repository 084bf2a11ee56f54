"""Promotion re-verification (SPEC 8): every refusal, on files, without Dagster."""

import os

import pytest

from value_assets.assets.lineage import PromotionRefused, canonical_json, resolve_latest_contract, verify_promotion
from value_assets.core.checkpoint_files import describe_folder
from value_assets.core.contract import build_contract, iter_dirname, write_contract
from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_bytes
from value_assets.core.objective import Objective
from value_assets.core.plan import build_plan

pytestmark = pytest.mark.unit
MANIFEST_SHA = "a" * 64


@pytest.fixture
def published(tmp_path):
    """A contracted save (written by the core) and a passing report naming it."""
    critic = tmp_path / "critic"
    plan = build_plan(8, 4, 1, 0)
    save = critic / iter_dirname(plan.num_steps)
    save.mkdir(parents=True)
    (save / "common.pt").write_bytes(b"stand-in")
    write_contract(critic, build_contract(
        manifest_sha256=MANIFEST_SHA, train_sha256="b" * 64, objective=Objective().canonical(), plan=plan,
        completed_steps=plan.num_steps, model={"backbone": "tiny"}, backbone_config={},
        checkpoint=str(save), checkpoint_files=describe_folder(save)))
    contract = resolve_latest_contract(critic)
    report = tmp_path / "reports" / f"ev-{contract.sha256[:12]}.json"
    write_report(report, {"passed": True, "split": "heldout", "contract_sha256": contract.sha256,
                          "source_manifest_sha256": MANIFEST_SHA})
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
    with pytest.raises(PromotionRefused, match="sidecar records"):
        promote(contract, report)


def test_report_other_than_the_one_ev_report_recorded_is_refused(published):
    contract, report = published
    with pytest.raises(PromotionRefused, match="ev_report recorded"):
        promote(contract, report, recorded="b" * 64)


@pytest.mark.parametrize("changes, message", [
    ({"passed": False}, "did not pass"),
    ({"contract_sha256": "c" * 64}, "not the one being promoted"),
    ({"split": "train"}, "only heldout"),
], ids=["failed-gate", "other-contract", "train-split"])
def test_republished_report_that_breaks_a_rule_is_refused(published, changes, message):
    contract, report = published
    report.unlink()
    write_report(report, {"passed": True, "split": "heldout", "contract_sha256": contract.sha256,
                          "source_manifest_sha256": MANIFEST_SHA} | changes)
    with pytest.raises(PromotionRefused, match=message):
        promote(contract, report)


def test_report_of_another_manifest_is_refused(published):
    contract, report = published
    with pytest.raises(PromotionRefused, match="names manifest"):
        promote(contract, report, manifest_sha="d" * 64)


def test_symlinked_report_is_refused(published, tmp_path):
    contract, report = published
    real = tmp_path / "elsewhere.json"
    os.replace(report, real)
    report.symlink_to(real)
    with pytest.raises(PromotionRefused, match="symlink"):
        promote(contract, report)


def test_latest_pointer_must_name_the_recorded_contract(published):
    contract, _ = published
    critic = contract.path.parent.parent
    assert resolve_latest_contract(critic, pinned_sha256=contract.sha256).path == contract.path
    with pytest.raises(InputError, match="lineage recorded"):
        resolve_latest_contract(critic, pinned_sha256="e" * 64)


def test_no_contracted_save_is_refused(tmp_path):
    with pytest.raises(InputError, match="no contracted save"):
        resolve_latest_contract(tmp_path / "critic")
