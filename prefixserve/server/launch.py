"""What `prefixserve serve` sets up before the model loads: `Launch`.

The settings (server/settings.py: flag, else environment variable, else default) become the model,
cache, engine and server configs and the API keys (`Launch.resolve`), then the files and sockets
they name are made and opened (`Launch.open`): the data and disk cache directories, the KV events'
publisher, the stored responses and the usage ledger. Each problem is a ValueError (or OSError,
sqlite3.Error, ...) naming its flag and path; server/run.py prints it as one line, exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixserve.config import (
    SHARED_SECRET_MIN_BYTES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ServerConfig,
    SharedTierConfig,
    default_data_dir,
    default_model_cache_dir,
)
from prefixserve.kvevents import open_publisher
from prefixserve.ledger import Ledger, Pricing
from prefixserve.server.openai.responses.store import ResponseStore, open_response_store
from prefixserve.server.operator.auth import KeyStore, parse_key_spec, read_keys_file
from prefixserve.server.settings import api_key_specs, kv_events_config, resolve_all

if TYPE_CHECKING:
    from prefixserve.kvevents.publisher import KVEventPublisher

# what a bad setting or an unusable file raises: one line on stderr, exit status 2
CONFIG_ERRORS = (OSError, ValueError, RuntimeError, sqlite3.Error, argparse.ArgumentTypeError)


@dataclass(slots=True)
class Launch:
    """The resolved settings (`s`, by dest), the configs and keys they make, and what `open` opened:
    the KV events' publisher, the stored responses and the usage ledger (each None when off or not
    opened yet). The app takes over the stored responses and the ledger (server/app.py); `close`
    closes whatever was opened, for a start-up that ends before serving."""

    args: argparse.Namespace
    env: Mapping[str, str]
    s: dict[str, Any]
    model_config: ModelConfig
    cache_config: CacheConfig
    engine_config: EngineConfig
    server_config: ServerConfig
    keys: KeyStore
    kv_events: KVEventPublisher | None = None
    responses: ResponseStore | None = None
    ledger: Ledger | None = None

    @classmethod
    def resolve(cls, args: argparse.Namespace, env: Mapping[str, str]) -> Launch:
        """Every setting checked and turned into its config, the log level set; nothing opened yet
        but the keys file."""
        s = resolve_all(args, env)
        logging.basicConfig(
            level=s["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        specs = api_key_specs(args, env)
        if s["api_keys_file"]:
            specs += read_keys_file_for_flag(s["api_keys_file"])
        for spec in specs:
            parse_key_spec(spec)
        check_model_path(s["model"])
        model_config = ModelConfig(
            path=s["model"],
            served_model_name=s["served_model_name"],
            dtype=s["dtype"],
            device=s["device"],
            decode_kernel=s["decode_kernel"],
            max_model_len=s["max_model_len"],
            num_threads=s["num_threads"],
            decode_threads=s["decode_threads"],
            cache_dir=None if s["no_model_cache"] else (s["model_cache_dir"] or default_model_cache_dir(env)),
            fresh_self_test=s["fresh_self_test"],
        )
        data_dir = Path(s["data_dir"] or default_data_dir(env))
        cache_config = CacheConfig(max_bytes=s["cache_max_bytes"], disk_dir=s["cache_dir"] or str(data_dir / "cache"),
                                   disk_max_bytes=s["cache_disk_bytes"], shared=shared_tier_config(s),
                                   eviction=s["cache_eviction"])
        engine_config = EngineConfig(
            prefill_chunk_tokens=s["prefill_chunk_tokens"],
            max_batch_tokens=s["max_batch_tokens"],
            max_num_seqs=s["max_num_seqs"],
            max_queued_requests=s["max_queued_requests"],
            max_session_bytes=s["max_session_bytes"],
        )
        server_config = server_config_of(s, specs, data_dir)
        keys = KeyStore.from_specs(server_config.api_keys, server_config.admin_key)
        return cls(args, env, s, model_config, cache_config, engine_config, server_config, keys)

    def open(self) -> None:
        """Make the data directory and the disk cache tier's, open the KV events, the stored responses
        (read back from their file: server/openai/responses/disk.py) and the usage ledger."""
        s, cache_config, server_config = self.s, self.cache_config, self.server_config
        make_dir("--data-dir", Path(server_config.data_dir))
        if cache_config.disk_max_bytes and cache_config.disk_dir:  # one that cannot be made is a config error;
            # one that exists read-only is served from, with a warning (docs/cache.md, "Disk failures")
            make_dir("--cache-dir" if s["cache_dir"] else "--data-dir", Path(cache_config.disk_dir), mode=0o700)
        self.kv_events = open_publisher(kv_events_config(s))  # the KV events' sockets, bound or connected now
        self.responses = open_response_store(server_config.max_stored_responses, server_config.responses_path,
                                             "--responses-path" if s["responses_path"] else "--data-dir")
        self.ledger = None if s["no_ledger"] else open_ledger(server_config, getattr(self.args, "prices", None) or (),
                                                              "--ledger-path" if s["ledger_path"] else "--data-dir")

    def keys_source(self) -> Callable[[], KeyStore] | None:
        """What SIGHUP reads the keys from: the key flags and the keys file, read again; None without
        a keys file (server/operator/auth.py, `reload_keys`)."""
        if not self.s["api_keys_file"]:
            return None

        def read_again() -> KeyStore:
            return KeyStore.from_specs([*api_key_specs(self.args, self.env),
                                        *read_keys_file_for_flag(self.s["api_keys_file"])],
                                       self.server_config.admin_key)

        return read_again

    def close(self) -> None:
        """Close the ledger, the stored responses and the KV events (each None when off or not opened)."""
        for thing in (self.ledger, self.responses, self.kv_events):
            if thing is not None:
                thing.close()


def server_config_of(s: dict[str, Any], specs: Sequence[str], data_dir: Path) -> ServerConfig:
    """The HTTP server's config from the resolved settings, the key specs and the data directory."""
    return ServerConfig(
        host=s["host"],
        port=s["port"],
        api_keys=tuple(specs),
        admin_key=s["admin_key"] or None,
        metrics_open=bool(s["metrics_open"]),
        allowed_origins=tuple(s["allowed_origins"]),
        data_dir=str(data_dir),
        ledger_path=s["ledger_path"] or str(data_dir / "usage.sqlite3"),
        pricing_path=s["pricing"],
        default_max_tokens=s["default_max_tokens"],
        max_stored_responses=s["max_stored_responses"],
        responses_path=None if s["no_responses_persist"] else s["responses_path"] or str(data_dir / "responses.sqlite3"),
        reasoning_parser=s["reasoning_parser"],
        shutdown_timeout_s=s["shutdown_timeout"],
    )


