"""The Dagster run configs stand for the job configs: no second default, no second rule; and the
job config, not an argument vector, is what crosses the Pipes boundary."""

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


def test_empty_run_config_gives_the_job_defaults_and_the_published_plan():
    manifest = SimpleNamespace(path=Path("/m.json"), sha256=SHA)
    g, epochs, seed = plan_settings(PlanConfig())
    assert (g, epochs, seed) == tuple(field_default(TrainJob, n) for n in ("global_batch_size", "epochs", "seed"))
    job = train_job(TrainRunConfig(), manifest, Path("/out"), PUBLISHED, build_plan(64, g, epochs, seed))
    assert job == TrainJob(
        manifest="/m.json", output="/out", manifest_sha256=SHA, plan="/a/plan.json", plan_sha256="ef" * 32
    )
    set_ = train_job(
        TrainRunConfig(lr=3e-4, gpus=2),
        manifest,
        Path("/out"),
        PUBLISHED,
        build_plan(8, 4, 2, 17),
        [Path("/data")],
        canary=True,
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


def test_run_config_values_are_checked_by_the_job_config():
    manifest = SimpleNamespace(path=Path("/m.json"), sha256=SHA)
    with pytest.raises(InputError, match="got -5") as err:
        train_job(TrainRunConfig(warmup_steps=-5), manifest, Path("/out"), PUBLISHED, build_plan(4, 4, 1, 0))
    assert err.value.where == "warmup_steps"
    with pytest.raises(InputError) as err:
        EvaluateJob(
            checkpoint="c",
            manifest="m",
            contract_sha256=SHA,
            report="r",
            **given(EvaluateRunConfig(global_batch_size=1)),
        )
    assert err.value.where == "global_batch_size"


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
