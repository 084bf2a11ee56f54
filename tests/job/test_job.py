"""The GPU job end to end on CPU: local Ray, two workers, the tiny backbone, the demo data.

One Ray cluster serves every run (`ray_cluster`, tests/conftest.py). The learnable run trains once
(the `learned` fixture); the tests that need a real checkpoint reuse its critic folder or train their
own small variants. Refusals that need only a folder with a contract get one from `write_contract`
over an empty save folder (`contracted`), never from a training. The negative control (shuffled
labels refused by the gate's interval lower bound, the failing report still published) trains through
the real engine once in the suite, inside Dagster: tests/dagster/test_dg_engine.py.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from tests.job.jobtest_helpers import quiet, tiny_train_job
from value_assets.core.checkpoint_files import describe_folder
from value_assets.core.contract import (
    CONTRACT_NAME,
    LATEST_NAME,
    build_contract,
    iter_dirname,
    load_contract,
    read_latest,
    write_contract,
)
from value_assets.core.demo_data import make_demo_data
from value_assets.core.errors import InputError
from value_assets.core.job_configs import EvaluateJob, TrainJob
from value_assets.core.publish import verify_published
from value_assets.core.strict_json import canonical_bytes
from value_assets.gpu.drivers.evaluate import evaluate
from value_assets.gpu.drivers.train import RECEIPT_NAME, execution_facts, prepare, train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# The critic must reach this fraction of the generator's Bayes-optimal heldout EV.
FRACTION_OF_OPTIMAL = 0.5
# 1024 demo rows: 32 steps of G = 32, saved every 16. Measured (seed 0, two workers): trajectory EV
# 0.318 of an optimal 0.433 (bound 0.216), token EV 0.326, AUROC 0.84.
ROWS, STEPS, SAVE = 1024, 32, 16


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    return {
        "learnable": make_demo_data(root, rows=ROWS, seed=0),
        "shuffled": make_demo_data(root, rows=ROWS, seed=0, shuffle_labels=True),
    }


def base_cfg(manifest: Path, output: Path, **kw) -> TrainJob:
    return tiny_train_job(manifest, output, **({"save_interval": SAVE} | kw))


@pytest.fixture(scope="module")
def learned(ray_cluster, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("learned") / "critic"
    cfg = base_cfg(data["learnable"], out)
    result = train(cfg, log=quiet)
    report = tmp_path_factory.mktemp("reports") / "ev.json"
    ev = evaluate(
        EvaluateJob(
            checkpoint=out, manifest=data["learnable"], contract_sha256=result.contract_sha256, report=report, gpus=2
        ),
        log=quiet,
    )
    return cfg, result, ev


def test_critic_learns_and_the_gate_passes(learned, data):
    _, result, ev = learned
    optimal = json.loads(Path(data["learnable"]).read_text())["provenance"]["bayes_optimal_trajectory_ev_heldout"]
    agg = ev.report["aggregates"]
    assert result.completed_steps == result.plan_steps == STEPS
    assert result.losses[-1] < result.losses[0]
    assert ev.passed and ev.report["gate"]["token"]["passed"] and ev.report["gate"]["trajectory"]["passed"]
    assert agg["token"]["ev"] > 0.1
    assert agg["trajectory"]["ev"] >= FRACTION_OF_OPTIMAL * optimal, (agg["trajectory"]["ev"], optimal)
    assert agg["auroc"] > 0.7
    # data parallel ranks hold identical weights
    assert len(set(result.state_sha256)) == 1


def test_report_states_position_intervals_and_gate_mode(learned):
    """The per-row statistics the workers return become the position table (whose deciles add up
    to the aggregate token statistics) and the row bootstrap intervals; the published report,
    read back, is decided the same way, also in interval mode."""
    import numpy as np

    from value_assets.core.report import decide_gate

    _, _, ev = learned
    report = json.loads(Path(ev.report_path).read_bytes())
    agg = report["aggregates"]
    deciles = report["position"]["deciles"]
    assert report["position"]["weighting"] == "token" and [d["decile"] for d in deciles] == list(range(10))
    table = np.array([[d["stats"][k] for k in ("n", "sum_r", "sum_r2", "sum_e", "sum_e2")] for d in deciles])
    assert table.sum(axis=0) == pytest.approx(stats_row_of(agg["token"]["stats"]), rel=1e-9, abs=1e-9)
    assert [d["n"] for d in deciles] == table[:, 0].tolist() and all(
        d["n"] > 1 and d["ev"] is not None for d in deciles
    )
    rows = sum(len(b["rows"]) for b in report["batches"])
    for w in ("token", "trajectory"):
        iv = report["intervals"][w]
        assert iv["estimate"] == pytest.approx(agg[w]["ev"], rel=1e-9)
        assert iv["low"] <= iv["estimate"] <= iv["high"]
        assert (iv["level"], iv["resamples"], iv["seed"], iv["units"], iv["unit"]) == (0.95, 2000, 0, rows, "row")
        for b in report["batches"]:
            assert np.sum(b[w]["row_stats"], axis=0) == pytest.approx(stats_row_of(b[w]["stats"]), rel=1e-9, abs=1e-9)
    assert report["gate"]["mode"] == "miles" and decide_gate(report).passed
    assert set(report["plots"]) == {"ev_per_batch", "calibration", "ev_by_position"}
    for plot in report["plots"].values():
        assert Path(ev.report_path).with_name(plot["file"]).read_bytes().startswith(b"\x89PNG")
    strict = {k: v for k, v in report.items() if k != "passed"} | {"gate": {"mode": "interval"}}
    lows = [report["intervals"][w]["low"] for w in ("token", "trajectory")]
    assert decide_gate(strict).passed is all(low > 0 for low in lows)


def stats_row_of(stats: dict) -> list[float]:
    return [stats[k] for k in ("n", "sum_r", "sum_r2", "sum_e", "sum_e2")]


def test_contract_and_report_bind_the_lineage(learned, data):
    cfg, result, ev = learned
    step_dir, sha = read_latest(cfg.output)
    contract, csha = load_contract(step_dir, pinned_sha256=sha)
    assert csha == result.contract_sha256 == ev.report["contract_sha256"]
    assert contract["completed_steps"] == STEPS and contract["checkpoint"] == iter_dirname(STEPS) == "iter_0000032"
    assert contract["source_manifest_sha256"] == result.manifest_sha256 == ev.report["source_manifest_sha256"]
    assert contract["batch_plan_sha256"] == result.plan_sha256
    assert contract["batch_plan"] == {
        "seed": 0,
        "global_batch_size": 32,
        "drop_incomplete_batch": True,
        "algorithm": "miles.epoch_shuffle.v1",
    }
    # one contract per save
    assert (cfg.output / iter_dirname(SAVE) / CONTRACT_NAME).is_file()
    # the report is write-once with its sha beside it, and so are its plots
    assert verify_published(ev.report_path) == ev.report_sha256
    for path in ev.plots.values():
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        verify_published(path)
    assert ev.report["execution"] == {"forward_only": True, "optimizer_steps": 0, "dp": 2}
    # metrics log: one line per step, undefined in-batch EV is null (never 0)
    lines = [json.loads(line) for line in (cfg.output / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert all(line["explained_variance"] is None or isinstance(line["explained_variance"], float) for line in lines)
    assert any((cfg.output / "tensorboard").iterdir())


def _retarget_contract(critic: Path, **changes) -> None:
    """Rewrite the latest contract with `changes` and re-point `latest` at it (a tampered lineage)."""
    step_dir, sha = read_latest(critic)
    contract, _ = load_contract(step_dir, pinned_sha256=sha)
    contract.update(changes)
    data = canonical_bytes(contract)
    (step_dir / CONTRACT_NAME).write_bytes(data)
    import hashlib

    (critic / LATEST_NAME).write_bytes(
        canonical_bytes({"iteration": step_dir.name, "contract_sha256": hashlib.sha256(data).hexdigest()})
    )


@pytest.fixture
def contracted(data, tmp_path):
    """The learnable run's folder as its last save publishes it, without training: the contract the
    job writes (same builder, same fields from `prepare`) over an empty iter_0000032 folder."""
    cfg = base_cfg(data["learnable"], tmp_path / "contracted")
    prep = prepare(cfg, log=quiet)
    step_dir = cfg.output / iter_dirname(prep.plan.num_steps)
    step_dir.mkdir(parents=True)
    (step_dir / "common.pt").write_bytes(b"stand-in: never loaded by the refusal tests")
    write_contract(
        cfg.output,
        build_contract(
            manifest_sha256=prep.manifest.sha256,
            train_sha256=prep.train.sha256,
            objective=prep.manifest.objective.canonical(),
            plan=prep.plan,
            completed_steps=prep.plan.num_steps,
            model=prep.backbone_identity,
            backbone_config=prep.backbone_cfg.to_json(),
            checkpoint=step_dir.name,
            checkpoint_files=describe_folder(step_dir),
            execution=execution_facts(cfg, prep.dp, prep.micro_batch_tokens),
        ),
    )
    return cfg


def test_the_contracted_stand_in_matches_a_trained_folder(contracted, learned):
    """`contracted` binds exactly what training binds: the trained folder's contract, field for field."""
    trained_dir, trained_sha = read_latest(learned[0].output)
    built_dir, built_sha = read_latest(contracted.output)
    assert built_dir.name == trained_dir.name == iter_dirname(STEPS)
    built, trained = (
        load_contract(d, pinned_sha256=sha)[0] for d, sha in ((built_dir, built_sha), (trained_dir, trained_sha))
    )
    # Every field but the file list, which binds the stand-in's one file instead of the real shards.
    assert {k: v for k, v in built.items() if k != "checkpoint_files"} == {
        k: v for k, v in trained.items() if k != "checkpoint_files"
    }
    assert [f["path"] for f in built["checkpoint_files"]] == ["common.pt"] and trained["checkpoint_files"]


