"""``deploy/kubernetes/``, checked offline: the core kinds (Namespace, ConfigMap, DaemonSet, Service) against the
Kubernetes JSON schemas that the ``kubernetes-validate`` package carries (strict: an unknown field fails); the
Gateway API and inference-extension kinds (InferencePool, HTTPRoute), for which it has no schema, field by field;
and what ties the files together: the ConfigMap's ``appliance.yaml``, completed by its own ``complete.py`` the way
the DaemonSet's init container runs it, passes the appliance's config validation and serves ``/v1/health`` and
``/metrics`` without the token (the kubelet's probes, the endpoint picker) while the API wants it; the ports,
labels, mounts and the endpoint picker's gauge names agree with the DaemonSet, the config and
``appliance/http/metrics.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import pytest
import yaml

from appliance.config.validate import ConfigInvalid, parse_config
from appliance.http import metrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33"
"""The Kubernetes release the core kinds are checked against (kubernetes-validate carries its schemas)."""
CORE_KINDS = {"Namespace", "ConfigMap", "DaemonSet", "Service"}
TOKEN = "fleet-test-token-0123456789"
UP_S = 90.0


def documents() -> list[tuple[str, dict[str, Any]]]:
    """Every manifest in deploy/kubernetes/ (the kustomization aside), with its file's name."""
    found = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            assert isinstance(document, dict), f"{path.name}: a document that is not a mapping"
            found.append((path.name, document))
    return found


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    matching = [doc for _, doc in documents() if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    assert len(matching) == 1, f"{len(matching)} {kind} named {name}"
    return matching[0]


def appliance_yaml() -> str:
    return one("ConfigMap", "appliance-config")["data"]["appliance.yaml"]


def completed(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """The ConfigMap's complete.py run as the init container runs it: SOURCE TARGET, the token and node name from
    the environment (``env``: what is set)."""
    data = one("ConfigMap", "appliance-config")["data"]
    (tmp_path / "complete.py").write_text(data["complete.py"])
    (tmp_path / "appliance.yaml").write_text(data["appliance.yaml"])
    clean = {key: value for key, value in os.environ.items() if key not in ("APPLIANCE_API_TOKEN", "NODE_NAME")}
    return subprocess.run([sys.executable, str(tmp_path / "complete.py"), str(tmp_path / "appliance.yaml"),
                           str(tmp_path / "completed.yaml")], env={**clean, **env}, capture_output=True, text=True,
                          timeout=60)


def pod_spec() -> dict[str, Any]:
    return one("DaemonSet", "appliance")["spec"]["template"]["spec"]


def container(name: str, *, init: bool = False) -> dict[str, Any]:
    listed = pod_spec()["initContainers" if init else "containers"]
    return next(item for item in listed if item["name"] == name)


def metric_spec(text: str) -> tuple[str, dict[str, str]]:
    """An endpoint-picker metric spec (``name{label="value",...}``) as its name and labels."""
    match = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?', text)
    assert match, text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
    return match.group(1), labels


def test_every_manifest_names_its_kind_and_the_kustomization_lists_every_file() -> None:
    for file, document in documents():
        assert {"apiVersion", "kind", "metadata"} <= set(document), file
        assert document["metadata"].get("name"), file
        if document["kind"] != "Namespace":
            assert document["metadata"].get("namespace") == "appliance", file
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(path.name for path in DEPLOY.glob("*.yaml")
                                                        if path.name != "kustomization.yaml")


def test_the_core_kinds_pass_the_kubernetes_schemas_strictly() -> None:
    kinds = set()
    for _, document in documents():
        if document["kind"] in CORE_KINDS:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
            kinds.add(document["kind"])
    assert kinds == CORE_KINDS


def test_the_validator_catches_a_broken_daemonset() -> None:
    """The check above can fail: a misspelt field and a port that is not a number are refused."""
    daemonset = one("DaemonSet", "appliance")
    misspelt = json.loads(json.dumps(daemonset))
    misspelt["spec"]["template"]["spec"]["nodeSelecter"] = {"a": "b"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
    bad_port = json.loads(json.dumps(daemonset))
    bad_port["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad_port, KUBERNETES_VERSION, strict=True)


def test_the_inference_pool_and_route_have_the_fields_their_apis_require() -> None:
    pool = one("InferencePool", "appliance")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    assert spec["selector"]["matchLabels"].items() <= one("DaemonSet")["spec"]["template"]["metadata"][
        "labels"].items()
    port = yaml.safe_load(appliance_yaml())["http"]["port"]
    assert spec["targetPorts"] == [{"number": port}]
    picker = spec["endpointPickerRef"]
    assert picker["name"] and picker["port"]["number"] == 9002 and picker["failureMode"] in ("FailOpen", "FailClose")
    route = one("HTTPRoute", "appliance")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] and all(ref["name"] for ref in route["spec"]["parentRefs"])
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "appliance"}]


def test_the_configmaps_config_needs_the_token_and_complete_py_fills_it_in(tmp_path: Path) -> None:
    with pytest.raises(ConfigInvalid) as refused:  # as shipped it binds 0.0.0.0 without a token: refused
        parse_config(appliance_yaml())
    problems = [str(problem) for problem in refused.value.problems]
    assert any("requires http.api_token" in problem for problem in problems), problems
    missing = completed(tmp_path, NODE_NAME="gpu-node-1")
    assert missing.returncode != 0 and "APPLIANCE_API_TOKEN not set" in missing.stderr
    assert not (tmp_path / "completed.yaml").exists()
    done = completed(tmp_path, APPLIANCE_API_TOKEN=TOKEN, NODE_NAME="gpu-node-1")
    assert done.returncode == 0, done.stderr
    config = parse_config((tmp_path / "completed.yaml").read_text())
    assert config.http.api_token == TOKEN and config.http.instance_name == "gpu-node-1"
    assert config.http.scrape_without_token and config.http.confirm_public_scrape


def test_the_pod_mounts_what_the_config_names_and_probes_its_port() -> None:
    config = yaml.safe_load(appliance_yaml())
    spec = pod_spec()
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    init = container("complete-config", init=True)
    main = container("appliance")
    for item in (init, main):
        assert {mount["name"] for mount in item["volumeMounts"]} <= set(volumes)
        assert item["image"] == main["image"]
    mounts = {mount["mountPath"]: mount["name"] for mount in main["volumeMounts"]}
    assert volumes[mounts[config["data_dir"]]]["hostPath"]["path"] == config["data_dir"]  # state stays on the node
    assert mounts[str(Path(config["socket"]["path"]).parent)] == "run"
    init_mounts = {mount["mountPath"]: mount["name"] for mount in init["volumeMounts"]}
    script, source, target = init["command"][1:]
    assert init_mounts[str(Path(script).parent)] == init_mounts[str(Path(source).parent)] == "config"
    assert init_mounts[str(Path(target).parent)] == mounts[str(Path(target).parent)] == "completed-config"
    assert main["command"] == ["appliance", "run", "--config", target]
    assert volumes["config"]["configMap"]["name"] == "appliance-config"
    env = {item["name"]: item["valueFrom"] for item in init["env"]}
    assert env["APPLIANCE_API_TOKEN"]["secretKeyRef"] == {"name": "appliance-token", "key": "api-token"}
    assert env["NODE_NAME"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    ports = {port["name"]: port["containerPort"] for port in main["ports"]}
    assert ports == {"http": config["http"]["port"]}
    for probe in ("readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"] == {"path": "/v1/health", "port": "http"}
    assert main["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    service = one("Service", "appliance")["spec"]
    assert service["selector"].items() <= one("DaemonSet")["spec"]["template"]["metadata"]["labels"].items()
    assert service["ports"][0]["targetPort"] == "http"


def test_the_endpoint_picker_reads_the_appliances_own_gauges_for_the_pools_model() -> None:
    epp = yaml.safe_load(one("ConfigMap", "appliance-epp-config")["data"]["config.yaml"])
    assert epp["kind"] == "EndpointPickerConfig" and epp["apiVersion"] == "llm-d.ai/v1alpha1"
    plugins = {plugin["type"]: plugin.get("parameters", {}) for plugin in epp["plugins"]}
    extractor = plugins["core-metrics-extractor"]
    engine_label = extractor["engineLabelKey"]
    pod_labels = one("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    [engine] = [config for config in extractor["engineConfigs"] if config["name"] == pod_labels[engine_label]]
    model = yaml.safe_load(appliance_yaml())["models"][0]["name"]
    wanted = {"queuedRequestsSpec": metrics.VLLM_WAITING, "runningRequestsSpec": metrics.VLLM_RUNNING,
              "kvUsageSpec": metrics.VLLM_KV_USAGE}
    for key, name in wanted.items():
        assert metric_spec(engine[key]) == (name, {metrics.VLLM_MODEL_LABEL: model}), key
    session = plugins["session-affinity-scorer"]
    assert session["strategy"] == "session_id"
    assert session["sessionIdConfig"]["sources"] == [{"header": "x-agent-id"}]  # the appliance's X-Agent-Id
    profile = {ref["pluginRef"] for ref in epp["schedulingProfiles"][0]["plugins"]}
    assert {"session-affinity-scorer", "prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer",
            "max-score-picker"} <= profile <= set(plugins)
    assert plugins["metrics-data-source"]["path"] == "/metrics"


@pytest.fixture
def deployed_config(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``appliance run`` on the completed ConfigMap config, moved onto this machine: a temporary data_dir and
    socket, loopback, any free port, a fake device and a tiny model in place of the pool's."""
    assert completed(tmp_path, APPLIANCE_API_TOKEN=TOKEN, NODE_NAME="gpu-node-1").returncode == 0
    config = yaml.safe_load((tmp_path / "completed.yaml").read_text())
    state = Path(tempfile.mkdtemp(prefix="k8s-"))
    config.update(data_dir=str(state), device="fake:8GiB", socket={"path": str(state / "a.sock")},
                  resync_interval_s=0, engine={"warmup_runs": 0})
    config["http"].update(host="127.0.0.1", port=0)
    config["models"][0].update(path=str(state / "models" / "m.gguf"),
                               generate_if_missing={"layers": 2, "dim": 64, "seed": 5})
    path = state / "appliance.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(path)], cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + UP_S
        while not (state / "registry.json").exists():
            assert process.poll() is None, "the appliance exited"
            assert time.monotonic() < deadline, "the appliance did not come up"
            time.sleep(0.1)
        yield json.loads((state / "registry.json").read_text())["http"], state
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        subprocess.run(["rm", "-rf", str(state)], check=False)


def test_the_deployed_config_lets_probes_and_the_picker_in_without_the_token(
        deployed_config: tuple[str, Path]) -> None:
    url, _ = deployed_config
    model = yaml.safe_load(appliance_yaml())["models"][0]["name"]
    health = httpx.get(f"{url}/v1/health", timeout=30)
    assert health.status_code == 200 and health.headers["x-appliance-instance"] == "gpu-node-1"
    scraped = httpx.get(f"{url}/metrics", timeout=30)
    assert scraped.status_code == 200
    for name in (metrics.VLLM_WAITING, metrics.VLLM_RUNNING, metrics.VLLM_KV_USAGE):
        assert f'{name}{{{metrics.VLLM_MODEL_LABEL}="{model}"}}' in scraped.text, name
    assert httpx.get(f"{url}/v1/models", timeout=30).status_code == 401
    listed = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert listed.status_code == 200 and [entry["id"] for entry in listed.json()["data"]] == [model]
