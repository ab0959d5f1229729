"""Waiting on the projection: ``sync`` (read-your-writes) and ``wait_for_rollouts``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import asyncpg
from nats.aio.client import Client as NATS

from eventlight.core.errors import RolloutNotFoundError, ServiceUnavailableError
from eventlight.core.types import (
    TERMINAL_ROLLOUT_STATUSES,
    Rollout,
)
from eventlight.store.finish import terminal_status
from eventlight.store.jetstream import pg, pg_errors
from eventlight.store.jetstream.layout import rollout_of_subject
from eventlight.store.jetstream.pg_errors import SERVER_FAILURES
from eventlight.store.jetstream.projector import Projector, ProjectorGroup
from eventlight.store.jetstream.readmodel.queries import SqlQueries

SYNC_TIMEOUT_S = 30.0
POLL_MIN_S = 0.005  # a waiter reading another process's checkpoint: first pause, doubled up to
POLL_MAX_S = 0.05
MAX_HINTS = 100_000
READ_AGAIN_S = 2.0
"""A ``wait_for_rollouts`` reads Postgres at least this often, whatever woke it or not (a fallback)."""
PROBE_POOL_WAIT_S = 0.25
"""How long ``postgres_down`` waits for a free pooled connection before it opens one of its own."""


class _Waiter:
    """A ``wait_for_rollouts`` call: the ids it still waits for; ``dirty`` once a projector commit
    in this process has put one of them in a terminal status (it then reads Postgres again)."""

    __slots__ = ("dirty", "ids")

    def __init__(self, ids: set[str]):
        self.ids = ids
        self.dirty = False


class Broadcast:
    """Wakes every waiter at each ``notify_all``, holding no lock.

    Not an ``asyncio.Condition``: on Python 3.11 a ``wait_for_rollouts`` cancelled at the wrong
    moment (a trainer stopping its algorithm) left the condition's lock held, and every later
    read-your-writes wait of the store deadlocked on it, past its own timeout.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify_all(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def wait(self, timeout_s: float) -> None:
        """Until the next ``notify_all`` or ``timeout_s`` seconds."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), max(0.0, timeout_s))

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Until ``predicate()`` holds after a ``notify_all`` (``True``), or ``timeout_s`` passes."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await self.wait(left)
        return True


class Waits(SqlQueries):
    """Read-your-writes (``sync``) and ``wait_for_rollouts``, woken by the local projector's commits
    and by terminal events on the stream."""

    nc: NATS
    prefix: str
    projector: Projector | ProjectorGroup | None
    _changed: Broadcast
    _hints: set[str]
    _waiters: list[_Waiter]
    _alone: asyncio.Task[str | None] | None

    async def _on_rollout_event(self, msg: Any) -> None:
        if terminal_status(msg.data) is not None:  # the rule subscribers share (``store.finish``)
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
        self._changed.notify_all()

    async def sync(self, seq: int, timeout_s: float = SYNC_TIMEOUT_S) -> None:
        """Wait until the projection includes stream sequence ``seq``.

        Raises:
            ServiceUnavailableError: The projector did not get there within ``timeout_s`` seconds.
        """
        target = seq
        if target == 0:
            return
        local = self.projector
        if local is not None and local.checkpoint >= target and local.leader.is_set():
            return  # the common case (this process projects, and is there): no clock, no wait
        deadline = time.monotonic() + timeout_s
        while True:  # in steps of at most a second: the local projector may lose or gain the lead
            step_end = min(deadline, time.monotonic() + 1.0)
            projector = self.projector
            if projector is not None and projector.leader.is_set():  # this process projects

                def reached(local: Any = projector) -> bool:
                    return bool(local.checkpoint >= target)

                await self._changed.wait_for(reached, max(0.0, step_end - time.monotonic()))
                if reached():
                    return
            elif await self._poll_checkpoint(target, step_end):  # another process projects (this one
                return  # has none, or a standby): read its checkpoint
            if time.monotonic() >= deadline:
                break
        why = await self.postgres_down()
        if why is not None:
            raise ServiceUnavailableError(
                "Postgres", f"the projection cannot reach stream sequence {target}: Postgres does not answer ({why})"
            )
        raise ServiceUnavailableError(
            "projector",
            f"the projection did not reach stream sequence {target} within {timeout_s:.0f} s; "
            "is a projector running for this namespace?",
        )

    async def _poll_checkpoint(self, target: int, until: float) -> bool:
        """Read the checkpoint until it reaches ``target`` (``True``) or ``until`` passes (``False``),
        holding a pooled connection only for each read, never while sleeping between them: waiters
        must not starve the projector, which needs a connection to commit (and this process's own
        projector may take the lead at any moment).

        Raises:
            ServiceUnavailableError: Postgres does not answer.
        """
        pause_s = POLL_MIN_S
        while True:
            try:
                async with self._conn() as conn:
                    last_seq = await conn.fetchval("SELECT min(last_seq) FROM projector_checkpoint")
            except ServiceUnavailableError as e:  # the cause is Postgres, not a missing projector
                raise ServiceUnavailableError("Postgres", f"waiting for stream sequence {target}: {e}") from e
            if last_seq >= target:
                return True
            left = until - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(pause_s, left))
            pause_s = min(pause_s * 2, POLL_MAX_S)

    async def postgres_down(self, timeout_s: float = 2.0) -> str | None:
        """Why Postgres does not answer, or ``None`` when it does: a connection must answer ``SELECT 1``
        within ``timeout_s`` seconds. It is one from the pool when the pool has one free within
        ``PROBE_POOL_WAIT_S`` (a quarter of ``timeout_s`` at most); else (every pooled connection
        busy, as under load) one opened for the probe alone and closed after it, so a busy Postgres
        is not called down; probes that find the pool busy at the same time share that one
        connection and its answer. A Postgres that answers that it has too many connections is busy,
        not down. Also what ``/v1/agl/health`` asks (``JetStreamLightningStore.dependencies_down``)."""
        waited_s = min(PROBE_POOL_WAIT_S, timeout_s / 4)
        try:
            conn = await self.pool.acquire(timeout=waited_s)
        except TimeoutError:  # every pooled connection is busy (or a new one is slow to open)
            return await self._probe_alone(timeout_s - waited_s, waited_s)
        except SERVER_FAILURES as e:
            return repr(e)
        try:
            await conn.fetchval("SELECT 1", timeout=timeout_s)
        except SERVER_FAILURES as e:
            return repr(e)
        finally:
            await self.pool.release(conn)
        return None

    async def _probe_alone(self, timeout_s: float, waited_s: float) -> str | None:
        """``_probe_own_connection``, shared by the probes that call it while it runs: each opened a
        connection of its own, so 30 health checks at once while the pool was saturated were 30 new
        connections to a Postgres already under load, up to "too many clients" for every process
        on it. A caller cancelled does not cancel it for the others; it closes its connection itself."""
        if self._alone is None or self._alone.done():
            self._alone = asyncio.ensure_future(self._probe_own_connection(timeout_s, waited_s))
        return await asyncio.shield(self._alone)

    async def _probe_own_connection(self, timeout_s: float, waited_s: float) -> str | None:
        """``postgres_down`` on a connection of its own (``self.server`` is the DSN), opened within
        ``timeout_s`` seconds, after ``waited_s`` seconds for a pooled one."""
        busy = f"no pooled connection free within {waited_s:g} s"
        try:
            conn = await pg_errors.connect(self.server, timeout_s=timeout_s)
        except ServiceUnavailableError as e:
            if isinstance(e.__cause__, asyncpg.TooManyConnectionsError):
                return None  # it answered: full, with every connection of ours busy
            return f"{busy}, and a new connection failed: {e.__cause__!r}"
        try:
            await conn.fetchval("SELECT 1", timeout=timeout_s)
        except SERVER_FAILURES as e:
            return f"{busy}, and a new connection did not answer: {e!r}"
        finally:
            with contextlib.suppress(Exception):
                await conn.close(timeout=timeout_s)
        return None

    async def wait_for_rollouts(self, rollout_ids: list[str], timeout: float | None) -> list[Rollout]:
        """The rollouts among ``rollout_ids`` in a terminal status, once all are or ``timeout`` passes.

        Reads Postgres once at the start (one query while none is finished), then only when this
        process's projector commits a terminal status for one of them (or every ``READ_AGAIN_S``), so
        a caller polling with short timeouts costs one query per call; with the projector elsewhere
        it follows the stream's terminal events (``SqlReadModel``).

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
                    step = READ_AGAIN_S
                    ready: Any = lambda: waiter.dirty  # noqa: E731
                else:  # a terminal event seen on the stream is being projected elsewhere: poll until it is
                    step = 0.02 if self._hints.intersection(waiter.ids) else READ_AGAIN_S
                    ready = None
                remaining = None if deadline is None else deadline - time.monotonic()
                wait = step if remaining is None else max(0.0, min(step, remaining))
                if ready is None:
                    await self._changed.wait(wait)
                else:
                    await self._changed.wait_for(ready, wait)
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
            rows = await conn.fetch(
                "SELECT rollout_id, status FROM rollouts WHERE rollout_id = ANY($1::text[])", pg.texts(ids)
            )
        status = {r[0]: r[1] for r in rows}
        for rid in ids:
            if rid not in status:
                raise RolloutNotFoundError(rid)
        finished = [rid for rid in ids if status[rid] in TERMINAL_ROLLOUT_STATUSES]
        if not finished:
            return {}
        done = await self.query_rollouts(rollout_id_in=finished, status_in=sorted(TERMINAL_ROLLOUT_STATUSES))
        return {r.rollout_id: r for r in done}
