"""The deploy stack with real processes: the service, Prometheus, Alertmanager, a webhook receiver, an OTLP sink.

The service runs as `python -m service serve` (the image's command) with the compose file's environment;
Prometheus and Alertmanager run from Debian's packages with configs derived from deploy/: 1 s intervals,
loopback ports, and one threshold lowered so that an alert must fire. After a short load, every PromQL
expression of the rules, dashboards and datasources runs against that Prometheus.
Tempo has no binary here: an in-test OTLP/gRPC receiver stands in for it, so exemplars can be matched
against the traces the service really exported. Debian's Prometheus (2.42) has no OTLP receiver: the metrics the
compose environment pushes go to an in-test OTLP/HTTP receiver instead.
"""

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests import web
from tests.conftest import free_port, needs_tools, wait_until
from tests.otlp import Receiver, latest
from tests.deploy.test_deploy_config import COMPOSE, DEPLOY, compose_config, promql_expressions

LOWERED_ALERT = "LLMHighTimeToFirstToken"  # its threshold goes down to 1 µs: any request breaks it
# $__rate_interval as wide as the recorded 5 m rates: on a busy machine the last queries run minutes after the load
GRAFANA_BUILTINS = {"$__rate_interval": "5m", "$__range_s": "600", "$__range": "10m", "$__interval": "15s"}
# no data here, and why: no NVIDIA GPU on this machine; ALERTS has series only while alerts are active; the
# pushed GenAI series need an OTLP receiver, which Debian's Prometheus 2.42 lacks (tests/telemetry/test_otlp_metrics.py
# receives them with a real OTLP receiver instead); random weights without a tokenizer compile no grammar, so the
# grammar time quantiles stay NaN; full garbage collections are rare by design (each process freezes its heap once
# loaded), so their pause quantile may be NaN too
NO_DATA_EXPECTED = ("llm_gpu_", "ALERTS", "gen_ai_", "llm_grammar_compile_seconds", "llm_grammar_mask_seconds",
                    "llm_gc_pause_seconds_bucket")


class Stack:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.ports = {name: free_port() for name in ("service", "prometheus", "alertmanager", "sink")}
        self.service = f"http://127.0.0.1:{self.ports['service']}"
        self.prometheus = f"http://127.0.0.1:{self.ports['prometheus']}"
        self.alertmanager = f"http://127.0.0.1:{self.ports['alertmanager']}"
        self.sink_log = tmp / "alert-sink.log"
        self.instance = f"127.0.0.1:{self.ports['service']}"
        self.model = "random:tiny"

    def start(self, name: str, args: list[str], env: dict | None = None) -> None:
        log = open(self.tmp / f"{name}.log", "w")
        self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.tmp,
                                           start_new_session=True))
        log.close()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.tmp.glob("*.log")))