@pytest.fixture
def learned_copy(learned, tmp_path):
    cfg, _, _ = learned
    dst = tmp_path / "critic"
    shutil.copytree(cfg.output, dst)
    return replace(cfg, output=dst)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"seed": 1}, "batch plan differs"),
        ({"global_batch_size": 16}, "batch plan differs"),
    ],
)
def test_resume_refuses_another_plan(contracted, change, message):
    with pytest.raises(InputError, match=message):
        prepare(replace(contracted, **change), log=quiet)


def test_resume_refuses_another_manifest(contracted, data):
    with pytest.raises(InputError, match="trained from manifest"):
        prepare(replace(contracted, manifest=data["shuffled"]), log=quiet)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"train_dataset_sha256": "0" * 64}, "trained on train dataset"),
        (
            {
                "objective": {
                    "loss_type": "mse",
                    "num_bins": 51,
                    "reward_range": [0.0, 1.0],
                    "target_type": "hl_gauss",
                    "hl_gauss_sigma_ratio": 0.75,
                }
            },
            "objective differs",
        ),
        ({"completed_steps": 999}, "beyond the plan"),
    ],
)
def test_resume_refuses_a_contract_that_does_not_match(contracted, changes, message):
    _retarget_contract(contracted.output, **changes)
    with pytest.raises(InputError, match=message):
        prepare(contracted, log=quiet)


