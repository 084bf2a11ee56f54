"""Champion and challenger through the real graph (docs/rules.md#champion): lineages of one family,
each trained and evaluated by the Pipes stand-in (critic values V = aR + (1 - a)/2 with the EV its
manifest asks for, the champion's likewise), gated by the real `ev_gate` and promoted by the real
`promoted_critic`. No champion, better, worse, within tolerance, and a warm start from the champion."""

import pytest
from dagster import AssetKey

from tests.dagster.conftest import tick
from value_assets.core.contract import load_contract, read_latest
from value_assets.lineage import Lineage

pytestmark = pytest.mark.integration


def spec(**extra):
    return {"schema": "value-assets.training.v1", "backbone": "tiny", "family": "fam", **extra}


def lineage(instance, defs, resources, manifests_dir, write_manifest, name, ev, **extra):
    """Write, register and run the full job of one lineage; its partition key and run result."""
    write_manifest(manifests_dir, name, standin={"ev": ev}, training=spec(**extra))
    (request,) = tick(instance, resources).run_requests
    result = defs.resolve_job_def("full").execute_in_process(
        instance=instance, partition_key=request.partition_key, run_config=request.run_config, raise_on_error=False
    )
    return request.partition_key, result


def gate_of(result):
    return next(e for e in result.get_asset_check_evaluations() if e.check_name == "ev_gate")


def test_a_family_keeps_its_champion_until_a_challenger_is_not_worse(
    instance, test_defs, test_resources, manifests_dir, write_manifest
):
    first, run = lineage(instance, test_defs, test_resources, manifests_dir, write_manifest, "a", 0.3)
    assert run.success and "champion_partition" not in Lineage(instance, first).metadata("ev_report")  # none yet
    assert Lineage(instance, first).metadata("promoted_critic")["family"] == "fam"

    better, run = lineage(instance, test_defs, test_resources, manifests_dir, write_manifest, "b", 0.5)
    assert run.success, [e.message for e in run.all_events if e.is_failure]
    shown = Lineage(instance, better).metadata("ev_report")
    assert shown["champion_partition"] == first and shown["champion_token_ev"] == pytest.approx(0.3)
    assert shown["token_ev"] == pytest.approx(0.5) and shown["vs_champion_token_ev_delta_low"] == pytest.approx(0.2)
    assert Lineage(instance, better).metadata("promoted_critic") is not None  # the new champion

    # The beaten lineage promoted again (the UI allows re-materializing it; it is idempotent) does not
    # come back as the champion: a critic's first promotion decides (it used to be the latest).
    again = test_defs.get_implicit_global_asset_job_def().execute_in_process(
        instance=instance, partition_key=first, asset_selection=[AssetKey("promoted_critic")], raise_on_error=False
    )
    assert again.success and Lineage(instance, first).metadata("promoted_critic")["handoff_reused"] is True
    assert Lineage(instance, "other").champion("fam").partition_key == better

    worse, run = lineage(instance, test_defs, test_resources, manifests_dir, write_manifest, "c", 0.2)
    assert not run.success and not gate_of(run).passed  # the gate alone would pass an EV of 0.2
    failures = gate_of(run).metadata["failures"].value
    assert any("champion rule, token-weighted" in f and repr(better) in f for f in failures), failures
    assert Lineage(instance, worse).metadata("promoted_critic") is None

    close, run = lineage(
        instance, test_defs, test_resources, manifests_dir, write_manifest, "d", 0.47, champion={"tolerance": 0.05}
    )
    assert run.success, [e.message for e in run.all_events if e.is_failure]  # 0.03 below, within 0.05
    assert Lineage(instance, close).metadata("ev_report")["champion_partition"] == better


def test_a_warm_start_trains_from_the_champions_pinned_save(
    instance, test_defs, test_resources, manifests_dir, write_manifest
):
    first, run = lineage(instance, test_defs, test_resources, manifests_dir, write_manifest, "a", 0.3)
    assert run.success
    champion = Lineage(instance, first).metadata("promoted_critic")
    second, run = lineage(
        instance, test_defs, test_resources, manifests_dir, write_manifest, "b", 0.4, champion={"warm_start": True}
    )
    assert run.success, [e.message for e in run.all_events if e.is_failure]
    critic_dir = test_resources["artifacts"].critic_dir(second)
    step_dir, sha = read_latest(critic_dir)
    contract, _ = load_contract(step_dir, sha)
    assert contract["warm_start"]["contract_sha256"] == champion["contract_sha256"]
    assert (
        contract["training_spec_sha256"]
        == Lineage(instance, second).metadata("promoted_critic")["training_spec_sha256"]
    )
