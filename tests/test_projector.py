"""The projector on real NATS and Postgres: it keeps going across idle periods and never applies twice."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import msgspec
import nats.errors
import pytest
from faults import Ledger, check_log_and_read_model, stream_last_seq, workload

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.core.events import SpansAdded, decode_event, encode_event, rollout_id_of
from eventlight.core.types import Event, Link, OtelResource, RolloutConfig, Span, SpanContext, TraceStatus
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.pg import may_hold_nul
from eventlight.store.jetstream.projector import Projector
from eventlight.store.jetstream.rows import decode_for_projection, span_row
from tests.conftest import as_role, role_of

PROJECTOR_LOGGER = "eventlight.store.jetstream.projector"


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


def _foreign_span(rid: str, aid: str, attributes: bytes) -> bytes:
    head = b'{"type":"spans_added","v":1,"time":1.0,"rollout_id":"%s","attempt_id":"%s","spans":[' % (
        rid.encode(),
        aid.encode(),
    )
    span = b'{"rollout_id":"%s","attempt_id":"%s","sequence_id":50,"trace_id":"t","span_id":"f50","parent_id":null,' % (
        rid.encode(),
        aid.encode(),
    )
    return head + span + b'"name":"foreign","attributes":' + attributes + b"}]}"


FOREIGN: dict[str, Any] = {  # what another writer might put on a span subject
    "attributes_not_an_object": lambda rid, aid: _foreign_span(rid, aid, b"[1]"),
    "not_json": lambda rid, aid: _foreign_span(rid, aid, b'{"a":')[:-3],
    "type_not_a_string": lambda rid, aid: b'{"type":["spans_added"]}',
    "version_not_an_int": lambda rid, aid: b'{"type":"spans_added","v":[1],"spans":[]}',
    "nested_too_deep": lambda rid, aid: _foreign_span(rid, aid, b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "empty": lambda rid, aid: b"",
    "name_not_utf8": lambda rid, aid: _foreign_span(rid, aid, b"{}").replace(b'"foreign"', b'"\xff"'),
    "another_object": lambda rid, aid: b"{}",
}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
async def test_foreign_span_payloads_are_skipped_and_numbering_goes_on(namespace: Settings, kind: str) -> None:
    """Spans are projected with their attributes as raw JSON (``decode_for_projection``); a payload on
    a span subject that is not a valid ``SpansAdded`` is dead-lettered (a row in
    ``projector_dead_letters``, in the batch's transaction) and skipped, whatever
    fails first (JSON syntax, a type, the nesting depth), the projection goes on, and the next
    numbered span continues the attempt's counter (``span_head`` looks past a foreign last message)."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        r = await store.start_rollout("x")
        rid, aid = r.rollout_id, r.attempt.attempt_id

        def make(name: str, **attributes: Any) -> Span:
            return Span.from_attributes(attributes=attributes, rollout_id=rid, attempt_id=aid, name=name)

        await store.add_spans_numbered(rid, aid, [make("pre", i=i) for i in range(3)])
        await store.log.js.publish(f"{store.log.prefix}.s.{rid}.{aid}", FOREIGN[kind](rid, aid))
        [after] = await store.add_spans_numbered(rid, aid, [make("after", k="v\x00w", n=1.5, l=[1, "2"])])
        await store.start_rollout("y")  # an event behind the foreign one
        await store.sync(timeout_s=10)
        # a batch-shaped foreign payload's ids (50) count as taken: the counter never reuses an id
        expected = 51 if kind in ("attributes_not_an_object", "name_not_utf8") else 4
        assert after.sequence_id == expected
        assert store.projector.malformed == 1 and store.projector.dead_letters == 1
        async with store.pool.acquire() as conn:
            [dead] = await conn.fetch("SELECT subject, error FROM projector_dead_letters")
        assert dead["subject"] == f"{store.log.prefix}.s.{rid}.{aid}" and "malformed event" in dead["error"]
        spans = await store.query_spans(rid)
        assert [(s.name, s.sequence_id) for s in spans] == [("pre", 1), ("pre", 2), ("pre", 3), ("after", expected)]
        assert spans[-1].attributes == {"k": "v\ufffdw", "n": 1.5, "l": [1, "2"]}
        assert len(await store.query_rollouts()) == 2


def _span_fields(**fields: Any) -> Span:
    base = Span.from_attributes(
        attributes={"a": "x\x00y", "b": [1, 2.5], "c": '\\u0000 "q"'}, rollout_id="ro-1", attempt_id="at-1"
    )
    for name, value in fields.items():
        setattr(base, name, value)
    return base


def test_spans_projected_raw_give_the_rows_of_their_typed_decode() -> None:
    """``decode_for_projection`` keeps a span's JSON fields as raw text; its rows are those of the
    typed ``SpansAdded`` (NUL characters replaced, a missing context ``NULL``), and a field of the
    wrong shape still fails the whole payload (``InvalidInputError``: dead-lettered)."""
    ctx = SpanContext(trace_id="t" * 32, span_id="s" * 16, trace_state={"k": "v\x00"})
    spans = [
        _span_fields(context=None, parent=None),
        _span_fields(
            status=TraceStatus(status_code="ERROR", description="bad\x00"),
            events=[Event(name="e", attributes={"n\x00": 1}, timestamp=2.0)],
            links=[Link(context=ctx, attributes={"l": "x"})],
            context=ctx,
            parent=ctx,
            resource=OtelResource(attributes={"service.name": "s\x00"}, schema_url="u"),
        ),
    ]
    data = encode_event(SpansAdded(time=1.0, rollout_id="ro-1", attempt_id="at-1", spans=spans))
    raw = decode_for_projection(data)
    typed = decode_event(data)
    assert isinstance(raw, SpansAdded) and isinstance(typed, SpansAdded)
    assert [type(s).__name__ for s in raw.spans] == ["RawSpan", "RawSpan"]
    assert [span_row(s, 9) for s in raw.spans] == [span_row(s, 9) for s in typed.spans]
    assert span_row(raw.spans[0], 9)[13] is None and "\x00" not in "".join(map(str, span_row(raw.spans[1], 9)))
    head = b'{"type":"spans_added","v":1,"time":1.0,"rollout_id":"r","attempt_id":"a","spans":[{"rollout_id":"r",'
    head += b'"attempt_id":"a","sequence_id":1,"trace_id":"t","span_id":"s","parent_id":null,"name":"n",'
    for bad in (
        b'"status":"ok"',
        b'"events":[1]',
        b'"links":[{}]',
        b'"context":5',
        b'"parent":{"trace_id":1}',
        b'"resource":{"attributes":[]}',
    ):
        with pytest.raises(InvalidInputError):
            decode_for_projection(head + bad + b"}]}")
    assert isinstance(decode_for_projection(head + b'"status":{"status_code":"OK"}}]}'), SpansAdded)


@pytest.mark.parametrize("text", ["", "plain", "a\\u0000", "\\\\u0000", "\\n\\u0001", "x" * 5000 + "\\u0000"])
def test_may_hold_nul_is_the_substring_test(text: str) -> None:
    assert may_hold_nul(text) == ("\\u0000" in text) == may_hold_nul(text.encode())


@pytest.mark.parametrize(
    "status",
    [b"{}", b'{"description":"d"}', b'{"status_code":"OK","status_code":"ERROR"}', b'{"x":1,"status_code":"OK"}'],
)
async def test_a_foreign_spans_status_is_stored_as_its_typed_decode(namespace: Settings, status: bytes) -> None:
    """A span's ``status`` as another writer may spell it (fields left out, repeated, unknown) is
    stored as ``decode_event`` reads it: ``v_spans.status_code`` is ``UNSET`` for ``{}``, not ``NULL``."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        r = await store.start_rollout("x")
        rid, aid = r.rollout_id, r.attempt.attempt_id
        data = _foreign_span(rid, aid, b"{}").replace(b'"attributes"', b'"status":' + status + b',"attributes"')
        await store.log.js.publish(f"{store.log.prefix}.s.{rid}.{aid}", data)
        await store.start_rollout("y")
        await store.sync(timeout_s=10)
        typed = decode_event(data)
        assert isinstance(typed, SpansAdded) and store.projector.dead_letters == 0
        async with store.pool.acquire() as conn:
            row = await conn.fetchrow(
                "SELECT v.status_code, s.status = $1::jsonb AS same FROM v_spans v JOIN spans s USING (span_id)",
                span_row(typed.spans[0], 0)[7],
            )
        assert row is not None and (row["status_code"], row["same"]) == (typed.spans[0].status.status_code, True)


@pytest.mark.parametrize(
    "data",
    [
        b'{"type":"spans_added","v":"x","k":"\xff"}',
        b'{"type":"spans_added","v":1,"time":1.0,"rollout_id":"\xff","attempt_id":"a","spans":[]}',
        b'{"type":"spans_added","v":1,"time":1.0,"rollout_id":"r","attempt_id":"a","spans":[{"rollout_id":"r",'
        b'"attempt_id":"a","sequence_id":1,"trace_id":"t","span_id":"s","parent_id":null,"name":"n",'
        b'"status":{"status_code":"\xff"}}]}',
    ],
)
def test_a_payload_not_in_utf8_is_not_an_event(data: bytes) -> None:
    """Bytes that are not UTF-8 in a string make a payload malformed (``InvalidInputError``: the
    projector dead-letters it in its batch), not a ``UnicodeDecodeError``."""
    for decode in (decode_event, decode_for_projection):
        with pytest.raises(InvalidInputError):
            decode(data)


async def test_a_number_beyond_float_range_in_raw_attributes_reads_back(namespace: Settings) -> None:
    """Postgres keeps a foreign span's ``1e5000`` as a 5001-digit ``numeric``; reads must not fail on it."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        r = await store.start_rollout("x")
        rid, aid = r.rollout_id, r.attempt.attempt_id
        await store.log.js.publish(f"{store.log.prefix}.s.{rid}.{aid}", _foreign_span(rid, aid, b'{"n":1e5000}'))
        await store.start_rollout("y")
        await store.sync(timeout_s=10)
        [span] = await store.query_spans(rid)
        assert span.name == "foreign" and span.attributes == {"n": float("inf")}


@pytest.mark.parametrize("failure", ["data", "event", "server", "stuck"])
async def test_a_failing_batch_is_never_skipped(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """A batch that fails is retried as it is, never acknowledged by a later batch (ack policy *all*).
    An event that fails on its own (data Postgres refuses, or a TypeError from a bug) is listed in
    ``projector_dead_letters`` (it stays in the stream) and the events around it in the same batch
    are applied; a server failure (a lost connection, twice) is retried until the batch is applied,
    and so is a connection asyncpg finds stuck (``InternalClientError``, twice: its server ended it,
    and asyncpg had not seen it close yet), which was taken for the event's failure."""
    fold = Projector._fold
    failures = {"left": 2}
    poisoned: set[str] = set()

    async def failing_fold(self: Projector, conn: Any, events: list[tuple[int, Any]]) -> Any:
        if any(rollout_id_of(event) in poisoned for _, event in events):
            if failure == "data":
                raise asyncpg.exceptions.InvalidTextRepresentationError("invalid input syntax (test)")
            if failure == "event":
                raise TypeError("a bug met this event (test)")
            if failures["left"] > 0:
                failures["left"] -= 1
                if failure == "stuck":
                    raise asyncpg.exceptions.InternalClientError(
                        "cannot switch to state 15; another operation (2) is in progress (test)"
                    )
                raise asyncpg.exceptions.ConnectionDoesNotExistError("connection lost (test)")
        return await fold(self, conn, events)

    monkeypatch.setattr(Projector, "_fold", failing_fold)
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, run_projector=False) as store:
        await store.enqueue_rollout("x")
        bad = await store.enqueue_rollout("bad")
        poisoned.add(bad.rollout_id)
        await store.enqueue_rollout("y")
        projector = Projector(store.log, store.pool)  # starts now: all three arrive in one batch
        await projector.start()
        try:
            await store.sync(timeout_s=15)
            await asyncio.sleep(0.3)
            await store.enqueue_rollout("z")  # a later batch, fetched only once the first one is done
            await store.sync(timeout_s=15)
            inputs = [r.input for r in await store.query_rollouts()]
            async with store.pool.acquire() as conn:
                dead = await conn.fetch("SELECT stream_seq, subject, error FROM projector_dead_letters")
            if failure in ("server", "stuck"):
                assert inputs == ["x", "bad", "y", "z"] and not dead and failures["left"] == 0
            else:
                assert inputs == ["x", "y", "z"] and projector.dead_letters == 1
                assert len(dead) == 1 and bad.rollout_id in dead[0]["subject"] and "test" in dead[0]["error"]
        finally:
            await projector.close()


@pytest.mark.parametrize("write", ["committed", "deposed"])
async def test_an_event_is_logged_as_skipped_only_once_its_dead_letter_is_committed(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, write: str
) -> None:
    """An event that fails on its own was logged "skipping the event" before its dead letter was
    written: when that write failed (another projector took the term), the log told of a skip that
    never happened. Now the skip is logged after the commit, and a failed write says the event
    was not skipped."""
    from eventlight.store.jetstream.projector.common import Deposed

    async def failing_fold(self: Projector, conn: Any, events: list[tuple[int, Any]]) -> Any:
        raise TypeError("a bug met this event (test)")

    async def deposed(self: Projector, conn: Any, rows: list[tuple[int, str, str]]) -> None:
        raise Deposed("another projector took the term (test)")

    monkeypatch.setattr(Projector, "_fold", failing_fold)
    if write == "deposed":
        monkeypatch.setattr(Projector, "_dead_letter", deposed)
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, run_projector=False) as store:
        await store.enqueue_rollout("bad")
        projector = Projector(store.log, store.pool)
        await projector._become_leader()
        sub = await store.log.js.pull_subscribe(f"{store.log.prefix}.>", stream=store.log.stream)
        [msg] = await sub.fetch(1, timeout=5)
        seq = msg.metadata.sequence.stream
        try:
            with caplog.at_level(logging.WARNING, logger=PROJECTOR_LOGGER):
                if write == "deposed":
                    with pytest.raises(Deposed):
                        await projector._apply_isolating([msg])
                else:
                    await projector._apply_isolating([msg])
            async with store.pool.acquire() as conn:
                dead = await conn.fetch("SELECT stream_seq FROM projector_dead_letters")
        finally:
            await projector.close()
    said = [r.getMessage() for r in caplog.records]
    if write == "committed":
        assert [d["stream_seq"] for d in dead] == [seq] and projector.dead_letters == 1
        assert [m for m in said if f"skipped the event at stream sequence {seq}" in m] != [], said
    else:
        assert dead == [] and projector.dead_letters == 0 and projector.checkpoint < seq
        assert [m for m in said if "skip" in m and "not skipped" not in m] == [], said
        assert [m for m in said if f"stream sequence {seq}" in m and "not dead-lettered" in m] != [], said


