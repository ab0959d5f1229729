"""``SqlReadModel``: the Postgres read model of one namespace."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import asyncpg
from nats.aio.client import Client as NATS

from eventlight.store.jetstream.connect import connected_server
from eventlight.store.jetstream.nats_errors import nats_errors
from eventlight.store.jetstream.projector import Projector, ProjectorGroup
from eventlight.store.jetstream.readmodel.waits import Broadcast, Waits, _Waiter


class SqlReadModel(Waits):
    """Queries over one namespace's Postgres schema.

    Args:
        pool: Connections that use the namespace's schema.
        nc: The NATS connection (``wait_for_rollouts`` follows terminal events on the stream).
        prefix: The namespace's subject prefix (``el.<ns>``).
        projector: This process's projector, if it runs one (its commits wake waiters).
        server: The Postgres DSN, named (without its password) when the server fails.
    """

    def __init__(
        self,
        pool: asyncpg.Pool,
        nc: NATS,
        prefix: str,
        projector: Projector | ProjectorGroup | None,
        server: str = "postgres",
    ):
        self.pool = pool
        self.server = server
        self.nc = nc
        self.prefix = prefix
        self.projector = projector
        self._changed = Broadcast()
        self._hints: set[str] = set()
        self._waiters: list[_Waiter] = []
        self._watch_sub: Any = None
        self._alone: asyncio.Task[str | None] | None = None  # the probe on a connection of its own

    async def start(self) -> None:
        """Follow terminal events (only ever published on a rollout's ``e`` subject: ``enters_queue``)."""
        with nats_errors(connected_server(self.nc), "subscribing to terminal events"):
            self._watch_sub = await self.nc.subscribe(f"{self.prefix}.r.*.e", cb=self._on_rollout_event)

    async def close(self) -> None:
        """Stop following the stream; idempotent (the store closes the pool)."""
        sub, self._watch_sub = self._watch_sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
