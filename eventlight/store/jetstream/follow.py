"""Subscribers' feeds on JetStream: a pull consumer of ``el.<ns>.r.>``, durable by name or ephemeral.

Settings come from ``_data/streams/005_subscriber.json``: deliver by start sequence, ``ack_policy:
all`` (an ack acknowledges every earlier delivery too), ``ack_wait`` 300 s.

* **Durable** (``durable="name"``): created at the first ``follow`` (after ``since``, default the
  stream's head); later ``follow`` calls with the name resume after its ack floor. A consumer with
  deliveries past its ack floor (its last subscriber died holding them) is re-created at the floor
  + 1 under the same name, so they come again at once and in order rather than after ``ack_wait``;
  they are flagged ``redelivered``. One live subscriber per name: a second takes the position over.
* **Ephemeral** (``durable=None``): a consumer of its own with ``inactive_threshold`` 30 s (the
  server deletes it after a crash), deleted on ``close``.

A consumer that disappears (deleted, or a restarted server without it) is re-created after the
feed's last acknowledged position. The server going away is retried while the client reconnects,
for up to ``server_timeout_s``; then ``next`` raises ``ServiceUnavailableError``. While no message
comes, the consumer's existence is checked every ``CHECK_EVERY_S``, so a lost consumer or server
never stalls a subscription silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from eventlight.core.errors import ServiceUnavailableError
from eventlight.store.futures import cancels, raise_if_cancelled
from eventlight.store.jetstream.definitions import consumer_config
from eventlight.store.jetstream.nats_errors import ANY_NATS_ERROR, NO_MESSAGES, JsNotFoundError, nats_errors
from eventlight.store.ports import Delivery

if TYPE_CHECKING:
    from eventlight.store.jetstream.log import JetStreamEventLog

log = logging.getLogger(__name__)

BATCH = 256
CHECK_EVERY_S = 5.0
EPHEMERAL_INACTIVE_S = 30.0
SERVER_TIMEOUT_S = 30.0
INFO_TIMEOUT_S = 2.0
CHECK_ERRORS: tuple[type[BaseException], ...] = (*ANY_NATS_ERROR, TimeoutError)


class JetStreamFeed:
    """One subscription's consumer (see the module docstring and ``eventlight.store.ports.Feed``)."""

    def __init__(self, log: JetStreamEventLog, durable: str | None, since: int | None, server_timeout_s: float):
        self.log = log
        self.durable = durable
        self.name = durable or f"sub-{uuid.uuid4().hex[:12]}"
        self.since = since
        self.server_timeout_s = server_timeout_s
        self.start_seq = 0
        self._acked = 0
        self._redelivered_until = 0
        self._held: dict[int, Any] = {}
        self._sub: Any = None
        self._down_since: float | None = None
        self._checked = time.monotonic()

    async def open(self) -> JetStreamFeed:
        """Create or resume the consumer and bind to it.

        Raises:
            ServiceUnavailableError: NATS did not answer.
        """
        with nats_errors(self.log.server, f"opening the subscription {self.name!r}"):
            info = await self._info() if self.durable is not None else None
            if info is None:
                start = (self.since if self.since is not None else await self.log.head_seq()) + 1
                await self._create(start)
            else:
                floor, delivered = int(info.ack_floor.stream_seq or 0), int(info.delivered.stream_seq or 0)
                start = floor + 1
                if delivered > floor:  # a dead subscriber held these: deliver them now, in order
                    self._redelivered_until = delivered
                    await self.log.js.delete_consumer(self.log.stream, self.name)
                    await self._create(start)
                    log.info(
                        "subscription %s: resuming at %d (%d delivered, not acknowledged)",
                        self.name,
                        start,
                        delivered - floor,
                    )
            await self._bind()
        self.start_seq, self._acked = start, start - 1
        return self

    async def _info(self) -> Any:
        try:
            return await self.log.js.consumer_info(self.log.stream, self.name, timeout=INFO_TIMEOUT_S)
        except JsNotFoundError:
            return None

    async def _create(self, start: int) -> None:
        cfg = consumer_config("subscriber", self.log.settings.namespace)
        cfg = dataclasses.replace(cfg, name=self.name, opt_start_seq=max(1, start))
        if self.durable is not None:
            cfg = dataclasses.replace(cfg, durable_name=self.name)
        else:
            cfg = dataclasses.replace(cfg, inactive_threshold=EPHEMERAL_INACTIVE_S, mem_storage=True)
        await self.log.js.add_consumer(self.log.stream, cfg)

    async def _bind(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        self._held.clear()  # acks for the old consumer's deliveries cannot reach the new one
        self._sub = await self.log.js.pull_subscribe_bind(durable=self.name, stream=self.log.stream)

    async def next(self, wait_s: float) -> list[Delivery]:
        """Up to ``BATCH`` deliveries, waiting up to ``wait_s`` seconds for the first.

        Raises:
            ServiceUnavailableError: The server did not answer for ``server_timeout_s`` seconds.
        """
        if not self.log.nc.is_connected:
            await self._failed(ConnectionError("the NATS client is not connected"))
            return []
        base = cancels()
        try:
            msgs = await self._sub.fetch(BATCH, timeout=max(0.05, wait_s))
        except NO_MESSAGES:
            raise_if_cancelled(base)  # a cancel nats-py's wait_for swallowed
            if time.monotonic() - self._checked >= CHECK_EVERY_S or self._down_since is not None:
                await self._check()
            return []
        except ANY_NATS_ERROR as e:
            await self._failed(e)
            return []
        raise_if_cancelled(base)
        self._down_since = None
        out = []
        for msg in msgs:
            meta = msg.metadata
            seq = int(meta.sequence.stream)
            self._held[seq] = msg
            again = seq <= self._redelivered_until or int(meta.num_delivered) > 1
            out.append(Delivery(seq, msg.subject[len(self.log.prefix) + 1 :], msg.data, again))
        return out

    async def _check(self) -> None:
        """Does the consumer still exist? Re-create it if not; count the time the server is away."""
        self._checked = time.monotonic()
        try:
            info = await self._info()
        except CHECK_ERRORS as e:
            await self._failed(e)
            return
        self._down_since = None
        if info is None:
            await self._recreate("it was gone")

    async def _recreate(self, why: str) -> None:
        log.warning("subscription %s: %s; re-creating it after position %d", self.name, why, self._acked)
        with nats_errors(self.log.server, f"re-creating the subscription {self.name!r}"):
            with contextlib.suppress(Exception):
                await self.log.js.delete_consumer(self.log.stream, self.name)
            await self._create(self._acked + 1)
            await self._bind()

    async def _failed(self, e: BaseException) -> None:
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = now
            log.warning(
                "subscription %s: NATS failed (%r); retrying for up to %.0f s", self.name, e, self.server_timeout_s
            )
        if now - self._down_since >= self.server_timeout_s:
            raise ServiceUnavailableError(
                self.log.server(),
                f"the subscription {self.name!r} had no answer from NATS for {now - self._down_since:.0f} s ({e!r}); "
                f"it resumes after position {self._acked} when opened again",
            ) from e
        await asyncio.sleep(0.25)
        if self.log.nc.is_connected:
            with contextlib.suppress(ServiceUnavailableError, *CHECK_ERRORS):
                if await self._info() is None:
                    await self._recreate("it was gone after the server came back")

    async def ack(self, seq: int) -> None:
        """Acknowledge every delivery up to ``seq`` and wait for the server to confirm it (a
        cumulative ack of the latest delivery held at or before ``seq``; nothing when none is held).

        Raises:
            ServiceUnavailableError: The server did not confirm it.
        """
        held = [s for s in self._held if s <= seq]
        if not held:
            self._acked = max(self._acked, seq)
            return
        msg = self._held[max(held)]
        base = cancels()
        with nats_errors(self.log.server, f"acknowledging position {seq} of subscription {self.name!r}"):
            await msg.ack_sync(timeout=5.0)
        for s in held:
            del self._held[s]
        self._acked = max(self._acked, seq)
        raise_if_cancelled(base)  # a cancel nats-py's wait_for swallowed: the ack stands, the caller stops

    async def close(self) -> None:
        """Unsubscribe; delete an ephemeral consumer (a durable one keeps its position); idempotent."""
        sub, self._sub = self._sub, None
        if sub is None:
            return
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        if self.durable is None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.log.js.delete_consumer(self.log.stream, self.name), 2)