def test_epochs_may_be_extended(contracted):
    prep = prepare(replace(contracted, epochs=2), log=quiet)
    assert prep.start_step == STEPS and prep.plan.num_steps == 2 * STEPS


def test_uncontracted_checkpoint_is_ambiguous(data, tmp_path):
    out = tmp_path / "critic"
    (out / "iter_0000005").mkdir(parents=True)
    with pytest.raises(InputError, match="has no contract"):
        prepare(base_cfg(data["learnable"], out), log=quiet)


def test_invalid_data_reserves_nothing_and_writes_nothing(data, tmp_path, monkeypatch):
    from value_assets.gpu.workers import cluster

    def refuse(**_):
        raise AssertionError("the cluster must not be reserved for invalid data")

    monkeypatch.setattr(cluster, "start_workers", refuse)
    manifest = json.loads(Path(data["learnable"]).read_text())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"sample_id":"a","tokens":[1,2,3],"response_length":2,"returns":[0.5,2.0]}\n')
    import hashlib

    manifest["train"] = {"path": str(bad), "sha256": hashlib.sha256(bad.read_bytes()).hexdigest(), "num_samples": 1}
    mpath = tmp_path / "bad.json"
    mpath.write_text(json.dumps(manifest))
    out = tmp_path / "critic"
    with pytest.raises(InputError, match=r"bad\.jsonl:1.*returns\[1\] = 2\.0 is outside reward_range"):
        train(base_cfg(mpath, out), log=quiet)
    assert not out.exists()


def test_canary_runs_one_step_and_publishes_a_receipt_not_a_contract(ray_cluster, contracted, data, tmp_path):
    out = tmp_path / "critic"
    result = train(base_cfg(data["learnable"], out, canary=True), log=quiet)
    assert result.completed_steps == 1 and result.contract_sha256 is None
    assert not (out / LATEST_NAME).exists()
    assert not list(out.glob(f"iter_*/{CONTRACT_NAME}"))
    receipt = json.loads((out / RECEIPT_NAME).read_text())
    verify_published(out / RECEIPT_NAME)
    assert receipt["promotable"] is False and receipt["executed_steps"] == 1
    assert receipt["source_manifest_sha256"] == result.manifest_sha256
    assert receipt["batch_plan_sha256"] == result.plan_sha256
    # the canary refuses a folder that already holds a contract
    with pytest.raises(InputError, match="already holds a contracted checkpoint"):
        prepare(replace(contracted, canary=True), log=quiet)


