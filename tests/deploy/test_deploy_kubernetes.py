"""The Kubernetes manifests (deploy/kubernetes): they build, validate offline, and agree with the service itself.

Every overlay is rendered by `kubectl kustomize` and each built-in object is validated against the Kubernetes
schemas of the `kubernetes-validate` package (no cluster here); the custom resources (Prometheus Operator, KEDA,
Gateway API Inference Extension) have their required fields checked. The monitoring objects are generated from
deploy/rules and the dashboards, so a drift fails a test.
"""

import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from service.settings import SECTIONS, parse
from tests.conftest import needs_tools
from tests.deploy.test_deploy_config import DEPLOY, metric_catalog

K8S = DEPLOY / "kubernetes"
OVERLAYS = ["cpu", "gpu"]
K8S_VERSION = "1.32.0"  # the oldest Kubernetes these manifests target (native sidecars, policy/v1, autoscaling/v2)
CUSTOM = {"ServiceMonitor", "PrometheusRule", "ScaledObject", "InferencePool", "HTTPRoute"}


def build(overlay: str) -> dict[str, dict]:
    """kind/name -> object, as `kubectl kustomize` renders the overlay."""
    done = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in yaml.safe_load_all(done.stdout)}


@pytest.fixture(scope="module", params=OVERLAYS)
@needs_tools("kubectl")
def rendered(request) -> tuple[str, dict[str, dict]]:
    return request.param, build(request.param)


def gateway_example() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((K8S / "gateway-api/inferencepool.yaml").read_text())}


def container(objects: dict) -> dict:
    [c] = objects["Deployment/llm-service"]["spec"]["template"]["spec"]["containers"]
    return c


def settings_map(objects: dict) -> dict[str, str]:
    [cm] = [o for k, o in objects.items() if k.startswith("ConfigMap/llm-service-settings-")]
    return cm["data"]


# ---------------------------------------------------------------- build and validate

def test_every_overlay_builds_and_its_built_in_objects_validate_against_the_kubernetes_schemas(rendered):
    overlay, objects = rendered
    kinds = {o["kind"] for o in objects.values()}
    assert {"Namespace", "Deployment", "Service", "PodDisruptionBudget", "ConfigMap", "ServiceMonitor",
            "PrometheusRule", "ScaledObject"} <= kinds
    for key, obj in objects.items():
        if obj["kind"] in CUSTOM:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # no CRD schemas offline: next test
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises ValidationError with the path
    assert all(o["metadata"].get("namespace") == "llm" for o in objects.values() if o["kind"] != "Namespace")


