"""deploy/ checked against upstream schemas (kept in schemas/, sources and versions in SOURCE.md):
the Helm values against the Dagster chart's values schema, the KubeRay manifests against the
`ray.io/v1` CRDs, and every core Kubernetes object (the PVCs, the pods the Kubernetes launcher
renders, the Ray pod templates) against the Kubernetes schemas of the target version. Plus the
settings a schema cannot see: what the chart template drops, what KubeRay ignores, floating tags."""

import copy
import json
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(__file__).resolve().parent / "schemas"
K8S_VERSION = "v1.33.0-local-strict"
K8S_DEFS = "https://kubernetes.io/api/_definitions.json"
# The chart schema points at kubernetesjsonschema.dev (v1.18.0); here those refs resolve to the
# target version's definitions kept beside it.
CHART_K8S_REF = "https://kubernetesjsonschema.dev/v1.18.0/_definitions.json#/definitions/"


def load_all(path: Path):
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


@cache
def registry():
    from referencing import Registry, Resource

    defs = json.loads((SCHEMAS / f"kubernetes-{K8S_VERSION}-_definitions.json").read_text())
    return Registry().with_resource(K8S_DEFS, Resource.from_contents(defs))


def k8s_validator(kind: str):
    from jsonschema import Draft202012Validator

    if kind.startswith("io.k8s."):
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$ref": f"{K8S_DEFS}#/$defs/{kind}"}
    else:
        schema = json.loads((SCHEMAS / f"kubernetes-{K8S_VERSION}-{kind}.json").read_text())
    return Draft202012Validator(schema, registry=registry())


def errors(validator, instance) -> list[str]:
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(instance))


# ---------------------------------------------------------------- Helm values / Dagster chart


def chart_validator():
    from jsonschema import Draft7Validator

    text = (SCHEMAS / "dagster-chart-values.schema.json").read_text().replace(CHART_K8S_REF, f"{K8S_DEFS}#/$defs/")
    return Draft7Validator(json.loads(text), registry=registry())


def helm_values():
    return load_all(ROOT / "deploy/helm/values.yaml")[0]


def test_helm_values_match_the_dagster_chart_schema():
    assert errors(chart_validator(), helm_values()) == []
    trial = load_all(ROOT / "deploy/helm/values-trial.yaml")[0]
    merged = {**helm_values(), **trial, "postgresql": {**helm_values()["postgresql"], **trial["postgresql"]}}
    assert errors(chart_validator(), merged) == []


def test_chart_schema_catches_what_it_should():
    """The check is live: an unknown key and a mistyped limit are refused."""
    values = helm_values()
    values["dagsterDaemon"]["runRetries"] = {"enabled": True}
    values["dagsterDaemon"]["runMonitorng"] = {"enabled": True}
    values["concurrency"]["pools"]["default_limit"] = 1
    values["dagster-user-deployments"]["deployments"][0]["volumes"][0]["persistentVolumeClaim"] = {"claim": "x"}
    found = errors(chart_validator(), values)
    assert any("runMonitorng" in e for e in found), found
    assert any("default_limit" in e for e in found), found
    assert any("claimName" in e or "'claim'" in e for e in found), found


def test_gpu_pool_limit_is_one_and_the_same_in_helm_and_dagster_yaml():
    local = yaml.safe_load((ROOT / "deploy/dagster.yaml").read_text())["concurrency"]["pools"]
    helm = helm_values()
    pools = helm["concurrency"]["pools"]
    assert helm["concurrency"]["enabled"] is True  # the chart renders `concurrency` only when enabled
    assert pools["defaultLimit"] == local["default_limit"] == 1
    assert pools["granularity"] == local["granularity"] == "op"
    assert "concurrency" not in (helm.get("additionalInstanceConfig") or {})  # one home: the chart's key


def test_no_run_retries_and_no_falsy_value_the_chart_drops():
    # The chart renders `max_retries` under `{{- if .maxRetries }}`: a 0 there is silently dropped.
    retries = helm_values()["dagsterDaemon"]["runRetries"]
    assert retries == {"enabled": False}


def test_postgres_scheme_names_the_driver_the_image_installs():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "dagster-postgres==0.29.27" in extras["k8s"]
    assert helm_values()["postgresql"]["postgresqlScheme"] == "postgresql+psycopg2"  # dagster-postgres -> psycopg2
    assert '".[k8s]"' in (ROOT / "deploy/Dockerfile").read_text()


# ---------------------------------------------------------------- KubeRay


