"""The store contract: every test runs unchanged on the in-memory and the JetStream + Postgres backends.

``store`` is the algorithm's store (reads from Postgres on JetStream); ``runner_store`` is what a
runner process opens (write-only on JetStream). ``settle`` waits until the projection has caught up
with writes made through another store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest

from eventlight.core.errors import (
    AttemptNotFoundError,
    InvalidInputError,
    InvalidTransitionError,
    InvalidTypeError,
    ResourcesNotFoundError,
    RolloutNotFoundError,
    ServiceUnavailableError,
)
from eventlight.core.types import (
    MAX_SPAN_SEQUENCE_ID,
    STATUS_REASON,
    AttemptedRollout,
    EnqueueRolloutRequest,
    Event,
    Link,
    OtelResource,
    PromptTemplate,
    RolloutConfig,
    Span,
    SpanContext,
    TraceStatus,
)
from eventlight.settings import Settings
from tests.conftest import reward_span

CANCELLED_REASON = "the rollout was cancelled while the attempt ran"
"""``eventlight.core.types.CANCELLED_REASON``: what a cancel records on the attempts it ends."""


async def settle(store: Any) -> None:
    """Wait until reads include every write, whoever made it (a no-op in memory)."""
    await store.sync_all(timeout_s=10)


async def test_enqueue_takes_latest_resources_and_queues(store: Any) -> None:
    res = await store.add_resources({"p": PromptTemplate(template="hello {x}")})
    r = await store.enqueue_rollout({"x": 1}, mode="train")
    assert r.status == "queuing" and r.resources_id == res.resources_id and r.metadata == {}
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got is not None and got.status == "queuing" and got.input == {"x": 1} and got.mode == "train"
    assert not isinstance(got, AttemptedRollout)


async def test_unknown_resources_id_is_refused(store: Any) -> None:
    with pytest.raises(ResourcesNotFoundError, match="rs-missing"):
        await store.enqueue_rollout({}, resources_id="rs-missing")
    assert len(await store.query_rollouts()) == 0


async def test_dequeue_claims_in_fifo_order(store: Any, runner_store: Any) -> None:
    first = await store.enqueue_rollout("a")
    second = await store.enqueue_rollout("b")
    d1 = await runner_store.dequeue_rollout(worker_id="w1")
    d2 = await runner_store.dequeue_rollout(worker_id="w2")
    assert (d1.rollout_id, d2.rollout_id) == (first.rollout_id, second.rollout_id)
    assert d1.status == "preparing" and d1.attempt.sequence_id == 1 and d1.attempt.worker_id == "w1"
    assert await runner_store.dequeue_rollout(worker_id="w3") is None
    await settle(store)
    workers = {w.worker_id: w.status for w in await store.query_workers()}
    assert workers == {"w1": "busy", "w2": "busy", "w3": "idle"}


async def test_a_rollout_enqueued_elsewhere_is_dequeued_without_waiting(store: Any, runner_store: Any) -> None:
    """A non-blocking dequeue sees what another store enqueued just before (JetStream's consumer
    learns of new messages asynchronously; a bare no-wait pull missed about 1 in 300 under load)."""
    for i in range(100):
        r = await store.enqueue_rollout(i)
        d = await runner_store.dequeue_rollout()
        assert d is not None and d.rollout_id == r.rollout_id, f"iteration {i}"
        await runner_store.update_attempt(d.rollout_id, d.attempt.attempt_id, status="succeeded")
    assert await runner_store.dequeue_rollout() is None


async def test_span_moves_attempt_to_running_and_sequence_ids_increase(store: Any, runner_store: Any) -> None:
    r = await store.enqueue_rollout("q")
    d = await runner_store.dequeue_rollout(worker_id="w")
    aid = d.attempt.attempt_id
    ids = [await runner_store.get_next_span_sequence_id(r.rollout_id, aid) for _ in range(3)]
    assert ids == [1, 2, 3]
    assert await runner_store.get_many_span_sequence_ids([(r.rollout_id, aid)] * 2) == [4, 5]
    await runner_store.add_many_spans([reward_span(r.rollout_id, aid, i, 0.1 * i) for i in (3, 1, 2)])
    await settle(store)
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got.status == "running" and got.attempt.status == "running"
    assert got.attempt.last_heartbeat_time is not None
    spans = await store.query_spans(r.rollout_id)
    assert [s.sequence_id for s in spans] == [1, 2, 3]
    assert spans[0].attributes["agentlightning.reward.0.value"] == pytest.approx(0.1)


async def test_sequence_ids_are_shared_by_concurrent_writers(store: Any, runner_store: Any) -> None:
    """The tracer's numbered batches and another writer's reservations (the LLM proxy's path) share
    one gap-free, strictly increasing counter per attempt."""
    r = await store.enqueue_rollout("seq")
    d = await runner_store.dequeue_rollout()
    rid, aid = r.rollout_id, d.attempt.attempt_id

    async def tracer(k: int) -> list[int]:
        out = []
        for j in range(5):
            batch = [reward_span(rid, aid, 0, float(j)) for _ in range(k)]
            await runner_store.add_spans_numbered(rid, aid, batch)
            out.extend(s.sequence_id for s in batch)
        return out

    async def proxy() -> list[int]:
        out = []
        for _ in range(5):
            (sid,) = await store.get_many_span_sequence_ids([(rid, aid)])
            await store.add_span(reward_span(rid, aid, sid, 9.0))
            out.append(sid)
        return out

    a, b, c = await asyncio.gather(tracer(3), tracer(1), proxy())
    assert sorted(a + b + c) == list(range(1, 3 * 5 + 5 + 5 + 1))  # unique and without gaps
    assert a == sorted(a) and b == sorted(b) and c == sorted(c)  # increasing for each writer
    await settle(store)
    stored = await store.query_spans(rid, aid)
    assert [s.sequence_id for s in stored] == list(range(1, 26))
    assert await runner_store.get_next_span_sequence_id(rid, aid) == 26
    with pytest.raises(InvalidInputError):
        await runner_store.add_spans_numbered(rid, "at-other", [reward_span(rid, aid, 0, 1.0)])


async def test_success_finishes_rollout_and_wakes_waiters(store: Any, runner_store: Any) -> None:
    r = await store.enqueue_rollout("q")
    d = await runner_store.dequeue_rollout(worker_id="w")
    waiter = asyncio.create_task(store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=10))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await runner_store.update_attempt(r.rollout_id, d.attempt.attempt_id, status="succeeded")
    t0 = time.monotonic()
    done = await asyncio.wait_for(waiter, 10)
    # woken by the finish itself (DESIGN.md: event-driven), not by the 2 s fallback re-read
    assert time.monotonic() - t0 < 1.5
    assert [x.rollout_id for x in done] == [r.rollout_id]
    assert done[0].status == "succeeded" and done[0].end_time is not None
    assert done[0].attempt.status == "succeeded" and done[0].attempt.end_time is not None
    worker = await store.get_worker_by_id("w")
    assert worker.status == "idle" and worker.current_rollout_id is None


async def test_wait_for_rollouts_times_out_with_the_finished_subset(store: Any, runner_store: Any) -> None:
    a = await store.enqueue_rollout("a")
    b = await store.enqueue_rollout("b")
    d = await runner_store.dequeue_rollout()
    await runner_store.update_attempt(d.rollout_id, "latest", status="failed")
    got = await store.wait_for_rollouts(rollout_ids=[a.rollout_id, b.rollout_id], timeout=0.3)
    assert [x.rollout_id for x in got] == [a.rollout_id] and got[0].status == "failed"
    assert await store.wait_for_rollouts(rollout_ids=[b.rollout_id], timeout=0) == []


async def test_wait_for_unknown_rollout_raises(store: Any) -> None:
    with pytest.raises(RolloutNotFoundError, match="ro-nope"):
        await store.wait_for_rollouts(rollout_ids=["ro-nope"], timeout=0)


async def test_failure_requeues_until_attempts_run_out(store: Any, runner_store: Any) -> None:
    cfg = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    r = await store.enqueue_rollout("q", config=cfg)
    d1 = await runner_store.dequeue_rollout(worker_id="w")
    await runner_store.update_attempt(r.rollout_id, d1.attempt.attempt_id, status="failed")
    await settle(store)
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"
    d2 = await runner_store.dequeue_rollout(worker_id="w")
    assert d2.rollout_id == r.rollout_id and d2.attempt.sequence_id == 2
    await runner_store.update_attempt(r.rollout_id, "latest", status="failed")
    done = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=10)
    assert done[0].status == "failed"
    assert [a.status for a in await store.query_attempts(r.rollout_id)] == ["failed", "failed"]
    assert await runner_store.dequeue_rollout() is None


async def test_a_claim_reads_the_rollouts_resources_with_it(store: Any, runner_store: Any) -> None:
    """``dequeue_rollout(read_resources=True)`` + ``claimed_resources`` give what a runner would read
    after the claim: the rollout's own resources (as they are at the claim, also when the rollout
    was pointed at others while queued), else the latest; a requeued entry, and a second ask, read."""
    a = await store.add_resources({"p": PromptTemplate(template="a {x}")})
    named = await store.enqueue_rollout("named", resources_id=a.resources_id)
    await store.update_resources(a.resources_id, {"p": PromptTemplate(template="a2 {x}")})
    d = await runner_store.dequeue_rollout(worker_id="w", read_resources=True)
    assert d.rollout_id == named.rollout_id
    got = await runner_store.claimed_resources(d)
    assert got.resources_id == a.resources_id and got.version == 2 and got.resources["p"].template == "a2 {x}"
    assert await runner_store.claimed_resources(d) == got  # handed over once, then read again: the same
    await runner_store.update_attempt(d.rollout_id, d.attempt.attempt_id, status="succeeded")

    b = await store.add_resources({"p": PromptTemplate(template="b {x}")})
    moved = await store.enqueue_rollout("moved", resources_id=a.resources_id)
    await store.update_rollout(moved.rollout_id, resources_id=b.resources_id)
    d = await runner_store.dequeue_rollout(worker_id="w", read_resources=True)
    assert d.rollout_id == moved.rollout_id and d.resources_id == b.resources_id
    assert (await runner_store.claimed_resources(d)).resources_id == b.resources_id
    await runner_store.update_attempt(d.rollout_id, d.attempt.attempt_id, status="succeeded")

    cfg = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    latest = await store.enqueue_rollout("latest", config=cfg)
    assert latest.resources_id == b.resources_id  # the latest at enqueue
    d = await runner_store.dequeue_rollout(worker_id="w", read_resources=True)
    assert (await runner_store.claimed_resources(d)).resources_id == b.resources_id
    await runner_store.update_attempt(d.rollout_id, d.attempt.attempt_id, status="failed")
    await settle(store)
    again = await runner_store.dequeue_rollout(worker_id="w", read_resources=True)  # the requeued entry
    assert again.rollout_id == latest.rollout_id and again.attempt.sequence_id == 2
    assert (await runner_store.claimed_resources(again)).resources_id == b.resources_id
    await runner_store.update_attempt(again.rollout_id, again.attempt.attempt_id, status="succeeded")
    c = await store.add_resources({"p": PromptTemplate(template="c1 {x}")})
    await store.enqueue_rollout("as of the claim", resources_id=c.resources_id)
    d = await runner_store.dequeue_rollout(worker_id="w", read_resources=True)
    await store.update_resources(c.resources_id, {"p": PromptTemplate(template="c2 {x}")})
    assert (await runner_store.claimed_resources(d)).version == 1  # as of the claim, on both backends
    assert (await runner_store.claimed_resources(d)).version == 2  # handed over once: then read anew
    await runner_store.update_attempt(d.rollout_id, d.attempt.attempt_id, status="succeeded")
    assert await runner_store.dequeue_rollout(read_resources=True) is None
    plain = await store.get_rollout_by_id(latest.rollout_id)  # a Rollout, no attempt: read by its id
    assert (await runner_store.claimed_resources(plain)).resources_id == b.resources_id
    with pytest.raises(InvalidInputError, match="claimed_resources takes the rollout"):
        await runner_store.claimed_resources(latest.rollout_id)


async def test_only_the_latest_attempt_moves_the_rollout(store: Any) -> None:
    """peer_failures C01: a status change of an attempt that is no longer the latest is refused
    and never moves the rollout; a new attempt moves it back to ``preparing``."""
    r = await store.enqueue_rollout({"q": 4})
    d = await store.dequeue_rollout()
    await store.update_attempt(r.rollout_id, d.attempt.attempt_id, status="succeeded")
    a2 = await store.start_attempt(r.rollout_id)
    assert a2.attempt.sequence_id == 2 and a2.status == "preparing"
    with pytest.raises(InvalidTransitionError):
        await store.update_attempt(r.rollout_id, d.attempt.attempt_id, status="failed")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "preparing"
    await store.update_attempt(r.rollout_id, a2.attempt.attempt_id, status="failed")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "failed"


async def test_a_live_attempt_that_is_not_the_latest_never_moves_or_requeues_the_rollout(store: Any) -> None:
    """peer_failures C01 (variants): three attempts started back to back; ``succeeded`` on the
    first (still live) leaves the rollout as the third has it, ``succeeded`` on the third moves it.
    With retries, failing a live non-latest attempt does not requeue; failing the latest does."""
    r = await store.start_rollout({"q": 4})
    first = r.attempt.attempt_id
    await store.start_attempt(r.rollout_id)
    third = (await store.start_attempt(r.rollout_id)).attempt
    assert third.sequence_id == 3
    await store.update_attempt(r.rollout_id, third.attempt_id, status="running")
    await store.update_attempt(r.rollout_id, first, status="succeeded")
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got.status == "running" and got.attempt.attempt_id == third.attempt_id and got.end_time is None
    await store.update_attempt(r.rollout_id, third.attempt_id, status="succeeded")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "succeeded"

    retried = await store.enqueue_rollout({"q": 5}, config=RolloutConfig(max_attempts=3, retry_condition=["failed"]))
    old = await store.dequeue_rollout(worker_id="w1")
    latest = (await store.start_attempt(retried.rollout_id)).attempt
    await store.update_attempt(retried.rollout_id, old.attempt.attempt_id, status="failed")
    assert (await store.get_rollout_by_id(retried.rollout_id)).status == "preparing"
    assert await store.dequeue_rollout(worker_id="w2") is None  # nothing was requeued
    await store.update_attempt(retried.rollout_id, latest.attempt_id, status="failed")  # seq 2 < 3
    assert (await store.get_rollout_by_id(retried.rollout_id)).status == "requeuing"


async def test_each_batch_completes_exactly_what_it_queued(store: Any, runner_store: Any) -> None:
    """peer_failures C04: a retried failure is one completion, from its last attempt; a rollout
    whose failed attempt waits for its retry is not finished; a late result of a superseded
    attempt changes nothing; the next batch's wait never returns the previous batch's rollouts;
    a rollout out of attempts is ``failed`` with its reason, never a success without a reward."""
    cfg = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    batch_a = [(await store.enqueue_rollout({"a": i}, config=cfg)).rollout_id for i in range(4)]
    a1 = batch_a[0]
    first = await runner_store.dequeue_rollout(worker_id="w1")
    assert first.rollout_id == a1
    too_long = {STATUS_REASON: "BadRequestError: maximum context length is 4608 tokens"}
    await runner_store.update_attempt(a1, first.attempt.attempt_id, status="failed", metadata=too_long)
    await settle(store)
    assert (await store.get_rollout_by_id(a1)).status == "requeuing"
    assert await store.wait_for_rollouts(rollout_ids=[a1], timeout=0.2) == []  # a pending retry is no result
    attempts: dict[str, str] = {}
    while (d := await runner_store.dequeue_rollout(worker_id="w2")) is not None:
        attempts[d.rollout_id] = d.attempt.attempt_id
        await runner_store.update_attempt(d.rollout_id, d.attempt.attempt_id, status="succeeded")
    assert sorted(attempts) == sorted(batch_a)
    done_a = await store.wait_for_rollouts(rollout_ids=batch_a, timeout=10)
    assert sorted(r.rollout_id for r in done_a) == sorted(batch_a) and {r.status for r in done_a} == {"succeeded"}
    [a1_done] = [r for r in done_a if r.rollout_id == a1]
    assert a1_done.attempt.attempt_id == attempts[a1] and a1_done.attempt.sequence_id == 2

    batch_b = [(await store.enqueue_rollout({"b": i}, config=cfg)).rollout_id for i in range(4)]
    with pytest.raises(InvalidTransitionError, match="already finished"):  # A1's first attempt, late
        await runner_store.update_attempt(a1, first.attempt.attempt_id, status="succeeded")
    for _ in range(2):  # B1 fails both its attempts; the others succeed
        while (d := await runner_store.dequeue_rollout(worker_id="w3")) is not None:
            status = "failed" if d.rollout_id == batch_b[0] else "succeeded"
            reason = {STATUS_REASON: f"ConnectionError: attempt {d.attempt.sequence_id}"}
            await runner_store.update_attempt(d.rollout_id, d.attempt.attempt_id, status=status, metadata=reason)
        await settle(store)
    done_b = await store.wait_for_rollouts(rollout_ids=batch_b, timeout=10)
    assert sorted(r.rollout_id for r in done_b) == sorted(batch_b)
    [b1] = [r for r in done_b if r.rollout_id == batch_b[0]]
    assert (b1.status, b1.attempt.sequence_id, b1.status_reason) == ("failed", 2, "ConnectionError: attempt 2")
    a1_now = await store.get_rollout_by_id(a1)
    assert a1_now.status == "succeeded" and a1_now.attempt.attempt_id == attempts[a1]
    assert len(await store.wait_for_rollouts(rollout_ids=batch_a + batch_b, timeout=0)) == 8
    assert (await store.query_rollouts()).total == 8


async def test_superseded_attempt_cannot_complete_the_rollout(store: Any, runner_store: Any) -> None:
    """peer_failures C03, C20: a late result of a timed-out attempt is fenced off."""
    cfg = RolloutConfig(max_attempts=3, retry_condition=["timeout"])
    r = await store.enqueue_rollout({}, config=cfg)
    d1 = await runner_store.dequeue_rollout(worker_id="w1")
    await store.update_attempt(r.rollout_id, d1.attempt.attempt_id, status="timeout")
    d2 = await runner_store.dequeue_rollout(worker_id="w2")
    assert d2.rollout_id == r.rollout_id and d2.attempt.sequence_id == 2
    await runner_store.add_span(reward_span(r.rollout_id, d1.attempt.attempt_id, 5, 1.0))
    with pytest.raises(InvalidTransitionError, match="already finished"):
        await runner_store.update_attempt(r.rollout_id, d1.attempt.attempt_id, status="succeeded")
    await settle(store)
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "preparing"
    await runner_store.update_attempt(r.rollout_id, d2.attempt.attempt_id, status="succeeded")
    done = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=10)
    assert done[0].status == "succeeded" and done[0].attempt.attempt_id == d2.attempt.attempt_id
    assert await store.query_spans(r.rollout_id, attempt_id="latest") == []
    assert len(await store.query_spans(r.rollout_id)) == 1


async def test_a_silent_holder_back_before_its_retry_is_claimed_keeps_it(store: Any, runner_store: Any) -> None:
    """peer_failures C03, C20 (the runner came back in time): the watchdog marked a silent runner's
    attempt ``unresponsive`` and requeued the rollout; the runner's next span revives the attempt
    before anyone claimed the retry, so the requeued entry starts no second attempt, and the
    runner's result is the rollout's, once (AGL 0.3.0 skips a queued rollout no longer queuing)."""
    config = RolloutConfig(max_attempts=3, retry_condition=["unresponsive"])
    r = await store.enqueue_rollout({}, config=config)
    d1 = await runner_store.dequeue_rollout(worker_id="a")
    aid = d1.attempt.attempt_id
    await store.update_attempt(r.rollout_id, aid, status="unresponsive")  # as the watchdog
    await settle(store)
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "requeuing"
    await runner_store.add_span(reward_span(r.rollout_id, aid, 1, 0.5))
    await settle(store)
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "running"
    assert await runner_store.dequeue_rollout(worker_id="b") is None
    await runner_store.update_attempt(r.rollout_id, aid, status="succeeded")
    [done] = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=10)
    assert (done.status, done.attempt.attempt_id) == ("succeeded", aid)
    assert [a.status for a in await store.query_attempts(r.rollout_id)] == ["succeeded"]
    assert await runner_store.dequeue_rollout(worker_id="b") is None


async def test_cancelled_rollout_is_skipped_and_stays_cancelled(store: Any, runner_store: Any) -> None:
    a = await store.enqueue_rollout("a")
    b = await store.enqueue_rollout("b")
    cancelled = await store.update_rollout(a.rollout_id, status="cancelled")
    assert cancelled.status == "cancelled" and cancelled.end_time is not None
    d = await runner_store.dequeue_rollout()
    assert d.rollout_id == b.rollout_id
    c = await store.enqueue_rollout("c")
    dc = await runner_store.dequeue_rollout()
    await store.update_rollout(c.rollout_id, status="cancelled")
    with pytest.raises(InvalidTransitionError, match="already finished"):  # the cancel ended the attempt
        await runner_store.update_attempt(c.rollout_id, dc.attempt.attempt_id, status="succeeded")
    await settle(store)
    got = await store.get_rollout_by_id(c.rollout_id)
    assert (got.status, got.attempt.status, got.attempt.metadata) == (
        "cancelled",
        "failed",
        {STATUS_REASON: CANCELLED_REASON},
    )
    with pytest.raises(InvalidTransitionError, match="cancelled"):
        await store.update_rollout(c.rollout_id, status="running")


async def test_a_failed_rollout_stays_failed_when_its_runner_reports_late(store: Any, runner_store: Any) -> None:
    """A rollout ``failed`` because its latest attempt went ``unresponsive`` with no retry left is
    finished: ``wait_for_rollouts`` answered ``failed``, so the runner's late ``running`` and
    ``succeeded`` are recorded on the attempt and the rollout keeps ``failed`` and its ``end_time``,
    as ``cancelled`` does (0.3.0 flips it to ``succeeded``). A rollout marked ``succeeded`` by
    hand is not requeued when its attempt fails later."""
    r = await store.enqueue_rollout("a", config=RolloutConfig(unresponsive_seconds=30))
    d = await runner_store.dequeue_rollout(worker_id="w1")
    aid = d.attempt.attempt_id
    await store.update_attempt(r.rollout_id, aid, status="unresponsive")  # as the watchdog
    (ended,) = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=10)
    assert ended.status == "failed" and ended.end_time is not None
    await runner_store.update_attempt(r.rollout_id, aid, status="running")
    assert (await runner_store.update_attempt(r.rollout_id, aid, status="succeeded")).status == "succeeded"
    await settle(store)
    got = await store.get_rollout_by_id(r.rollout_id)
    assert (got.status, got.end_time, got.attempt.status) == ("failed", ended.end_time, "succeeded")
    (again,) = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=0)
    assert again.status == "failed"

    retry = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    s = await store.enqueue_rollout("b", config=retry)
    ds = await runner_store.dequeue_rollout(worker_id="w1")
    await store.update_rollout(s.rollout_id, status="succeeded")
    await runner_store.update_attempt(s.rollout_id, ds.attempt.attempt_id, status="failed")
    await settle(store)
    assert (await store.get_rollout_by_id(s.rollout_id)).status == "succeeded"
    assert await runner_store.dequeue_rollout(worker_id="w2") is None  # not requeued


def _hold_the_next_append(
    log: Any, monkeypatch: pytest.MonkeyPatch, *, stored: bool
) -> tuple[asyncio.Event, asyncio.Event]:
    """Make ``log``'s next append stop: after it is stored (``stored``), else before it is sent,
    until ``release`` is set; then the held one raises ``ServiceUnavailableError`` if it was not
    stored. Returns ``(reached, release)``."""
    reached, release = asyncio.Event(), asyncio.Event()
    original = log.append
    held = False

    async def append(*args: Any, **kwargs: Any) -> Any:
        nonlocal held
        if held:
            return await original(*args, **kwargs)
        held = True
        if stored:
            version = await original(*args, **kwargs)
            reached.set()
            await release.wait()
            return version
        reached.set()
        await release.wait()
        raise ServiceUnavailableError("test", "the append was never sent")

    monkeypatch.setattr(log, "append", append)
    return reached, release


async def test_a_dequeue_cancelled_after_its_claim_was_stored_fails_that_attempt(
    store: Any, runner_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller cancelled mid-claim (``asyncio.wait_for``, a runner stopping) never learns of the
    attempt its claim started: the store marks it failed, and the rollout's retry policy requeues it.
    Before, the attempt stayed ``preparing`` for ever (seen 3 times in 40 on JetStream)."""
    r = await store.enqueue_rollout("x", config=RolloutConfig(max_attempts=2, retry_condition=["failed"]))
    reached, release = _hold_the_next_append(runner_store._event_log, monkeypatch, stored=True)
    task = asyncio.create_task(runner_store.dequeue_rollout(worker_id="w1", read_resources=True))
    await asyncio.wait_for(reached.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    again = await runner_store.dequeue_rollout(worker_id="w2", wait_s=10)
    assert again is not None and again.rollout_id == r.rollout_id and again.attempt.sequence_id == 2
    await settle(store)
    attempts = await store.query_attempts(r.rollout_id)
    assert [(a.sequence_id, a.status, a.worker_id) for a in attempts] == [(1, "failed", "w1"), (2, "preparing", "w2")]


async def test_a_dequeue_cancelled_before_its_claim_was_stored_hands_the_entry_back(
    store: Any, runner_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry of a claim that never got stored goes back to the queue at once (not after the
    consumer's 30 s ack wait), and no attempt is left behind."""
    r = await store.enqueue_rollout("x")
    reached, release = _hold_the_next_append(runner_store._event_log, monkeypatch, stored=False)
    task = asyncio.create_task(runner_store.dequeue_rollout(worker_id="w1"))
    await asyncio.wait_for(reached.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()
    started = time.monotonic()
    again = await runner_store.dequeue_rollout(worker_id="w2", wait_s=10)
    assert again is not None and again.rollout_id == r.rollout_id and again.attempt.sequence_id == 1
    assert time.monotonic() - started < 5, "the entry waited out the ack wait"
    await settle(store)
    assert [a.worker_id for a in await store.query_attempts(r.rollout_id)] == ["w2"]


def _lose_the_next_claims_answer(log: Any, monkeypatch: pytest.MonkeyPatch, *, stored: bool) -> None:
    """The next append fails in transit with ``ServiceUnavailableError`` (a NATS timeout, a lost
    connection), after the server stored it (``stored``: its acknowledgement was lost) or before."""
    original, failed = log.append, False

    async def append(*args: Any, **kwargs: Any) -> Any:
        nonlocal failed
        if failed:
            return await original(*args, **kwargs)
        failed = True
        if stored:
            await original(*args, **kwargs)
        raise ServiceUnavailableError("test", "no acknowledgement")

    monkeypatch.setattr(log, "append", append)


async def test_a_claim_stored_without_an_answer_fails_that_attempt(
    store: Any, runner_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim the server stored but whose acknowledgement was lost: the caller hears
    ``ServiceUnavailableError`` and will never run that attempt, which stayed ``preparing`` for ever
    (a reviewer). The store settles it as a cancelled caller's: failed, and the retry policy
    requeues the rollout."""
    r = await store.enqueue_rollout("x", config=RolloutConfig(max_attempts=2, retry_condition=["failed"]))
    _lose_the_next_claims_answer(runner_store._event_log, monkeypatch, stored=True)
    with pytest.raises(ServiceUnavailableError):
        await runner_store.dequeue_rollout(worker_id="w1")
    again = await runner_store.dequeue_rollout(worker_id="w2", wait_s=10)
    assert again is not None and again.rollout_id == r.rollout_id and again.attempt.sequence_id == 2
    await settle(store)
    attempts = await store.query_attempts(r.rollout_id)
    assert [(a.sequence_id, a.status, a.worker_id) for a in attempts] == [(1, "failed", "w1"), (2, "preparing", "w2")]


async def test_a_claim_lost_before_it_was_stored_hands_the_entry_back(
    store: Any, runner_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim that failed in transit before the server stored it: the entry comes back at once,
    not after the consumer's 30 s ack wait, and no attempt is left behind."""
    r = await store.enqueue_rollout("x")
    _lose_the_next_claims_answer(runner_store._event_log, monkeypatch, stored=False)
    with pytest.raises(ServiceUnavailableError):
        await runner_store.dequeue_rollout(worker_id="w1")
    again = await runner_store.dequeue_rollout(worker_id="w2", wait_s=10)
    assert again is not None and again.rollout_id == r.rollout_id and again.attempt.sequence_id == 1
    await settle(store)
    assert [a.worker_id for a in await store.query_attempts(r.rollout_id)] == ["w2"]


@pytest.mark.parametrize(
    ("wait_s", "error"),
    [
        ("1", InvalidTypeError),
        (None, InvalidTypeError),
        (True, InvalidTypeError),
        (-1, InvalidInputError),
        (float("inf"), InvalidInputError),
        (float("nan"), InvalidInputError),
        pytest.param(10**400, InvalidInputError, id="10**400"),
        (1e300, InvalidInputError),
        (2**63, InvalidInputError),
        (3600.5, InvalidInputError),
    ],
)
async def test_a_bad_wait_is_refused_and_takes_nothing(store: Any, runner_store: Any, wait_s: Any, error: type) -> None:
    r = await store.enqueue_rollout("x")
    with pytest.raises(error, match="wait_s"):
        await runner_store.dequeue_rollout(worker_id="w1", wait_s=wait_s)
    claimed = await runner_store.dequeue_rollout(worker_id="w1", wait_s=0)
    assert claimed is not None and claimed.rollout_id == r.rollout_id and claimed.attempt.sequence_id == 1


async def test_unknown_ids_raise_clear_errors(store: Any) -> None:
    with pytest.raises(RolloutNotFoundError, match="ro-ghost"):
        await store.update_attempt("ro-ghost", "latest", status="failed")
    with pytest.raises(RolloutNotFoundError):
        await store.query_spans("ro-ghost")
    with pytest.raises(RolloutNotFoundError):
        await store.start_attempt("ro-ghost")
    r = await store.enqueue_rollout("q")
    with pytest.raises(AttemptNotFoundError, match="no attempts"):
        await store.update_attempt(r.rollout_id, "latest", status="failed")
    d = await store.dequeue_rollout()
    with pytest.raises(AttemptNotFoundError, match="at-ghost"):
        await store.update_attempt(r.rollout_id, "at-ghost", status="failed")
    with pytest.raises(AttemptNotFoundError):
        await store.add_span(reward_span(r.rollout_id, "at-ghost", 1, 1.0))
    with pytest.raises(AttemptNotFoundError):
        await store.get_next_span_sequence_id(r.rollout_id, "at-ghost")
    assert await store.get_rollout_by_id("ro-ghost") is None
    assert (await store.get_rollout_by_id(r.rollout_id)).attempt.attempt_id == d.attempt.attempt_id


async def test_bad_input_is_refused_and_writes_nothing(store: Any) -> None:
    r = await store.enqueue_rollout("q")
    d = await store.dequeue_rollout()
    with pytest.raises(InvalidInputError, match="unknown attempt status"):
        await store.update_attempt(r.rollout_id, "latest", status="done")
    with pytest.raises(InvalidInputError, match="unknown rollout status"):
        await store.update_rollout(r.rollout_id, status="paused")
    broken = reward_span(r.rollout_id, d.attempt.attempt_id, 1, 1.0)
    broken.span_id = ""
    with pytest.raises(InvalidInputError, match="span_id"):
        await store.add_many_spans([reward_span(r.rollout_id, d.attempt.attempt_id, 2, 1.0), broken])
    with pytest.raises(InvalidInputError, match="not an eventlight Span"):
        await store.add_many_spans([{"name": "x"}])
    with pytest.raises(InvalidInputError, match="not a valid id"):
        await store.dequeue_rollout(worker_id="has space.and dot")
    with pytest.raises(InvalidInputError, match="limit"):
        await store.query_rollouts(limit=-5)
    with pytest.raises(InvalidInputError, match="unknown field"):
        await store.query_rollouts(sort_by="nope")
    assert len(await store.query_spans(r.rollout_id)) == 0
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got.status == "preparing" and got.attempt.status == "preparing"


async def test_query_rollouts_filters_sorts_and_pages(store: Any) -> None:
    made = [await store.enqueue_rollout(i, mode="train" if i % 2 else "val") for i in range(5)]
    await store.update_rollout(made[0].rollout_id, status="cancelled")
    page = await store.query_rollouts(limit=2, offset=1)
    assert [r.rollout_id for r in page] == [m.rollout_id for m in made[1:3]]
    assert page.total == 5 and page.limit == 2 and page.offset == 1
    assert [r.rollout_id for r in await store.query_rollouts(status_in=["cancelled"])] == [made[0].rollout_id]
    assert len(await store.query_rollouts(status_in=[])) == 0
    queued = await store.query_rollouts(status_in=["queuing", "running"], limit=1)
    assert len(queued) == 1 and queued.total == 4  # totals count every match, not the page
    assert (await store.query_rollouts(status_in=[], limit=1)).total == 0
    either = await store.query_rollouts(status_in=["cancelled"], rollout_id_in=[made[4].rollout_id], filter_logic="or")
    assert {r.rollout_id for r in either} == {made[0].rollout_id, made[4].rollout_id}
    desc = await store.query_rollouts(sort_by="start_time", sort_order="desc")
    assert [r.rollout_id for r in desc] == [m.rollout_id for m in reversed(made)]
    part = made[3].rollout_id[3:9]
    assert [r.rollout_id for r in await store.query_rollouts(rollout_id_contains=part)] == [made[3].rollout_id]


async def test_query_spans_filters(store: Any) -> None:
    r = await store.enqueue_rollout("q")
    d = await store.dequeue_rollout()
    aid = d.attempt.attempt_id
    spans = [reward_span(r.rollout_id, aid, i, float(i)) for i in (1, 2, 3)]
    spans[1].name = "openai.chat.completion"
    await store.add_many_spans(spans)
    assert [s.sequence_id for s in await store.query_spans(r.rollout_id, name_contains="openai")] == [2]
    assert len(await store.query_spans(r.rollout_id, filter_logic="or")) == 3
    page = await store.query_spans(r.rollout_id, attempt_id=aid, sort_order="desc", limit=2)
    assert [s.sequence_id for s in page] == [3, 2] and page.total == 3
    assert [s.span_id for s in await store.query_spans(r.rollout_id, span_id=spans[0].span_id)] == [spans[0].span_id]


async def test_spans_read_back_as_written_whatever_their_text_holds(store: Any) -> None:
    """Every field of a span comes back as written, quotes, backslashes, control characters and
    non-ASCII text included, from the common call (no filter, no paging: Postgres hands each row
    over as one JSON object) and from a filtered one (column by column) alike."""
    r = await store.enqueue_rollout("q", config=RolloutConfig(max_attempts=2, retry_condition=["failed"]))
    first = await store.dequeue_rollout()
    odd = 'q"uo\\te \n\t\x01\x7f é 😀 \u2028 </script>'
    ctx = SpanContext(trace_id="ab" * 16, span_id="cd" * 8, is_remote=True, trace_state={odd: odd})
    spans = [
        Span(
            rollout_id=r.rollout_id,
            attempt_id=first.attempt.attempt_id,
            sequence_id=1,
            trace_id="ab" * 16,
            span_id="01" * 8,
            parent_id=odd,
            name=odd,
            status=TraceStatus(status_code="ERROR", description=odd),
            attributes={odd: odd, "n": [1, 2.5, True, None], "nested": {"x": {odd: [odd]}}},
            events=[Event(name=odd, attributes={"k": odd}, timestamp=1.25)],
            links=[Link(context=ctx, attributes={odd: 1})],
            start_time=1733600000.1234567,
            end_time=1733600000.9876543,
            context=ctx,
            parent=ctx,
            resource=OtelResource(attributes={"service.name": odd}, schema_url=odd),
        ),
        Span(
            rollout_id=r.rollout_id,
            attempt_id=first.attempt.attempt_id,
            sequence_id=2,
            trace_id="ab" * 16,
            span_id="02" * 8,
            parent_id=None,
            name="plain",
        ),
    ]
    await store.add_many_spans(spans)
    assert list(await store.query_spans(r.rollout_id)) == spans
    assert list(await store.query_spans(r.rollout_id, attempt_id="latest")) == spans
    assert list(await store.query_spans(r.rollout_id, name=odd)) == spans[:1]
    await store.update_attempt(r.rollout_id, first.attempt.attempt_id, status="failed")
    second = await store.dequeue_rollout()
    assert second is not None and second.rollout_id == r.rollout_id
    assert list(await store.query_spans(r.rollout_id, attempt_id="latest")) == []
    assert list(await store.query_spans(r.rollout_id)) == spans


async def test_query_spans_of_a_retried_rollout_go_attempt_by_attempt(store: Any) -> None:
    """Without an attempt, spans come attempt by attempt (as Agent-lightning 0.3.0's per-rollout
    sequence ids put them), then by sequence id: a first attempt's late span stays with its attempt."""
    r = await store.enqueue_rollout("q", config=RolloutConfig(max_attempts=2, retry_condition=["failed"]))
    first = await store.dequeue_rollout()
    a1 = first.attempt.attempt_id
    await store.add_many_spans([reward_span(r.rollout_id, a1, i, 0.0) for i in (5, 6)])
    await store.update_attempt(r.rollout_id, a1, status="failed")
    second = await store.dequeue_rollout()
    assert second is not None and second.rollout_id == r.rollout_id
    a2 = second.attempt.attempt_id
    await store.add_many_spans([reward_span(r.rollout_id, a2, i, 1.0) for i in (1, 2)])
    await store.add_span(reward_span(r.rollout_id, a1, 7, 0.0))  # late, from the first attempt
    expected = [(a1, 5), (a1, 6), (a1, 7), (a2, 1), (a2, 2)]
    assert [(s.attempt_id, s.sequence_id) for s in await store.query_spans(r.rollout_id)] == expected
    got = await store.query_spans(r.rollout_id, sort_order="desc")
    assert [(s.attempt_id, s.sequence_id) for s in got] == expected[::-1] and got.total == 5
    page = await store.query_spans(r.rollout_id, limit=2, offset=2)
    assert [(s.attempt_id, s.sequence_id) for s in page] == expected[2:4] and page.total == 5


async def test_duplicate_spans_are_reported_and_stored_once(
    store: Any, runner_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A duplicate is the same ``(rollout_id, attempt_id, span_id)``; ``add_span`` returns ``None`` and
    logs a warning (0.3.0 logs the same text)."""
    caplog.set_level(logging.WARNING, logger="eventlight.store.spans")
    r = await store.enqueue_rollout("dup")
    d = await runner_store.dequeue_rollout()
    aid = d.attempt.attempt_id
    first = reward_span(r.rollout_id, aid, 1, 1.0)
    assert await runner_store.add_span(first) is not None
    assert await runner_store.add_span(first) is None  # same store object
    assert await store.add_span(first) is None  # another store (process), within the duplicate window
    second = reward_span(r.rollout_id, aid, 2, 2.0)
    added = await runner_store.add_many_spans([second, first, second])
    assert [s.span_id for s in added] == [second.span_id]
    dropped = [rec.getMessage() for rec in caplog.records if rec.name == "eventlight.store.spans"]
    assert dropped == [  # one warning per span dropped, 0.3.0's text
        f"Duplicated span added for rollout={r.rollout_id}, attempt={aid}, span={span.span_id}. Skipping."
        for span in (first, first, first, second)
    ]
    await settle(store)
    assert [s.span_id for s in await store.query_spans(r.rollout_id)] == [first.span_id, second.span_id]


async def test_concurrent_copies_of_a_span_are_recorded_once(store: Any, runner_store: Any) -> None:
    """Copies of one span sent at the same time by one store object: one call records it, the others
    are told it was a duplicate, also where a batch overlaps another in flight."""
    r = await store.enqueue_rollout("dup-concurrent")
    d = await runner_store.dequeue_rollout()
    aid = d.attempt.attempt_id
    first = reward_span(r.rollout_id, aid, 1, 1.0)
    answers = await asyncio.gather(*(runner_store.add_span(first) for _ in range(5)))
    assert sum(a is not None for a in answers) == 1
    second, third = reward_span(r.rollout_id, aid, 2, 2.0), reward_span(r.rollout_id, aid, 3, 3.0)
    batches = await asyncio.gather(
        runner_store.add_many_spans([second, third]), runner_store.add_many_spans([third, second])
    )
    assert sorted(s.span_id for batch in batches for s in batch) == sorted([second.span_id, third.span_id])
    await settle(store)
    assert len(await store.query_spans(r.rollout_id)) == 3


async def test_query_rollouts_deprecated_aliases(store: Any) -> None:
    made = [await store.enqueue_rollout(i) for i in range(3)]
    await store.update_rollout(made[0].rollout_id, status="cancelled")
    with pytest.warns(DeprecationWarning, match="status_in"):
        old = await store.query_rollouts(status=["cancelled"])
    assert [r.rollout_id for r in old] == [made[0].rollout_id]
    with pytest.warns(DeprecationWarning, match="rollout_id_in"):
        both = await store.query_rollouts(rollout_id_in=[made[1].rollout_id], rollout_ids=[made[2].rollout_id])
    assert [r.rollout_id for r in both] == [made[1].rollout_id]  # the new parameter wins


async def test_query_workers_filters_sorts_and_pages(store: Any, runner_store: Any) -> None:
    await store.enqueue_rollout("w")
    assert await runner_store.dequeue_rollout(worker_id="runner-a") is not None
    assert await runner_store.dequeue_rollout(worker_id="runner-b") is None  # empty queue: idle
    await store.update_worker("probe-c", {"gpu": 1})
    await settle(store)
    assert {w.worker_id: w.status for w in await store.query_workers()} == {
        "runner-a": "busy",
        "runner-b": "idle",
        "probe-c": "unknown",
    }
    assert [w.worker_id for w in await store.query_workers(status_in=["idle"])] == ["runner-b"]
    assert len(await store.query_workers(status_in=[])) == 0
    assert {w.worker_id for w in await store.query_workers(worker_id_contains="runner-")} == {"runner-a", "runner-b"}
    both = await store.query_workers(status_in=["busy"], worker_id_contains="probe", filter_logic="or")
    assert {w.worker_id for w in both} == {"runner-a", "probe-c"}
    none = await store.query_workers(status_in=["busy"], worker_id_contains="probe")
    assert len(none) == 0 and none.total == 0
    page = await store.query_workers(sort_by="worker_id", sort_order="desc", limit=2, offset=1)
    assert [w.worker_id for w in page] == ["runner-a", "probe-c"] and page.total == 3
    with pytest.raises(InvalidInputError):
        await store.query_workers(sort_by="no_such_field")


async def test_query_resources_filters_sorts_and_pages(store: Any) -> None:
    for rid in ("prompt-a", "prompt-b", "other"):
        await store.update_resources(rid, {"p": PromptTemplate(template=rid)})
    assert [x.resources_id for x in await store.query_resources(resources_id="prompt-b")] == ["prompt-b"]
    assert [x.resources_id for x in await store.query_resources(resources_id_contains="prompt")] == [
        "prompt-a",
        "prompt-b",
    ]
    both = await store.query_resources(resources_id="other", resources_id_contains="prompt")
    assert len(both) == 0  # always ANDed
    page = await store.query_resources(sort_by="resources_id", sort_order="desc", limit=2)
    assert [x.resources_id for x in page] == ["prompt-b", "prompt-a"] and page.total == 3
    assert len(await store.query_resources(limit=0)) == 0
    with pytest.raises(InvalidInputError):
        await store.query_resources(offset=-1)


async def test_span_and_attempt_reads_tell_an_unknown_rollout_from_an_empty_one(store: Any) -> None:
    """``query_spans`` and ``query_attempts`` raise for an unknown rollout in every attempt mode and
    give an empty page for a known one with nothing yet; ``latest`` is the latest attempt's spans
    (on Postgres one query, the rollout row read only when no span matches)."""
    for attempt_id in (None, "latest", "at-ghost"):
        with pytest.raises(RolloutNotFoundError, match="ro-ghost"):
            await store.query_spans("ro-ghost", attempt_id=attempt_id)
    with pytest.raises(RolloutNotFoundError, match="ro-ghost"):
        await store.query_attempts("ro-ghost")
    r = await store.enqueue_rollout("q")
    await settle(store)
    for attempt_id in (None, "latest"):
        page = await store.query_spans(r.rollout_id, attempt_id=attempt_id)
        assert list(page) == [] and page.total == 0
        assert list(await store.query_spans(r.rollout_id, attempt_id=attempt_id, offset=3, limit=2)) == []
    assert list(await store.query_attempts(r.rollout_id)) == []
    with pytest.raises(AttemptNotFoundError):
        await store.query_spans(r.rollout_id, attempt_id="at-ghost")
    first = await store.start_attempt(r.rollout_id)
    await store.add_span(reward_span(r.rollout_id, first.attempt.attempt_id, 1, 1.0))
    await store.add_span(reward_span(r.rollout_id, first.attempt.attempt_id, 2, 2.0))
    await store.update_attempt(r.rollout_id, first.attempt.attempt_id, status="failed")
    second = await store.start_attempt(r.rollout_id)
    await settle(store)
    assert list(await store.query_spans(r.rollout_id, attempt_id="latest")) == []
    await store.add_span(reward_span(r.rollout_id, second.attempt.attempt_id, 3, 3.0))
    await settle(store)
    latest = await store.query_spans(r.rollout_id, attempt_id="latest")
    assert [s.attempt_id for s in latest] == [second.attempt.attempt_id] and latest.total == 1
    assert len(await store.query_spans(r.rollout_id, attempt_id=first.attempt.attempt_id)) == 2
    assert (await store.query_spans(r.rollout_id)).total == 3
    assert (await store.query_spans(r.rollout_id, attempt_id="latest", offset=1, limit=1)).total == 1
    assert [a.attempt_id for a in await store.query_attempts(r.rollout_id)] == [
        first.attempt.attempt_id,
        second.attempt.attempt_id,
    ]


async def test_span_and_attempt_reads_refuse_ids_and_filters_of_the_wrong_type(store: Any) -> None:
    """A rollout id that is not a string names no rollout (it never reaches SQL: ``None`` there
    matched every rollout's spans); an attempt id or span filter of another type is refused."""
    r = await store.enqueue_rollout("q")
    for bad in (None, 5, ["ro-x"]):
        for attempt_id in (None, "latest", "at-x"):
            with pytest.raises(RolloutNotFoundError):
                await store.query_spans(bad, attempt_id=attempt_id)
        with pytest.raises(RolloutNotFoundError):
            await store.query_attempts(bad)
        with pytest.raises(RolloutNotFoundError):
            await store.get_latest_attempt(bad)
    for kwargs in ({"attempt_id": 5}, {"name": 5}, {"name_contains": ["x"]}, {"trace_id": 1.5}):
        with pytest.raises(InvalidTypeError, match="must be a string"):
            await store.query_spans(r.rollout_id, **kwargs)
    assert list(await store.query_spans(r.rollout_id, name="nothing")) == []


async def test_spans_of_several_attempts_come_attempt_by_attempt(store: Any) -> None:
    """Sequence ids count per attempt here (0.3.0: per rollout), so sorting a rollout's spans by
    ``sequence_id`` alone interleaved its attempts, and the tutorial's
    ``find_final_reward(await store.query_spans(rollout_id))`` returned a failed attempt's reward (a
    reviewer). Over several attempts ``sequence_id`` sorts attempt by attempt, 0.3.0's order."""
    from eventlight import find_final_reward

    r = await store.enqueue_rollout("retried")
    first = await store.dequeue_rollout()
    for seq in range(1, 5):
        await store.add_span(reward_span(r.rollout_id, first.attempt.attempt_id, seq, 0.9))
    await store.update_attempt(r.rollout_id, first.attempt.attempt_id, status="failed")
    second = await store.start_attempt(r.rollout_id)
    for seq in (1, 2):
        await store.add_span(reward_span(r.rollout_id, second.attempt.attempt_id, seq, 0.2))
    await settle(store)
    a1, a2 = first.attempt.attempt_id, second.attempt.attempt_id
    spans = await store.query_spans(r.rollout_id)
    assert [(s.attempt_id, s.sequence_id) for s in spans] == [(a1, 1), (a1, 2), (a1, 3), (a1, 4), (a2, 1), (a2, 2)]
    assert find_final_reward(spans) == 0.2
    down = await store.query_spans(r.rollout_id, sort_order="desc", limit=3)
    assert [(s.attempt_id, s.sequence_id) for s in down] == [(a2, 2), (a2, 1), (a1, 4)] and down.total == 6
    by_name = await store.query_spans(r.rollout_id, sort_by="name")  # another field: as asked
    assert len(by_name) == 6
    assert [s.sequence_id for s in await store.query_spans(r.rollout_id, attempt_id=a1)] == [1, 2, 3, 4]


async def test_an_attempt_that_revives_or_succeeds_drops_the_watchdogs_reason(store: Any, runner_store: Any) -> None:
    """``unresponsive`` writes its reason into the attempt's metadata; an attempt that a span revives,
    or that then succeeds, kept saying "unresponsive: ..." as its ``status_reason`` (a reviewer)."""
    reason = "unresponsive: no span or heartbeat for 4.0 s, over unresponsive_seconds=3"
    for revive_with_span in (True, False):
        r = await store.enqueue_rollout("revived")
        d = await runner_store.dequeue_rollout()
        aid = d.attempt.attempt_id
        await store.update_attempt(
            r.rollout_id, aid, status="unresponsive", metadata={STATUS_REASON: reason, "kept": 1}
        )
        if revive_with_span:
            await runner_store.add_span(reward_span(r.rollout_id, aid, 1, 1.0))
            await settle(store)
            revived = await store.get_latest_attempt(r.rollout_id)
            assert revived.status == "running" and revived.metadata == {"kept": 1}
        await runner_store.update_attempt(r.rollout_id, aid, status="succeeded")
        await settle(store)
        done = await store.get_rollout_by_id(r.rollout_id)
        assert done.attempt.status == "succeeded" and done.status_reason is None, revive_with_span
        assert done.attempt.metadata == {"kept": 1}


async def test_reads_by_an_id_that_is_not_a_string(store: Any) -> None:
    """Both backends answer alike: ``get_rollout_by_id`` and ``get_worker_by_id`` find nothing (as
    ``get_resources_by_id``), ``wait_for_rollouts`` names the id it cannot find, and a string for
    the id list is refused."""
    r = await store.enqueue_rollout("q")
    for bad in (123, None, 1.5, b"ro"):
        assert await store.get_rollout_by_id(bad) is None
        assert await store.get_worker_by_id(bad) is None
        with pytest.raises(RolloutNotFoundError, match=repr(bad)[:3]):
            await store.wait_for_rollouts(rollout_ids=[r.rollout_id, bad], timeout=0)
    for bad_list in (r.rollout_id, 5, None):
        with pytest.raises(InvalidTypeError, match="rollout_ids must be a list"):
            await store.wait_for_rollouts(rollout_ids=bad_list, timeout=0)
    assert await store.wait_for_rollouts(rollout_ids=(r.rollout_id,), timeout=0) == []
    for bad_timeout, error in (("1", InvalidTypeError), (True, InvalidTypeError), (float("nan"), InvalidInputError)):
        with pytest.raises(error, match="timeout must be a number of seconds"):
            await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=bad_timeout)


async def test_a_config_given_as_a_dict_or_out_of_range(store: Any) -> None:
    """``config={"timeout_seconds": 5}`` is taken as a ``RolloutConfig`` (it was checked, then passed
    on as a dict: ``TypeError: struct must be a msgspec.Struct``); a bound that is not a finite number
    of seconds > 0 is refused (``-1`` timed every attempt out at once, NaN never; a reviewer)."""
    r = await store.enqueue_rollout("q", config={"timeout_seconds": 5, "max_attempts": 2})
    assert r.config == RolloutConfig(timeout_seconds=5, max_attempts=2)
    started = await store.start_rollout("s", config={"unresponsive_seconds": 3})
    assert started.config.unresponsive_seconds == 3
    updated = await store.update_rollout(r.rollout_id, config={"max_attempts": 3})
    assert updated.config == RolloutConfig(max_attempts=3)
    for bad, error, says in (
        ({"timeout_seconds": -1}, InvalidInputError, "config.timeout_seconds must be a finite number"),
        (RolloutConfig(timeout_seconds=float("nan")), InvalidInputError, "timeout_seconds must be a finite"),
        (RolloutConfig(unresponsive_seconds=0), InvalidInputError, "unresponsive_seconds must be a finite"),
        ({"bogus": 1}, InvalidInputError, "unknown fields"),
        ({"timeout_seconds": "10"}, InvalidTypeError, "Expected `float | null`"),
    ):
        for call in (
            lambda: store.enqueue_rollout("q", config=bad),  # noqa: B023
            lambda: store.start_rollout("q", config=bad),  # noqa: B023
            lambda: store.update_rollout(r.rollout_id, config=bad),  # noqa: B023
        ):
            with pytest.raises(error, match=says):
                await call()
    assert (await store.query_rollouts()).total == 2
    assert (await store.get_rollout_by_id(r.rollout_id)).config == RolloutConfig(max_attempts=3)


async def test_ids_that_cannot_exist_are_not_found(store: Any) -> None:
    """Wildcards and dots never reach a NATS subject: ``*`` must not match some real rollout."""
    r = await store.enqueue_rollout("real")
    for bad in ("*", ">", "ro-x.y", "", "a b"):
        with pytest.raises(RolloutNotFoundError):
            await store.update_rollout(bad, status="cancelled")
        with pytest.raises(RolloutNotFoundError):
            await store.start_attempt(bad)
        assert await store.get_resources_by_id(bad) is None
    await store.add_resources({"p": PromptTemplate(template="x")})
    with pytest.raises(ResourcesNotFoundError):
        await store.update_rollout(r.rollout_id, resources_id="*")
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "queuing"


async def test_spans_that_cannot_be_stored_are_refused(store: Any, runner_store: Any) -> None:
    r = await store.enqueue_rollout("bad spans")
    d = await runner_store.dequeue_rollout()
    aid = d.attempt.attempt_id
    bad = []
    for change in ({"name": None}, {"attributes": [1]}, {"attributes": {"x": object()}}, {"sequence_id": 2**63}):
        span = reward_span(r.rollout_id, aid, 1, 1.0)
        for k, v in change.items():
            setattr(span, k, v)
        bad.append(span)
    for span in bad:
        with pytest.raises(InvalidInputError):
            await runner_store.add_span(span)
    await settle(store)
    assert len(await store.query_spans(r.rollout_id)) == 0


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"attributes": {"agentlightning.reward.0.value": float("nan")}}, "'agentlightning.reward.0.value' is nan"),
        ({"attributes": {"score": float("-inf")}}, "'score' is -inf, which JSON cannot hold"),
        ({"attributes": {"scores": [1.0, float("inf")]}}, r"'scores': \[1\] is inf"),
        ({"attributes": {"d": {"e": [float("nan")]}}}, r"'d': e\[0\] is nan"),
        ({"end_time": float("inf")}, "a field: end_time is inf"),
        ({"attributes": {"text": json.loads('"model said \\ud83d"')}}, "'text' is not valid Unicode text"),
        ({"name": "half \ud83d"}, "name is not valid Unicode text"),
        ({"attributes": {"k\udc80": "v"}}, "an attribute key is not valid Unicode text"),
        ({"span_id": "ab\ud800"}, "span_id is not valid Unicode text"),
    ],
)
async def test_spans_json_cannot_hold_are_refused_alike(store: Any, runner_store: Any, change: dict, says: str) -> None:
    """NaN, infinity and lone surrogates: JetStream's JSON turned NaN into null (a reward read back
    as ``None`` failed ``find_final_reward``) and a lone surrogate failed the whole batch with a
    ``UnicodeEncodeError``, where the in-memory store kept both (a reviewer). Both refuse the span
    with ``InvalidInputError``, so the tracer keeps the other spans of its batch."""
    r = await store.enqueue_rollout("odd values")
    d = await runner_store.dequeue_rollout()
    span = reward_span(r.rollout_id, d.attempt.attempt_id, 1, 1.0)
    for k, v in change.items():
        setattr(span, k, v)
    good = reward_span(r.rollout_id, d.attempt.attempt_id, 2, 0.5)
    with pytest.raises(InvalidInputError, match=says):
        await runner_store.add_many_spans([good, span])
    assert await runner_store.add_span(good) is not None
    await settle(store)
    assert [s.span_id for s in await store.query_spans(r.rollout_id)] == [good.span_id]


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda s: s.enqueue_rollout({"x": float("nan")}), "input.x is nan"),
        (lambda s: s.enqueue_rollout("q", metadata={"m": [0, float("inf")]}), r"metadata.m\[1\] is inf"),
        (lambda s: s.start_rollout("q", metadata={"m": float("-inf")}), "metadata.m is -inf"),
    ],
)
async def test_payloads_json_cannot_hold_are_refused_alike(store: Any, call: Any, says: str) -> None:
    """An input or metadata with NaN or infinity came back as ``None`` on JetStream and as given in
    memory (a reviewer); both refuse it and write nothing."""
    with pytest.raises(InvalidInputError, match=says):
        await call(store)
    assert (await store.query_rollouts()).total == 0


