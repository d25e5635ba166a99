"""The OpenAI API: `routes.py` serves it; each request is checked and prepared as an engine request
(`completions.py`, `chat.py`, `responses/`), run and answered (`respond.py`) in OpenAI's shapes
(`shapes.py`, `streaming.py`). Imports `operator` (each request's accounting), never the reverse."""
