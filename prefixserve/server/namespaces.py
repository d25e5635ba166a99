"""A request's cache namespace: the served model, the tenant its API key names (never its body), and
the `cache_salt` its body may add (docs/cache.md, "Keys and namespaces").

One set of rules for the requests that fill the cache (server/openai/) and the flushes that empty it
(server/operator/cache_flush.py).
"""

from __future__ import annotations

from typing import Any

from prefixserve.server.errors import bad_request
from prefixserve.types import Namespace

MAX_SALT_CHARS = 256


def check_salt(value: Any) -> str:
    """cache_salt -> the namespace's salt ('' when absent). Only the caller's own tenant is salted."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise bad_request("cache_salt must be a string", "cache_salt")
    if not value:
        raise bad_request("cache_salt must not be empty (omit it instead)", "cache_salt")
    if len(value) > MAX_SALT_CHARS:
        raise bad_request(f"cache_salt must be at most {MAX_SALT_CHARS} characters", "cache_salt")
    try:  # encodable (no lone surrogates), as every string that reaches the tokenizer (openai/params.py)
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("cache_salt contains invalid unicode", "cache_salt") from None
    return value


def namespace(model_id: str, tenant_id: str, salt: str) -> Namespace:
    """The only place a Namespace is built: tenant from the key, never from the body."""
    return Namespace(model_id=model_id, tenant_id=tenant_id, cache_salt=salt)
