"""Frozen, validated configuration passed into constructors. No globals."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

DTYPES = ("auto", "bf16", "fp32")
DECODE_KERNELS = ("auto", "dense", "int4")
# A request that names no max_tokens generates at most this many (`--default-max-tokens`): without a cap
# a chat request at temperature 1 can run until the context fills (7,735 tokens, 378 s, measured on 2
# cores). 1,024 covers a long answer; ask for more explicitly.
DEFAULT_MAX_TOKENS = 1024
# The least KV `--max-session-bytes` must hold, in tokens of the model loaded: one short chat turn with
# the embedded model's template (its default system prompt and a one-line question) is ~40 tokens,
# plus a short reply. A smaller budget started, said ok on /health, and refused every request (400).
MIN_SESSION_TOKENS = 64


class ConfigError(ValueError):
    """A setting that cannot work with the model loaded: found when the engine is built, since the
    settings alone cannot tell. For `prefixserve serve` a configuration error, as a bad flag is."""


def session_tokens(max_session_bytes: int, kv_bytes_per_token: int) -> int:
    """The most tokens of KV (prompt + max_tokens) one session may reserve under `max_session_bytes`.
    Raises ConfigError, naming the flag, below MIN_SESSION_TOKENS."""
    num_tokens = max_session_bytes // kv_bytes_per_token
    if num_tokens < MIN_SESSION_TOKENS:
        raise ConfigError(
            f"--max-session-bytes {max_session_bytes:,} holds {num_tokens} tokens of this model's KV "
            f"({kv_bytes_per_token:,} bytes a token), fewer than the {MIN_SESSION_TOKENS} a small request needs: "
            f"give at least {MIN_SESSION_TOKENS * kv_bytes_per_token:,}"
        )
    return num_tokens


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str | None = None  # None = the embedded SmolLM2 default
    served_model_name: str | None = None
    dtype: str = "auto"  # auto = bf16 (fp32 dense tiles where the CPU has no bf16 arithmetic: models/loaders/load.py)
    device: str = "auto"  # auto = cuda when present, else cpu
    max_model_len: int | None = None  # None = the model's own context length
    num_threads: int | None = None  # None = torch's default
    decode_threads: int | None = None  # threads of the big matmuls and attention (models/kernels/threads.py); None = every usable core
    # decode rows' matmuls: int4 = the GGUF's 4-bit codes (bf16 CPU; 4x fewer bytes, but a decoded
    # token's KV then differs from a prefilled one, so a finished turn is re-fed by prefill before it is
    # cached, engine/refill.py); dense = the same weights as prefill; auto = int4 where available
    decode_kernel: str = "auto"
    cache_dir: str | None = None  # the prepared-model cache (models/loaders/prepared.py); None = prepare at every start
    # run the start-up self-test even where a pass is recorded for this machine and build
    # (runner/selftest_memo.py); without a cache_dir it always runs
    fresh_self_test: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, not {self.dtype!r}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, not {self.decode_kernel!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")
        if self.decode_threads is not None and self.decode_threads < 1:
            raise ValueError("decode_threads must be >= 1")


SHARED_SECRET_MIN_BYTES = 16  # the shared tier's HMAC key (docs/cache.md, "Shared tier")


@dataclass(frozen=True, slots=True)
class SharedTierConfig:
    """The shared cache tier on Redis (docs/cache.md, "Shared tier"); its bound is Redis's maxmemory."""

    url: str  # redis://[:password@]host:port/db, rediss:// for TLS, unix:///path
    secret: bytes = field(default=b"", repr=False)  # the per-deployment HMAC key, the same on every replica
    prefix: str = "prefixserve"  # first component of every key
    timeout_s: float = 1.0  # socket connect and per-read timeout: a slow Redis is a miss, not a stall

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("the Redis URL must start with redis://, rediss:// or unix://")
        if len(self.secret) < SHARED_SECRET_MIN_BYTES:
            raise ValueError(f"the shared cache tier needs a secret of at least {SHARED_SECRET_MIN_BYTES} bytes "
                             "(--cache-redis-key)")
        if not self.prefix or any(c in self.prefix for c in "*?[]:"):
            raise ValueError("the Redis key prefix must be non-empty, without glob characters or ':'")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")


