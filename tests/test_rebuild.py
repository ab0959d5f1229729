"""The read model is a fold of the log: rebuilt from sequence 1 into a fresh schema, it equals the live one.

A workload through the store API (JetStream backend) fills the live schema; a second ``Projector``,
the same code with a pool on an empty schema, folds the whole stream again (``Projector.rebuild``:
no consumer, no leader lock). Then every read-model table is compared row by row.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest

from eventlight.core.errors import ServiceUnavailableError
from eventlight.core.types import PromptTemplate, RolloutConfig, Span
from eventlight.ops import apply_migrations
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore, pg
from eventlight.store.jetstream.projector import Projector

TABLES = ("rollouts", "attempts", "spans", "resources", "workers", "rollout_status_counts")
NO_WATCHDOG_S = 3600.0  # the rebuilding projector must only read: its watchdog would append to the log


def span(rollout_id: str, attempt_id: str, seq: int, span_id: str) -> Span:
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=seq,
        trace_id="cd" * 16,
        span_id=span_id,
        parent_id=None,
        name=f"step-{seq}",
        attributes={"seq": seq, "nested": {"k": [1, 2]}},
        start_time=1.0 + seq,
        end_time=2.0 + seq,
    )


async def workload(store: Any) -> None:
    """Every kind of event: resources, rollouts with retry configs, claims, spans (a duplicate and a
    late one), attempt and rollout updates, heartbeats, empty polls and watchdog decisions."""
    res = await store.add_resources({"p": PromptTemplate(template="v1 {x}")})
    await store.update_resources(res.resources_id, {"p": PromptTemplate(template="v2 {x}")})
    await store.update_resources("prod", {"p": PromptTemplate(template="prod {x}")})
    retry = RolloutConfig(max_attempts=2, retry_condition=["failed", "timeout"], timeout_seconds=30.0)
    silent = RolloutConfig(unresponsive_seconds=5.0)
    a = await store.enqueue_rollout({"x": 1}, mode="train", config=retry, metadata={"k": 1})
    b = await store.enqueue_rollout({"x": 2}, resources_id=res.resources_id, config=silent)
    c = await store.enqueue_rollout({"x": 3}, mode="val")
    da = await store.dequeue_rollout(worker_id="w1")
    db = await store.dequeue_rollout(worker_id="w2")
    aid = da.attempt.attempt_id
    await store.add_many_spans([span(a.rollout_id, aid, 1, "00000000000000a1"), span(a.rollout_id, aid, 2, "00a2" * 4)])
    await store.add_span(span(a.rollout_id, aid, 1, "00000000000000a1"))  # a duplicate
    await store.update_attempt(a.rollout_id, aid, status="failed", metadata={"why": "test"})  # requeued
    await store.update_worker("w1", heartbeat_stats={"gpu": 0.5})
    await store.update_worker("w3")
    assert (await store.dequeue_rollout(worker_id="w3")).rollout_id == c.rollout_id
    assert (await store.dequeue_rollout(worker_id="w1")).rollout_id == a.rollout_id  # the retry
    await store.update_attempt(a.rollout_id, "latest", status="succeeded")
    await store.start_attempt(c.rollout_id, worker_id="w1")
    await store.update_rollout(c.rollout_id, status="cancelled", metadata={"stop": True})
    assert await store.dequeue_rollout(worker_id="w2") is None  # empty polls
    assert await store.dequeue_rollout(worker_id="w2") is None
    await store.sync_all(timeout_s=10)
    assert await store.projector.watch_once(time.time() + 100) >= 1  # b falls silent: unresponsive
    await store.add_span(span(b.rollout_id, db.attempt.attempt_id, 1, "00000000000000b1"))  # late span
    await store.sync_all(timeout_s=10)


async def last_seq(store: JetStreamLightningStore) -> int:
    info = await store.log.js.stream_info(store.log.stream)
    return int(info.state.last_seq)


async def rebuild(store: JetStreamLightningStore, schema: str, dsn: str, batch_size: int = 512) -> int:
    """Fold the whole stream into ``schema`` with a second projector; returns the last sequence applied."""
    await apply_migrations(dsn, schema)
    pool = await pg.create_pool(dsn, schema)
    try:
        projector = Projector(store.log, pool, watchdog_interval_s=NO_WATCHDOG_S)
        return await asyncio.wait_for(projector.rebuild(batch_size), 30)
    finally:
        await pool.close()


async def table(conn: asyncpg.Connection, schema: str, name: str) -> list[dict[str, Any]]:
    # the status counts are kept by a trigger per written row: a status that a rollout passed through
    # inside one batch never gets a row, one it left in an earlier batch keeps a row with n = 0
    where = " WHERE n <> 0" if name == "rollout_status_counts" else ""
    rows = await conn.fetch(f'SELECT * FROM "{schema}"."{name}"{where}')
    return sorted((dict(r) for r in rows), key=repr)


@pytest.mark.parametrize("batch_size", [512, 2], ids=["one-batch", "batches-read-ahead"])
async def test_rebuilt_read_model_equals_the_live_one(namespace: Settings, batch_size: int) -> None:
    dsn = namespace.pg_dsn
    assert dsn is not None
    fresh = f"{namespace.pg_schema}_rebuilt"
    async with JetStreamLightningStore(namespace, pg_dsn=dsn) as store:
        await workload(store)
        try:
            assert await rebuild(store, fresh, dsn, batch_size) == await last_seq(store)
            await assert_same(dsn, namespace.pg_schema, fresh, TABLES)
        finally:
            await drop_schema(dsn, fresh)


async def assert_same(dsn: str, live_schema: str, rebuilt_schema: str, tables: tuple[str, ...]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        for name in tables:
            live = await table(conn, live_schema, name)
            rebuilt = await table(conn, rebuilt_schema, name)
            assert live, f"the workload left {name} empty: the comparison would prove nothing"
            assert len(rebuilt) == len(live), f"{name}: {len(rebuilt)} rows rebuilt, {len(live)} live"
            for want, got in zip(live, rebuilt, strict=True):
                assert got == want, f"{name} differs:\n  live:    {want}\n  rebuilt: {got}"
    finally:
        await conn.close()


async def drop_schema(dsn: str, schema: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


async def test_a_batch_touching_many_finished_rollouts_rebuilds(namespace: Settings) -> None:
    """A batch of late spans for 24 rollouts that finished in earlier batches: the rebuilding
    projector caches none of them (finished rollouts leave its cache) and reads them all before the
    fold. It read one per round, at most 8, and a rebuild of the demo's log stopped with 'the fold
    still lacked rows after 8 reads' (a fresh-user run)."""
    dsn = namespace.pg_dsn
    assert dsn is not None
    fresh = f"{namespace.pg_schema}_rebuilt"
    async with JetStreamLightningStore(namespace, pg_dsn=dsn) as store:
        done = []
        for i in range(24):
            attempted = await store.start_rollout({"i": i}, worker_id=f"w{i % 3}")
            await store.update_attempt(attempted.rollout_id, attempted.attempt.attempt_id, status="succeeded")
            done.append(attempted)
        for i, attempted in enumerate(done):  # spans that arrive after the attempt finished
            await store.add_span(span(attempted.rollout_id, attempted.attempt.attempt_id, 1, f"{i + 1:016x}"))
        await store.sync_all(timeout_s=10)
        try:
            assert await rebuild(store, fresh, dsn, batch_size=24) == await last_seq(store)
            await assert_same(dsn, namespace.pg_schema, fresh, ("rollouts", "attempts", "spans", "workers"))
        finally:
            await drop_schema(dsn, fresh)


