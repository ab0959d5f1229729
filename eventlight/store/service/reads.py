"""Reads of ``EventStore``: the queries, answered by the read model (read-your-writes)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from eventlight.core.errors import InvalidInputError, InvalidTypeError, RolloutNotFoundError
from eventlight.core.types import (
    Attempt,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    Span,
    Worker,
)
from eventlight.store.service.plumbing import StorePlumbing, store_call


def _rollout_id(rollout_id: Any) -> str:
    """A rollout id to read by; one that is not a string names no rollout.

    Raises:
        RolloutNotFoundError: ``rollout_id`` is not a string (``None`` included), on every backend.
    """
    if not isinstance(rollout_id, str):
        raise RolloutNotFoundError(rollout_id)
    return rollout_id


def _text_filters(**values: Any) -> None:
    """Span filters compare strings.

    Raises:
        InvalidTypeError: A filter that is neither ``None`` nor a string (``name=5``).
    """
    for name, value in values.items():
        if value is not None and not isinstance(value, str):
            raise InvalidTypeError(f"{name} must be a string, not {type(value).__name__}")


class Reads(StorePlumbing):
    """Queries, answered by the read model after it has seen this store's last write."""

    # -- reads (the read model) -----------------------------------------------------------------

    @store_call
    async def query_rollouts(
        self,
        *,
        status_in: Sequence[str] | None = None,
        rollout_id_in: Sequence[str] | None = None,
        rollout_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
        status: Sequence[str] | None = None,
        rollout_ids: Sequence[str] | None = None,
    ) -> PaginatedResult[Rollout]:
        return await (await self._reads()).query_rollouts(
            status_in=status_in,
            rollout_id_in=rollout_id_in,
            rollout_id_contains=rollout_id_contains,
            filter_logic=filter_logic,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
            status=status,
            rollout_ids=rollout_ids,
        )

    @store_call
    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        """The rollout with its latest attempt; ``None`` for an unknown id or one that is not a string."""
        if not isinstance(rollout_id, str):
            return None
        return await (await self._reads()).get_rollout_by_id(rollout_id)

    @store_call
    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Attempt]:
        reads = await self._reads()
        return await reads.query_attempts(
            _rollout_id(rollout_id), sort_by=sort_by, sort_order=sort_order, limit=limit, offset=offset
        )

    @store_call
    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        return await (await self._reads()).get_latest_attempt(_rollout_id(rollout_id))

    @store_call
    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        """The rollouts among ``rollout_ids`` that have finished, once all have or ``timeout``
        seconds pass (``None``: no limit). A ``close()`` of this store ends the wait as a timeout
        would: the rollouts finished by then.

        Raises:
            RolloutNotFoundError: An id names no rollout (one that is not a string included).
            InvalidTypeError: ``rollout_ids`` is a string or not iterable, or ``timeout`` is not a number.
            InvalidInputError: ``timeout`` is NaN.
        """
        if isinstance(rollout_ids, (str, bytes)) or not isinstance(rollout_ids, Iterable):
            raise InvalidTypeError(f"rollout_ids must be a list of rollout ids, got {rollout_ids!r:.80}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)):
            raise InvalidTypeError(f"timeout must be a number of seconds or None, got {timeout!r:.80}")
        if timeout is not None and timeout != timeout:
            raise InvalidInputError("timeout must be a number of seconds or None, got nan")
        ids = [_rollout_id(r) for r in rollout_ids]
        reads = await self._reads()
        waited, found = await self._unless_closing(reads.wait_for_rollouts(ids, timeout))
        if waited:
            assert found is not None
            return found
        return await reads.wait_for_rollouts(ids, 0.0)

    @store_call
    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
        *,
        trace_id: str | None = None,
        trace_id_contains: str | None = None,
        span_id: str | None = None,
        span_id_contains: str | None = None,
        parent_id: str | None = None,
        parent_id_contains: str | None = None,
        name: str | None = None,
        name_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        limit: int = -1,
        offset: int = 0,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
    ) -> PaginatedResult[Span]:
        """The spans of a rollout (``attempt_id``: ``None`` every attempt's, ``"latest"``, or an id).

        Raises:
            RolloutNotFoundError: Unknown rollout (also a ``rollout_id`` that is not a string).
            AttemptNotFoundError: Unknown attempt.
            InvalidTypeError: ``attempt_id`` or a filter is neither ``None`` nor a string.
            InvalidInputError: Bad paging, sort field or ``filter_logic``.
        """
        filters = {
            "trace_id": trace_id,
            "trace_id_contains": trace_id_contains,
            "span_id": span_id,
            "span_id_contains": span_id_contains,
            "parent_id": parent_id,
            "parent_id_contains": parent_id_contains,
            "name": name,
            "name_contains": name_contains,
        }
        _text_filters(attempt_id=attempt_id, **filters)
        return await (await self._reads()).query_spans(
            _rollout_id(rollout_id),
            attempt_id,
            **filters,
            filter_logic=filter_logic,
            limit=limit,
            offset=offset,
            sort_by=sort_by,
            sort_order=sort_order,
        )

    @store_call
    async def query_resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[ResourcesUpdate]:
        return await (await self._reads()).query_resources(
            resources_id=resources_id,
            resources_id_contains=resources_id_contains,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
        )

    @store_call
    async def query_workers(
        self,
        *,
        status_in: Sequence[str] | None = None,
        worker_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
        worker_id_in: Sequence[str] | None = None,
    ) -> PaginatedResult[Worker]:
        return await (await self._reads()).query_workers(
            status_in=status_in,
            worker_id_contains=worker_id_contains,
            filter_logic=filter_logic,
            sort_by=sort_by,
            sort_order=sort_order,
            limit=limit,
            offset=offset,
            worker_id_in=worker_id_in,
        )

    @store_call
    async def statistics(self) -> dict[str, Any]:
        """Counts of rollouts, attempts, spans, resources and workers, plus ``name`` and ``uptime``
        (seconds since this store object was made, as in Agent-lightning 0.3.0)."""
        counts = await (await self._reads()).statistics()
        return {"name": type(self).__name__, **counts, "uptime": time.monotonic() - self._created_monotonic}
