"""Cross-tenant and cross-salt isolation, in `cached_tokens` and in timing: the audit of
"Auditing Prompt Caching in Language Model APIs" (Gu et al., 2025) run against our own server.

The owner (tenant `alice`) caches a prompt P. Then, in one random interleaving:
- probe i (i = 0 .. N-1): tenant `probe<i>` sends P exactly;
- fresh i: the same tenant `probe<i>` sends a never-seen prompt of exactly the same token length;
- every fifth request: the owner repeats P (its own cache must hit: cached_tokens == len(P)).
Each probe must report cached_tokens 0, and the probes' TTFT distribution must be
indistinguishable from the fresh prompts' (two-sample Kolmogorov-Smirnov, p > ALPHA), while the
owner's repeats are clearly faster (median < 0.5x the probes').

False alarms: with no leak the p-value is uniform, so each audit fails by chance with probability
ALPHA; two audits per `make test` run give 0.2%, one run in 500. A leak of the cache itself is
far beyond that: the owner's hits take 0.1x a fresh prompt's TTFT, which 200 + 200 samples put at
p < 1e-50 (the positive control below sees it with 40).

Why one tenant per probe: a tenant that sends P once holds P in its *own* namespace afterwards, so
its later probes would hit legitimately (its own data) and the audit would measure nothing. With
N distinct tenants (`probe000` ..; the server's keys file lists them) every probe is a first
contact of a different tenant with the owner's exact cached prompt, which is the attack. Each probe
tenant also sends one fresh prompt, so both samples come from the same set of tenants, each
tenant's namespace holding one other entry at most in either case, in random order.

Fairness of the measurement: prompts are token-id lists (exact, equal lengths, no tokenizer
variance); max_tokens=1, streaming, TTFT at the first chunk carrying output, all requests in
sequence over one keep-alive connection; a few unrecorded requests warm the path first.

The salt audit is the same with one key (`bob`): the owner's salt vs one fresh salt per probe.
`make test`: N = 200 per audit; `make soak`: N = 500.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from scipy.stats import ks_2samp

from tests.reliability.client import StreamResult, Target, stream, wait_idle
from tests.reliability.conftest import NUM_PROBES

pytestmark = pytest.mark.slow

PROMPT_LEN = 32
ALPHA = 0.001  # per audit; see the module docstring
OWNER_EVERY = 5  # an owner repeat after every 4 probe/fresh requests keeps P recently used


@dataclass(slots=True)
class Audit:
    """Who sends what: (headers, extra body fields) for the owner and for probe tenant i."""

    owner: tuple[dict[str, str], dict[str, Any]]
    prober: Any  # i -> (headers, extra body fields)
    ttft: dict[str, list[float]] = field(default_factory=lambda: {"probe": [], "fresh": [], "owner": []})
    cached: dict[str, list[int]] = field(default_factory=lambda: {"probe": [], "fresh": [], "owner": []})


def fresh_ids(rng: random.Random) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_LEN)]


def ask(
    client: httpx.Client, target: Target, ids: list[int], who: tuple[dict[str, str], dict[str, Any]]
) -> StreamResult:
    headers, extra = who
    r = stream(client, target.base_url + "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0, **extra},
               headers)  # fmt: skip
    assert r.ok and r.ttft_s is not None and r.usage is not None, r
    assert r.usage["prompt_tokens"] == PROMPT_LEN, r.usage
    return r


def run_audit(target: Target, audit: Audit, num_probes: int, seed: int) -> None:
    rng = random.Random(seed)
    secret = fresh_ids(rng)
    with httpx.Client(timeout=120) as client:
        for _ in range(5):  # warm the path (connection, allocator) with unrecorded fresh prompts
            ask(client, target, fresh_ids(rng), audit.owner)
        ask(client, target, secret, audit.owner)  # the owner caches P
        assert ask(client, target, secret, audit.owner).cached_tokens == PROMPT_LEN
        order = [("probe", i) for i in range(num_probes)] + [("fresh", i) for i in range(num_probes)]
        rng.shuffle(order)
        for n, (kind, i) in enumerate(order):
            if n % (OWNER_EVERY - 1) == 0:
                r = ask(client, target, secret, audit.owner)
                audit.ttft["owner"].append(r.ttft_s or 0.0)
                audit.cached["owner"].append(r.cached_tokens)
            r = ask(client, target, secret if kind == "probe" else fresh_ids(rng), audit.prober(i))
            audit.ttft[kind].append(r.ttft_s or 0.0)
            audit.cached[kind].append(r.cached_tokens)
    wait_idle(target)


def check_audit(audit: Audit, name: str, num_probes: int) -> None:
    probe, fresh, owner = audit.ttft["probe"], audit.ttft["fresh"], audit.ttft["owner"]
    ks = ks_2samp(probe, fresh)
    med = {k: statistics.median(v) for k, v in audit.ttft.items()}
    print(f"\n{name}: {num_probes} probes, {num_probes} fresh, {len(owner)} owner repeats; median TTFT probe "
          f"{med['probe'] * 1e3:.1f} ms, fresh {med['fresh'] * 1e3:.1f} ms, owner {med['owner'] * 1e3:.1f} ms "
          f"({med['owner'] / med['probe']:.2f}x); KS p = {ks.pvalue:.3f}; probe cached_tokens all "
          f"{sorted(set(audit.cached['probe']))}")  # fmt: skip
    assert len(probe) == len(fresh) == num_probes
    assert audit.cached["probe"] == [0] * num_probes, "a probe was served from another namespace's cache"
    assert audit.cached["fresh"] == [0] * num_probes
    assert audit.cached["owner"] == [PROMPT_LEN] * len(owner), "the owner's own repeats must hit"
    assert med["owner"] < 0.5 * med["probe"], med
    assert ks.pvalue > ALPHA, f"probe and fresh TTFT distributions differ (KS p = {ks.pvalue:.4f}): {med}"


def test_the_audit_sees_a_shared_cache_when_there_is_one(main: Target) -> None:
    """Positive control: probes from the owner's own namespace do share its cache, and the same
    measurement tells them apart from fresh prompts at once (so a pass above is not a blind test)."""
    same = (main.auth("alice"), {"cache_salt": "audit-control"})
    audit = Audit(owner=same, prober=lambda i: same)
    run_audit(main, audit, 40, time.time_ns())
    ks = ks_2samp(audit.ttft["probe"], audit.ttft["fresh"])
    assert audit.cached["probe"] == [PROMPT_LEN] * 40
    assert ks.pvalue < ALPHA, ks


def test_another_tenant_gets_no_hit_and_no_timing_signal(main: Target) -> None:
    audit = Audit(owner=(main.auth("alice"), {}), prober=lambda i: (main.auth(f"probe{i:03d}"), {}))
    run_audit(main, audit, NUM_PROBES, time.time_ns())
    check_audit(audit, "cross-tenant audit", NUM_PROBES)


def test_another_salt_of_the_same_key_gets_no_hit_and_no_timing_signal(main: Target) -> None:
    owner = (main.auth("bob"), {"cache_salt": "audit-owner"})
    audit = Audit(owner=owner, prober=lambda i: (main.auth("bob"), {"cache_salt": f"audit-probe-{i}"}))
    run_audit(main, audit, NUM_PROBES, time.time_ns())
    check_audit(audit, "cross-salt audit", NUM_PROBES)
