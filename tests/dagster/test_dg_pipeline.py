"""The asset graph run for real: sensor -> full job with the Pipes stand-in in a subprocess.

Covers the launcher plumbing (extras in, metadata and data versions out), the blocking gate,
promotion, two-manifest isolation, a silent job, a failing job, the canary and the evaluation job.
"""

import json

import pytest
from dagster import AssetKey

from tests.dagster.conftest import tick
from value_assets.core.job_configs import TrainJob, field_default
from value_assets.core.progress import parse_progress, report_every
from value_assets.lineage import Lineage

pytestmark = pytest.mark.integration


def spec(**sections):
    """A training spec of the tiny backbone with these sections (docs/rules.md#training-spec)."""
    return {"schema": "value-assets.training.v1", "backbone": "tiny", **sections}


def run(defs, job, instance, key, config=None):
    return defs.resolve_job_def(job).execute_in_process(
        instance=instance, partition_key=key, raise_on_error=False, run_config=config or {}
    )


def gate(result):
    return {e.asset_key.to_user_string(): e for e in result.get_asset_check_evaluations() if e.check_name == "ev_gate"}


def test_full_job_trains_evaluates_gates_and_promotes(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register
):
    path = write_manifest(manifests_dir, "good", standin={"ev": 0.3})
    (key,) = register(instance, test_resources, path)
    result = run(test_defs, "full", instance, key)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    materialized = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert materialized == {
        "value_manifest",
        "train_dataset",
        "heldout_dataset",
        "batch_plan",
        "critic_checkpoint",
        "training_contract",
        "ev_report",
        "promoted_critic",
    }
    checks = {(e.asset_key.to_user_string(), e.check_name): e.passed for e in result.get_asset_check_evaluations()}
    assert checks == {
        ("train_dataset", "dataset_integrity"): True,
        ("heldout_dataset", "dataset_integrity"): True,
        ("training_contract", "contract_integrity"): True,
        ("ev_report", "ev_gate"): True,
    }

    ckpt = Lineage(instance, key).metadata("critic_checkpoint")
    plan_steps = Lineage(instance, key).metadata("batch_plan")["steps"]
    assert plan_steps >= 1 and ckpt["steps"] == plan_steps  # job-reported
    assert isinstance(ckpt["final_loss"], float) and ckpt["loss_summary"]["logged_steps"] == plan_steps
    assert ckpt["plot_training_curve"].startswith("![training_curve](data:image/png;base64,")
    assert str(ckpt["tensorboard"]).endswith(f"{key}/critic/tensorboard") and "loss_curve" not in ckpt
    contract_sha = ckpt["contract_sha256"]
    report = Lineage(instance, key).metadata("ev_report")
    assert report["token_ev"] == pytest.approx(0.3) and report["trajectory_ev"] == pytest.approx(0.3)
    assert (
        report["token_positive_batches"] == report["token_batches"] == 8
        and report["auroc"] > 0.5
        and report["trajectory_r2"] is not None
    )
    assert report["plot_calibration"].startswith("![calibration](data:image/png;base64,")
    assert report["plot_ev_by_position"].startswith("![ev_by_position](data:image/png;base64,")
    assert report["gate_mode"] == "miles" and report["token_ev_low"] == pytest.approx(0.3)
    assert str(report["report_path"]).endswith(f"reports/ev-{contract_sha[:12]}.json")
    assert report["manifest_sha256"] == Lineage(instance, key).metadata("value_manifest")["manifest_sha256"]

    record = json.loads((tmp_path / "artifacts" / "registry" / f"{key}.json").read_text())
    assert record["contract_sha256"] == contract_sha and record["report_sha256"] == report["report_sha256"]
    assert record["manifest_sha256"] == Lineage(instance, key).metadata("value_manifest")["manifest_sha256"]

    # Data versions are the artifacts' shas.
    versions = (
        {
            k: instance.get_latest_data_version_record(AssetKey(k), partition_key=key)
            for k in ("batch_plan", "training_contract", "ev_report")
        }
        if hasattr(instance, "get_latest_data_version_record")
        else {}
    )
    for name, rec in versions.items():
        assert rec is not None, name


