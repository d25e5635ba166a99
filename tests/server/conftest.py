from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from prefixserve.config import ServerConfig
from prefixserve.server.app import create_app
from tests.helpers.fake_engine import FakeEngine

KEY_A = "sk-tenant-a-0123456789"
KEY_B = "sk-tenant-b-9876543210"
ADMIN = "sk-admin-xyz"


class FakeLedger:
    def __init__(self) -> None:
        self.records: list[Any] = []
        self.closed = False

    def record(self, rec: Any) -> None:
        self.records.append(rec)

    def refusal(self) -> str | None:
        return None

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def make_client(engine: FakeEngine) -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(
        api_keys: tuple[str, ...] = (KEY_A, f"bob {KEY_B}"),
        admin_key: str | None = ADMIN,
        ledger: Any = None,
        eng: FakeEngine | None = None,
        metrics_open: bool = False,
        allowed_origins: tuple[str, ...] = (),
    ) -> TestClient:
        config = ServerConfig(api_keys=api_keys, admin_key=admin_key, metrics_open=metrics_open,
                              allowed_origins=allowed_origins)
        app = create_app(eng or engine, config, ledger)
        client = TestClient(app)
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    return make_client()


def auth(key: str = KEY_A) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