async def test_a_store_with_a_standby_projector_wakes_waiters_promptly(namespace: Settings) -> None:
    """A second store with Postgres on the same namespace holds a standby projector (another leads):
    its reads wait for the leader's checkpoint, and its ``wait_for_rollouts`` follows the stream's
    terminal events, not its own (absent) commits."""
    async with (
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as leader,
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as standby,
    ):
        assert leader.projector.leader.is_set() and not standby.projector.leader.is_set()
        r = await standby.enqueue_rollout("q")
        d = await leader.dequeue_rollout(worker_id="w")
        waiter = asyncio.create_task(standby.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=10))
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        await leader.update_attempt(r.rollout_id, d.attempt.attempt_id, status="succeeded")
        [done] = await asyncio.wait_for(waiter, 10)
        assert done.status == "succeeded" and time.monotonic() - t0 < 1.5  # not the 2 s fallback


async def _eventually(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_only_a_store_that_does_not_lead_follows_terminal_events(namespace: Settings) -> None:
    """The leader's own commits wake its waiters: its process receives no terminal events (issue 17);
    the standby's follows them, and stops when it takes the lead."""
    async with (
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as leader,
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as standby,
    ):
        assert leader.projector.leader.is_set() and not standby.projector.leader.is_set()
        await _eventually(lambda: leader.read_model._watch_sub is None, "the leader still follows terminal events")
        assert standby.read_model._watch_sub is not None
        await leader.projector.close()
        await _eventually(standby.projector.leader.is_set, "the standby did not take the lead")
        await _eventually(lambda: standby.read_model._watch_sub is None, "the new leader still follows them")
        await _eventually(lambda: leader.read_model._watch_sub is not None, "the old leader does not follow them")


@pytest.mark.parametrize("finish", ["after the subscription is back", "before it is back"])
async def test_a_waiter_wakes_when_the_lead_moves_to_another_process_mid_wait(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch, finish: str
) -> None:
    """A ``wait_for_rollouts`` that began while its process led wakes on its rollout's terminal
    event after the lead moved to another process: the read model follows the stream again, and a
    terminal event published before it did is read once the new leader has projected it. The
    fallback read (``READ_AGAIN_S``) is put out of reach, so only those wake the waiter."""
    from eventlight.store.jetstream.readmodel import waits

    monkeypatch.setattr(waits, "READ_AGAIN_S", 3600.0)
    async with (
        JetStreamLightningStore(namespace) as runner,
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as first,
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as second,
    ):
        assert first.projector.leader.is_set() and not second.projector.leader.is_set()
        r = await first.enqueue_rollout("moved")
        d = await runner.dequeue_rollout(worker_id="w")
        await first.sync(timeout_s=10)
        waiter = asyncio.create_task(first.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=None))
        await _eventually(lambda: len(first.read_model._waiters) == 1, "the waiter did not start")
        await asyncio.sleep(0.05)  # it waits for its projector's commits
        if finish == "before it is back":  # published while the read model follows nothing
            subscribe = first.read_model._subscribe

            async def late_subscribe() -> None:
                await runner.update_attempt(r.rollout_id, d.attempt.attempt_id, status="succeeded")
                await subscribe()

            monkeypatch.setattr(first.read_model, "_subscribe", late_subscribe)
        await first.projector.close()  # the lead moves to the second store's projector
        await _eventually(second.projector.leader.is_set, "the second store did not take the lead")
        if finish == "after the subscription is back":
            await _eventually(lambda: not first.read_model._followers, "the read model did not catch up")
            await runner.update_attempt(r.rollout_id, d.attempt.attempt_id, status="succeeded")
        [done] = await asyncio.wait_for(waiter, 20)  # a waiter nothing wakes waits an hour
        assert done.status == "succeeded"


