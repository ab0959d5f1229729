"""Bad input at the store API and on the stream's subjects (issue 12, items 4 and 7).

Every input gets one error from eventlight's tree (``InvalidInputError``; ``InvalidTypeError`` is also
a ``TypeError``), nothing is written, and the store keeps serving. Foreign payloads published on the
stream's subjects are dead-lettered by the projector, which goes on. Each input is printed with the
error it got.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import BadInputRows

from eventlight.core.errors import (
    AttemptNotFoundError,
    EventlightError,
    InvalidInputError,
    InvalidTypeError,
    ResourcesNotFoundError,
    RolloutNotFoundError,
    ServiceUnavailableError,
)
from eventlight.core.types import PromptTemplate, RolloutConfig, Span
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore


def _deep(n: int) -> Any:
    value: Any = []
    for _ in range(n):
        value = [value]
    return value


def _span(rid: str, aid: str, **over: Any) -> Span:
    fields: dict[str, Any] = dict(
        rollout_id=rid, attempt_id=aid, sequence_id=1, trace_id="t" * 32, span_id="s" * 16, parent_id=None, name="x"
    )
    return Span(**{**fields, **over})


TYPE, INPUT = InvalidTypeError, InvalidInputError
BAD: dict[str, tuple[Any, type[Exception], str]] = {  # name: (call, error class, what its message says)
    "enqueue mode=123": (lambda s, r: s.enqueue_rollout("x", mode=123), TYPE, "got `int` - at `mode`"),
    "RolloutConfig(timeout_seconds='10')": (
        lambda s, r: s.enqueue_rollout("x", config=RolloutConfig(timeout_seconds="10")),
        TYPE,
        "at `config.timeout_seconds`",
    ),
    "enqueue input=object()": (lambda s, r: s.enqueue_rollout(object()), TYPE, "cannot be stored as JSON"),
    "enqueue input lone surrogate": (lambda s, r: s.enqueue_rollout("a\ud800b"), INPUT, "not valid Unicode text"),
    "enqueue input 3000-deep": (lambda s, r: s.enqueue_rollout(_deep(3000)), INPUT, "nested deeper than 256 levels"),
    "enqueue input 9 MB": (lambda s, r: s.enqueue_rollout("x" * (9 * 1024 * 1024)), INPUT, "over the 8,388,608"),
    "update_attempt metadata='str'": (
        lambda s, r: s.update_attempt(r[0], r[1], metadata="str"),
        TYPE,
        "got `str` - at `metadata`",
    ),
    "update_attempt last_heartbeat_time='now'": (
        lambda s, r: s.update_attempt(r[0], r[1], last_heartbeat_time="now"),
        TYPE,
        "at `last_heartbeat_time`",
    ),
    "update_rollout config='x'": (lambda s, r: s.update_rollout(r[0], config="x"), TYPE, "at `config`"),
    "update_rollout mode=[1]": (lambda s, r: s.update_rollout(r[0], mode=[1]), TYPE, "got `array` - at `mode`"),
    "PromptTemplate(template=123)": (
        lambda s, r: s.add_resources({"p": PromptTemplate(template=123)}),
        TYPE,
        "at `resources[...].template`",
    ),
    "PromptTemplate(engine='x')": (
        lambda s, r: s.add_resources({"p": PromptTemplate(template="t", engine="x")}),
        TYPE,
        "Invalid enum value 'x'",
    ),
    "resources {'p': 'str'}": (lambda s, r: s.add_resources({"p": "str"}), INPUT, "not an LLM or PromptTemplate"),
    "resources 'str'": (lambda s, r: s.add_resources("str"), INPUT, "must be a dict of name -> resource"),
    "span sequence_id=2**31 (over the read model's integer)": (
        lambda s, r: s.add_span(_span(r[0], r[1], sequence_id=2**31)),
        INPUT,
        "invalid sequence_id 2147483648",
    ),
    "span sequence_id=10**5000 (too long to print)": (
        lambda s, r: s.add_span(_span(r[0], r[1], sequence_id=10**5000)),
        INPUT,
        "invalid sequence_id (an integer of 5001 digits)",
    ),
    "span sequence_id=2**63": (
        lambda s, r: s.add_span(_span(r[0], r[1], sequence_id=2**63)),
        INPUT,
        "invalid sequence_id 9223372036854775808",
    ),
    "query_rollouts status_in='queuing'": (
        lambda s, r: s.query_rollouts(status_in="queuing"),
        INPUT,
        "use ['queuing']",
    ),
    "query_rollouts status_in=[1]": (lambda s, r: s.query_rollouts(status_in=[1]), INPUT, "must be strings, got 1"),
    "query_workers status_in='idle'": (lambda s, r: s.query_workers(status_in="idle"), INPUT, "use ['idle']"),
    "update_attempt on an unknown rollout": (
        lambda s, r: s.update_attempt("ro-unknown0001", "at-unknown01", status="succeeded"),
        RolloutNotFoundError,
        "ro-unknown0001",
    ),
    "update_attempt an unknown attempt": (
        lambda s, r: s.update_attempt(r[0], "at-unknown01", status="succeeded"),
        AttemptNotFoundError,
        "at-unknown01",
    ),
    "update_rollout an unknown rollout": (
        lambda s, r: s.update_rollout("ro-unknown0001", status="cancelled"),
        RolloutNotFoundError,
        "ro-unknown0001",
    ),
    "enqueue resources_id unknown": (
        lambda s, r: s.enqueue_rollout("x", resources_id="rs-unknown0001"),
        ResourcesNotFoundError,
        "rs-unknown0001",
    ),
}


async def _counts(store: Any) -> tuple[int, int]:
    return len(await store.query_rollouts()), len(await store.query_resources())


async def test_bad_inputs_get_one_clear_error_and_write_nothing(
    store: Any, backend: str, bad_input_table: BadInputRows
) -> None:
    r = await store.start_rollout("target")
    target = (r.rollout_id, r.attempt.attempt_id)
    before = await _counts(store)
    for name, (call, error, says) in BAD.items():
        with pytest.raises(error) as info:
            await call(store, target)
        assert isinstance(info.value, EventlightError) and says in str(info.value), (name, info.value)
        bad_input_table.append((f"store API ({backend})", name, f"{type(info.value).__name__}: {info.value}"[:160]))
    assert await _counts(store) == before
    [attempt] = await store.query_attempts(r.rollout_id)
    assert attempt.metadata in (None, {}) and attempt.last_heartbeat_time is None or attempt.status == "preparing"
    # the rollout is not poisoned, and the store keeps serving
    assert (await store.update_attempt(*target, metadata={"ok": True})).metadata == {"ok": True}
    assert (await store.enqueue_rollout("after")).input == "after"
    assert await store.get_rollout_by_id("ro-unknown0001") is None  # Agent-lightning: a get of an unknown id is None


def test_type_errors_are_also_type_errors() -> None:
    assert issubclass(InvalidTypeError, TypeError) and issubclass(InvalidTypeError, ValueError)


FOREIGN_SUBJECTS = {
    "r.<rid>.e not JSON": ("r.{rid}.e", b"{not json"),
    "r.<rid>.e unknown type": ("r.{rid}.e", b'{"type":"nope","v":1}'),
    "r.<rid>.q wrong field type": ("r.{rid}.q", b'{"type":"rollout_updated","v":2,"time":"x","rollout_id":"{rid}"}'),
    "w.<wid> empty": ("w.wfoo", b""),
    "res.<id> array": ("res.rsfoo", b"[1,2]"),
    "unknown subject": ("zz.top", b"{}"),
}


async def test_foreign_payloads_on_stream_subjects_are_dead_lettered(
    namespace: Settings, bad_input_table: BadInputRows
) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        other = await store.start_rollout("other")  # a rollout the foreign events do not touch
        seqs: dict[str, int] = {}
        for name, (subject, data) in FOREIGN_SUBJECTS.items():
            rid = "ro-foreign0001"
            ack = await store.log.js.publish(
                f"{store.log.prefix}.{subject.format(rid=rid)}", data.replace(b"{rid}", rid.encode())
            )
            seqs[name] = ack.seq
        after = await store.enqueue_rollout("after")
        await store.sync_all(timeout_s=15)
        async with store.pool.acquire() as conn:
            dead = await conn.fetch("SELECT stream_seq, subject, error FROM projector_dead_letters ORDER BY stream_seq")
        errors = {d["stream_seq"]: d["error"] for d in dead}
        for name, (_, data) in FOREIGN_SUBJECTS.items():
            got = (
                f"dead-lettered: {errors[seqs[name]]}" if seqs[name] in errors else "no event: skipped, no dead letter"
            )
            bad_input_table.append(("stream subjects", f"{name}: {data[:40]!r}", got[:160]))
        assert len(dead) >= len(FOREIGN_SUBJECTS) - 1  # an empty payload may be no event at all
        assert all("not an eventlight event" in d["error"] for d in dead), dead
        assert {r.rollout_id for r in await store.query_rollouts()} == {other.rollout_id, after.rollout_id}
        await store.update_attempt(other.rollout_id, other.attempt.attempt_id, status="succeeded")
        await store.sync(timeout_s=10)
        assert (await store.get_rollout_by_id(other.rollout_id)).status == "succeeded"


QUEUE_ENTRIES = {
    "not an event, no rollout": ("r.ro-qbad00001.q", b"\xffnot an event"),
    "empty object, no rollout": ("r.ro-qbad00002.q", b"{}"),
    "a queue event of an unknown rollout": (
        "r.ro-qbad00003.q",
        b'{"type":"rollout_updated","v":2,"time":1.0,"rollout_id":"ro-qbad00003"}',
    ),
}


async def test_queue_entries_no_rollout_stands_behind_are_dropped(
    namespace: Settings, bad_input_table: BadInputRows, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    async with JetStreamLightningStore(namespace) as store:
        for subject, data in QUEUE_ENTRIES.values():
            await store.log.js.publish(f"{store.log.prefix}.{subject}", data)
        with caplog.at_level(logging.WARNING, logger="eventlight.store.service.claims"):
            got = [await store.dequeue_rollout(worker_id="w-bad") for _ in QUEUE_ENTRIES]
        assert got == [None] * len(QUEUE_ENTRIES)
        dropped = [r.getMessage() for r in caplog.records if "dropping queue entry" in r.getMessage()]
        for (name, (subject, _)), line in zip(QUEUE_ENTRIES.items(), dropped, strict=True):
            assert subject.split(".")[1] in line, (subject, line)
            bad_input_table.append(("queue", name, f"dequeue_rollout() -> None; {line}"[:160]))
        good = await store.enqueue_rollout("after")
        claimed = await store.dequeue_rollout(worker_id="w-bad")
        assert claimed is not None and claimed.rollout_id == good.rollout_id  # the queue keeps serving
        info = await store.log.js.consumer_info(store.log.stream, "runners")
        assert info.num_pending == 0 and info.num_ack_pending == 1  # the bad ones acknowledged, not redelivered


async def test_a_store_on_servers_that_are_down_says_which(namespace: Settings, bad_input_table: BadInputRows) -> None:
    from eventlight.net import free_port

    dead_nats = f"nats://127.0.0.1:{free_port()}"
    dead_pg = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/postgres"
    cases = {
        "NATS down": (JetStreamLightningStore(namespace, nats_url=dead_nats), "NATS is not reachable"),
        "NATS cluster all down": (
            JetStreamLightningStore(namespace, nats_url=f"{dead_nats},{dead_nats}"),
            "nothing answers",
        ),
        "Postgres down": (JetStreamLightningStore(namespace, pg_dsn=dead_pg), "127.0.0.1"),
    }
    for name, (store, says) in cases.items():
        with pytest.raises(ServiceUnavailableError) as info:
            await store.start()
        await store.close()
        assert says in str(info.value) and "secret" not in str(info.value), info.value
        bad_input_table.append(("store API (servers down)", name, f"ServiceUnavailableError: {info.value}"[:160]))
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:  # the real ones still serve
        r = await store.enqueue_rollout("after")
        assert (await store.get_rollout_by_id(r.rollout_id)) is not None
