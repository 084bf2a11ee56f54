"""Issue 9, defects 1 and 7, with real Dagster: a real instance, real job runs, the Pipes stand-in
in a subprocess, real files. Each test forges or breaks what an attacker or a full disk would, then
asserts that nothing is reused or promoted that the lineage did not evaluate and gate (docs/rules.md#promotion), and
that an identical retry after a full disk completes.

The rules themselves are tested without Dagster in tests/core/test_promotion.py.
"""

import json
from pathlib import Path

import numpy as np
import pytest
from dagster import AssetKey, AssetMaterialization, materialize

from value_assets.assets import ALL_ASSETS
from value_assets.core.hashing import sha256_bytes
from value_assets.core.publish import verify_published
from value_assets.core.report import build_report
from value_assets.core.stats import RankReport
from value_assets.core.strict_json import canonical_bytes
from value_assets.lineage import Lineage

pytestmark = pytest.mark.integration
TRAINING = [
    "value_manifest",
    "train_dataset",
    "heldout_dataset",
    "batch_plan",
    "critic_checkpoint",
    "training_contract",
]


def run(defs, job, instance, key):
    return defs.resolve_job_def(job).execute_in_process(instance=instance, partition_key=key, raise_on_error=False)


def run_assets(defs, instance, key, names):
    """The given assets (and their checks) alone, as a user materializing them from the UI would."""
    return defs.get_implicit_global_asset_job_def().execute_in_process(
        instance=instance, partition_key=key, asset_selection=[AssetKey(n) for n in names], raise_on_error=False
    )


def failure(result, step_key: str) -> str:
    """The failure message of one step ("" when that step did not fail)."""
    event = next(
        (e for e in result.all_events if e.event_type_value == "STEP_FAILURE" and e.step_key == step_key), None
    )
    if event is None:
        return ""
    data = event.event_specific_data
    return f"{data.error.message if data.error else ''} {getattr(data.user_failure_data, 'description', '')}"


def gate_passed(result) -> bool | None:
    return next((e.passed for e in result.get_asset_check_evaluations() if e.check_name == "ev_gate"), None)


def forge(path: Path, report: dict) -> str:
    """Replace a report and rewrite its sidecar, as the forger in issue 9 did; return the new sha."""
    data = canonical_bytes(report)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.with_name(path.name + ".sha256").write_text(f"{sha256_bytes(data)}  {path.name}\n")
    return sha256_bytes(data)


def passing_report(contract_sha: str, manifest_sha: str, slope: float = 0.5) -> dict:
    """A self-consistent passing report, per-batch statistics included, with no evaluation behind it."""
    labels = [float(i % 2) for i in range(16)]
    batches = [list(range(k * 4, k * 4 + 4)) for k in range(4)]
    reports = []
    for rows in batches:
        r = [np.full(3, labels[i]) for i in rows]
        v = [slope * x + (1 - slope) / 2 for x in r]
        reports.append([RankReport.from_rows(0, [(i, a, b, np.ones(3)) for i, a, b in zip(rows, r, v, strict=True)])])
    return build_report(
        manifest_sha256=manifest_sha,
        dataset_sha256="d" * 64,
        split="heldout",
        checkpoint="forged",
        contract_sha256=contract_sha,
        dp=1,
        seed=0,
        global_batch_size=4,
        batches=batches,
        rank_reports=reports,
        active_targets=[12] * 4,
        labels=labels,
    )


def shas(instance, key):
    return (
        Lineage(instance, key).metadata("training_contract")["contract_sha256"],
        Lineage(instance, key).metadata("value_manifest")["manifest_sha256"],
    )


def test_forged_report_after_a_failed_gate_is_neither_reused_nor_promoted(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register
):
    (key,) = register(instance, test_resources, write_manifest(manifests_dir, "shuffled", standin={"ev": -0.2}))
    first = run(test_defs, "full", instance, key)
    assert not first.success and gate_passed(first) is False
    genuine = Lineage(instance, key).metadata("ev_report")
    path = Path(genuine["report_path"])
    forged_sha = forge(path, json.loads(path.read_bytes()) | {"passed": True})

    again = run(test_defs, "evaluate", instance, key)
    assert not again.success
    message = failure(again, "ev_report")
    assert str(path) in message and "did not record" in message and "Remove it" in message
    assert Lineage(instance, key).metadata("ev_report")["report_sha256"] == genuine["report_sha256"] != forged_sha

    forced = run_assets(test_defs, instance, key, ["promoted_critic"])
    assert not forced.success and "refused" in failure(forced, "promoted_critic")
    assert not (tmp_path / "artifacts" / "registry" / f"{key}.json").exists()


