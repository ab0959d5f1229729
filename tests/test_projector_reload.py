"""What a projector reads when it becomes leader (``IN_FLIGHT_SQL``): the same rows as the ``OR`` form
it replaced, read through indexes that hold only what is in flight (migration 014), not the history."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from eventlight.core.types import RolloutConfig, Span
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.pg import ROLLOUT_COLS
from eventlight.store.jetstream.projector.leader import IN_FLIGHT_SQL

OR_FORM = (
    f"SELECT {ROLLOUT_COLS}, last_seq FROM rollouts WHERE status IN ('preparing', 'running') "
    "OR rollout_id IN (SELECT a.rollout_id FROM attempts a WHERE a.status IN ('preparing', 'running'))"
)
"""The reload query's rows in the form it had until migration 014 (which read every rollout and every
attempt); since the watchdog checks every live attempt, a latest one too, without its ``<> latest``."""

LIMIT = RolloutConfig(unresponsive_seconds=5.0, max_attempts=3, retry_condition=["unresponsive", "failed"])
NO_LIMIT = RolloutConfig(max_attempts=3, retry_condition=["unresponsive"])


async def revived(store: JetStreamLightningStore, config: RolloutConfig, *, finish: bool) -> str:
    """A rollout whose first attempt, superseded by a retry, a late span made ``running`` again;
    the retry succeeded (``finish``) or is still ``preparing``."""
    r = await store.enqueue_rollout("revived", config=config)
    a = (await store.dequeue_rollout(worker_id="a")).attempt
    await store.update_attempt(r.rollout_id, a.attempt_id, status="unresponsive")  # as the watchdog
    b = (await store.dequeue_rollout(worker_id="b")).attempt
    await store.add_span(Span.from_attributes(attributes={}, rollout_id=r.rollout_id, attempt_id=a.attempt_id))
    if finish:
        await store.update_attempt(r.rollout_id, b.attempt_id, status="succeeded")
    return r.rollout_id


async def finished_under(store: JetStreamLightningStore) -> str:
    """A rollout marked ``succeeded`` by hand while its only attempt runs on."""
    r = await store.enqueue_rollout("finished under", config=LIMIT)
    a = (await store.dequeue_rollout(worker_id="a")).attempt
    await store.update_attempt(r.rollout_id, a.attempt_id, status="running")
    await store.update_rollout(r.rollout_id, status="succeeded")
    return r.rollout_id


async def every_case(store: JetStreamLightningStore) -> dict[str, str]:
    """One rollout of each kind the reload tells apart, by name; the dequeues take them in this order."""
    ids = {
        "finished, superseded attempt live, a limit": await revived(store, LIMIT, finish=True),
        "finished, superseded attempt live, no limit": await revived(store, NO_LIMIT, finish=True),
        "in flight, superseded attempt live": await revived(store, LIMIT, finish=False),
        "finished, latest attempt live": await finished_under(store),
    }
    for name in ("preparing", "running", "finished", "requeuing", "queuing"):
        ids[name] = (await store.enqueue_rollout(name, config=LIMIT)).rollout_id
    for name in ("preparing", "running", "finished", "requeuing"):
        claimed = await store.dequeue_rollout(worker_id="w")
        assert claimed is not None and claimed.rollout_id == ids[name]
        status = {"running": "running", "finished": "succeeded", "requeuing": "failed"}.get(name)
        if status:
            await store.update_attempt(claimed.rollout_id, claimed.attempt.attempt_id, status=status)
    await store.sync(timeout_s=10)
    return ids


async def test_the_reload_reads_the_rows_the_or_form_read(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        ids = await every_case(store)
        conn = await asyncpg.connect(namespace.pg_dsn, server_settings={"search_path": namespace.pg_schema})
        try:
            statuses = dict(await conn.fetch("SELECT rollout_id, status FROM rollouts"))
            assert [statuses[ids[n]] for n in ("finished", "requeuing", "queuing")] == [
                "succeeded",
                "requeuing",
                "queuing",
            ]
            old = sorted(tuple(r) for r in await conn.fetch(OR_FORM))
            new = sorted(tuple(r) for r in await conn.fetch(IN_FLIGHT_SQL))
        finally:
            await conn.close()
    assert new == old
    read = {name for name, rid in ids.items() if rid in {r[0] for r in new}}
    assert read == {
        "preparing",
        "running",
        "in flight, superseded attempt live",
        "finished, superseded attempt live, a limit",
        "finished, superseded attempt live, no limit",  # read, then left out by fold.watched
        "finished, latest attempt live",
    }
    assert len(new) == len(read)  # a rollout both arms find is read once


async def test_the_reload_reads_by_key_or_from_indexes_of_what_is_live(namespace: Settings) -> None:
    """Each scan of the reload's plan is bounded by what is in flight: a lookup by key, or a
    partial index (only rollouts not finished, only attempts live), never all the rows. Scans of a
    whole table are priced out (``enable_seqscan``), so the plan is the same on a small fixture as
    on a namespace with a long history, where the planner picks it by itself (bench/README.md)."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await every_case(store)
        conn = await asyncpg.connect(namespace.pg_dsn, server_settings={"search_path": namespace.pg_schema})
        try:
            await conn.execute("ANALYZE rollouts; ANALYZE attempts; SET enable_seqscan = off")
            plan = json.loads(await conn.fetchval("EXPLAIN (FORMAT JSON) " + IN_FLIGHT_SQL))[0]["Plan"]
            partial = {
                r[0]
                for r in await conn.fetch(
                    "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                    "WHERE i.indpred IS NOT NULL AND c.relnamespace = $1::regnamespace",
                    namespace.pg_schema,
                )
            }
        finally:
            await conn.close()
    scans = list(scans_of(plan))
    assert {s["Relation Name"] for s in scans if "Relation Name" in s} == {"rollouts", "attempts"}
    unbounded = [
        s
        for s in scans
        if s["Node Type"] != "Bitmap Heap Scan"  # its Bitmap Index Scans are judged
        and not ("Index Cond" in s or s.get("Index Name") in partial)
    ]
    assert unbounded == [], unbounded
    assert "attempts_live_idx" in {s.get("Index Name") for s in scans}


def scans_of(node: dict[str, Any]) -> Any:
    """The plan's nodes that read a table or an index, with the keys the test looks at."""
    if "Relation Name" in node or "Index Name" in node:
        yield {k: node[k] for k in ("Node Type", "Relation Name", "Index Name", "Index Cond") if k in node}
    for child in node.get("Plans", []):
        yield from scans_of(child)