KV_EVENT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """KV events in vLLM's ZMQ format: the RAM cache's blocks announced to a gateway's indexer
    (docs/gateway.md). The flags mirror vLLM's --kv-events-config fields of the same names."""

    endpoint: str  # PUB socket: bound where it has '*' or '::' (or is ipc:// / inproc://), else connected
    topic: str = ""  # first frame of every message; llm-d's indexer wants kv@<pod-id>@<model-name>
    replay_endpoint: str | None = None  # ROUTER socket (always bound) answering replays from a sequence number
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (messages ZMQ queues per subscriber)
    max_queue_size: int = 100_000  # cache changes waiting for the publisher thread; past it they are dropped
    block_size: int = 16  # tokens per announced block; must be the indexer's block size
    data_parallel_rank: int = 0  # the third field of every batch
    # keys the block hashes (docs/gateway.md, "What events reveal"): random per process unless a test sets it
    hash_key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def __post_init__(self) -> None:
        for name, value in (("endpoint", self.endpoint), ("replay endpoint", self.replay_endpoint)):
            if value is not None and not value.startswith(KV_EVENT_SCHEMES):
                raise ValueError(f"the KV events {name} must start with tcp://, ipc:// or inproc://, not {value!r}")
        if self.block_size < 1:
            raise ValueError("the KV events block size must be >= 1")
        if self.buffer_steps < 0 or self.hwm < 0 or self.max_queue_size < 1:
            raise ValueError("KV events buffer steps and hwm must be >= 0, the queue size >= 1")
        if not 16 <= len(self.hash_key) <= 64:  # BLAKE2b's key
            raise ValueError("the KV events hash key is 16 to 64 bytes")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    max_bytes: int = 2 << 30  # one global budget across all namespaces; 0 disables caching
    disk_dir: str | None = None  # the disk tier's directory (docs/cache.md)
    disk_max_bytes: int = 0  # the disk tier's budget; 0 = no disk tier
    shared: SharedTierConfig | None = None  # the shared tier on Redis; None = none
    eviction: str = "lru"  # which entry makes room first: "lru" or "gdsf" (cache/eviction.py)

    def __post_init__(self) -> None:
        if self.max_bytes < 0:
            raise ValueError("cache max_bytes must be >= 0")
        if self.disk_max_bytes < 0:
            raise ValueError("cache disk_max_bytes must be >= 0")
        if self.disk_max_bytes and not self.disk_dir:
            raise ValueError("a disk tier needs a directory")
        if self.eviction not in ("lru", "gdsf"):
            raise ValueError(f"cache eviction must be 'lru' or 'gdsf', not {self.eviction!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    # long prompts are prefilled in chunks so decoders keep moving, and one step's rows bounded so a
    # newcomer's first token waits for a short step (docs/architecture.md, "Scheduling")
    prefill_chunk_tokens: int = 128
    max_batch_tokens: int = 256  # token budget of one engine step (decode rows + prefill chunks)
    max_num_seqs: int = 64  # sessions running at once; the rest wait
    offer_finished_turns: bool = True  # cache prompt + reply so the next chat turn hits
    # requests waiting beyond the free room (a session slot and session bytes at the next step: engine/
    # admission.py); past it new ones get 429
    max_queued_requests: int = 256
    max_session_bytes: int = 4 << 30  # KV of all running sessions together; admission waits past it

    def __post_init__(self) -> None:
        if self.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1")
        if self.max_batch_tokens < self.prefill_chunk_tokens:
            raise ValueError("max_batch_tokens must be >= prefill_chunk_tokens")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_queued_requests < 1:  # 0 would refuse every request: one waits while the engine takes it
            raise ValueError("max_queued_requests must be >= 1")
        if self.max_session_bytes < 1:
            raise ValueError("max_session_bytes must be >= 1")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # empty = open server with one tenant
    admin_key: str | None = None
    # /metrics readable without a key where tenant keys are configured (a scraper on a private network);
    # else it needs the admin key there (its figures are every tenant's traffic together)
    metrics_open: bool = False
    # origins whose browser pages may call the API (CORS); "*" any; empty: none (browsers refuse them)
    allowed_origins: tuple[str, ...] = ()
    data_dir: str = ""  # "" = default_data_dir(os.environ), resolved by the caller that reads the environment
    ledger_path: str | None = None  # None = <data_dir>/usage.sqlite3
    pricing_path: str | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # a request without max_tokens generates at most this many
    max_stored_responses: int = 4096  # /v1/responses answers kept for previous_response_id (0: none)
    # their SQLite file (server/openai/responses/disk.py); None: memory only, gone at restart (`serve` sets
    # <data_dir>/responses.sqlite3 unless --no-responses-persist)
    responses_path: str | None = None
    reasoning_parser: str = "auto"  # "auto": a thinking model's reasoning as reasoning_content; "none": as text
    # after SIGTERM / SIGINT, how long requests in flight may take before the engine ends them; 0 = at
    # once (docs/architecture.md, "Shutdown")
    shutdown_timeout_s: float = 20.0  # + SETTLE_S + the drain: inside Kubernetes' default 30 s grace

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError("port must be in 1..65535")
        if not 0 <= self.shutdown_timeout_s < float("inf"):  # NaN fails too
            raise ValueError("shutdown_timeout_s must be a number of seconds >= 0")
        if self.max_stored_responses < 0:
            raise ValueError("max_stored_responses must be >= 0")
        if self.reasoning_parser not in ("auto", "none"):
            raise ValueError("reasoning_parser must be 'auto' or 'none'")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")


def default_data_dir(environ: Mapping[str, str]) -> str:
    """The one data directory (usage ledger, stored responses, disk cache tier) when no flag names one:
    $PREFIXSERVE_DATA_DIR, else $XDG_DATA_HOME/prefixserve, else ~/.local/share/prefixserve (the XDG
    base-directory default). Pure but for expanding ~ through `environ`'s HOME."""
    if environ.get("PREFIXSERVE_DATA_DIR"):
        return environ["PREFIXSERVE_DATA_DIR"]
    if environ.get("XDG_DATA_HOME"):
        return os.path.join(environ["XDG_DATA_HOME"], "prefixserve")
    home = environ.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".local", "share", "prefixserve")


def cache_home(environ: Mapping[str, str]) -> str:
    """Where derived data goes (XDG's cache home): $XDG_CACHE_HOME/prefixserve, else ~/.cache/prefixserve."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "prefixserve")


def default_model_cache_dir(environ: Mapping[str, str]) -> str:
    """The prepared-model cache when no flag names one: $PREFIXSERVE_MODEL_CACHE_DIR, else
    `cache_home`/models."""
    if environ.get("PREFIXSERVE_MODEL_CACHE_DIR"):
        return environ["PREFIXSERVE_MODEL_CACHE_DIR"]
    return os.path.join(cache_home(environ), "models")
