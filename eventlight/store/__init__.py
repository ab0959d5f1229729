"""Store backends: in-memory and JetStream + Postgres, one API (``LightningStore``)."""

from eventlight.store.base import UNSET, LightningStore, LightningStoreCapabilities
from eventlight.store.memory import InMemoryLightningStore

__all__ = ["UNSET", "InMemoryLightningStore", "LightningStore", "LightningStoreCapabilities"]
