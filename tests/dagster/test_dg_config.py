"""The Dagster run configs stand for the job configs: no second default, no second rule; and the
job config, not an argument vector, is what crosses the Pipes boundary."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from value_assets.assets.common import given
from value_assets.assets.critic import EvaluateRunConfig, TrainRunConfig, train_job
from value_assets.assets.data import PlanConfig, plan_settings
from value_assets.core import vocabulary as v
from value_assets.core.errors import InputError
from value_assets.core.job_configs import EvaluateJob, TrainJob, field_default, field_doc
from value_assets.core.plan import build_plan
from value_assets.lineage import PublishedPlan
from value_assets.resources.launchers import GpuJobLauncher

pytestmark = pytest.mark.unit
SHA = "cd" * 32


@pytest.mark.parametrize(
    "run_config, job", [(TrainRunConfig, TrainJob), (EvaluateRunConfig, EvaluateJob), (PlanConfig, TrainJob)]
)
def test_run_config_fields_are_job_fields_unset_by_default(run_config, job):
    for name, f in run_config.model_fields.items():
        assert f.default is None, name  # None: the job config's default applies
        assert f.description.startswith(field_doc(job, name)), name
    assert given(run_config()) == {}


PUBLISHED = PublishedPlan(Path("/a/plan.json"), "ef" * 32)


def _spec(**sections):
    from value_assets.core.training_spec import parse_training_spec

    raw = {"schema": "value-assets.training.v1", "backbone": "tiny", **sections}
    return parse_training_spec(raw, base=Path("/manifests"), where="m.json: training")


def test_the_lineage_spec_gives_the_job_its_settings_and_the_published_plan():
    manifest = SimpleNamespace(path=Path("/m.json"), sha256=SHA)
    spec = _spec()
    g, epochs, seed = plan_settings(dict(spec.plan), PlanConfig())
    assert (g, epochs, seed) == tuple(field_default(TrainJob, n) for n in ("global_batch_size", "epochs", "seed"))
    job = train_job(TrainRunConfig(), spec, manifest, Path("/out"), PUBLISHED, build_plan(64, g, epochs, seed))
    assert job == TrainJob(
        manifest="/m.json", output="/out", manifest_sha256=SHA, plan="/a/plan.json", plan_sha256="ef" * 32,
        training_spec_sha256=spec.sha256,
    )  # fmt: skip
    spec = _spec(plan={"global_batch_size": 4, "epochs": 2, "seed": 17}, train={"lr": 3e-4, "gpus": 2})
    plan = build_plan(8, *plan_settings(dict(spec.plan), PlanConfig()))
    set_ = train_job(
        TrainRunConfig(lr=3e-4), spec, manifest, Path("/out"), PUBLISHED, plan, [Path("/data")], canary=True
    )
    assert (set_.lr, set_.gpus, set_.global_batch_size, set_.epochs, set_.seed, set_.canary) == (
        3e-4,
        2,
        4,
        2,
        17,
        True,
    )
    assert (set_.data_roots, set_.plan, set_.plan_sha256) == (("/data",), PUBLISHED.path, PUBLISHED.sha256)
    with pytest.raises(InputError, match="go together") as err:
        TrainJob(manifest="/m.json", output="/out", plan="/a/plan.json")
    assert err.value.where == "plan_sha256"


def test_a_run_config_may_restate_the_spec_but_not_change_it():
    manifest = SimpleNamespace(path=Path("/m.json"), sha256=SHA)
    spec = _spec(train={"lr": 3e-4})
    for changed in (TrainRunConfig(lr=1e-3), TrainRunConfig(gpus=2)):  # set in the spec / left to its default
        with pytest.raises(InputError, match="differs from the lineage's training spec") as err:
            train_job(changed, spec, manifest, Path("/out"), PUBLISHED, build_plan(32, 32, 1, 0))
        assert err.value.where.startswith("run config ")
    with pytest.raises(InputError, match="run config global_batch_size: 8 differs"):
        plan_settings(dict(spec.plan), PlanConfig(global_batch_size=8))


def test_spec_values_are_checked_by_the_job_configs_and_named_as_the_specs():
    from value_assets.core.training_spec import parse_training_spec

    base = {"schema": "value-assets.training.v1", "backbone": "tiny"}
    cases = [
        ({"train": {"warmup_steps": -5}}, "m.json: training.train.warmup_steps", "got -5"),
        ({"plan": {"epochs": 0}}, "m.json: training.plan.epochs", ""),
        ({"evaluate": {"global_batch_size": 1}}, "m.json: training.evaluate.global_batch_size", ""),
        ({"gate": {"mode": "vibes"}}, "m.json: training.gate.mode", "vibes"),
        ({"train": {"lr": 1e-3, "lrate": 1}}, "m.json: training.train", "unknown setting(s) ['lrate']"),
        ({"champion": {"tolerance": 0.01}}, "m.json: training.champion", "needs a family"),
        # an EV difference: refused with the manifest, not after training at ev_report
        ({"family": "f", "champion": {"tolerance": 1.5}}, "m.json: training.champion.tolerance", "must be below 1"),
        ({"family": "f", "champion": {"tolerance": -0.1}}, "m.json: training.champion.tolerance", ""),
        ({"backbone": {"path": "a", "sha256": "nope"}}, "m.json: training.backbone.sha256", "nope"),
        ({"schema": "v0"}, "m.json: training.schema", "v0"),
        ({"train": {"optimizer_offload": 0.5}}, "m.json: training.train.optimizer_offload", "distributed optimizer"),
        (
            {"train": {"distributed_optimizer": True, "optimizer_offload": 2}},
            "m.json: training.train.optimizer_offload",
            "fraction from 0 to 1, got 2",
        ),
    ]
    for extra, where, fragment in cases:
        with pytest.raises(InputError, match=re.escape(fragment)) as err:
            parse_training_spec({**base, **extra}, base=Path("/m"), where="m.json: training")
        assert err.value.where == where, (extra, err.value.where)
    with pytest.raises(InputError, match="is required") as err:
        parse_training_spec({"schema": "value-assets.training.v1"}, base=Path("/m"), where="w")
    assert err.value.where == "w.backbone"
    spec = parse_training_spec({**base, "backbone": {"path": "actors/qwen"}}, base=Path("/m"), where="w")
    assert spec.backbone.spec == "/m/actors/qwen"  # relative to the manifest's folder, like datasets


def job_config(task, config):
    return v.task_named(task).config_from_json(config)


def test_pipes_job_reads_the_config_for_its_task():
    train = TrainJob(manifest="m.json", output="o")
    assert job_config("train", train.to_json()) == train
    canary = TrainJob(manifest="m.json", output="o", canary=True)
    assert job_config("canary", canary.to_json()) == canary
    with pytest.raises(InputError) as err:
        job_config("canary", train.to_json())
    assert err.value.where == "canary"
    with pytest.raises(InputError):
        job_config("train", None)
    evaluation = EvaluateJob(checkpoint="c", manifest="m", contract_sha256=SHA, report="r")
    assert job_config("evaluate", evaluation.to_json()) == evaluation
    with pytest.raises(InputError):
        job_config("evaluate", train.to_json())
    with pytest.raises(InputError, match="must be one of train, canary, evaluate, handoff") as err:
        job_config("retrain", train.to_json())
    assert err.value.where == "task"


class _Recorder(GpuJobLauncher):
    def _invoke(self, context, task, extras):
        context.sent.append(extras)
        return SimpleNamespace(get_results=lambda implicit_materializations: [])


def test_launch_sends_the_config_as_json_and_refuses_a_mismatch():
    logs, sent = [], []
    context = SimpleNamespace(
        log=SimpleNamespace(info=logs.append, warning=logs.append), sent=sent, selected_asset_keys=set()
    )
    train = TrainJob(manifest="m.json", output="o", gpus=2)
    _Recorder().launch(context, v.TRAIN, train, {"partition_key": "p"})
    assert sent == [{"partition_key": "p", "task": "train", "config": train.to_json()}]
    assert '"gpus": 2' in logs[0]
    for task, cfg in (
        (v.CANARY, train),
        (v.EVALUATE, train),
        (v.TRAIN, TrainJob(manifest="m", output="o", canary=True)),
    ):
        with pytest.raises(InputError, match=task.name):
            _Recorder().launch(context, task, cfg)
    assert len(sent) == 1

    # a launcher that does not say how it runs a job cannot be configured, rather than failing at launch
    class Unfinished(GpuJobLauncher):
        pass

    with pytest.raises(TypeError, match="_invoke"):
        Unfinished()


def test_ray_submission_waits_for_a_starting_clusters_job_agent_and_no_longer():
    """Ray refuses a job while the cluster's job agents start ("try again later"): the launcher
    submits again until a deadline; any other refusal is raised at once."""
    from value_assets.resources.launchers import NO_AGENT_YET, submit_when_ready

    now = [0.0]
    logs: list[str] = []

    def sleep(s):
        now[0] += s

    def refusing(times, message=f"Request failed with status code 500: {NO_AGENT_YET}, please try again later.."):
        calls = []

        def submit():
            calls.append(now[0])
            if len(calls) <= times:
                raise RuntimeError(message)
            return "submitted"

        return submit, calls

    submit, calls = refusing(2)
    assert submit_when_ready(submit, log=logs.append, sleep=sleep, clock=lambda: now[0]) == "submitted"
    assert calls == [0.0, 2.0, 4.0] and len(logs) == 2 and "no job agent ready yet" in logs[0]

    submit, calls = refusing(100)
    with pytest.raises(RuntimeError, match=NO_AGENT_YET):
        submit_when_ready(submit, log=logs.append, deadline_s=10, sleep=sleep, clock=lambda: now[0])
    assert len(calls) == 6  # at 0, 2, ..., 10 s, then the deadline

    submit, calls = refusing(1, message="Request failed with status code 400: bad runtime_env")
    with pytest.raises(RuntimeError, match="bad runtime_env"):
        submit_when_ready(submit, log=logs.append, sleep=sleep, clock=lambda: now[0])
    assert len(calls) == 1
