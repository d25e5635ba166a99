"""KV events: the RAM cache's entries as vLLM-style blocks (`blocks.py`, pure) published over ZMQ in
vLLM's format for a gateway's indexer (`publisher.py`, pyzmq + msgpack: the `kv-events` extra).
docs/gateway.md."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prefixserve.config import KVEventsConfig

if TYPE_CHECKING:
    from prefixserve.kvevents.publisher import KVEventPublisher

log = logging.getLogger("prefixserve.kvevents")


def open_publisher(config: KVEventsConfig | None) -> KVEventPublisher | None:
    """The started publisher for `config` (None: None). Raises ValueError naming the flag when pyzmq or
    msgpack is missing or an endpoint cannot be bound or connected (a port in use, a bad address)."""
    if config is None:
        return None
    try:
        import zmq

        from prefixserve.kvevents.publisher import KVEventPublisher, binds
    except ImportError as e:
        raise ValueError(f"--kv-events-endpoint needs pyzmq and msgpack (pip install 'prefixserve[kv-events]'): {e}") from None
    try:
        publisher = KVEventPublisher(config)
    except zmq.ZMQError as e:
        raise ValueError(f"--kv-events-endpoint {config.endpoint} / --kv-events-replay-endpoint "
                         f"{config.replay_endpoint}: {e}") from None
    if binds(config.endpoint) and config.endpoint.startswith("tcp://"):
        log.warning("KV events listen on %s: they carry prompt token ids, so only the gateway may reach that port "
                    "(docs/gateway.md)", config.endpoint)
    return publisher