def test_exported_critic_reproduces_the_report(learned, data, tmp_path):
    """export-hf -> transformers token classification; its values give the report's EVs."""
    import torch
    from transformers import AutoModelForTokenClassification

    from value_assets.core.dataset import validate_dataset
    from value_assets.core.manifest import load_manifest
    from value_assets.core.stats import SuffStats, token_stats, trajectory_stats
    from value_assets.gpu.convert.export import export_checkpoint

    cfg, _, ev = learned
    out = export_checkpoint(cfg.output, tmp_path / "hf")
    model = AutoModelForTokenClassification.from_pretrained(str(out)).eval()
    assert model.config.num_labels == 51
    m = load_manifest(data["learnable"])
    ds = validate_dataset(m.heldout, m.objective)
    support = torch.linspace(0.0, 1.0, 51, dtype=torch.float64)
    tok, traj = SuffStats(), SuffStats()
    for batch in ev.report["batch_plan"]["batches"]:
        for i in batch:
            r = ds.row(i)
            with torch.no_grad():
                logits = model(input_ids=torch.as_tensor(r.tokens[:-1])[None]).logits[0].double()
            values = (logits.softmax(-1) @ support).numpy()[r.prompt_length - 1 :]
            tok = tok + token_stats(r.returns, values, r.loss_mask)
            traj = traj + trajectory_stats(r.returns, values, r.loss_mask)
    agg = ev.report["aggregates"]
    assert tok.ev() == pytest.approx(agg["token"]["ev"], abs=2e-3)
    assert traj.ev() == pytest.approx(agg["trajectory"]["ev"], abs=2e-3)


def test_pipeline_parallel_job_matches_one_stage(ray_cluster, data, tmp_path):
    """Two pipeline stages on two workers train the same steps as one stage (two data-parallel
    workers), and the PP=2 checkpoint gives the same report evaluated at PP=2 and re-sharded to one
    stage. Two workers throughout: the session's worker pool keeps its shape (a one-worker job
    would replace it, and the next two-worker job again: fresh processes, torch and megatron
    imported anew; one-worker jobs run in tests/dagster/test_dg_engine.py)."""
    one = train(base_cfg(data["learnable"], tmp_path / "pp1", stop_after=4), log=quiet)
    two = train(base_cfg(data["learnable"], tmp_path / "pp2", pipeline_parallel=2, stop_after=4), log=quiet)
    assert one.completed_steps == two.completed_steps == 4 and two.contract_sha256
    assert len(two.state_sha256) == 2 and two.state_sha256[0] != two.state_sha256[1]  # each stage holds its own layers
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    assert [m["grad_norm"] for m in two.metrics] == pytest.approx([m["grad_norm"] for m in one.metrics], rel=1e-4)
    # Interrupted after 2 steps and resumed at PP=2: bitwise the uninterrupted PP=2 run.
    cut = base_cfg(data["learnable"], tmp_path / "pp2-resumed", pipeline_parallel=2, stop_after=2)
    assert train(cut, log=quiet).completed_steps == 2
    resumed = train(cut, log=quiet)
    assert resumed.resumed_from == 2 and resumed.completed_steps == 4
    assert resumed.losses == two.losses[2:] and resumed.state_sha256 == two.state_sha256

    def ev(result, name, **kw):
        return evaluate(
            EvaluateJob(
                checkpoint=Path(result.critic_dir),
                manifest=data["learnable"],
                contract_sha256=result.contract_sha256,
                report=tmp_path / f"{name}.json",
                **kw,
            ),
            log=quiet,
        ).report["aggregates"]

    # (The one-stage run's parameters equal these within 1e-5: tests/engine checks that.)
    staged = ev(two, "pp2-at-pp2", gpus=2, pipeline_parallel=2)
    resharded = ev(two, "pp2-at-pp1", gpus=2)
    for kind in ("token", "trajectory"):
        assert staged[kind]["ev"] == pytest.approx(resharded[kind]["ev"], abs=1e-6)
        assert staged[kind]["ev"] != 0.0