async def test_span_sequence_ids_stay_within_what_the_read_model_stores(store: Any, runner_store: Any) -> None:
    """An id over ``MAX_SPAN_SEQUENCE_ID`` (the read model's Postgres ``integer``) is refused with
    the batch it came in, not taken and then dead-lettered by the projector with its batch; the
    largest id is stored, and numbering past it is refused with nothing appended."""
    r = await store.enqueue_rollout("ids")
    d = await runner_store.dequeue_rollout()
    rid, aid = r.rollout_id, d.attempt.attempt_id
    with pytest.raises(InvalidInputError, match=f"invalid sequence_id {MAX_SPAN_SEQUENCE_ID + 1}"):
        await runner_store.add_many_spans([reward_span(rid, aid, 5, 0.5), reward_span(rid, aid, 2**31, 1.0)])
    assert await runner_store.add_span(reward_span(rid, aid, MAX_SPAN_SEQUENCE_ID, 1.0)) is not None
    with pytest.raises(InvalidInputError, match="no sequence id left"):
        await runner_store.add_spans_numbered(rid, aid, [reward_span(rid, aid, 0, 0.25)])
    with pytest.raises(InvalidInputError, match="no sequence id left"):
        await runner_store.get_next_span_sequence_id(rid, aid)
    await runner_store.update_attempt(rid, aid, status="succeeded")
    assert [x.status for x in await store.wait_for_rollouts(rollout_ids=[rid], timeout=10)] == ["succeeded"]
    assert [s.sequence_id for s in await store.query_spans(rid)] == [MAX_SPAN_SEQUENCE_ID]


