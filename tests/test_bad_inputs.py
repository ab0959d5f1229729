"""Bad input at the store API and on the stream's subjects (issue 12, items 4 and 7).

Every input gets one error from eventlight's tree (``InvalidInputError``; ``InvalidTypeError`` is also
a ``TypeError``), nothing is written, and the store keeps serving. Foreign payloads published on the
stream's subjects are dead-lettered by the projector, which goes on. Each input is printed with the
error it got.
"""

from __future__ import annotations

from typing import Any

import pytest

from eventlight.core.errors import InvalidInputError, InvalidTypeError
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


BAD: dict[str, Any] = {
    "enqueue mode=123": lambda s, r: s.enqueue_rollout("x", mode=123),
    "RolloutConfig(timeout_seconds='10')": lambda s, r: s.enqueue_rollout(
        "x", config=RolloutConfig(timeout_seconds="10")
    ),
    "enqueue input=object()": lambda s, r: s.enqueue_rollout(object()),
    "enqueue input lone surrogate": lambda s, r: s.enqueue_rollout("a\ud800b"),
    "enqueue input 3000-deep": lambda s, r: s.enqueue_rollout(_deep(3000)),
    "enqueue input 9 MB": lambda s, r: s.enqueue_rollout("x" * (9 * 1024 * 1024)),
    "update_attempt metadata='str'": lambda s, r: s.update_attempt(r[0], r[1], metadata="str"),
    "update_attempt last_heartbeat_time='now'": lambda s, r: s.update_attempt(r[0], r[1], last_heartbeat_time="now"),
    "update_rollout config='x'": lambda s, r: s.update_rollout(r[0], config="x"),
    "update_rollout mode=[1]": lambda s, r: s.update_rollout(r[0], mode=[1]),
    "PromptTemplate(template=123)": lambda s, r: s.add_resources({"p": PromptTemplate(template=123)}),
    "PromptTemplate(engine='x')": lambda s, r: s.add_resources({"p": PromptTemplate(template="t", engine="x")}),
    "resources {'p': 'str'}": lambda s, r: s.add_resources({"p": "str"}),
    "resources 'str'": lambda s, r: s.add_resources("str"),
    "span sequence_id=2**63": lambda s, r: s.add_span(_span(r[0], r[1], sequence_id=2**63)),
    "query_rollouts status_in='queuing'": lambda s, r: s.query_rollouts(status_in="queuing"),
    "query_rollouts status_in=[1]": lambda s, r: s.query_rollouts(status_in=[1]),
    "query_workers status_in='idle'": lambda s, r: s.query_workers(status_in="idle"),
}


async def _counts(store: Any) -> tuple[int, int]:
    return len(await store.query_rollouts()), len(await store.query_resources())


async def test_bad_inputs_get_one_clear_error_and_write_nothing(store: Any, backend: str) -> None:
    r = await store.start_rollout("target")
    target = (r.rollout_id, r.attempt.attempt_id)
    before = await _counts(store)
    answers: list[str] = []
    for name, call in BAD.items():
        with pytest.raises(InvalidInputError) as info:
            await call(store, target)
        answers.append(f"{name}: {type(info.value).__name__}: {str(info.value)[:110]}")
    print(f"\n[bad inputs, {backend}]\n  " + "\n  ".join(answers))
    assert await _counts(store) == before
    [attempt] = await store.query_attempts(r.rollout_id)
    assert attempt.metadata in (None, {}) and attempt.last_heartbeat_time is None or attempt.status == "preparing"
    # the rollout is not poisoned, and the store keeps serving
    assert (await store.update_attempt(*target, metadata={"ok": True})).metadata == {"ok": True}
    assert (await store.enqueue_rollout("after")).input == "after"


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


async def test_foreign_payloads_on_stream_subjects_are_dead_lettered(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        other = await store.start_rollout("other")  # a rollout the foreign events do not touch
        for subject, data in FOREIGN_SUBJECTS.values():
            rid = "ro-foreign0001"
            await store.log.js.publish(
                f"{store.log.prefix}.{subject.format(rid=rid)}", data.replace(b"{rid}", rid.encode())
            )
        after = await store.enqueue_rollout("after")
        await store.sync_all(timeout_s=15)
        async with store.pool.acquire() as conn:
            dead = await conn.fetch("SELECT stream_seq, subject, error FROM projector_dead_letters ORDER BY stream_seq")
        print("\n[foreign payloads]\n  " + "\n  ".join(f"{d['subject']}: {d['error'][:100]}" for d in dead))
        assert len(dead) >= len(FOREIGN_SUBJECTS) - 1  # an empty payload may be no event at all
        assert {r.rollout_id for r in await store.query_rollouts()} == {other.rollout_id, after.rollout_id}
        await store.update_attempt(other.rollout_id, other.attempt.attempt_id, status="succeeded")
        await store.sync(timeout_s=10)
        assert (await store.get_rollout_by_id(other.rollout_id)).status == "succeeded"
