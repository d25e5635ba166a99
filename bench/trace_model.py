"""A Mooncake-format request trace turned into token ids, tenants and arrival times (pure, no I/O).

The trace (kvcache-ai/Mooncake, `FAST25-release/traces/*.jsonl`) has one JSON object per request:
`timestamp` (ms since the trace's start), `input_length`, `output_length` and `hash_ids`, one id per
512-token block of the prompt, the last block possibly partial. Ids are chained: two requests share
block i's id only if they share blocks 0..i, so an id stands for its whole prefix.

Contracts of the construction (`Scale`, `prompt_ids`):

- Each 512-token block becomes `block_tokens` tokens (a partial last block of r tokens becomes
  max(1, round(r * block_tokens / 512))). A block's tokens are a pure function of its id (and the
  seed): equal ids give equal tokens, so requests with equal leading ids have equal token prefixes
  and the first differing id starts differing tokens (random ids from a 49k vocabulary: two blocks'
  first tokens agree with probability ~2e-5).
- A prompt is capped at `max_prompt_tokens` (its leading blocks kept, the last one cut), so prompt
  plus `max_output` fits the model's context; output lengths are scaled as prompts are, then
  capped at `max_output` (a reply the next turn does not reuse costs cache bytes in proportion).
- Tenants: `tenant_of` maps a request to one of K tenants by the id of its block `tenant_block`
  (or its last block, when it has fewer), mod K. Requests sharing that block share a tenant, so a
  conversation stays inside one tenant. Block 0 of every request of the conversation trace is the
  same id (a shared system prompt), so keying on it would put every request in one tenant; the
  default keys on block 1.
- Sampling: `sample_conversations` keeps the requests whose block `tenant_block` id hashes to a
  given part mod K: about 1/K of the conversations, each with all of its turns, over the trace's
  whole span. Reuse distances (in requests and in bytes) and the working set shrink by about K
  together, so a hit rate at a budget given as a fraction of the working set estimates the whole
  trace's (one part's figure varies with which conversations it drew); a prefix of the trace (the
  first N requests, `--limit`) does not: most of its reuse lies later.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
VOCAB_LOW, VOCAB_HIGH = 256, 49_000  # token ids drawn from here: no control tokens of SmolLM2's vocabulary
# SmolLM2-135M: 30 layers x (K and V) x 3 KV heads x head_dim 64 x 2 bytes (bf16)
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # 23,040
SMOLLM2_LOGITS_BYTES = 49_152 * 4  # the fp32 logits an entry with logits keeps (vocabulary 49,152)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One line of the trace, as given (unscaled)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Scale:
    """How trace lengths map onto the model: tokens per 512-token block, and the caps."""

    block_tokens: int = 16
    max_prompt_tokens: int = 8_192 - 64
    max_output: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.block_tokens <= TRACE_BLOCK_TOKENS:
            raise ValueError(f"block_tokens must be in [1, {TRACE_BLOCK_TOKENS}]")
        if self.max_prompt_tokens < 1 or self.max_output < 1:
            raise ValueError("max_prompt_tokens and max_output must be >= 1")

    def describe(self) -> str:
        return (
            f"1 trace block (512 tokens) -> {self.block_tokens} tokens (x{self.block_tokens / 512:g}), "
            f"prompts capped at {self.max_prompt_tokens} tokens, outputs at {self.max_output}"
        )


def parse_trace(lines: Iterable[str], limit: int | None = None) -> list[TraceRequest]:
    """The requests of a JSONL trace, in file order (blank lines skipped); at most `limit` of them.
    Raises ValueError on a line that is not a trace object."""
    out: list[TraceRequest] = []
    for lineno, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            req = TraceRequest(
                float(obj["timestamp"]),
                int(obj["input_length"]),
                int(obj["output_length"]),
                tuple(int(h) for h in obj["hash_ids"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"trace line {lineno}: {exc}") from exc
        if not req.hash_ids or req.input_length < 1:
            raise ValueError(f"trace line {lineno}: a request needs input_length >= 1 and hash ids")
        out.append(req)
    return out


def sample_conversations(
    requests: Iterable[TraceRequest], sample: int, sample_block: int = 1, part: int = 0
) -> list[TraceRequest]:
    """The requests whose conversation is in part `part` of `sample` (module docstring), in order:
    parts 0..sample-1 partition the trace. `sample` 1 keeps every request. Pure: the same trace and
    arguments always keep the same requests."""
    if sample < 1 or not 0 <= part < sample:
        raise ValueError("sample must be >= 1 and part in [0, sample)")
    return [r for r in requests if _mix(r.hash_ids[min(sample_block, len(r.hash_ids) - 1)]) % sample == part]


def multi_turn_requests(
    requests: Sequence[TraceRequest], n: int, conversation_block: int = 1
) -> list[TraceRequest]:
    """The first `n` requests, in order, of the conversations (requests sharing the id of block
    `conversation_block`, as in `sample_conversations`) that have at least two requests in `requests`:
    a sample whose later turns can be served from the cache its earlier turns filled."""
    def key(r: TraceRequest) -> int:
        return r.hash_ids[min(conversation_block, len(r.hash_ids) - 1)]

    turns = Counter(key(r) for r in requests)
    return [r for r in requests if turns[key(r)] >= 2][:n]


def block_lengths(req: TraceRequest, scale: Scale) -> list[int]:
    """Scaled token count of each of the request's blocks, after the cap (trailing blocks that do
    not fit are dropped, the last kept one cut). Every length is >= 1; the sum is <= the cap."""
    num_blocks = len(req.hash_ids)
    last = req.input_length - TRACE_BLOCK_TOKENS * (num_blocks - 1)  # tokens of the last block
    if not 0 < last <= TRACE_BLOCK_TOKENS:  # a line whose length disagrees with its blocks: trust the blocks
        last = TRACE_BLOCK_TOKENS
    lengths = [scale.block_tokens] * (num_blocks - 1)
    lengths.append(max(1, round(last * scale.block_tokens / TRACE_BLOCK_TOKENS)))
    out: list[int] = []
    room = scale.max_prompt_tokens
    for n in lengths:
        if room <= 0:
            break
        out.append(min(n, room))
        room -= out[-1]
    return out


def block_token_ids(hash_id: int, scale: Scale) -> tuple[int, ...]:
    """The `block_tokens` token ids of block `hash_id` (a partial block is a prefix of these)."""
    rng = random.Random(hash_id * 1_000_003 + scale.seed)
    return tuple(rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(scale.block_tokens))


def prompt_ids(req: TraceRequest, scale: Scale) -> list[int]:
    """The request's prompt as token ids (module docstring: equal ids -> equal tokens, scaled, capped)."""
    out: list[int] = []
    for hash_id, n in zip(req.hash_ids, block_lengths(req, scale), strict=False):
        out.extend(block_token_ids(hash_id, scale)[:n])
    return out


