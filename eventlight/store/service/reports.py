"""Spans and worker heartbeats of ``EventStore``."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from eventlight.core.events import WorkerHeartbeat
from eventlight.core.types import (
    Span,
    Worker,
)
from eventlight.store.service.plumbing import UNSET, StorePlumbing, Unset, store_call
from eventlight.store.validate import (
    check_one_attempt,
    check_spans,
    check_stats,
    check_token,
)


class Reports(StorePlumbing):
    """What runners report: spans (de-duplicated, numbered) and worker heartbeats."""

    # -- spans ----------------------------------------------------------------------------------

    @store_call
    async def add_many_spans(self, spans: Sequence[Span]) -> list[Span]:
        check_spans(spans)
        return await self._spans.add(spans, numbered=False)

    @store_call
    async def add_spans_numbered(self, rollout_id: str, attempt_id: str, spans: Sequence[Span]) -> list[Span]:
        """Give ``spans`` the attempt's next sequence ids, in order, and record them (one append).

        The spans' ``sequence_id`` fields are overwritten in place. Returns the spans recorded.

        Raises:
            RolloutNotFoundError / AttemptNotFoundError: Unknown ids.
            InvalidInputError: A span names another attempt or lacks its ids.
        """
        check_one_attempt(rollout_id, attempt_id, spans)
        for i, span in enumerate(spans):
            span.sequence_id = i + 1  # placeholders that pass validation; renumbered when appended
        check_spans(spans)
        return await self._spans.add(spans, numbered=True)

    @store_call
    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> list[int]:
        return await self._spans.reserve(rollout_attempt_ids)

    # -- workers --------------------------------------------------------------------------------

    @store_call
    async def update_worker(self, worker_id: str, heartbeat_stats: dict[str, Any] | Unset = UNSET) -> Worker:
        """Record a heartbeat; also keeps this store's claimed queue entries in progress.

        Without a read model (a runner's store) the returned record holds only what this call knows.

        Raises:
            InvalidInputError: ``worker_id`` is not a token, or the stats are not JSON-encodable.
        """
        check_token("worker_id", worker_id)
        stats = None if isinstance(heartbeat_stats, Unset) else check_stats(heartbeat_stats)
        at = self._clock()
        self._wrote(await self._log().publish(WorkerHeartbeat(time=at, worker_id=worker_id, heartbeat_stats=stats)))
        for item in list(self._held.values()):
            with contextlib.suppress(Exception):
                await item.in_progress()
        if self._read_model is None:
            return Worker(worker_id=worker_id, heartbeat_stats=stats, last_heartbeat_time=at)
        found = await self.get_worker_by_id(worker_id)
        assert found is not None
        return found

    @store_call
    async def get_worker_by_id(self, worker_id: str) -> Worker | None:
        """The worker; ``None`` for an unknown id or one that is not a string."""
        if not isinstance(worker_id, str):
            return None
        page = await (await self._reads()).query_workers(worker_id_in=[worker_id])
        return page[0] if page else None