async def test_a_read_failure_mid_rebuild_is_raised_not_waited_on(namespace: Settings, monkeypatch: Any) -> None:
    """The reader task's error reaches the writer (no hang on the batch queue); what was read
    before it was applied."""
    dsn = namespace.pg_dsn
    assert dsn is not None
    fresh = f"{namespace.pg_schema}_rebuilt"
    async with JetStreamLightningStore(namespace, pg_dsn=dsn) as store:
        await workload(store)
        real_scan = store.log.scan

        async def failing_scan(from_seq: int = 0, until_seq: int | None = None) -> Any:
            async for i, item in _enumerate(real_scan(from_seq, until_seq)):
                if i == 5:
                    raise ServiceUnavailableError("nats://test", "the stream went away")
                yield item

        monkeypatch.setattr(store.log, "scan", failing_scan)
        await apply_migrations(dsn, fresh)
        pool = await pg.create_pool(dsn, fresh)
        try:
            projector = Projector(store.log, pool, watchdog_interval_s=NO_WATCHDOG_S)
            with pytest.raises(ServiceUnavailableError, match="the stream went away"):
                await asyncio.wait_for(projector.rebuild(2), 30)
            assert projector.checkpoint == 4  # two batches of two before the failure
        finally:
            await pool.close()
            conn = await asyncpg.connect(dsn)
            await conn.execute(f'DROP SCHEMA IF EXISTS "{fresh}" CASCADE')
            await conn.close()