def wait_for(what: str, check, timeout: float, stack: Stack | None = None):
    """wait_until, with the stack's logs in the failure."""
    try:
        return wait_until(check, timeout, what, interval=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{stack.logs() if stack else ''}") from None


# ---------------------------------------------------------------- configs derived from deploy/

def derived_rules(out: Path) -> Path:
    """deploy/rules unchanged, except the lowered alert: threshold 1 µs and `for: 2s`."""
    out.mkdir()
    for path in (DEPLOY / "rules").glob("*.yml"):
        doc = yaml.safe_load(path.read_text())
        for group in doc["groups"]:
            for rule in group["rules"]:
                if rule.get("record") == "llm:threshold:ttft_p95_seconds":
                    rule["expr"] = "vector(0.000001)"
                if rule.get("alert") == LOWERED_ALERT:
                    rule["for"] = "2s"
        (out / path.name).write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def derived_prometheus_config(stack: Stack, rules: Path) -> Path:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    config["rule_files"] = [str(rules / "*.yml")]
    config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{stack.ports['alertmanager']}"]}]
    targets = {"llm-service": stack.instance, "prometheus": f"127.0.0.1:{stack.ports['prometheus']}",
               "alertmanager": f"127.0.0.1:{stack.ports['alertmanager']}"}  # no Tempo here
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert targets.keys() <= jobs.keys()
    config["scrape_configs"] = [{**{k: v for k, v in jobs[name].items() if k != "dns_sd_configs"},  # compose's DNS
                                 "static_configs": [{"targets": [t]}]} for name, t in targets.items()]
    path = stack.tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def derived_alertmanager_template(stack: Stack) -> Path:
    """deploy/alertmanager.yml with the grouping waits shortened; receivers and routes unchanged."""
    config = yaml.safe_load((DEPLOY / "alertmanager.yml").read_text())
    config["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1m")
    path = stack.tmp / "alertmanager.template.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def dockerfile_command() -> list[str]:
    """The image's CMD, with this interpreter for `python` (the image's PATH starts with its venv)."""
    command = json.loads(re.findall(r"^CMD (\[.*\])$", (DEPLOY / "Dockerfile").read_text(), re.M)[-1])
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


# ---------------------------------------------------------------- load

def send_load(base: str, seconds: float = 8.0, min_requests: int = 40, max_requests: int = 400) -> dict[str, int]:
    """Completions, streamed completions and native requests with token-id prompts, plus a few bad ones:
    for `seconds`, and on until `min_requests` were sent however slow a busy machine is (within 120 s)."""
    statuses: dict[str, int] = {}
    start = time.monotonic()
    lock = threading.Lock()
    sent = [0]

    def more() -> bool:
        elapsed = time.monotonic() - start
        return elapsed < seconds or (sent[0] < min_requests and elapsed < 120)

    def worker(i: int):
        with httpx.Client(base_url=base, timeout=60) as client:
            while more():
                with lock:
                    if sent[0] >= max_requests:
                        return
                    n = sent[0] = sent[0] + 1
                prompt = [(n * 7 + k) % 90 + 5 for k in range(4 + n % 40)]
                kind = n % 10
                if kind < 6:
                    r = client.post("/v1/completions", json={"model": "random:tiny", "prompt": prompt,
                                                             "max_tokens": 8 + n % 16, "ignore_eos": True})
                elif kind < 8:
                    with client.stream("POST", "/v1/completions", json={
                            "model": "random:tiny", "prompt": prompt, "max_tokens": 12, "stream": True}) as r:
                        r.read()
                elif kind < 9:
                    r = client.post("/generate", json={"token_ids": prompt, "max_tokens": 10})
                else:
                    r = client.post("/v1/completions", json={"model": "random:tiny", "prompt": prompt,
                                                             "max_tokens": -1})  # a client error: 400
                with lock:
                    statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


# ---------------------------------------------------------------- the stack

@pytest.fixture(scope="module")
@needs_tools("prometheus", "prometheus-alertmanager", "docker-compose")
def stack():
    with contextlib.ExitStack() as cleanup:
        tmp = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="llm-deploy-")))
        s = Stack(tmp)
        s.otlp = otlp = cleanup.enter_context(Receiver("grpc"))
        s.otlp_metrics = cleanup.enter_context(Receiver("http/protobuf"))
        cleanup.callback(s.stop)  # before the receivers close (last in, first out): the service flushes to them

        # the webhook receiver the compose stack uses by default
        s.start("alert-sink", [sys.executable, str(DEPLOY / "alert_sink.py"), "--host", "127.0.0.1",
                               "--port", str(s.ports["sink"])])
        # Alertmanager through the compose entrypoint, which writes the webhook URL into the config
        am_env = {"PATH": os.environ["PATH"], "ALERT_WEBHOOK_URL": f"http://127.0.0.1:{s.ports['sink']}/alerts",
                  "ALERTMANAGER_TEMPLATE": str(derived_alertmanager_template(s)),
                  "ALERTMANAGER_CONFIG": str(tmp / "alertmanager.yml"),
                  "ALERTMANAGER_BIN": shutil.which("prometheus-alertmanager")}
        s.start("alertmanager", ["sh", str(DEPLOY / "alertmanager-entrypoint.sh"), f"--storage.path={tmp / 'am'}",
                                 f"--web.listen-address=127.0.0.1:{s.ports['alertmanager']}",
                                 "--cluster.listen-address="], env=am_env)
        # Prometheus with the compose file's feature flags
        compose = compose_config(COMPOSE)
        flags = [f for f in compose["services"]["prometheus"]["command"]
                 if f.startswith(("--enable-feature", "--web.enable-"))]
        s.start("prometheus", ["prometheus", f"--config.file={derived_prometheus_config(s, derived_rules(tmp / 'rules'))}",
                               f"--storage.tsdb.path={tmp / 'tsdb'}", "--storage.tsdb.retention.time=1h",
                               f"--web.listen-address=127.0.0.1:{s.ports['prometheus']}", *flags])
        # the service: the image's command with the compose file's environment, on loopback, tiny model
        env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "OTEL_"))}
        env.update({k: str(v) for k, v in compose["services"]["service"]["environment"].items()})
        env.update(LLM_MODEL="random:tiny", LLM_DEVICE="cpu", LLM_HOST="127.0.0.1", LLM_PORT=str(s.ports["service"]),
                   LLM_NUM_BLOCKS="256", LLM_GPU_SAMPLE_INTERVAL="0",
                   OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint,  # was http://tempo:4317
                   # was Prometheus 2.53's OTLP receiver, which 2.42 lacks
                   OTEL_EXPORTER_OTLP_METRICS_ENDPOINT=s.otlp_metrics.endpoint + "/v1/metrics",
                   OTEL_METRIC_EXPORT_INTERVAL="1000", OTEL_BSP_SCHEDULE_DELAY="500", PYTHONPATH=str(DEPLOY.parent))
        s.start("service", dockerfile_command(), env=env)

        wait_for("alert sink", lambda: web.get(f"http://127.0.0.1:{s.ports['sink']}/").status_code == 200, 30, s)
        wait_for("alertmanager", lambda: web.get(s.alertmanager + "/-/ready").status_code == 200, 30, s)
        wait_for("prometheus", lambda: web.get(s.prometheus + "/-/ready").status_code == 200, 30, s)
        wait_for("service", lambda: web.get(s.service + "/ready").status_code == 200, 120, s)
        # Prometheus's first scrape comes seconds after it starts: load sent before it would show no increase
        wait_for("the first scrape", lambda: query(s, 'up{job="llm-service"} == 1')["result"], 30, s)
        s.statuses = send_load(s.service)
        # every rule group has evaluated over the load: the slowest windows and the per-instance quantiles exist
        for q in ("model:llm_slo_ttft_errors:burn_rate3d", "instance_model:llm_request_duration_seconds:quantile_rate5m",
                  "instance_model:llm_slo_availability_errors:ratio_rate5m"):
            wait_for(q, lambda: finite(query(s, q)), 30, s)
        yield s


