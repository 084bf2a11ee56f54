"""Deployment artifacts: the pod the Kubernetes launcher submits, the Ray job it would submit,
and the YAML/Dockerfile under deploy/ (parsed and cross-checked, not applied)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from value_assets.core.job_configs import EvaluateJob, TrainJob
from value_assets.resources import K8sPodLauncher, RayJobLauncher
from value_assets.resources.launchers import PIPES_MODULE

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
GPU_IMAGE = "registry.example.com/value-assets-gpu:0.1.0"
BOOTSTRAP = {"DAGSTER_PIPES_CONTEXT": "ctx-payload", "DAGSTER_PIPES_MESSAGES": "msg-payload"}


def pod_for(launcher, config, task="train"):
    pod = launcher.render_pod("dagster-run-abc-critic-training", task, config.to_json(), BOOTSTRAP)
    return pod, pod.spec.containers[0]


def test_k8s_pod_has_image_command_gpus_env_and_mounts():
    launcher = K8sPodLauncher(
        image=GPU_IMAGE,
        gpus=1,
        env={"VALUE_ASSETS_ARTIFACTS": "/artifacts"},
        pvc_mounts={"value-assets-artifacts": "/artifacts", "value-assets-data": "/data"},
        node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"},
    )
    pod, container = pod_for(launcher, TrainJob(manifest="m.json", output="/artifacts/p/critic", gpus=8))
    assert container.image == GPU_IMAGE
    assert container.command == ["python", "-m", PIPES_MODULE]
    assert container.resources.limits["nvidia.com/gpu"] == "8"
    assert container.resources.requests["nvidia.com/gpu"] == "8"
    env = {e.name: e.value for e in container.env}
    assert env["DAGSTER_PIPES_CONTEXT"] == "ctx-payload" and env["DAGSTER_PIPES_MESSAGES"] == "msg-payload"
    assert env["VALUE_ASSETS_ARTIFACTS"] == "/artifacts"
    assert {m.mount_path for m in container.volume_mounts} == {"/artifacts", "/data", "/dev/shm"}
    claims = {v.persistent_volume_claim.claim_name for v in pod.spec.volumes if v.persistent_volume_claim}
    assert claims == {"value-assets-artifacts", "value-assets-data"}
    assert pod.spec.restart_policy == "Never"
    assert pod.spec.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod.metadata.labels["value-assets/task"] == "train"
    assert pod.metadata.name == "dagster-run-abc-critic-training"


def test_k8s_pod_requests_the_job_configs_gpus():
    evaluation = EvaluateJob(checkpoint="c", manifest="m.json", contract_sha256="a" * 64, report="r.json", gpus=2)
    _, container = pod_for(K8sPodLauncher(image=GPU_IMAGE, gpus=4), evaluation, task="evaluate")
    assert container.resources.limits["nvidia.com/gpu"] == "2"
    # the job config's default is one worker, whatever the launcher's fallback
    _, container = pod_for(K8sPodLauncher(image=GPU_IMAGE, gpus=4), TrainJob(manifest="m.json", output="o"))
    assert container.resources.limits["nvidia.com/gpu"] == "1"


DEDICATED = {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}


def operator_env(**extra):
    return {
        "VALUE_ASSETS_K8S_NAMESPACE": "rl",
        "VALUE_ASSETS_K8S_PVCS": "value-assets-artifacts=/artifacts",
        "VALUE_ASSETS_K8S_CPU_PER_GPU": "12",
        "VALUE_ASSETS_K8S_MEMORY_PER_GPU": "100Gi",
        "VALUE_ASSETS_K8S_SHM_PER_GPU": "16Gi",
        "VALUE_ASSETS_K8S_NODE_SELECTOR": "nvidia.com/gpu.product=NVIDIA-H200, pool=train",
        "VALUE_ASSETS_K8S_TOLERATIONS": json.dumps([DEDICATED]),
        "VALUE_ASSETS_K8S_SERVICE_ACCOUNT": "critic-trainer",
        "VALUE_ASSETS_K8S_IMAGE_PULL_SECRETS": "registry-a,registry-b",
        **extra,
    }


@pytest.mark.parametrize(
    ("gpus", "cpu", "memory", "shm"),
    [(1, "12", "116Gi", "16Gi"), (2, "24", "232Gi", "32Gi"), (8, "96", "928Gi", "128Gi")],
)
def test_k8s_pods_carry_what_the_operator_set(gpus, cpu, memory, shm, monkeypatch):
    """The code location's environment (deploy/helm/values.yaml) sizes and places every GPU pod; CPU,
    memory and /dev/shm per GPU, the memory holding the memory-backed /dev/shm."""
    from value_assets.definitions import k8s_launcher

    monkeypatch.setenv("VALUE_ASSETS_GPU_IMAGE", GPU_IMAGE)
    launcher = k8s_launcher(operator_env()).process_config_and_initialize()
    pod, container = pod_for(launcher, TrainJob(manifest="m.json", output="/artifacts/p/critic", gpus=gpus))
    assert container.image == GPU_IMAGE
    want = {"cpu": cpu, "memory": memory, "nvidia.com/gpu": str(gpus)}
    assert container.resources.requests == container.resources.limits == want
    (shm_volume,) = [v for v in pod.spec.volumes if v.name == "dshm"]
    assert (shm_volume.empty_dir.medium, shm_volume.empty_dir.size_limit) == ("Memory", shm)
    assert pod.spec.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H200", "pool": "train"}
    assert [(t.key, t.operator, t.value, t.effect) for t in pod.spec.tolerations] == [
        ("dedicated", "Equal", "rl", "NoSchedule")
    ]
    assert pod.spec.service_account_name == "critic-trainer"
    assert [s.name for s in pod.spec.image_pull_secrets] == ["registry-a", "registry-b"]
    assert launcher.namespace == "rl"


def test_k8s_pod_defaults_tolerate_gpu_nodes_and_name_no_account():
    pod, container = pod_for(K8sPodLauncher(image=GPU_IMAGE), TrainJob(manifest="m.json", output="o", gpus=2))
    assert container.resources.limits == {"cpu": "16", "memory": "144Gi", "nvidia.com/gpu": "2"}
    assert [(t.key, t.operator, t.effect) for t in pod.spec.tolerations] == [("nvidia.com/gpu", "Exists", "NoSchedule")]
    assert pod.spec.service_account_name is None and pod.spec.image_pull_secrets is None


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("VALUE_ASSETS_K8S_CPU_PER_GPU", "8 cores", "not a Kubernetes quantity"),
        ("VALUE_ASSETS_K8S_MEMORY_PER_GPU", "64GB", "not a Kubernetes quantity"),
        ("VALUE_ASSETS_K8S_SHM_PER_GPU", "0", "more than zero"),
        ("VALUE_ASSETS_K8S_NODE_SELECTOR", "pool", "KEY=VALUE"),
        ("VALUE_ASSETS_K8S_PVCS", "claim:/artifacts", "KEY=VALUE"),
        ("VALUE_ASSETS_K8S_TOLERATIONS", "[{key: dedicated}]", "not JSON"),
        ("VALUE_ASSETS_K8S_TOLERATIONS", '{"key": "dedicated"}', "JSON list of objects"),
        ("VALUE_ASSETS_GPUS", "two", "whole number"),
    ],
)
def test_a_malformed_pod_setting_names_the_variable(variable, value, message):
    from value_assets.definitions import k8s_launcher

    with pytest.raises(ValueError, match=rf"^{variable}.*{message}"):
        k8s_launcher(operator_env(**{variable: value}))


def test_kuberay_gpu_workers_are_sized_like_a_launcher_pod_of_their_gpus():
    """The Ray worker groups follow the launcher's per-GPU defaults, /dev/shm inside the memory."""
    from value_assets.core.pod_sizing import pod_size

    launcher = K8sPodLauncher(image=GPU_IMAGE)
    for path in ("deploy/kuberay/raycluster.yaml", "deploy/kuberay/rayjob.yaml"):
        (doc,) = load_all(ROOT / path)
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        (group,) = spec["workerGroupSpecs"]
        pod = group["template"]["spec"]
        resources = pod["containers"][0]["resources"]
        gpus = int(resources["limits"]["nvidia.com/gpu"])
        size = pod_size(
            gpus,
            cpu_per_gpu=launcher.cpu_per_gpu,
            memory_per_gpu=launcher.memory_per_gpu,
            shm_per_gpu=launcher.shm_per_gpu,
        )
        assert (
            resources["requests"]
            == resources["limits"]
            == {"cpu": size.cpu, "memory": size.memory, "nvidia.com/gpu": str(gpus)}
        ), path
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": size.shm}, path