async def test_a_failed_resubscription_is_tried_again(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """When the lead moves away and subscribing to terminal events again fails (NATS down at that
    moment), the read model tries again, with one warning, until it succeeds: a waiter on a rollout
    another process finishes meanwhile still wakes. The fallback read (``READ_AGAIN_S``) is put out
    of reach, so only the subscription (and its catch-up) can wake it."""
    from eventlight.store.jetstream.readmodel import waits

    monkeypatch.setattr(waits, "READ_AGAIN_S", 3600.0)
    async with (
        JetStreamLightningStore(namespace) as runner,
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as first,
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as second,
    ):
        assert first.projector.leader.is_set() and not second.projector.leader.is_set()
        r = await first.enqueue_rollout("resubscribed")
        d = await runner.dequeue_rollout(worker_id="w")
        await first.sync(timeout_s=10)
        waiter = asyncio.create_task(first.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=None))
        await _eventually(lambda: len(first.read_model._waiters) == 1, "the waiter did not start")
        subscribe, failures = (
            first.read_model._subscribe,
            [ServiceUnavailableError("nats", "subscribing to terminal events failed (injected)")] * 2,
        )
        failed = asyncio.Event()

        async def failing_subscribe() -> None:
            if failures:
                failed.set()
                raise failures.pop()
            await subscribe()

        monkeypatch.setattr(first.read_model, "_subscribe", failing_subscribe)
        with caplog.at_level(logging.DEBUG, logger="eventlight.store.jetstream.readmodel.model"):
            await first.projector.close()  # the lead moves to the second store's projector
            await asyncio.wait_for(failed.wait(), 20)
            await runner.update_attempt(r.rollout_id, d.attempt.attempt_id, status="succeeded")  # nothing follows
            [done] = await asyncio.wait_for(waiter, 20)  # a waiter nothing wakes waits an hour
        assert done.status == "succeeded" and not failures and first.read_model._watch_sub is not None
        warned = [
            rec for rec in caplog.records if rec.name.endswith("readmodel.model") and rec.levelno >= logging.WARNING
        ]
        assert len(warned) == 1, [rec.getMessage() for rec in warned]