def test_forged_report_with_forged_statistics_and_no_evaluation_is_refused(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register
):
    (key,) = register(instance, test_resources, write_manifest(manifests_dir, "planted", standin={"ev": -0.2}))
    assert run_assets(test_defs, instance, key, TRAINING).success
    contract_sha, manifest_sha = shas(instance, key)
    path = tmp_path / "artifacts" / key / "reports" / f"ev-{contract_sha[:12]}.json"
    forge(path, passing_report(contract_sha, manifest_sha))

    result = run(test_defs, "evaluate", instance, key)
    assert not result.success and gate_passed(result) is None
    assert "recorded: none" in failure(result, "ev_report")
    assert Lineage(instance, key).metadata("ev_report") is None

    forced = run_assets(test_defs, instance, key, ["promoted_critic"])
    assert not forced.success and "ev_report recorded no evaluated report" in failure(forced, "promoted_critic")
    assert not (tmp_path / "artifacts" / "registry" / f"{key}.json").exists()


@pytest.mark.parametrize("reused", [True, False], ids=["recorded-as-reuse", "recorded-as-evaluated"])
def test_gate_passed_on_one_sha_but_the_file_now_holds_another_is_refused(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register, reused
):
    """The forged file also got into the instance's ev_report record (older code recorded whatever
    file it reused): still, ev_gate passed on the genuine sha only, so promotion refuses."""
    (key,) = register(instance, test_resources, write_manifest(manifests_dir, "good", standin={"ev": 0.3}))
    assert run(test_defs, "full", instance, key).success
    registry = tmp_path / "artifacts" / "registry" / f"{key}.json"
    registry.unlink()
    genuine = Lineage(instance, key).metadata("ev_report")
    path = Path(genuine["report_path"])
    contract_sha, manifest_sha = shas(instance, key)
    other = forge(path, passing_report(contract_sha, manifest_sha, slope=0.8))
    instance.report_runless_asset_event(
        AssetMaterialization(
            asset_key="ev_report",
            partition=key,
            metadata={
                "report_sha256": other,
                "report_path": str(path),
                "contract_sha256": contract_sha,
                **({"reused": True} if reused else {}),
            },
        )
    )

    forced = run_assets(test_defs, instance, key, ["promoted_critic"])
    assert not forced.success
    assert genuine["report_sha256"] in failure(forced, "promoted_critic")
    assert not registry.exists()


def test_another_partitions_passed_gate_does_not_promote_this_one(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register
):
    a, b = register(
        instance,
        test_resources,
        write_manifest(manifests_dir, "alpha", standin={"ev": 0.3}),
        write_manifest(manifests_dir, "beta", standin={"ev": 0.3}),
    )
    assert run(test_defs, "full", instance, a).success
    # b: trained and genuinely evaluated (a passing report), but its own ev_gate never ran.
    assert materialize(
        ALL_ASSETS, selection=TRAINING + ["ev_report"], partition_key=b, instance=instance, resources=test_resources
    ).success
    assert Lineage(instance, b).metadata("ev_report")["passed"] is True

    forced = run_assets(test_defs, instance, b, ["promoted_critic"])
    assert not forced.success and "ev_gate has no evaluation" in failure(forced, "promoted_critic")
    assert not (tmp_path / "artifacts" / "registry" / f"{b}.json").exists()
    assert (tmp_path / "artifacts" / "registry" / f"{a}.json").exists()


def test_full_disk_between_report_and_sidecar_then_the_identical_retry_completes(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register
):
    marker = tmp_path / "enospc-once"
    (key,) = register(
        instance, test_resources, write_manifest(manifests_dir, "disk", standin={"ev": 0.3, "enospc_once": str(marker)})
    )
    first = run(test_defs, "full", instance, key)
    assert not first.success and marker.exists()
    assert next(e for e in first.all_events if e.event_type_value == "STEP_FAILURE").step_key == "ev_report"
    assert not list((tmp_path / "artifacts" / key / "reports").glob("ev-*.json"))  # all or nothing

    retry = run(test_defs, "evaluate", instance, key)
    assert retry.success, [e.message for e in retry.all_events if e.is_failure]
    assert gate_passed(retry) is True
    recorded = Lineage(instance, key).metadata("ev_report")
    assert recorded["reused"] is False and verify_published(recorded["report_path"]) == recorded["report_sha256"]
    assert (tmp_path / "artifacts" / "registry" / f"{key}.json").exists()
