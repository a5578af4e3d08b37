"""deploy/kubernetes: the kustomization renders, every object validates, and the pod is wired right.

Rendering: a small kustomize in Python below (resources, namespace, images, replicas,
configMapGenerator with merge, strategic-merge patches: the features deploy/ uses, and it refuses
any other). Where `kubectl` is installed (it bundles kustomize), the Python rendering must equal
`kubectl kustomize` object for object, so the Python renderer is itself checked against the real
tool.

Validation, offline: built-in kinds against the Kubernetes OpenAPI schemas shipped by
kubernetes-validate, in strict mode (unknown fields are errors); ServiceMonitor and
PrometheusRule against JSON schemas written from the Prometheus Operator CRDs (deploy/schemas/).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvgate.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "deploy" / "kubernetes" / "base"
EXAMPLE = ROOT / "deploy" / "kubernetes" / "overlays" / "example"
SIDECAR = ROOT / "deploy" / "kubernetes" / "overlays" / "sidecar-example"
SCHEMAS = ROOT / "deploy" / "schemas"
DOCS = ROOT / "docs" / "deploy.md"

# Oldest Kubernetes these manifests target, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "RuntimeClass"}
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring-v1.json",
}

# ---------------------------------------------------------------------------------------------
# A small kustomize
# ---------------------------------------------------------------------------------------------

_KNOWN_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "namespace",
    "images",
    "replicas",
    "configMapGenerator",
    "generatorOptions",
    "patches",
}
# Strategic-merge keys of the lists deploy/ patches (from the Kubernetes API's patchMergeKey).
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}


def _load_yaml_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _find(objects: list[dict], kind: str, name: str) -> dict | None:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) <= 1, f"two {kind}/{name}"
    return hits[0] if hits else None


def _strategic_merge(target: dict, patch: dict) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _strategic_merge(target[key], value)
        elif isinstance(value, list) and key in _MERGE_KEYS and isinstance(target.get(key), list):
            # As kustomize orders them: the patch's items first, then the untouched ones.
            merge_key = _MERGE_KEYS[key]
            patched, deleted = [], set()
            for item in value:
                existing = next((e for e in target[key] if e.get(merge_key) == item.get(merge_key)), None)
                if item.get("$patch") == "delete":
                    deleted.add(item.get(merge_key))
                elif existing is None:
                    patched.append(copy.deepcopy(item))
                else:
                    _strategic_merge(existing, item)
                    patched.append(existing)
            keys = {e.get(merge_key) for e in patched} | deleted
            target[key] = patched + [e for e in target[key] if e.get(merge_key) not in keys]
        else:
            target[key] = copy.deepcopy(value)


def _configmap(folder: Path, spec: dict, options: dict) -> dict:
    data: dict[str, str] = {}
    for literal in spec.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    for entry in spec.get("files", []):
        key, _, rel = entry.rpartition("=") if "=" in entry else ("", "", entry)
        data[key or Path(rel).name] = (folder / rel).read_text()
    labels = {**options.get("labels", {}), **spec.get("options", {}).get("labels", {})}
    metadata: dict = {"name": spec["name"]}
    if labels:
        metadata["labels"] = labels
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def _image_name(image: str) -> tuple[str, str]:
    """('registry/name', ':tag' or '@digest' or '')."""
    if "@" in image:
        name, _, digest = image.partition("@")
        return name, "@" + digest
    head, _, last = image.rpartition("/")
    if ":" in last:
        last, _, tag = last.partition(":")
        return (f"{head}/{last}" if head else last), ":" + tag
    return image, ""


def _pod_containers(obj: dict) -> Iterator[dict]:
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    yield from spec.get("initContainers", [])
    yield from spec.get("containers", [])


def _kustomization(folder: Path, kind: str = "Kustomization") -> dict:
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert k["kind"] == kind, f"{folder}: a {k['kind']}, not a {kind}"
    unknown = set(k) - _KNOWN_FIELDS
    assert not unknown, f"{folder}: the test's kustomize does not implement {sorted(unknown)}"
    return k


def _json_patch(target: dict, operations: list[dict]) -> None:
    """RFC 6902, the one operation deploy/ uses: replace an existing value."""
    for op in operations:
        assert op["op"] == "replace", f"JSON patch op {op['op']} is not implemented"
        *parents, last = [p for p in op["path"].split("/")[1:]]
        node = target
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key = int(last) if isinstance(node, list) else last
        assert key in range(len(node)) if isinstance(node, list) else key in node, op["path"]
        node[key] = copy.deepcopy(op["value"])


def _apply_patches(folder: Path, k: dict, objects: list[dict]) -> None:
    """File patches: strategic merges naming their object, or with a `target` (kind, optional
    name) a strategic merge or JSON patch applied to every object it selects."""
    for entry in k.get("patches", []):
        assert set(entry) <= {"path", "target"}, f"only file patches are implemented: {entry}"
        if "target" not in entry:
            for patch in _load_yaml_docs(folder / entry["path"]):
                target = _find(objects, patch["kind"], patch["metadata"]["name"])
                assert target is not None, f"patch {entry['path']} targets a missing {patch['kind']}"
                _strategic_merge(target, patch)
            continue
        selector = entry["target"]
        assert set(selector) <= {"kind", "name"}, f"target selectors implemented: kind, name: {selector}"
        chosen = [
            o
            for o in objects
            if o["kind"] == selector["kind"] and selector.get("name", o["metadata"]["name"]) == o["metadata"]["name"]
        ]
        assert chosen, f"patch {entry['path']} selects nothing"
        patch = yaml.safe_load((folder / entry["path"]).read_text())
        for target in chosen:
            if isinstance(patch, list):
                _json_patch(target, patch)
            else:
                _strategic_merge(target, {k: v for k, v in patch.items() if k != "metadata"})


def render(folder: Path) -> list[dict]:
    """The objects `kubectl kustomize folder` prints, for the kustomize features deploy/ uses."""
    k = _kustomization(folder)
    objects: list[dict] = []
    for resource in k.get("resources", []):
        path = (folder / resource).resolve()
        objects += render(path) if path.is_dir() else _load_yaml_docs(path)

    options = k.get("generatorOptions", {})
    for spec in k.get("configMapGenerator", []):
        generated = _configmap(folder, spec, options)
        existing = _find(objects, "ConfigMap", spec["name"])
        behavior = spec.get("behavior", "create")
        if behavior == "create":
            assert existing is None, f"configMapGenerator {spec['name']} exists already"
            assert options.get("disableNameSuffixHash"), "name-suffix hashes are not implemented"
            objects.append(generated)
        elif behavior == "merge":
            assert existing is not None, f"configMapGenerator merge: no {spec['name']}"
            existing.setdefault("data", {}).update(generated["data"])
            existing["metadata"].setdefault("labels", {}).update(generated["metadata"].get("labels", {}))
            if not existing["metadata"]["labels"]:
                del existing["metadata"]["labels"]
        else:
            raise AssertionError(f"configMapGenerator behavior {behavior} is not implemented")

    for component in k.get("components", []):
        _apply_patches(folder / component, _kustomization(folder / component, "Component"), objects)
    _apply_patches(folder, k, objects)

    for entry in k.get("replicas", []):
        target = next(o for o in objects if o["metadata"]["name"] == entry["name"] and "replicas" in o.get("spec", {}))
        target["spec"]["replicas"] = entry["count"]

    for entry in k.get("images", []):
        for obj in objects:
            for container in _pod_containers(obj):
                name, suffix = _image_name(container["image"])
                if name != entry["name"]:
                    continue
                if "digest" in entry:
                    suffix = "@" + entry["digest"]
                elif "newTag" in entry:
                    suffix = ":" + str(entry["newTag"])
                container["image"] = entry.get("newName", name) + suffix

    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    return objects


def by_key(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


RENDERED = {"base": render(BASE), "example": render(EXAMPLE), "sidecar": render(SIDECAR)}
FOLDERS = {"base": BASE, "example": EXAMPLE, "sidecar": SIDECAR}


def kind(objects: list[dict], name: str) -> list[dict]:
    return [o for o in objects if o["kind"] == name]


def pod_spec(objects: list[dict]) -> dict:
    (deployment,) = kind(objects, "Deployment")
    return deployment["spec"]["template"]["spec"]


def container(objects: list[dict], name: str) -> dict:
    return next(c for c in pod_spec(objects)["containers"] if c["name"] == name)


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def engine_config(objects: list[dict]) -> dict[str, str]:
    cm = by_key(objects)[("ConfigMap", "kvgate-engine")]
    return cm["data"]


def resolved_env(objects: list[dict], c: dict) -> dict[str, str]:
    """The container's environment with configMapKeyRef values filled in."""
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in kind(objects, "ConfigMap")}
    out = {}
    for name, entry in env_of(c).items():
        if "value" in entry:
            out[name] = entry["value"]
        elif "configMapKeyRef" in entry.get("valueFrom", {}):
            ref = entry["valueFrom"]["configMapKeyRef"]
            out[name] = configmaps[ref["name"]][ref["key"]]
    return out