async def test_a_write_refused_for_its_ids_fails_alone_beside_concurrent_ones(store: Any, runner_store: Any) -> None:
    """Spans written at the same moment share one message on JetStream (group commit): a numbering
    that would pass ``MAX_SPAN_SEQUENCE_ID`` fails alone, and a span with its own id written beside
    it is stored, as on the in-memory store (a reviewer: both failed, 7 of 15 tries)."""
    r = await store.enqueue_rollout("ids")
    d = await runner_store.dequeue_rollout()
    rid, aid = r.rollout_id, d.attempt.attempt_id
    await runner_store.add_span(reward_span(rid, aid, MAX_SPAN_SEQUENCE_ID - 1, 1.0))
    for round_ in range(5):
        own, numbered = await asyncio.gather(
            runner_store.add_span(reward_span(rid, aid, 10 + round_, 0.5)),
            runner_store.add_spans_numbered(rid, aid, [reward_span(rid, aid, 0, 0.1), reward_span(rid, aid, 0, 0.2)]),
            return_exceptions=True,
        )
        assert isinstance(own, Span), own
        assert isinstance(numbered, InvalidInputError) and "no sequence id left" in str(numbered)
    await runner_store.update_attempt(rid, aid, status="succeeded")
    await store.wait_for_rollouts(rollout_ids=[rid], timeout=10)
    assert [s.sequence_id for s in await store.query_spans(rid)] == [10, 11, 12, 13, 14, MAX_SPAN_SEQUENCE_ID - 1]


