"""Retirement: terminal rollouts past the retention window leave the hot stream (issue 14).

The hot stream ``EL_<NS>`` needs a subject per rollout (its appends fence on ``r.<rid>.>``) and
nats-server keeps state for every subject it holds, so it should hold what is live. With
``Settings.retention_s`` set, JetStream sources every event into the archive stream
(``archive``); ``retire`` then, per batch:

1. takes the position ``bound`` that the archive (its last sourced position), the live
   projection (its checkpoint) and every subscriber (``subscriber_floors``) have passed; while the
   archive is more than ``ARCHIVE_LAG_MAX`` messages behind the hot stream it retires nothing
   (on nats-server 2.15.1 a purge costs in proportion to the messages a consumer of the stream has
   not been handed yet: 0.4 ms with the archive caught up, 80-100 ms with 100,000 behind);
2. selects, from the read model, rollouts in a terminal status that ended more than
   ``retention_s`` ago, whose last state event is at or below ``bound``, not yet marked
   ``retired`` (set with their ``retired_rollouts`` row, step 5), that the watchdog no longer
   watches (no attempt still ``preparing``/``running`` under a ``RolloutConfig`` limit:
   ``eventlight.store.fold.watched``);
3. appends their ids to the archive's ledger (so a late write finds them: ``RolloutRetiredError``);
4. purges ``r.<rid>.>`` and ``s.<rid>.>`` from the hot stream below ``bound + 1`` (a message that
   came after stays: nothing unarchived is ever purged);
5. lists them in ``retired_rollouts`` and marks them ``retired`` in ``rollouts``, in one transaction
   (migration 015's partial index holds the terminal rollouts not yet ``retired``: step 2 reads
   those, not the whole history), locking the rows in ``rollout_id`` order, as the projector writes
   them: the two never deadlock.

Each step can be repeated: a retirement cut short is finished by the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from eventlight.core.errors import InvalidInputError
from eventlight.core.types import TERMINAL_ROLLOUT_STATUSES
from eventlight.settings import Settings
from eventlight.store.jetstream.archive import archive_head, archive_lag, archived_until
from eventlight.store.jetstream.definitions import consumer_config
from eventlight.store.jetstream.log import JetStreamEventLog
from eventlight.store.jetstream.nats_errors import nats_errors

log = logging.getLogger(__name__)

BATCH = 500
"""Rollouts per ledger entry."""

ARCHIVE_LAG_MAX = 10_000
"""Messages the archive may be behind the hot stream for a retirement round to purge (see step 1)."""

PURGES_IN_FLIGHT = 16
"""Purge requests a retirement keeps in flight (pipelined: one at a time is bound by the round trip)."""

_TERMINAL = ", ".join(f"'{s}'" for s in sorted(TERMINAL_ROLLOUT_STATUSES))

_SELECT = f"""
SELECT r.rollout_id FROM rollouts r
 WHERE r.status IN ({_TERMINAL}) AND NOT r.retired AND r.last_seq <= $2
   AND r.end_time IS NOT NULL AND r.end_time < $1
   AND NOT (
     (r.config->>'timeout_seconds' IS NOT NULL OR r.config->>'unresponsive_seconds' IS NOT NULL)
     AND EXISTS (SELECT 1 FROM attempts a WHERE a.rollout_id = r.rollout_id
                   AND a.status IN ('preparing', 'running')))
 ORDER BY r.last_seq LIMIT $3
"""
"""What is due, oldest log position first. ``status IN (...) AND NOT retired`` is the predicate of
migration 015's ``rollouts_retirable_idx`` (written out, not a parameter, so the planner can use it):
the scan walks only terminal rollouts not yet retired, in ``last_seq`` order, and stops at the
``LIMIT``; the rollouts retired long ago are not read. ``retired`` is set with the rollout's
``retired_rollouts`` row (``_LIST``).

