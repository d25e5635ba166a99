"""`DELETE /v1/cache`: who may forget which namespaces, from the caller's key and its parameters.

Parameters (JSON body and/or query string; a name given in both must agree):
  cache_salt  only that salt's namespace of the tenant (default: all of the tenant's namespaces)
  tenant      flush this tenant (a tenant id as `/v1/usage` reports it): admin only, except that a
              tenant key may name its own tenant (the same as leaving it out)
  all         admin only: true flushes every tenant
A tenant key flushes only its own tenant; naming another tenant, or `all`, with a non-admin key is a
403. The bare admin key must name `tenant` or set `all`. Every other field is a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prefixserve.engine.protocol import FlushReport
from prefixserve.server.errors import APIError, bad_request
from prefixserve.server.namespaces import check_salt
from prefixserve.server.operator.auth import Principal
from prefixserve.types import FlushScope

FIELDS = ("cache_salt", "tenant", "all")


def flush_scope(principal: Principal, raw_body: bytes, query: Mapping[str, str]) -> FlushScope:
    """The namespaces this caller asked to forget and may. Raises APIError (400/403)."""
    params = _merge(_body_params(raw_body), query)
    salt = check_salt(params["cache_salt"]) if "cache_salt" in params else None
    flush_all = _bool(params.get("all", False))
    tenant = params.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise bad_request("tenant must be a non-empty string", "tenant")
    others = tenant is not None and tenant != principal.tenant_id  # naming oneself is harmless
    if (others or flush_all) and not principal.is_admin:
        raise APIError(403, "only the admin key may flush another tenant or every tenant",
                       param="tenant" if others else "all", code="admin_only")
    if flush_all and tenant is not None:
        raise bad_request("give either tenant or all, not both", "all")
    if flush_all:
        if salt is not None:
            raise bad_request("cache_salt needs a tenant; all flushes every salt", "cache_salt")
        return FlushScope(None, None)
    tenant = tenant if tenant is not None else principal.tenant_id
    if tenant is None:
        raise bad_request("the admin key must name a tenant or set all=true", "tenant")
    return FlushScope(tenant, salt)


def flush_payload(scope: FlushScope, report: FlushReport) -> dict[str, Any]:
    """The answer to a flush; a 503 (retry: a flush is idempotent) when a tier did not answer, whose
    entries of the scope may remain there: a 200 would read as "forgotten everywhere"."""
    missed = [t.tier for t in report.tiers if not t.complete]
    if missed:
        done = ", ".join(f"{t.tier} {t.num_entries}" for t in report.tiers if t.complete)
        raise APIError(503, f"the {' and '.join(missed)} cache tier did not answer: entries of this scope may "
                            f"remain there; retry the flush (entries forgotten elsewhere: {done})",
                       code="flush_incomplete", headers={"Retry-After": "5"})
    return {
        "object": "cache.flush",
        "tenant": scope.tenant_id,  # None: every tenant
        "cache_salt": scope.cache_salt,  # None: every salt
        "deleted_entries": report.num_entries,
        "deleted_bytes": report.num_bytes,
        "tiers": {t.tier: {"deleted_entries": t.num_entries, "deleted_bytes": t.num_bytes} for t in report.tiers},
    }


def _body_params(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise bad_request("the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    return data


def _merge(body: dict[str, Any], query: Mapping[str, str]) -> dict[str, Any]:
    merged = dict(body)
    for name, value in query.items():
        if name in merged and merged[name] != _query_value(name, value):
            raise bad_request(f"{name} differs between the query string and the body", name)
        merged[name] = _query_value(name, value)
    for name in merged:
        if name not in FIELDS:
            raise bad_request(f"unknown parameter {name!r} (expected one of {', '.join(FIELDS)})", name)
    return merged


def _query_value(name: str, value: str) -> Any:
    if name == "all":
        if value.lower() in ("true", "1"):
            return True
        if value.lower() in ("false", "0"):
            return False
        raise bad_request("all must be true or false", "all")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad_request("all must be a boolean", "all")
    return value
