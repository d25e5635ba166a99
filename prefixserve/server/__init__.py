"""The HTTP layer, one subpackage per surface: `openai` (the OpenAI API: completions, chat, the
Responses API and its stored responses, tokenize) and `operator` (health, metrics, usage, cache
flushes, API keys and tenants, each request's accounting); the app's wiring at the top.

Request path: openai/routes.py: operator/auth.py (key -> tenant) -> openai/schemas.py (body) ->
openai/completions.py / chat.py / responses/prepare.py (prompt ids, sampling, namespace) ->
openai/respond.py (engine, disconnects) -> openai/streaming.py / shapes.py (OpenAI shapes) ->
operator/accounting.py (metrics, usage ledger). `run` is the `prefixserve serve` entry point.
Nothing imports this package; `openai` imports `operator`, never the reverse.
"""
