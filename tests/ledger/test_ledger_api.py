"""GET /v1/usage payloads: OpenAI's page shape, tenant isolation, pagination, parameter errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixserve.ledger import Ledger, Pricing, UsageQueryError, UsageRecord
from prefixserve.ledger.api import usage_payload

DAY = 86_400
T0 = 1_730_419_200  # 2024-11-01T00:00:00Z
NOW = T0 + 3 * DAY + 100


@pytest.fixture()
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(str(tmp_path / "usage.sqlite3"), Pricing.from_specs(["m1=2,0.5,8", "m2=4,1,16"]))
    # alice: 2 requests on day 0 (m1, m2), 1 on day 2; bob: 1 on day 0
    led.record(UsageRecord("a1", "alice", "m1", 100, 40, 10, "stop", T0 + 5))
    led.record(UsageRecord("a2", "alice", "m2", 50, 0, 5, "length", T0 + 3600))
    led.record(UsageRecord("a3", "alice", "m1", 10, 10, 1, "abort", T0 + 2 * DAY + 1))
    led.record(UsageRecord("b1", "bob", "m1", 1000, 900, 100, "stop", T0 + 7))
    yield led
    led.close()


def payload(ledger: Ledger, params: dict[str, str], tenant: str = "alice", admin: bool = False) -> dict:
    return usage_payload(ledger, params, tenant, admin, now=NOW)


def result(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "object": "organization.usage.completions.result",
        "model": None,
        "tenant_id": None,
    }
    base.update(kw)
    return base


def test_page_shape_for_a_tenant(ledger: Ledger) -> None:
    got = payload(ledger, {"start_time": str(T0), "end_time": str(T0 + 3 * DAY)})
    assert got == {
        "object": "page",
        "data": [
            {
                "object": "bucket",
                "start_time": T0,
                "end_time": T0 + DAY,
                "results": [
                    result(
                        input_tokens=150,
                        input_cached_tokens=40,
                        output_tokens=15,
                        num_model_requests=2,
                        cost_usd=(60 * 2 + 40 * 0.5 + 10 * 8) / 1e6 + (50 * 4 + 5 * 16) / 1e6,
                    )
                ],
            },
            {"object": "bucket", "start_time": T0 + DAY, "end_time": T0 + 2 * DAY, "results": []},
            {
                "object": "bucket",
                "start_time": T0 + 2 * DAY,
                "end_time": T0 + 3 * DAY,
                "results": [
                    result(
                        input_tokens=10,
                        input_cached_tokens=10,
                        output_tokens=1,
                        num_model_requests=1,
                        cost_usd=(10 * 0.5 + 8) / 1e6,
                    )
                ],
            },
        ],
        "has_more": False,
        "next_page": None,
    }


def test_group_by_model_and_tenant(ledger: Ledger) -> None:
    got = payload(ledger, {"start_time": str(T0), "end_time": str(T0 + DAY), "group_by": "model,tenant_id"})
    assert [(r["tenant_id"], r["model"], r["num_model_requests"]) for r in got["data"][0]["results"]] == [
        ("alice", "m1", 1),
        ("alice", "m2", 1),
    ]


def test_non_admin_never_sees_others(ledger: Ledger) -> None:
    got = payload(
        ledger, {"start_time": str(T0), "end_time": str(T0 + DAY), "group_by": "tenant_id"}, tenant="bob"
    )
    assert [(r["tenant_id"], r["input_tokens"]) for r in got["data"][0]["results"]] == [("bob", 1000)]
    nobody = payload(ledger, {"start_time": str(T0), "end_time": str(T0 + DAY)}, tenant="carol")
    assert nobody["data"][0]["results"] == []
    for value in ("alice", "bob"):  # not even its own id: the filter is an admin feature
        with pytest.raises(UsageQueryError) as e:
            payload(ledger, {"start_time": str(T0), "tenant_id": value}, tenant="bob")
        assert e.value.param == "tenant_id"


def test_admin_sees_all_and_filters(ledger: Ledger) -> None:
    params = {"start_time": str(T0), "end_time": str(T0 + DAY), "group_by": "tenant_id"}
    everyone = payload(ledger, params, tenant="root", admin=True)
    assert [(r["tenant_id"], r["num_model_requests"]) for r in everyone["data"][0]["results"]] == [
        ("alice", 2),
        ("bob", 1),
    ]
    only_bob = payload(ledger, {**params, "tenant_id": "bob"}, tenant="root", admin=True)
    assert [r["tenant_id"] for r in only_bob["data"][0]["results"]] == ["bob"]
    both = payload(ledger, {**params, "tenant_id": "bob,alice"}, tenant="root", admin=True)
    assert len(both["data"][0]["results"]) == 2
    m2 = payload(ledger, {**params, "models": "m2"}, tenant="root", admin=True)
    assert [(r["tenant_id"], r["input_tokens"]) for r in m2["data"][0]["results"]] == [("alice", 50)]


def test_hourly_buckets_and_pagination(ledger: Ledger) -> None:
    params = {"start_time": str(T0), "end_time": str(T0 + 2 * 3600 + 60), "bucket_width": "1h", "limit": "2"}
    first = payload(ledger, params)
    assert [(b["start_time"] - T0, len(b["results"])) for b in first["data"]] == [(0, 1), (3600, 1)]
    assert first["has_more"] is True
    second = payload(ledger, {**params, "page": first["next_page"]})
    assert [(b["start_time"] - T0, b["end_time"] - T0) for b in second["data"]] == [(7200, 7260)]
    assert (second["has_more"], second["next_page"]) == (False, None)


def test_defaults_end_now_and_seven_daily_buckets(ledger: Ledger) -> None:
    got = payload(ledger, {"start_time": str(T0)})
    assert len(got["data"]) == 4  # up to NOW = day 3 + 100 s, the last bucket cut at NOW
    assert got["data"][-1]["end_time"] == NOW
    many = payload(ledger, {"start_time": str(T0 - 30 * DAY)})
    assert (len(many["data"]), many["has_more"]) == (7, True)


def test_getlist_mappings_accept_repeated_list_params(ledger: Ledger) -> None:
    class MultiDict(dict):  # what Starlette's QueryParams offers
        def __init__(self, pairs: list[tuple[str, str]]) -> None:
            super().__init__(pairs)
            self.pairs = pairs

        def getlist(self, key: str) -> list[str]:
            return [v for k, v in self.pairs if k == key]

    params = MultiDict(
        [
            ("start_time", str(T0)),
            ("end_time", str(T0 + DAY)),
            ("group_by", "model"),
            ("group_by", "tenant_id"),
        ]
    )
    got = usage_payload(ledger, params, "root", True)
    assert {(r["tenant_id"], r["model"]) for r in got["data"][0]["results"]} == {
        ("alice", "m1"),
        ("alice", "m2"),
        ("bob", "m1"),
    }


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({}, "start_time"),
        ({"start_time": ""}, "start_time"),
        ({"start_time": "-5"}, "start_time"),
        ({"start_time": "1.5"}, "start_time"),
        ({"start_time": "1e9"}, "start_time"),
        ({"start_time": "abc"}, "start_time"),
        ({"start_time": " 17"}, "start_time"),
        ({"start_time": "99999999999999999999"}, "start_time"),
        ({"start_time": "100", "end_time": "99"}, "end_time"),
        ({"start_time": "100", "end_time": "100"}, "end_time"),
        ({"start_time": "100", "end_time": "x"}, "end_time"),
        ({"start_time": "100", "bucket_width": "1w"}, "bucket_width"),
        ({"start_time": "100", "bucket_width": ""}, "bucket_width"),
        ({"start_time": "100", "group_by": "project_id"}, "group_by"),
        ({"start_time": "100", "group_by": "model,"}, "group_by"),
        ({"start_time": "100", "limit": "0"}, "limit"),
        ({"start_time": "100", "limit": "32"}, "limit"),
        ({"start_time": "100", "bucket_width": "1m", "limit": "1441"}, "limit"),
        ({"start_time": "100", "limit": "2.5"}, "limit"),
        ({"start_time": "100", "page": "page_99"}, "page"),
        ({"start_time": "100", "page": "page_150"}, "page"),
        ({"start_time": "100", "page": "garbage"}, "page"),
        ({"start_time": "100", "models": ""}, "models"),
        ({"start_time": "100", "project_ids": "p"}, "project_ids"),
        ({"start_time": "100", "tenant_id": "alice"}, "tenant_id"),
    ],
)
def test_bad_parameters(ledger: Ledger, params: dict[str, str], param: str) -> None:
    with pytest.raises(UsageQueryError) as e:
        payload(ledger, params)
    assert e.value.param == param
    assert isinstance(e.value, ValueError)


def test_admin_empty_tenant_filter_is_an_error(ledger: Ledger) -> None:
    with pytest.raises(UsageQueryError) as e:
        payload(ledger, {"start_time": "100", "tenant_id": ""}, tenant="root", admin=True)
    assert e.value.param == "tenant_id"
