#!/usr/bin/env bash
# The system tools the tests run for real: Prometheus (with promtool), Alertmanager, docker-compose (v1,
# to validate deploy/docker-compose.yml offline), and PostgreSQL (the results store's tests start their own cluster). Debian packages, installed only when missing.
set -euo pipefail
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
command -v docker-compose >/dev/null || need+=(docker-compose)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
