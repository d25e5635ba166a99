"""Record -> query: exact sums, buckets, grouping, costs fixed at write time, restarts, replays."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve.ledger import Ledger, Pricing, UsageQuery, UsageRecord, UsageRow
from prefixserve.types import FinishReason

DAY = 86_400
T0 = 1_730_419_200  # 2024-11-01T00:00:00Z
PRICING = Pricing.from_specs(["m1=2,0.5,8", "m2=4,1,16"])


def rec(
    i: int,
    tenant: str = "t1",
    model: str = "m1",
    created: float = T0,
    p: int = 100,
    c: int = 40,
    o: int = 10,
    reason: str = "stop",
) -> UsageRecord:
    return UsageRecord(f"req-{i}", tenant, model, p, c, o, reason, created)


@pytest.fixture()
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(str(tmp_path / "sub" / "usage.sqlite3"), PRICING)
    yield led
    led.close()


def test_record_then_query_sums_exactly(ledger: Ledger) -> None:
    records = [rec(i, tenant=f"t{i % 2}", created=T0 + i, p=100 + i, c=i, o=2 * i) for i in range(50)]
    for r in records:
        ledger.record(r)
    rows = ledger.query(UsageQuery(T0, T0 + DAY, DAY, group_by=("tenant_id",)))
    assert [r.tenant_id for r in rows] == ["t0", "t1"]
    for row in rows:
        mine = [r for r in records if r.tenant_id == row.tenant_id]
        assert row == UsageRow(
            T0,
            None,
            row.tenant_id,
            len(mine),
            sum(r.prompt_tokens for r in mine),
            sum(r.cached_tokens for r in mine),
            sum(r.completion_tokens for r in mine),
            math.fsum(
                PRICING.cost(r.model, r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in mine
            ),
        )
    assert ledger.check_integrity() == 50
    assert ledger.stats().num_written == 50


def test_daily_and_hourly_buckets_with_model_grouping(ledger: Ledger) -> None:
    ledger.record(rec(1, model="m1", created=T0 + 10))
    ledger.record(rec(2, model="m2", created=T0 + 3600 - 0.001))  # last instant of hour 0
    ledger.record(rec(3, model="m1", created=T0 + 3600))  # first instant of hour 1
    ledger.record(rec(4, model="m1", created=T0 + DAY + 7200.5))
    ledger.record(rec(5, model="m1", created=T0 + 2 * DAY))  # == end_time: excluded
    ledger.record(rec(6, model="m1", created=T0 - 1))  # before start: excluded

    daily = ledger.query(UsageQuery(T0, T0 + 2 * DAY, DAY))
    assert [(r.bucket_start, r.num_requests) for r in daily] == [(T0, 3), (T0 + DAY, 1)]

    hourly = ledger.query(UsageQuery(T0, T0 + 2 * DAY, 3600, group_by=("model",)))
    assert [(r.bucket_start - T0, r.model, r.num_requests) for r in hourly] == [
        (0, "m1", 1),
        (0, "m2", 1),
        (3600, "m1", 1),
        (DAY + 7200, "m1", 1),
    ]
    assert hourly[1].cost_usd == (60 * 4 + 40 * 1 + 10 * 16) / 1e6

    # buckets count from origin, not from start_time: origin=0 gives UTC-aligned days
    shifted = ledger.query(UsageQuery(T0 + 1800, T0 + DAY, DAY, origin=0))
    assert [(r.bucket_start, r.num_requests) for r in shifted] == [(T0, 2)]


def test_filters_by_tenant_and_model(ledger: Ledger) -> None:
    ledger.record(rec(1, tenant="a", model="m1"))
    ledger.record(rec(2, tenant="b", model="m1"))
    ledger.record(rec(3, tenant="b", model="m2"))
    q = UsageQuery(T0, T0 + DAY, DAY, tenant_ids=("b",), models=("m2",))
    assert [r.num_requests for r in ledger.query(q)] == [1]
    assert ledger.query(UsageQuery(T0, T0 + DAY, DAY, tenant_ids=())) == []
    assert ledger.query(UsageQuery(T0, T0 + DAY, DAY, tenant_ids=("a", "b")))[0].num_requests == 3


def test_cost_is_fixed_at_write_time(tmp_path: Path) -> None:
    path = str(tmp_path / "usage.sqlite3")
    with Ledger(path, Pricing.from_specs(["m1=2,1,8"])) as led:
        led.record(rec(1))  # 60 * 2 + 40 * 1 + 10 * 8 = 240
    with Ledger(path, Pricing.from_specs(["m1=20,10,80"])) as led:
        led.record(rec(2))  # the price rose: 2400
        rows = led.query(UsageQuery(T0, T0 + DAY, DAY))
        assert rows[0].cost_usd == math.fsum([240 / 1e6, 2400 / 1e6])
        assert led.check_integrity() == 2


def test_a_new_ledger_file_is_the_operators_only(tmp_path: Path) -> None:
    """QA: usage.sqlite3 was created 0644 (the stored responses' file, 0600): tenants' usage, readable
    by every local user. New files are 0600, and so are SQLite's -wal and -shm beside them (when there)."""
    path = tmp_path / "usage.sqlite3"
    with Ledger(str(path), PRICING) as led:
        led.record(rec(1))
        led.query(UsageQuery(T0, T0 + DAY, DAY))
        files = [p for p in tmp_path.iterdir() if p.name.startswith("usage.sqlite3")]
        assert path in files and all(p.stat().st_mode & 0o777 == 0o600 for p in files), files


def test_restart_keeps_records_and_replays_do_not_double_count(tmp_path: Path) -> None:
    path = str(tmp_path / "usage.sqlite3")
    first = [rec(i, created=T0 + i) for i in range(20)]
    with Ledger(path, PRICING) as led:
        for r in first:
            led.record(r)
    with Ledger(path, PRICING) as led:
        before = led.query(UsageQuery(T0, T0 + DAY, DAY))
        assert before[0].num_requests == 20
        for r in first[5:]:  # a replay after a restart, and a same-id record with other counts
            led.record(r)
        led.record(rec(3, p=999, c=0, o=999, created=T0 + 3))
        led.record(rec(20, created=T0 + 20))
        led.record(rec(20, created=T0 + 20))
        after = led.query(UsageQuery(T0, T0 + DAY, DAY))
        assert after[0].num_requests == 21
        assert after[0].input_tokens == before[0].input_tokens + 100
        stats = led.stats()
        assert (stats.num_written, stats.num_duplicates) == (1, 17)
        assert led.check_integrity() == 21


def test_finish_reasons_enum_or_str_and_aborts_are_recorded(ledger: Ledger) -> None:
    ledger.record(UsageRecord("a", "t", "m1", 10, 0, 0, FinishReason.ABORT, T0))
    ledger.record(UsageRecord("b", "t", "m1", 10, 10, 3, "length", T0))
    ledger.flush()
    import sqlite3

    conn = sqlite3.connect(ledger.path)
    assert conn.execute("SELECT finish_reason FROM usage_records ORDER BY request_id").fetchall() == [
        ("abort",),
        ("length",),
    ]
    conn.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"request_id": ""},
        {"prompt_tokens": -1},
        {"cached_tokens": 101},
        {"completion_tokens": 1.5},
        {"prompt_tokens": True},
        {"finish_reason": ""},
        {"created": float("nan")},
        {"created": "yesterday"},
        {"tenant_id": None},
    ],
)
def test_broken_records_fail_where_they_are_made(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {
        "request_id": "r",
        "tenant_id": "t",
        "model": "m",
        "prompt_tokens": 100,
        "cached_tokens": 40,
        "completion_tokens": 1,
        "finish_reason": "stop",
        "created": T0,
    }
    fields.update(kwargs)
    with pytest.raises((TypeError, ValueError)):
        UsageRecord(**fields)  # type: ignore[arg-type]


def test_record_after_close_and_of_junk_never_raises(ledger: Ledger) -> None:
    ledger.record("not a record")  # type: ignore[arg-type]
    ledger.close()
    ledger.record(rec(1))
    ledger.close()  # idempotent
    ledger.flush()  # nothing left to flush
    assert ledger.stats().num_dropped == 1
    assert ledger.query(UsageQuery(T0, T0 + DAY, DAY)) == []


def test_cost_sum_is_independent_of_row_order(tmp_path: Path) -> None:
    pricing = Pricing.from_specs(["m1=0.15,0.075,0.6"])
    records = [rec(i, p=1 + 37 * i, c=i, o=3 * i % 17) for i in range(300)]
    sums = []
    for seed in (1, 2):
        random.Random(seed).shuffle(records)
        with Ledger(str(tmp_path / f"{seed}.sqlite3"), pricing) as led:
            for r in records:
                led.record(r)
            sums.append(led.query(UsageQuery(T0, T0 + DAY, DAY))[0].cost_usd)
    assert (
        sums[0]
        == sums[1]
        == math.fsum(
            pricing.cost("m1", r.prompt_tokens, r.cached_tokens, r.completion_tokens) for r in records
        )
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    offsets=st.lists(st.floats(min_value=0, max_value=3 * DAY, exclude_max=True), min_size=1, max_size=40),
    width=st.sampled_from([60, 3600, DAY]),
)
def test_buckets_partition_the_records(
    tmp_path_factory: pytest.TempPathFactory, offsets: list[float], width: int
) -> None:
    path = str(tmp_path_factory.mktemp("prop") / "usage.sqlite3")
    with Ledger(path, PRICING) as led:
        for i, offset in enumerate(offsets):
            led.record(rec(i, created=T0 + offset, p=i + 1, c=i // 2, o=i))
        rows = led.query(UsageQuery(T0, T0 + 3 * DAY, width))
    expected: dict[int, int] = {}
    for offset in offsets:
        created = T0 + offset  # the float the ledger stores (T0 + 8099.99999999994 is T0 + 8100.0)
        if created >= T0 + 3 * DAY:
            continue  # rounded up onto the exclusive end
        start = T0 + int((created - T0) // width) * width
        expected[start] = expected.get(start, 0) + 1
    assert {r.bucket_start: r.num_requests for r in rows} == expected
    assert sum(r.num_requests for r in rows) == sum(expected.values())


def test_record_costs_the_caller_little(ledger: Ledger) -> None:
    records = [rec(i, created=T0 + i % DAY) for i in range(10_000)]
    t0 = time.perf_counter()
    for r in records:
        ledger.record(r)
    t1 = time.perf_counter()
    ledger.flush(timeout=30)
    t2 = time.perf_counter()
    print(f"\nrecord(): {(t1 - t0) / len(records) * 1e6:.1f} us each; flush of 10k: {(t2 - t1) * 1e3:.0f} ms")
    assert ledger.query(UsageQuery(T0, T0 + DAY, DAY))[0].num_requests == 10_000


def test_many_threads_record_while_others_query(ledger: Ledger) -> None:
    import threading

    def writer(t: int) -> None:
        for i in range(500):
            ledger.record(rec(t * 1000 + i, tenant=f"t{t}", created=T0 + i, p=3, c=1, o=2))

    def reader() -> None:
        for _ in range(5):
            for row in ledger.query(UsageQuery(T0, T0 + DAY, DAY, group_by=("tenant_id",))):
                assert (row.input_tokens, row.cached_tokens, row.output_tokens) == (
                    3 * row.num_requests,
                    row.num_requests,
                    2 * row.num_requests,
                )

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(6)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rows = ledger.query(UsageQuery(T0, T0 + DAY, DAY, group_by=("tenant_id",)))
    assert [(r.tenant_id, r.num_requests) for r in rows] == [(f"t{t}", 500) for t in range(6)]
    assert ledger.check_integrity() == 3000


def test_last_float_before_a_boundary_stays_in_its_bucket(ledger: Ledger) -> None:
    for i, width in enumerate((60, 3600, DAY)):
        ledger.record(rec(i, model=f"w{width}", created=math.nextafter(float(T0 + 5 * width), 0)))
    for width in (60, 3600, DAY):
        rows = ledger.query(UsageQuery(T0, T0 + 5 * width, width, models=(f"w{width}",)))
        assert [(r.bucket_start, r.num_requests) for r in rows] == [(T0 + 4 * width, 1)]
