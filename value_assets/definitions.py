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
| VALUE_ASSETS_K8S_* (pods: docs/operations.md#environment-variables), VALUE_ASSETS_GPUS | kubernetes | |

This process never imports torch, megatron or `value_assets.gpu` (tests/dagster/test_dg_layers.py loads it;
tests/test_imports.py checks every module statically).
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dagster import Definitions, EnvVar, ExecutorDefinition, multi_or_in_process_executor

from value_assets.assets import ALL_ASSETS
from value_assets.checks import ALL_CHECKS
from value_assets.core.pod_sizing import parse_quantity
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


def _pairs(env: Mapping[str, str], name: str, sep: str) -> dict[str, str]:
    """`a<sep>b,c<sep>d` from the variable `name` (unset or empty: none); a malformed item names it."""
    out: dict[str, str] = {}
    for item in (i.strip() for i in env.get(name, "").split(",")):
        if not item:
            continue
        key, found, value = item.partition(sep)
        if not found or not key.strip() or not value.strip():
            raise ValueError(f"{name}: {item!r} is not of the form KEY{sep}VALUE (items separated by commas)")
        out[key.strip()] = value.strip()
    return out


def _names(env: Mapping[str, str], name: str) -> list[str]:
    """`a,b` from the variable `name`: the names, without blanks."""
    return [n.strip() for n in env.get(name, "").split(",") if n.strip()]


def _json_list(env: Mapping[str, str], name: str) -> list[dict[str, Any]] | None:
    """The variable `name` as a JSON list of objects; None when unset or empty."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}: not JSON ({err.msg} at character {err.pos})") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValueError(f"{name}: must be a JSON list of objects, got {text[:80]!r}")
    return value


# The `kubernetes` launcher's settings, from the code location's environment (docs/operations.md).
K8S_SIZES = {
    "VALUE_ASSETS_K8S_CPU_PER_GPU": "cpu_per_gpu",
    "VALUE_ASSETS_K8S_MEMORY_PER_GPU": "memory_per_gpu",
    "VALUE_ASSETS_K8S_SHM_PER_GPU": "shm_per_gpu",
}


def k8s_launcher(env: Mapping[str, str] = os.environ) -> K8sPodLauncher:
    """The `kubernetes` deployment's launcher. A malformed variable is a ValueError naming it."""
    settings: dict[str, Any] = {
        "namespace": env.get("VALUE_ASSETS_K8S_NAMESPACE") or None,
        "pvc_mounts": _pairs(env, "VALUE_ASSETS_K8S_PVCS", "="),
        "node_selector": _pairs(env, "VALUE_ASSETS_K8S_NODE_SELECTOR", "="),
        "service_account_name": env.get("VALUE_ASSETS_K8S_SERVICE_ACCOUNT") or None,
        "image_pull_secrets": _names(env, "VALUE_ASSETS_K8S_IMAGE_PULL_SECRETS"),
        "env": {"VALUE_ASSETS_ARTIFACTS": env.get("VALUE_ASSETS_ARTIFACTS", "/artifacts")},
    }
    gpus = env.get("VALUE_ASSETS_GPUS", "1")
    if not gpus.isdigit() or int(gpus) < 1:
        raise ValueError(f"VALUE_ASSETS_GPUS={gpus!r}: a whole number of GPUs, at least 1")
    settings["gpus"] = int(gpus)
    tolerations = _json_list(env, "VALUE_ASSETS_K8S_TOLERATIONS")
    if tolerations is not None:
        settings["tolerations"] = tolerations
    for variable, field in K8S_SIZES.items():
        if env.get(variable):
            parse_quantity(env[variable], setting=variable)  # refused here, named as the variable
            settings[field] = env[variable]
    return K8sPodLauncher(image=EnvVar("VALUE_ASSETS_GPU_IMAGE"), **settings)


def resources_for(deployment: str, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The resources of one deployment (`local`, `ray` or `kubernetes`): only its launcher differs."""
    if deployment not in DEPLOYMENTS:
        raise ValueError(f"{DEPLOYMENT_ENV}={deployment!r}; expected one of {DEPLOYMENTS}")
    shared = {
        "artifacts": ArtifactStore(root=env.get("VALUE_ASSETS_ARTIFACTS") or str(project_root() / "artifacts")),
        "inbox": ManifestInbox(
            folder=env.get("VALUE_ASSETS_MANIFESTS") or str(project_root() / "manifests"),
            data_roots=[r for r in env.get("VALUE_ASSETS_DATA_ROOTS", "").split(":") if r],
            default_training=env.get(DEFAULT_TRAINING_ENV) or None,
        ),
    }
    if deployment == "local":
        command = env.get("VALUE_ASSETS_GPU_COMMAND")
        return {**shared, "launcher": SubprocessLauncher(command=shlex.split(command) if command else None)}
    if deployment == "ray":
        return {**shared, "launcher": RayJobLauncher(address=EnvVar("RAY_ADDRESS"))}
    return {**shared, "launcher": k8s_launcher(env)}


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


defs = make_definitions(resources_for(deployment_name()))
