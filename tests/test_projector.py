"""The projector on real NATS and Postgres: it keeps going across idle periods and never applies twice."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import nats.errors
import pytest

from eventlight.events import rollout_id_of
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.projector import Projector
from eventlight.types import RolloutConfig, Span


async def counts(store: JetStreamLightningStore) -> tuple[int, int, int]:
    stats = await store.statistics()
    return stats["total_rollouts"], stats["total_attempts"], stats["total_spans"]


async def test_projection_resumes_after_idle_fetches(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.enqueue_rollout("a")
        await store.sync(timeout_s=10)
        await asyncio.sleep(1.0)  # several empty fetches, some ending in a status message
        await store.enqueue_rollout("b")
        await store.sync(timeout_s=10)
        assert [r.input for r in await store.query_rollouts()] == ["a", "b"]


async def test_a_restarted_projector_reapplies_nothing(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        r = await store.enqueue_rollout("q", config=RolloutConfig(max_attempts=2, retry_condition=["failed"]))
        d = await store.dequeue_rollout(worker_id="w")
        await store.update_attempt(r.rollout_id, d.attempt.attempt_id, status="failed")
        await store.dequeue_rollout(worker_id="w")
        await store.sync_all(timeout_s=10)
        before = await counts(store)
        checkpoint = store.projector.checkpoint
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, run_projector=False) as store:
        replay = Projector(store.log, store.pool)
        await replay._become_leader()
        assert replay.checkpoint == checkpoint
        sub = await store.log.js.pull_subscribe(f"{store.log.prefix}.>", stream=store.log.stream)
        msgs = []
        while True:  # every message again, from the start of the stream, as a redelivery would
            try:
                msgs.extend(await sub.fetch(100, timeout=0.5))
            except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises either, depending on timing
                break
        assert len(msgs) >= checkpoint
        await replay.apply(msgs)
        assert await counts(store) == before
        attempts = await store.query_attempts(r.rollout_id)
        assert [a.status for a in attempts] == ["failed", "preparing"]
        await replay.close()


async def test_an_event_postgres_refuses_is_dead_lettered_and_the_rest_projected(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One poison event must not stop the projection (it stays in the stream, listed in
    ``projector_dead_letters``); the events around it in the same batch are applied."""
    poisoned: set[str] = set()
    fold = Projector._fold

    async def refusing_fold(self: Projector, conn: Any, batch: Any, event: Any, seq: int) -> None:
        if rollout_id_of(event) in poisoned:
            raise asyncpg.exceptions.InvalidTextRepresentationError("invalid input syntax (test)")
        await fold(self, conn, batch, event, seq)

    monkeypatch.setattr(Projector, "_fold", refusing_fold)
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, run_projector=False) as store:
        before = await store.enqueue_rollout("before")
        bad = await store.enqueue_rollout("bad")
        poisoned.add(bad.rollout_id)
        after = await store.enqueue_rollout("after")
        projector = Projector(store.log, store.pool)  # starts now: all three arrive in one batch
        await projector.start()
        try:
            await store.sync(timeout_s=10)
            assert [r.input for r in await store.query_rollouts()] == ["before", "after"]
            assert projector.dead_letters == 1
            async with store.pool.acquire() as conn:
                rows = await conn.fetch("SELECT stream_seq, subject, error FROM projector_dead_letters")
            assert len(rows) == 1 and bad.rollout_id in rows[0]["subject"] and "test" in rows[0]["error"]
            assert {before.rollout_id, after.rollout_id} == {r.rollout_id for r in await store.query_rollouts()}
        finally:
            await projector.close()


async def test_large_json_values_are_compressed_with_lz4(namespace: Settings) -> None:
    """migrations/003: every jsonb column of the read models compresses with lz4 where the server
    has it (pglz cost about half of Postgres' CPU per projected span), and a big span round-trips."""
    conn = await asyncpg.connect(namespace.pg_dsn)
    try:
        try:
            await conn.execute("SET default_toast_compression = lz4")
            has_lz4 = True
        except asyncpg.PostgresError:
            has_lz4 = False
        rows = await conn.fetch(
            "SELECT c.relname, a.attname, a.attcompression FROM pg_attribute a"
            " JOIN pg_class c ON a.attrelid = c.oid JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = $1 AND c.relkind = 'r' AND a.atttypid = 'jsonb'::regtype AND NOT a.attisdropped",
            namespace.pg_schema,
        )
    finally:
        await conn.close()
    assert {(r["relname"], r["attname"]) for r in rows} >= {("spans", "attributes"), ("rollouts", "input")}
    expected = b"l" if has_lz4 else b"\x00"
    assert {r["attcompression"] for r in rows} == {expected}, rows

    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        big = {f"key.{i}": "value " * 40 + str(i) for i in range(100)}  # ~25 KB: stored compressed
        r = await store.start_rollout("big")
        span = Span.from_attributes(
            attributes=big, rollout_id=r.rollout_id, attempt_id=r.attempt.attempt_id, sequence_id=1, name="big"
        )
        assert await store.add_span(span) is not None
        await store.sync(timeout_s=10)
        [stored] = await store.query_spans(r.rollout_id)
        assert stored.attributes == big


async def test_foreign_span_payloads_are_skipped_and_valid_spans_projected(namespace: Settings) -> None:
    """Spans are projected with their attributes as raw JSON (``decode_for_projection``); payloads on
    a span subject that are not valid ``SpansAdded`` events are counted as malformed and skipped,
    whatever fails first (JSON syntax or a type), and the projection goes on."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        r = await store.start_rollout("x")
        rid, aid = r.rollout_id, r.attempt.attempt_id
        subject = f"{store.log.prefix}.s.{rid}.{aid}"
        head = b'{"type":"spans_added","time":1.0,"rollout_id":"%s","attempt_id":"%s","spans":[' % (
            rid.encode(),
            aid.encode(),
        )
        span = (
            b'{"rollout_id":"%s","attempt_id":"%s","sequence_id":9,"trace_id":"t","span_id":"s9","parent_id":null,"name":"n",'
            % (
                rid.encode(),
                aid.encode(),
            )
        )
        await store.log.js.publish(subject, head + span + b'"attributes":[1]}]}')  # attributes not an object
        await store.log.js.publish(subject, head + span + b'"attributes":{"a":')  # not even JSON
        kept = Span.from_attributes(
            attributes={"k": "v\x00w", "n": 1.5, "l": [1, "2"]},
            rollout_id=rid,
            attempt_id=aid,
            sequence_id=1,
            name="ok",
        )
        assert await store.add_span(kept) is not None
        await store.sync(timeout_s=10)
        assert store.projector.malformed == 2
        [stored] = await store.query_spans(rid)
        assert stored.name == "ok" and stored.attributes == {"k": "v\ufffdw", "n": 1.5, "l": [1, "2"]}
