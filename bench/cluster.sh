#!/usr/bin/env bash
# A local cluster: one redis-server, N prefixserve replicas sharing it as their cache tier, and SMG
# (SGLang's model gateway, `pip install smg`) in front of them. Ctrl-C (or SIGTERM) stops all of it.
# Usage: bench/cluster.sh [N]   (make cluster N=3)
# Environment: PORT (the gateway's, default 8000), BASE_PORT (replica k listens on BASE_PORT + k,
# default 8001), REDIS_PORT (default 6390), POLICY (SMG's --policy, default consistent_hashing: it
# hashes X-SMG-Routing-Key, else Authorization, so one tenant stays on one replica; docs/cache.md,
# "Behind a gateway"), SERVE_ARGS (more `prefixserve serve` flags for every replica), VENV (.venv).
# State (Redis secret, each replica's data dir, logs) lives in a temporary directory removed at exit.
set -euo pipefail
N="${1:-${N:-3}}"
PORT="${PORT:-8000}"
BASE_PORT="${BASE_PORT:-8001}"
REDIS_PORT="${REDIS_PORT:-6390}"
POLICY="${POLICY:-consistent_hashing}"
VENV="${VENV:-.venv}"
SMG="$VENV/bin/smg"
PREFIXSERVE="$VENV/bin/prefixserve"

[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "N must be a positive integer, not '$N'" >&2; exit 2; }
command -v redis-server >/dev/null || { echo "redis-server is missing (make redis-server)" >&2; exit 1; }
[ -x "$PREFIXSERVE" ] || { echo "$PREFIXSERVE is missing (make install)" >&2; exit 1; }
[ -x "$SMG" ] || { echo "$SMG is missing: $VENV/bin/pip install smg" >&2; exit 1; }

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
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$STATE/redis.key"  # the replicas' shared secret

WORKERS=()
for ((k = 0; k < N; k++)); do
  port=$((BASE_PORT + k))
  # shellcheck disable=SC2086  # SERVE_ARGS is a list of flags
  "$PREFIXSERVE" serve --host 127.0.0.1 --port "$port" --data-dir "$STATE/replica$k" \
    --cache-redis-url "redis://127.0.0.1:$REDIS_PORT/0" --cache-redis-key-file "$STATE/redis.key" \
    ${SERVE_ARGS:-} >"$STATE/replica$k.log" 2>&1 &
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

"$SMG" launch --host 127.0.0.1 --port "$PORT" --policy "$POLICY" --worker-urls "${WORKERS[@]}" \
  >"$STATE/smg.log" 2>&1 &
PIDS+=($!)
until curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; do
  kill -0 "${PIDS[-1]}" 2>/dev/null || { echo "smg exited; its log:" >&2; tail -n 30 "$STATE/smg.log" >&2; exit 1; }
  sleep 1
done
echo "gateway on http://127.0.0.1:$PORT/v1 ($POLICY) -> ${WORKERS[*]}; Redis on :$REDIS_PORT. Ctrl-C stops all." >&2
wait -n "${PIDS[@]}" || true
echo "a process exited; stopping the rest" >&2
