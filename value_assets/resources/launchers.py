"""Launchers of the GPU job: one interface, three ways to run it, all through Dagster Pipes.

The GPU job is ``python -m value_assets.gpu.pipes_job``. It opens Dagster Pipes, reads its task and
job config (`TrainJob` / `EvaluateJob` / `HandoffJob` as JSON, never an argument vector) from the
Pipes extras, runs it, and reports materializations (metadata and data version) for the asset keys
the task names (`core/vocabulary.py`). The launcher decides only *where* it runs:

- `SubprocessLauncher` (default): a child process of the step, through `PipesSubprocessClient`.
- `RayJobLauncher`: a Ray job on an existing cluster (KubeRay or not), through dagster-ray's
  `PipesRayJobClient`, created fresh for every launch (it caches its connection).
- `K8sPodLauncher`: one pod per launch, through dagster-k8s' `PipesK8sClient`.

Whatever the launcher, a job that exits without reporting a materialization for every asset the
step was asked to produce fails the step: silence is never success.
"""

import abc
import contextlib
import json
import os
import shlex
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from dagster import (
    AssetCheckKey,
    AssetCheckResult,
    ConfigurableResource,
    Failure,
    MaterializeResult,
    MetadataValue,
    PipesSubprocessClient,
)
from dagster._core.pipes.client import PipesClientCompletedInvocation
from pydantic import Field, ValidationInfo, field_validator

from value_assets.core.job_configs import TrainJob
from value_assets.core.pod_sizing import parse_quantity, pod_size
from value_assets.core.vocabulary import JobConfig, Task
from value_assets.core.warm_folder import default_folder, pipes_python, stop_warm_cluster, use_warm_cluster

# Pipes' message-reader API is marked preview in 1.13; the warning is noise on every launch.
warnings.filterwarnings("ignore", message=r"Function `PipesMessageReader.expected_writer_count`")

PIPES_MODULE = "value_assets.gpu.pipes_job"
RUN_TAG_PREFIX = "value_assets/"
PipesResult = MaterializeResult | AssetCheckResult


class GpuJobLauncher(ConfigurableResource):
    """Interface: run one GPU task through Pipes and return what it reported.

    Subclasses implement `_invoke`; `launch` adds the shared extras and tags the run (`run_tags`),
    then refuses silent jobs.
    """

    launcher_name: ClassVar[str] = "custom"

    def launch(
        self,
        context: Any,
        task: Task,
        config: JobConfig,
        extras: Mapping[str, Any] | None = None,
    ) -> list[PipesResult]:
        task.check(config)  # the same rule the Pipes job applies to what it receives
        payload = {**(extras or {}), "task": task.name, "config": config.to_json()}
        context.log.info(
            f"GPU job {task.name} via {type(self).__name__}: {json.dumps(payload['config'], sort_keys=True)}"
        )
        tag_run(context, self.run_tags(config))
        invocation = self._invoke(context, task.name, payload)
        # Pipes would invent an empty materialization for every selected asset the job did not
        # report; a silent job must fail instead.
        return accept_results(context, task.name, invocation.get_results(implicit_materializations=False))

    def run_tags(self, config: JobConfig) -> dict[str, str]:
        """What the run launched: backbone (training; an evaluation's is the checkpoint's), GPUs
        (the hand-off export runs in one process), launcher. Known only once the step has built
        the job config, hence tagged at launch."""
        gpus = getattr(config, "gpus", 1)
        tags = {f"{RUN_TAG_PREFIX}gpus": str(gpus), f"{RUN_TAG_PREFIX}launcher": self.launcher_name}
        if isinstance(config, TrainJob):
            tags[f"{RUN_TAG_PREFIX}backbone"] = str(config.backbone)
        return tags

    @abc.abstractmethod
    def _invoke(self, context: Any, task: str, extras: dict[str, Any]) -> PipesClientCompletedInvocation:
        """Run the Pipes task with `extras` (the job config as JSON) where this launcher runs GPU jobs."""


def tag_run(context: Any, tags: Mapping[str, str]) -> None:
    """Add `tags` to the step's run (the runs list filters and shows them), and log them."""
    instance, run = getattr(context, "instance", None), getattr(context, "run", None)
    if instance is not None and run is not None:
        instance.add_run_tags(run.run_id, dict(tags))
    context.log.info("run tags: " + ", ".join(f"{k}={v}" for k, v in sorted(tags.items())))


