"""Store backends: in-memory and JetStream + Postgres, one API (``LightningStore``)."""

from typing import TYPE_CHECKING

from eventlight.store.base import UNSET, LightningStore, LightningStoreCapabilities, LightningStoreStatistics
from eventlight.store.memory import InMemoryLightningStore
from eventlight.store.threaded import LightningStoreThreaded
from eventlight.unavailable import unavailable_class

if TYPE_CHECKING:
    from eventlight.server.client import LightningStoreClient
    from eventlight.server.serving import LightningStoreServer
CollectionBasedLightningStore = unavailable_class(
    "CollectionBasedLightningStore",
    "eventlight's stores are event-sourced, not collection-based; subclass "
    "eventlight.store.service.EventStore over an EventLog and ReadModel (eventlight.store.ports), "
    "or use InMemoryLightningStore / JetStreamLightningStore",
    __name__,
)

__all__ = [
    "UNSET",
    "CollectionBasedLightningStore",
    "InMemoryLightningStore",
    "LightningStore",
    "LightningStoreCapabilities",
    "LightningStoreClient",
    "LightningStoreServer",
    "LightningStoreStatistics",
    "LightningStoreThreaded",
]


def __getattr__(name: str) -> object:
    # the HTTP server and client (FastAPI, uvicorn, httpx) load on first use
    if name in ("LightningStoreServer", "LightningStoreClient"):
        import eventlight.server

        return getattr(eventlight.server, name)
    raise AttributeError(f"module 'eventlight.store' has no attribute {name!r}")
