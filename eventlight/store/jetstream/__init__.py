"""``JetStreamLightningStore``: the one store over JetStream (the log) and Postgres (the read model).

* **Writes** go through the one store's command loop (``eventlight.store.service``): decide with
  the pure decider, append with the rollout's expected last sequence (``log``), reload and decide
  again when it is stale.
* **The queue** is the durable pull consumer ``runners`` on ``el.<ns>.r.*.q`` (``queue``).
* **Spans** are appended in batches on ``el.<ns>.s.<rid>.<aid>``, numbered by the stream, with
  group commit (``spanlog``).
* **Reads** come from the Postgres projection (``readmodel``) after read-your-writes; resources are
  read from the stream itself, so runners need no Postgres connection (``pg_dsn=None``).
* **The projector** (``projector``) and its watchdog run in this process when asked: one
  ``Projector``, or with ``Settings.projector_partitions`` > 1 a ``ProjectorGroup`` that takes this
  process's fair share of the partitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import asyncpg
from nats.aio.client import Client as NATS

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError, WrongEventLoopError
from eventlight.core.events import AnyEvent
from eventlight.core.types import now as wall_clock
from eventlight.net import redact_configured
from eventlight.settings import Settings
from eventlight.store.base import LightningStoreCapabilities
from eventlight.store.jetstream import pg, pg_errors
from eventlight.store.jetstream.connect import RECONNECT_WAIT_S, connect_nats, connected_server
from eventlight.store.jetstream.log import JetStreamEventLog
from eventlight.store.jetstream.nats_errors import nats_errors
from eventlight.store.jetstream.pg_open import open_waiting
from eventlight.store.jetstream.projector import Projector, ProjectorGroup
from eventlight.store.jetstream.projector.partition import record_partitions
from eventlight.store.jetstream.readmodel import SYNC_TIMEOUT_S, SqlReadModel
from eventlight.store.service import EventStore
from eventlight.store.service.plumbing import store_call

__all__ = ["JetStreamLightningStore"]

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0


class JetStreamLightningStore(EventStore):
    """The event-sourced store.

    Args:
        settings: Namespace and (optionally) service addresses.
        nats_url: NATS server; defaults to ``settings.nats_url``.
        pg_dsn: Postgres DSN for reads; ``None`` opens a write-only store (what runners use).
        run_projector: Run the projector (and its watchdog) in this process. Defaults to ``True``
            when ``pg_dsn`` is given.
        pool_size: Upper bound of this store's Postgres connections (peer failure C25).
        watchdog_interval_s: Seconds between watchdog ticks of the local projector.
        clock: Wall-clock seconds (injectable for tests of timing rules).

    Use as ``async with JetStreamLightningStore(...) as store:`` or call ``start()``/``close()``.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        nats_url: str | None = None,
        pg_dsn: str | None = None,
        run_projector: bool | None = None,
        pool_size: int = 4,
        watchdog_interval_s: float = 1.0,
        clock: Callable[[], float] = wall_clock,
    ):
        super().__init__(None, None, clock)
        self.settings = settings
        self.nats_url = nats_url or settings.nats_url
        self.pg_dsn = pg_dsn
        self.run_projector = (pg_dsn is not None) if run_projector is None else run_projector
        self.pool_size = pool_size
        self.watchdog_interval_s = watchdog_interval_s
        self.nc: NATS | None = None
        self.log: JetStreamEventLog | None = None
        self.pool: asyncpg.Pool | None = None
        self.projector: Projector | ProjectorGroup | None = None
        self.read_model: SqlReadModel | None = None
        self._home_loop: asyncio.AbstractEventLoop | None = None  # the loop start() ran on

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return {"async_safe": True, "thread_safe": False, "zero_copy": True, "otlp_traces": False}

    async def start(self) -> JetStreamLightningStore:
        """Connect to NATS (and Postgres when ``pg_dsn`` is set); start the projector if asked.

        Postgres answering "too many clients" (or that it is starting up) is tried again for up to
        ``settings.pg_open_wait_s`` seconds (``EVENTLIGHT_PG_OPEN_WAIT_S``, 30 by default), one
        warning line a try.

        Raises:
            ServiceUnavailableError: A server cannot be reached, or Postgres took no connection
                within ``settings.pg_open_wait_s`` seconds.
            InvalidInputError: No NATS URL, a projector without Postgres, or a namespace without tables.
        """
        if self.nats_url is None:
            raise InvalidInputError("JetStreamLightningStore needs a NATS URL (settings.nats_url or nats_url=)")
        if self.run_projector and self.pg_dsn is None:
            raise InvalidInputError("the projector needs Postgres (pg_dsn)")
        self._home_loop = asyncio.get_running_loop()
        self.nc = await connect_nats(self.nats_url, auth=self.settings.nats_auth)
        try:
            self.log = JetStreamEventLog(self.nc, self.settings, self._clock)
            await self.log.learn_replicas()
            if self.pg_dsn is not None:
                self.pool = await self._open_pool(self.pg_dsn)
                self.read_model = SqlReadModel(
                    self.pool, self.nc, self.log.prefix, None, server=self.pg_dsn, head_seq=self.log.head_seq
                )
                await self.read_model.start()
            if self.run_projector:
                assert self.pool is not None and self.read_model is not None
                self.projector = await self._projector(self.log, self.pool, self.read_model)
                self.read_model.projector = self.projector
                await self.projector.start()
            self._bind(self.log, self.read_model)
        except BaseException:
            await self.close()  # nothing half-open is left behind
            raise
        return self

    async def _projector(
        self, log_: JetStreamEventLog, pool: asyncpg.Pool, reads: SqlReadModel
    ) -> Projector | ProjectorGroup:
        """One projector, or one per partition (``ProjectorGroup``), after the partition count is
        recorded or checked (``record_partitions``: a namespace's count is fixed).

        Raises:
            InvalidInputError: The namespace is recorded with another partition count.
        """
        n = self.settings.projector_partitions
        kw = {
            "watchdog_interval_s": self.watchdog_interval_s,
            "on_commit": reads._on_commit,
            "on_leadership": reads._on_leadership,
            "clock": self._clock,
        }
        if n == 1:
            async with pool.acquire() as conn:
                await record_partitions(conn, 1)
            return Projector(log_, pool, **kw)  # type: ignore[arg-type]
        return ProjectorGroup(log_, pool, n, **kw)  # type: ignore[arg-type]

    async def _open_pool(self, dsn: str) -> asyncpg.Pool:
        """The store's pool, once Postgres takes a connection: while it answers "too many clients"
        (or that it is starting up), tried again for up to ``settings.pg_open_wait_s`` seconds
        (``open_waiting``).

        Raises:
            ServiceUnavailableError: Postgres cannot be reached, or took no connection in time.
            InvalidInputError: The namespace has no tables.
        """
        n = self.settings.projector_partitions
        extra = 2 * n + 1 if self.run_projector and n > 1 else 0  # ProjectorGroup's lock and batch connections
        pool = await open_waiting(
            dsn,
            "opening the store",
            lambda: pg.create_pool(dsn, self.settings.pg_schema, max_size=self.pool_size + extra),
            wait_s=self.settings.pg_open_wait_s,
        )
        try:
            with pg_errors.pg_errors(dsn, "connect"):
                async with pool.acquire() as conn:
                    migrated = await conn.fetchval("SELECT to_regclass('projector_checkpoint')") is not None
        except BaseException:
            pool.terminate()
            raise
        if not migrated:
            await pool.close()
            raise InvalidInputError(
                f"namespace {self.settings.namespace!r} has no tables in Postgres schema "
                f"{self.settings.pg_schema!r}; run `eventlight up` (or "
                "eventlight.ops.apply_migrations) first"
            )
        return pool

    async def __aenter__(self) -> JetStreamLightningStore:
        return await self.start()

    @property
    def home_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop this store is open on (``start()`` ran there, and its NATS connection,
        Postgres pool and projector belong to it), or ``None`` before ``start()`` and after ``close()``."""
        return None if self.nc is None or self._closed else self._home_loop

    def _check_open(self) -> None:
        super()._check_open()
        self._check_loop()

    def _check_loop(self) -> None:
        """Refuse a call from another event loop than the one ``start()`` ran on: its NATS
        connection, Postgres pool and projector belong to that loop (a call from here would wait on
        sockets nobody reads, then fail with asyncio's "attached to a different loop").

        Raises:
            WrongEventLoopError: The running loop is not the store's.
        """
        home = self._home_loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        if home is None or running is home:
            return
        state = "closed" if home.is_closed() else "still running" if home.is_running() else "not running"
        raise WrongEventLoopError(
            f"this {type(self).__name__} was started on another event loop ({state}), and its NATS "
            "connection, Postgres pool and projector belong to that loop; open one store per event "
            "loop (per asyncio.run or thread), or call this one only from the loop that started it"
        )

    async def close(self) -> None:
        """Stop the projector, unsubscribe, close NATS and Postgres; idempotent.

        Raises:
            WrongEventLoopError: Called from another event loop than the one the store started on.
        """
        if self._closed and (self._closing is None or self._closing.done()):
            return
        self._check_loop()
        await super().close()

    async def _close(self) -> None:
        await self._drain_calls()
        await self._settle_abandoned_claims()  # while NATS and Postgres are still open
        self._cancel_claim_reads()
        for task in self._background:  # what outlived the settle's wait stops with the connections
            task.cancel()
        if self.read_model is not None:  # first: the projector stepping down need not subscribe it again
            await self.read_model.close()
        if self.projector is not None:
            await self.projector.close()
        if self.log is not None:
            await self.log.close()
        self._closed = True
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.flush(timeout=2)
            with contextlib.suppress(Exception):
                await self.nc.close()
        if self.pool is not None:
            try:
                await asyncio.wait_for(self.pool.close(), CLOSE_TIMEOUT_S)
            except TimeoutError:
                log.warning("Postgres connections did not close within %.0f s; terminating them", CLOSE_TIMEOUT_S)
                self.pool.terminate()

    async def dependencies_down(self, timeout_s: float = 2.0) -> dict[str, str]:
        """NATS and Postgres, checked at once and cheaply: what ``/v1/agl/health`` reports.

        NATS is down when the connection is lost (nats-py reconnects meanwhile) or the server does
        not answer a PING within ``timeout_s`` seconds; Postgres (when the store has it) when no
        connection answers ``SELECT 1`` within ``timeout_s`` seconds: a pooled one, or, when every
        pooled connection stays busy (a pool saturated under load), one opened for the probe
        (``postgres_down`` of the read model). A closed store has neither.

        Returns:
            ``{"nats": why, "postgres": why}`` for those that are down (one line each, no
            passwords); ``{}`` when both answer.
        """
        nats, postgres = await asyncio.gather(self._nats_down(timeout_s), self._postgres_down(timeout_s))
        return {name: why for name, why in (("nats", nats), ("postgres", postgres)) if why is not None}

    async def _nats_down(self, timeout_s: float) -> str | None:
        nc, url = self.nc, self.nats_url or "NATS"
        if nc is None or nc.is_closed:
            return redact_configured(url, f"no connection to {url} (the store is closed)")
        if not nc.is_connected:
            return redact_configured(
                url, f"the connection to {url} is lost; reconnecting every {RECONNECT_WAIT_S:.0f} s"
            )
        try:
            with nats_errors(connected_server(nc), "ping"):
                await nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # nats-py annotates int; a float works
        except ServiceUnavailableError as e:
            return str(e)
        return None

    async def _postgres_down(self, timeout_s: float) -> str | None:
        if self.read_model is None or self.pg_dsn is None:
            return None  # a runner's store: it needs no Postgres
        why = await self.read_model.postgres_down(timeout_s)
        return None if why is None else redact_configured(self.pg_dsn, f"{self.pg_dsn} does not answer ({why})")

    @store_call
    async def sync(self, seq: int | None = None, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """Wait until the projection includes stream sequence ``seq`` (default: this store's last write).

        Raises:
            ServiceUnavailableError: The projector did not get there within ``timeout_s`` seconds.
            InvalidInputError: The store has no Postgres, or closed meanwhile.
        """
        reads = await self._reads_unsynced()
        waited, _ = await self._unless_closing(reads.sync(self._last_write if seq is None else seq, timeout_s))
        if not waited:
            raise InvalidInputError("this store closed before the projection caught up")

    async def _reads_unsynced(self) -> SqlReadModel:
        self._check_open()
        if self.read_model is None:
            raise InvalidInputError("this store was opened without Postgres (pg_dsn=None); it cannot answer queries")
        return self.read_model

    @store_call
    async def sync_all(self, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """Wait until the projection includes everything on the stream now, whoever wrote it."""
        log_ = self._log()
        assert isinstance(log_, JetStreamEventLog)
        with nats_errors(log_.server, "stream info"):
            info = await log_.js.stream_info(log_.stream)
        await self.sync(info.state.last_seq, timeout_s)

    @store_call
    async def run_watchdog(self, now: float | None = None) -> list[AnyEvent]:
        """One watchdog tick at ``now`` (default: the clock) over the local projector's rollouts.

        Raises:
            InvalidInputError: This store runs no projector, or is closed.
        """
        self._check_open()
        if self.projector is None:
            raise InvalidInputError("this store runs no projector (run_projector=False): its watchdog runs elsewhere")
        if isinstance(self.projector, ProjectorGroup):
            return await self.projector.tick(now)
        return await self.projector.watchdog.tick(now)