async def test_nul_characters_do_not_stop_the_projection(store: Any, runner_store: Any) -> None:
    """LLM output may hold NUL, which Postgres cannot store: the span is kept (NUL as U+FFFD in the
    read model, unchanged in the stream) and later events are still projected."""
    r = await store.enqueue_rollout({"prompt": "a\x00b"})
    d = await runner_store.dequeue_rollout()
    aid = d.attempt.attempt_id
    span = reward_span(r.rollout_id, aid, 1, 1.0)
    span.name = "llm\x00call"
    span.attributes["gen_ai.completion"] = "x\x00y"
    assert await runner_store.add_span(span) is not None
    await runner_store.update_attempt(r.rollout_id, aid, status="succeeded")
    done = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=10)
    assert [x.status for x in done] == ["succeeded"]
    (stored,) = await store.query_spans(r.rollout_id)
    assert stored.name in ("llm\x00call", "llm\ufffdcall")
    assert stored.attributes["gen_ai.completion"] in ("x\x00y", "x\ufffdy")


async def test_nul_characters_in_query_arguments_are_answered_as_any_text(store: Any, runner_store: Any) -> None:
    """A filter holding NUL finds what the value written with it became, and an id holding NUL is
    unknown, on both backends (a reviewer: Postgres refused the argument, and the server answered
    500 for ``GET /rollouts/a%00b`` and every search field)."""
    r = await store.enqueue_rollout("nul filters")
    d = await runner_store.dequeue_rollout()
    span = reward_span(r.rollout_id, d.attempt.attempt_id, 1, 1.0)
    span.name = "llm\x00call"
    await runner_store.add_span(span)
    await runner_store.update_attempt(r.rollout_id, "latest", status="succeeded")
    await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=10)
    assert [s.span_id for s in await store.query_spans(r.rollout_id, name="llm\x00call")] == [span.span_id]
    assert [s.span_id for s in await store.query_spans(r.rollout_id, name_contains="\x00")] == [span.span_id]
    assert await store.get_rollout_by_id("ro-\x00") is None
    assert list(await store.query_rollouts(rollout_id_contains="\x00")) == []
    assert list(await store.query_rollouts(status_in=["\x00"])) == []
    assert list(await store.query_workers(worker_id_contains="\x00")) == []
    for call in (
        lambda: store.query_spans("ro-\x00"),
        lambda: store.query_attempts("ro-\x00"),
        lambda: store.wait_for_rollouts(rollout_ids=["ro-\x00"], timeout=0),
    ):
        with pytest.raises(RolloutNotFoundError):
            await call()
    with pytest.raises(AttemptNotFoundError):
        await store.query_spans(r.rollout_id, attempt_id="at-\x00")


