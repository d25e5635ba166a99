"""`prefixserve serve`: start-up and shutdown (the flags and their PREFIXSERVE_* environment variables:
server/settings.py).

Start-up checks everything it can before the model loads (server/launch.py): a bad setting, an
unusable file or directory (named by its flag), a port in use are each one line on stderr and exit
status 2. Then the port listens at once: while the model loads, /health answers 503 ``{"status":
"loading", "phase", "elapsed_s", ...}`` and every other request a 503 to retry, and each long phase
prints a line on the console, the last one the URL and the start-up's time (server/startup.py). On
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
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefixserve.config import ConfigError
from prefixserve.models.kernels import native_build
from prefixserve.server.launch import CONFIG_ERRORS, Launch
from prefixserve.server.startup import LoadingServer, StartupProgress, hand_over

if TYPE_CHECKING:  # not at run time: prefixserve.engine imports torch, seconds the port would not answer in
    from prefixserve.engine.protocol import EngineClient
    from prefixserve.models.loaders.prepared import Later

STARTUP_TIMES = "startup-times.json"  # beside the prepared models: each model's last start-up, phase by phase

logger = logging.getLogger("prefixserve.server")


class StartEnded(Exception):
    """The start-up ended before serving, with this exit status (what it opened is closed)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGTERM / Ctrl-C, drain, return 0. Configuration errors return 2."""
    try:
        launch = Launch.resolve(args, os.environ)
    except CONFIG_ERRORS as e:
        return _config_error(e)
    try:
        launch.open()
    except CONFIG_ERRORS as e:
        launch.close()
        return _config_error(e)
    config = launch.server_config
    try:  # the port is ours before the model loads: a port in use is an error now, not after the load
        sock = bind_socket(config.host, config.port)
    except OSError as e:
        print(f"prefixserve serve: cannot listen on {config.host}:{config.port}: "
              f"{e.strerror or e}", file=sys.stderr)
        launch.close()
        return 2

    signal.signal(signal.SIGTERM, _exit_now)  # while the model loads, SIGTERM just exits cleanly
    url = server_url(config.host, sock)
    progress = startup_progress(launch)
    loading = LoadingServer(sock, progress)
    loading.start()  # /health answers "loading" from now on

    def abandon() -> None:  # a start-up that ends before serving
        native_build.cancel()  # a first start's compilers stop with it
        loading.stop()
        progress.close()
        launch.close()
        sock.close()

    stores: list[Callable[[], None]] = []  # a model prepared anew: stored once the server serves
    try:
        engine = load_engine(launch, progress, abandon, stores.append)
    except StartEnded as e:
        return e.status
    progress.phase("starting_http", f"starting HTTP on {url}")
    from prefixserve.server.app import create_app

    # owns engine, ledger and stored responses from here
    app = create_app(engine, config, launch.ledger, keys=launch.keys, keys_source=launch.keys_source(),
                     response_store=launch.responses)
    try:
        return serve_app(app, config.host, config.port, launch.s["log_level"], sock, engine=engine,
                         shutdown_timeout_s=config.shutdown_timeout_s, before_serving=loading.stop,
                         on_ready=lambda: _ready(progress, url, engine, stores))
    finally:
        loading.stop()
        progress.close()
        if launch.kv_events is not None:  # after the engine drained: its last changes are published
            launch.kv_events.close()


def _config_error(e: Exception) -> int:
    """A bad setting or an unusable file: one line on stderr, exit status 2."""
    print(f"prefixserve serve: {e}", file=sys.stderr)
    return 2


def startup_progress(launch: Launch) -> StartupProgress:
    """The start-up's console lines (at log level info or debug) and its timings file, beside the
    prepared models (none without the model cache)."""
    model_config = launch.model_config
    return StartupProgress(
        out=sys.stdout if logging.getLevelName(launch.s["log_level"].upper()) in (logging.DEBUG, logging.INFO) else None,
        timings_path=None if model_config.cache_dir is None else os.path.join(model_config.cache_dir, STARTUP_TIMES),
        key=f"{os.path.abspath(model_config.path) if model_config.path else 'embedded'}|{model_config.dtype}|"
            f"{model_config.device}")


def load_engine(launch: Launch, progress: StartupProgress, abandon: Callable[[], None],
                later: Later | None = None) -> EngineClient:
    """Import the runtime and build the engine. A start-up that ends here calls `abandon` and raises
    StartEnded: 0 for a SIGTERM during the imports, 2 for a setting the model cannot work with
    (config.py's ConfigError, one line on stderr), 1 for a model that cannot load."""
    try:
        if launch.model_config.device != "cuda":
            # the compiler on the other core while torch is imported and the model prepared (a SIGTERM
            # meanwhile cancels it); `prefixserve serve` has started it already (cli/__init__.py)
            native_build.prebuild()
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
        raise StartEnded(0)
    logger.info("loading the model ...")
    try:
        return build_engine(launch.model_config, launch.cache_config, launch.engine_config, progress=progress.phase,
                            cache_listener=launch.kv_events, later=later)
    except ConfigError as e:  # a setting the model loaded cannot work with (config.py)
        print(f"prefixserve serve: {e}", file=sys.stderr)
        abandon()
        raise StartEnded(2) from None
    except ModelLoadError as e:
        logger.error("cannot load the model: %s", e)
        abandon()
        raise StartEnded(1) from None
    except BaseException:
        abandon()
        raise


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


def _ready(progress: StartupProgress, url: str, engine: EngineClient, stores: list[Callable[[], None]]) -> None:
    """The server serves: say so, then have the grammar compiler built (its build holds the GIL, so not
    while `/health` is still waited for: AsyncEngine.build_grammars_soon) and a model prepared anew
    stored (prepared.save_later: 380 MB written, 1.8-2.9 s on the 2-core Zen 3 VM, that a first start
    no longer waits for; not a daemon thread, so a shutdown meanwhile waits for it and the next start
    finds the entry)."""
    progress.ready(url, engine.model_id)
    engine.build_grammars_soon()
    for store in stores:
        threading.Thread(target=store, name="prefixserve-prepared-save").start()
    stores.clear()


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