def shared_tier_config(s: dict[str, Any]) -> SharedTierConfig | None:
    """The shared tier's config from the resolved settings, or None without a URL. Raises ValueError
    for a URL without a secret (or two secrets, or a secret without a URL); OSError for an unreadable file."""
    url, key, key_file = s["cache_redis_url"], s["cache_redis_key"], s["cache_redis_key_file"]
    if key and key_file:
        raise ValueError("give either --cache-redis-key or --cache-redis-key-file, not both")
    if not url:
        if key or key_file:
            raise ValueError(f"{'--cache-redis-key-file' if key_file else '--cache-redis-key'} needs --cache-redis-url")
        return None
    if not key and not key_file:
        raise ValueError("--cache-redis-url needs a secret: --cache-redis-key or --cache-redis-key-file")
    secret = read_secret_file(key_file) if key_file else key.encode()
    return SharedTierConfig(url=url, secret=secret)


def check_model_path(path: str | None) -> None:
    """A --model that cannot be a model is a ValueError naming the flag, before torch is imported: a
    path that is not there, a file without GGUF's magic, a folder without config.json (what each
    loader reads first). What else is wrong with a model shows when it loads (exit status 1)."""
    if path is None:
        return
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"--model {path}: a model folder holds config.json (a Hugging Face folder); this one does not")
        return
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"--model {path}: cannot read it: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ValueError(f"--model {path}: not a GGUF file (no GGUF magic) nor a model folder")


def read_secret_file(path: str) -> bytes:
    """The shared tier's secret from --cache-redis-key-file (surrounding whitespace stripped). A file
    that cannot be read or holds under 16 bytes is a ValueError naming the flag and the path: a
    bare OSError would name neither, and a short secret would blame --cache-redis-key."""
    try:
        secret = Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf").strip()  # an editor's byte-order mark is no part of it
    except OSError as e:
        raise ValueError(f"--cache-redis-key-file {path}: cannot read it: {e.strerror or e}") from None
    if len(secret) < SHARED_SECRET_MIN_BYTES:
        raise ValueError(f"--cache-redis-key-file {path}: the secret must be at least {SHARED_SECRET_MIN_BYTES} bytes, "
                         f"the file holds {len(secret)}")
    return secret


def read_pricing(path: str) -> Pricing:
    """The --pricing file. One that cannot be read or parsed is a ValueError naming the flag and the
    path (Pricing's own messages start with the path; an OSError's name neither)."""
    try:
        return Pricing.from_toml(path)
    except OSError as e:
        raise ValueError(f"--pricing {path}: cannot read it: {e.strerror or e}") from None
    except ValueError as e:  # PricingError: "<path>...: what is wrong"
        raise ValueError(f"--pricing {e}" if str(e).startswith(path) else f"--pricing {path}: {e}") from None


def open_ledger(server_config: ServerConfig, prices: Sequence[str] = (), flag: str = "--ledger-path") -> Ledger:
    """The usage ledger, priced from the TOML file and/or `--price` flags. A path that cannot hold it
    (a directory, a parent that cannot be made or written) is a ValueError naming `flag` and the path."""
    pricing = read_pricing(server_config.pricing_path) if server_config.pricing_path else Pricing.default()
    if prices:
        pricing = Pricing.from_specs(prices, base=pricing)
    assert server_config.ledger_path is not None
    path = Path(server_config.ledger_path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; the usage ledger is a file (e.g. {path / 'usage.sqlite3'})")
    make_dir(flag, path.parent, what="the usage ledger's directory", writable=True)
    try:
        return Ledger(str(path), pricing)
    except (sqlite3.Error, OSError) as e:
        raise ValueError(f"{flag} {path}: cannot open the usage ledger: {e}") from None


def make_dir(flag: str, path: Path, mode: int = 0o777, what: str = "", writable: bool = False) -> None:
    """Create directory `path` (and its parents) if missing; one that cannot be, is not a directory,
    or (`writable`) cannot be written is a ValueError naming `flag` and the path."""
    where = f"{flag} {path}" + (f" ({what})" if what else "")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{where}: not a directory")
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{where}: cannot create it: {e.strerror or e}") from None
    if writable and not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{where}: not writable by this user")


def read_keys_file_for_flag(path: str) -> list[str]:
    """`read_keys_file`, its errors naming --api-keys-file (a missing file, a directory, a bad line)."""
    try:
        return read_keys_file(path)
    except OSError as e:
        raise ValueError(f"--api-keys-file {path}: {e.strerror or e}") from None
    except ValueError as e:  # its message starts with the path (and line)
        raise ValueError(f"--api-keys-file {e}") from None
