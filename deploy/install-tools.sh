#!/usr/bin/env bash
# The system tools the tests run for real: Prometheus (with promtool), Alertmanager, HAProxy (the load balancer
# in front of replicas), docker-compose (v1, to validate deploy/docker-compose.yml offline), PostgreSQL (the
# results store's tests start their own cluster), stress-ng (scripts/stress-suite.sh runs the suite beside it),
# and Chromium with its WebDriver (the /dashboard page's browser tests drive it headless through Selenium).
# Debian packages, installed only when missing.
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v haproxy >/dev/null || need+=(haproxy)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
command -v stress-ng >/dev/null || need+=(stress-ng)
command -v chromium >/dev/null || need+=(chromium)
command -v chromedriver >/dev/null || need+=(chromium-driver)
# kubectl (with Kustomize v5, kubectl >= 1.27) has no current Debian package: Debian's kubernetes-client is 1.20
command -v kubectl >/dev/null || echo "kubectl missing: tests/deploy/test_deploy_kubernetes.py needs kubectl >= 1.27;" \
    "see https://kubernetes.io/docs/tasks/tools/" >&2
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