def script(c: dict) -> str:
    assert c["command"] == ["/bin/sh", "-c"], c["name"]
    (text,) = c["args"]
    return text


# ---------------------------------------------------------------------------------------------
# Rendering and schemas
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["base", "example", "sidecar"])
def test_python_rendering_equals_kubectl_kustomize(name: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the Python rendering is not cross-checked")
    out = subprocess.run(
        [kubectl, "kustomize", str(FOLDERS[name])], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    theirs = by_key(_load_yaml_docs_text(out))
    ours = by_key(RENDERED[name])
    assert sorted(theirs) == sorted(ours)
    for key in ours:
        assert ours[key] == theirs[key], key


def _load_yaml_docs_text(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def validate(obj: dict, version: str) -> None:
    """Raise if obj does not validate; built-ins strictly, CRDs against deploy/schemas/."""
    crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd is not None:
        schema = json.loads((SCHEMAS / crd).read_text())
        jsonschema.Draft202012Validator(schema).validate(obj)
    else:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", ["base", "example"])
def test_every_object_validates_against_its_schema(name: str, version: str) -> None:
    objects = RENDERED[name]
    assert {o["kind"] for o in objects} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ConfigMap",
        "ServiceMonitor",
        "PrometheusRule",
    }
    problems = []
    for obj in objects:
        try:
            validate(obj, version)
        except (jsonschema.ValidationError, kubernetes_validate.utils.SchemaNotFoundError) as exc:
            detail = getattr(exc, "message", str(exc))
            path = ".".join(str(p) for p in getattr(exc, "absolute_path", []))
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {detail}")
    assert problems == []


def test_the_schemas_refuse_mistakes() -> None:
    """Negative controls: the validation above is not vacuous."""
    objects = copy.deepcopy(RENDERED["example"])
    deployment = by_key(objects)[("Deployment", "kvgate-vllm")]
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][1]["readinesProbe"] = {}
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    monitor = copy.deepcopy(by_key(objects)[("ServiceMonitor", "kvgate-vllm")])
    del monitor["spec"]["selector"]
    rule = copy.deepcopy(by_key(objects)[("PrometheusRule", "kvgate")])
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    both = copy.deepcopy(by_key(objects)[("PrometheusRule", "kvgate")])
    both["spec"]["groups"][0]["rules"][0]["record"] = "kvgate:x"
    for bad in (typo, wrong_type, monitor, rule, both):
        with pytest.raises(jsonschema.ValidationError):
            validate(bad, K8S_VERSIONS[0])


def test_shell_scripts_and_init_code_parse() -> None:
    objects = RENDERED["example"]
    for name in ("vllm", "kvgate"):
        subprocess.run(["sh", "-n", "-c", script(container(objects, name))], check=True)
    (init,) = pod_spec(objects)["initContainers"]
    assert init["command"] == ["python3", "-c"]
    compile(init["args"][0], "fetch-model", "exec")


# ---------------------------------------------------------------------------------------------
# The pod: vLLM and the kvgate sidecar
# ---------------------------------------------------------------------------------------------

ENGINE_FLAGS = [  # kvgate settings that must equal vLLM's flags of the same name
    "served_model_name",
    "max_model_len",
    "max_num_batched_tokens",
    "max_num_seqs",
    "block_size",
    "tensor_parallel_size",
    "kv_cache_dtype",
    "gpu_memory_utilization",
    "long_prefill_token_threshold",
    "enable_prefix_caching",
]


def configmap_key(c: dict, env_name: str) -> str:
    ref = env_of(c)[env_name]["valueFrom"]["configMapKeyRef"]
    assert ref["name"] == "kvgate-engine"
    return ref["key"]


@pytest.mark.parametrize("name", ["base", "example"])
def test_vllm_and_kvgate_read_each_engine_flag_from_the_same_key(name: str) -> None:
    objects = RENDERED[name]
    vllm, kvgate = container(objects, "vllm"), container(objects, "kvgate")
    flags = dict(re.findall(r'--([a-z0-9-]+) "\$([A-Z_]+)"', script(vllm)))
    for field in ENGINE_FLAGS:
        key = configmap_key(kvgate, f"KVGATE_{field.upper()}")
        if field == "enable_prefix_caching":
            text = script(vllm)
            assert f'"${key}" = "true"' in text
            assert "--enable-prefix-caching" in text
            assert "--no-enable-prefix-caching" in text
            continue
        flag = field.replace("_", "-")
        assert flag in flags, f"vLLM is not given --{flag}"
        assert configmap_key(vllm, flags[flag]) == key, field
    # not a flag: vLLM's allocator setting, which kvgate cannot read and is told
    key = configmap_key(kvgate, "KVGATE_EXPANDABLE_SEGMENTS")
    assert configmap_key(vllm, key) == key
    assert f'"${key}" = "true"' in script(vllm)
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in script(vllm)


@pytest.mark.parametrize("name", ["base", "example"])
def test_kvgate_environment_is_valid_settings(name: str) -> None:
    """Every KVGATE_* variable names a real setting, and the values parse."""
    objects = RENDERED[name]
    env = resolved_env(objects, container(objects, "kvgate"))
    given = {k.removeprefix("KVGATE_").lower(): v for k, v in env.items() if k.startswith("KVGATE_")}
    assert set(given) <= set(Settings.model_fields), set(given) - set(Settings.model_fields)
    settings = Settings(**given)
    assert settings.backend == "http://127.0.0.1:8000"
    assert settings.gpu_memory_bytes
    assert settings.gpu_memory_bytes > 8 * 2**30
    assert settings.enable_prefix_caching is True
    assert settings.gpu_probe == "nvml"


@pytest.mark.parametrize("name", ["base", "example"])
def test_kvgate_reaches_vllm_on_localhost_and_reads_the_same_model(name: str) -> None:
    objects = RENDERED[name]
    vllm, kvgate = container(objects, "vllm"), container(objects, "kvgate")
    env = resolved_env(objects, kvgate)
    port = next(p["containerPort"] for p in vllm["ports"] if p["name"] == "vllm")
    assert env["KVGATE_BACKEND"] == f"http://127.0.0.1:{port}"
    assert f"--port {port}" in script(vllm)
    model_dir = env["KVGATE_MODEL"]
    assert f"vllm serve {model_dir} " in script(vllm)
    mounts = {m["name"]: m for m in kvgate["volumeMounts"]}
    assert model_dir.startswith(mounts["model"]["mountPath"] + "/")
    assert mounts["model"]["readOnly"]
    assert any(m["name"] == "model" for m in vllm["volumeMounts"])
    (init,) = pod_spec(objects)["initContainers"]
    assert f'pathlib.Path("{model_dir}")' in init["args"][0]


@pytest.mark.parametrize("name", ["base", "example"])
def test_gpu_goes_to_vllm_and_nvml_to_kvgate_without_a_second_gpu(name: str) -> None:
    objects = RENDERED[name]
    spec = pod_spec(objects)
    vllm, kvgate = container(objects, "vllm"), container(objects, "kvgate")
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in kvgate["resources"].get(section, {})
    assert spec["runtimeClassName"] == "nvidia"
    env = resolved_env(objects, kvgate)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    handoff = {m["name"]: m["mountPath"] for m in kvgate["volumeMounts"]}["gpu-handoff"]
    assert handoff in script(vllm)
    assert handoff in script(kvgate)


def _run_script(text: str, handoff: Path, bin_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", "-c", text.replace("/run/kvgate", str(handoff))],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize(
    ("smi", "expected"),
    [
        ("GPU 0: NVIDIA L4 (UUID: GPU-1111-aaaa)\n", "GPU-1111-aaaa"),
        (
            "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-2222-bbbb)\n"
            "  MIG 3g.40gb     Device  0: (UUID: MIG-3333-cccc)\n"
            "  MIG 3g.40gb     Device  1: (UUID: MIG-4444-dddd)\n",
            "MIG-3333-cccc,MIG-4444-dddd",
        ),
    ],
)
def test_the_containers_scripts_pass_flags_and_gpu_uuids(tmp_path: Path, smi: str, expected: str) -> None:
    """Run the real scripts with stand-ins for nvidia-smi, vllm and kvgate."""
    objects = RENDERED["example"]
    handoff, bin_dir = tmp_path / "handoff", tmp_path / "bin"
    handoff.mkdir()
    bin_dir.mkdir()
    (tmp_path / "smi.txt").write_text(smi)
    _fake(bin_dir, "nvidia-smi", f'cat "{tmp_path}/smi.txt"\n')
    _fake(bin_dir, "vllm", 'printf "%s\\n" "$@" "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-}"\n')
    _fake(bin_dir, "kvgate", 'printf "%s %s\\n" "$*" "$KVGATE_GPU_DEVICES"\n')

    vllm = container(objects, "vllm")
    ran = _run_script(script(vllm), handoff, bin_dir, resolved_env(objects, vllm))
    assert ran.returncode == 0, ran.stderr
    args = ran.stdout.split("\n")
    config = engine_config(objects)
    assert args[:2] == ["serve", "/models/model"]
    for flag, key in [
        ("--max-num-batched-tokens", "MAX_NUM_BATCHED_TOKENS"),
        ("--max-model-len", "MAX_MODEL_LEN"),
        ("--served-model-name", "SERVED_MODEL_NAME"),
        ("--gpu-memory-utilization", "GPU_MEMORY_UTILIZATION"),
        ("--block-size", "BLOCK_SIZE"),
        ("--max-num-seqs", "MAX_NUM_SEQS"),
    ]:
        assert args[args.index(flag) + 1] == config[key]
    assert "--enable-prefix-caching" in args
    assert config["EXPANDABLE_SEGMENTS"] == "true"
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in args
    assert (handoff / "nvidia-visible-devices").read_text().strip() == expected

    kvgate = container(objects, "kvgate")
    ran = _run_script(script(kvgate), handoff, bin_dir, resolved_env(objects, kvgate))
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == f"serve {expected}"


@pytest.mark.parametrize("name", ["base", "example"])
def test_probes_resources_and_security(name: str) -> None:
    objects = RENDERED[name]
    spec = pod_spec(objects)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    kvgate, vllm = container(objects, "kvgate"), container(objects, "vllm")
    assert kvgate["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert kvgate["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert kvgate["startupProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "vllm"}
    for c in [*spec["initContainers"], *spec["containers"]]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert sc["runAsUser"] != 0, c["name"]
        assert {"requests", "limits"} <= set(c["resources"]), c["name"]
        assert "memory" in c["resources"]["limits"], c["name"]
    assert kvgate["securityContext"]["readOnlyRootFilesystem"] is True
    assert kvgate["securityContext"]["runAsUser"] == 10001  # the Dockerfile's user
    listen_port = int(resolved_env(objects, kvgate)["KVGATE_LISTEN"].rpartition(":")[2])
    assert [p["containerPort"] for p in kvgate["ports"] if p["name"] == "http"] == [listen_port]


@pytest.mark.parametrize("name", ["base", "example"])
def test_service_exposes_kvgate_only(name: str) -> None:
    objects = RENDERED[name]
    (service,) = kind(objects, "Service")
    pod_labels = kind(objects, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    kvgate_ports = {p["name"]: p["containerPort"] for p in container(objects, "kvgate")["ports"]}
    vllm_ports = {p["name"]: p["containerPort"] for p in container(objects, "vllm")["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in kvgate_ports or port["targetPort"] in kvgate_ports.values()
        assert port["targetPort"] not in vllm_ports
        assert port["targetPort"] not in vllm_ports.values()
        assert port["port"] not in vllm_ports.values()


@pytest.mark.parametrize("name", ["base", "example"])
def test_pdb_and_network_policy_select_the_pod(name: str) -> None:
    objects = RENDERED[name]
    pod_labels = kind(objects, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    (pdb,) = kind(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] == 1
    (policy,) = kind(objects, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    open_to_all = [r for r in policy["spec"]["ingress"] if "from" not in r]
    assert [p["port"] for r in open_to_all for p in r["ports"]] == ["http"]
    vllm_rule = next(r for r in policy["spec"]["ingress"] if any(p["port"] == "vllm" for p in r["ports"]))
    assert vllm_rule["from"], "vLLM's port must not be open to everyone"


@pytest.mark.parametrize("name", ["base", "example"])
def test_service_monitor_scrapes_kvgate_and_vllm(name: str) -> None:
    objects = RENDERED[name]
    (monitor,) = kind(objects, "ServiceMonitor")
    (service,) = kind(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    kvgate_endpoint, vllm_endpoint = monitor["spec"]["endpoints"]
    assert kvgate_endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert vllm_endpoint["targetPort"] in {p["name"] for p in container(objects, "vllm")["ports"]}
    for endpoint, job in ((kvgate_endpoint, "kvgate"), (vllm_endpoint, "vllm")):
        assert endpoint["path"] == "/metrics"
        assert {"targetLabel": "job", "replacement": job} in endpoint["relabelings"]


REQUIRED_ALERTS = {
    "KvgateBackendRestarted",
    "KvgateQueueWaitHigh",
    "KvgateRejectionRateHigh",
    "KvgateScrapeStale",
    "KvgateGpuHeadroomLow",
}


def alert_rules(objects: list[dict]) -> list[dict]:
    (rule,) = kind(objects, "PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]


@pytest.mark.parametrize("name", ["base", "example"])
def test_prometheus_rule_has_the_alerts(name: str) -> None:
    rules = alert_rules(RENDERED[name])
    assert {r["alert"] for r in rules} >= REQUIRED_ALERTS
    for r in rules:
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert r["annotations"]["summary"], r["alert"]
        assert len(r["annotations"]["description"]) > 80, r["alert"]
        assert r["expr"].count("(") == r["expr"].count(")"), r["alert"]


@pytest.mark.parametrize("name", ["base", "example"])
def test_dashboard_configmap_carries_the_dashboard(name: str) -> None:
    objects = RENDERED[name]
    cm = by_key(objects)[("ConfigMap", "kvgate-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    source = (BASE / "dashboards" / "kvgate.json").read_text()
    assert cm["data"] == {"kvgate.json": source}
    dashboard = json.loads(source)
    assert dashboard["uid"]
    assert dashboard["title"]
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Budget against use", "Decisions", "Queue", "Latency added by kvgate", "Backend state"]
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in graphs:
        assert panel["targets"], panel["title"]
        assert all(t["expr"] for t in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert variables == {"datasource", "namespace", "pod"}


def test_example_overlay_is_complete() -> None:
    """What `kubectl apply -k overlays/example` creates, in one namespace, with real images."""
    objects = RENDERED["example"]
    namespaces = [o["metadata"]["name"] for o in kind(objects, "Namespace")]
    assert namespaces == ["llm"]
    for obj in objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            assert obj["metadata"]["namespace"] == "llm", obj["kind"]
    (deployment,) = kind(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2
    for c in _pod_containers(deployment):
        name, suffix = _image_name(c["image"])
        assert "/" in name, c["image"]
        assert suffix.startswith(":"), c["image"]
        assert suffix != ":latest", c["image"]
    assert container(objects, "kvgate")["image"] == "registry.example.com/kvgate:0.1.0"
    for k in ("ServiceMonitor", "PrometheusRule"):
        assert kind(objects, k)[0]["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    # The overlay's merge kept the base's keys and changed the model.
    assert engine_config(objects).keys() == engine_config(RENDERED["base"]).keys()
    assert engine_config(objects)["MODEL_ID"] == "Qwen/Qwen2.5-7B-Instruct"
    assert resolved_env(objects, container(objects, "kvgate"))["KVGATE_MAX_QUEUE_WAIT"] == "60"


def test_docs_explain_every_knob() -> None:
    """docs/deploy.md names every engine key, every kvgate variable set, and every alert."""
    text = DOCS.read_text()
    objects = RENDERED["base"]
    missing = [k for k in engine_config(objects) if k not in text]
    missing += [k for k in env_of(container(objects, "kvgate")) if k not in text]
    missing += [r["alert"] for r in alert_rules(objects) if f"`{r['alert']}`" not in text]
    for needle in (
        "runtimeClassName",
        "NVIDIA_VISIBLE_DEVICES",
        "MIG",
        "host PID",
        "release:",
        "kubectl apply -k deploy/kubernetes/overlays/example",
        "docker build",
    ):
        if needle not in text:
            missing.append(needle)
    assert missing == []


# ---------------------------------------------------------------------------------------------
# The kvgate-sidecar component, added to an existing vLLM Deployment
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_sidecar_example_validates_against_its_schema(version: str) -> None:
    objects = RENDERED["sidecar"]
    assert sorted(o["kind"] for o in objects) == ["Deployment", "Service"]
    for obj in objects:
        validate(obj, version)


def _vllm_args(c: dict) -> dict[str, str]:
    return dict(a.removeprefix("--").split("=", 1) for a in c["args"])


def test_sidecar_joins_the_existing_vllm_unchanged_and_takes_its_service() -> None:
    objects = RENDERED["sidecar"]
    original = {(o["kind"], o["metadata"]["name"]): o for o in _load_yaml_docs(SIDECAR / "vllm.yaml")}
    spec = pod_spec(objects)
    assert [c["name"] for c in spec["containers"]] == ["kvgate", "vllm"]
    vllm = container(objects, "vllm")
    assert vllm == original[("Deployment", "vllm")]["spec"]["template"]["spec"]["containers"][0]
    kvgate = container(objects, "kvgate")
    assert kvgate["image"] == "registry.example.com/kvgate:0.1.0"
    (service,) = kind(objects, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "kvgate"
    assert any(p["name"] == "kvgate" for p in kvgate["ports"])
    assert "nvidia.com/gpu" not in kvgate["resources"]["limits"]


def test_sidecar_settings_match_the_vllm_it_joins() -> None:
    objects = RENDERED["sidecar"]
    vllm, kvgate = container(objects, "vllm"), container(objects, "kvgate")
    env = resolved_env(objects, kvgate)
    given = {k.removeprefix("KVGATE_").lower(): v for k, v in env.items() if k.startswith("KVGATE_")}
    settings = Settings(**given)
    flags = _vllm_args(vllm)
    assert settings.backend == f"http://127.0.0.1:{flags['port']}"
    assert settings.model == flags["model"]
    for field in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization"):
        assert str(getattr(settings, field)) == flags[field.replace("_", "-")], field
    # kvgate's hub cache is vLLM's: the same volume, HF_HOME/hub on each side.
    vllm_home = env_of(vllm)["HF_HOME"]["value"]
    vllm_mount = next(m for m in vllm["volumeMounts"] if vllm_home.startswith(m["mountPath"]))
    kvgate_mount = next(m for m in kvgate["volumeMounts"] if m["name"] == vllm_mount["name"])
    inside = vllm_home.removeprefix(vllm_mount["mountPath"])
    assert env["HF_HUB_CACHE"] == f"{kvgate_mount['mountPath']}{inside}/hub"
    assert kvgate_mount["readOnly"]


def test_sidecar_waits_for_the_model_then_serves_it_from_the_hub_cache(tmp_path: Path) -> None:
    """The sidecar's script, run: it waits for config.json in vLLM's hub cache, then starts
    kvgate, whose --model (the id) resolves there."""
    from kvgate.model_folder import resolve_model_folder

    objects = RENDERED["sidecar"]
    kvgate = container(objects, "kvgate")
    env = resolved_env(objects, kvgate)
    cache = tmp_path / "hub"
    snapshot = cache / ("models--" + env["KVGATE_MODEL"].replace("/", "--")) / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "kvgate", 'echo "kvgate $*"\n')
    done = subprocess.run(
        ["sh", "-c", script(kvgate)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env, "HF_HUB_CACHE": str(cache)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "kvgate serve\n", done.stderr
    import huggingface_hub.constants

    saved = huggingface_hub.constants.HF_HUB_CACHE
    huggingface_hub.constants.HF_HUB_CACHE = str(cache)
    try:
        assert resolve_model_folder(env["KVGATE_MODEL"]) == snapshot
    finally:
        huggingface_hub.constants.HF_HUB_CACHE = saved


@pytest.mark.parametrize("name", ["base", "example", "sidecar"])
def test_gpu_memory_examples_are_no_larger_than_the_gpu_they_name(name: str) -> None:
    """Every example names an L4 (or A10G): its GPU_MEMORY_BYTES must not exceed an L4's 22.05
    GiB total as CUDA reports it (the simulator's l4-24gb preset); larger is the unsafe side."""
    from kvgate.sim.presets import GPUS

    objects = RENDERED[name]
    env = resolved_env(objects, container(objects, "kvgate"))
    assert 0 < int(env["KVGATE_GPU_MEMORY_BYTES"]) <= GPUS["l4-24gb"]
