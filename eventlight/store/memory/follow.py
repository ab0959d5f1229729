"""Subscribers' feeds over the in-memory log: the rollout events from a position, durable by name.

A durable's position is kept in the log (``MemoryEventLog.durables``), so a subscription closed and
opened again with the same name, in the same process, resumes after the last position it
acknowledged, as a JetStream durable consumer does across processes (``jetstream.follow``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from eventlight.core.events import SpansAdded, encode_event, rollout_id_of
from eventlight.store.jetstream.layout import subject_for  # pure; the subjects both logs name
from eventlight.store.ports import Delivery

if TYPE_CHECKING:
    from eventlight.store.memory.log import MemoryEventLog

BATCH = 256


class MemoryFeed:
    """One subscription's reader of a ``MemoryEventLog`` (see ``eventlight.store.ports.Feed``)."""

    def __init__(self, log: MemoryEventLog, durable: str | None, since: int | None):
        self.log = log
        self.durable = durable
        head = len(log.events)
        if durable is not None and durable in log.durables:
            acked, delivered = log.durables[durable]
        else:
            acked = head if since is None else min(since, head)
            delivered = acked
        if durable is not None:
            log.durables[durable] = (acked, delivered)
        self.start_seq = acked + 1
        self._pos = acked
        self._redelivered_until = delivered

    async def next(self, wait_s: float) -> list[Delivery]:
        events = self.log.events
        if self._pos >= len(events):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.log.appended().wait(), max(0.0, wait_s))
        out: list[Delivery] = []
        while self._pos < len(events) and len(out) < BATCH:
            self._pos += 1
            event = events[self._pos - 1]
            if isinstance(event, SpansAdded) or rollout_id_of(event) is None:
                continue
            subject = subject_for("", event)[1:]
            out.append(Delivery(self._pos, subject, encode_event(event), self._pos <= self._redelivered_until))
        if self.durable is not None:
            acked, delivered = self.log.durables[self.durable]
            self.log.durables[self.durable] = (acked, max(delivered, self._pos))
        return out

    async def ack(self, seq: int) -> None:
        if self.durable is not None:
            acked, delivered = self.log.durables[self.durable]
            self.log.durables[self.durable] = (max(acked, seq), delivered)

    async def close(self) -> None:
        """Nothing to release (a durable's position stays in the log)."""
