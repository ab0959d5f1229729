"""Span writes of the one store: attempt checks, de-duplication by span id, chunking, numbering.

Duplicate spans (same ``(rollout_id, attempt_id, span_id)``) are never stored twice: the projector
drops them. ``add_span``/``add_many_spans`` also report them at write time (``None`` / left out of
the result) when they repeat a span this store object already wrote (it remembers the span ids of
its last ``RECENT_ATTEMPTS`` attempts; a copy sent while another call of this store object is writing
that span waits for that write's outcome) or, on JetStream, re-send the same batch from any process
within the stream's duplicate window (120 s). A duplicate written by another process after that
is dropped silently but returned as if recorded. Each duplicate reported is also logged as a warning,
with Agent-lightning 0.3.0's text (``Duplicated span added for rollout=…, attempt=…, span=…. Skipping.``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from eventlight.core.types import Span
from eventlight.store.command_loop import CommandLoop
from eventlight.store.ports import EventLog

log = logging.getLogger(__name__)

SPANS_PER_MESSAGE = 256
RECENT_ATTEMPTS = 256  # attempts whose span ids this store remembers for duplicate checks


class SpanWriter:
    """Writes span batches through the log and folds them into the command loop's cache.

    Args:
        log: The event log.
        loop: The store's command loop (its cached states learn about the spans written).
        on_write: Called with each batch's log position.
    """

    def __init__(self, log: EventLog, loop: CommandLoop, on_write: Callable[[int], None]):
        self.log = log
        self.loop = loop
        self.on_write = on_write
        self._span_ids: dict[tuple[str, str], set[str]] = {}  # insertion-ordered, trimmed
        self._writing: dict[tuple[str, str, str], asyncio.Future[None]] = {}  # span ids of appends in flight

    async def _attempt_id(self, rollout_id: str, attempt_id: str) -> str:
        """Resolve an attempt (``latest`` allowed) on the cached state, else the log's.

        Raises:
            RolloutNotFoundError / AttemptNotFoundError: Unknown ids.
        """
        cached = self.loop.cached(rollout_id)
        if cached is not None:
            try:
                return cached[0].attempt(attempt_id).attempt_id
            except ValueError:
                pass
        return (await self.loop.load(rollout_id)).attempt(attempt_id).attempt_id

    def _seen(self, key: tuple[str, str]) -> set[str]:
        seen = self._span_ids.get(key)
        if seen is None:
            seen = self._span_ids[key] = set()
            while len(self._span_ids) > RECENT_ATTEMPTS:
                del self._span_ids[next(iter(self._span_ids))]
        return seen

    async def add(self, spans: Sequence[Span], *, numbered: bool) -> list[Span]:
        """Record validated spans; returns those recorded (duplicates left out)."""
        groups: dict[tuple[str, str], list[Span]] = {}
        for span in spans:
            groups.setdefault((span.rollout_id, span.attempt_id), []).append(span)
        for rid, aid in groups:
            await self._attempt_id(rid, aid)
        added: list[Span] = []
        for (rid, aid), group in groups.items():
            while waits := {f for s in group if (f := self._writing.get((rid, aid, s.span_id))) is not None}:
                await asyncio.wait(waits)  # a copy is being written by a concurrent call: its outcome decides
            seen = self._seen((rid, aid))
            fresh, batch_ids = [], set()
            for span in group:  # the first of each span id that this store has not written yet
                if span.span_id not in seen and span.span_id not in batch_ids:
                    batch_ids.add(span.span_id)
                    fresh.append(span)
                else:
                    _dropped(rid, aid, span.span_id)
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            for span_id in batch_ids:
                self._writing[(rid, aid, span_id)] = done
            try:
                for i in range(0, len(fresh), SPANS_PER_MESSAGE):
                    chunk = fresh[i : i + SPANS_PER_MESSAGE]
                    first, at, seq = await self.log.append_spans(rid, aid, chunk, numbered=numbered)
                    self.on_write(seq)
                    if first is not None:
                        added.extend(chunk)
                        self.loop.spans_written(rid, aid, at)
                    else:  # the log had this very batch already (another store re-sent it)
                        for span in chunk:
                            _dropped(rid, aid, span.span_id)
                    seen.update(s.span_id for s in chunk)  # only once written: a failed append may be retried
            finally:
                for span_id in batch_ids:
                    del self._writing[(rid, aid, span_id)]
                done.set_result(None)
        recorded = {(s.rollout_id, s.attempt_id, s.span_id): s for s in added}
        ordered = []  # in the order given (as 0.3.0 returns them), each recorded span once
        for span in spans:
            if (key := (span.rollout_id, span.attempt_id, span.span_id)) in recorded:
                ordered.append(recorded.pop(key))
        return ordered

    async def reserve(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> list[int]:
        """One new sequence id per ``(rollout_id, attempt_id)``, increasing within an attempt.

        Raises:
            RolloutNotFoundError / AttemptNotFoundError: Unknown ids.
        """
        counts: dict[tuple[str, str], int] = {}
        resolved: list[tuple[str, str]] = []
        for rid, aid in rollout_attempt_ids:
            key = (rid, await self._attempt_id(rid, aid))
            resolved.append(key)
            counts[key] = counts.get(key, 0) + 1
        next_id: dict[tuple[str, str], int] = {}
        for (rid, aid), n in counts.items():
            first, _, seq = await self.log.append_spans(rid, aid, [], numbered=False, reserve=n)
            assert first is not None  # a reservation is never a duplicate
            self.on_write(seq)
            next_id[(rid, aid)] = first
        out = []
        for key in resolved:
            out.append(next_id[key])
            next_id[key] += 1
        return out


def _dropped(rollout_id: str, attempt_id: str, span_id: str) -> None:
    log.warning("Duplicated span added for rollout=%s, attempt=%s, span=%s. Skipping.", rollout_id, attempt_id, span_id)
