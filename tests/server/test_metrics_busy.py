"""A /metrics scrape never holds up other requests: the handler reads the engine off the event loop.
(It read it on the loop, and the engine waited there for its step lock: every request and stream on
the server stalled for the wait, up to 2 s, while a prefill ran.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from fastapi.testclient import TestClient

from tests.helpers.fake_engine import FakeEngine
from tests.server.conftest import ADMIN, auth

BUSY_S = 1.0


class BusyEngine(FakeEngine):
    """An engine whose metrics() blocks its caller, as one waiting for a long step would."""

    def __init__(self) -> None:
        super().__init__()
        self.reading = threading.Event()

    def metrics(self) -> dict[str, float]:
        self.reading.set()
        time.sleep(BUSY_S)
        return super().metrics()


def test_requests_during_a_slow_scrape_do_not_wait_for_it(make_client: Callable[..., TestClient]) -> None:
    engine = BusyEngine()
    client = make_client(eng=engine)
    scrape: list[str] = []
    scraper = threading.Thread(target=lambda: scrape.append(client.get("/metrics", headers=auth(ADMIN)).text))
    scraper.start()
    assert engine.reading.wait(5.0)
    times = {}
    for path, headers in (("/health", {}), ("/v1/models", auth())):
        t0 = time.monotonic()
        assert client.get(path, headers=headers).status_code == 200
        times[path] = time.monotonic() - t0
    scraper.join(10.0)
    assert all(t < BUSY_S / 4 for t in times.values()), times  # they waited for the scrape: ~1 s
    assert "prefixserve_cache_entries" in scrape[0]  # and the scrape itself still answered in full
