"""What an operator runs the server with: `routes.py` (/health, /metrics, /v1/usage, DELETE /v1/cache),
API keys and tenants (`auth.py`), the Prometheus metrics (`metrics.py`), each generation request's
accounting into them and the usage ledger (`accounting.py`), who may flush what (`cache_flush.py`).
Imports nothing of `openai`."""
