"""The HTTP layer: FastAPI app, OpenAI schemas, auth/tenancy, streaming, metrics.

Request path: auth (key -> tenant) -> schemas (body) -> completions / chat (prompt ids, sampling,
namespace) -> generation (engine, disconnects) -> streaming / responses (OpenAI shapes) -> tracking
(metrics, usage ledger). `run` is the `prefixserve serve` entry point. Nothing imports this package.
"""
