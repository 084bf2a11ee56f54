"""Deployment artifacts: the pod the Kubernetes launcher submits, the Ray job it would submit,
and the YAML/Dockerfile under deploy/ (parsed and cross-checked, not applied)."""

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
    assert values["postgresql"]["enabled"] is True
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
    assert '"value_assets.definitions"' in text
    assert f'"-m", "{PIPES_MODULE}"' in text


def test_workspace_and_instance_templates_load(tmp_path):
    from dagster import DagsterInstance

    workspace = yaml.safe_load((ROOT / "workspace.yaml").read_text())
    assert workspace["load_from"][0]["python_module"]["module_name"] == "value_assets.definitions"
    shutil.copy(ROOT / "dagster.yaml", tmp_path / "dagster.yaml")
    instance = DagsterInstance.from_config(str(tmp_path))  # validates the config schema
    try:
        settings = yaml.safe_load((ROOT / "dagster.yaml").read_text())
        assert settings["telemetry"]["enabled"] is False and settings["nux"]["enabled"] is False
        assert instance.get_settings("concurrency")["pools"]["default_limit"] == 1
    finally:
        instance.dispose()
