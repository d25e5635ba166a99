"""`prefixserve serve`'s settings: each flag, its PREFIXSERVE_* environment variable, parser and default.

Precedence: a flag on the command line, else its environment variable, else the default. A bad flag
is argparse's usage error (exit status 2); a bad environment variable is a ValueError naming it,
which `run_serve` reports as a configuration error (exit status 2 too).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from prefixserve.cache.eviction import EVICTION_POLICIES
from prefixserve.config import (
    DECODE_KERNELS,
    DEFAULT_MAX_TOKENS,
    DTYPES,
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    ServerConfig,
)


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '2G', '2GiB', '0' -> bytes (binary units)."""
    s = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(s[-1:], 1)
    number = s[:-1] if s[-1:] in units else s
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("a byte size must be >= 0")
    return value


def parse_seconds(text: str) -> float:
    """'30', '2.5', '0' -> seconds, a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, not {text!r}")
    return value


def parse_origins(text: str) -> tuple[str, ...]:
    """'https://a.example,https://b.example' or '*' -> the origins; each scheme://host[:port], no path."""
    origins = tuple(dict.fromkeys(part.strip().rstrip("/") for part in text.split(",") if part.strip()))
    if "*" in origins and len(origins) > 1:
        raise argparse.ArgumentTypeError("'*' (any origin) stands alone: it would make the others meaningless")
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/?#\s*]+", origin):
            raise argparse.ArgumentTypeError(f"not an origin (scheme://host[:port], no wildcards, or '*' alone): {origin!r}")
    return origins


def parse_eviction(value: str) -> str:
    """A `CacheConfig.eviction` policy name (ValueError naming the choices otherwise)."""
    if value not in EVICTION_POLICIES:
        raise ValueError(f"one of {', '.join(EVICTION_POLICIES)}")
    return value


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


