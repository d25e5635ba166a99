"""`prefixserve serve`: start-up and shutdown (the flags and their PREFIXSERVE_* environment variables:
server/settings.py).

Start-up checks everything it can before the model loads: a bad setting, an unusable file or
directory (named by its flag), a port in use are each one line on stderr and exit status 2. Then the
port listens at once: while the model loads, /health answers 503 ``{"status": "loading", "phase",
"elapsed_s", ...}`` and every other request a 503 to retry, and each long phase prints a line on
the console, the last one the URL and the start-up's time (server/startup.py). On
SIGTERM (or Ctrl-C) uvicorn stops accepting connections; requests in flight get up to
--shutdown-timeout seconds, then the engine ends the rest (server/shutdown.py, docs/architecture.md,
"Shutdown"); then the app's lifespan drains the engine and closes the ledger and the stored responses'
file, and `run_serve` returns 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sqlite3
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefixserve.config import (
    SHARED_SECRET_MIN_BYTES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    ServerConfig,
    SharedTierConfig,
    default_data_dir,
    default_model_cache_dir,
)
from prefixserve.kvevents import open_publisher
from prefixserve.ledger import Ledger, Pricing
from prefixserve.server.auth import KeyStore, parse_key_spec, read_keys_file
from prefixserve.server.response_store import open_response_store
from prefixserve.server.settings import api_key_specs, kv_events_config, resolve_all
from prefixserve.server.startup import LoadingServer, StartupProgress, hand_over

if TYPE_CHECKING:  # not at run time: prefixserve.engine imports torch, seconds the port would not answer in
    from prefixserve.engine.protocol import EngineClient

STARTUP_TIMES = "startup-times.json"  # beside the prepared models: each model's last start-up, phase by phase

logger = logging.getLogger("prefixserve.server")


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGTERM / Ctrl-C, drain, return 0. Configuration errors return 2."""
    env = os.environ
    responses = kv_events = None
    try:
        s = resolve_all(args, env)
        logging.basicConfig(
            level=s["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        specs = api_key_specs(args, env)
        if s["api_keys_file"]:
            specs += read_keys_file_for_flag(s["api_keys_file"])
        for spec in specs:
            parse_key_spec(spec)
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
        server_config = ServerConfig(
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
        keys = KeyStore.from_specs(server_config.api_keys, server_config.admin_key)
        make_dir("--data-dir", data_dir)
        if cache_config.disk_max_bytes and cache_config.disk_dir:  # one that cannot be made is a config error;
            # one that exists read-only is served from, with a warning (docs/cache.md, "Disk failures")
            make_dir("--cache-dir" if s["cache_dir"] else "--data-dir", Path(cache_config.disk_dir), mode=0o700)
        kv_events = open_publisher(kv_events_config(s))  # the KV events' sockets, bound or connected now
        # stored /v1/responses answers, read back from their file (server/response_disk.py)
        responses = open_response_store(server_config.max_stored_responses, server_config.responses_path,
                                        "--responses-path" if s["responses_path"] else "--data-dir")
        ledger = None if s["no_ledger"] else open_ledger(server_config, getattr(args, "prices", None) or (),
                                                         "--ledger-path" if s["ledger_path"] else "--data-dir")
    except (OSError, ValueError, RuntimeError, sqlite3.Error, argparse.ArgumentTypeError) as e:
        print(f"prefixserve serve: {e}", file=sys.stderr)
        _close(kv_events, responses)
        return 2
    try:  # the port is ours before the model loads: a port in use is an error now, not after the load
        sock = bind_socket(server_config.host, server_config.port)
    except OSError as e:
        print(f"prefixserve serve: cannot listen on {server_config.host}:{server_config.port}: "
              f"{e.strerror or e}", file=sys.stderr)
        _close(ledger, responses, kv_events)
        return 2

    signal.signal(signal.SIGTERM, _exit_now)  # while the model loads, SIGTERM just exits cleanly
    url = server_url(server_config.host, sock)
    progress = StartupProgress(
        out=sys.stdout if logging.getLevelName(s["log_level"].upper()) in (logging.DEBUG, logging.INFO) else None,
        timings_path=None if model_config.cache_dir is None else os.path.join(model_config.cache_dir, STARTUP_TIMES),
        key=f"{os.path.abspath(model_config.path) if model_config.path else 'embedded'}|{model_config.dtype}|"
            f"{model_config.device}")
    loading = LoadingServer(sock, progress)
    loading.start()  # /health answers "loading" from now on

    def abandon() -> None:  # a start-up that ends before serving
        loading.stop()
        progress.close()
        _close(ledger, responses, kv_events)
        sock.close()

    try:
        progress.phase("importing", "importing the runtime (torch, transformers)")
        # every module build_engine imports on this thread, torch among them, while a SIGTERM only
        # records (`_exit_now`): a SystemExit raised inside an import breaks numpy for the process
        import prefixserve.engine.async_engine
        import prefixserve.engine.torch_thread  # noqa: F401
        from prefixserve.engine import build_engine
        from prefixserve.models import ModelLoadError
    except BaseException:
        abandon()
        raise
    _INTERRUPTIBLE.set()
    if _STOP.is_set():  # a SIGTERM during the imports
        abandon()
        return 0
    logger.info("loading the model ...")
    try:
        engine = build_engine(model_config, cache_config, engine_config, progress=progress.phase,
                              cache_listener=kv_events)
    except ConfigError as e:  # a setting the model loaded cannot work with (config.py)
        print(f"prefixserve serve: {e}", file=sys.stderr)
        abandon()
        return 2
    except ModelLoadError as e:
        logger.error("cannot load the model: %s", e)
        abandon()
        return 1
    except BaseException:
        abandon()
        raise
    progress.phase("starting_http", f"starting HTTP on {url}")
    from prefixserve.server.app import create_app

    # owns engine, ledger and stored responses from here
    def keys_source() -> KeyStore:  # SIGHUP: the key flags and the keys file, read again
        return KeyStore.from_specs([*api_key_specs(args, env), *read_keys_file_for_flag(s["api_keys_file"])],
                                   server_config.admin_key)

    app = create_app(engine, server_config, ledger, keys=keys, keys_source=keys_source if s["api_keys_file"] else None,
                     response_store=responses)
    try:
        return serve_app(app, server_config.host, server_config.port, s["log_level"], sock, engine=engine,
                         shutdown_timeout_s=server_config.shutdown_timeout_s, before_serving=loading.stop,
                         on_ready=lambda: progress.ready(url, engine.model_id))
    finally:
        loading.stop()
        progress.close()
        _close(kv_events)  # after the engine drained: its last changes are published


def server_url(host: str, sock: socket.socket) -> str:
    """http://host:port of the bound socket (its real port where --port was 0), IPv6 in brackets."""
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening: `run_serve`'s LoadingServer
    (server/startup.py) listens on it as soon as the settings are checked, then uvicorn serves it."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT never blocks a restart
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve_app(app: Any, host: str, port: int, log_level: str = "info", sock: socket.socket | None = None, *,
              engine: EngineClient | None = None, shutdown_timeout_s: float = 30.0,
              before_serving: Callable[[], None] | None = None, on_ready: Callable[[], Any] | None = None) -> int:
    """Run uvicorn until SIGTERM / SIGINT, then shut down within `shutdown_timeout_s` (plus the time
    the engine takes to end what is left: server/shutdown.py); 0 on a clean shutdown. `sock`: a socket
    already bound to (host, port) (`bind_socket`); None binds here. `engine`: the app's, whose
    requests are ended when the grace runs out. `before_serving` runs as the app's lifespan start-up
    ends, before uvicorn accepts on `sock` (the loading server's stop); `on_ready` once it accepts."""
    import uvicorn

    from prefixserve.server import shutdown

    endings = getattr(getattr(app, "state", None), "endings", None)
    if before_serving is not None:
        app = hand_over(app, before_serving)
    config = uvicorn.Config(  # the access log line comes from server/middleware.py, after the response
        app, host=host, port=port, log_level=log_level, lifespan="on", timeout_keep_alive=5, access_log=False
    )
    server = shutdown.GracefulServer(config, engine, shutdown_timeout_s, endings=endings, on_started=on_ready)
    # uvicorn installs the server's handler while it runs and puts back what it found: the same one,
    # so a signal in the moments before and after is recorded too, never a death by SIGTERM
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)
    server.run(sockets=None if sock is None else [sock])
    # Drained and closed. A further SIGTERM (a supervisor repeating itself) must not turn this
    # clean exit into a death by signal: Python resets handlers to the default while it
    # finalises, but leaves SIG_IGN in place.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    return 0 if server.started else 1


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


def _close(*owned: Any | None) -> None:
    """Close the ledger, the response store and the KV events (each None when off)."""
    for thing in owned:
        if thing is not None:
            thing.close()


_STOP = threading.Event()  # a SIGTERM arrived before the server served
_INTERRUPTIBLE = threading.Event()  # set once the heavy imports are done: SIGTERM may raise SystemExit


def _exit_now(signum: int, frame: Any) -> None:
    """SIGTERM before the server serves: exit cleanly. While torch and the model's modules are being
    imported it only records the request (`_STOP`, read right after them): a SystemExit raised inside
    an import leaves half-imported modules (numpy's "cannot load module more than once") and a
    traceback. Later (the main thread waits for the model's load) it raises SystemExit at once."""
    _STOP.set()
    if _INTERRUPTIBLE.is_set():
        raise SystemExit(0)
