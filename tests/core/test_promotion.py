"""The trust rules of docs/rules.md#evaluation and docs/rules.md#promotion as plain functions, on files, without
Dagster: `decide_gate`, when a published report is reused, and every refusal of promotion."""

import os

import numpy as np
import pytest

from value_assets.core.checkpoint_files import describe_folder
from value_assets.core.contract import build_contract, iter_dirname, write_contract
from value_assets.core.contract_lookup import resolve_latest_contract
from value_assets.core.errors import InputError
from value_assets.core.hashing import sha256_bytes
from value_assets.core.objective import Objective
from value_assets.core.plan import build_plan
from value_assets.core.promotion import (
    GateRecord,
    PromotionRefused,
    ReportRecord,
    decide_reuse,
    lineage_report_sha,
    verify_promotion,
)
from value_assets.core.publish import publish_once
from value_assets.core.report import build_report, decide_gate
from value_assets.core.stats import RankReport, SuffStats
from value_assets.core.strict_json import canonical_bytes

pytestmark = pytest.mark.unit
MANIFEST_SHA = "a" * 64
KEY = "p-000000000000"


def ev_report(*, slope=0.5, split="heldout", contract_sha="c" * 64, manifest_sha=MANIFEST_SHA, batches=4, g=4):
    """A real core report over synthetic rows: V = slope*R + (1-slope)/2, so EV = 1 - (1-slope)^2."""
    labels = [float(i % 2) for i in range(batches * g)]
    plan = [list(range(k * g, (k + 1) * g)) for k in range(batches)]
    rank_reports, active = [], []
    for rows in plan:
        returns = [np.full(3, labels[i]) for i in rows]
        rank_reports.append(
            [
                RankReport.from_rows(
                    0, [(i, r, slope * r + (1 - slope) / 2, np.ones(3)) for i, r in zip(rows, returns, strict=True)]
                )
            ]
        )
        active.append(3 * len(rows))
    return build_report(
        manifest_sha256=manifest_sha,
        dataset_sha256="d" * 64,
        split=split,
        checkpoint="ckpt",
        contract_sha256=contract_sha,
        dp=1,
        seed=0,
        global_batch_size=g,
        batches=plan,
        rank_reports=rank_reports,
        active_targets=active,
        labels=labels,
    )


# ---- decide_gate: the one gate, used by the builder, the ev_gate check and promotion


def test_builder_states_what_decide_gate_decides():
    good, bad, train = ev_report(slope=0.5), ev_report(slope=-0.5), ev_report(split="train")
    assert good["passed"] is True and decide_gate(good).passed
    assert good["aggregates"]["token"]["ev"] == pytest.approx(0.75) and good["gate"]["token"]["passed"]
    assert bad["passed"] is False and not decide_gate(bad).passed
    assert (
        train["passed"] is False and train["gate"]["applies"] is False and "fit diagnostic" in train["gate"]["reason"]
    )
    assert good["gate"]["criteria"]["split"].startswith("heldout rows only")


def test_decide_gate_only_heldout_gates():
    decision = decide_gate(ev_report(split="train") | {"passed": False})
    assert not decision.passed and "only heldout rows gate" in decision.failures[0]
    assert decision.weightings["token"].passed  # the numbers would pass; the split does not


def test_decide_gate_does_not_trust_the_reports_verdict_or_aggregates():
    bad = ev_report(slope=-0.5)
    assert not decide_gate(bad | {"passed": True}).passed
    good = ev_report()
    forged = good | {"aggregates": {**good["aggregates"], "token": {**good["aggregates"]["token"], "ev": 0.9}}}
    assert any("report's aggregate EV 0.9" in f for f in decide_gate(forged).failures)
    assert any("report says passed=False" in f for f in decide_gate(good | {"passed": False}).failures)


def test_decide_gate_needs_a_strict_majority_of_positive_batches():
    good = ev_report(batches=4)
    flipped = [dict(b) for b in good["batches"]]
    worse = ev_report(slope=-0.5, batches=4)["batches"]
    flipped[0], flipped[1] = worse[0], worse[1]  # 2 of 4 positive: not a strict majority
    decision = decide_gate({"split": "heldout", "batches": flipped})
    assert not decision.passed and any("positive-EV batches 2 of 4" in f for f in decision.failures)


def test_undefined_ev_fails_the_gate_with_the_reason_never_a_silent_value():
    """Covers what `SuffStats.ev_or_none` (removed) was tested for: an undefined EV is never a
    number or a None that a caller could mistake for a verdict; the gate fails and says why."""
    empty = {
        "split": "heldout",
        "batches": [{"token": {"stats": SuffStats().to_json()}, "trajectory": {"stats": SuffStats().to_json()}}],
    }
    decision = decide_gate(empty)
    assert not decision.passed and decision.weightings == {}
    assert all("n = 0" in f for f in decision.failures[:2])
    assert not decide_gate({"split": "heldout"}).passed
    assert "no per-batch statistics" in decide_gate({"split": "heldout", "batches": []}).failures[0]