# dest -> (environment variable, parser, default)
SETTINGS: dict[str, tuple[str, Callable[[str], Any], Any]] = {
    "host": ("PREFIXSERVE_HOST", str, "127.0.0.1"),
    "port": ("PREFIXSERVE_PORT", int, 8000),
    "model": ("PREFIXSERVE_MODEL", str, None),
    "served_model_name": ("PREFIXSERVE_SERVED_MODEL_NAME", str, None),
    "api_keys_file": ("PREFIXSERVE_API_KEYS_FILE", str, None),
    "admin_key": ("PREFIXSERVE_ADMIN_KEY", str, None),
    "metrics_open": ("PREFIXSERVE_METRICS_OPEN", _flag, False),
    "allowed_origins": ("PREFIXSERVE_ALLOWED_ORIGINS", parse_origins, ()),
    "cache_max_bytes": ("PREFIXSERVE_CACHE_MAX_BYTES", parse_bytes, CacheConfig().max_bytes),
    "cache_dir": ("PREFIXSERVE_CACHE_DIR", str, None),  # None = <data dir>/cache
    "cache_disk_bytes": ("PREFIXSERVE_CACHE_DISK_BYTES", parse_bytes, 0),
    "cache_eviction": ("PREFIXSERVE_CACHE_EVICTION", parse_eviction, CacheConfig().eviction),
    "cache_redis_url": ("PREFIXSERVE_CACHE_REDIS_URL", str, None),
    "cache_redis_key": ("PREFIXSERVE_CACHE_REDIS_KEY", str, None),
    "cache_redis_key_file": ("PREFIXSERVE_CACHE_REDIS_KEY_FILE", str, None),
    "kv_events_endpoint": ("PREFIXSERVE_KV_EVENTS_ENDPOINT", str, None),
    "kv_events_topic": ("PREFIXSERVE_KV_EVENTS_TOPIC", str, ""),
    "kv_events_replay_endpoint": ("PREFIXSERVE_KV_EVENTS_REPLAY_ENDPOINT", str, None),
    "kv_events_buffer_steps": ("PREFIXSERVE_KV_EVENTS_BUFFER_STEPS", int, 10_000),
    "kv_events_hwm": ("PREFIXSERVE_KV_EVENTS_HWM", int, 100_000),
    "kv_events_max_queue_size": ("PREFIXSERVE_KV_EVENTS_MAX_QUEUE_SIZE", int, 100_000),
    "kv_events_block_size": ("PREFIXSERVE_KV_EVENTS_BLOCK_SIZE", int, 16),
    "max_model_len": ("PREFIXSERVE_MAX_MODEL_LEN", int, None),
    "dtype": ("PREFIXSERVE_DTYPE", str, "auto"),
    "device": ("PREFIXSERVE_DEVICE", str, "auto"),
    "decode_kernel": ("PREFIXSERVE_DECODE_KERNEL", str, "auto"),
    "num_threads": ("PREFIXSERVE_NUM_THREADS", int, None),
    "decode_threads": ("PREFIXSERVE_DECODE_THREADS", int, None),
    "max_num_seqs": ("PREFIXSERVE_MAX_NUM_SEQS", int, EngineConfig().max_num_seqs),
    "prefill_chunk_tokens": ("PREFIXSERVE_PREFILL_CHUNK_TOKENS", int, EngineConfig().prefill_chunk_tokens),
    "max_batch_tokens": ("PREFIXSERVE_MAX_BATCH_TOKENS", int, EngineConfig().max_batch_tokens),
    "max_queued_requests": ("PREFIXSERVE_MAX_QUEUED_REQUESTS", int, EngineConfig().max_queued_requests),
    "default_max_tokens": ("PREFIXSERVE_DEFAULT_MAX_TOKENS", int, DEFAULT_MAX_TOKENS),
    "max_stored_responses": ("PREFIXSERVE_MAX_STORED_RESPONSES", int, ServerConfig().max_stored_responses),
    "reasoning_parser": ("PREFIXSERVE_REASONING_PARSER", str, "auto"),
    "max_session_bytes": ("PREFIXSERVE_MAX_SESSION_BYTES", parse_bytes, EngineConfig().max_session_bytes),
    "data_dir": ("PREFIXSERVE_DATA_DIR", str, None),  # None = config.default_data_dir
    "model_cache_dir": ("PREFIXSERVE_MODEL_CACHE_DIR", str, None),  # None = models.prepared.default_cache_dir
    "no_model_cache": ("PREFIXSERVE_NO_MODEL_CACHE", _flag, False),
    "fresh_self_test": ("PREFIXSERVE_FRESH_SELF_TEST", _flag, False),
    "ledger_path": ("PREFIXSERVE_LEDGER_PATH", str, None),
    "pricing": ("PREFIXSERVE_PRICING", str, None),
    "no_ledger": ("PREFIXSERVE_NO_LEDGER", _flag, False),
    "responses_path": ("PREFIXSERVE_RESPONSES_PATH", str, None),  # None = <data dir>/responses.sqlite3
    "no_responses_persist": ("PREFIXSERVE_NO_RESPONSES_PERSIST", _flag, False),
    "log_level": ("PREFIXSERVE_LOG_LEVEL", str, "info"),
    "shutdown_timeout": ("PREFIXSERVE_SHUTDOWN_TIMEOUT", parse_seconds, ServerConfig().shutdown_timeout_s),
}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` subcommand's flags. Defaults are None here and resolved at start (`resolve`), so that an
    environment variable applies exactly when its flag is absent."""
    for add in (_listen_args, _access_args, _cache_args, _kv_events_args, _runtime_args, _request_args, _file_args,
                _process_args):  # in this order in --help and docs/flags.md
        add(parser.add_argument)


def _listen_args(a: Callable[..., argparse.Action]) -> None:
    """Where the server listens and what it serves."""
    a("--host", help="bind address (PREFIXSERVE_HOST; default 127.0.0.1)")
    a("--port", type=int, help="port (PREFIXSERVE_PORT; default 8000)")
    a("--model", help="GGUF file or model directory (PREFIXSERVE_MODEL; default: the embedded SmolLM2-135M)")
    a("--served-model-name", help="model id in the API (PREFIXSERVE_SERVED_MODEL_NAME)")


def _access_args(a: Callable[..., argparse.Action]) -> None:
    """Who may call it: API keys and tenants, the admin key, /metrics, browser origins."""
    a("--api-key", action="append", dest="api_keys", metavar="KEY",
      help="an API key, or 'TENANT KEY'; repeat for more tenants (PREFIXSERVE_API_KEYS, comma-separated)")
    a("--api-keys-file", metavar="FILE",
      help="one 'KEY' or 'TENANT KEY' per line, '#' starts a comment at a line's start or after a space; no key is an error (PREFIXSERVE_API_KEYS_FILE)")
    a("--admin-key", metavar="KEY",
      help="key for the usage API across tenants, flushing any tenant's cache and /metrics "
           "(PREFIXSERVE_ADMIN_KEY)")
    a("--metrics-open", action="store_true", default=None,
      help="/metrics without a key where API keys are configured (else it takes the admin key there: its "
           "figures are all tenants' traffic; PREFIXSERVE_METRICS_OPEN=1)")
    a("--allowed-origins", type=parse_origins, metavar="ORIGINS",
      help="comma-separated origins (https://app.example) whose browser pages may call the API, or '*' for any "
           "(CORS; an API key is still needed where keys are configured); default none "
           "(PREFIXSERVE_ALLOWED_ORIGINS)")


def _cache_args(a: Callable[..., argparse.Action]) -> None:
    """The prefix cache's tiers: RAM, disk, shared (Redis)."""
    a("--cache-max-bytes", type=parse_bytes, metavar="N",
      help="prefix cache budget, e.g. 2G; 0 disables caching (PREFIXSERVE_CACHE_MAX_BYTES; default 2G)")
    a("--cache-eviction", choices=EVICTION_POLICIES,
      help="which unpinned entry makes room first when the budget is full (docs/cache.md, \"Eviction\"; "
           "PREFIXSERVE_CACHE_EVICTION; default lru)")
    a("--cache-dir", metavar="PATH",
      help="the disk cache tier's directory (PREFIXSERVE_CACHE_DIR; default <data-dir>/cache)")
    a("--cache-disk-bytes", type=parse_bytes, metavar="N",
      help="disk cache tier budget, e.g. 20G; 0 (the default) = no disk tier (PREFIXSERVE_CACHE_DISK_BYTES)")
    a("--cache-redis-url", metavar="URL",
      help="shared cache tier on Redis, redis://[:password@]host:port/db, the same on every replica; bound it with "
           "Redis's maxmemory + allkeys-lru (PREFIXSERVE_CACHE_REDIS_URL; default: none)")
    a("--cache-redis-key", metavar="SECRET",
      help="per-deployment secret (>= 16 bytes) authenticating every shared-tier value (HMAC-SHA256); prefer "
           "--cache-redis-key-file (PREFIXSERVE_CACHE_REDIS_KEY)")
    a("--cache-redis-key-file", metavar="FILE",
      help="file holding that secret, surrounding whitespace ignored (PREFIXSERVE_CACHE_REDIS_KEY_FILE)")


def _kv_events_args(a: Callable[..., argparse.Action]) -> None:
    """The RAM cache's blocks published as vLLM's KV events (docs/gateway.md)."""
    a("--kv-events-endpoint", metavar="ENDPOINT",
      help="publish the RAM cache's blocks as vLLM's KV events (ZMQ PUB, msgpack) for a gateway's indexer: "
           "tcp://*:5557 binds, tcp://indexer:5557 connects. Events carry prompt token ids: only where the gateway "
           "alone can reach it (docs/gateway.md; PREFIXSERVE_KV_EVENTS_ENDPOINT; default: off)")
    a("--kv-events-topic", metavar="TOPIC",
      help="every message's first frame; llm-d's indexer wants kv@<pod-id>@<model-name> (PREFIXSERVE_KV_EVENTS_TOPIC; "
           "default empty)")
    a("--kv-events-replay-endpoint", metavar="ENDPOINT",
      help="ZMQ ROUTER answering requests for missed batches by sequence number (PREFIXSERVE_KV_EVENTS_REPLAY_ENDPOINT)")
    a("--kv-events-buffer-steps", type=int, metavar="N",
      help="batches kept for replay (PREFIXSERVE_KV_EVENTS_BUFFER_STEPS; default 10000)")
    a("--kv-events-hwm", type=int, metavar="N",
      help="the PUB socket's high-water mark (PREFIXSERVE_KV_EVENTS_HWM; default 100000)")
    a("--kv-events-max-queue-size", type=int, metavar="N",
      help="cache changes waiting to be published; past it they are dropped and counted, never waited for "
           "(PREFIXSERVE_KV_EVENTS_MAX_QUEUE_SIZE; default 100000)")
    a("--kv-events-block-size", type=int, metavar="N",
      help="tokens per announced block, the indexer's block size (PREFIXSERVE_KV_EVENTS_BLOCK_SIZE; default 16)")


def _runtime_args(a: Callable[..., argparse.Action]) -> None:
    """How the model runs: context, dtype, device, kernels, threads."""
    a("--max-model-len", type=int, metavar="N", help="context length (PREFIXSERVE_MAX_MODEL_LEN)")
    a("--dtype", choices=DTYPES, help="runtime dtype (PREFIXSERVE_DTYPE; default auto)")
    a("--device", choices=("auto", "cpu", "cuda"), help="(PREFIXSERVE_DEVICE; default auto)")
    a("--decode-kernel", choices=DECODE_KERNELS,
      help="decode matmuls: int4 reads the GGUF's 4-bit weights (bf16 CPU; finished chat turns are re-fed by "
           "prefill before they are cached), dense uses prefill's weights (PREFIXSERVE_DECODE_KERNEL; default auto = int4 where possible)")
    a("--num-threads", type=int, metavar="N",
      help="torch threads (PREFIXSERVE_NUM_THREADS; default: every usable core but one, at least one; "
           "docs/architecture.md)")
    a("--decode-threads", type=int, metavar="N",
      help="threads of the big calls (4-bit and dense matmuls, native attention); back to --num-threads a while "
           "when threads wait for a core (PREFIXSERVE_DECODE_THREADS; default: every usable core; docs/architecture.md)")


def _request_args(a: Callable[..., argparse.Action]) -> None:
    """Scheduling and the requests' own limits."""
    a("--max-num-seqs", type=int, metavar="N",
      help="sessions running at once; n choices take n (PREFIXSERVE_MAX_NUM_SEQS; default 64)")
    a("--prefill-chunk-tokens", type=int, metavar="N",
      help="prompt tokens a session prefills in one engine step (PREFIXSERVE_PREFILL_CHUNK_TOKENS; default 128; "
           "docs/architecture.md)")
    a("--max-batch-tokens", type=int, metavar="N",
      help="tokens one engine step computes, decode rows + prefill chunks; bounds how long a step keeps the "
           "others waiting (PREFIXSERVE_MAX_BATCH_TOKENS; default 256; docs/architecture.md)")
    a("--max-queued-requests", type=int, metavar="N",
      help="requests queued beyond the free room (a session slot and session bytes at the next step); past it new "
           "ones get 429 + Retry-After (PREFIXSERVE_MAX_QUEUED_REQUESTS; default 256; docs/architecture.md, \"Admission\")")
    a("--default-max-tokens", type=int, metavar="N",
      help="max_tokens of a request that names none, within the room its prompt leaves in the context and the "
           "session budget; /health and /v1/models "
           f"report it (PREFIXSERVE_DEFAULT_MAX_TOKENS; default {DEFAULT_MAX_TOKENS}; completions: OpenAI's 16)")
    a("--max-stored-responses", type=int, metavar="N",
      help="/v1/responses answers kept for previous_response_id and GET /v1/responses/{id}, in all (and at most "
           "64 MiB of text), in memory and in --responses-path; past it the tenant holding the most loses its least "
           "recently used; 0 keeps none (PREFIXSERVE_MAX_STORED_RESPONSES; default 4096)")
    a("--reasoning-parser", choices=["auto", "none"],
      help="auto: a thinking model's <think> block as reasoning_content (chat); none: left in the text "
           "(PREFIXSERVE_REASONING_PARSER; default auto)")
    a("--max-session-bytes", type=parse_bytes, metavar="BYTES",
      help="KV of all running sessions together (prompt + max_tokens each); admission waits past it and a request "
           "that can never fit is a 400; at least 64 tokens of the model's KV (PREFIXSERVE_MAX_SESSION_BYTES; default 4G)")


def _file_args(a: Callable[..., argparse.Action]) -> None:
    """What the server keeps on disk: data, the prepared models, the usage ledger, stored responses."""
    a("--data-dir", metavar="DIR", help="usage ledger, stored responses and disk cache tier, created at start (PREFIXSERVE_DATA_DIR; "
      "default $XDG_DATA_HOME/prefixserve, else ~/.local/share/prefixserve)")
    a("--model-cache-dir", metavar="DIR",
      help="prepared-model cache: a GGUF's runtime weights and tokenizer, verified by digest, so later starts take "
           "seconds (PREFIXSERVE_MODEL_CACHE_DIR; default $XDG_CACHE_HOME/prefixserve/models, else "
           "~/.cache/prefixserve/models)")
    a("--no-model-cache", action="store_true", default=None,
      help="prepare the model from its file at every start (PREFIXSERVE_NO_MODEL_CACHE=1)")
    a("--fresh-self-test", action="store_true", default=None,
      help="run the start-up self-test even where the model cache records a pass for this machine, build and "
           "model (PREFIXSERVE_FRESH_SELF_TEST=1; docs/architecture.md, \"Start-up\")")
    a("--ledger-path", metavar="PATH", help="usage ledger (PREFIXSERVE_LEDGER_PATH; default <data-dir>/usage.sqlite3)")
    a("--pricing", metavar="FILE", help="pricing TOML for the usage API (PREFIXSERVE_PRICING)")
    a("--price", action="append", dest="prices", metavar="MODEL=IN,CACHED,OUT",
      help="USD per million tokens for MODEL ('*' = any), overriding --pricing; repeatable")
    a("--no-ledger", action="store_true", default=None, help="do not record usage (PREFIXSERVE_NO_LEDGER=1)")
    a("--responses-path", metavar="FILE",
      help="SQLite file of the stored /v1/responses answers, read back at start so they survive a restart "
           "(PREFIXSERVE_RESPONSES_PATH; default <data-dir>/responses.sqlite3)")
    a("--no-responses-persist", action="store_true", default=None,
      help="keep stored responses in memory only, gone at restart (PREFIXSERVE_NO_RESPONSES_PERSIST=1)")


def _process_args(a: Callable[..., argparse.Action]) -> None:
    """Logging and the shutdown."""
    a("--log-level", choices=("debug", "info", "warning", "error"), help="(PREFIXSERVE_LOG_LEVEL; default info)")
    a("--shutdown-timeout", type=parse_seconds, metavar="SECONDS",
      help="after SIGTERM / SIGINT, how long requests in flight may take to finish; then the engine ends the rest "
           "(a stream gets an error event, others a 503; usage is recorded) and the server exits. 0: at once; a "
           "second signal: now (PREFIXSERVE_SHUTDOWN_TIMEOUT; default 20: the exit comes within it + ~6 s; docs/architecture.md, \"Shutdown\")")


def resolve(args: argparse.Namespace, dest: str, env: Mapping[str, str]) -> Any:
    """`dest`'s value: its flag, else its environment variable (ValueError naming it if bad), else the default."""
    value = getattr(args, dest, None)
    if value is not None:
        return value
    name, parse, default = SETTINGS[dest]
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"bad {name}={raw!r}: {e}") from None


def resolve_all(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Every setting resolved (`resolve`), by dest."""
    return {dest: resolve(args, dest, env) for dest in SETTINGS}


def api_key_specs(args: argparse.Namespace, env: Mapping[str, str]) -> list[str]:
    """The --api-key flags, else PREFIXSERVE_API_KEYS (comma-separated); not yet the keys file's."""
    return list(getattr(args, "api_keys", None) or split_env_keys(env.get("PREFIXSERVE_API_KEYS", "")))


def split_env_keys(raw: str) -> list[str]:
    return [part.strip() for part in raw.split(",") if part.strip()]


def kv_events_config(s: Mapping[str, Any]) -> KVEventsConfig | None:
    """The KV events' config from the resolved settings, or None without --kv-events-endpoint (ValueError
    for a bad value, or a companion flag given without it)."""
    if not s["kv_events_endpoint"]:
        if s["kv_events_replay_endpoint"]:
            raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return None
    return KVEventsConfig(endpoint=s["kv_events_endpoint"], topic=s["kv_events_topic"],
                          replay_endpoint=s["kv_events_replay_endpoint"] or None,
                          buffer_steps=s["kv_events_buffer_steps"], hwm=s["kv_events_hwm"],
                          max_queue_size=s["kv_events_max_queue_size"], block_size=s["kv_events_block_size"])
