"""The code location's executor (`definitions.STEP_EXECUTOR`): Dagster's default executor whose
step processes are forked from a forkserver that has imported the code once, unless the run config
says otherwise. Checked with a real multiprocess run on a persistent instance: each step reports
the command line of its parent process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from dagster import DagsterInstance, Definitions, asset, define_asset_job, execute_job, reconstructable

from value_assets.definitions import (
    STEP_EXECUTOR,
    _forkserver_unless_told,
    make_definitions,
    resources_for,
)

pytestmark = pytest.mark.integration


def report_path(instance: DagsterInstance) -> Path:
    # Not an environment variable: a forkserver already running in this process (another test's)
    # hands its children its own environment, from when it started.
    return Path(instance.root_directory) / "step.json"


@asset
def parent_of_a_step(context) -> None:
    import psutil

    report = {"pid": os.getpid(), "parent": " ".join(psutil.Process(os.getppid()).cmdline())}
    report_path(context.instance).write_text(json.dumps(report))


@asset(deps=[parent_of_a_step])
def parent_of_another_step() -> None:
    pass


def probe_job():
    return Definitions(
        assets=[parent_of_a_step, parent_of_another_step], jobs=[define_asset_job("probe")], executor=STEP_EXECUTOR
    ).resolve_job_def("probe")


def test_the_default_start_method_is_forkserver_and_explicit_settings_are_kept():
    forkserver = {"forkserver": {"preload_modules": ["value_assets.definitions"]}}
    assert _forkserver_unless_told({"multiprocess": {}}) == {"multiprocess": {"start_method": forkserver}}
    assert _forkserver_unless_told({"multiprocess": {"max_concurrent": 2}}) == {
        "multiprocess": {"max_concurrent": 2, "start_method": forkserver}
    }
    assert _forkserver_unless_told({"multiprocess": {"start_method": {"spawn": {}}}}) == {
        "multiprocess": {"start_method": {"spawn": {}}}
    }
    assert _forkserver_unless_told({"in_process": {}}) == {"in_process": {}}
    job = make_definitions(resources_for("local")).resolve_job_def("full")
    assert job.executor_def is STEP_EXECUTOR


def test_the_forkserver_preloads_the_code_location():
    """Named explicitly: left out, Dagster preloads nothing of it (its documented default, the
    job's module, is never used), and every step process imports the graph again."""
    from dagster._config import process_config
    from dagster._core.definitions.executor_definition import multiprocess_executor
    from dagster._core.executor.init import InitExecutorContext

    config = process_config(
        multiprocess_executor.config_schema.config_type, _forkserver_unless_told({"multiprocess": {}})["multiprocess"]
    )
    assert config.success, config.errors
    executor = multiprocess_executor.executor_creation_fn(
        InitExecutorContext(
            job=reconstructable(probe_job),
            executor_def=multiprocess_executor,
            executor_config=config.value,
            instance=DagsterInstance.ephemeral(),
        )
    )
    assert executor._start_method == "forkserver"
    assert executor._explicit_forkserver_preload == ["value_assets.definitions"]


@pytest.mark.parametrize("execution, forked", [(None, True), ({"in_process": {}}, False)])
def test_steps_fork_from_a_forkserver_and_in_process_still_runs_in_the_run_process(tmp_path, execution, forked):
    with DagsterInstance.local_temp(str(tmp_path)) as instance:
        run_config = {"execution": {"config": execution}} if execution else {}
        with execute_job(reconstructable(probe_job), instance=instance, run_config=run_config) as result:
            assert result.success
        step = json.loads(report_path(instance).read_text())
    assert ("forkserver" in step["parent"]) is forked, step
    if not forked:
        assert step["pid"] == os.getpid()