async def test_query_arguments_of_the_wrong_type_are_refused(store: Any) -> None:
    r = await store.enqueue_rollout("args")
    for kwargs in ({"limit": 1.5}, {"limit": None}, {"offset": "1"}, {"sort_by": "input"}, {"sort_by": "config"}):
        with pytest.raises(InvalidInputError):
            await store.query_rollouts(**kwargs)
    with pytest.raises(InvalidInputError):
        await store.query_spans(r.rollout_id, sort_by="attributes")
    for stats in ([1, 2], "busy", {"x": object()}):
        with pytest.raises(InvalidInputError):
            await store.update_worker("w-args", stats)


async def test_wrong_argument_types_are_also_type_errors(store: Any) -> None:
    """Where Agent-lightning 0.3.0 raises ``TypeError`` for a wrongly typed argument (``offset="1"``,
    ``limit=None``, ``heartbeat_stats=None`` or a list), eventlight's error is both an
    ``InvalidInputError`` and a ``TypeError``; so are the other wrong types (0.3.0: ``ValueError``)."""
    r = await store.enqueue_rollout("types")
    calls = {
        "offset='1'": lambda: store.query_rollouts(offset="1"),
        "limit=None": lambda: store.query_rollouts(limit=None),
        "limit=None (spans)": lambda: store.query_spans(r.rollout_id, limit=None),
        "heartbeat_stats=None": lambda: store.update_worker("w-types", None),
        "heartbeat_stats=[1, 2]": lambda: store.update_worker("w-types", [1, 2]),
        "a dict for a span": lambda: store.add_many_spans([{"name": "x"}]),
        "worker_id=123": lambda: store.dequeue_rollout(worker_id=123),
        "status_in=[1]": lambda: store.query_rollouts(status_in=[1]),
        "resources 'str'": lambda: store.add_resources("str"),
        "mode=123": lambda: store.enqueue_rollout("x", mode=123),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError) as info:
            await call()
        assert isinstance(info.value, InvalidInputError) and isinstance(info.value, ValueError), name
    assert len(await store.query_rollouts()) == 1 and await store.get_worker_by_id("w-types") is None