def strict(schema):
    """The CRD schema as the API server applies it. Unknown fields refused, as `kubectl apply
    --validate=strict` does (else they are pruned silently): every object schema with properties,
    and no rule of its own for extra keys, gets additionalProperties: false. Defaults are applied
    before validation, so a required field with a default may be left out."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            if "required" in node:
                props = node.get("properties", {})
                node["required"] = [k for k in node["required"] if "default" not in props.get(k, {})]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def crd_validator(plural: str):
    from jsonschema import Draft7Validator

    return Draft7Validator(strict(json.loads((SCHEMAS / f"kuberay-v1.7.0-{plural}-v1.json").read_text())))


def kuberay():
    (cluster,) = load_all(ROOT / "deploy/kuberay/raycluster.yaml")
    (job,) = load_all(ROOT / "deploy/kuberay/rayjob.yaml")
    return cluster, job


def cluster_specs():
    cluster, job = kuberay()
    return [("raycluster", cluster["spec"]), ("rayjob", job["spec"]["rayClusterSpec"])]


def test_kuberay_manifests_match_the_ray_io_v1_crds():
    cluster, job = kuberay()
    assert errors(crd_validator("rayclusters"), cluster) == []
    assert errors(crd_validator("rayjobs"), job) == []


def test_crd_schema_catches_what_it_should():
    cluster, _ = kuberay()
    cluster["spec"]["workerGroupSpecs"][0]["minReplica"] = 0
    cluster["spec"]["workerGroupSpecs"][0]["replicas"] = "one"
    found = errors(crd_validator("rayclusters"), cluster)
    assert any("minReplica'" in e for e in found) and any("replicas" in e for e in found), found


def test_ray_pod_templates_are_valid_pod_specs():
    validator = k8s_validator("io.k8s.api.core.v1.PodSpec")
    for name, spec in cluster_specs():
        templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
        for template in templates:
            assert errors(validator, template["spec"]) == [], name


def test_head_ports_use_kuberay_names_and_keep_metrics():
    # KubeRay adds its default head ports only when none are listed; listed ones are taken as is and
    # found by name (gcs-server for the head service, metrics for Prometheus scraping).
    for name, spec in cluster_specs():
        (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in head.get("ports", [])}
        if ports:
            assert ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "metrics": 8080}, name


def test_replica_bounds_only_with_in_tree_autoscaling():
    for name, spec in cluster_specs():
        bounded = any({"minReplicas", "maxReplicas"} & set(g) for g in spec["workerGroupSpecs"])
        assert not bounded or spec.get("enableInTreeAutoscaling") is True, name
        for group in spec["workerGroupSpecs"]:
            assert group.get("minReplicas", 0) <= group["replicas"] <= group.get("maxReplicas", group["replicas"])


# ---------------------------------------------------------------- core Kubernetes objects


def test_pvcs_are_valid():
    validator = k8s_validator("persistentvolumeclaim-v1")
    docs = load_all(ROOT / "deploy/pvc.yaml")
    assert len(docs) == 2
    for doc in docs:
        assert errors(validator, doc) == [], doc["metadata"]["name"]
        # shared by every pod: a class named on purpose, not the cluster default (often RWO only)
        assert doc["spec"]["accessModes"] == ["ReadWriteMany"] and doc["spec"]["storageClassName"]


def helm_code_location_env() -> dict[str, str]:
    (deployment,) = helm_values()["dagster-user-deployments"]["deployments"]
    return {e["name"]: e["value"] for e in deployment["env"]}


DEDICATED = {"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}


OPERATOR = {  # what a platform engineer sets beyond the Helm values' defaults
    "VALUE_ASSETS_K8S_NODE_SELECTOR": "nvidia.com/gpu.product=NVIDIA-H200,pool=train",
    "VALUE_ASSETS_K8S_TOLERATIONS": json.dumps([DEDICATED]),
    "VALUE_ASSETS_K8S_IMAGE_PULL_SECRETS": "registry-creds",
}


def rendered_pods(gpu_counts=(8, 1, 2)):
    """The pods K8sPodLauncher renders, configured by the environment the Helm values give the code
    location (and, for every second pod, the operator's settings above): train with each GPU count,
    evaluate, the canary."""
    from kubernetes.client import ApiClient

    from value_assets.core.job_configs import EvaluateJob, TrainJob
    from value_assets.definitions import k8s_launcher

    env = helm_code_location_env()
    launchers = [
        k8s_launcher(e).model_copy(update={"image": env["VALUE_ASSETS_GPU_IMAGE"]}) for e in (env, {**env, **OPERATOR})
    ]
    bootstrap = {"DAGSTER_PIPES_CONTEXT": "ctx", "DAGSTER_PIPES_MESSAGES": "msg"}
    configs = [
        (f"train-{g}", TrainJob(manifest="/data/m.json", output="/artifacts/p/critic", gpus=g)) for g in gpu_counts
    ]
    configs += [
        (
            "evaluate",
            EvaluateJob(
                checkpoint="/artifacts/p/critic",
                manifest="/data/m.json",
                contract_sha256="0" * 64,
                report="/artifacts/p/reports/ev.json",
            ),
        ),
        ("canary", TrainJob(manifest="/data/m.json", output="/artifacts/p/canary", canary=True)),
    ]
    for k, (name, config) in enumerate(configs):
        task = name.split("-")[0]
        pod = launchers[k % 2].render_pod(f"dagster-run-abc-{name}", task, config.to_json(), bootstrap)
        body = ApiClient().sanitize_for_serialization(pod)
        yield name, {"apiVersion": "v1", "kind": "Pod", **body}


def test_launcher_pods_are_valid():
    validator = k8s_validator("pod-v1")
    pods = list(rendered_pods())
    assert [name for name, _ in pods] == ["train-8", "train-1", "train-2", "evaluate", "canary"]
    for task, body in pods:
        assert errors(validator, body) == [], task


def test_pod_schema_catches_what_it_should():
    _, body = next(rendered_pods())
    body["spec"]["containers"][0]["resources"]["limitz"] = {}
    body["spec"]["restartPolicy"] = 3
    found = errors(k8s_validator("pod-v1"), body)
    assert any("limitz" in e for e in found) and any("restartPolicy" in e for e in found), found


# ---------------------------------------------------------------- images


def test_base_images_are_pinned_by_version():
    froms = re.findall(r"^FROM\s+(\S+)", (ROOT / "deploy/Dockerfile").read_text(), flags=re.M)
    assert len(froms) == 2
    for image in froms:
        name, _, tag = image.partition(":")
        assert re.match(r"\d+\.\d+\.\d+-", tag), f"{image}: tag is not a full version"
        assert not re.search(r"(^|-)(latest|gpu|slim)$", tag), f"{image}: a floating variant alias"