def test_training_progress_reaches_the_event_log_and_the_run_is_tagged(
    instance, test_defs, test_resources, manifests_dir, write_manifest, register
):
    path = write_manifest(
        manifests_dir, "long", standin={"ev": 0.3}, training=spec(plan={"global_batch_size": 1, "epochs": 3})
    )
    (key,) = register(instance, test_resources, path)
    result = run(test_defs, "full", instance, key)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    plan_steps = Lineage(instance, key).metadata("batch_plan")["steps"]
    every = report_every(plan_steps)
    assert plan_steps == 96 and every == 3

    # The job's progress lines are in the instance's event log: the first, every K-th and the last step.
    progress = [p for e in instance.all_logs(result.run_id) if (p := parse_progress(e.user_message))]
    assert [p["step"] for p in progress] == [1, *range(every, plan_steps + 1, every)]
    assert all(p["planned_steps"] == plan_steps and p["tokens_per_s"] == 1234.5 for p in progress)
    ckpt = Lineage(instance, key).metadata("critic_checkpoint")
    assert progress[-1]["loss"] == pytest.approx(ckpt["final_loss"], abs=1e-6)

    # The run carries what it launched: backbone, GPUs, launcher.
    tags = instance.get_run_by_id(result.run_id).tags
    assert {k: tags.get(k) for k in ("value_assets/backbone", "value_assets/gpus", "value_assets/launcher")} == {
        "value_assets/backbone": field_default(TrainJob, "backbone"),
        "value_assets/gpus": "1",
        "value_assets/launcher": "subprocess",
    }


def test_two_manifests_are_isolated(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register
):
    good = write_manifest(manifests_dir, "good", standin={"ev": 0.3})
    bad = write_manifest(manifests_dir, "bad", standin={"ev": -0.2})
    good_key, bad_key = register(instance, test_resources, good, bad)
    bad_run = run(test_defs, "full", instance, bad_key)
    assert not bad_run.success
    assert gate(bad_run)["ev_report"].passed is False
    assert "promoted_critic" not in {e.asset_key.to_user_string() for e in bad_run.get_asset_materialization_events()}
    assert (tmp_path / "artifacts" / "reports").exists() is False
    assert (tmp_path / "artifacts" / bad_key / "reports").is_dir()  # a failing gate still publishes its report

    good_run = run(test_defs, "full", instance, good_key)
    assert good_run.success and gate(good_run)["ev_report"].passed is True
    assert (tmp_path / "artifacts" / "registry" / f"{good_key}.json").exists()
    assert not (tmp_path / "artifacts" / "registry" / f"{bad_key}.json").exists()

    # Forcing promotion of the failed manifest alone (no gate in the run) is still refused,
    # and the other manifest's pass does not stand in for it.
    forced = test_defs.get_implicit_global_asset_job_def().execute_in_process(
        instance=instance, partition_key=bad_key, asset_selection=[AssetKey("promoted_critic")], raise_on_error=False
    )
    assert not forced.success
    failure = next(e for e in forced.all_events if e.event_type_value == "STEP_FAILURE")
    assert "latest ev_gate evaluation failed" in str(failure.event_specific_data.user_failure_data)
    assert not (tmp_path / "artifacts" / "registry" / f"{bad_key}.json").exists()


def test_job_that_reports_nothing_fails_the_step(
    instance, test_defs, test_resources, manifests_dir, write_manifest, register
):
    (key,) = register(instance, test_resources, write_manifest(manifests_dir, "quiet", standin={"silent": True}))
    result = run(test_defs, "full", instance, key)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert failure.step_key == "critic_training"
    assert "without reporting a materialization" in str(failure.event_specific_data.user_failure_data.description)


