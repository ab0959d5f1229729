"""The read model's queries over the projector's tables (``migrations/``)."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal

import asyncpg

from eventlight.core.errors import AttemptNotFoundError, RolloutNotFoundError
from eventlight.core.types import (
    Attempt,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    Span,
    Worker,
)
from eventlight.store.jetstream import pg
from eventlight.store.jetstream.pg_errors import pg_errors
from eventlight.store.query import check_paging, deprecated_alias

ATTEMPT_ORDER = (
    "SELECT a.sequence_id FROM attempts a WHERE a.rollout_id = spans.rollout_id AND a.attempt_id = spans.attempt_id"
)
"""The sequence number of a span's attempt: ``query_spans`` over several attempts sorts by it first."""

ALL_SPANS = f"SELECT {pg.SPAN_JSON_COLS} FROM spans WHERE rollout_id = $1 ORDER BY sequence_id, stream_seq"
ALL_SPANS_OF_LATEST = (
    f"SELECT {pg.SPAN_JSON_COLS} FROM spans WHERE rollout_id = $1"
    " AND attempt_id = (SELECT latest_attempt_id FROM rollouts WHERE rollout_id = $1) ORDER BY sequence_id, stream_seq"
)
"""``query_spans``' common call (``SqlQueries._all_spans``): a rollout's spans (of its latest attempt)."""

LATEST_ATTEMPT = (
    "(SELECT ROW(" + ", ".join("a." + col.strip() for col in pg.ATTEMPT_COLS.split(",")) + ") FROM attempts a"
    " WHERE a.rollout_id = rollouts.rollout_id AND a.attempt_id = rollouts.latest_attempt_id)"
)
"""A rollout's latest attempt as one record column (``ATTEMPT_COLS``, ``NULL`` when it has none):
``query_rollouts`` reads rollouts and their latest attempts in one round trip."""

ROLLOUT_WITH_LATEST_COLS = f"{pg.ROLLOUT_COLS}, {LATEST_ATTEMPT}"
LATEST_ATTEMPT_AT = len(pg.ROLLOUT_COLS.split(","))
"""The index of the latest-attempt record in a row of ``ROLLOUT_WITH_LATEST_COLS``."""


def _latest_attempt(row: asyncpg.Record) -> Attempt | None:
    record = row[LATEST_ATTEMPT_AT]
    return None if record is None else pg.attempt_from_row(record)


class _Pooled:
    """``async with``: a connection of ``pool``, given back at the end; a server failure inside the
    block (the acquire and the release included) becomes ``ServiceUnavailableError``
    (``pg_errors``). A plain class, not a ``contextlib.asynccontextmanager`` generator: every
    read-model query enters one (about 5 us less CPU a query)."""

    __slots__ = ("_acquire", "_errors")

    def __init__(self, pool: asyncpg.Pool, server: str):
        self._errors = pg_errors(server, "read-model query")
        self._acquire = pool.acquire()

    async def __aenter__(self) -> asyncpg.Connection:
        with self._errors:
            conn: asyncpg.Connection = await self._acquire.__aenter__()
        return conn

    async def __aexit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        with self._errors:
            await self._acquire.__aexit__(kind, e, tb)
        return self._errors.__exit__(kind, e, tb)  # raises a server failure of the block as ours


