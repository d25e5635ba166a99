"""`GET /v1/usage`: query parameters in, an OpenAI organization-usage-shaped page out.

    GET /v1/usage?start_time=<unix s>&end_time=<unix s>&bucket_width=1d|1h|1m
                 &group_by=model,tenant_id&tenant_id=<admin only>&models=a,b&limit=N&page=<cursor>

Buckets are [start_time + k * width, ...), the last one cut at end_time (exclusive; default now).
Pass a start_time on a UTC day boundary to get calendar days. Empty buckets are listed with
`results: []`, as OpenAI does. Tenancy: the caller's own tenant only, unless `is_admin`; only an
admin may pass `tenant_id` (one id or a comma-separated list). List parameters accept
comma-separated values and repeats (when the mapping has `getlist`, like Starlette's).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from typing import Any

from prefixserve.ledger.ledger import Ledger
from prefixserve.ledger.records import BUCKET_WIDTHS, GROUP_BY_FIELDS, UsageQuery, UsageQueryError, UsageRow

DEFAULT_LIMIT = {"1m": 60, "1h": 24, "1d": 7}  # buckets per page, OpenAI's defaults
MAX_LIMIT = {"1m": 1440, "1h": 168, "1d": 31}
MAX_TIME = 253_402_300_799  # 9999-12-31T23:59:59Z
_LIST_PARAMS = ("group_by", "tenant_id", "models")
_SCALAR_PARAMS = ("start_time", "end_time", "bucket_width", "limit", "page")
_INT = re.compile(r"-?[0-9]+")
_PAGE = re.compile(r"page_([0-9]+)")


def usage_payload(
    ledger: Ledger,
    query_params: Mapping[str, str],
    caller_tenant_id: str,
    is_admin: bool,
    *,
    now: float | None = None,
) -> dict[str, Any]:
    """The usage page for `query_params`, scoped to what the caller may see.

    Raises UsageQueryError(message, param) on any bad parameter (map it to a 400). Reads the
    ledger's committed data after a flush, so the caller's finished requests are included;
    blocks for about one commit (call from a worker thread).
    """
    params = _normalise(query_params)
    start = _parse_time(params, "start_time", required=True)
    assert start is not None
    end_param = _parse_time(params, "end_time", required=False)
    if end_param is not None and end_param <= start:
        raise UsageQueryError("end_time must be after start_time", "end_time")
    end = end_param if end_param is not None else max(start, math.ceil(time.time() if now is None else now))

    width_name = _scalar(params, "bucket_width")
    width_name = "1d" if width_name is None else width_name
    if width_name not in BUCKET_WIDTHS:
        raise UsageQueryError(f"bucket_width must be one of {sorted(BUCKET_WIDTHS)}", "bucket_width")
    width = BUCKET_WIDTHS[width_name]
    limit = _parse_limit(_scalar(params, "limit"), width_name)

    group_by = tuple(dict.fromkeys(params.get("group_by", [])))
    for field in group_by:
        if field not in GROUP_BY_FIELDS:
            raise UsageQueryError(f"cannot group by {field!r}; allowed: {list(GROUP_BY_FIELDS)}", "group_by")

    if "tenant_id" in params and not is_admin:
        raise UsageQueryError("only the admin key may filter by tenant_id", "tenant_id")
    tenant_ids = tuple(params["tenant_id"]) if "tenant_id" in params else None
    if not is_admin:
        tenant_ids = (caller_tenant_id,)
    models = tuple(params["models"]) if "models" in params else None

    page_start = _parse_page(_scalar(params, "page"), start, end, width)
    num_buckets = min(limit, -(-(end - page_start) // width))
    page_end = min(page_start + num_buckets * width, end)

    rows = ledger.query(UsageQuery(page_start, page_end, width, group_by, tenant_ids, models, origin=start))
    by_bucket: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_bucket.setdefault(row.bucket_start, []).append(_result(row))
    data = []
    for k in range(num_buckets):
        bucket_start = page_start + k * width
        data.append(
            {
                "object": "bucket",
                "start_time": bucket_start,
                "end_time": min(bucket_start + width, end),
                "results": by_bucket.get(bucket_start, []),
            }
        )
    has_more = page_end < end
    return {
        "object": "page",
        "data": data,
        "has_more": has_more,
        "next_page": f"page_{page_end}" if has_more else None,
    }


def _result(row: UsageRow) -> dict[str, Any]:
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": row.input_tokens,
        "input_cached_tokens": row.cached_tokens,
        "output_tokens": row.output_tokens,
        "num_model_requests": row.num_requests,
        "model": row.model,
        "tenant_id": row.tenant_id,
        "cost_usd": row.cost_usd,
    }


def _normalise(query_params: Mapping[str, str]) -> dict[str, list[str]]:
    """name -> values. List parameters are split on commas; `name[]` is read as `name`."""
    out: dict[str, list[str]] = {}
    getlist = getattr(query_params, "getlist", None)
    for raw_name in query_params:
        name = raw_name.removesuffix("[]")
        if name not in _LIST_PARAMS and name not in _SCALAR_PARAMS:
            raise UsageQueryError(f"unknown parameter {raw_name!r}", raw_name)
        values = list(getlist(raw_name)) if callable(getlist) else [query_params[raw_name]]
        if name in _LIST_PARAMS:
            items = [item.strip() for value in values for item in str(value).split(",")]
            if not items or any(not item for item in items):
                raise UsageQueryError(f"{name} must be a non-empty comma-separated list", name)
            out.setdefault(name, []).extend(items)
        else:
            if len(values) != 1 or name in out:
                raise UsageQueryError(f"{name} given more than once", name)
            out[name] = [str(values[0])]
    return out


def _scalar(params: dict[str, list[str]], name: str) -> str | None:
    values = params.get(name)
    return values[0] if values else None


def _parse_time(params: dict[str, list[str]], name: str, *, required: bool) -> int | None:
    value = _scalar(params, name)
    if value is None:
        if required:
            raise UsageQueryError(f"{name} is required (unix seconds)", name)
        return None
    if not _INT.fullmatch(value):
        raise UsageQueryError(f"{name} must be an integer (unix seconds), not {value!r}", name)
    seconds = int(value)
    if not 0 <= seconds <= MAX_TIME:
        raise UsageQueryError(f"{name} must be in [0, {MAX_TIME}]", name)
    return seconds


def _parse_limit(value: str | None, width_name: str) -> int:
    if value is None:
        return DEFAULT_LIMIT[width_name]
    if not _INT.fullmatch(value) or not 1 <= int(value) <= MAX_LIMIT[width_name]:
        raise UsageQueryError(
            f"limit must be an integer in [1, {MAX_LIMIT[width_name]}] for bucket_width={width_name}", "limit"
        )
    return int(value)


def _parse_page(value: str | None, start: int, end: int, width: int) -> int:
    """The first bucket's start: start_time, or the one a previous page's next_page names."""
    if value is None:
        return start
    match = _PAGE.fullmatch(value)
    page_start = int(match.group(1)) if match else -1
    if not match or not start <= page_start < end or (page_start - start) % width:
        raise UsageQueryError("page is not a next_page cursor of this query", "page")
    return page_start
