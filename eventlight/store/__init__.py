"""Store backends: in-memory and JetStream + Postgres, one API (``LightningStore``)."""

from eventlight.store.base import UNSET, LightningStore, LightningStoreCapabilities, LightningStoreStatistics
from eventlight.store.memory import InMemoryLightningStore
from eventlight.store.threaded import LightningStoreThreaded
from eventlight.unavailable import unavailable_class

_REST = (
    "eventlight has no REST store server yet (another issue builds it); share one store between "
    "processes through NATS and Postgres instead: JetStreamLightningStore(settings) in each process"
)
LightningStoreServer = unavailable_class("LightningStoreServer", _REST, __name__)
LightningStoreClient = unavailable_class("LightningStoreClient", _REST, __name__)
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
