"""deploy/kubernetes/overlays/inference-pool (+ the autoscaling components), rendered by the real
kustomize (`kubectl kustomize`, kustomize v5 inside kubectl) and validated offline.

Validation: built-in kinds against the Kubernetes OpenAPI schemas of kubernetes-validate, strict
(unknown fields are errors); InferencePool, HTTPRoute and ScaledObject against their CRDs'
published schemas vendored in deploy/schemas/ (source, commit and sha256 in each file), made
strict the way the API server is for a typed client: an unknown field is an error where the CRD
does not preserve unknown fields; then every CEL rule of the CRD (x-kubernetes-validations) is
evaluated with cel-python on the object after the schema's defaults, as the API server does
(transition rules, which compare with `oldSelf`, need an update and are the one kind left out).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OVERLAY = ROOT / "deploy" / "kubernetes" / "overlays" / "inference-pool"
COMPONENTS = ROOT / "deploy" / "kubernetes" / "components"
SCHEMAS = ROOT / "deploy" / "schemas"
DOCS = ROOT / "docs" / "deploy.md"
K8S_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
VENDORED = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-inference.networking.k8s.io-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-gateway.networking.k8s.io-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda.sh-v1alpha1.json",
}
WRITTEN = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring-v1.json",
}


def kustomize(folder: Path) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed (the machine image ships it; it bundles kustomize)")
    done = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def with_component(tmp: Path, component: str) -> list[dict[str, Any]]:
    """The overlay with one component added, as an operator's kustomization would add it."""
    tmp.mkdir(parents=True, exist_ok=True)
    text = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(OVERLAY, tmp)],
        "components": [os.path.relpath(COMPONENTS / component, tmp)],
    }
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(text))
    return kustomize(tmp)


def strict(schema: Any) -> Any:
    """An OpenAPI v3 structural schema as a JSON Schema that refuses unknown fields: every object
    with `properties` and no other say on extra keys gets additionalProperties: false."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (strict(v) if k != "properties" else {n: strict(s) for n, s in v.items()}) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(name: str) -> jsonschema.Validator:
    vendored = json.loads((SCHEMAS / name).read_text())
    return jsonschema.Draft7Validator(strict(vendored["openAPIV3Schema"]))


def defaulted(schema: dict[str, Any], value: Any) -> Any:
    """The value with the structural schema's defaults filled in, as the API server stores it."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = defaulted(sub, out[name])
        return out
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {k: defaulted(schema["additionalProperties"], v) for k, v in value.items()}
    if isinstance(value, list) and "items" in schema:
        return [defaulted(schema["items"], v) for v in value]
    return value


