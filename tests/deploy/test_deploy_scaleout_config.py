"""The scale-out files agree with each other and with the service, checked without Docker.

HAProxy's config is checked by `haproxy -c` for one host and for compose; the compose stack must scale (no
published port or fixed name on the service, a load balancer in front, Prometheus and HAProxy finding replicas
by DNS); the one-host Prometheus config differs from the compose one only in how it finds its targets.
"""

import re
import subprocess

import yaml

from tests.conftest import needs_tools
from tests.deploy.test_deploy_config import COMPOSE, DEPLOY, compose_config, mounts

HAPROXY = (DEPLOY / "haproxy.cfg").read_text()


def haproxy_check(*files: str) -> subprocess.CompletedProcess:
    args = ["haproxy", "-c"] + [a for f in files for a in ("-f", str(DEPLOY / f))]
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


def seconds(value: str) -> float:
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h)?", value).groups()
    return int(number) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 0.001}[unit]


@needs_tools("haproxy")
def test_haproxy_config_is_valid_with_the_host_and_the_compose_server_lists():
    for servers in ("haproxy-host.cfg", "haproxy-compose.cfg"):
        done = haproxy_check("haproxy.cfg", servers)
        assert done.returncode == 0 and "WARNING" not in done.stdout + done.stderr, done.stdout + done.stderr
    broken = DEPLOY.parent / "build" / "haproxy-broken.cfg"
    broken.parent.mkdir(exist_ok=True)
    broken.write_text(HAPROXY.replace("balance leastconn", "balance leastconnections"))
    try:
        assert haproxy_check(str(broken), "haproxy-host.cfg").returncode != 0  # the check really checks
    finally:
        broken.unlink()


def test_haproxy_routes_only_to_ready_replicas_by_least_connections_and_streams_long_generations():
    directives = {line.split(None, 1)[0] + " " + line.split(None, 2)[1]: line.strip()
                  for line in HAPROXY.splitlines() if line.startswith("    ") and len(line.split()) > 1}
    assert directives["balance leastconn"]
    assert directives["http-check send"] == "http-check send meth GET uri /ready"  # the service's readiness route
    assert '@public.get("/ready")' in (DEPLOY.parent / "service/api/native_routes.py").read_text()
    assert directives["http-check expect"] == "http-check expect status 200"
    # each SSE event goes out at once; compression would buffer
    assert "option http-no-delay" in HAPROXY and not re.search(r"^\s+compression", HAPROXY, re.M)
    # a request is retried only if HAProxy held all of it when it connected (it buffers requests, not responses)
    assert "option http-buffer-request" in HAPROXY
    timeouts = {m.group(1): seconds(m.group(2)) for m in re.finditer(r"^\s+timeout (\S+) (\S+)", HAPROXY, re.M)}
    assert timeouts["server"] >= 600 and timeouts["client"] >= 600  # a long generation may stream for minutes
    assert timeouts["check"] < 1 + timeouts["server"]
    # requests a replica never started go elsewhere: refused, closed without an answer, or 503 (draining, full)
    retry_on = directives["retry-on conn-failure"].split()[1:]
    assert {"conn-failure", "empty-response", "503"} <= set(retry_on) and "option redispatch 1" in HAPROXY
    assert "option http-server-close" in HAPROXY  # no request rides an idle connection its replica may be closing
    # every server line of the one-host list is health-checked, via default-server
    assert re.search(r"^\s+default-server check ", HAPROXY, re.M)
    host_servers = (DEPLOY / "haproxy-host.cfg").read_text()
    ports = [int(p) for p in re.findall(r"server replica\d+ 127\.0\.0\.1:(\d+)", host_servers)]
    assert ports == [8000 + i for i in range(1, len(ports) + 1)]  # the ports replicas.sh gives replica i
    assert "LLM_REPLICA_BASE_PORT:-8000" in (DEPLOY / "replicas.sh").read_text()


@needs_tools("docker-compose")
def test_compose_service_scales_behind_the_load_balancer_and_prometheus_finds_each_replica_by_dns():
    services = compose_config(COMPOSE)["services"]
    service, lb = services["service"], services["lb"]
    # `--scale service=3` fails on a fixed host port or container name
    assert "ports" not in service and "container_name" not in service
    assert lb["ports"] == ["127.0.0.1:8000:8000/tcp", "127.0.0.1:8404:8404/tcp"]  # clients and stats, on loopback
    bind = mounts(lb)
    assert bind["/usr/local/etc/haproxy/haproxy.cfg"] == DEPLOY / "haproxy.cfg"
    assert bind["/usr/local/etc/haproxy/replicas.cfg"] == DEPLOY / "haproxy-compose.cfg"
    assert lb["command"][-4:] == ["-f", "/usr/local/etc/haproxy/haproxy.cfg",
                                  "-f", "/usr/local/etc/haproxy/replicas.cfg"]
    assert lb["environment"] == {"LB_BIND": ":8000", "LB_STATS_BIND": ":8404"}
    assert "8404" in " ".join(lb["healthcheck"]["test"])
    port = int(re.search(r"LLM_PORT=(\d+)", (DEPLOY / "Dockerfile").read_text()).group(1))
    template = re.search(r"server-template \S+ \S+ (\S+):(\d+) ", (DEPLOY / "haproxy-compose.cfg").read_text())
    assert (template.group(1), int(template.group(2))) == ("service", port)
    prometheus = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prometheus["scrape_configs"]}
    [dns] = jobs["llm-service"]["dns_sd_configs"]
    assert dns["names"] == ["service"] and dns["port"] == port and dns["type"] == "A"
    assert jobs["haproxy"]["static_configs"][0]["targets"] == ["lb:8404"]
    assert "--url=http://lb:8000" in services["load"]["command"]  # v1 `config` lists profile services too


@needs_tools("promtool")
def test_one_host_prometheus_config_is_the_compose_one_but_for_file_based_discovery():
    done = subprocess.run(["promtool", "check", "config", str(DEPLOY / "prometheus-host.yml")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    host = yaml.safe_load((DEPLOY / "prometheus-host.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    assert host["global"] == compose["global"] and host["rule_files"] == compose["rule_files"]
    jobs = {j["job_name"]: j for j in host["scrape_configs"]}
    assert set(jobs) == {j["job_name"] for j in compose["scrape_configs"]} - {"tempo"}
    assert jobs["llm-service"]["file_sd_configs"][0]["files"] == ["targets/llm-service.json"]
    assert "targets/llm-service.json" in (DEPLOY / "replicas.sh").read_text()
    assert jobs["haproxy"]["static_configs"][0]["targets"] == ["127.0.0.1:8404"]
    assert "LB_STATS_BIND-127.0.0.1:8404" in HAPROXY
