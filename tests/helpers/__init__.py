"""Shared test helpers: `server_proc` (a real server subprocess), `fake_engine` (an EngineClient
without a model, for fast HTTP-layer tests)."""