def test_ray_job_params_name_the_pipes_entry():
    launcher = RayJobLauncher(address="http://head:8265", env={"A": "1"}, working_dir="/opt/value_assets")
    params = launcher.submit_params("evaluate")
    assert params["entrypoint"] == f"python -m {PIPES_MODULE}"
    assert params["runtime_env"] == {"env_vars": {"A": "1"}, "working_dir": "/opt/value_assets"}
    assert params["metadata"] == {"value_assets/task": "evaluate"}


def load_all(path: Path):
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_helm_values_name_the_code_location_launcher_and_postgres():
    values = load_all(ROOT / "deploy/helm/values.yaml")[0]
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    assert deployment["dagsterApiGrpcArgs"] == ["--module-name", "value_assets.definitions"]
    env = {e["name"]: e["value"] for e in deployment["env"]}
    assert env["VALUE_ASSETS_DEPLOYMENT"] == "kubernetes" and env["VALUE_ASSETS_GPU_IMAGE"] == GPU_IMAGE
    claims = {c.split("=")[0] for c in env["VALUE_ASSETS_K8S_PVCS"].split(",")}
    assert claims == {v["persistentVolumeClaim"]["claimName"] for v in deployment["volumes"]}
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    # production: an external Postgres whose password secret the operator creates (deploy/README.md)
    assert values["postgresql"]["enabled"] is False and values["postgresql"]["postgresqlHost"]
    assert values["generatePostgresqlPasswordSecret"] is False
    assert values["global"]["postgresqlSecretName"] == "value-assets-postgresql"
    # a trial: the bundled one, its secret generated by the chart
    trial = load_all(ROOT / "deploy/helm/values-trial.yaml")[0]
    assert trial == {"postgresql": {"enabled": True}, "generatePostgresqlPasswordSecret": True}
    run_worker = values["runLauncher"]["config"]["k8sRunLauncher"]["resources"]
    assert run_worker["requests"]["cpu"] and run_worker["requests"]["memory"] and run_worker["limits"]["memory"]
    assert values["dagsterDaemon"]["runMonitoring"]["enabled"] is True
    assert values["telemetry"]["enabled"] is False


