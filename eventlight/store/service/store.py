"""``EventStore``: the one ``LightningStore``, assembled from its parts."""

from __future__ import annotations

from eventlight.store.service.claims import Claims
from eventlight.store.service.reads import Reads
from eventlight.store.service.reports import Reports
from eventlight.store.service.resources import Resources
from eventlight.store.service.rollouts import RolloutCommands
from eventlight.store.service.subscribe import Subscriptions


class EventStore(RolloutCommands, Claims, Resources, Reports, Reads, Subscriptions):
    """The store over an event log and (optionally) a read model.

    Args:
        log: The event log (the source of truth).
        reads: The read model; ``None`` for a write-only store (reads raise ``InvalidInputError``).
        clock: Wall-clock seconds (injectable for tests of timing rules).
    """

    async def dependencies_down(self, timeout_s: float = 2.0) -> dict[str, str]:
        """The servers this store needs that do not answer now, each with why (one line).

        ``{}`` here: the in-memory store needs none. ``JetStreamLightningStore`` checks NATS and
        Postgres within ``timeout_s`` seconds. What ``/v1/agl/health`` reports.
        """
        return {}