def query(stack: Stack, expr: str) -> dict:
    r = web.post(stack.prometheus + "/api/v1/query", data={"query": expr}, timeout=30)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]


def finite(data: dict) -> bool:
    if data["resultType"] == "scalar":
        return math.isfinite(float(data["result"][1]))
    return any(math.isfinite(float(s["value"][1])) for s in data["result"])


def substitute(expr: str, instance: str, model: str, span_model: str = "random:tiny") -> str:
    for name, value in GRAFANA_BUILTINS.items():
        expr = expr.replace(name, value)
    expr = expr.replace("$__tags", f'model="{span_model}"')  # from the span's gen_ai.request.model
    expr = re.sub(r"label_values\((.*), (\w+)\)$", r"group by (\2) (\1)", expr)  # a variable query as PromQL
    return expr.replace("$instance", instance).replace("$model", model)


# ---------------------------------------------------------------- tests

def test_load_got_answers_including_client_errors(stack):
    assert stack.statuses.get("200", 0) >= 20 and stack.statuses.get("400", 0) >= 1, stack.statuses
    assert set(stack.statuses) <= {"200", "400"}, stack.statuses


@pytest.mark.parametrize("selection", ["all", "one"])
def test_every_promql_expression_runs_and_returns_data_where_data_is_expected(stack, selection):
    """Rules, dashboard panels, variables, annotations and datasource queries, with Grafana's variables
    set to All (".*") or to the one instance and model (regex-escaped, as Grafana does)."""
    if selection == "all":
        instance = model = ".*"
    else:
        instance, model = re.escape(stack.instance).replace("\\", "\\\\"), stack.model
    alerts = {f"{p.name}: {r['alert']}" for p in (DEPLOY / "rules").glob("*.yml")
              for g in yaml.safe_load(p.read_text())["groups"] for r in g["rules"] if "alert" in r}
    empty, checked = [], 0
    for where, expr in promql_expressions():
        data = query(stack, substitute(expr, instance, model))  # asserts status success
        checked += 1
        if where in alerts or any(m in expr for m in NO_DATA_EXPECTED):
            continue  # an alert's condition is false on a healthy service; see test_*alert* for the true case
        if not finite(data):
            empty.append(f"{where}: {expr}")
    assert checked > 150 and not empty, "\n".join(empty)


