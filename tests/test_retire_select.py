"""Retirement's selection of what is due (``retire._SELECT``): the same rows as the form it replaced,
read through migration 015's ``rollouts_retirable_idx`` (terminal rollouts not yet retired), not the
history of rollouts retired long ago."""

from __future__ import annotations

import json
import time
from typing import Any

import asyncpg

from bench.retire_select import OLD_FORM  # the selection until migration 015
from eventlight.core.types import TERMINAL_ROLLOUT_STATUSES
from eventlight.ops import apply_migrations
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.retire import _SELECT, _due, retire
from tests.test_projector_reload import LIMIT, revived, scans_of
from tests.test_retire import _archive_caught_up, _with_archive


async def finished(store: JetStreamLightningStore, name: str) -> str:
    r = await store.start_rollout(name)
    await store.update_attempt(r.rollout_id, r.attempt.attempt_id, status="succeeded")
    return r.rollout_id


async def every_case(store: JetStreamLightningStore, settings: Settings) -> tuple[dict[str, str], float]:
    """One rollout of each kind the selection tells apart, by name, and an ``ended_before`` that has
    "finished, due" ended before it and "finished, not due" after."""
    pool: Any = store.read_model.pool  # type: ignore[union-attr]
    ids = {"already retired": await finished(store, "retired")}
    await store.sync_all(timeout_s=10)
    await _archive_caught_up(store)
    assert (await retire(store.log, pool, settings, now=time.time() + 1, limit=1)).retired == 1
    ids["finished, due"] = await finished(store, "due")
    ids["finished, superseded attempt live, a limit"] = await revived(store, LIMIT, finish=True)
    ids["running"] = (await store.start_rollout("running")).rollout_id
    ids["finished, not due"] = await finished(store, "not due")
    await store.sync_all(timeout_s=10)
    ends = dict(await pool.fetch("SELECT rollout_id, end_time FROM rollouts"))
    due, not_due = ends[ids["finished, due"]], ends[ids["finished, not due"]]
    assert due < not_due
    return ids, (due + not_due) / 2


async def test_the_selection_reads_the_rows_the_old_form_read(namespace: Settings) -> None:
    settings = await _with_archive(namespace)
    async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        ids, ended_before = await every_case(store, settings)
        conn = await asyncpg.connect(settings.pg_dsn, server_settings={"search_path": settings.pg_schema})
        try:
            flags = dict(await conn.fetch("SELECT rollout_id, retired FROM rollouts"))
            assert [name for name, rid in ids.items() if flags[rid]] == ["already retired"]
            terminal = sorted(TERMINAL_ROLLOUT_STATUSES)
            for bound in (2**62, 0):
                old = [r[0] for r in await conn.fetch(OLD_FORM, terminal, ended_before, bound, 100)]
                assert await _due(conn, ended_before, bound, 100) == old
            due = await _due(conn, ended_before, 2**62, 100)
            whole = [r[0] for r in await conn.fetch(OLD_FORM, terminal, time.time() + 60, 2**62, 100)]
            assert await _due(conn, time.time() + 60, 2**62, 100) == whole
            assert await _due(conn, time.time() + 60, 2**62, 1) == whole[:1]
        finally:
            await conn.close()
    assert [name for name, rid in ids.items() if rid in old] == []  # bound 0: nothing
    assert [name for name, rid in ids.items() if rid in due] == ["finished, due"]
    assert [name for name, rid in ids.items() if rid in whole] == ["finished, due", "finished, not due"]


async def test_the_selection_reads_only_rollouts_not_yet_retired(namespace: Settings) -> None:
    """The scan of ``rollouts`` walks ``rollouts_retirable_idx`` (terminal, not ``retired``), in
    ``last_seq`` order; scans of a whole table are priced out (``enable_seqscan``), so the plan is the
    same on a small fixture as on a long history, where the planner picks it by itself (bench/README.md,
    "Retirement's selection of what is due")."""
    settings = await _with_archive(namespace)
    async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        await every_case(store, settings)
        conn = await asyncpg.connect(settings.pg_dsn, server_settings={"search_path": settings.pg_schema})
        try:
            await conn.execute("ANALYZE rollouts; ANALYZE attempts; SET enable_seqscan = off")
            await conn.execute("PREPARE due(float8, bigint, bigint) AS " + _SELECT)
            plan = json.loads(await conn.fetchval("EXPLAIN (FORMAT JSON) EXECUTE due(1e12, 1000000, 500)"))[0]["Plan"]
        finally:
            await conn.close()
    scans = list(scans_of(plan))
    rollouts = [s for s in scans if s.get("Relation Name") == "rollouts"]
    assert [s.get("Index Name") for s in rollouts] == ["rollouts_retirable_idx"], scans
    assert plan["Node Type"] == "Limit" and "Sort" not in json.dumps(plan), plan  # read in order, no sort


async def test_the_migration_marks_the_rollouts_already_retired(namespace: Settings) -> None:
    """A schema retired from before migration 015 gets ``retired`` set from ``retired_rollouts``."""
    conn = await asyncpg.connect(namespace.pg_dsn, server_settings={"search_path": namespace.pg_schema})
    try:
        await conn.execute("DROP INDEX rollouts_retirable_idx; ALTER TABLE rollouts DROP COLUMN retired")
        await conn.execute("DELETE FROM schema_migrations WHERE version = '015_retirable_rollouts_index'")
        for rid in ("ro-old", "ro-kept"):
            await conn.execute(
                "INSERT INTO rollouts (rollout_id, input, start_time, end_time, status, config, metadata,"
                " created_seq, last_seq) VALUES ($1, '{}'::jsonb, 1, 2, 'succeeded', '{}'::jsonb, '{}'::jsonb, 1, 2)",
                rid,
            )
        await conn.execute("INSERT INTO retired_rollouts VALUES ('ro-old', 3, 3)")
        assert await apply_migrations(namespace.pg_dsn or "", namespace.pg_schema) == ["015_retirable_rollouts_index"]
        flags = dict(await conn.fetch("SELECT rollout_id, retired FROM rollouts"))
        assert flags == {"ro-old": True, "ro-kept": False}
        kept = await _due(conn, 10.0, 10, 100)
    finally:
        await conn.close()
    assert kept == ["ro-kept"]