def accept_results(context: Any, task: str, results: Sequence[PipesResult]) -> list[PipesResult]:
    """Keep what the step declared; fail when a selected asset got no materialization.

    Check results for checks the step does not declare are logged and dropped (Dagster would
    reject them); the gate is evaluated by Dagster itself from the published report.
    """
    wanted_assets = set(context.selected_asset_keys)
    wanted_checks = set(getattr(context, "selected_asset_check_keys", set()) or set())
    single = next(iter(wanted_assets)) if len(wanted_assets) == 1 else None
    kept: list[PipesResult] = []
    seen = set()
    for result in results:
        if isinstance(result, MaterializeResult):
            key = result.asset_key or single
            if key not in wanted_assets:
                context.log.warning(f"GPU job {task} reported a materialization of {key}, not selected: dropped")
                continue
            seen.add(key)
            kept.append(result)
        elif isinstance(result, AssetCheckResult):
            check_key = AssetCheckKey(result.asset_key, result.check_name) if result.asset_key else None
            if check_key is None or check_key not in wanted_checks:
                context.log.warning(f"GPU job {task} reported an undeclared check {result.check_name!r}: dropped")
                continue
            kept.append(result)
    missing = sorted(k.to_user_string() for k in wanted_assets - seen)
    if missing:
        raise Failure(
            description=f"GPU job {task} ended without reporting a materialization for {missing}",
            metadata={"task": task, "missing": MetadataValue.json(missing)},
        )
    return kept


