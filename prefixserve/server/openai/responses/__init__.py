"""The Responses API (POST /v1/responses): the chat request a body means (`prepare.py`), the response
object and its typed events (`shape.py`), input items (`items.py`) and the stored responses
`previous_response_id` continues (`store.py`, on disk `disk.py`)."""