def test_kuberay_manifests_parse_and_use_the_gpu_image():
    import ray

    (cluster,) = load_all(ROOT / "deploy/kuberay/raycluster.yaml")
    (job,) = load_all(ROOT / "deploy/kuberay/rayjob.yaml")
    assert (cluster["kind"], job["kind"]) == ("RayCluster", "RayJob")
    assert cluster["apiVersion"] == job["apiVersion"] == "ray.io/v1"
    for spec in (cluster["spec"], job["spec"]["rayClusterSpec"]):
        assert spec["rayVersion"] == ray.__version__
        head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
        (workers,) = spec["workerGroupSpecs"]
        worker = workers["template"]["spec"]["containers"][0]
        assert head["image"] == worker["image"] == GPU_IMAGE
        assert int(worker["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert job["spec"]["entrypoint"].startswith("value-assets train ")
    pvcs = {d["metadata"]["name"] for d in load_all(ROOT / "deploy/pvc.yaml")}
    assert pvcs == {"value-assets-artifacts", "value-assets-data"}


def test_dockerfile_builds_both_images():
    text = (ROOT / "deploy/Dockerfile").read_text()
    assert "AS code-location" in text and "AS gpu" in text
    # each stage ends as a user other than root, by number for the code location
    for stage in re.split(r"^FROM ", text, flags=re.M)[1:]:
        users = re.findall(r"^USER\s+(\S+)", stage, flags=re.M)
        assert users and users[-1] not in ("root", "0"), stage.splitlines()[0]
    code_location = re.split(r"^FROM ", text, flags=re.M)[1]
    assert re.findall(r"^USER\s+(\S+)", code_location, flags=re.M)[-1].isdigit()
    assert '"value_assets.definitions"' in text
    assert f'"-m", "{PIPES_MODULE}"' in text


def test_workspace_and_instance_templates_load(tmp_path):
    from dagster import DagsterInstance

    workspace = yaml.safe_load((ROOT / "workspace.yaml").read_text())
    assert workspace["load_from"][0]["python_module"]["module_name"] == "value_assets.definitions"
    shutil.copy(ROOT / "deploy/dagster.yaml", tmp_path / "dagster.yaml")
    instance = DagsterInstance.from_config(str(tmp_path))  # validates the config schema
    try:
        settings = yaml.safe_load((ROOT / "deploy/dagster.yaml").read_text())
        assert settings["telemetry"]["enabled"] is False and settings["nux"]["enabled"] is False
        assert instance.get_settings("concurrency")["pools"]["default_limit"] == 1
    finally:
        instance.dispose()