def test_job_that_exits_nonzero_fails_the_step(
    instance, test_defs, test_resources, manifests_dir, write_manifest, register
):
    (key,) = register(instance, test_resources, write_manifest(manifests_dir, "crash", standin={"exit_code": 3}))
    result = run(test_defs, "full", instance, key)
    assert not result.success
    assert next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE").step_key == "critic_training"
    assert Lineage(instance, key).metadata("training_contract") is None


def test_manifest_without_heldout_trains_but_is_never_promoted(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register
):
    (key,) = register(instance, test_resources, write_manifest(manifests_dir, "noheld", heldout_rows=None))
    result = run(test_defs, "full", instance, key)
    assert not result.success
    assert "heldout" in gate(result)["ev_report"].description
    assert not (tmp_path / "artifacts" / "registry" / f"{key}.json").exists()


def test_canary_runs_one_step_and_is_not_promotable(
    instance, test_defs, test_resources, manifests_dir, tmp_path, write_manifest, register
):
    (key,) = register(instance, test_resources, write_manifest(manifests_dir, "canary"))
    result = run(test_defs, "canary", instance, key)
    assert result.success
    receipt = Lineage(instance, key).metadata("canary_receipt")
    assert receipt["executed_steps"] == 1 and receipt["promotable"] is False
    assert not (tmp_path / "artifacts" / key / "critic").exists()
    assert not (tmp_path / "artifacts" / "registry").exists()


def test_evaluation_job_reuses_the_published_report(
    instance, test_defs, test_resources, manifests_dir, write_manifest, register
):
    (key,) = register(instance, test_resources, write_manifest(manifests_dir, "again", standin={"ev": 0.5}))
    assert run(test_defs, "full", instance, key).success
    first = Lineage(instance, key).metadata("ev_report")
    again = run(test_defs, "evaluate", instance, key)
    assert again.success and gate(again)["ev_report"].passed
    second = Lineage(instance, key).metadata("ev_report")
    assert second["reused"] is True and second["report_sha256"] == first["report_sha256"]


def test_the_training_spec_reaches_the_job_and_a_run_config_may_only_restate_it(
    instance, test_defs, test_resources, manifests_dir, write_manifest, register
):
    """docs/rules.md#training-spec: the lineage's spec decides the plan, the training and the gate;
    the sensor's run request states it as run config; a run config that differs is refused by name
    before anything is launched."""
    training = spec(
        plan={"global_batch_size": 4, "epochs": 2, "seed": 17},
        train={"save_interval": 2, "lr": 3e-4},
        gate={"mode": "interval", "min_ev": 0.001},
    )
    write_manifest(manifests_dir, "cfg", rows=16, heldout_rows=32, training=training)
    result_of_tick = tick(instance, test_resources)
    (request,) = result_of_tick.run_requests
    key = request.partition_key
    assert request.run_config["ops"]["critic_training"]["config"] == {
        "save_interval": 2,
        "lr": 3e-4,
        "backbone": "tiny",
    }
    changed = {"ops": {"critic_training": {"config": {"lr": 1e-3}}}}
    refused = run(test_defs, "full", instance, key, {"ops": {**request.run_config["ops"], **changed["ops"]}})
    failure = next(e for e in refused.all_events if e.is_step_failure and e.step_key == "critic_training")
    assert "run config lr: 0.001 differs from the lineage's training spec (0.0003)" in str(
        failure.event_specific_data.error
    )
    assert not (test_resources["artifacts"].critic_dir(key)).exists()
    result = run(test_defs, "full", instance, key, request.run_config)
    assert result.success
    # The stricter gate mode reached the evaluation, and ev_gate decided in it.
    report = Lineage(instance, key).metadata("ev_report")
    assert (report["gate_mode"], report["gate_min_ev"]) == ("interval", 0.001) and gate(result)["ev_report"].passed
    assert Lineage(instance, key).metadata("batch_plan")["steps"] == 8
    checkpoint = Lineage(instance, key).metadata("critic_checkpoint")
    assert checkpoint["completed_steps"] == 8
    # The job received the spec's settings as a TrainJob (set fields as given, the rest its defaults).
    job = TrainJob.from_json(checkpoint["standin_config"])
    assert (job.global_batch_size, job.epochs, job.seed, job.save_interval, job.lr) == (4, 2, 17, 2, 3e-4)
    assert job.manifest_sha256 == Lineage(instance, key).metadata("value_manifest")["manifest_sha256"]
    defaults = TrainJob(manifest="m", output="o")
    assert (job.gpus, job.warmup_steps, job.micro_batch_tokens) == (
        defaults.gpus,
        defaults.warmup_steps,
        defaults.micro_batch_tokens,
    )


