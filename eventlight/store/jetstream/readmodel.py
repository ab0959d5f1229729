"""The Postgres read model: the projector's tables (``migrations/``) and the queries over them.

Reads first wait until the projector's checkpoint has passed the caller's last write
(``sync``: read-your-writes). ``wait_for_rollouts`` listens to the rollouts' terminal events on the
stream (``r.*.e``) and to the local projector's commits instead of polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import asyncpg
import msgspec
from nats.aio.client import Client as NATS

from eventlight.core.errors import AttemptNotFoundError, RolloutNotFoundError, ServiceUnavailableError
from eventlight.core.types import (
    TERMINAL_ROLLOUT_STATUSES,
    Attempt,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    Span,
    Worker,
)
from eventlight.store.jetstream import pg
from eventlight.store.jetstream.layout import rollout_of_subject
from eventlight.store.jetstream.nats_errors import nats_errors
from eventlight.store.jetstream.pg_errors import SERVER_FAILURES, pg_errors
from eventlight.store.jetstream.projector import Projector
from eventlight.store.query import check_paging, deprecated_alias

SYNC_TIMEOUT_S = 30.0
MAX_HINTS = 100_000


class _RolloutStatus(msgspec.Struct):
    status: str | None = None


class _StatusPeek(msgspec.Struct):
    """The rollout status an event carries, if any: ``AttemptStarted``/``AttemptUpdated``'s
    ``rollout_status``, ``RolloutUpdated``'s ``status``, ``RolloutCreated``'s ``rollout.status``;
    decoding only these fields skips the rest of the event (inputs, metadata)."""

    rollout_status: str | None = None
    status: str | None = None
    rollout: _RolloutStatus | None = None
    type: str = ""


_status_peek = msgspec.json.Decoder(_StatusPeek)


class _Waiter:
    """A ``wait_for_rollouts`` call: the ids it still waits for; ``dirty`` once a projector commit
    in this process has put one of them in a terminal status (it then reads Postgres again)."""

    __slots__ = ("dirty", "ids")

    def __init__(self, ids: set[str]):
        self.ids = ids
        self.dirty = False


class SqlReadModel:
    """Queries over one namespace's Postgres schema.

    Args:
        pool: Connections that use the namespace's schema.
        nc: The NATS connection (``wait_for_rollouts`` follows terminal events on the stream).
        prefix: The namespace's subject prefix (``el.<ns>``).
        projector: This process's projector, if it runs one (its commits wake waiters).
        server: The Postgres DSN, named (without its password) when the server fails.
    """

    def __init__(
        self, pool: asyncpg.Pool, nc: NATS, prefix: str, projector: Projector | None, server: str = "postgres"
    ):
        self.pool = pool
        self.server = server
        self.nc = nc
        self.prefix = prefix
        self.projector = projector
        self._changed = asyncio.Condition()
        self._hints: set[str] = set()
        self._waiters: list[_Waiter] = []
        self._watch_sub: Any = None

    @contextlib.asynccontextmanager
    async def _conn(self) -> AsyncIterator[asyncpg.Connection]:
        """A pooled connection; a server failure inside the block becomes ``ServiceUnavailableError``."""
        with pg_errors(self.server, "read-model query"):
            async with self.pool.acquire() as conn:
                yield conn

    async def start(self) -> None:
        """Follow terminal events (only ever published on a rollout's ``e`` subject: ``enters_queue``)."""
        with nats_errors(str(self.nc.connected_url or "nats"), "subscribing to terminal events"):
            self._watch_sub = await self.nc.subscribe(f"{self.prefix}.r.*.e", cb=self._on_rollout_event)

    async def close(self) -> None:
        """Stop following the stream; idempotent (the store closes the pool)."""
        sub, self._watch_sub = self._watch_sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _on_rollout_event(self, msg: Any) -> None:
        try:
            peek = _status_peek.decode(msg.data)
        except msgspec.DecodeError:
            return
        status = peek.rollout.status if peek.rollout is not None else (peek.rollout_status or peek.status)
        if status in TERMINAL_ROLLOUT_STATUSES:
            rid = rollout_of_subject(msg.subject)
            if len(self._hints) >= MAX_HINTS:  # hints of rollouts nobody waits for; they only speed up waits
                self._hints.clear()
            self._hints.add(rid)
            await self._notify()

    def _on_commit(self, last_seq: int, finished: set[str]) -> None:
        for waiter in self._waiters:
            if not waiter.dirty and not waiter.ids.isdisjoint(finished):
                waiter.dirty = True
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def sync(self, seq: int, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """Wait until the projection includes stream sequence ``seq``.

        Raises:
            ServiceUnavailableError: The projector did not get there within ``timeout_s`` seconds.
        """
        target = seq
        if target == 0:
            return
        deadline = time.monotonic() + timeout_s
        while True:  # in steps of at most a second: the local projector may lose or gain the lead
            step_end = min(deadline, time.monotonic() + 1.0)
            projector = self.projector
            if projector is not None and projector.leader.is_set():  # this process projects

                def reached(local: Any = projector) -> bool:
                    return bool(local.checkpoint >= target)

                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait_for(reached), max(0.0, step_end - time.monotonic()))
                if reached():
                    return
            else:  # another process projects (this one has none, or a standby): read its checkpoint
                try:
                    async with self._conn() as conn:
                        while time.monotonic() < step_end:
                            if await conn.fetchval("SELECT last_seq FROM projector_checkpoint") >= target:
                                return
                            await asyncio.sleep(0.005)
                except ServiceUnavailableError as e:  # the cause is Postgres, not a missing projector
                    raise ServiceUnavailableError("Postgres", f"waiting for stream sequence {target}: {e}") from e
            if time.monotonic() >= deadline:
                break
        why = await self._postgres_down()
        if why is not None:
            raise ServiceUnavailableError(
                "Postgres", f"the projection cannot reach stream sequence {target}: Postgres does not answer ({why})"
            )
        raise ServiceUnavailableError(
            "projector",
            f"the projection did not reach stream sequence {target} within {timeout_s:.0f} s; "
            "is a projector running for this namespace?",
        )

    async def _postgres_down(self) -> str | None:
        """Why Postgres does not answer, or ``None`` when it does (the projector is the one missing)."""
        try:
            async with self.pool.acquire(timeout=2) as conn:
                await conn.fetchval("SELECT 1", timeout=2)
        except SERVER_FAILURES as e:
            return repr(e)
        return None

    async def wait_for_rollouts(self, rollout_ids: list[str], timeout: float | None) -> list[Rollout]:
        """The rollouts among ``rollout_ids`` in a terminal status, once all are or ``timeout`` passes.

        Reads Postgres once at the start (one query while none is finished), then only when this
        process's projector commits a terminal status for one of them (or every 2 s), so a caller
        polling with short timeouts costs one query per call; with the projector elsewhere it
        follows the stream's terminal events (see the class docstring).

        Raises:
            RolloutNotFoundError: An id is unknown.
        """
        ids = list(dict.fromkeys(rollout_ids))
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        waiter = _Waiter(set(ids))
        self._waiters.append(waiter)
        try:
            by_id = await self._finished_among(ids)
            while True:
                if len(by_id) == len(ids) or (deadline is not None and time.monotonic() >= deadline):
                    return [by_id[r] for r in rollout_ids if r in by_id]
                waiter.ids.difference_update(by_id)
                self._hints.difference_update(by_id)
                local = self.projector is not None and self.projector.leader.is_set()
                if local:  # this process projects: its commits say when one of ours has finished (2 s: a fallback)
                    step = 2.0
                    ready: Any = lambda: waiter.dirty  # noqa: E731
                else:  # a terminal event seen on the stream is being projected elsewhere: poll until it is
                    step = 0.02 if self._hints.intersection(waiter.ids) else 2.0
                    ready = None
                remaining = None if deadline is None else deadline - time.monotonic()
                wait = step if remaining is None else max(0.0, min(step, remaining))
                async with self._changed:
                    with contextlib.suppress(TimeoutError):
                        if ready is None:
                            await asyncio.wait_for(self._changed.wait(), wait)
                        else:
                            await asyncio.wait_for(self._changed.wait_for(ready), wait)
                if local and not waiter.dirty and wait < step:
                    continue  # the deadline came and no commit finished one of ours: nothing new to read
                waiter.dirty = False
                done = await self.query_rollouts(rollout_id_in=ids, status_in=sorted(TERMINAL_ROLLOUT_STATUSES))
                by_id = {r.rollout_id: r for r in done}
        finally:
            self._waiters.remove(waiter)

    async def _finished_among(self, ids: list[str]) -> dict[str, Rollout]:
        """The rollouts among ``ids`` in a terminal status, by id (the others' rows are not loaded).

        Raises:
            RolloutNotFoundError: An id is unknown.
        """
        async with self._conn() as conn:
            rows = await conn.fetch("SELECT rollout_id, status FROM rollouts WHERE rollout_id = ANY($1::text[])", ids)
        status = {r[0]: r[1] for r in rows}
        for rid in ids:
            if rid not in status:
                raise RolloutNotFoundError(rid)
        finished = [rid for rid in ids if status[rid] in TERMINAL_ROLLOUT_STATUSES]
        if not finished:
            return {}
        done = await self.query_rollouts(rollout_id_in=finished, status_in=sorted(TERMINAL_ROLLOUT_STATUSES))
        return {r.rollout_id: r for r in done}

    async def _attempt_map(self, conn: asyncpg.Connection, rollouts: list[Rollout]) -> dict[str, Attempt]:
        ids = [r.rollout_id for r in rollouts]
        rows = await conn.fetch(
            f"SELECT {pg.ATTEMPT_COLS} FROM attempts a WHERE (a.rollout_id, a.attempt_id) IN "
            "(SELECT rollout_id, latest_attempt_id FROM rollouts WHERE rollout_id = ANY($1::text[]))",
            ids,
        )
        return {row[0]: pg.attempt_from_row(row) for row in rows}

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
                rows = await pg.fetch_rows(conn, "rollouts", pg.ROLLOUT_COLS, w, filter_logic, tail)
                total = await conn.fetchval(
                    "SELECT coalesce(sum(n), 0) FROM rollout_status_counts"
                    + ("" if status_in is None else " WHERE status = ANY($1::text[])"),
                    *([] if status_in is None else [list(status_in)]),
                )
                total = int(total)
            else:
                rows, total = await pg.fetch_page(
                    conn, "rollouts", pg.ROLLOUT_COLS, w, filter_logic, tail, n, limit, offset
                )
            items = [pg.rollout_from_row(r) for r in rows]
            attempts = await self._attempt_map(conn, items)
        return pg.paginated([pg.attach(r, attempts.get(r.rollout_id)) for r in items], limit, offset, total)

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        page = await self.query_rollouts(rollout_id_in=[rollout_id])
        return page[0] if page else None

    async def _require_rollout(self, conn: asyncpg.Connection, rollout_id: str) -> asyncpg.Record:
        row = await conn.fetchrow("SELECT latest_attempt_id FROM rollouts WHERE rollout_id = $1", rollout_id)
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
            await self._require_rollout(conn, rollout_id)
            rows, total = await pg.fetch_page(conn, "attempts", pg.ATTEMPT_COLS, w, "and", tail, 1, limit, offset)
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
        async with self._conn() as conn:
            row = await self._require_rollout(conn, rollout_id)
            w = pg.Where()
            w.exact("rollout_id", rollout_id, must=True)
            if attempt_id == "latest":
                if row[0] is None:
                    return PaginatedResult([], limit=limit, offset=offset, total=0)
                w.exact("attempt_id", row[0], must=True)
            elif attempt_id is not None:
                exists = await conn.fetchval(
                    "SELECT 1 FROM attempts WHERE rollout_id = $1 AND attempt_id = $2", rollout_id, attempt_id
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
            rows, total = await pg.fetch_page(conn, "spans", pg.SPAN_COLS, w, filter_logic, tail, n, limit, offset)
        return pg.paginated([pg.span_from_row(r) for r in rows], limit, offset, total)

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
        tail = pg.order_page(Worker, w, sort_by, sort_order, limit, offset, "created_seq NULLS FIRST, worker_id")
        async with self._conn() as conn:
            rows, total = await pg.fetch_page(conn, "workers", pg.WORKER_COLS, w, filter_logic, tail, n, limit, offset)
        return pg.paginated([pg.worker_from_row(r) for r in rows], limit, offset, total)

    async def statistics(self) -> dict[str, Any]:
        async with self._conn() as conn:
            row = await conn.fetchrow(
                "SELECT (SELECT count(*) FROM rollouts), (SELECT count(*) FROM attempts), "
                "(SELECT count(*) FROM spans), (SELECT count(*) FROM resources), (SELECT count(*) FROM workers), "
                "(SELECT last_seq FROM projector_checkpoint)"
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
