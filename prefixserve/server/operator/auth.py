"""API keys -> tenants.

Every configured key is its own tenant. A key spec is either ``KEY`` (tenant id = ``key-`` + the first
12 hex digits of the key's sha256, so the id never is the key) or ``TENANT KEY`` (a named tenant; two
keys may share a name, e.g. during rotation). Keys are held only as sha256 digests and every presented
key is compared against all of them with `hmac.compare_digest`, without an early exit.

With no keys the server is open: every caller is the tenant ``OPEN_TENANT_ID`` ("(open)"), an id
no key spec can produce (names allow no parentheses; an unnamed key's id is ``key-<hex>``), so a
tenant a key file names ``default`` (the open tenant's id before) or anything else never shares the
open server's cache namespaces, ledger rows or stored responses. The admin key (the
usage API across tenants, flushing any tenant's cache, /metrics on a server with keys) is recognised
separately; it is a tenant for generation only if it is also listed.

A running server takes new keys with `KeyStore.replace` (SIGHUP re-reads --api-keys-file,
server/app.py): a tenant keeps its name, and so its cache namespaces, ledger rows and stored
responses, across a rotation of its key; a request already authenticated keeps its tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from prefixserve.server.errors import APIError
from prefixserve.types import OPEN_TENANT_ID

logger = logging.getLogger("prefixserve.server")

_TENANT_RE = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling. tenant_id is None for a caller that is only the admin."""

    tenant_id: str | None
    is_admin: bool = False


@dataclass(frozen=True, slots=True)
class _KeyEntry:
    digest: bytes
    tenant_id: str


class KeyStore:
    """Hashed API keys; safe to share between requests. `replace` swaps all of them at once (one
    attribute): each call reads one generation of keys, never a mix."""

    def __init__(self, entries: Iterable[tuple[str, str]] = (), admin_key: str | None = None) -> None:
        """entries: (tenant_id, key) pairs. Raises ValueError on an empty or duplicated key. An admin key
        that is also a tenant's makes that key both (`admin_tenant`)."""
        seen: set[bytes] = set()
        keys: list[_KeyEntry] = []
        for tenant_id, key in entries:
            if not key:
                raise ValueError("an API key must not be empty")
            digest = _digest(key)
            if digest in seen:
                raise ValueError(f"an API key is listed twice (the second time for tenant {tenant_id!r})")
            seen.add(digest)
            keys.append(_KeyEntry(digest, tenant_id))
        if any(_digest(k.tenant_id) in seen for k in keys):
            raise ValueError("a tenant name must not be an API key (tenant ids are logged and stored)")
        if admin_key is not None and not admin_key:
            raise ValueError("the admin key must not be empty")
        self._state = (tuple(keys), _digest(admin_key) if admin_key else None)

    def replace(self, other: KeyStore) -> None:
        """From now on, `other`'s keys and admin key."""
        self._state = other._state

    def changes(self, other: KeyStore) -> str:
        """What `other` changes, for the log: tenants added, removed, and given other keys (no key)."""
        def by_tenant(store: KeyStore) -> dict[str, set[bytes]]:
            out: dict[str, set[bytes]] = {}
            for k in store._state[0]:
                out.setdefault(k.tenant_id, set()).add(k.digest)
            return out

        old, new = by_tenant(self), by_tenant(other)
        parts = [f"{what}: {', '.join(sorted(names))}" for what, names in (
            ("added", new.keys() - old.keys()), ("removed", old.keys() - new.keys()),
            ("new keys for", {t for t in old.keys() & new.keys() if old[t] != new[t]})) if names]
        if self._state[1] != other._state[1]:
            parts.append("admin key changed")
        return "; ".join(parts) or "no change"

    @classmethod
    def from_specs(cls, specs: Iterable[str], admin_key: str | None = None) -> KeyStore:
        return cls((parse_key_spec(s) for s in specs), admin_key)

    @property
    def is_open(self) -> bool:
        """No keys configured: anyone may generate, as the single open tenant."""
        return not self._state[0]

    @property
    def num_tenants(self) -> int:
        return len({k.tenant_id for k in self._state[0]}) or 1

    @property
    def has_admin(self) -> bool:
        return self._state[1] is not None

    @property
    def admin_tenant(self) -> str | None:
        """The tenant whose key is also the admin key (it generates as that tenant and holds the
        admin's rights over every other), else None: worth a warning, as a mistake would be."""
        keys, admin = self._state
        return next((k.tenant_id for k in keys if k.digest == admin), None)

    def warn_admin_tenant(self, why: str = "") -> None:
        if (tenant := self.admin_tenant) is not None:
            logger.warning("%sthe admin key is also tenant %s's API key: that key flushes every tenant's cache and "
                           "reads every tenant's usage", f"{why}: " if why else "", tenant)

    def identify(self, authorization: str | None) -> Principal:
        """Map an Authorization header to a Principal. Raises APIError(401) when keys are configured and
        the header carries none of them (nor the admin key). In open mode every caller is the open
        tenant, and is also admin if it presents the admin key."""
        key = bearer_token(authorization)
        keys, admin_digest = self._state
        tenant_id: str | None = None
        is_admin = False
        if key is not None:
            digest = _digest(key)
            for entry in keys:  # all of them, always: no timing hint about which key matched
                if hmac.compare_digest(entry.digest, digest):
                    tenant_id = entry.tenant_id
            if admin_digest is not None:
                is_admin = hmac.compare_digest(admin_digest, digest)
        if not keys:
            return Principal(OPEN_TENANT_ID, is_admin)
        if tenant_id is None and not is_admin:
            raise unauthorized(key is None)
        return Principal(tenant_id, is_admin)

    def tenant_for_generation(self, authorization: str | None) -> str:
        """The tenant a generation request runs as; 401 without a valid key, 403 for the bare admin key."""
        principal = self.identify(authorization)
        if principal.tenant_id is None:
            raise APIError(
                403, "the admin key is not a tenant: it reads the usage API and /metrics and flushes caches; generate with a tenant key", code="admin_key_not_a_tenant"
            )
        return principal.tenant_id


