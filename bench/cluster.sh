#!/usr/bin/env bash
# A local cluster: one redis-server, N prefixserve replicas sharing it as their cache tier, and SMG
# (SGLang's model gateway, `smg` from PyPI, in the project's test extra) in front of them. Ctrl-C (or
# SIGTERM) stops all of it. docs/gateway.md, "A local cluster", says what each part gets.
# Usage: bench/cluster.sh [N] [--api-keys-file FILE]     (make cluster N=3 [API_KEYS_FILE=keys.txt])
#   --api-keys-file: replicas that require API keys (one 'KEY' or 'TENANT KEY' a line). Each replica
#   reads FILE (kill -HUP re-reads it) plus a gateway key generated here (tenant `smg-gateway`); SMG
#   gets that key as its --api-key and every key of FILE as a --tenant-api-key (a key added to FILE
#   later passes SMG only after a restart of the cluster). Without it everything is open.
# Environment: PORT (the gateway's, default 8000), BASE_PORT (replica k listens on BASE_PORT + k,
# default 8001), REDIS_PORT (default 6390), PROMETHEUS_PORT (SMG's own metrics on 127.0.0.1, default
# 29000), POLICY (SMG's --policy, default cache_aware: on the multi-tenant benchmark it kept a single
# replica's hit rate with no header from the client; consistent_hashing keeps a tenant on one replica
# only when requests carry X-SMG-Routing-Key; docs/gateway.md, "Routing measured"),
# SERVE_ARGS (more `prefixserve serve` flags for every replica), VENV (.venv).
# State (Redis secret, gateway key, each replica's data dir, logs) lives in a temporary directory
# removed at exit.
set -euo pipefail
N="${N:-3}"
KEYS_FILE=""
while (($#)); do
  case "$1" in
    --api-keys-file) KEYS_FILE="${2:?--api-keys-file needs a file}"; shift 2 ;;
    --api-keys-file=*) KEYS_FILE="${1#*=}"; shift ;;
    -h|--help) sed -n '2,17p' "$0" | cut -c3-; exit 0 ;;
    *) N="$1"; shift ;;
  esac
done
PORT="${PORT:-8000}"
BASE_PORT="${BASE_PORT:-8001}"
REDIS_PORT="${REDIS_PORT:-6390}"
PROMETHEUS_PORT="${PROMETHEUS_PORT:-29000}"
POLICY="${POLICY:-cache_aware}"
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
PREFIXSERVE="$VENV/bin/prefixserve"
GATEWAY="$(dirname "$0")/smg_gateway.py"

[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "N must be a positive integer, not '$N'" >&2; exit 2; }
command -v redis-server >/dev/null || { echo "redis-server is missing (make redis-server)" >&2; exit 1; }
[ -x "$PREFIXSERVE" ] || { echo "$PREFIXSERVE is missing (make install)" >&2; exit 1; }
[ -x "$VENV/bin/smg" ] || { echo "$VENV/bin/smg is missing (make install: smg is in the test extra)" >&2; exit 1; }
if [ -n "$KEYS_FILE" ]; then  # refused here, before anything starts, as the replicas would refuse it
  "$PY" "$GATEWAY" --check --api-keys-file "$KEYS_FILE"
  KEYS_FILE="$(realpath "$KEYS_FILE")"
fi

STATE="$(mktemp -d -t prefixserve-cluster.XXXXXX)"
PIDS=()
stop() {
  trap - INT TERM EXIT
  echo "stopping ${#PIDS[@]} processes" >&2
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$STATE"
}
trap 'stop; exit 130' INT
trap 'stop; exit 143' TERM
trap stop EXIT

redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no \
  --maxmemory 2gb --maxmemory-policy allkeys-lru --dir "$STATE" >"$STATE/redis.log" 2>&1 &
PIDS+=($!)
(umask 077
 head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE/redis.key"  # the replicas' shared secret
 echo "sk-gateway-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')" >"$STATE/gateway.key")

KEY_ARGS=()
GATEWAY_KEY_ARGS=()
PROBE_AUTH=()
if [ -n "$KEYS_FILE" ]; then
  KEY_ARGS=(--api-keys-file "$KEYS_FILE")
  GATEWAY_KEY_ARGS=(--api-keys-file "$KEYS_FILE" --gateway-key-file "$STATE/gateway.key")
  PROBE_AUTH=(-H "Authorization: Bearer $(cat "$STATE/gateway.key")")
fi
WORKERS=()
for ((k = 0; k < N; k++)); do
  port=$((BASE_PORT + k))
  # The gateway's key through the environment (added to the file's keys), never on a command line.
  # shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
  PREFIXSERVE_API_KEYS="$([ -n "$KEYS_FILE" ] && echo "smg-gateway $(cat "$STATE/gateway.key")")" \
  "$PREFIXSERVE" serve --host 127.0.0.1 --port "$port" --data-dir "$STATE/replica$k" \
    --cache-redis-url "redis://127.0.0.1:$REDIS_PORT/0" --cache-redis-key-file "$STATE/redis.key" \
    "${KEY_ARGS[@]}" ${SERVE_ARGS:-} >"$STATE/replica$k.log" 2>&1 &
  PIDS+=($!)
  WORKERS+=("http://127.0.0.1:$port")
done

echo "waiting for $N replicas (logs in $STATE)" >&2
for url in "${WORKERS[@]}"; do
  until curl -fsS "$url/health" >/dev/null 2>&1; do
    for pid in "${PIDS[@]}"; do
      kill -0 "$pid" 2>/dev/null || { echo "a process exited; its log:" >&2; tail -n 20 "$STATE"/*.log >&2; exit 1; }
    done
    sleep 1
  done
done

"$PY" "$GATEWAY" "${GATEWAY_KEY_ARGS[@]}" -- --host 127.0.0.1 --port "$PORT" --policy "$POLICY" \
  --prometheus-host 127.0.0.1 --prometheus-port "$PROMETHEUS_PORT" --worker-urls "${WORKERS[@]}" \
  >"$STATE/smg.log" 2>&1 &
PIDS+=($!)
# ready once SMG lists the model: it has registered a replica (read its /v1/models with its key)
until curl -fsS "${PROBE_AUTH[@]}" "http://127.0.0.1:$PORT/v1/models" 2>/dev/null | grep -q '"id"'; do
  kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "smg exited; its log:" >&2; tail -n 30 "$STATE/smg.log" >&2; exit 1; }
  sleep 1
done
echo "gateway on http://127.0.0.1:$PORT/v1 ($POLICY$([ -n "$KEYS_FILE" ] && echo ", keys of $KEYS_FILE")) ->" \
  "${WORKERS[*]}; Redis on :$REDIS_PORT. Ctrl-C stops all." >&2
wait -n "${PIDS[@]}" || true
echo "a process exited; stopping the rest" >&2