def test_the_schema_validation_rejects_a_broken_deployment(rendered):
    """The validator used above really validates: a port given as text, or a misspelt field, fails."""
    _, objects = rendered
    broken = yaml.safe_load(yaml.safe_dump(objects["Deployment/llm-service"]))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8000"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(objects["Deployment/llm-service"]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/ready"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_custom_resources_have_their_required_fields_and_point_at_real_objects(rendered):
    _, objects = rendered
    service = objects["Service/llm-service"]
    monitor = objects["ServiceMonitor/llm-service"]["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["endpoints"]] == [p["name"] for p in service["spec"]["ports"]]
    assert all(e["path"] == "/metrics" for e in monitor["endpoints"])

    for group in objects["PrometheusRule/llm-service"]["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for rule in group["rules"]:
            assert rule["expr"] and (("record" in rule) != ("alert" in rule)), rule

    scaled = objects["ScaledObject/llm-service"]["spec"]
    assert f"Deployment/{scaled['scaleTargetRef']['name']}" in objects
    assert 1 <= scaled["minReplicaCount"] < scaled["maxReplicaCount"]
    for trigger in scaled["triggers"]:
        assert trigger["type"] == "prometheus" and trigger["metricType"] in ("AverageValue", "Value")
        assert {"serverAddress", "query", "threshold"} <= trigger["metadata"].keys()
        float(trigger["metadata"]["threshold"])  # KEDA wants a number in a string

    pool = gateway_example()["InferencePool"]["spec"]
    pod_labels = objects["Deployment/llm-service"]["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= pod_labels.items()
    assert len(pool["targetPorts"]) == 1 and pool["endpointPickerRef"]["name"]
    [rule] = gateway_example()["HTTPRoute"]["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": "llm-service"}]


def test_gpu_overlay_asks_for_an_nvidia_gpu_and_the_cpu_overlay_for_none(rendered):
    overlay, objects = rendered
    gpus = 1 if overlay == "gpu" else None
    resources = container(objects)["resources"]
    assert resources["limits"].get("nvidia.com/gpu") == gpus and resources["requests"].get("nvidia.com/gpu") == gpus
    assert {"cpu", "memory"} <= resources["requests"].keys() and {"cpu", "memory"} <= resources["limits"].keys()
    assert settings_map(objects)["LLM_DEVICE"] == ("cuda" if gpus else "cpu")
    assert container(objects)["image"] == f"llm-service:{'cuda' if gpus else 'cpu'}"


def test_monitoring_objects_are_what_generate_writes_from_the_rules_and_dashboards():
    sys.path.insert(0, str(K8S))
    try:
        import generate
    finally:
        sys.path.remove(str(K8S))
    for path, text in generate.render().items():
        assert path.read_text() == text, f"run python deploy/kubernetes/generate.py ({path.name})"
    rule = yaml.safe_load((K8S / "base/monitoring/prometheusrule.yaml").read_text())
    groups = [g for p in sorted((DEPLOY / "rules").glob("*.yml")) for g in yaml.safe_load(p.read_text())["groups"]]
    assert rule["spec"]["groups"] == groups
    maps = list(yaml.safe_load_all((K8S / "base/monitoring/dashboards.yaml").read_text()))
    shipped = {name: text for m in maps for name, text in m["data"].items()}
    assert shipped == {p.name: p.read_text() for p in (DEPLOY / "grafana/dashboards").glob("*.json")}
    assert all(m["metadata"]["labels"] == {"grafana_dashboard": "1"} for m in maps)


# ---------------------------------------------------------------- agreement with the service

def test_probes_ports_metric_names_and_drain_timeout_agree_with_the_service_settings(rendered):
    overlay, objects = rendered
    env = settings_map(objects)
    # every variable is a setting of service/settings.py and parses as one
    fields = {f"LLM_{name.upper()}" for section in SECTIONS.values() for name in section.__dataclass_fields__}
    assert env.keys() <= fields, env.keys() - fields
    settings = parse([a for key, value in env.items() for a in (f"--{key[4:].lower().replace('_', '-')}", value)])
    assert settings.server.host == "0.0.0.0"  # reachable on the pod's IP

    c = container(objects)
    [port] = c["ports"]
    assert port["containerPort"] == settings.server.port and port["name"] == "http"
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    routes = (DEPLOY.parent / "service/api/native_routes.py").read_text()
    assert '@public.get("/ready")' in routes and '@public.get("/health")' in routes  # unauthenticated probes
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # compose's start_period for a first load
    [svc_port] = objects["Service/llm-service"]["spec"]["ports"]
    assert svc_port["targetPort"] == "http" and svc_port["port"] == settings.server.port

    # shutdown: preStop, then SIGTERM drains for up to drain_timeout; the grace period must cover both
    pod = objects["Deployment/llm-service"]["spec"]["template"]["spec"]
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > int(sleep[1]) + settings.server.drain_timeout

    # the API key comes from a Secret, never from the ConfigMap
    assert "LLM_API_KEY" not in env
    [key] = [e for e in c["env"] if e["name"] == "LLM_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"]["name"]

    # runs as the image's user, with the model cache where the service writes it
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    uid = re.search(r"useradd .*--uid (\d+)", dockerfile).group(1)
    assert pod["securityContext"]["runAsUser"] == int(uid) and pod["securityContext"]["runAsNonRoot"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert "/home/app/.cache/llm-service".startswith(mounts["model-cache"] + "/")
    assert "mkdir -p /home/app/.cache/llm-service" in dockerfile

    # metric names in the autoscaler and the endpoint picker exist; the job and namespace they select are ours
    catalog = metric_catalog()
    epp = yaml.safe_load((K8S / "gateway-api/epp-values.yaml").read_text())["inferenceExtension"]["flags"]
    names = [v for v in epp.values() if v]
    scaled = objects["ScaledObject/llm-service"]["spec"]["triggers"]
    for trigger in scaled:
        query = trigger["metadata"]["query"]
        names += re.findall(r"\bllm_\w+", query)
        assert 'namespace="llm"' in query and 'job="llm-service"' in query
    assert names and set(names) <= catalog, set(names) - catalog
    assert objects["ServiceMonitor/llm-service"]["metadata"]["namespace"] == "llm"
    assert 'job="llm-service"' in (DEPLOY / "rules/llm-alerts.yml").read_text()  # job = the Service's name
    # the autoscaler acts before the alerts: its targets are below the alert thresholds
    thresholds = {r["record"]: float(re.fullmatch(r"vector\((.+)\)", r["expr"]).group(1)) for g in
                  yaml.safe_load((DEPLOY / "rules/llm-thresholds.yml").read_text())["groups"] for r in g["rules"]
                  if r["record"].startswith("llm:threshold:")}
    by_name = {t["name"]: float(t["metadata"]["threshold"]) for t in scaled}
    assert by_name["waiting-requests"] < thresholds["llm:threshold:waiting_requests"]
    assert by_name["kv-cache-usage"] < thresholds["llm:threshold:kv_cache_usage_ratio"]
    pool = gateway_example()["InferencePool"]["spec"]
    assert pool["targetPorts"] == [{"number": settings.server.port}]
