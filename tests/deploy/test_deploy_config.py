"""The deploy stack's files agree with each other and with the service, checked without Docker.

Compose is validated by Debian's docker-compose (v1) `config`; Prometheus and Alertmanager configs by
promtool and amtool. Tempo and Grafana have no binary here: their files are parsed and cross-checked
(ports, datasource uids, provisioning paths, metric names against service/telemetry/metrics.py).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.telemetry.metrics import GPUMetrics, Metrics

from tests.conftest import needs_tools

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
GRAFANA = DEPLOY / "grafana"
COMPOSE = DEPLOY / "docker-compose.yml"
GPU_OVERRIDE = DEPLOY / "docker-compose.gpu.yml"
SECRETS = "/run/llm-secrets"  # where secrets-init's volume is mounted (tests/deploy/test_deploy_secrets.py)
LOAD_COMMAND = ("python -m service bench serve --url http://lb:8000 --model SmolLM2-135M-Instruct "
                "--request-rate 2 --burstiness 1.0 --max-concurrency 16 --duration 600 --dataset builtin "
                "--progress off")



# ---------------------------------------------------------------- helpers (the live test uses them too)

def run_compose_config(*files: Path, profiles: tuple[str, ...] = (), env: dict | None = None
                       ) -> subprocess.CompletedProcess:
    args = ["docker-compose"] + [a for f in files for a in ("-f", str(f))]
    args += [a for p in profiles for a in ("--profile", p)] + ["config"]
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("LLM_", "LOAD_", "GRAFANA_", "ALERT_", "POSTGRES_"))}
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})


def compose_config(*files: Path, profiles: tuple[str, ...] = (), env: dict | None = None) -> dict:
    """The compose model after docker-compose has validated, merged and interpolated it."""
    done = run_compose_config(*files, profiles=profiles, env=env)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def mounts(service: dict, named: bool = False) -> dict[str, str]:
    """target -> source of a service's bind mounts (or of its named volumes), from `config` short syntax."""
    out = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("/") != named:
            out[target] = source if named else Path(source)
    return out


def active(config: dict, profiles: tuple[str, ...] = ()) -> dict:
    """The services `up` starts: docker-compose v1 `config` lists profile services too."""
    return {n: s for n, s in config["services"].items() if not s.get("profiles") or set(s["profiles"]) & set(profiles)}


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted((GRAFANA / "dashboards").glob("*.json"))}


def panels(dashboard: dict):
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])


def datasources() -> list[dict]:
    return yaml.safe_load((GRAFANA / "provisioning/datasources/datasources.yml").read_text())["datasources"]