def test_invalid_run_config_fails_before_launch(
    instance, test_defs, test_resources, manifests_dir, write_manifest, register, tmp_path
):
    """A spec with a bad value never becomes a lineage: the sensor refuses it by name, with the
    job config's own rule."""
    path = write_manifest(manifests_dir, "badcfg", training=spec(train={"warmup_steps": -5}))
    result = tick(instance, test_resources)
    assert not result.run_requests
    assert f"{path}: training.train.warmup_steps: must be an integer >= 0, got -5" in result.skip_reason.skip_message
    assert not (tmp_path / "artifacts").exists()


@pytest.mark.parametrize("tamper", ["steps", "steps-and-sidecar"])
def test_training_trains_on_the_published_plan_and_refuses_a_changed_one_before_launch(
    instance, test_defs, test_resources, manifests_dir, write_manifest, register, tmp_path, tamper
):
    """The published plan is the training input: the job gets its path and the sha batch_plan
    recorded, and trains on exactly it (the contract names that sha). A plan file changed after
    publication (even with a matching sidecar) is refused by critic_training before anything is
    launched."""
    from value_assets.core.hashing import sha256_bytes
    from value_assets.core.publish import sha_sidecar

    path = write_manifest(
        manifests_dir, "planned", rows=16, heldout_rows=32, training=spec(plan={"global_batch_size": 4, "seed": 3})
    )
    (key,) = register(instance, test_resources, path)
    assert (
        test_defs.resolve_job_def("full")
        .execute_in_process(
            instance=instance,
            partition_key=key,
            asset_selection=[AssetKey("batch_plan"), AssetKey("value_manifest"), AssetKey("train_dataset")],
        )
        .success
    )
    published = Lineage(instance, key).plan()
    plan = json.loads(published.path.read_bytes())
    plan["steps"][0], plan["steps"][1] = plan["steps"][1], plan["steps"][0]  # same rows, another order
    forged = json.dumps(plan, sort_keys=True, separators=(",", ":")).encode() + b"\n"
    published.path.write_bytes(forged)
    if tamper == "steps-and-sidecar":
        sha_sidecar(published.path).write_text(sha256_bytes(forged) + "\n")
    result = test_defs.resolve_job_def("full").execute_in_process(
        instance=instance,
        partition_key=key,
        raise_on_error=False,
        asset_selection=[AssetKey("critic_checkpoint"), AssetKey("training_contract")],
    )
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure and e.step_key == "critic_training")
    message = str(failure.event_specific_data.error)
    assert str(published.path) in message and published.sha256 in message
    assert not (tmp_path / "artifacts" / key / "critic").exists()  # nothing launched, nothing written


def test_the_contract_names_the_published_plan_the_job_was_given(
    instance, test_defs, test_resources, manifests_dir, write_manifest, register
):
    path = write_manifest(
        manifests_dir, "bound", rows=16, heldout_rows=32, training=spec(plan={"global_batch_size": 8})
    )
    (key,) = register(instance, test_resources, path)
    assert run(test_defs, "full", instance, key).success
    lineage = Lineage(instance, key)
    job = TrainJob.from_json(lineage.metadata("critic_checkpoint")["standin_config"])
    assert (job.plan, job.plan_sha256) == (lineage.plan().path, lineage.plan().sha256)
    assert lineage.metadata("critic_checkpoint")["batch_plan_sha256"] == lineage.plan().sha256
