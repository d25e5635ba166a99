"""prefixserve: an OpenAI-compatible inference server with an exact, isolated cross-request prefix cache."""

__version__ = "0.1.0"