def promql_expressions() -> list[tuple[str, str]]:
    """(where, expression) for every PromQL expression of the stack: rules, dashboards, datasources."""
    out = []
    for path in sorted((DEPLOY / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                out.append((f"{path.name}: {rule.get('record') or rule.get('alert')}", rule["expr"]))
    for name, dash in dashboards().items():
        for p in panels(dash):
            for t in p.get("targets", []):
                if t["datasource"]["uid"] == "prometheus":
                    out.append((f"{name}: {p['title']}", t["expr"]))
        for var in dash["templating"]["list"]:
            if var["datasource"]["uid"] == "prometheus":
                out.append((f"{name}: variable {var['name']}", var["query"]["query"]))
        for ann in dash["annotations"]["list"]:
            if ann["datasource"]["uid"] == "prometheus":
                out.append((f"{name}: annotation {ann['name']}", ann["expr"]))
    for ds in datasources():
        for q in ds.get("jsonData", {}).get("tracesToMetrics", {}).get("queries", []):
            # Grafana expands $VAR in provisioning files: $$ is a literal $
            out.append((f"datasource {ds['name']}: {q['name']}", q["query"].replace("$$", "$")))
    return out


def metric_catalog() -> set[str]:
    """Every series name the service can export, from the metric definitions themselves."""
    metrics = Metrics("m")
    GPUMetrics(metrics.registry)
    names = set()
    for family in [*metrics.registry.collect(), *metrics.local.collect()]:
        if family.name.startswith("llm_"):
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(family.type, [""])
            names |= {family.name + s for s in suffixes}
    return names


def recorded_names() -> set[str]:
    return {r["record"] for p in (DEPLOY / "rules").glob("*.yml")
            for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"] if "record" in r}


# ---------------------------------------------------------------- compose

@needs_tools("docker-compose")
def test_compose_file_validates_with_and_without_the_gpu_override_and_load_profile():
    base = compose_config(COMPOSE)
    assert set(active(base)) == {"service", "lb", "prometheus", "alertmanager", "alert-sink", "tempo", "grafana",
                                 "postgres", "secrets-init"}
    with_load = compose_config(COMPOSE, profiles=("load",))
    assert set(active(with_load, ("load",))) == set(active(base)) | {"load"}
    gpu = compose_config(COMPOSE, GPU_OVERRIDE, profiles=("load",))
    service = gpu["services"]["service"]
    assert service["build"]["args"]["TORCH_VARIANT"] == "cuda" and service["environment"]["LLM_DEVICE"] == "cuda"
    [device] = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert gpu["services"]["load"]["image"] == service["image"]  # one CUDA image, built once


@needs_tools("docker-compose")
def test_docker_compose_config_rejects_an_invalid_file(tmp_path):
    """The validator used above really validates: a misspelt key fails."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("    healthcheck:\n      test: [\"CMD\", \"wget\"",
                                                  "    healthchek:\n      test: [\"CMD\", \"wget\"", 1))
    done = run_compose_config(broken)
    assert done.returncode != 0 and "healthchek" in done.stderr


@needs_tools("docker-compose")
def test_every_service_is_pinned_healthchecked_and_restarted():
    services = compose_config(COMPOSE, profiles=("load",))["services"]
    for name, s in services.items():
        image = s["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image version ({image})"
        assert s["restart"] == ("no" if name == "secrets-init" else "unless-stopped"), name  # a one-shot step
        if name not in ("load", "secrets-init"):  # batch jobs: healthy means nothing for them
            assert s["healthcheck"]["test"][0] == "CMD", name
    assert "/ready" in " ".join(services["service"]["healthcheck"]["test"])
    # start order with conditions; waiting for health only where the dependent cannot work without it, so
    # that a broken Tempo or Alertmanager never keeps the service or Prometheus down
    conditions = {(name, dep): c["condition"] for name, s in services.items()
                  for dep, c in s.get("depends_on", {}).items()}
    assert conditions == {("load", "service"): "service_healthy", ("service", "tempo"): "service_started",
                          ("load", "lb"): "service_started", ("lb", "service"): "service_started",
                          ("prometheus", "alertmanager"): "service_started",
                          ("alertmanager", "alert-sink"): "service_started",
                          ("grafana", "prometheus"): "service_healthy", ("grafana", "tempo"): "service_started",
                          ("grafana", "secrets-init"): "service_completed_successfully",
                          ("postgres", "secrets-init"): "service_completed_successfully"}


@needs_tools("docker-compose")
def test_state_lives_in_named_volumes():
    config = compose_config(COMPOSE)
    want = {"service": ["/home/app/.cache/llm-service"], "prometheus": ["/prometheus"],
            "alertmanager": ["/alertmanager"], "tempo": ["/var/tempo"], "grafana": ["/var/lib/grafana", SECRETS],
            "postgres": ["/var/lib/postgresql/data", SECRETS], "secrets-init": [SECRETS]}
    for name, targets in want.items():
        named = mounts(config["services"][name], named=True)
        assert list(named) == targets, name
        assert set(named.values()) <= set(config["volumes"])


@needs_tools("docker-compose")
def test_load_profile_runs_the_project_load_generator_with_the_documented_arguments():
    load = compose_config(COMPOSE, profiles=("load",))["services"]["load"]
    assert load["profiles"] == ["load"]
    assert " ".join(a.replace("=", " ", 1) if a.startswith("--") else a for a in load["command"]) == LOAD_COMMAND
    assert load["image"] == compose_config(COMPOSE)["services"]["service"]["image"]


@needs_tools("docker-compose")
def test_service_exports_traces_to_the_tempo_receiver_that_listens_on_that_port_and_protocol():
    config = compose_config(COMPOSE)
    env = config["services"]["service"]["environment"]
    endpoint = re.fullmatch(r"http://(\w[\w-]*):(\d+)", env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint, env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    host, port = endpoint.group(1), int(endpoint.group(2))
    assert host == "tempo" and host in config["services"]
    tempo = yaml.safe_load((DEPLOY / "tempo.yaml").read_text())
    protocol = {"grpc": "grpc", "http/protobuf": "http"}[env["OTEL_EXPORTER_OTLP_PROTOCOL"]]
    listen = tempo["distributor"]["receivers"]["otlp"]["protocols"][protocol]["endpoint"]
    assert listen == f"0.0.0.0:{port}"  # all interfaces: the service reaches Tempo over the compose network
    # the config file compose mounts is this one, and Tempo is started with it
    tempo_service = config["services"]["tempo"]
    assert mounts(tempo_service)["/etc/tempo.yaml"] == DEPLOY / "tempo.yaml"
    assert "-config.file=/etc/tempo.yaml" in tempo_service["command"]
    # Tempo remote-writes span metrics to Prometheus, which accepts remote writes and keeps exemplars
    [remote] = tempo["metrics_generator"]["storage"]["remote_write"]
    assert remote["url"] == "http://prometheus:9090/api/v1/write"
    flags = config["services"]["prometheus"]["command"]
    assert "--web.enable-remote-write-receiver" in flags and "--enable-feature=exemplar-storage" in flags
    assert {"service-graphs", "span-metrics"} <= set(tempo["overrides"]["defaults"]["metrics_generator"]["processors"])
    assert tempo["compactor"]["compaction"]["block_retention"] and tempo["storage"]["trace"]["backend"] == "local"


@needs_tools("docker-compose")
def test_service_pushes_otlp_metrics_to_prometheus_whose_otlp_receiver_is_on():
    config = compose_config(COMPOSE)
    env = config["services"]["service"]["environment"]
    assert env["LLM_OTLP_METRICS"] == "true"
    endpoint = re.fullmatch(r"http://(\w[\w-]*):(\d+)(/.*)", env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"])
    assert endpoint and endpoint.group(1) == "prometheus" and endpoint.group(3) == "/api/v1/otlp/v1/metrics"
    assert endpoint.group(2) == "9090"  # the port Prometheus listens on in its container
    assert "--enable-feature=otlp-write-receiver" in config["services"]["prometheus"]["command"]
    # the receiver takes OTLP/HTTP with cumulative temporality only
    assert env["OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"] == "http/protobuf"
    assert env["OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"] == "cumulative"


@needs_tools("docker-compose")
def test_grafana_provisioning_paths_match_the_mounted_volumes():
    grafana = compose_config(COMPOSE)["services"]["grafana"]
    bind = mounts(grafana)
    assert bind["/etc/grafana/provisioning"] == GRAFANA / "provisioning"
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/dashboards.yml").read_text())["providers"][0]
    assert bind[provider["options"]["path"]] == GRAFANA / "dashboards"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (bind[str(Path(home).parent)] / Path(home).name).is_file()
    # anonymous viewers; the admin password comes from the secrets volume (tests/deploy/test_deploy_secrets.py)
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    # datasource URLs name compose services on their ports
    urls = {ds["uid"]: ds["url"] for ds in datasources()}
    assert urls == {"prometheus": "http://prometheus:9090", "tempo": "http://tempo:3200", "bench-postgres": "postgres:5432"}


@needs_tools("docker-compose")
def test_prometheus_and_alertmanager_containers_read_the_files_of_this_folder():
    services = compose_config(COMPOSE)["services"]
    prom = mounts(services["prometheus"])
    assert prom["/etc/prometheus/prometheus.yml"] == DEPLOY / "prometheus.yml"
    assert prom["/etc/prometheus/rules"] == DEPLOY / "rules"
    am = services["alertmanager"]
    bind = mounts(am)
    assert bind["/etc/alertmanager/alertmanager.yml"] == DEPLOY / "alertmanager.yml"
    assert am["entrypoint"] == ["/bin/sh", "/etc/alertmanager/entrypoint.sh"]
    assert bind["/etc/alertmanager/entrypoint.sh"] == DEPLOY / "alertmanager-entrypoint.sh"
    assert am["environment"]["ALERT_WEBHOOK_URL"] == "http://alert-sink:9095/alerts"
    sink = services["alert-sink"]
    assert "--port=9095" in sink["command"]
    overridden = compose_config(COMPOSE, env={"ALERT_WEBHOOK_URL": "https://pager.example/hook"})
    assert overridden["services"]["alertmanager"]["environment"]["ALERT_WEBHOOK_URL"] == "https://pager.example/hook"


# ---------------------------------------------------------------- Prometheus and Alertmanager configs

@needs_tools("promtool")
def test_prometheus_config_passes_promtool_and_scrapes_every_15s():
    done = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 rule files found" in done.stdout
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert config["global"]["scrape_interval"] == "15s" and config["global"]["evaluation_interval"] == "15s"
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert jobs["llm-service"]["dns_sd_configs"] == [{"names": ["service"], "type": "A", "port": 8000,
                                                      "refresh_interval": "5s"}]  # every replica (docs/scale-out.md)
    assert jobs["prometheus"]["static_configs"][0]["targets"] == ["localhost:9090"]
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    rules_text = " ".join(p.read_text() for p in (DEPLOY / "rules").glob("*.yml"))
    assert 'job="llm-service"' in rules_text


def render_alertmanager_config(tmp_path: Path, url: str, template: Path = DEPLOY / "alertmanager.yml") -> Path:
    """Run the real entrypoint with `echo` for Alertmanager: it writes the config it would start with."""
    out = tmp_path / "alertmanager.rendered.yml"
    env = {"PATH": os.environ["PATH"], "ALERT_WEBHOOK_URL": url, "ALERTMANAGER_TEMPLATE": str(template),
           "ALERTMANAGER_CONFIG": str(out), "ALERTMANAGER_BIN": "echo"}
    done = subprocess.run(["sh", str(DEPLOY / "alertmanager-entrypoint.sh"), "--storage.path=x"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"--config.file={out}", "--storage.path=x"]
    return out


@needs_tools("amtool")
def test_alertmanager_config_routes_every_alert_to_the_webhook_from_the_environment(tmp_path):
    url = "https://hooks.example.com/alert?team=llm&route=a|b"  # & and | mean something to sed
    rendered = render_alertmanager_config(tmp_path, url)
    done = subprocess.run(["amtool", "check-config", str(rendered)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    config = yaml.safe_load(rendered.read_text())
    [receiver] = config["receivers"]
    assert receiver["webhook_configs"][0]["url"] == url
    assert config["route"]["receiver"] == receiver["name"]
    assert all(r["receiver"] == receiver["name"] for r in config["route"].get("routes", []))
    for labels in ({"alertname": "LLMHighErrorRatio", "severity": "critical"},
                   {"alertname": "LLMKVCacheNearlyFull", "severity": "warning"}):
        done = subprocess.run(["amtool", "config", "routes", "test", "--config.file", str(rendered),
                               *(f"{k}={v}" for k, v in labels.items())], capture_output=True, text=True)
        assert done.stdout.strip() == receiver["name"], done.stdout + done.stderr


def test_alertmanager_entrypoint_refuses_to_start_without_a_webhook_url(tmp_path):
    env = {"PATH": os.environ["PATH"], "ALERTMANAGER_TEMPLATE": str(DEPLOY / "alertmanager.yml"),
           "ALERTMANAGER_CONFIG": str(tmp_path / "x.yml"), "ALERTMANAGER_BIN": "echo"}
    done = subprocess.run(["sh", str(DEPLOY / "alertmanager-entrypoint.sh")], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "ALERT_WEBHOOK_URL" in done.stderr


# ---------------------------------------------------------------- Grafana

def test_dashboards_are_what_build_dashboards_writes():
    sys.path.insert(0, str(GRAFANA))
    try:
        import build_dashboards
    finally:
        sys.path.remove(str(GRAFANA))
    rendered = build_dashboards.render()
    assert rendered.keys() == {p.name for p in (GRAFANA / "dashboards").glob("*.json")}
    for name, text in rendered.items():
        assert (GRAFANA / "dashboards" / name).read_text() == text, f"run deploy/grafana/build_dashboards.py ({name})"


def test_dashboards_refer_to_provisioned_datasources_by_uid():
    uids = {ds["uid"] for ds in datasources()}
    assert uids == {"prometheus", "tempo", "bench-postgres"}
    for name, dash in dashboards().items():
        used = set()
        for p in panels(dash):
            used |= {p["datasource"]["uid"]} if "datasource" in p else set()
            used |= {t["datasource"]["uid"] for t in p.get("targets", [])}
        used |= {v["datasource"]["uid"] for v in dash["templating"]["list"]}
        used |= {a["datasource"]["uid"] for a in dash["annotations"]["list"]}
        assert used and used <= uids, name


def test_datasources_link_exemplars_to_tempo_and_traces_back_to_prometheus():
    by_uid = {ds["uid"]: ds for ds in datasources()}
    [dest] = by_uid["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert dest == {"name": "trace_id", "datasourceUid": "tempo"}
    tempo = by_uid["tempo"]["jsonData"]
    assert tempo["tracesToMetrics"]["datasourceUid"] == "prometheus"
    assert tempo["serviceMap"]["datasourceUid"] == "prometheus"
    assert all("{$$__tags}" in q["query"] for q in tempo["tracesToMetrics"]["queries"])
    # the exemplar label the service writes is the one Grafana looks for
    recorder = (ROOT / "service/telemetry/recorder.py").read_text()
    assert '{"trace_id": trace_id}' in recorder


def test_dashboards_have_fixed_uids_instance_and_model_variables_and_exemplars_on_latency():
    dashes = dashboards()
    assert {d["uid"] for d in dashes.values()} == {"llm-overview", "llm-gpu", "llm-slo", "llm-bench-history"}
    dashes.pop("llm-bench-history.json")  # SQL over the results store: tests/bench/test_bench_dashboard.py
    for name, dash in dashes.items():
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert set(variables) == {"instance", "model"}, name
        for v in variables.values():
            assert v["query"]["query"].startswith("label_values(") and v["multi"] and v["includeAll"]
        ids = [p["id"] for p in panels(dash)]
        assert len(ids) == len(set(ids)), name
        for p in panels(dash):
            if p["type"] == "row":
                continue
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, (name, p["title"])
            for t in p.get("targets", []):
                # pushed GenAI series have no scrape instance (theirs is service.instance.id): $model only
                if "gen_ai_" in t.get("expr", ""):
                    assert "$model" in t["expr"], (name, p["title"], t["expr"])
                elif "expr" in t and "llm:" not in t["expr"] and "llm_gpu_" not in t["expr"] \
                        and "ALERTS" not in t["expr"]:
                    assert "$instance" in t["expr"] and "$model" in t["expr"], (name, p["title"], t["expr"])
    overview = {p["title"]: p for p in panels(dashes["llm-overview.json"])}
    for title in ("Time to first token", "End-to-end request duration"):
        assert any(t["exemplar"] for t in overview[title]["targets"]), title


def test_dashboards_show_what_the_issue_asks_for():
    titles = {name: {p["title"] for p in panels(d)} for name, d in dashboards().items()}
    assert {"Requests by finish reason", "Error ratio", "Time to first token", "Inter-token latency",
            "End-to-end request duration", "Tokens per second", "Running and waiting requests", "KV cache usage",
            "Preemptions", "Tokens per step", "Engine step time"} <= titles["llm-overview.json"]
    assert {"GPU utilization", "GPU memory used", "Power draw", "Temperature", "SM clock"} <= titles["llm-gpu.json"]
    assert {"Burn rate by window", "Error budget left"} <= titles["llm-slo.json"]


def test_every_metric_in_rules_dashboards_and_datasources_exists_in_the_catalog_or_the_rules():
    catalog, recorded = metric_catalog(), recorded_names()
    for where, expr in promql_expressions():
        for name in set(re.findall(r"[a-zA-Z_:][\w:]*", re.sub(r'"[^"]*"', '""', expr))):
            if name.startswith("llm_"):
                assert name in catalog, f"{where}: {name} is not a metric of service/telemetry/metrics.py"
            elif ":" in name:
                assert name in recorded, f"{where}: {name} is not recorded by deploy/rules"
    # and the other way round: every recorded series is read by an alert or a dashboard
    used = " ".join(expr for _, expr in promql_expressions())
    for name in recorded:
        assert re.search(rf"(?<![\w:]){re.escape(name)}(?![\w:])", used), f"{name} is recorded but nothing reads it"


# ---------------------------------------------------------------- Dockerfile

def test_dockerfile_runs_unprivileged_with_a_ready_healthcheck_and_a_cuda_variant():
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+) AS (\w+)", text, re.M)
    assert [s for _, s in stages] == ["build", "runtime"]
    runtime = text.split("AS runtime", 1)[1]
    users = re.findall(r"^USER (\S+)", runtime, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*\n?.*/ready", runtime, re.M)
    assert 'CMD ["python", "-m", "service", "serve"]' in runtime
    assert "ARG TORCH_VARIANT=cpu" in text and '"$TORCH_VARIANT" = cuda' in text
    # the torch pin matches the one the project tests with
    pinned = re.search(r"ARG TORCH_VERSION=(\S+)", text).group(1)
    assert f"torch=={pinned}" in (ROOT / "Makefile").read_text()


def test_dockerfile_copies_only_what_dockerignore_lets_into_the_context():
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "allow-list style: everything excluded, then the few inputs"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copies = re.findall(r"^COPY (?!--from)(\S+(?: \S+)*) \S+$", (DEPLOY / "Dockerfile").read_text(), re.M)
    sources = {src for line in copies for src in line.split()}
    assert sources == allowed
    assert all((ROOT / s).exists() for s in sources)
