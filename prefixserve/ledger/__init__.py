"""Usage ledger: per-tenant token usage, priced with a cached-input discount, durable in SQLite.

    record ─▶ ledger.Ledger (batching writer thread) ─▶ store (SQLite, WAL) ─▶ api / cli (queries)

`records` is the plain data, `pricing` the price table, `store` the SQL, `ledger` the writer and
its durability contract, `api` the OpenAI-shaped `GET /v1/usage`, `cli` `prefixserve usage`.
"""

from __future__ import annotations

from prefixserve.ledger.ledger import Ledger, LedgerStats
from prefixserve.ledger.pricing import ModelPrice, Pricing, PricingError
from prefixserve.ledger.records import UsageQuery, UsageQueryError, UsageRecord, UsageRow

__all__ = [
    "Ledger",
    "LedgerStats",
    "ModelPrice",
    "Pricing",
    "PricingError",
    "UsageQuery",
    "UsageQueryError",
    "UsageRecord",
    "UsageRow",
]