@pytest.mark.parametrize("end", ["this process leads again", "the store closes"])
async def test_a_failing_resubscription_stops_being_tried(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch, end: str
) -> None:
    """A re-subscription that keeps failing is tried until this process leads again (its own
    commits wake waiters then) or the store closes: no follower is left behind."""
    async with (
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as first,
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as second,
    ):
        assert first.projector.leader.is_set() and not second.projector.leader.is_set()
        reads, tries = first.read_model, asyncio.Semaphore(0)

        async def failing_subscribe() -> None:
            tries.release()
            raise ServiceUnavailableError("nats", "subscribing to terminal events failed (injected)")

        monkeypatch.setattr(reads, "_subscribe", failing_subscribe)
        await first.projector.close()  # the lead moves to the second store's projector
        for _ in range(2):  # tried, and tried again
            await asyncio.wait_for(tries.acquire(), 20)
        assert reads._followers
        if end == "this process leads again":
            monkeypatch.setattr(reads, "_leads", lambda: True)
        else:
            await first.close()
        await _eventually(lambda: not reads._followers, f"still trying after {end}")
        assert reads._watch_sub is None


async def test_polling_wait_for_rollouts_reads_rows_only_when_one_has_finished(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An algorithm polling with short timeouts costs one status query per call while nothing has
    finished: the rows are read again only after this process's projector committed a finish."""
    async with (
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store,
        JetStreamLightningStore(namespace) as runner,
    ):
        a, b = await store.enqueue_rollout("a"), await store.enqueue_rollout("b")
        reads: list[list[str]] = []
        real = store.read_model.query_rollouts

        async def counting(**kwargs: Any) -> Any:
            reads.append(sorted(kwargs.get("rollout_id_in") or []))
            return await real(**kwargs)

        monkeypatch.setattr(store.read_model, "query_rollouts", counting)
        ids = [a.rollout_id, b.rollout_id]
        for _ in range(5):
            assert await store.wait_for_rollouts(rollout_ids=ids, timeout=0.02) == []
        assert reads == []
        d = await runner.dequeue_rollout(worker_id="w")
        waiter = asyncio.create_task(store.wait_for_rollouts(rollout_ids=ids, timeout=1.5))  # < the 2 s fallback
        await asyncio.sleep(0.05)
        await runner.update_attempt(d.rollout_id, d.attempt.attempt_id, status="succeeded")
        got = await asyncio.wait_for(waiter, 10)  # times out: b never finishes
        assert [r.rollout_id for r in got] == [d.rollout_id] and got[0].status == "succeeded"
        assert reads and all(r == sorted(ids) for r in reads)  # read because of the finish
        reads.clear()
        got = await store.wait_for_rollouts(rollout_ids=ids, timeout=0.02)  # a new call reads the finished row
        assert [r.rollout_id for r in got] == [d.rollout_id] and reads == [[d.rollout_id]]


async def test_the_projector_plans_its_writes_once(namespace: Settings) -> None:
    """The pool plans each read for its parameters (``force_custom_plan``); the projector's writes
    go by primary key and use one generic plan (``batch.GENERIC_PLANS``). Before, every row of every
    batch was planned again (13 % of Postgres's CPU in the bench's sleep-0 scenarios, when span rows
    still went one by one; they go by ``COPY`` now): here, the attempts' upserts."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, pool_size=2) as store:
        for i in range(8):  # several batches, each with a few span rows
            r = await store.enqueue_rollout(i)
            d = await store.dequeue_rollout(worker_id="w")
            assert d is not None
            rid, aid = r.rollout_id, d.attempt.attempt_id
            spans = [Span.from_attributes(attributes={"k": k}, rollout_id=rid, attempt_id=aid) for k in range(3)]
            await store.add_spans_numbered(rid, aid, spans)
            await store.sync(timeout_s=10)
        assert store.pool is not None
        held: list[Any] = []
        plans: list[tuple[int, int]] = []
        try:
            for _ in range(2):  # the pool's connections the projector's leader lock does not hold
                try:
                    held.append(await asyncio.wait_for(store.pool.acquire(), 1))
                except TimeoutError:
                    break
            for conn in held:
                try:
                    row = await conn.fetchrow(
                        "SELECT coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0)"
                        " FROM pg_prepared_statements WHERE statement LIKE '%INSERT INTO attempts%'"
                    )
                except asyncpg.UndefinedColumnError:
                    pytest.skip("pg_prepared_statements counts plans from PostgreSQL 14")
                plans.append((int(row[0]), int(row[1])))
        finally:
            for conn in held:
                await store.pool.release(conn)
    generic, custom = (sum(p[i] for p in plans) for i in range(2))
    assert generic >= 8 and custom == 0, f"attempt upserts: {generic} generic plans, {custom} custom plans"


# -- failures of the servers under the projector ----------------------------------------------


async def test_postgres_out_of_connection_slots_is_named_waited_out_and_loses_nothing(
    namespace: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """peer_failures C25: Postgres says "too many connections" because other clients hold every
    slot (here the role's ``CONNECTION LIMIT``, which Postgres enforces as it does
    ``max_connections``). The store's connections are cut while two other clients fill the limit:
    runners' writes go on (NATS only); a read and a store opened meanwhile (told not to wait:
    ``pg_open_wait_s=0``; ``test_pg_open`` has the wait) fail with ``ServiceUnavailableError``
    naming the cause. One slot frees: the projector leads again but
    cannot open a connection to write with; two: it catches up. Meanwhile it retries at growing
    intervals, one warning line a try, instead of crashing or spinning (before, a batch it could
    not write logged a traceback every second), and the read model ends with every event once
    (it equals a rebuild of the log)."""
    assert namespace.pg_dsn is not None
    admin = await asyncpg.connect(namespace.pg_dsn)
    others: list[asyncpg.Connection] = []
    ledger = Ledger()
    caplog.set_level(logging.INFO, logger="eventlight")
    password = "c25-not-shown"

    def projector_lines(part: str = "") -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name.startswith(PROJECTOR_LOGGER) and part in r.getMessage()]

    def refused(part: str) -> list[str]:
        return [r.getMessage() for r in projector_lines(part) if "too many connections" in r.getMessage()]

    async def until(predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    try:
        async with role_of(namespace, password, prefix="c25") as role:
            dsn = as_role(namespace.pg_dsn, role, password)
            async with (
                JetStreamLightningStore(namespace) as runner,  # a runner's store: NATS only
                JetStreamLightningStore(namespace, pg_dsn=dsn, pool_size=2) as store,
            ):
                await workload(runner, ledger, n=4, spans=3)
                await store.sync_all(timeout_s=15)
                others = [await asyncpg.connect(dsn) for _ in range(2)]  # other processes' pools
                await admin.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT 2')  # they hold every slot
                with pytest.raises(asyncpg.TooManyConnectionsError):  # what Postgres says now
                    await asyncpg.connect(dsn)
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1 AND pid <> ALL($2)",
                    role,
                    [c.get_server_pid() for c in others],
                )  # the store's connections are gone (a Postgres restart, a proxy's idle timeout)
                await workload(runner, ledger, n=6, spans=3)  # the runners go on meanwhile
                last = await stream_last_seq(runner)
                with pytest.raises(ServiceUnavailableError, match="too many connections") as read:
                    await store.sync(last, timeout_s=1.5)
                at_once = msgspec.structs.replace(namespace, pg_open_wait_s=0)  # no wait (EVENTLIGHT_PG_OPEN_WAIT_S)
                with pytest.raises(ServiceUnavailableError, match="too many connections") as opened:
                    await JetStreamLightningStore(at_once, pg_dsn=dsn).start()
                await until(lambda: len(refused("projector of")) >= 2, "the projector did not try twice to lead")
                await others.pop().close()  # one slot frees: the lock's connection, none to write with
                await until(store.projector.leader.is_set, "the projector did not lead again")
                await until(lambda: len(projector_lines("projector batch")) >= 2, "no batch was tried twice")
                await others.pop().close()
                await store.sync(last, timeout_s=30)
                verdict = await check_log_and_read_model(runner, namespace, ledger)
    finally:
        for conn in others:
            await conn.close()
        await admin.close()
    assert (verdict.lost, verdict.doubled, verdict.stuck) == (0, 0, 0)
    assert len(ledger.finished) == 10 and verdict.spans == 10 * 2 * 3
    assert read.value.server == "Postgres" and password not in str(opened.value)
    assert not [r for r in projector_lines() if r.levelno >= logging.ERROR or r.exc_info], "a retry logged a traceback"
    for part in ("projector of", "batch"):  # competing for the lead, writing a batch
        tries = refused(part)
        delays = [float(m.group(1)) for line in tries if (m := re.search(r"retrying (?:it )?in ([\d.]+) s", line))]
        assert len(delays) == len(tries) >= 1 and delays == sorted(delays), tries  # growing intervals


@pytest.mark.parametrize("failure", ["server_down", "timeout_mid_fetch"])
async def test_a_failed_fetch_is_read_again_from_the_checkpoint(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failure: str
) -> None:
    """peer_failures C18 on the projector's side: its pull from JetStream fails once, either before
    anything came (``server_down``: the connection closed under the request) or after the server
    had delivered a batch that never reached the projector (``timeout_mid_fetch``: the batch is
    lost in the client, a gap in the consumer's delivery sequence shows it). The projector says so
    in one warning line, reads again from its checkpoint, and the read model ends with every event
    once (it equals a rebuild of the log)."""
    subscribe = Projector._subscribe
    injected: dict[str, int] = {}

    async def failing_subscribe(self: Projector, after_seq: int) -> Any:
        psub = await subscribe(self, after_seq)
        fetch = psub.fetch

        async def failing_fetch(batch: int = 1, timeout: float | None = 5, heartbeat: Any = None) -> Any:
            if injected:  # it failed once already
                return await fetch(batch, timeout, heartbeat)
            if failure == "server_down":
                injected["dropped"] = 0
                raise nats.errors.ConnectionClosedError
            msgs = await fetch(batch, timeout, heartbeat)
            if msgs:
                injected["dropped"] = len(msgs)
                raise nats.errors.TimeoutError
            return msgs

        psub.fetch = failing_fetch
        return psub

    monkeypatch.setattr(Projector, "_subscribe", failing_subscribe)
    caplog.set_level(logging.INFO, logger="eventlight")
    ledger = Ledger()
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await workload(store, ledger, n=8, spans=3)
        await store.enqueue_rollout("after")  # an event after the lost batch, whenever it came
        await store.sync_all(timeout_s=30)
        verdict = await check_log_and_read_model(store, namespace, ledger)
        rollouts = await store.query_rollouts()
    assert "dropped" in injected and (failure == "server_down") == (injected["dropped"] == 0)
    assert (verdict.lost, verdict.doubled, verdict.stuck) == (0, 0, 0)
    assert len(rollouts) == len({r.rollout_id for r in rollouts}) == 9 and verdict.spans == 8 * 2 * 3
    lines = [r for r in caplog.records if r.name.startswith(PROJECTOR_LOGGER) and r.levelno >= logging.WARNING]
    assert len(lines) == 1 and not lines[0].exc_info, [r.getMessage() for r in lines]
    # the error's type and nats-py's own text ("nats: connection closed"), not a bare repr
    expected = "ConnectionClosedError: nats: connection closed" if failure == "server_down" else "delivery 1 expected"
    assert expected in lines[0].getMessage() and "reading again from" in lines[0].getMessage()


async def test_the_leaders_retry_waits_as_long_as_its_warning_says(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A leader that fails in a row waits 0.5, 1, 2, 4, 5, 5 s, and each warning names the wait
    that follows it (it used to name half of it)."""
    from types import SimpleNamespace

    from eventlight.store.jetstream.projector import leader

    p = Projector.__new__(Projector)
    p._stopping = False
    p.term = 0
    p.last_error = None
    p._decided = asyncio.Event()
    p.log = SimpleNamespace(settings=SimpleNamespace(namespace="el_retry"))  # type: ignore[assignment]
    tries = 0

    async def lead() -> None:
        nonlocal tries
        tries += 1
        if tries > 6:
            p._stopping = True
            return
        raise ConnectionRefusedError("postgres is down")

    async def step_down() -> None:
        return None

    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    monkeypatch.setattr(p, "_lead", lead)
    monkeypatch.setattr(p, "_step_down", step_down)
    monkeypatch.setattr(leader.asyncio, "sleep", sleep)
    with caplog.at_level(logging.WARNING, logger=leader.__name__):
        await p._run()
    said = [float(m) for m in re.findall(r"retrying in ([\d.]+) s", caplog.text)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert said == waits


async def test_a_leader_failing_for_hours_keeps_retrying(monkeypatch: pytest.MonkeyPatch) -> None:
    """The leader's wait was ``RETRY_S * 2**failures`` with ``failures`` counting every failure in a
    row: at the 1025th (some 85 minutes of Postgres down, 5 s a try) the float overflowed, the
    ``OverflowError`` left ``_run`` and the projector stopped for good, Postgres back or not."""
    from types import SimpleNamespace

    from eventlight.store.jetstream.projector import leader

    p = Projector.__new__(Projector)
    p._stopping = False
    p.term = 0
    p.last_error = None
    p._decided = asyncio.Event()
    p.log = SimpleNamespace(settings=SimpleNamespace(namespace="el_retry"))  # type: ignore[assignment]
    tries = 0

    async def lead() -> None:
        nonlocal tries
        tries += 1
        if tries > 1100:
            p._stopping = True
            return
        raise ConnectionRefusedError("postgres is down")

    async def step_down() -> None:
        return None

    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)

    monkeypatch.setattr(p, "_lead", lead)
    monkeypatch.setattr(p, "_step_down", step_down)
    monkeypatch.setattr(leader.asyncio, "sleep", sleep)
    monkeypatch.setattr(logging.getLogger(leader.__name__), "disabled", True)  # 1100 warnings
    await p._run()
    assert tries == 1101 and len(waits) == 1100 and set(waits[4:]) == {5.0}


async def _whole_stream(store: JetStreamLightningStore) -> list[Any]:
    """Every message of the namespace from the start of the stream, as a redelivery would bring them."""
    sub = await store.log.js.pull_subscribe(f"{store.log.prefix}.>", stream=store.log.stream)
    msgs: list[Any] = []
    while True:
        try:
            msgs.extend(await sub.fetch(100, timeout=0.5))
        except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises either, depending on timing
            break
    await sub.unsubscribe()
    return msgs


async def test_spans_already_projected_are_copied_once_with_the_checkpoint(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The projector writes a batch's spans with ``COPY`` (``BatchWriter._write_spans``). A batch
    that holds spans already in the read model (the same spans published again, as a runner that
    retried a publish might, redelivered with the messages the checkpoint has passed) and a new span
    published twice adds each span once, keeps its first copy, moves the checkpoint to the batch's
    last sequence, and dead-letters nothing."""
    copies: list[str] = []
    copy = asyncpg.Connection.copy_records_to_table

    async def counting_copy(self: asyncpg.Connection, table_name: str, **kwargs: Any) -> Any:
        copies.append(table_name)
        return await copy(self, table_name, **kwargs)

    monkeypatch.setattr(asyncpg.Connection, "copy_records_to_table", counting_copy)
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, run_projector=False) as store:
        r = await store.start_rollout("x")
        rid, aid = r.rollout_id, r.attempt.attempt_id
        subject = f"{store.log.prefix}.s.{rid}.{aid}"

        def make(name: str, k: int) -> Span:
            return Span.from_attributes(attributes={"k": k}, rollout_id=rid, attempt_id=aid, name=name)

        await store.add_spans_numbered(rid, aid, [make("first", k) for k in range(3)])
        projector = Projector(store.log, store.pool)
        await projector._become_leader()
        try:
            first = await _whole_stream(store)
            await projector.apply(first)
            assert copies == ["spans"]  # a batch of new spans goes by COPY

            [spans_msg] = [m for m in first if m.subject == subject]
            await store.log.js.publish(subject, spans_msg.data.replace(b'"name":"first"', b'"name":"again"'))
            [new] = await store.add_spans_numbered(rid, aid, [make("new", 3)])
            [new_msg] = [m for m in await _whole_stream(store) if b'"name":"new"' in m.data]
            await store.log.js.publish(subject, new_msg.data.replace(b'"name":"new"', b'"name":"new again"'))
            batch = await _whole_stream(store)  # the first batch again, then the copies and the new span
            await projector.apply(batch)

            async with store.pool.acquire() as conn:
                rows = await conn.fetch("SELECT span_id, name, stream_seq FROM spans ORDER BY sequence_id")
                checkpoint = await conn.fetchval("SELECT last_seq FROM projector_checkpoint WHERE id = 0")
            assert [row["name"] for row in rows] == ["first", "first", "first", "new"]
            assert len({row["span_id"] for row in rows}) == 4 and rows[-1]["span_id"] == new.span_id
            assert rows[0]["stream_seq"] == spans_msg.metadata.sequence.stream
            assert checkpoint == projector.checkpoint == batch[-1].metadata.sequence.stream
            assert projector.dead_letters == 0 and copies == ["spans", "spans"]
            assert (await store.statistics())["total_spans"] == 4
        finally:
            await projector.close()


async def test_a_batch_opens_and_fences_its_transaction_in_one_round_trip(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch with spans costs two statements besides its writes (issue 17): ``BEGIN``, the plan
    setting, the spans' savepoint and the fenced checkpoint update in one; ``COMMIT``. It was six
    (``BEGIN``, ``SET LOCAL``, the update, ``SAVEPOINT``, ``RELEASE``, ``COMMIT``), then three (the
    savepoint on its own), each a round trip of the algorithm's process. The rows and the
    checkpoint still commit together."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, run_projector=False) as store:
        r = await store.start_rollout("x")
        rid, aid = r.rollout_id, r.attempt.attempt_id
        spans = [Span.from_attributes(attributes={"k": k}, rollout_id=rid, attempt_id=aid) for k in range(3)]
        await store.add_spans_numbered(rid, aid, spans)
        projector = Projector(store.log, store.pool)
        await projector._become_leader()
        try:
            msgs = await _whole_stream(store)
            statements: list[str] = []
            execute = asyncpg.Connection.execute

            async def counting(self: asyncpg.Connection, query: str, *args: Any, **kwargs: Any) -> Any:
                statements.append(query)
                return await execute(self, query, *args, **kwargs)

            monkeypatch.setattr(asyncpg.Connection, "execute", counting)
            await projector.apply(msgs)
            monkeypatch.undo()
            assert len(statements) == 2, statements
            assert statements[0].startswith("BEGIN;") and "SAVEPOINT spans;" in statements[0]
            # the fenced update last: the status the simple query answers is its own
            assert statements[0].rsplit(";", 1)[-1].strip().startswith("UPDATE projector_checkpoint")
            assert statements[-1] == "COMMIT"
            async with store.pool.acquire() as conn:
                checkpoint = await conn.fetchval("SELECT last_seq FROM projector_checkpoint WHERE id = 0")
                rows = await conn.fetchval("SELECT count(*) FROM spans")
            assert checkpoint == projector.checkpoint == msgs[-1].metadata.sequence.stream and rows == 3
        finally:
            await projector.close()


async def test_a_batch_cancelled_in_its_first_round_trip_gives_no_connection_back_in_a_transaction(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch cancelled (its projector closing) while its first statement (``BEGIN; SET LOCAL ...;
    UPDATE projector_checkpoint ...``) is in flight: asyncpg learns of the ``BEGIN`` only from its
    answer, so the batch's roll-back saw no transaction and gave the connection back with one open
    on the server; the pool's reset rolled it back with "Resetting connection with an active
    transaction" through the event loop's exception handler (an ERROR line). The cut query is
    cancelled on the server (not left running on a closed connection), nothing of the batch is
    committed, and the batch applies in full afterwards."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, run_projector=False) as store:
        r = await store.start_rollout("x")
        rid, aid = r.rollout_id, r.attempt.attempt_id
        await store.add_spans_numbered(
            rid, aid, [Span.from_attributes(attributes={"k": 1}, rollout_id=rid, attempt_id=aid)]
        )
        projector = Projector(store.log, store.pool)
        await projector._become_leader()
        try:
            msgs = await _whole_stream(store)
            sent = asyncio.Event()
            execute = asyncpg.Connection.execute

            async def slow_begin(self: asyncpg.Connection, query: str, *args: Any, **kwargs: Any) -> Any:
                if query.startswith("BEGIN;"):  # the batch's first round trip, held on the server
                    query = query.replace("BEGIN;", "BEGIN; SELECT pg_sleep(30) AS cut_batch;", 1)
                    sent.set()
                return await execute(self, query, *args, **kwargs)

            monkeypatch.setattr(asyncpg.Connection, "execute", slow_begin)
            caplog.set_level(logging.ERROR, logger="asyncio")
            batch = asyncio.create_task(projector.apply(msgs))
            await asyncio.wait_for(sent.wait(), 10)
            batch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await batch
            monkeypatch.undo()
            assert not [m for m in caplog.messages if "active transaction" in m], caplog.messages
            async with store.pool.acquire() as conn:
                assert await conn.fetchval("SELECT count(*) FROM spans") == 0
                running = await conn.fetchval(  # the cut query was cancelled on the server, not left running
                    "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%AS cut_batch%'"
                    " AND pid <> pg_backend_pid()"
                )
                assert running == 0
            await projector.apply(msgs)
            async with store.pool.acquire() as conn:
                checkpoint = await conn.fetchval("SELECT last_seq FROM projector_checkpoint WHERE id = 0")
                assert await conn.fetchval("SELECT count(*) FROM spans") == 1
            assert checkpoint == projector.checkpoint == msgs[-1].metadata.sequence.stream
        finally:
            await projector.close()


async def test_a_term_ended_by_two_tasks_at_once_leaves_no_exception_unretrieved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lock connection lost: the lock watch ends the term with ``Deposed``, and the projection,
    cancelled inside a query the same loss ends, raises ``Deposed`` too instead of stopping. Nobody
    took the second, so asyncio logged it at ERROR with its traceback ("Task exception was never
    retrieved") when the task was collected."""
    import gc
    from types import SimpleNamespace

    from eventlight.store.jetstream.projector.common import Deposed

    p = Projector.__new__(Projector)
    p._stopping = False
    p.leader = asyncio.Event()
    p.on_leadership = None
    p.partition = 0
    p.log = SimpleNamespace(settings=SimpleNamespace(namespace="el_two", retention_s=None))  # type: ignore[assignment]

    async def nothing() -> None:
        return None

    async def lock_lost() -> None:
        raise Deposed("the advisory-lock connection to Postgres was lost")

    async def projection() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:  # as asyncpg's timeout can turn a cancel into the query's error
            raise Deposed("the advisory-lock connection to Postgres was lost") from None

    async def watchdog(_stopping: object) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(p, "_become_leader", nothing)
    monkeypatch.setattr(p, "_watch_lock", lock_lost)
    monkeypatch.setattr(p, "_project", projection)
    p.watchdog = SimpleNamespace(run=watchdog)  # type: ignore[assignment]
    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        with pytest.raises(Deposed):
            await p._lead()
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert [c["message"] for c in reported] == []


async def test_a_batch_whose_connection_was_lost_reports_what_failed_it() -> None:
    """A connection lost mid-batch is given back to the pool by asyncpg as it sees it close; the
    proxy the batch holds then raises ``InterfaceError`` ("connection has been released back to
    the pool") on any call. Rolling back called one, and that error replaced the batch's own
    ("connection was closed in the middle of operation") in the projector's warning line."""
    from eventlight.store.jetstream.projector.batch import _roll_back

    class Released:
        def is_closed(self) -> bool:
            raise asyncpg.InterfaceError(
                "cannot call Connection.is_closed(): connection has been released back to the pool"
            )

        def terminate(self) -> None:
            raise asyncpg.InterfaceError(
                "cannot call Connection.terminate(): connection has been released back to the pool"
            )

    await _roll_back(Released())  # type: ignore[arg-type]
    await _roll_back(Released(), cut=True)  # type: ignore[arg-type]
    await _roll_back(Released(), stuck=True)  # type: ignore[arg-type]


async def test_a_stuck_connection_is_closed_not_given_back() -> None:
    """A batch that asyncpg refused on a stuck connection (``InternalClientError``) closes it, so
    that the pool does not hand the same connection to the retry."""
    from eventlight.store.jetstream.projector.batch import _roll_back

    class Stuck:
        terminated = False

        def is_closed(self) -> bool:
            return False

        def is_in_transaction(self) -> bool:
            return False

        def terminate(self) -> None:
            self.terminated = True

    conn = Stuck()
    await _roll_back(conn, stuck=True)  # type: ignore[arg-type]
    assert conn.terminated


async def test_query_spans_of_one_attempt_skip_the_per_row_attempt_lookup(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``query_spans(rollout_id)`` orders spans by their attempt's number first. With one attempt
    (most rollouts) the spans index gives that order already: the query leaves out the per-row
    lookup of each span's attempt and the sort on it (half of Postgres' time for a 20-span rollout:
    0.20 -> 0.10 ms), and reads each row as one JSON object (``SqlQueries._all_spans``). A retried
    rollout's spans are read again, in attempt order."""
    from eventlight.store.jetstream import pg
    from eventlight.store.jetstream.readmodel.queries import ATTEMPT_ORDER, SqlQueries

    reads: list[str] = []
    real_page, real_all = pg.fetch_page, SqlQueries._all_spans

    async def recording(*args: Any, **kw: Any) -> Any:
        reads.append(args[5])
        return await real_page(*args, **kw)

    async def recording_all(*args: Any, **kw: Any) -> Any:
        reads.append("all spans")
        return await real_all(*args, **kw)

    monkeypatch.setattr(pg, "fetch_page", recording)
    monkeypatch.setattr(SqlQueries, "_all_spans", recording_all)
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        r = await store.enqueue_rollout("q", config=config)
        first = await store.dequeue_rollout()
        assert first is not None
        a1 = first.attempt.attempt_id
        await store.add_many_spans([_span(r.rollout_id, a1, i) for i in (2, 1)])
        reads.clear()
        assert [s.sequence_id for s in await store.query_spans(r.rollout_id)] == [1, 2]
        assert reads == ["all spans"]

        await store.update_attempt(r.rollout_id, a1, status="failed")
        second = await store.dequeue_rollout()
        assert second is not None
        await store.add_span(_span(r.rollout_id, second.attempt.attempt_id, 0))
        reads.clear()
        got = await store.query_spans(r.rollout_id)
        assert [(s.attempt_id, s.sequence_id) for s in got] == [(a1, 1), (a1, 2), (second.attempt.attempt_id, 0)]
        assert len(reads) == 2 and reads[0] == "all spans" and ATTEMPT_ORDER in reads[1]


def _span(rollout_id: str, attempt_id: str, seq: int) -> Span:
    return Span.from_attributes(
        attributes={"i": seq}, rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=seq, name=f"s{seq}"
    )


async def test_query_spans_of_a_rollout_retried_between_its_two_reads_stay_in_attempt_order(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``query_spans(rollout_id)`` reads a rollout's spans without the attempt order first and again
    with it when they hold several attempts. A retry that lands between the two reads (a new
    attempt and its spans) leaves either read's answer whole: the first's (one attempt: its spans,
    its total) or the second's (every attempt, in attempt order, and its total); never a mix."""
    from eventlight.store.jetstream import pg
    from eventlight.store.jetstream.readmodel.queries import SqlQueries

    real_page, real_all = pg.fetch_page, SqlQueries._all_spans
    between: list[Any] = []

    async def interleaved(*args: Any, **kw: Any) -> Any:
        out = await real_page(*args, **kw)
        if between:
            await between.pop()()
        return out

    async def interleaved_all(*args: Any, **kw: Any) -> Any:
        out = await real_all(*args, **kw)
        if between:
            await between.pop()()
        return out

    monkeypatch.setattr(pg, "fetch_page", interleaved)
    monkeypatch.setattr(SqlQueries, "_all_spans", interleaved_all)
    config = RolloutConfig(max_attempts=3, retry_condition=["failed"])
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        r = await store.enqueue_rollout("q", config=config)
        rid = r.rollout_id
        attempts: list[str] = []

        async def retry(seqs: tuple[int, ...]) -> None:
            if attempts:
                await store.update_attempt(rid, attempts[-1], status="failed")
            claimed = await store.dequeue_rollout()
            assert claimed is not None and claimed.rollout_id == rid
            attempts.append(claimed.attempt.attempt_id)
            await store.add_many_spans([_span(rid, attempts[-1], i) for i in seqs])
            await store.sync_all(timeout_s=10)

        await retry((5, 6))
        between.append(lambda: retry((1,)))  # lands after the first read, which saw one attempt
        got = await store.query_spans(rid)
        assert [(s.attempt_id, s.sequence_id) for s in got] == [(attempts[0], 5), (attempts[0], 6)]
        assert got.total == 2
        between.append(lambda: retry((0,)))  # the first read saw two attempts; the second reads three
        got = await store.query_spans(rid)
        expected = [(attempts[0], 5), (attempts[0], 6), (attempts[1], 1), (attempts[2], 0)]
        assert [(s.attempt_id, s.sequence_id) for s in got] == expected and got.total == 4
        page = await store.query_spans(rid, limit=2, offset=1)
        assert [(s.attempt_id, s.sequence_id) for s in page] == expected[1:3] and page.total == 4
        desc = await store.query_spans(rid, sort_order="desc", limit=-1, offset=1)
        assert [(s.attempt_id, s.sequence_id) for s in desc] == expected[::-1][1:] and desc.total == 4