# ---- reuse: only a sha the lineage recorded when it published


def rec(sha, *, contract="c" * 64, path="r.json", evaluated=True):
    return ReportRecord(contract_sha256=contract, report_path=path, report_sha256=sha, evaluated=evaluated)


def test_lineage_sha_is_the_newest_evaluated_record_of_this_contract_and_path():
    records = [
        rec("f" * 64, evaluated=False),
        rec("1" * 64, contract="e" * 64),
        rec("2" * 64, path="other.json"),
        rec("3" * 64),
        rec("4" * 64),
    ]
    assert lineage_report_sha(records, contract_sha256="c" * 64, report_path="r.json") == "3" * 64
    assert lineage_report_sha(records[:3], contract_sha256="c" * 64, report_path="r.json") is None


def test_reuse_only_the_recorded_sha(tmp_path):
    path = tmp_path / "ev.json"
    assert decide_reuse(path, None) is False  # nothing there: evaluate
    sha = publish_once(path, b'{"a":1}\n')
    assert decide_reuse(path, sha) is True
    with pytest.raises(InputError, match=r"did not record \(recorded: none\).*Remove it and ev.json.sha256"):
        decide_reuse(path, None)
    with pytest.raises(InputError, match="proves nothing"):
        decide_reuse(path, "b" * 64)


def test_a_report_without_its_sidecar_is_evaluated_again_not_reused_nor_refused(tmp_path):
    path = tmp_path / "ev.json"
    path.write_bytes(b'{"a":1}\n')  # what a full disk between report and sidecar left (older code)
    assert decide_reuse(path, None) is False
    (tmp_path / "ev.json.sha256").write_text("0" * 64 + "  ev.json\n")  # disagrees with its file
    with pytest.raises(InputError, match="cannot trust"):
        decide_reuse(path, None)


# ---- promotion


@pytest.fixture
def published(tmp_path):
    """A contracted save (written by the core), its passing report, and the lineage's records of both."""
    critic = tmp_path / "critic"
    plan = build_plan(8, 4, 1, 0)
    save = critic / iter_dirname(plan.num_steps)
    save.mkdir(parents=True)
    (save / "common.pt").write_bytes(b"stand-in")
    write_contract(
        critic,
        build_contract(
            manifest_sha256=MANIFEST_SHA,
            train_sha256="b" * 64,
            objective=Objective().canonical(),
            plan=plan,
            completed_steps=plan.num_steps,
            model={"backbone": "tiny"},
            backbone_config={},
            checkpoint=str(save),
            checkpoint_files=describe_folder(save),
        ),
    )
    contract = resolve_latest_contract(critic)
    report = tmp_path / "reports" / f"ev-{contract.sha256[:12]}.json"
    sha = write_report(report, ev_report(contract_sha=contract.sha256))
    return contract, report, sha


def write_report(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    for p in (path, path.with_name(path.name + ".sha256")):
        p.unlink(missing_ok=True)
    data = canonical_bytes(obj)
    path.write_bytes(data)
    path.with_name(path.name + ".sha256").write_text(sha256_bytes(data) + "\n")
    return sha256_bytes(data)


def gate(sha, *, passed=True, partition=KEY, blocking=True):
    return GateRecord(partition_key=partition, passed=passed, blocking=blocking, report_sha256=sha, run_id="r1")


def promote(contract, report, recorded, gate_record="same", manifest_sha=MANIFEST_SHA, verify_checkpoint=None):
    return verify_promotion(
        partition_key=KEY,
        manifest_sha256=manifest_sha,
        contract=contract,
        report_path=report,
        recorded_report_sha256=recorded,
        gate=gate(recorded) if gate_record == "same" else gate_record,
        verify_checkpoint=verify_checkpoint,
    )


def test_passing_report_gives_the_record_the_rl_job_pins(published):
    contract, report, sha = published
    record = promote(contract, report, sha)
    assert record["checkpoint"] == str(contract.checkpoint_dir)
    assert record["contract_sha256"] == contract.sha256
    assert record["report_sha256"] == sha == sha256_bytes(report.read_bytes())
    assert record["manifest_sha256"] == MANIFEST_SHA


@pytest.mark.parametrize(
    "gate_record, message",
    [
        (None, "ev_gate has no evaluation"),
        (gate("x", passed=False), "latest ev_gate evaluation failed"),
        (gate("x", partition="other-111111111111"), "another manifest's result never stands for this one"),
        (gate("x", blocking=None), "not blocking"),
        (gate("9" * 64), "ev_gate passed on report '9999"),
    ],
    ids=["no-gate", "gate-failed", "other-partition", "not-blocking", "gate-on-other-sha"],
)
def test_promotion_needs_this_partitions_passed_gate_on_this_very_sha(published, gate_record, message):
    contract, report, sha = published
    if gate_record is not None and gate_record.report_sha256 == "x":
        gate_record = GateRecord(**{**gate_record.__dict__, "report_sha256": sha})
    with pytest.raises(PromotionRefused, match=message):
        promote(contract, report, sha, gate_record=gate_record)


def test_no_recorded_report_is_refused(published):
    contract, report, _ = published
    with pytest.raises(PromotionRefused, match="ev_report recorded no evaluated report"):
        promote(contract, report, None, gate_record=None)


def test_missing_report_is_refused(published):
    contract, report, sha = published
    report.unlink()
    with pytest.raises(PromotionRefused, match="does not exist"):
        promote(contract, report, sha)


def test_report_that_no_longer_hashes_to_its_sidecar_is_refused(published):
    contract, report, sha = published
    report.write_bytes(report.read_bytes().replace(b'"passed":true', b'"passed":true '))
    with pytest.raises(PromotionRefused, match="sidecar records"):
        promote(contract, report, sha)


def test_gate_passed_on_x_but_the_file_now_holds_y_is_refused(published):
    """A republished file that agrees with its own sidecar and passes every file rule still is not
    the report the lineage recorded and gated."""
    contract, report, sha = published
    other = write_report(report, ev_report(contract_sha=contract.sha256, slope=0.9))
    assert other != sha and decide_gate(ev_report(contract_sha=contract.sha256, slope=0.9)).passed
    with pytest.raises(PromotionRefused, match=f"but {sha} was expected"):
        promote(contract, report, sha)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"passed": False}, "did not pass"),
        ({"contract_sha256": "c" * 64}, "not the one being promoted"),
        ({"split": "train"}, "only heldout"),
    ],
    ids=["failed-gate", "other-contract", "train-split"],
)
def test_recorded_and_gated_report_that_breaks_a_rule_is_refused(published, changes, message):
    contract, report, _ = published
    sha = write_report(report, ev_report(contract_sha=contract.sha256) | changes)
    with pytest.raises(PromotionRefused, match=message):
        promote(contract, report, sha)