async def test_resources_versioning(store: Any) -> None:
    a = await store.add_resources({"p": PromptTemplate(template="v1")})
    b = await store.add_resources({"p": PromptTemplate(template="other")})
    assert (await store.get_latest_resources()).resources_id == b.resources_id
    u = await store.update_resources(a.resources_id, {"p": PromptTemplate(template="v2")})
    assert u.version == 2 and u.create_time == a.create_time
    latest = await store.get_latest_resources()
    assert latest.resources_id == a.resources_id and latest.resources["p"].template == "v2"
    assert await store.get_resources_by_id("rs-nope") is None
    put = await store.update_resources("v0", {"p": PromptTemplate(template="seed")})  # an unknown id: created (0.3.0)
    assert put.version == 1 and put.create_time == put.update_time
    assert (await store.get_resources_by_id("v0")).resources["p"].template == "seed"
    assert (await store.get_latest_resources()).resources_id == "v0"
    again = await store.update_resources("v0", {"p": PromptTemplate(template="seed 2")})
    assert again.version == 2 and again.create_time == put.create_time
    listed = await store.query_resources()
    assert [x.resources_id for x in listed] == [a.resources_id, b.resources_id, "v0"]
    with pytest.raises(InvalidInputError):
        await store.add_resources({"p": "not a resource"})
    with pytest.raises(InvalidInputError, match="not a valid id"):
        await store.update_resources("has space", {"p": PromptTemplate(template="x")})


async def test_worker_heartbeats(store: Any) -> None:
    w = await store.update_worker("Worker-7", {"cpu": 0.5})
    assert w.worker_id == "Worker-7" and w.last_heartbeat_time is not None
    await settle(store)
    got = await store.get_worker_by_id("Worker-7")
    assert got.status == "unknown" and got.heartbeat_stats == {"cpu": 0.5}
    assert await store.get_worker_by_id("Worker-nobody") is None
    with pytest.raises(InvalidInputError):
        await store.update_worker("Worker-7", None)