_INLINE_COMMENT = re.compile(r"\s#(?:\s|$)")


def reload_keys(keys: KeyStore, source: Callable[[], KeyStore] | None, why: str = "SIGHUP") -> None:
    """SIGHUP's handler: `keys` become what `source` reads (the key flags and --api-keys-file read
    again). A source that fails (a missing file, a bad line, no key left) changes nothing, and says why.
    `why` "start": the read once the model has loaded (a change made, or a SIGHUP sent, while it
    loaded applies; logged only when something changed)."""
    if source is None:
        logger.warning("%s: no --api-keys-file to read again; the API keys are unchanged", why)
        return
    try:
        new = source()
    except (OSError, ValueError) as e:
        logger.error("%s: the API keys are unchanged: %s", why, e)
        return
    changes = keys.changes(new)
    keys.replace(new)
    if why != "start" or changes != "no change":
        logger.info("%s: API keys read again: %d tenant(s); %s", why, new.num_tenants, changes)
        new.warn_admin_tenant(why)


def parse_key_spec(spec: str) -> tuple[str, str]:
    """'KEY' -> (key-<sha256[:12]>, KEY); 'TENANT KEY' -> (TENANT, KEY). Raises ValueError."""
    if any(ord(c) < 32 or ord(c) == 127 for c in spec.replace("\t", " ")):
        raise ValueError("an API key spec must not hold control characters")
    parts = spec.split()
    if len(parts) == 1:
        return key_tenant_id(parts[0]), parts[0]
    if len(parts) == 2:
        tenant_id, key = parts
        if not _TENANT_RE.match(tenant_id):
            raise ValueError(f"invalid tenant name {tenant_id!r} (use 1-64 of A-Z a-z 0-9 _ . : @ -)")
        return tenant_id, key
    raise ValueError("an API key spec is 'KEY' or 'TENANT KEY'")


def read_keys_file(path: str | Path) -> list[str]:
    """Key specs from a file: one per line, blank lines skipped. A comment is a line starting with
    '#', or ' # ...' after a spec ('#' after whitespace and before whitespace or the end): a '#' inside
    a key (`pass#word`, `#abc`) is part of it. A file with no key is an error: it must not leave the
    server open by accident (an emptied or commented-out secrets file). A UTF-8 byte-order mark
    (Windows editors write one) is not part of the first key; a key listed twice is an error naming
    both lines."""
    specs: list[str] = []
    seen: dict[str, int] = {}
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#"):
            continue
        line = _INLINE_COMMENT.split(line, 1)[0].strip()
        if not line:
            continue
        try:
            key = parse_key_spec(line)[1]
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
        if key in seen:
            raise ValueError(f"{path}:{lineno}: the key of line {seen[key]} again (each key is one tenant's)")
        seen[key] = lineno
        specs.append(line)
    if not specs:
        raise ValueError(f"{path}: no API keys in the file (an emptied secrets file must not open the server)")
    return specs


def key_tenant_id(key: str) -> str:
    """The tenant id of an unnamed key: derived from, but never revealing, the key."""
    return "key-" + hashlib.sha256(key.encode("utf-8")).hexdigest()[:12]


def bearer_token(authorization: str | None) -> str | None:
    """'Bearer KEY' -> KEY (scheme case-insensitive); anything else -> None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def unauthorized(missing: bool) -> APIError:
    message = (
        "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
        if missing
        else "Incorrect API key provided."
    )
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()