async def _enumerate(items: Any) -> Any:
    i = 0
    async for item in items:
        yield i, item
        i += 1


@pytest.mark.parametrize("batch_size", [512, 2], ids=["one-batch", "batches-read-ahead"])
async def test_revived_superseded_attempts_rebuild(namespace: Settings, batch_size: int) -> None:
    """A superseded attempt revived by a late span after its rollout finished, marked
    ``unresponsive`` by the watchdog (f268f91) and revived once more: the rebuild folds the same
    rows, and the rebuilding projector watches what the live one does (the rollout with its
    superseded attempt ``running`` again)."""
    dsn = namespace.pg_dsn
    assert dsn is not None
    fresh = f"{namespace.pg_schema}_rebuilt"
    cfg = RolloutConfig(unresponsive_seconds=5.0, max_attempts=3, retry_condition=["unresponsive"])
    async with JetStreamLightningStore(namespace, pg_dsn=dsn) as store:
        assert store.projector is not None
        r = await store.enqueue_rollout({"x": 1}, config=cfg)
        a = (await store.dequeue_rollout(worker_id="a")).attempt
        await store.sync_all(timeout_s=10)
        assert await store.projector.watch_once(a.start_time + 6) == 1  # a falls silent: the retry
        await store.sync_all(timeout_s=10)
        b = (await store.dequeue_rollout(worker_id="b")).attempt
        await store.add_span(span(r.rollout_id, a.attempt_id, 1, "00000000000000c1"))  # a is back: revived
        await store.update_attempt(r.rollout_id, b.attempt_id, status="succeeded")
        await store.sync_all(timeout_s=10)
        assert await store.projector.watch_once(time.time() + 60) == 1  # a silent again, after the end
        await store.sync_all(timeout_s=10)
        assert store.projector.in_flight() == []
        await store.add_span(span(r.rollout_id, a.attempt_id, 2, "00000000000000c2"))  # and back once more
        await store.sync_all(timeout_s=10)
        live = [rid for rid, _, _ in store.projector.in_flight()]
        assert live == [r.rollout_id]
        try:
            await apply_migrations(dsn, fresh)
            pool = await pg.create_pool(dsn, fresh)
            try:
                projector = Projector(store.log, pool, watchdog_interval_s=NO_WATCHDOG_S)
                assert await asyncio.wait_for(projector.rebuild(batch_size), 30) == await last_seq(store)
                assert [rid for rid, _, _ in projector.in_flight()] == live
            finally:
                await pool.close()
            await assert_same(dsn, namespace.pg_schema, fresh, ("rollouts", "attempts", "spans", "workers"))
        finally:
            await drop_schema(dsn, fresh)