@pytest.mark.parametrize(
    "kw, flag, message",
    [
        (
            {"gpus": 3, "pipeline_parallel": 3, "global_batch_size": 30},
            "pipeline_parallel",
            "3 stages do not split the backbone's 2 layers evenly",
        ),
        (
            {"gpus": 2, "tensor_parallel": 2, "pipeline_parallel": 2},
            "gpus",
            "not divisible by the model-parallel size tp x pp = 2 x 2 = 4",
        ),
        (
            {"gpus": 3, "tensor_parallel": 3, "global_batch_size": 30},
            "tensor_parallel",
            "3 does not divide the backbone's num_attention_heads",
        ),
    ],
)
def test_model_parallel_layout_is_refused_before_launch(data, tmp_path, monkeypatch, kw, flag, message):
    from value_assets.gpu.workers import cluster

    monkeypatch.setattr(cluster, "start_workers", lambda *_, **__: pytest.fail("the cluster must not be reserved"))
    cfg = replace(base_cfg(data["learnable"], tmp_path / "critic"), **kw)
    with pytest.raises(InputError, match=message) as err:
        train(cfg, log=quiet)
    assert err.value.where == flag
    assert not (tmp_path / "critic").exists()


def _published(folder: Path, plan) -> tuple[Path, str]:
    from value_assets.core.publish import publish_once

    path = folder / "plan.json"
    return path, publish_once(path, plan.to_bytes())


def test_a_published_plan_is_trained_on_exactly_or_refused_before_launch(data, tmp_path, monkeypatch):
    """`TrainJob.plan`: the job reads the published plan against the lineage's sha, checks it was
    made for this train split and these settings, and plans nothing of its own. Every refusal comes
    before any worker is reserved."""
    from value_assets.core.hashing import sha256_bytes
    from value_assets.core.plan import build_plan
    from value_assets.core.publish import sha_sidecar
    from value_assets.gpu.workers import cluster

    monkeypatch.setattr(cluster, "start_workers", lambda *_, **__: pytest.fail("the cluster must not be reserved"))
    path, sha = _published(tmp_path / "a", build_plan(ROWS, 32, 1, 5))
    cfg = base_cfg(data["learnable"], tmp_path / "critic", seed=5, plan=path, plan_sha256=sha)
    prep = prepare(cfg, log=quiet)
    assert prep.plan.sha256 == sha and prep.plan.steps == build_plan(ROWS, 32, 1, 5).steps
    # the file rewritten after publication, sidecar and all: refused by the lineage's pin
    forged = build_plan(ROWS, 32, 1, 6).to_bytes()
    path.write_bytes(forged)
    sha_sidecar(path).write_text(sha256_bytes(forged) + "\n")
    with pytest.raises(InputError, match=f"sha256 is {sha256_bytes(forged)}, but {sha} was expected") as err:
        train(cfg, log=quiet)
    assert err.value.where == str(path)
    # a plan published for another split (other row count) or with other settings than the job's
    other, other_sha = _published(tmp_path / "b", build_plan(ROWS // 2, 32, 1, 5))
    with pytest.raises(InputError, match=f"plans {ROWS // 2} rows, but the validated train split has {ROWS}"):
        train(replace(cfg, plan=other, plan_sha256=other_sha), log=quiet)
    good, good_sha = _published(tmp_path / "c", build_plan(ROWS, 32, 1, 5))
    with pytest.raises(InputError, match="differs from the published plan's 32") as err:
        train(replace(cfg, plan=good, plan_sha256=good_sha, global_batch_size=16), log=quiet)
    assert err.value.where == "global_batch_size"
    assert not (tmp_path / "critic").exists()


def test_evaluation_refuses_a_layout_the_backbone_cannot_take(contracted, data, tmp_path, monkeypatch):
    from value_assets.gpu.workers import cluster

    monkeypatch.setattr(cluster, "start_workers", lambda *_, **__: pytest.fail("the cluster must not be reserved"))
    report = tmp_path / "ev.json"
    with pytest.raises(InputError, match="4 stages do not split the backbone's 2 layers evenly"):
        evaluate(
            EvaluateJob(
                checkpoint=contracted.output,
                manifest=data["learnable"],
                contract_sha256=read_latest(contracted.output)[1],
                report=report,
                gpus=4,
                pipeline_parallel=4,
            ),
            log=quiet,
        )
    assert not report.exists()


# Last in the module: this refusal comes from the loaded workers, and a job that fails ends the
# session's worker pool, so every pooled job after it would start fresh processes (torch and
# megatron imported again) -- the canary and pipeline-parallel tests did, ~10 s.
def test_resume_refuses_an_iteration_the_contract_does_not_name(ray_cluster, learned_copy):
    # The contract says 16 steps, the checkpoint it sits beside holds iteration 32.
    _retarget_contract(learned_copy.output, completed_steps=16)
    with pytest.raises(InputError, match="at iteration 32, but its contract says 16"):
        train(learned_copy, log=quiet)