async def test_start_rollout_bypasses_the_queue(store: Any, runner_store: Any) -> None:
    started = await store.start_rollout({"k": 1}, mode="val", worker_id="w")
    assert started.status == "preparing" and started.attempt.sequence_id == 1
    assert await runner_store.dequeue_rollout() is None
    many = await store.enqueue_many_rollouts([EnqueueRolloutRequest(input=i) for i in range(3)])
    assert [m.input for m in many] == [0, 1, 2]


async def test_watchdog_times_out_and_requeues(store: Any) -> None:
    """``timeout`` from the watchdog follows ``RolloutConfig`` without anyone calling the store."""
    cfg = RolloutConfig(timeout_seconds=5, max_attempts=2, retry_condition=["timeout"])
    r = await store.enqueue_rollout("slow", config=cfg)
    d = await store.dequeue_rollout(worker_id="w")
    start = d.attempt.start_time
    await settle(store)
    assert await watchdog(store, start + 1) == 0
    assert await watchdog(store, start + 6) == 1
    await settle(store)
    got = await store.get_rollout_by_id(r.rollout_id)
    assert got.status == "requeuing" and got.attempt.status == "timeout"
    assert (await store.get_worker_by_id("w")).status == "unknown"


async def watchdog(store: Any, now: float) -> int:
    return len(await store.run_watchdog(now))


async def test_a_revived_superseded_attempt_whose_runner_vanishes_again_is_marked_unresponsive(
    store: Any, runner_store: Any
) -> None:
    """peer_failures C03, C20: runner A goes silent, its attempt goes ``unresponsive`` and B claims
    the retry; A's late span revives attempt 1 (``running``, not the latest), then A vanishes again.
    The watchdog marks attempt 1 ``unresponsive`` once more, while B runs and after B's success
    ended the rollout, and nothing else moves: the rollout follows B (C01). AGL 0.3.0 checks only
    the latest attempt, so attempt 1 would stay ``running`` for ever."""
    cfg = RolloutConfig(unresponsive_seconds=5, max_attempts=3, retry_condition=["unresponsive"])
    for b_finishes_first in (True, False):
        r = await store.enqueue_rollout("x", config=cfg)
        rid = r.rollout_id
        a = (await runner_store.dequeue_rollout(worker_id="a")).attempt
        await settle(store)
        assert await watchdog(store, a.start_time + 6) == 1
        await settle(store)
        b = (await runner_store.dequeue_rollout(worker_id="b")).attempt
        await runner_store.update_attempt(rid, b.attempt_id, last_heartbeat_time=time.time() + 1000)
        await runner_store.add_span(reward_span(rid, a.attempt_id, 1, 0.1))  # A, late: revived
        await settle(store)
        revived = (await store.query_attempts(rid))[0]
        assert revived.status == "running" and revived.last_heartbeat_time is not None
        if b_finishes_first:
            await runner_store.update_attempt(rid, b.attempt_id, status="succeeded")
            await settle(store)
        before = await store.get_rollout_by_id(rid)
        silent = revived.last_heartbeat_time + 6
        assert await watchdog(store, silent) == 1
        await settle(store)
        assert [x.status for x in await store.query_attempts(rid)] == [
            "unresponsive",
            "succeeded" if b_finishes_first else "preparing",
        ]
        after = await store.get_rollout_by_id(rid)
        assert (after.status, after.attempt.attempt_id, after.end_time) == (
            before.status,
            b.attempt_id,
            before.end_time,
        )
        assert (await store.get_worker_by_id("a")).status == "unknown"
        assert await watchdog(store, silent + 2000) == (0 if b_finishes_first else 1)  # then only B, if live


async def test_a_finished_rollouts_revived_latest_attempt_whose_runner_vanishes_is_marked(
    store: Any, runner_store: Any
) -> None:
    """A rollout ``failed`` because its only attempt went ``unresponsive`` (no retry left); the
    runner's late span revives the attempt (``running``: the finished rollout keeps ``failed``),
    then the runner vanishes. The watchdog marks the attempt ``unresponsive`` once more, and
    ``timeout`` past ``timeout_seconds`` after another late span, and the rollout keeps ``failed``
    and its ``end_time``. It used to check a latest attempt only while its rollout was in flight:
    the revived attempt stayed ``running`` for ever (as in 0.3.0)."""
    r = await store.enqueue_rollout("x", config=RolloutConfig(unresponsive_seconds=5, timeout_seconds=100))
    rid = r.rollout_id
    a = (await runner_store.dequeue_rollout(worker_id="a")).attempt
    await settle(store)
    assert await watchdog(store, a.start_time + 6) == 1
    (ended,) = await store.wait_for_rollouts(rollout_ids=[rid], timeout=10)
    assert ended.status == "failed" and ended.end_time is not None
    for seq, status in ((1, "unresponsive"), (2, "timeout")):
        await runner_store.add_span(reward_span(rid, a.attempt_id, seq, 0.1))  # back late: revived
        await settle(store)
        [revived] = await store.query_attempts(rid)
        assert revived.status == "running" and revived.last_heartbeat_time is not None
        silent = revived.last_heartbeat_time + 6 if status == "unresponsive" else a.start_time + 101
        assert await watchdog(store, silent) == 1
        await settle(store)
        [marked] = await store.query_attempts(rid)
        assert marked.status == status and marked.metadata[STATUS_REASON].startswith(status)
        got = await store.get_rollout_by_id(rid)
        assert (got.status, got.end_time) == ("failed", ended.end_time)
    assert await watchdog(store, a.start_time + 2000) == 0


async def test_a_cancelled_rollout_requeued_before_its_runners_heartbeat_is_not_taken_back(
    store: Any, runner_store: Any
) -> None:
    """Cancel, then requeue (``update_rollout(status="queuing")``) before the runner's next
    heartbeat: the cancel recorded the runner's attempt ``failed`` (``CANCELLED_REASON``), so that
    heartbeat leaves the rollout in the queue, ``rollout_cancelled`` tells the runner its attempt
    was cancelled, and the next claim starts attempt 2. Without that the heartbeat took the
    requeued rollout back (0.3.0's revive rule) and the runner, asking about the rollout, ran on."""
    r = await store.enqueue_rollout("x", config=RolloutConfig(unresponsive_seconds=30))
    rid = r.rollout_id
    a = (await runner_store.dequeue_rollout(worker_id="a")).attempt
    await store.update_rollout(rid, status="cancelled")
    await store.update_rollout(rid, status="queuing")
    beat = await runner_store.update_attempt(rid, a.attempt_id, last_heartbeat_time=time.time())
    assert beat.status == "failed" and beat.metadata == {STATUS_REASON: CANCELLED_REASON}
    await settle(store)
    assert (await store.get_rollout_by_id(rid)).status == "queuing"
    assert await runner_store.rollout_cancelled(rid, a.attempt_id) is True
    assert await runner_store.rollout_cancelled(rid) is False  # the rollout itself is queued again
    b = await runner_store.dequeue_rollout(worker_id="b")
    assert b is not None and (b.rollout_id, b.attempt.sequence_id) == (rid, 2)
    assert await runner_store.rollout_cancelled(rid, a.attempt_id) is True
    assert await runner_store.rollout_cancelled(rid, b.attempt.attempt_id) is False
    await runner_store.update_attempt(rid, b.attempt.attempt_id, status="succeeded")
    (done,) = await store.wait_for_rollouts(rollout_ids=[rid], timeout=10)
    assert (done.status, done.attempt.attempt_id) == ("succeeded", b.attempt.attempt_id)


async def _cancel_outcome(store: Any, rid: str) -> tuple[Any, ...]:
    """The rollout's status, whether it has an ``end_time``, and each attempt's status and reason."""
    await settle(store)
    got = await store.get_rollout_by_id(rid)
    attempts = await store.query_attempts(rid)
    return got.status, got.end_time is not None, [(a.status, (a.metadata or {}).get(STATUS_REASON)) for a in attempts]


async def test_a_cancel_in_each_state_ends_what_ran_and_nothing_else(store: Any, runner_store: Any) -> None:
    """A cancel of a rollout queuing, preparing, running (twice), requeuing after a ``failed``
    attempt, requeuing after an ``unresponsive`` one, and cancelled-requeued-claimed-cancelled: the
    rollout ends ``cancelled``, every attempt that had not finished is ``failed`` with
    ``CANCELLED_REASON``, a finished one keeps its own status and reason; a span, a heartbeat after
    the cancel change neither, a late ``running`` is refused, a finished rollout refuses the cancel.
    The same answers on both backends."""
    cfg = RolloutConfig(unresponsive_seconds=5, max_attempts=3, retry_condition=["unresponsive", "failed"])
    cancelled = [("failed", CANCELLED_REASON)]

    async def claimed(name: str) -> tuple[str, str]:
        r = await store.enqueue_rollout(name, config=cfg)
        d = await runner_store.dequeue_rollout(worker_id="w")
        assert d is not None and d.rollout_id == r.rollout_id
        return r.rollout_id, d.attempt.attempt_id

    queued = (await store.enqueue_rollout("queuing", config=cfg)).rollout_id
    await store.update_rollout(queued, status="cancelled")
    assert await _cancel_outcome(store, queued) == ("cancelled", True, [])

    rid, aid = await claimed("preparing")
    await store.update_rollout(rid, status="cancelled")
    await runner_store.add_span(reward_span(rid, aid, 1, 0.1))
    await runner_store.update_attempt(rid, aid, last_heartbeat_time=time.time())
    with pytest.raises(InvalidTransitionError, match="already finished"):
        await runner_store.update_attempt(rid, aid, status="running")
    assert await _cancel_outcome(store, rid) == ("cancelled", True, cancelled)

    rid, aid = await claimed("running")
    await runner_store.update_attempt(rid, aid, status="running")
    for _ in range(2):
        await store.update_rollout(rid, status="cancelled")
    assert await _cancel_outcome(store, rid) == ("cancelled", True, cancelled)

    rid, aid = await claimed("requeuing after failed")
    await runner_store.update_attempt(rid, aid, status="failed")
    await store.update_rollout(rid, status="cancelled")
    assert await _cancel_outcome(store, rid) == ("cancelled", True, [("failed", None)])

    rid, aid = await claimed("requeuing after unresponsive")
    await settle(store)
    assert await watchdog(store, (await store.query_attempts(rid))[0].start_time + 6) == 1
    await store.update_rollout(rid, status="cancelled")
    assert await _cancel_outcome(store, rid) == ("cancelled", True, cancelled)

    rid, aid = await claimed("cancelled twice around a requeue")
    await store.update_rollout(rid, status="cancelled")
    await store.update_rollout(rid, status="queuing")
    again = await runner_store.dequeue_rollout(worker_id="w2")
    assert again is not None and again.rollout_id == rid
    await store.update_rollout(rid, status="cancelled")
    assert await _cancel_outcome(store, rid) == ("cancelled", True, cancelled * 2)
    for attempt_id in (aid, again.attempt.attempt_id):
        assert await runner_store.rollout_cancelled(rid, attempt_id) is True
    with pytest.raises(AttemptNotFoundError):  # as its docstring says, cancelled or not
        await runner_store.rollout_cancelled(rid, "at-not-this-rollouts")

    rid, aid = await claimed("succeeded")
    await runner_store.update_attempt(rid, aid, status="succeeded")
    with pytest.raises(InvalidTransitionError, match="finished"):
        await store.update_rollout(rid, status="cancelled")
    assert await _cancel_outcome(store, rid) == ("succeeded", True, [("succeeded", None)])