def output_tokens(req: TraceRequest, scale: Scale) -> int:
    """max_tokens for the request: its output length scaled as prompts are (x block_tokens / 512,
    rounded), capped at `scale.max_output`, at least 1."""
    return max(1, min(round(req.output_length * scale.block_tokens / TRACE_BLOCK_TOKENS), scale.max_output))


def tenant_of(req: TraceRequest, num_tenants: int, tenant_block: int = 1) -> int:
    """Tenant index in [0, num_tenants): the id of block `tenant_block` (the last block if the request
    has fewer) mod num_tenants."""
    if num_tenants < 1:
        raise ValueError("num_tenants must be >= 1")
    return req.hash_ids[min(tenant_block, len(req.hash_ids) - 1)] % num_tenants


def tenant_key(tenant: int) -> tuple[str, str]:
    """(tenant name, API key) of tenant index `tenant`, as `--api-keys-file` lines name them."""
    return f"trace-t{tenant}", f"sk-trace-tenant-{tenant}-0123456789abcdef"


def api_keys_file_text(num_tenants: int) -> str:
    """An `--api-keys-file` for `num_tenants` tenants ('TENANT KEY' per line)."""
    return "".join(f"{name} {key}\n" for name, key in map(tenant_key, range(num_tenants)))


def scaled_blocks(req: TraceRequest, scale: Scale, tenant: int) -> list[tuple[tuple[int, int], int]]:
    """The request's blocks as cache units: ((tenant, hash id), scaled tokens), after the cap. A
    unit is what a block-granular cache stores once per tenant."""
    return [((tenant, h), n) for h, n in zip(req.hash_ids, block_lengths(req, scale), strict=False)]


def _mix(hash_id: int) -> int:
    """A hash id scrambled (splitmix64's finaliser), so that sampling by it mod K is independent of
    the tenant choice, which takes the id itself mod K."""
    z = (hash_id + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)
