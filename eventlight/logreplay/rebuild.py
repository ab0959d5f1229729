"""``eventlight replay --rebuild``: the whole log into a fresh schema, compared, swapped in on request.

The fresh schema (``<schema>_rebuild``) gets the migrations and then the whole log, folded by the
projector's own code (``Projector.rebuild``: no consumer, no leader lock, no watchdog). Each
read-model table is then compared with the live one by row count and a checksum (md5 over the
sorted md5s of the rows' text), so a difference is found without moving the rows to the client.
``--swap`` renames the live schema to ``<schema>_replaced_<unix seconds>`` (the next free second
when a swap of the same second already took the name) and the rebuilt one to the live name in one
transaction, only while no projector of the namespace holds its advisory lock (a running one would
go on writing into the swapped-in schema from its own checkpoint).

One rebuild of a schema runs at a time: it holds the advisory lock ``(hashtext('eventlight_rebuild'),
hashtext(<schema>))`` from the drop of ``<schema>_rebuild`` to the end of the swap; a second one
is refused at once (it would drop and refill the first one's schema under it).
"""

from __future__ import annotations

import time
import zlib
from typing import Any

import msgspec

from eventlight.core.errors import InvalidInputError
from eventlight.settings import Settings

TABLES = ("rollouts", "attempts", "spans", "resources", "workers", "rollout_status_counts")
"""The read-model tables compared (``rollout_status_counts``: its rows with ``n <> 0``; a status a
rollout passed through inside one batch never gets a row, so rows at 0 depend on batching)."""

NOT_FOLDED = {"rollouts": ("retired",)}
"""Columns of the read-model tables that are not a fold of the log, left out of the comparison:
``rollouts.retired`` is set by ``retire`` with the rollout's ``retired_rollouts`` row (migration
015). A rebuilt schema has it false everywhere and ``retired_rollouts`` empty, as the two agree
(a later ``retire`` lists the rollouts again; purging twice removes nothing more)."""

NO_WATCHDOG_S = 3600.0

_REBUILD_LOCK = "eventlight_rebuild"
"""First key of the two-key advisory lock a rebuild holds (the second: ``hashtext(<schema>)``)."""


class TableDiff(msgspec.Struct, frozen=True):
    table: str
    live_rows: int
    rebuilt_rows: int
    live_sum: str
    rebuilt_sum: str

    @property
    def same(self) -> bool:
        return self.live_rows == self.rebuilt_rows and self.live_sum == self.rebuilt_sum


class RebuildReport(msgspec.Struct, kw_only=True):
    schema: str
    live_checkpoint: int
    rebuilt_checkpoint: int
    seconds: float
    tables: list[TableDiff]
    swapped_out: str | None = None

    @property
    def same(self) -> bool:
        return all(t.same for t in self.tables)


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def table_sums(conn: Any, schema: str) -> dict[str, tuple[int, str]]:
    """``table -> (row count, checksum)`` of a schema's read-model tables."""
    out: dict[str, tuple[int, str]] = {}
    for name in TABLES:
        where = " WHERE t.n <> 0" if name == "rollout_status_counts" else ""
        text = "".join(f" - '{c}'" for c in NOT_FOLDED.get(name, ()))
        text = f"(to_jsonb(t){text})::text" if text else "t::text"
        row = await conn.fetchrow(
            f"SELECT count(*) AS n, coalesce(md5(string_agg(md5({text}), ',' ORDER BY md5({text}))), '') AS sum"
            f" FROM {_q(schema)}.{_q(name)} t{where}"
        )
        out[name] = (int(row["n"]), str(row["sum"]))
    return out


async def rebuild(settings: Settings, pg_dsn: str | None = None, *, swap: bool = False) -> RebuildReport:
    """Rebuild the namespace's read models from its log into ``<schema>_rebuild`` and compare.

    Args:
        settings: The namespace, on ``settings.nats_url``, else on the embedded servers under
            ``settings.state_dir`` (``eventlight.logreplay.servers``: as the commands find them;
            none is started).
        pg_dsn: The Postgres holding the live schema; default ``settings.pg_dsn``, else the
            embedded one.
        swap: Put the rebuilt schema in place of the live one afterwards.

    Raises:
        InvalidInputError: ``swap`` while a projector of the namespace runs, or another rebuild of
            the namespace is running, or the namespace has no stream.
        ServiceUnavailableError: NATS or Postgres cannot be reached, or one is not set and no
            embedded server runs, or Postgres took no connection within ``settings.pg_open_wait_s``
            seconds (``EVENTLIGHT_PG_OPEN_WAIT_S``; meanwhile one warning line a try).
    """
    from eventlight.logreplay.servers import log_of, pg_dsn_of

    dsn = await pg_dsn_of(settings, pg_dsn)
    async with log_of(settings, "eventlight-rebuild", time.time) as log_:  # the stream exists: then Postgres
        return await _rebuild(log_, settings.pg_schema, dsn, swap, settings.pg_open_wait_s)


