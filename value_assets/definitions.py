"""The code location: one `Definitions` naming every asset, check, job, sensor and resource.

Resources are chosen per deployment by `VALUE_ASSETS_DEPLOYMENT` (`local`, the default; `ray`;
`kubernetes`). Only the GPU-job launcher differs between them; settings come from environment
variables so the same image serves every deployment:

| variable | used by | default |
| --- | --- | --- |
| VALUE_ASSETS_ARTIFACTS | all | `artifacts/` in the project checkout (else the working directory) |
| VALUE_ASSETS_MANIFESTS | all | `manifests/` likewise |
| VALUE_ASSETS_DATA_ROOTS | all | unset: no restriction (`:`-separated folders) |
| VALUE_ASSETS_DEFAULT_TRAINING | all | unset: a manifest without a `training` spec is refused (a spec file's path) |
| VALUE_ASSETS_GPU_COMMAND | local | `<this python> -m value_assets.gpu.pipes_job`; e.g. a GPU venv's python |
| RAY_ADDRESS | ray | required: the Ray dashboard address |
| VALUE_ASSETS_GPU_IMAGE | kubernetes | required: the GPU job image |
| VALUE_ASSETS_K8S_NAMESPACE, VALUE_ASSETS_K8S_PVCS (`claim=/mount,...`), VALUE_ASSETS_GPUS | kubernetes | |

This process never imports torch, megatron or `value_assets.gpu` (tests/dagster/test_dg_layers.py loads it;
tests/test_imports.py checks every module statically).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dagster import Definitions, EnvVar, ExecutorDefinition, multi_or_in_process_executor

from value_assets.assets import ALL_ASSETS
from value_assets.checks import ALL_CHECKS
from value_assets.core.training_spec import DEFAULT_TRAINING_ENV
from value_assets.jobs import ALL_JOBS
from value_assets.resources import ArtifactStore, K8sPodLauncher, ManifestInbox, RayJobLauncher, SubprocessLauncher
from value_assets.sensors import ALL_SENSORS

DEPLOYMENT_ENV = "VALUE_ASSETS_DEPLOYMENT"
DEPLOYMENTS = ("local", "ray", "kubernetes")


def project_root() -> Path:
    """The source checkout holding this package (editable install), else the working directory.

    Anchoring the project-local defaults here keeps the code server, the daemon and run workers
    on the same folders whatever their working directory.
    """
    here = Path(__file__).resolve().parents[1]
    return here if (here / "pyproject.toml").is_file() else Path.cwd()


def _pvcs(spec: str) -> dict[str, str]:
    pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
    return {claim.strip(): mount.strip() for claim, mount in pairs}


def resources_by_deployment_name(env: Mapping[str, str] = os.environ) -> dict[str, dict[str, Any]]:
    shared = {
        "artifacts": ArtifactStore(root=env.get("VALUE_ASSETS_ARTIFACTS") or str(project_root() / "artifacts")),
        "inbox": ManifestInbox(
            folder=env.get("VALUE_ASSETS_MANIFESTS") or str(project_root() / "manifests"),
            data_roots=[r for r in env.get("VALUE_ASSETS_DATA_ROOTS", "").split(":") if r],
            default_training=env.get(DEFAULT_TRAINING_ENV) or None,
        ),
    }
    return {
        "local": {
            **shared,
            "launcher": SubprocessLauncher(
                command=shlex.split(env["VALUE_ASSETS_GPU_COMMAND"]) if env.get("VALUE_ASSETS_GPU_COMMAND") else None
            ),
        },
        "ray": {**shared, "launcher": RayJobLauncher(address=EnvVar("RAY_ADDRESS"))},
        "kubernetes": {
            **shared,
            "launcher": K8sPodLauncher(
                image=EnvVar("VALUE_ASSETS_GPU_IMAGE"),
                namespace=env.get("VALUE_ASSETS_K8S_NAMESPACE") or None,
                gpus=int(env.get("VALUE_ASSETS_GPUS", "1")),
                pvc_mounts=_pvcs(env.get("VALUE_ASSETS_K8S_PVCS", "")),
                env={"VALUE_ASSETS_ARTIFACTS": env.get("VALUE_ASSETS_ARTIFACTS", "/artifacts")},
            ),
        },
    }


def deployment_name(env: Mapping[str, str] = os.environ) -> str:
    name = env.get(DEPLOYMENT_ENV, "local") or "local"
    if name not in DEPLOYMENTS:
        raise ValueError(f"{DEPLOYMENT_ENV}={name!r}; expected one of {DEPLOYMENTS}")
    return name


def _forkserver_unless_told(config: dict[str, Any]) -> dict[str, Any]:
    if "multiprocess" in config and not config["multiprocess"].get("start_method"):
        forkserver = {"preload_modules": [__name__]}
        return {"multiprocess": {**config["multiprocess"], "start_method": {"forkserver": forkserver}}}
    return config


# Dagster's default executor (a process per step, or `in_process` in the run config) with the step
# processes forked from a server that has imported this code location once, instead of each
# spawned and importing Dagster and the graph again (~2.5 s of CPU per step, ten steps in a `full`
# run). The server preloads this module by name: Dagster's own default (the job's module) does not
# apply, since an absent `preload_modules` reads as an empty list, and its children then imported
# the graph each (~0.5 s of CPU per step). Any `execution.config` Dagster's default accepts is
# accepted; an explicit `start_method` is kept.
STEP_EXECUTOR = multi_or_in_process_executor.configured(
    _forkserver_unless_told,
    name="multi_or_in_process_forkserver",
    config_schema=multi_or_in_process_executor.config_schema.as_field(),
)


def make_definitions(resources: Mapping[str, Any], executor: ExecutorDefinition = STEP_EXECUTOR) -> Definitions:
    return Definitions(
        assets=ALL_ASSETS,
        asset_checks=ALL_CHECKS,
        jobs=ALL_JOBS,
        sensors=ALL_SENSORS,
        resources=dict(resources),
        executor=executor,
    )


defs = make_definitions(resources_by_deployment_name()[deployment_name()])