class SqlQueries:
    """The queries over the projector's tables, each on one pooled connection."""

    pool: asyncpg.Pool
    server: str

    def _conn(self) -> _Pooled:
        """A pooled connection; a server failure inside the block becomes ``ServiceUnavailableError``."""
        return _Pooled(self.pool, self.server)

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
        status_in = deprecated_alias(status_in, status, "status_in", "status")
        rollout_id_in = deprecated_alias(rollout_id_in, rollout_ids, "rollout_id_in", "rollout_ids")
        w = pg.Where()
        w.within("status", status_in)
        w.within("rollout_id", rollout_id_in)
        w.contains("rollout_id", rollout_id_contains)
        n = len(w.args)
        check_paging(limit, offset, sort_order, filter_logic)
        tail = pg.order_page(Rollout, w, sort_by, sort_order, limit, offset, "created_seq")
        async with self._conn() as conn:
            if rollout_id_in is None and rollout_id_contains is None:
                # all rollouts, or a status filter: the total comes from the trigger-kept counts
                # (migrations/002), so a page costs the same on 10^2 or 10^6 rollouts
                rows = await pg.fetch_rows(conn, "rollouts", ROLLOUT_WITH_LATEST_COLS, w, filter_logic, tail)
                total = await conn.fetchval(
                    "SELECT coalesce(sum(n), 0) FROM rollout_status_counts"
                    + ("" if status_in is None else " WHERE status = ANY($1::text[])"),
                    *([] if status_in is None else [pg.texts(list(status_in))]),
                )
                total = int(total)
            else:
                rows, total = await pg.fetch_page(
                    conn, "rollouts", ROLLOUT_WITH_LATEST_COLS, w, filter_logic, tail, n, limit, offset
                )
        items = [pg.attach(pg.rollout_from_row(r), _latest_attempt(r)) for r in rows]
        return pg.paginated(items, limit, offset, total)

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        page = await self.query_rollouts(rollout_id_in=[rollout_id])
        return page[0] if page else None

    async def _require_rollout(self, conn: asyncpg.Connection, rollout_id: str) -> asyncpg.Record:
        row = await conn.fetchrow("SELECT latest_attempt_id FROM rollouts WHERE rollout_id = $1", pg.text(rollout_id))
        if row is None:
            raise RolloutNotFoundError(rollout_id)
        return row

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Attempt]:
        w = pg.Where()
        w.exact("rollout_id", rollout_id, must=True)
        tail = pg.order_page(Attempt, w, sort_by, sort_order, limit, offset, "sequence_id")
        async with self._conn() as conn:
            rows, total = await pg.fetch_page(conn, "attempts", pg.ATTEMPT_COLS, w, "and", tail, 1, limit, offset)
            if not rows:  # rows name their rollout; none: an empty page, or an unknown rollout
                await self._require_rollout(conn, rollout_id)
        return pg.paginated([pg.attempt_from_row(r) for r in rows], limit, offset, total)

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        page = await self.query_attempts(rollout_id, sort_order="desc", limit=1)
        return page[0] if page else None

    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | None,
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
        check_paging(limit, offset, sort_order, filter_logic)
        several = False
        if (
            attempt_id in (None, "latest")
            and limit == -1
            and offset == 0
            and sort_by == "sequence_id"
            and sort_order == "asc"
            and trace_id is trace_id_contains is span_id is span_id_contains is None
            and parent_id is parent_id_contains is name is name_contains is None
        ):
            spans, several = await self._all_spans(rollout_id, latest=attempt_id == "latest")
            if spans is not None:
                return pg.paginated(spans, -1, 0, len(spans))
        async with self._conn() as conn:
            w = pg.Where()
            w.exact("rollout_id", rollout_id, must=True)  # $1
            if attempt_id == "latest":  # in the same query: no round trip for the rollout's row first
                w.must.append("attempt_id = (SELECT latest_attempt_id FROM rollouts WHERE rollout_id = $1)")
            elif attempt_id is not None:
                await self._require_rollout(conn, rollout_id)
                exists = await conn.fetchval(
                    "SELECT 1 FROM attempts WHERE rollout_id = $1 AND attempt_id = $2",
                    pg.text(rollout_id),
                    pg.text(attempt_id),
                )
                if not exists:
                    raise AttemptNotFoundError(rollout_id, attempt_id)
                w.exact("attempt_id", attempt_id, must=True)
            for col, value in (
                ("trace_id", trace_id),
                ("span_id", span_id),
                ("parent_id", parent_id),
                ("name", name),
            ):
                w.exact(col, value)
            for col, needle in (
                ("trace_id", trace_id_contains),
                ("span_id", span_id_contains),
                ("parent_id", parent_id_contains),
                ("name", name_contains),
            ):
                w.contains(col, needle)
            n = len(w.args)
            tail = pg.order_page(Span, w, sort_by, sort_order, limit, offset, "sequence_id, stream_seq")
            by_attempt = sort_by == "sequence_id" and attempt_id is None  # as 0.3.0's per-rollout ids
            ordered = tail
            if by_attempt:
                direction = "DESC" if sort_order == "desc" else "ASC"
                ordered = tail.replace("ORDER BY ", f"ORDER BY ({ATTEMPT_ORDER}) {direction}, ", 1)
            if by_attempt and limit == -1 and offset == 0:
                # All of them: the spans of one attempt (most rollouts) are in order without the
                # per-row lookup of their attempt and the sort on it (half of Postgres' time);
                # spans of several attempts are read again in attempt order (at once when
                # ``_all_spans`` found several).
                rows: list[asyncpg.Record] = []
                if not several:
                    rows, total = await pg.fetch_page(conn, "spans", pg.SPAN_COLS, w, filter_logic, tail, n, -1, 0)
                if several or len({row[1] for row in rows}) > 1:
                    rows, total = await pg.fetch_page(conn, "spans", pg.SPAN_COLS, w, filter_logic, ordered, n, -1, 0)
            else:
                cols = pg.SPAN_COLS
                rows, total = await pg.fetch_page(conn, "spans", cols, w, filter_logic, ordered, n, limit, offset)
            if not rows and attempt_id in (None, "latest"):
                await self._require_rollout(conn, rollout_id)  # no rows: an empty page, or an unknown rollout
        return pg.paginated([pg.span_from_row(r) for r in rows], limit, offset, total)

    async def _all_spans(self, rollout_id: str, *, latest: bool) -> tuple[list[Span] | None, bool]:
        """All spans of a rollout (or of its latest attempt) by ``sequence_id``, for the common call
        with no filter and no paging: one query in the index's order, each row one JSON object
        decoded into a ``Span`` in one pass (``pg.SPAN_JSON_COLS``). Returns ``(spans, False)``, or
        ``(None, several)`` for ``query_spans``' general path: ``several`` when the rows hold
        several attempts (read again in attempt order), else when msgspec refused a row.

        Raises:
            RolloutNotFoundError: No rows, and no such rollout.
        """
        sql = ALL_SPANS_OF_LATEST if latest else ALL_SPANS
        async with self._conn() as conn:
            rows = await conn.fetch(sql, pg.text(rollout_id))
            if not rows:
                await self._require_rollout(conn, rollout_id)  # an empty rollout, or an unknown one
                return [], False
        if not latest and len({row[1] for row in rows}) > 1:
            return None, True
        return pg.spans_from_json_rows(rows), False

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
        w = pg.Where()
        w.exact("resources_id", resources_id, must=True)
        w.contains("resources_id", resources_id_contains)
        n = len(w.args)
        tail = pg.order_page(ResourcesUpdate, w, sort_by, sort_order, limit, offset, "created_seq")
        cols = "resources_id, create_time, update_time, version, resources::text"
        async with self._conn() as conn:
            rows, total = await pg.fetch_page(conn, "resources", cols, w, "and", tail, n, limit, offset)
        return pg.paginated([pg.resources_from_row(r) for r in rows], limit, offset, total)

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
        check_paging(limit, offset, sort_order, filter_logic)
        w = pg.Where()
        w.within("worker_id", worker_id_in, must=True)
        w.within("status", status_in)
        w.contains("worker_id", worker_id_contains)
        n = len(w.args)
        tail = pg.order_page(
            Worker, w, sort_by, sort_order, limit, offset, 'created_seq NULLS FIRST, worker_id COLLATE "C"'
        )
        async with self._conn() as conn:
            rows, total = await pg.fetch_page(conn, "workers", pg.WORKER_COLS, w, filter_logic, tail, n, limit, offset)
        return pg.paginated([pg.worker_from_row(r) for r in rows], limit, offset, total)

    async def statistics(self) -> dict[str, Any]:
        async with self._conn() as conn:
            row = await conn.fetchrow(
                "SELECT (SELECT count(*) FROM rollouts), (SELECT count(*) FROM attempts), "
                "(SELECT count(*) FROM spans), (SELECT count(*) FROM resources), (SELECT count(*) FROM workers), "
                "(SELECT min(last_seq) FROM projector_checkpoint)"
            )
        keys = (
            "total_rollouts",
            "total_attempts",
            "total_spans",
            "total_resources",
            "total_workers",
            "projected_seq",
        )
        return dict(zip(keys, row, strict=True))
