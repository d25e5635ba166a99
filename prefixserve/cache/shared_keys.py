"""Key names and value authentication of the shared tier (cache/shared.py). Pure functions.

Keys carry no tenant id, salt or bare token hash, only the keyed digests of cache/tier.py (TierKeys,
under the deployment secret: without it a key name confirms no guessed tenant, salt or prompt):
    <prefix>:<space>:<tenant digest>:<salt digest>:<model digest>:<token digest>   the value
    <prefix>:<space>:<tenant digest>:<salt digest>:<model digest>:len              ZSET of entry lengths
    <prefix>:<space>:<tenant digest>:<salt digest>:<model digest>:p:<token digest>  marker: the key of
                                              an entry extending that prefix (every 64 tokens of an entry)
<space> (`key_space`) is keyed by the secret and names the model fingerprint and runtime: replicas
that could not use each other's values (another secret, during a rotation or by a typo; another
dtype, kernel or CPU class in a mixed fleet) never read them, so they never delete or overwrite each
other's entries. A flush reaches every space: a tenant's data goes whoever wrote it.
A value is the disk tier's file (same header: fingerprint, runtime, digests, token ids; same
checksum) followed by HMAC-SHA256(secret, key name + file). It is used only if the MAC, the
checksum, the fingerprint, the runtime, the digests and the token ids all match; otherwise (tampered
or corrupt, in this space) it is deleted and counted.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from prefixserve.cache.tier import TierKeys
from prefixserve.types import FlushScope, Namespace

MAC_BYTES = 32  # HMAC-SHA256, appended to every value
MARK_TOKENS = 64  # a marker every this many tokens of an entry names it, so a prompt sharing part of it finds it


def key_space(prefix: str, secret: bytes, fingerprint: str, runtime: str) -> str:
    """`<prefix>:<space>`: the keys of replicas that share this secret, fingerprint and runtime."""
    space = hmac.new(secret, f"key space\0{fingerprint}\0{runtime}".encode(), hashlib.sha256).hexdigest()[:16]
    return f"{prefix}:{space}"


def ns_prefix(space: str, keys: TierKeys, ns: Namespace) -> str:
    dns = keys.namespace(ns)
    return f"{space}:{dns.tenant_id}:{dns.cache_salt}:{dns.model_id}"


def scope_pattern(prefix: str, keys: TierKeys, scope: FlushScope) -> str:
    """The SCAN pattern of every key a flush of `scope` removes, in every key space."""
    if scope.tenant_id is None and scope.cache_salt is None:
        return f"{prefix}:*"
    tenant = "*" if scope.tenant_id is None else keys.digest("tenant", scope.tenant_id)
    if scope.cache_salt is None:
        return f"{prefix}:*:{tenant}:*"
    return f"{prefix}:*:{tenant}:{keys.digest('salt', scope.cache_salt)}:*"


def marker_keys(space: str, keys: TierKeys, ns: Namespace, token_ids: Sequence[int]) -> list[str]:
    """The markers an entry of `token_ids` writes: one every MARK_TOKENS tokens of it."""
    base = ns_prefix(space, keys, ns)
    return [f"{base}:p:{keys.tokens(token_ids[:k])}" for k in range(MARK_TOKENS, len(token_ids) + 1, MARK_TOKENS)]


def mac(secret: bytes, key: str, body: bytes | memoryview) -> bytes:
    """HMAC-SHA256 over the key name and the value's file bytes (a value cannot move to another key)."""
    h = hmac.new(secret, key.encode() + b"\0", hashlib.sha256)
    h.update(body)
    return h.digest()


def add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]