def test_gpu_queries_are_valid_and_empty_on_a_machine_without_gpus(stack):
    gpu = [(w, e) for w, e in promql_expressions() if "llm_gpu_" in e]
    assert len(gpu) >= 10
    for where, expr in gpu:
        assert query(stack, substitute(expr, ".*", ".*"))["result"] == [], where


def test_latency_exemplars_carry_trace_ids_of_traces_the_service_exported(stack):
    from tests.deploy.test_deploy_config import dashboards, panels

    targets = [t["expr"] for d in dashboards().values() for p in panels(d) for t in p.get("targets", [])
               if t.get("exemplar")]
    assert len(targets) == 2  # time to first token, end-to-end duration
    now = time.time()
    for expr in targets:
        r = web.get(stack.prometheus + "/api/v1/query_exemplars",
                    params={"query": substitute(expr, ".*", ".*"), "start": now - 600, "end": now})
        body = r.json()
        assert body["status"] == "success", body
        trace_ids = {e["labels"]["trace_id"] for series in body["data"] for e in series["exemplars"]}
        assert trace_ids, f"no exemplars for {expr}"
        exported = lambda: trace_ids <= {sp.trace_id for sp in stack.otlp.spans}
        wait_for("the exemplars' traces at the OTLP receiver", exported, 20, stack)
    services = {sp.resource.get("service.name") for sp in stack.otlp.spans}
    assert services == {compose_config(COMPOSE)["services"]["service"]["environment"]["OTEL_SERVICE_NAME"]}


def test_the_compose_environment_pushes_genai_metrics_that_count_what_prometheus_scraped(stack):
    env = compose_config(COMPOSE)["services"]["service"]["environment"]
    assert env["OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"] == "cumulative"  # all Prometheus takes

    def agree():
        scraped = query(stack, 'sum(llm_request_duration_seconds_count{job="llm-service"})')["result"]
        points = [p for p in latest(stack.otlp_metrics.points).values() if p.name == "gen_ai.server.request.duration"]
        pushed = sum(p.count for p in points)
        return points if pushed and scraped and pushed == float(scraped[0]["value"][1]) else None
    points = wait_for("the pushed request count to equal the scraped one", agree, 30, stack)
    assert all(p.temporality == 2 and p.resource["service.name"] == env["OTEL_SERVICE_NAME"] for p in points)


def test_lowered_threshold_fires_the_real_alert_to_alertmanager_and_the_webhook(stack):
    def active_on_alertmanager():
        alerts = web.get(stack.alertmanager + "/api/v2/alerts", params={"active": "true"}).json()
        return [a for a in alerts if a["labels"]["alertname"] == LOWERED_ALERT]

    [alert] = wait_for(f"{LOWERED_ALERT} on Alertmanager", active_on_alertmanager, 90, stack)
    assert alert["status"]["state"] == "active"
    assert {k: alert["labels"][k] for k in ("severity", "instance", "model", "quantile", "job")} == {
        "severity": "warning", "instance": stack.instance, "model": stack.model, "quantile": "0.95",
        "job": "llm-service"}
    assert alert["annotations"]["summary"].startswith(f"{stack.model} on {stack.instance}: p95 time to first token")

    def delivered():
        lines = [json.loads(line) for line in (stack.tmp / "alert-sink.log").read_text().splitlines()]
        return [a for a in lines if a["alertname"] == LOWERED_ALERT and a["status"] == "firing"]

    [note, *_] = wait_for("the webhook notification", delivered, 60, stack)
    assert note["severity"] == "warning" and note["receiver"] == "webhook"
    # the summary ends in the p95 value at the evaluation that sent the note; later evaluations move it
    summary = f"{stack.model} on {stack.instance}: p95 time to first token is "
    assert note["labels"]["instance"] == stack.instance and note["summary"].startswith(summary)


def test_a_healthy_service_raises_no_error_down_or_saturation_alert(stack):
    firing = query(stack, 'ALERTS{alertname=~"LLMServiceDown|LLMHighErrorRatio|LLMWaitingQueueGrowing|'
                          'LLMKVCacheNearlyFull|LLMAvailabilityErrorBudgetBurn.*"}')["result"]
    assert firing == []
    assert query(stack, 'up{job="llm-service"}')["result"][0]["value"][1] == "1"