def test_failed_report_is_refused_even_when_it_claims_to_pass(published):
    contract, report, _ = published
    sha = write_report(report, ev_report(contract_sha=contract.sha256, slope=-0.5) | {"passed": True})
    with pytest.raises(PromotionRefused, match="did not pass.*aggregate EV"):
        promote(contract, report, sha)


def test_report_of_another_manifest_is_refused(published):
    contract, report, sha = published
    with pytest.raises(PromotionRefused, match="names manifest"):
        promote(contract, report, sha, manifest_sha="d" * 64)


def test_symlinked_report_is_refused(published, tmp_path):
    contract, report, sha = published
    real = tmp_path / "elsewhere.json"
    os.replace(report, real)
    report.symlink_to(real)
    with pytest.raises(PromotionRefused, match="symlink"):
        promote(contract, report, sha)


def test_checkpoint_verification_hook_is_called_and_its_refusal_refuses(published):
    contract, report, sha = published
    seen = []
    promote(contract, report, sha, verify_checkpoint=lambda step_dir, c: seen.append((step_dir, c)))
    assert seen == [(contract.checkpoint_dir, contract.contract)]

    def refuse(step_dir, c):
        raise InputError(str(step_dir / "model.safetensors"), "sha256 differs from the contract's")

    with pytest.raises(PromotionRefused, match="checkpoint does not match its contract.*model.safetensors"):
        promote(contract, report, sha, verify_checkpoint=refuse)


def test_latest_pointer_must_name_the_recorded_contract(published):
    contract, _, _ = published
    critic = contract.path.parent.parent
    assert resolve_latest_contract(critic, pinned_sha256=contract.sha256).path == contract.path
    with pytest.raises(InputError, match="lineage recorded"):
        resolve_latest_contract(critic, pinned_sha256="e" * 64)


def test_no_contracted_save_is_refused(tmp_path):
    with pytest.raises(InputError, match="no contracted save"):
        resolve_latest_contract(tmp_path / "critic")


@pytest.mark.parametrize("tamper", ["modify", "add", "remove"])
def test_promotion_refuses_a_save_whose_files_differ_from_its_contract(published, tamper):
    """The real `verify_checkpoint` (the one `promoted_critic` passes): a modified, extra or
    missing file of the save refuses promotion, naming the file."""
    from value_assets.core.checkpoint_files import verify_checkpoint
    from value_assets.core.promotion import PromotionRefused

    contract, report, sha = published
    save = contract.checkpoint_dir
    promote(contract, report, sha, verify_checkpoint=verify_checkpoint)  # untouched: promoted
    if tamper == "modify":
        (save / "common.pt").write_bytes(b"stand-iN")
    elif tamper == "add":
        (save / "extra.distcp").write_bytes(b"x")
    else:
        (save / "common.pt").unlink()
    with pytest.raises(PromotionRefused, match="common.pt|extra.distcp"):
        promote(contract, report, sha, verify_checkpoint=verify_checkpoint)