def cel_rules(schema: dict[str, Any], value: Any, path: str) -> list[tuple[str, dict[str, str], Any]]:
    """(path, rule, self) for every x-kubernetes-validations rule that applies to a present value."""
    found = [(path, rule, value) for rule in schema.get("x-kubernetes-validations", [])]
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name in value:
                found += cel_rules(sub, value[name], f"{path}.{name}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for name, item in value.items():
            found += cel_rules(schema["additionalProperties"], item, f"{path}[{name}]")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            found += cel_rules(schema["items"], item, f"{path}[{i}]")
    return found


def cel_problems(schema: dict[str, Any], obj: dict[str, Any]) -> list[str]:
    env = celpy.Environment()
    out = []
    for path, rule, value in cel_rules(schema, defaulted(schema, obj), ""):
        if "oldSelf" in rule["rule"]:
            continue  # a transition rule: it judges an update against the stored object
        result = env.program(env.compile(rule["rule"])).evaluate({"self": celpy.json_to_cel(value)})
        if not (isinstance(result, celpy.celtypes.BoolType) and result):  # false, or a CEL error: refused
            out.append(f"{path}: {rule.get('message', rule['rule'])} ({result!r})")
    return out


def problems(obj: dict[str, Any], version: str) -> list[str]:
    key = (obj["apiVersion"], obj["kind"])
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    if key in VENDORED:
        validator = crd_validator(VENDORED[key])
        found = [f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
        schema = json.loads((SCHEMAS / VENDORED[key]).read_text())["openAPIV3Schema"]
        return found or [f"{where}: {p}" for p in cel_problems(schema, obj)]
    if key in WRITTEN:
        validator = jsonschema.Draft202012Validator(json.loads((SCHEMAS / WRITTEN[key]).read_text()))
        return [f"{where}: {'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except (jsonschema.ValidationError, kubernetes_validate.utils.SchemaNotFoundError) as exc:
        return [f"{where}: {getattr(exc, 'message', exc)}"]
    return []


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("kustomize")
    return {
        "pool": kustomize(OVERLAY),
        "keda": with_component(tmp / "keda", "autoscaling-keda"),
        "hpa": with_component(tmp / "hpa", "autoscaling-hpa"),
    }


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"{len(hits)} {kind} {name or ''}"
    return hits[0]


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", ["pool", "keda", "hpa"])
def test_every_object_validates_against_its_schema(
    rendered: dict[str, list[dict[str, Any]]], name: str, version: str
) -> None:
    objects = rendered[name]
    kinds = {o["kind"] for o in objects}
    assert {"InferencePool", "HTTPRoute", "Deployment", "Service", "Role", "RoleBinding", "ServiceAccount"} <= kinds
    assert ("ScaledObject" in kinds) == (name == "keda")
    assert ("HorizontalPodAutoscaler" in kinds) == (name == "hpa")
    assert [p for o in objects for p in problems(o, version)] == []


def test_the_vendored_schemas_refuse_mistakes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Negative controls: each vendored schema refuses a typo'd field, a wrong type and a missing
    required field, so the validation above is not vacuous."""
    pool = one(rendered["pool"], "InferencePool")
    route = one(rendered["pool"], "HTTPRoute")
    scaled = one(rendered["keda"], "ScaledObject")
    mistakes = []
    bad = copy.deepcopy(pool)
    bad["spec"]["targetPort"] = bad["spec"].pop("targetPorts")
    mistakes.append(bad)
    bad = copy.deepcopy(pool)
    bad["spec"]["targetPorts"][0]["number"] = "8080"
    mistakes.append(bad)
    bad = copy.deepcopy(pool)
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    mistakes.append(bad)
    bad = copy.deepcopy(pool)  # CEL: port numbers must be unique
    bad["spec"]["targetPorts"].append({"number": 8080})
    mistakes.append(bad)
    bad = copy.deepcopy(pool)  # CEL: a Service picker needs a port
    del bad["spec"]["endpointPickerRef"]["port"]
    mistakes.append(bad)
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["backendRefs"][0]["weight"] = -1
    mistakes.append(bad)
    bad = copy.deepcopy(route)  # CEL: a backendRef to a Service (the default kind) needs a port
    bad["spec"]["rules"][0]["backendRefs"] = [{"name": "kvgate"}]
    mistakes.append(bad)
    bad = copy.deepcopy(route)  # CEL: a path prefix must start with "/"
    bad["spec"]["rules"][0]["matches"][0]["path"]["value"] = "v1"
    mistakes.append(bad)
    bad = copy.deepcopy(route)
    bad["spec"]["rules"][0]["timeouts"]["request"] = "ten minutes"
    mistakes.append(bad)
    bad = copy.deepcopy(scaled)
    del bad["spec"]["triggers"]
    mistakes.append(bad)
    bad = copy.deepcopy(scaled)
    bad["spec"]["scaleTargetRef"]["nmae"] = bad["spec"]["scaleTargetRef"].pop("name")
    mistakes.append(bad)
    for obj in mistakes:
        assert problems(obj, K8S_VERSIONS[0]), obj["spec"]


def test_vendored_schemas_name_their_source() -> None:
    for name in VENDORED.values():
        vendored = json.loads((SCHEMAS / name).read_text())
        assert vendored["source"].startswith("https://github.com/"), name
        assert f"/blob/{vendored['source'].split('/blob/')[1].split('/')[0]}/" in vendored["source"], name
        assert len(vendored["commit"]) == 40, name
        assert len(vendored["sha256"]) == 64, name
        assert vendored["openAPIV3Schema"]["type"] == "object", name


def test_the_pool_reaches_kvgate_and_never_vllm(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The pool selects the kvgate + vLLM pods on kvgate's port: the EPP scrapes kvgate's gauges
    and the Gateway's requests go through kvgate's admission."""
    objects = rendered["pool"]
    pool = one(objects, "InferencePool")
    pods = one(objects, "Deployment", "kvgate-vllm")
    labels = pods["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {c: {p["containerPort"] for p in spec.get("ports", [])} for c, spec in containers(pods).items()}
    target = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert target == sorted(ports["kvgate"]), (target, ports)
    assert not set(target) & ports["vllm"]
    assert pool["metadata"]["namespace"] == pods["metadata"]["namespace"] == "llm"


def test_the_endpoint_picker_is_wired_to_the_pool(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["pool"]
    pool = one(objects, "InferencePool")
    picker = pool["spec"]["endpointPickerRef"]
    service = one(objects, "Service", picker["name"])
    epp = one(objects, "Deployment", "kvgate-pool-epp")
    (container,) = containers(epp).values()
    # The picker's Service port reaches the EPP's ext-proc gRPC port.
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == picker["port"]["number"]]
    (grpc,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert int(args["grpc-port"]) == grpc["containerPort"]
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    assert args["pool-name"] == pool["metadata"]["name"]
    assert args["pool-namespace"] == pool["metadata"]["namespace"]
    assert container["image"] == "ghcr.io/llm-d/llm-d-router-endpoint-picker:v0.10.0"
    # Its config file is the generated ConfigMap (name with kustomize's hash), mounted where read.
    (volume,) = epp["spec"]["template"]["spec"]["volumes"]
    configmap = one(objects, "ConfigMap", volume["configMap"]["name"])
    (mount,) = container["volumeMounts"]
    assert args["config-file"] == f"{mount['mountPath']}/epp-config.yaml"
    config = yaml.safe_load(configmap["data"]["epp-config.yaml"])
    (profile,) = config["schedulingProfiles"]
    weights = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    assert weights["queue-scorer"] == weights["kv-cache-utilization-scorer"] == 2
    assert {p["type"] for p in config["plugins"]} >= set(weights)
    assert "featureGates" not in config  # flow control off: docs/deploy.md says why
    # RBAC: the EPP's ServiceAccount may watch the pool and its pods, in the pool's namespace.
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == "kvgate-pool-epp"
    binding = one(objects, "RoleBinding", "kvgate-pool-epp")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "kvgate-pool-epp", "namespace": "llm"}]
    role = one(objects, "Role", binding["roleRef"]["name"])
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("inference.networking.k8s.io", "inferencepools"), ("", "pods")} <= granted


def test_the_route_sends_the_gateway_to_the_pool(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["pool"]
    route = one(objects, "HTTPRoute")
    pool = one(objects, "InferencePool")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    # Longer than kvgate's queue wait plus a long answer.
    queue_wait = next(
        e["value"]
        for e in containers(one(objects, "Deployment", "kvgate-vllm"))["kvgate"]["env"]
        if e["name"] == "KVGATE_MAX_QUEUE_WAIT"
    )
    assert int(rule["timeouts"]["request"].removesuffix("s")) > 5 * int(queue_wait)


def test_autoscalers_read_the_waiting_gauge_kvgate_serves(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """KEDA's query and the HPA's metric name kvgate's `vllm:num_requests_waiting` (the
    ServiceMonitor's job="kvgate" endpoint), not vLLM's own series, and both scale the Deployment."""
    scaled = one(rendered["keda"], "ScaledObject")
    hpa = one(rendered["hpa"], "HorizontalPodAutoscaler")
    monitor = one(rendered["keda"], "ServiceMonitor")
    jobs = {
        e.get("port", e.get("targetPort")): r["replacement"]
        for e in monitor["spec"]["endpoints"]
        for r in e.get("relabelings", [])
        if r.get("targetLabel") == "job"
    }
    assert jobs["http"] == "kvgate"  # the Service's port "http" is kvgate's
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    assert 'vllm:num_requests_waiting{job="kvgate", namespace="llm"}' in query
    for target in (scaled["spec"]["scaleTargetRef"], hpa["spec"]["scaleTargetRef"]):
        assert target["kind"] == "Deployment"
        assert target["name"] == "kvgate-vllm"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    text = DOCS.read_text()
    assert "vllm_num_requests_waiting" in text  # the adapter rule
    assert 'job="kvgate"' in text


def test_docs_cover_the_pool(rendered: dict[str, list[dict[str, Any]]]) -> None:
    text = DOCS.read_text()
    for needle in (
        "kubectl apply -k deploy/kubernetes/overlays/inference-pool",
        "## In an InferencePool",
        "## Autoscaling",
        "## Data parallelism",
        "## Prefill/decode disaggregation",
        "8200",
        "bench/results/fleet/",
    ):
        assert needle in text, needle