async def _rebuild(log_: Any, live: str, pg_dsn: str, swap: bool, open_wait_s: float) -> RebuildReport:
    """``rebuild`` from the namespace's event log ``log_``, of the live schema ``live``; each
    opening (connection, migrations, pool) waits up to ``open_wait_s`` seconds while Postgres
    takes no connection now (``open_waiting``)."""
    from eventlight.ops import apply_migrations
    from eventlight.store.jetstream import pg, pg_errors
    from eventlight.store.jetstream.pg_open import open_waiting
    from eventlight.store.jetstream.projector import Projector

    fresh = f"{live}_rebuild"
    conn = await open_waiting(pg_dsn, "rebuilding", lambda: pg_errors.connect(pg_dsn), wait_s=open_wait_s)
    try:
        if not await conn.fetchval("SELECT pg_try_advisory_lock(hashtext($1), hashtext($2))", _REBUILD_LOCK, live):
            raise InvalidInputError(
                f"another rebuild of schema {live} is running (it holds the rebuild lock): wait for it to finish"
            )
        await conn.execute(f"DROP SCHEMA IF EXISTS {_q(fresh)} CASCADE")  # an earlier rebuild left behind
        await apply_migrations(pg_dsn, fresh, open_wait_s=open_wait_s)
        pool = await open_waiting(pg_dsn, "rebuilding", lambda: pg.create_pool(pg_dsn, fresh), wait_s=open_wait_s)
        t0 = time.perf_counter()
        try:
            rebuilt_at = await Projector(log_, pool, watchdog_interval_s=NO_WATCHDOG_S).rebuild()
        finally:
            await pool.close()
        seconds = time.perf_counter() - t0
        live_at = int(await conn.fetchval(f"SELECT min(last_seq) FROM {_q(live)}.projector_checkpoint") or 0)
        a, b = await table_sums(conn, live), await table_sums(conn, fresh)
        diffs = [TableDiff(t, a[t][0], b[t][0], a[t][1], b[t][1]) for t in TABLES]
        report = RebuildReport(
            schema=fresh, live_checkpoint=live_at, rebuilt_checkpoint=rebuilt_at, seconds=seconds, tables=diffs
        )
        if swap:
            report.swapped_out = await _swap(conn, live, fresh)
            report.schema = live
        return report
    finally:
        await conn.close()  # ends the session: its advisory locks go with it


async def _swap(conn: Any, live: str, fresh: str) -> str:
    """Rename ``live`` away and ``fresh`` to ``live`` in one transaction, under the projector's lock."""
    key = zlib.crc32(live.encode())  # the projector's leader lock (eventlight.store.jetstream.projector)
    if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", key):
        raise InvalidInputError(
            f"a projector of schema {live} is running (it holds the leader lock): stop the trainers and stores "
            "opened with pg_dsn, then swap"
        )
    try:
        old = await _free_name(conn, live, int(time.time()))
        async with conn.transaction():
            await conn.execute(f"ALTER SCHEMA {_q(live)} RENAME TO {_q(old)}")
            await conn.execute(f"ALTER SCHEMA {_q(fresh)} RENAME TO {_q(live)}")
        return old
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1)", key)


async def _free_name(conn: Any, live: str, now_s: int) -> str:
    """``<live>_replaced_<second>`` for the first second from ``now_s`` whose name no schema has
    (two swaps within one second; the rebuild lock keeps others from taking it meanwhile). The
    length stays that of a unix time, within Postgres's 63 bytes for the longest namespace."""
    rows = await conn.fetch("SELECT nspname FROM pg_namespace WHERE starts_with(nspname, $1)", f"{live}_replaced_")
    taken = {str(r[0]) for r in rows}
    while f"{live}_replaced_{now_s}" in taken:
        now_s += 1
    return f"{live}_replaced_{now_s}"


def rebuild_command(settings: Settings, swap: bool) -> None:
    """The CLI side: find the servers, rebuild, print the comparison; exit 1 when they differ
    (and nothing was swapped)."""
    from rich.table import Table

    from eventlight.cli.common import EXIT_UNAVAILABLE, CliError, _run, console
    from eventlight.cli.discovery import _need_pg
    from eventlight.cli.replay import _nats_settings

    async def go() -> RebuildReport:
        s = await _nats_settings(settings)
        found = await _need_pg(s)
        return await rebuild(s, str(found.url), swap=swap)

    report = _run(go())
    table = Table("table", "live rows", "rebuilt rows", "checksum", box=None, header_style="dim")
    for t in report.tables:
        table.add_row(t.table, str(t.live_rows), str(t.rebuilt_rows), "same" if t.same else "[red]differs[/red]")
    console.print(
        f"rebuilt {settings.pg_schema} from the log into {settings.pg_schema}_rebuild in {report.seconds:.2f} s "
        f"(log position {report.rebuilt_checkpoint}; the live projection is at {report.live_checkpoint})"
    )
    console.print(table)
    if report.swapped_out is not None:
        console.print(f"swapped: the rebuilt schema is now {settings.pg_schema}; the old one is {report.swapped_out}")
        return
    if not report.same:
        raise CliError(
            "the rebuilt read model differs from the live one (see above); --swap puts the rebuilt one in place",
            EXIT_UNAVAILABLE,
        )
    console.print(f"identical; {settings.pg_schema}_rebuild can be dropped, or swapped in with --swap")