Not a rollout the watchdog still watches (``eventlight.store.fold.watched``: an attempt
live, a limit set): its appends fence on ``r.<rid>.>``, so once purged the watchdog could never mark
that attempt and would keep the rollout in its set for ever. It retires after the watchdog marked it."""

_LIST = (
    "INSERT INTO retired_rollouts (rollout_id, retired_at, purged_below_seq)"
    " SELECT rid, $2, $3 FROM unnest($1::text[]) rid ON CONFLICT (rollout_id) DO NOTHING"
)
_FLAG = (
    "UPDATE rollouts r SET retired = true FROM ("
    "SELECT rollout_id FROM rollouts WHERE rollout_id = ANY($1::text[]) AND NOT retired"
    ' ORDER BY rollout_id COLLATE "C" FOR UPDATE) due WHERE r.rollout_id = due.rollout_id'
)
"""Marks the rollouts ``retired``, locking their rows in one order whatever the plan: by ``rollout_id``
in byte order (``COLLATE "C"``, Python's ``sorted`` of ``str``), the order in which the projector
writes rollouts (``projector.batch``), so the two never wait on each other in a cycle (a deadlock,
which Postgres would break by failing one of them)."""


class RetireReport(msgspec.Struct, kw_only=True):
    """What one ``retire`` did: rollouts retired, below which log position, how long it took."""

    retired: int = 0
    bound: int = 0
    seconds: float = 0.0
    archive_lag: int = 0
    """Messages the archive was behind the hot stream when the round began."""


async def retire(
    log_: JetStreamEventLog, pg: Any, settings: Settings, *, now: float, limit: int | None = None
) -> RetireReport:
    """Retire what is due (see the module docstring); returns what it did.

    Args:
        log_: The namespace's event log.
        pg: An asyncpg pool or connection on the namespace's schema.
        settings: ``retention_s`` must be set.
        now: Seconds since the epoch (the clock is passed in).
        limit: At most this many rollouts (default: all that are due).

    Raises:
        InvalidInputError: ``settings.retention_s`` is not set, or the namespace has no archive.
        ServiceUnavailableError: NATS or Postgres failed.
    """
    import time

    t0 = time.perf_counter()
    if settings.retention_s is None:
        raise InvalidInputError("retirement is off: set Settings.retention_s (EVENTLIGHT_RETENTION_S)")
    if await archive_head(log_) is None:
        raise InvalidInputError(f"namespace {settings.namespace} has no archive stream: apply_streams with retention_s")
    checkpoint = int(await pg.fetchval("SELECT min(last_seq) FROM projector_checkpoint") or 0)
    archived = await archived_until(log_)
    bound = min(archived, checkpoint)
    lag = await archive_lag(log_)
    if lag > ARCHIVE_LAG_MAX:
        log.info(
            "retirement waits for the archive to catch up (%d messages behind the hot stream, more than %d): "
            "purges while it is behind are slow",
            lag,
            ARCHIVE_LAG_MAX,
        )
        return RetireReport(bound=bound, archive_lag=lag, seconds=time.perf_counter() - t0)
    behind = await subscriber_floors(log_)
    if behind and min(behind.values()) < bound:
        bound = min(behind.values())
        log.info(
            "retirement waits for subscribers %s (acknowledged up to log position %d); delete a durable "
            "subscription that is no longer used, or it holds retirement back",
            ", ".join(sorted(k for k, v in behind.items() if v <= bound)),
            bound,
        )
    report = RetireReport(bound=bound, archive_lag=lag)
    while limit is None or report.retired < limit:
        take = BATCH if limit is None else min(BATCH, limit - report.retired)
        ids = await _due(pg, now - settings.retention_s, bound, take)
        if not ids:
            break
        await log_.retired.record(ids, now)
        await _purge_all(log_, ids, bound)
        await _list_retired(pg, ids, now, bound)
        report.retired += len(ids)
        log.info("retired %d rollouts below log position %d (%s ...)", len(ids), bound + 1, ids[0])
    report.seconds = time.perf_counter() - t0
    return report


@contextlib.asynccontextmanager
async def _connection(pg: Any) -> AsyncIterator[Any]:
    """``pg`` itself when it is a connection, else one of the pool's."""
    if hasattr(pg, "acquire"):
        async with pg.acquire() as conn:
            yield conn
    else:
        yield pg


async def _list_retired(pg: Any, rollout_ids: list[str], now: float, bound: int) -> None:
    """Step 5: list ``rollout_ids`` in ``retired_rollouts`` (purged below ``bound + 1``, at ``now``)
    and mark them ``retired``, in one transaction, their rows locked in ``rollout_id`` order (``_FLAG``)."""
    ordered = sorted(rollout_ids)
    async with _connection(pg) as conn, conn.transaction():
        await conn.execute(_LIST, ordered, now, bound + 1)
        await conn.execute(_FLAG, ordered)


async def _due(pg: Any, ended_before: float, bound: int, limit: int) -> list[str]:
    """``_SELECT``'s ids, with JIT off: compiling the plan cost more than running it (1.3-1.5 s of a
    7.4 s round on 800k retired rollouts before migration 015; a round now reads a few hundred rows)."""
    async with _connection(pg) as conn, conn.transaction():
        await conn.execute("SET LOCAL jit = off")
        rows = await conn.fetch(_SELECT, ended_before, bound, limit)
    return [str(r["rollout_id"]) for r in rows]


async def subscriber_floors(log_: JetStreamEventLog) -> dict[str, int]:
    """Each subscriber consumer's position (``store.subscribe_*``, durable or live ephemeral): the
    log position up to which it has acknowledged, or where it started when it has acknowledged
    nothing yet. Retirement stays at or below the lowest, so a subscriber that is behind (or down,
    with a durable name) still finds its records in the hot stream when it resumes.

    Raises:
        ServiceUnavailableError: NATS failed.
    """
    template = consumer_config("subscriber", log_.settings.namespace)
    with nats_errors(log_.server, "listing the subscribers' consumers"):
        infos = await log_.js.consumers_info(log_.stream)
    floors: dict[str, int] = {}
    for info in infos:
        cfg = info.config
        if cfg.filter_subject != template.filter_subject or cfg.ack_policy != template.ack_policy:
            continue  # the projector's and the queue's consumers
        acked = int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0
        floors[str(cfg.name or cfg.durable_name)] = max(acked, int(cfg.opt_start_seq or 1) - 1)
    return floors


async def _purge_all(log_: JetStreamEventLog, rollout_ids: list[str], bound: int) -> None:
    """Purge each rollout's ``r.`` and ``s.`` subjects below ``bound + 1``, ``PURGES_IN_FLIGHT`` at a time;
    the first failure is raised once the requests in flight are done (a rollout not yet listed in
    ``retired_rollouts`` is selected, recorded and purged again by the next retirement)."""
    subjects = [f"{log_.prefix}.{kind}.{rid}.>" for rid in rollout_ids for kind in ("r", "s")]
    for i in range(0, len(subjects), PURGES_IN_FLIGHT):
        results = await asyncio.gather(
            *(_purge(log_, subject, bound) for subject in subjects[i : i + PURGES_IN_FLIGHT]), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result


async def _purge(log_: JetStreamEventLog, subject: str, bound: int) -> None:
    with nats_errors(log_.server, f"purging {subject}"):
        await log_.js.purge_stream(log_.stream, seq=bound + 1, subject=subject)
