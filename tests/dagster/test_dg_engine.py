"""The asset graph with the real GPU job: local subprocess launcher, real Pipes, real local Ray,
the tiny backbone on CPU. Two manifests in one instance: the learnable demo data is promoted, its
shuffled-label control is stopped by the blocking gate, and neither lineage touches the other.
Metadata is checked against the files themselves.

Size and gate: 1024 train rows (32 steps of G = 32) and the gate in "interval" mode. The control's
critic predicts a near-constant, so its EV is ~0 +- 1e-4 and the "miles" criteria alone (EV > 0, a
majority of positive batches) refuse it only by chance: measured, it passed them for data seed 2
(1024 rows) and for 512 rows at G = 16, and failed them at 2048 rows / 64 steps with token EV
-0.00000 and 4 of 8 batches. The interval mode's bootstrap lower bound refuses it for a reason (seeds
0-2: lower bounds -1.5e-4 to -5.7e-4), while the learnable critic passes with a wide margin (seed 0:
EV 0.33, lower bound 0.25; seeds 1, 2: lower bounds 0.16, 0.13). This is the suite's one real-engine
negative control (the engine's own tests, tests/job/test_job.py, train only the learnable data)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from value_assets.core.contract import load_contract, read_latest
from value_assets.core.demo_data import DEMO_TRAINING, make_demo_data
from value_assets.core.hashing import sha256_file
from value_assets.core.progress import parse_progress, report_every
from value_assets.core.publish import verify_published
from value_assets.core.strict_json import loads
from value_assets.core.warm_folder import process_alive, read_live
from value_assets.lineage import Lineage

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]
ROWS, STEPS = 1024, 32  # G = 32 (TrainJob's default)


@pytest.fixture
def real_resources(tmp_path, manifests_dir, monkeypatch):
    from value_assets.resources import ArtifactStore, ManifestInbox, SubprocessLauncher

    # The launcher's own warm cluster (the default), in a folder of this test's; no Ray given.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    launcher = SubprocessLauncher(
        command=[sys.executable, "-m", "value_assets.gpu.pipes_job"], warm_dir=str(tmp_path / "warm")
    )
    yield {
        "artifacts": ArtifactStore(root=str(tmp_path / "artifacts")),
        "inbox": ManifestInbox(folder=str(manifests_dir)),
        "launcher": launcher,
    }
    launcher.stop_warm_cluster()


def test_real_engine_promotes_the_learnable_critic_and_the_gate_stops_the_control(
    instance, real_resources, manifests_dir, register, tick, tmp_path, capfd
):
    from value_assets.definitions import make_definitions

    defs = make_definitions(real_resources)
    family = {**DEMO_TRAINING, "family": "demo-critics"}
    good = make_demo_data(manifests_dir, rows=ROWS, seed=0, training=family)
    bad = make_demo_data(manifests_dir, rows=ROWS, seed=0, shuffle_labels=True)
    good_key, bad_key = register(instance, real_resources, good, bad)
    artifacts = Path(real_resources["artifacts"].root)

    # The demo manifests' training spec gates in interval mode (core/demo_data.DEMO_TRAINING).
    bad_run = defs.resolve_job_def("full").execute_in_process(
        instance=instance, partition_key=bad_key, raise_on_error=False
    )
    good_run = defs.resolve_job_def("full").execute_in_process(
        instance=instance, partition_key=good_key, raise_on_error=False
    )

    gate = {
        r: {e.check_name: e.passed for e in run.get_asset_check_evaluations()}
        for r, run in (("good", good_run), ("bad", bad_run))
    }
    assert good_run.success, [e.message for e in good_run.all_events if e.is_failure]
    assert gate["good"] == {"dataset_integrity": True, "contract_integrity": True, "ev_gate": True}
    assert not bad_run.success and gate["bad"]["ev_gate"] is False
    # refused for a reason: no evidence of EV > 0 (the bootstrap interval's lower bound), not a coin flip
    (bad_gate,) = [e for e in bad_run.get_asset_check_evaluations() if e.check_name == "ev_gate"]
    assert "lower bound of the 95% interval" in bad_gate.description, bad_gate.description
    assert (artifacts / "registry" / f"{good_key}.json").is_file()
    assert not (artifacts / "registry" / f"{bad_key}.json").exists()

    reports = {}
    for key, manifest in ((good_key, good), (bad_key, bad)):
        meta = {
            name: Lineage(instance, key).metadata(name)
            for name in (
                "value_manifest",
                "train_dataset",
                "heldout_dataset",
                "batch_plan",
                "critic_checkpoint",
                "training_contract",
                "ev_report",
            )
        }
        # every sha recorded is the sha of the file it names
        assert meta["value_manifest"]["manifest_sha256"] == sha256_file(manifest)
        m = json.loads(Path(manifest).read_text())
        assert (
            meta["train_dataset"]["dataset_sha256"]
            == sha256_file(Path(manifest).parent / m["train"]["path"])
            == m["train"]["sha256"]
        )
        assert meta["heldout_dataset"]["dataset_sha256"] == sha256_file(Path(manifest).parent / m["heldout"]["path"])
        assert meta["batch_plan"]["plan_sha256"] == sha256_file(artifacts / key / "plan" / "plan.json")
        contract_sha = meta["training_contract"]["contract_sha256"]
        step = loads((artifacts / key / "critic" / "latest").read_bytes(), "latest")["iteration"]
        assert (
            contract_sha
            == meta["critic_checkpoint"]["contract_sha256"]
            == sha256_file(artifacts / key / "critic" / step / "value_pretrain_contract.json")
        )
        assert meta["critic_checkpoint"]["steps"] == meta["batch_plan"]["steps"] == STEPS
        report_path = artifacts / key / "reports" / f"ev-{contract_sha[:12]}.json"
        assert meta["ev_report"]["report_sha256"] == sha256_file(report_path)
        report = reports[key] = json.loads(report_path.read_text())
        # the EVs shown are the report's
        assert meta["ev_report"]["token_ev"] == pytest.approx(report["aggregates"]["token"]["ev"], abs=1e-12)
        assert meta["ev_report"]["trajectory_ev"] == pytest.approx(report["aggregates"]["trajectory"]["ev"], abs=1e-12)
        assert report["contract_sha256"] == contract_sha and report["source_manifest_sha256"] == sha256_file(manifest)
        assert report["gate"]["mode"] == "interval"
        assert verify_published(report_path) == meta["ev_report"]["report_sha256"]  # a failing report is published too
    # The control's critic predicts a near-constant (EV ~0 +- 1e-4): every bootstrap lower bound is <= 0.
    bad_report = reports[bad_key]
    assert bad_report["passed"] is False
    assert all(low is not None and low <= 0 for low in bad_report["gate"]["interval_low"].values()), bad_report["gate"]

    # The real job's progress reached the event log live: every step of 32 (K = 1; K > 1 is
    # tests/core/test_progress.py and, through Pipes, tests/dagster/test_dg_pipeline.py).
    assert report_every(STEPS) == 1
    progress = [p for e in instance.all_logs(good_run.run_id) if (p := parse_progress(e.user_message))]
    assert [p["step"] for p in progress] == list(range(1, STEPS + 1))
    ckpt = Lineage(instance, good_key).metadata("critic_checkpoint")
    assert progress[-1]["loss"] == pytest.approx(ckpt["final_loss"], abs=1e-6) and ckpt["tokens_per_s"] > 0
    assert ckpt["plot_training_curve"].startswith("![training_curve](data:image/png;base64,")
    assert Path(str(ckpt["tensorboard"])).is_dir() and ckpt["loss_summary"]["logged_steps"] == STEPS
    # The jobs' stderr (this process's) carries none of megatron-core's warnings.
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if "Warning" in line and "megatron" in line] == []

    record = json.loads((artifacts / "registry" / f"{good_key}.json").read_text())
    assert record["contract_sha256"] == Lineage(instance, good_key).metadata("training_contract")["contract_sha256"]
    assert record["report_sha256"] == Lineage(instance, good_key).metadata("ev_report")["report_sha256"]

    # The hand-off (docs/rules.md#hand-off): a real Miles export of the promoted critic, which core's reader (Miles'
    # rules) accepts at the sha the record pins; every file is the one recorded.
    from value_assets.core.handoff import verify_handoff
    from value_assets.core.miles import read_miles_contract

    miles_dir = artifacts / good_key / "handoff" / "miles"
    assert record["handoff"]["miles"]["dir"] == str(miles_dir)
    miles, miles_sha = read_miles_contract(miles_dir, pinned_sha256=record["handoff"]["miles"]["contract_sha256"])
    assert miles["completed_steps"] == STEPS and (miles_dir / f"iter_{STEPS:07d}" / ".metadata").is_file()
    assert miles["model_identity"] == f"value-assets:tiny-random@{record['contract_sha256']}"
    verify_handoff(record, "registry record")
    assert Lineage(instance, good_key).metadata("promoted_critic")["miles_contract_sha256"] == miles_sha
    assert not (artifacts / bad_key / "handoff" / "miles").exists()

    # A challenger of the same family (docs/rules.md#champion), on the real engine: it warm-starts from
    # the promoted critic's weights (its first step already has a trained critic's loss, not a fresh
    # head's ~ln 51) and is evaluated beside it on its own held-out rows, both loaded by the workers
    # only against their contracts.
    challenger = make_demo_data(
        manifests_dir, rows=256, seed=0, name="demo-again",
        training={**family, "champion": {"warm_start": True, "tolerance": 0.05}},
    )  # fmt: skip
    (request,) = [r for r in tick(instance, real_resources).run_requests if "demo-again" in r.partition_key]
    again_run = defs.resolve_job_def("full").execute_in_process(
        instance=instance, partition_key=request.partition_key, run_config=request.run_config, raise_on_error=False
    )
    assert again_run.success, [e.message for e in again_run.all_events if e.is_failure]
    again = Lineage(instance, request.partition_key)
    step_dir, sha = read_latest(artifacts / request.partition_key / "critic")
    contract, _ = load_contract(step_dir, sha)
    champion_sha = Lineage(instance, good_key).metadata("training_contract")["contract_sha256"]
    assert contract["warm_start"]["contract_sha256"] == champion_sha
    first_loss = json.loads(
        (artifacts / request.partition_key / "critic" / "metrics.jsonl").read_text().splitlines()[0]
    )
    fresh_first = json.loads((artifacts / good_key / "critic" / "metrics.jsonl").read_text().splitlines()[0])
    assert first_loss["loss"] < 0.8 * fresh_first["loss"], (first_loss["loss"], fresh_first["loss"])
    shown = again.metadata("ev_report")
    assert shown["champion_partition"] == good_key and shown["champion_contract_sha256"] == champion_sha
    assert (
        shown["vs_champion_token_ev_delta_low"] >= -0.05
        and again.metadata("promoted_critic")["family"] == "demo-critics"
    )
    assert challenger.is_file()

    # A resume starts only from a save the lineage recorded (docs/rules.md#resume): training again
    # finds the save its first run logged and has nothing to do; the same save rewritten in the folder
    # (other weights, a contract binding them, `latest` pointing at it) is refused before anything loads it.
    from dagster import AssetKey

    from value_assets.core.checkpoint_files import describe_folder
    from value_assets.core.contract import write_contract

    def train_again():
        return defs.get_implicit_global_asset_job_def().execute_in_process(
            instance=instance,
            partition_key=good_key,
            raise_on_error=False,
            asset_selection=[AssetKey("critic_checkpoint"), AssetKey("training_contract")],
        )

    again = train_again()
    assert again.success, [e.message for e in again.all_events if e.is_failure]
    step_dir = artifacts / good_key / "critic" / f"iter_{STEPS:07d}"
    contract, recorded_sha = load_contract(step_dir)
    assert Lineage(instance, good_key).metadata("training_contract")["contract_sha256"] == recorded_sha
    shard = sorted(step_dir.glob("*.distcp"))[-1]
    planted = bytearray(shard.read_bytes())
    planted[-64] ^= 0xFF
    shard.write_bytes(bytes(planted))
    planted_sha = write_contract(step_dir.parent, {**contract, "checkpoint_files": describe_folder(step_dir)})
    refused = train_again()
    assert not refused.success
    said = [r.user_message for r in instance.all_logs(refused.run_id)]
    assert any(f"refusing to resume: its contract {planted_sha} is not one of the" in m for m in said), said[-5:]
    assert Lineage(instance, good_key).metadata("training_contract")["contract_sha256"] == recorded_sha

    # One warm Ray cluster served every GPU step of both runs, and the second and later Ray jobs
    # took the first one's worker processes (no Ray start, no torch/megatron import).
    messages = [e.user_message for run in (bad_run, good_run, again_run) for e in instance.all_logs(run.run_id)]
    joined = {
        m.split("warm Ray cluster ", 1)[1].split(" ", 1)[0] for m in messages if "joins the warm Ray cluster" in m
    }
    assert len(joined) == 1, joined
    ups = [m for m in messages if m.startswith("workers up:")]
    assert len(ups) == 6 and "pool warm (new)" in ups[0] and all("pool warm (reused)" in m for m in ups[1:]), ups
    pids = {
        json.dumps(json.loads(m[len("placement ") :])["ranks"], sort_keys=True)
        for m in messages
        if m.startswith("placement ")
    }
    assert len(pids) == 1  # the same ranks, nodes and worker processes in all six Ray jobs
    launcher = real_resources["launcher"]
    warm = read_live(launcher.warm_folder())
    assert warm is not None and launcher.stop_warm_cluster() and read_live(launcher.warm_folder()) is None
    # stop_warm_cluster waited for its helper (it has ended, though maybe not yet been reaped)
    assert not process_alive(warm.pid, warm.started)
    assert not launcher.stop_warm_cluster()  # nothing serves now