async def test_a_cancel_cut_short_half_way_leaves_no_rollout_in_flight_under_an_ended_attempt(
    store: Any, runner_store: Any, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On JetStream a command's events are separate publishes: NATS lost after the first leaves
    that one in the log (``ServiceUnavailableError`` to the caller). The cancel's first event, the
    latest attempt's end, carries the rollout's ``cancelled``, so that prefix is a cancelled
    rollout. It used to leave the rollout ``running`` with its latest attempt ``failed``: not
    watched (no live attempt), never finished, ``wait_for_rollouts`` waited for it for ever."""
    if backend == "memory":
        pytest.skip("the in-memory log appends a command's events at once")
    import eventlight.store.jetstream.appender as appender

    r = await store.enqueue_rollout("x", config=RolloutConfig(unresponsive_seconds=5))
    rid = r.rollout_id
    a = (await runner_store.dequeue_rollout(worker_id="w")).attempt
    await runner_store.update_attempt(rid, a.attempt_id, status="running")
    await settle(store)
    publish, sent = appender.publish_acked, []

    async def lost_after_the_attempts_end(*args: Any, **kwargs: Any) -> Any:
        if sent and CANCELLED_REASON.encode() in sent[-1] and b'"rollout_updated"' in args[2]:
            raise ServiceUnavailableError("nats://127.0.0.1", "the connection was lost")
        sent.append(args[2])
        return await publish(*args, **kwargs)

    monkeypatch.setattr(appender, "publish_acked", lost_after_the_attempts_end)
    with pytest.raises(ServiceUnavailableError):
        await store.update_rollout(rid, status="cancelled")
    monkeypatch.setattr(appender, "publish_acked", publish)
    assert await _cancel_outcome(store, rid) == ("cancelled", True, [("failed", CANCELLED_REASON)])
    (ended,) = await store.wait_for_rollouts(rollout_ids=[rid], timeout=10)
    assert ended.status == "cancelled"


async def test_statistics_and_capabilities(store: Any, runner_store: Any, zero_copy: bool) -> None:
    r = await store.enqueue_rollout("q")
    d = await runner_store.dequeue_rollout(worker_id="w")
    await runner_store.add_span(reward_span(r.rollout_id, d.attempt.attempt_id, 1, 1.0))
    await settle(store)
    stats = await store.statistics()
    assert stats["name"] == type(store).__name__
    assert isinstance(stats["uptime"], float) and 0.0 < stats["uptime"] < 600  # seconds since construction (0.3.0)
    assert (stats["total_rollouts"], stats["total_attempts"], stats["total_spans"]) == (1, 1, 1)
    caps = store.capabilities
    assert caps.get("async_safe") is True and caps.get("otlp_traces", False) is False
    assert caps.get("zero_copy") is zero_copy
    with pytest.raises(NotImplementedError):
        store.otlp_traces_endpoint()  # only stores with capabilities["otlp_traces"] serve OTLP


async def test_a_metadata_update_after_the_first_span_keeps_the_attempt_running(store: Any, runner_store: Any) -> None:
    """Spans move an attempt; an update without a status decides on that (and writes only metadata)."""
    started = await store.start_rollout("x")  # cached as `preparing` by the store that updates it
    rid, aid = started.rollout_id, started.attempt.attempt_id
    await runner_store.add_span(reward_span(rid, aid, 1, 1.0))  # another writer's span
    got = await store.update_attempt(rid, aid, metadata={"k": 1})
    assert (got.status, got.metadata) == ("running", {"k": 1})
    await settle(store)
    latest = await store.get_latest_attempt(rid)
    assert (latest.status, latest.metadata) == ("running", {"k": 1})
    assert (await store.get_rollout_by_id(rid)).status == "running"
    d = await store.start_attempt(rid, worker_id="w")
    await runner_store.add_span(reward_span(d.rollout_id, d.attempt.attempt_id, 1, 1.0))
    again = await runner_store.update_attempt(d.rollout_id, d.attempt.attempt_id, metadata={"k": 2})
    assert again.status == "running"


async def test_worker_ids_must_be_tokens_everywhere(store: Any) -> None:
    """Worker ids become subject tokens: one with dots or spaces is refused on every backend."""
    r = await store.enqueue_rollout("x")
    for call in (
        store.start_attempt(r.rollout_id, worker_id="bad id.with dots"),
        store.dequeue_rollout(worker_id="bad id.with dots"),
        store.start_rollout("y", worker_id="bad.id"),
        store.update_worker("bad id"),
    ):
        with pytest.raises(InvalidInputError, match="worker_id"):
            await call
    assert (await store.get_rollout_by_id(r.rollout_id)).status == "queuing"


async def test_a_non_blocking_dequeue_yields_to_the_event_loop(runner_store: Any) -> None:
    """A ``dequeue_rollout()`` on an empty queue lets other tasks run (a pull yields as a round trip
    does, on every backend): a poller that never sleeps cannot starve the loop it shares."""
    ran = asyncio.Event()

    async def other() -> None:
        ran.set()

    task = asyncio.ensure_future(other())
    assert await runner_store.dequeue_rollout() is None  # no worker id: no idle mark written
    assert ran.is_set()
    await task


async def test_repeated_empty_polls_mark_a_worker_idle_once(store: Any, runner_store: Any) -> None:
    """peer_failures C19: an empty poll is no error: the worker is idle."""
    assert await runner_store.dequeue_rollout(worker_id="w") is None
    await settle(store)
    first = (await store.get_worker_by_id("w")).last_dequeue_time
    await asyncio.sleep(0.01)
    assert await runner_store.dequeue_rollout(worker_id="w") is None
    await settle(store)
    w = await store.get_worker_by_id("w")
    assert w.status == "idle" and first is not None and w.last_dequeue_time == first


async def test_a_rollout_queued_after_an_empty_poll_is_handed_out_at_once(
    store: Any, runner_store: Any, backend_namespace: Settings | None
) -> None:
    """peer_failures C18: an empty poll that timed out leaves no pull request behind (nats-py's
    ``fetch`` left an orphan that took the next message, and the next fetch sat out its whole
    timeout). Each time, a rollout queued after an empty poll goes to the next poll at once, and
    the runners' consumer holds no waiting pull once the poll has its answer."""
    slowest = 0.0
    for i in range(40):
        assert await runner_store.dequeue_rollout(worker_id="w", wait_s=0.05) is None
        r = await store.enqueue_rollout(i)
        t0 = time.monotonic()
        d = await runner_store.dequeue_rollout(worker_id="w", wait_s=5)
        slowest = max(slowest, time.monotonic() - t0)
        assert d is not None and d.rollout_id == r.rollout_id, f"iteration {i}"
        await runner_store.update_attempt(d.rollout_id, d.attempt.attempt_id, status="succeeded")
        if backend_namespace is not None:
            info = await runner_store.log.js.consumer_info(backend_namespace.stream_name, "runners")
            assert info.num_waiting == 0, f"iteration {i}: {info.num_waiting} pull request(s) left waiting"
    assert slowest < 0.5, f"a queued rollout waited {slowest:.2f} s for a poll"


async def _hand_back_next_entry(store: Any, rollout_id: str) -> int:
    """Take the queue's next entry without claiming it and hand it back (``nak``): offered again,
    it is a redelivered entry (JetStream's num_delivered 2; in memory, a handed-back one), which a
    non-blocking dequeue finds once ``nak`` has returned
    (``test_an_entry_handed_back_is_found_by_the_next_non_blocking_dequeue``)."""
    item = await store._log().next_queued(1.0)
    assert item is not None and item.rollout_id == rollout_id
    await item.nak(0.0)
    return int(item.seq)


HAND_BACK_ROUNDS = 200


async def test_an_entry_handed_back_is_found_by_the_next_non_blocking_dequeue(store: Any) -> None:
    """Once ``nak`` returns, a non-blocking dequeue finds the entry it handed back, every time. On
    JetStream the ``-NAK`` was a publish the server took in its own time, after a ``no_wait`` pull
    that left in the same write: the pull answered "no messages" (5 in 100 under load), and the
    empty answer's confirmation (``STREAM.INFO``) sees stream writes, not hand-backs."""
    r = await store.enqueue_rollout({"q": 3})
    log = store._log()
    missed = []
    for i in range(HAND_BACK_ROUNDS):
        item = await log.next_queued(0.0)
        if item is None:
            missed.append(i)
            item = await log.next_queued(10.0)  # the entry is still there: carry on with it
        assert item is not None and item.rollout_id == r.rollout_id
        await item.nak(0.0)
    assert missed == [], f"{len(missed)} of {HAND_BACK_ROUNDS} non-blocking dequeues after a hand-back found nothing"
    claimed = await store.dequeue_rollout(worker_id="w")
    assert claimed is not None and claimed.rollout_id == r.rollout_id


@pytest.mark.parametrize("requeue", ["failed", "update_rollout"])
@pytest.mark.parametrize("after", [None, "metadata", "heartbeat_of_failed"])
async def test_a_requeued_rollouts_redelivered_entry_is_still_claimed(store: Any, requeue: str, after: str) -> None:
    """A rollout sent back to the queue (its attempt failed with a retry left, or
    ``update_rollout(status="queuing")``) has a fresh entry; offered again after a hand-back
    (redelivered), with or without events after it that leave the rollout queued, it is not taken
    for a stale entry: the next dequeue claims the rollout."""
    cfg = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    r = await store.enqueue_rollout({"q": 1}, config=cfg)
    first = await store.dequeue_rollout(worker_id="w1")
    assert first is not None and first.rollout_id == r.rollout_id
    a1 = first.attempt.attempt_id
    if requeue == "failed":
        await store.update_attempt(r.rollout_id, a1, status="failed")
    else:
        await store.update_attempt(r.rollout_id, a1, status="failed")  # ends a1: no heartbeat revives it
        await store.update_rollout(r.rollout_id, status="queuing")
    await _hand_back_next_entry(store, r.rollout_id)
    if after == "metadata":
        await store.update_rollout(r.rollout_id, metadata={"touched": True})
    elif after == "heartbeat_of_failed":
        await store.update_attempt(r.rollout_id, a1, last_heartbeat_time=time.time())
    await settle(store)
    assert (await store.get_rollout_by_id(r.rollout_id)).status in ("queuing", "requeuing")
    second = await store.dequeue_rollout(worker_id="w2")
    assert second is not None and second.rollout_id == r.rollout_id
    assert second.attempt.sequence_id == 2 and second.attempt.worker_id == "w2"


async def test_a_fresh_entry_handed_back_is_claimed_and_stale_ones_are_not(store: Any) -> None:
    """A rollout's creation entry handed back is claimed from its state (no later event); once
    claimed, its old entries handed back are passed over and the rollout keeps one attempt."""
    r = await store.enqueue_rollout({"q": 2})
    await store.update_rollout(r.rollout_id, status="queuing")  # already queuing: no event, no entry
    await _hand_back_next_entry(store, r.rollout_id)
    claimed = await store.dequeue_rollout(worker_id="w")
    assert claimed is not None and claimed.rollout_id == r.rollout_id
    assert await store.dequeue_rollout(worker_id="w") is None
    await settle(store)
    assert len(await store.query_attempts(r.rollout_id)) == 1