class SubprocessLauncher(GpuJobLauncher):
    """Runs the GPU job as a local child process (laptop, CI, one GPU box).

    Unless the job is given a Ray cluster (`RAY_ADDRESS` in `env` or in this process's
    environment), its jobs share one warm local Ray cluster and its worker pool
    (core/warm_folder.py, docs/operations.md#warm-workers): the first GPU job of the instance starts
    it, later ones (of this run and of others) join it, and it ends after `warm_idle_s` seconds
    without a job. `warm_idle_s: 0` gives every job its own Ray, as a job run by hand has.
    """

    launcher_name: ClassVar[str] = "subprocess"

    command: list[str] | None = Field(
        default=None,
        description="Command line of the Pipes job; default: this interpreter -m value_assets.gpu.pipes_job.",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the job.")
    cwd: str | None = Field(default=None, description="Working directory of the job.")
    warm_idle_s: float = Field(
        default=120.0,
        ge=0,
        description="Keep one local Ray cluster and its workers (torch and megatron imported) warm between GPU jobs "
        "for this many idle seconds; 0: every job starts and ends its own Ray.",
    )
    warm_dir: str | None = Field(
        default=None,
        description="Folder of the warm cluster's files; default: one per Dagster instance under the temp dir.",
    )

    def job_command(self) -> list[str]:
        return list(self.command) if self.command else [sys.executable, "-m", PIPES_MODULE]

    def warm_folder(self, instance: Any = None) -> Path | None:
        """Where this launcher's warm cluster is found, or None when its jobs get none."""
        if not self.warm_idle_s or "RAY_ADDRESS" in self.env or os.environ.get("RAY_ADDRESS"):
            return None
        if pipes_python(self.job_command(), PIPES_MODULE) is None:
            return None  # a custom command: its environment is unknown
        return Path(self.warm_dir) if self.warm_dir else default_folder(getattr(instance, "root_directory", None))

    def stop_warm_cluster(self, instance: Any = None) -> bool:
        """End the warm cluster now (e.g. at the end of `make demo`); False if none served."""
        folder = self.warm_folder(instance)
        return stop_warm_cluster(folder) if folder is not None else False

    def _invoke(self, context: Any, task: str, extras: dict[str, Any]) -> PipesClientCompletedInvocation:
        command = self.job_command()
        folder = self.warm_folder(getattr(context, "instance", None))
        warm_cluster = (
            use_warm_cluster(folder, python=command[0], idle_s=self.warm_idle_s)
            if folder is not None
            else contextlib.nullcontext()
        )
        with warm_cluster as warm:
            env = dict(self.env)
            if warm is not None:
                context.log.info(
                    f"GPU job {task} joins the warm Ray cluster {warm.address} (worker pool {warm.pool!r}, {folder})"
                )
                env.update(warm.job_env())
            return PipesSubprocessClient(env=env, cwd=self.cwd).run(context=context, command=command, extras=extras)


NO_AGENT_YET = "No available agent to submit job"  # Ray's answer while a cluster's job agents start


def submit_when_ready(
    submit: Any, *, log: Any, deadline_s: float = 60.0, wait_s: float = 2.0, sleep: Any = None, clock: Any = None
) -> Any:
    """`submit()`, again every `wait_s` for up to `deadline_s` while Ray answers that no job agent
    can take the job yet (a cluster whose agents are still starting: nothing was submitted, Ray
    says to try again later). Any other error, or that one past the deadline, is raised."""
    import time

    sleep, clock = sleep or time.sleep, clock or time.monotonic
    end = clock() + deadline_s
    while True:
        try:
            return submit()
        except RuntimeError as exc:
            if NO_AGENT_YET not in str(exc) or clock() + wait_s > end:
                raise
            log(f"the Ray cluster has no job agent ready yet; submitting again in {wait_s:g} s")
            sleep(wait_s)


class RayJobLauncher(GpuJobLauncher):
    """Submits the GPU job to an existing Ray cluster as a Ray job (the driver then places its
    GPU workers with a placement group; the entrypoint itself reserves no GPU)."""

    launcher_name: ClassVar[str] = "ray-job"

    address: str = Field(description="Ray dashboard address, e.g. http://raycluster-head-svc:8265.")
    python: str = Field(default="python", description="Interpreter on the cluster's image.")
    command: list[str] | None = Field(
        default=None, description="Entrypoint argv; default: <python> -m value_assets.gpu.pipes_job."
    )
    working_dir: str | None = Field(default=None, description="runtime_env working_dir, if the image lacks the code.")
    env: dict[str, str] = Field(default_factory=dict)
    entrypoint_num_cpus: float = 1.0
    poll_interval_s: float = 5.0
    timeout_s: float = 600.0

    def entrypoint(self) -> str:
        return shlex.join(list(self.command) if self.command else [self.python, "-m", PIPES_MODULE])

    def submit_params(self, task: str) -> dict[str, Any]:
        runtime_env: dict[str, Any] = {"env_vars": dict(self.env)}
        if self.working_dir:
            runtime_env["working_dir"] = self.working_dir
        return {
            "entrypoint": self.entrypoint(),
            "runtime_env": runtime_env,
            "entrypoint_num_cpus": self.entrypoint_num_cpus,
            "metadata": {"value_assets/task": task},
        }

    def _invoke(self, context: Any, task: str, extras: dict[str, Any]) -> PipesClientCompletedInvocation:
        from dagster_ray import PipesRayJobClient  # heavy; only where this launcher is used

        def submit() -> PipesClientCompletedInvocation:
            # Fresh per launch: the client caches its JobSubmissionClient (docs/operations.md).
            client = PipesRayJobClient(address=self.address, timeout=self.timeout_s, poll_interval=self.poll_interval_s)
            return client.run(context=context, submit_job_params=self.submit_params(task), extras=extras)

        return submit_when_ready(submit, log=context.log.info)


GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


class K8sPodLauncher(GpuJobLauncher):
    """Runs the GPU job as one Kubernetes pod per launch, on GPU nodes.

    Everything a cluster differs in is a setting (resource config, or the `VALUE_ASSETS_K8S_*`
    environment of the code location: docs/operations.md#environment-variables). CPU, memory and
    `/dev/shm` are per GPU and grow with the job's GPUs (`core/pod_sizing.py`: the memory-backed
    `/dev/shm` is counted inside the pod's memory).
    """

    launcher_name: ClassVar[str] = "k8s-pod"

    image: str = Field(description="GPU job image (deploy/Dockerfile, target `gpu`).")
    namespace: str | None = None
    command: list[str] = Field(default_factory=lambda: ["python", "-m", PIPES_MODULE])
    gpus: int = Field(
        default=1, description="nvidia.com/gpu per pod when the job config names no `gpus` (every job config does)."
    )
    cpu_per_gpu: str = Field(default="8", description="CPU request and limit per GPU (a Kubernetes quantity).")
    memory_per_gpu: str = Field(default="64Gi", description="Memory per GPU for the job's processes, without /dev/shm.")
    shm_per_gpu: str = Field(default="8Gi", description="Memory-backed /dev/shm per GPU (NCCL, data loaders).")
    env: dict[str, str] = Field(default_factory=dict)
    pvc_mounts: dict[str, str] = Field(
        default_factory=dict,
        description="PersistentVolumeClaim name -> mount path; the artifacts root and data must be "
        "mounted at the same paths as in the Dagster code location.",
    )
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [dict(GPU_TOLERATION)],
        description="The pod's tolerations (default: the nvidia.com/gpu taint of GPU node pools).",
    )
    service_account_name: str | None = None
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secrets to pull the GPU image with.")
    image_pull_policy: str = "IfNotPresent"
    load_incluster_config: bool | None = None
    kubeconfig_file: str | None = None
    pod_wait_timeout_s: float = 7 * 24 * 3600.0

    @field_validator("cpu_per_gpu", "memory_per_gpu", "shm_per_gpu")
    @classmethod
    def _a_quantity(cls, value: str, info: ValidationInfo) -> str:
        parse_quantity(value, setting=str(info.field_name))
        return value

    def gpus_for(self, config: Mapping[str, Any]) -> int:
        """The pod's GPUs: the job config's worker slots (`gpus`)."""
        return int(config.get("gpus", self.gpus))

    def base_pod_spec(self, task: str, config: Mapping[str, Any]) -> dict[str, Any]:
        size = pod_size(
            self.gpus_for(config),
            cpu_per_gpu=self.cpu_per_gpu,
            memory_per_gpu=self.memory_per_gpu,
            shm_per_gpu=self.shm_per_gpu,
        )
        mounts = [{"name": f"pvc-{i}", "mountPath": path} for i, path in enumerate(self.pvc_mounts.values())]
        volumes: list[dict[str, Any]] = [
            {"name": f"pvc-{i}", "persistentVolumeClaim": {"claimName": claim}}
            for i, claim in enumerate(self.pvc_mounts)
        ]
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size.shm}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
        resources = {"cpu": size.cpu, "memory": size.memory, "nvidia.com/gpu": str(size.gpus)}
        container = {
            "name": "gpu-job",
            "imagePullPolicy": self.image_pull_policy,
            "resources": {"requests": dict(resources), "limits": dict(resources)},
            "volumeMounts": mounts,
        }
        spec: dict[str, Any] = {
            "containers": [container],
            "volumes": volumes,
            "restartPolicy": "Never",
            "tolerations": [dict(t) for t in self.tolerations],
        }
        if self.node_selector:
            spec["nodeSelector"] = dict(self.node_selector)
        if self.service_account_name:
            spec["serviceAccountName"] = self.service_account_name
        if self.image_pull_secrets:
            spec["imagePullSecrets"] = [{"name": name} for name in self.image_pull_secrets]
        return spec

    def base_pod_meta(self, task: str) -> dict[str, Any]:
        return {"labels": {"app.kubernetes.io/name": "value-assets-gpu-job", "value-assets/task": task}}

    def render_pod(self, pod_name: str, task: str, config: Mapping[str, Any], bootstrap_env: Mapping[str, str]):
        """The V1Pod this launcher submits, as `PipesK8sClient.run` builds it (used by tests)."""
        from dagster_k8s.pipes import build_pod_body

        return build_pod_body(
            pod_name=pod_name,
            image=self.image,
            command=list(self.command),
            env_vars={**bootstrap_env, **self.env},
            base_pod_meta=self.base_pod_meta(task),
            base_pod_spec=self.base_pod_spec(task, config),
        )

    def _invoke(self, context: Any, task: str, extras: dict[str, Any]) -> PipesClientCompletedInvocation:
        from dagster_k8s import PipesK8sClient

        client = PipesK8sClient(
            env=dict(self.env),
            load_incluster_config=self.load_incluster_config,
            kubeconfig_file=self.kubeconfig_file,
        )
        return client.run(
            context=context,
            extras=extras,
            image=self.image,
            command=list(self.command),
            namespace=self.namespace,
            base_pod_meta=self.base_pod_meta(task),
            base_pod_spec=self.base_pod_spec(task, extras["config"]),
            pod_wait_timeout=self.pod_wait_timeout_s,
        )
