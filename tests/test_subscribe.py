"""The algorithm as a subscriber: ``store.subscribe_triplets`` / ``subscribe_messages`` on both backends.

Finished attempts come in log order with the adapter's output, the same data ``eventlight.replay``
makes from the same log; a durable subscription resumes after its last acknowledged record; bad
input fails at once with one line; a malformed entry in the log is reported with its position and
ids while the subscription goes on. The kill -9 restart test is ``tests/test_subscribe_restart.py``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

import eventlight
from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.core.types import RolloutConfig, Span
from eventlight.ops import apply_streams
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats
from eventlight.store.memory import InMemoryLightningStore
from eventlight.store.subscription import FinishedAttempt
from tests.faults import NatsServer
from tests.test_replay import llm_span, reward_span, workload

ACK_FLUSH_S = 2.0
"""Measured here: a nats-server killed within ~0.1 s of an acknowledgement may restart without it."""


def names(spans: list[Span]) -> list[str]:
    """A small adapter: the span names, in order."""
    return [s.name for s in spans]


async def finish_one(store: Any, status: str = "succeeded", reward: float | None = 0.5, llm: bool = True) -> str:
    r = await store.enqueue_rollout({"task": "t"})
    d = await store.dequeue_rollout(worker_id="w1")
    aid = d.attempt.attempt_id
    if llm:
        await store.add_many_spans([llm_span(r.rollout_id, aid, 1, "x", 10.0)])
    if reward is not None:
        await store.add_span(reward_span(r.rollout_id, aid, 2, reward, 12.0))
    await store.update_attempt(r.rollout_id, aid, status=status)
    return str(r.rollout_id)


async def test_finished_attempts_match_replay(store: Any) -> None:
    async with store.subscribe_triplets() as sub:
        ids = await workload(store)
        records = await sub.collect(list(ids.values()), timeout_s=20)
    assert [r.rollout_id for r in records] == list(ids.values())
    assert [r.status for r in records] == ["succeeded", "succeeded", "failed"]
    assert [r.final_reward for r in records] == [0.9, 0.2, None]
    assert [r.position for r in records] == sorted(r.position for r in records)
    replayed = [r async for r in eventlight.replay(store, adapter="triplets")]
    for rec in records:
        mine = [r for r in replayed if r["attempt_id"] == rec.attempt_id]
        assert [t.response for t in rec.data] == [r["response"] for r in mine]
        assert [t.reward for t in rec.data] == [r["reward"] for r in mine]
        assert rec.span_positions == mine[0]["log_positions"]
        assert rec.started_position == mine[0]["attempt_seq"]
        assert rec.resources_id == mine[0]["resources_id"]
        assert all(t.prompt["token_ids"] for t in rec.data)


async def test_messages_and_filters(store: Any) -> None:
    async with store.subscribe_messages(modes="val") as sub:
        ids = await workload(store)
        record = await sub.next_record(timeout_s=20)
        assert record is not None and record.rollout_id == ids["val"]
        assert record.data[0]["messages"][0] == {"role": "user", "content": "q val"}
        assert await sub.next_record(timeout_s=0.3) is None  # the train rollouts were filtered out


async def test_a_retried_rollout_is_collected_at_its_last_attempt(store: Any) -> None:
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    async with store.subscribe(names) as sub:
        r = await store.enqueue_rollout({"task": "retry"}, config=config)
        for status in ("failed", "succeeded"):
            d = await store.dequeue_rollout(worker_id="w1")
            await store.add_span(reward_span(r.rollout_id, d.attempt.attempt_id, 1, 1.0, 1.0))
            await store.update_attempt(r.rollout_id, d.attempt.attempt_id, status=status)
        (last,) = await sub.collect([r.rollout_id], timeout_s=20)
    assert (last.attempt.sequence_id, last.status, last.rollout.status) == (2, "succeeded", "succeeded")
    assert last.data == ["agentlightning.annotation"]


async def test_a_superseded_attempt_still_live_when_its_rollout_ends_is_never_collected_for_it(store: Any) -> None:
    """peer_failures C03, C16 (b): runner A's attempt goes silent (``unresponsive``) and is retried;
    A's late span revives it while B's attempt 2 runs. When B succeeds, both attempts are done at
    that one log position (A's never finished); ``collect`` hands the algorithm attempt 2's
    record, with B's reward, never A's partial trace with A's reward."""
    config = RolloutConfig(max_attempts=3, retry_condition=["unresponsive"])
    async with store.subscribe(names) as sub:
        r = await store.enqueue_rollout({"task": "vanished"}, config=config)
        a = await store.dequeue_rollout(worker_id="a")
        await store.add_span(reward_span(r.rollout_id, a.attempt.attempt_id, 1, 0.1, 1.0))
        await store.update_attempt(r.rollout_id, a.attempt.attempt_id, status="unresponsive")  # as the watchdog
        b = await store.dequeue_rollout(worker_id="b")
        assert (b.rollout_id, b.attempt.sequence_id) == (r.rollout_id, 2)
        await store.add_span(reward_span(r.rollout_id, a.attempt.attempt_id, 2, 0.2, 2.0))  # A, late
        await store.add_span(reward_span(r.rollout_id, b.attempt.attempt_id, 1, 0.9, 3.0))
        await store.update_attempt(r.rollout_id, b.attempt.attempt_id, status="succeeded")
        (got,) = await sub.collect([r.rollout_id], timeout_s=20)
        assert (got.attempt_id, got.status, got.final_reward) == (b.attempt.attempt_id, "succeeded", 0.9)
        assert got.rollout.status == "succeeded"
    async with store.subscribe(names, since=0) as sub:  # each attempt once, A's as it was when the rollout ended
        records = [await sub.next_record(timeout_s=20) for _ in range(2)]
        assert await sub.next_record(timeout_s=0.3) is None
    assert [(x.attempt_id, x.latest, x.final_reward) for x in records if x is not None] == [
        (a.attempt.attempt_id, False, 0.2),
        (b.attempt.attempt_id, True, 0.9),
    ]


async def test_an_attempt_its_rollouts_end_finished_is_recorded_as_the_read_model_has_it(store: Any) -> None:
    """The feed carries no spans, yet spans move attempts: A's late span revived its superseded
    attempt (``unresponsive`` -> ``running``) before B's success ended the rollout, and a cancelled
    rollout's attempt had moved ``preparing`` -> ``running`` on its first span before the cancel
    ended it (``failed``). Each record shows its attempt as the read model has it at that position
    (DESIGN: one fold), not ``unresponsive`` or ``preparing``."""
    config = RolloutConfig(max_attempts=3, retry_condition=["unresponsive"])
    r = await store.enqueue_rollout({"task": "vanished"}, config=config)
    rid = r.rollout_id
    a = (await store.dequeue_rollout(worker_id="a")).attempt
    await store.update_attempt(rid, a.attempt_id, status="unresponsive")  # as the watchdog
    b = (await store.dequeue_rollout(worker_id="b")).attempt
    await store.add_span(reward_span(rid, a.attempt_id, 1, 0.2, 2.0))  # A, late: revived
    await store.update_attempt(rid, b.attempt_id, status="succeeded")
    c = await store.enqueue_rollout({"task": "cancelled"})
    d = (await store.dequeue_rollout(worker_id="c")).attempt
    await store.add_span(reward_span(c.rollout_id, d.attempt_id, 1, 0.5, 1.0))
    await store.update_rollout(c.rollout_id, status="cancelled")
    async with store.subscribe(names, since=0) as sub:
        records = [await sub.next_record(timeout_s=20) for _ in range(3)]
    await store.sync_all(timeout_s=10)
    model = {x.attempt_id: x for x in [*await store.query_attempts(rid), *await store.query_attempts(c.rollout_id)]}
    got = [(x.attempt_id, x.status, x.latest) for x in records if x is not None]
    assert got == [(a.attempt_id, "running", False), (b.attempt_id, "succeeded", True), (d.attempt_id, "failed", True)]
    for x in records:
        assert x is not None
        if x.attempt_id == a.attempt_id:  # done with a status a span can change: exactly the model's
            assert x.attempt == model[x.attempt_id]
        else:  # done with a final status, which no span changes (their heartbeat time is not folded)
            assert (x.attempt.status, x.attempt.metadata) == (model[x.attempt_id].status, model[x.attempt_id].metadata)


async def test_a_cancelled_rollouts_latest_attempt_is_yielded_failed_under_the_cancelled_rollout(store: Any) -> None:
    """A rollout cancelled while its attempt runs: the record plain iteration yields for that
    attempt shows it ``failed`` under the ``cancelled`` rollout, as the read model has them after
    the cancel, and ``collect`` (another subscription) returns that same record. It showed the rollout ``running`` (the
    attempt's end came before the cancel, moving nothing): a state no reader ever saw."""
    async with store.subscribe(names) as sub:
        r = await store.enqueue_rollout({"task": "cancelled while it runs"})
        d = await store.dequeue_rollout(worker_id="w1")
        await store.add_span(reward_span(r.rollout_id, d.attempt.attempt_id, 1, 0.5, 1.0))
        await store.update_rollout(r.rollout_id, status="cancelled")
        record = await sub.next_record(timeout_s=20)
        assert record is not None and record.latest
        assert (record.attempt.status, record.rollout.status) == ("failed", "cancelled")
        assert record.rollout.end_time is not None
    async with store.subscribe(names, since=0) as again:
        assert await again.collect([r.rollout_id], timeout_s=20) == [record]
    await store.sync_all(timeout_s=10)
    assert record.rollout.status == (await store.get_rollout_by_id(r.rollout_id)).status


async def test_a_finished_rollout_sent_back_to_the_queue_is_collected_from_its_next_run(store: Any) -> None:
    """A result kept for a later ``collect`` (its rollout finished while another was collected) is
    not returned once the rollout went back to the queue (``update_rollout(status="queuing")``):
    ``collect`` waits for the run after the requeue and returns its attempt and reward."""
    async with store.subscribe(names) as sub:
        again = await finish_one(store, reward=0.2)
        other = await finish_one(store, reward=0.5)
        assert [x.rollout_id for x in await sub.collect([other], timeout_s=20)] == [other]  # keeps `again`'s
        await store.update_rollout(again, status="queuing")
        assert await sub.collect([again], timeout_s=0.5) == []  # not finished: running again
        d = await store.dequeue_rollout(worker_id="w2")
        assert d is not None and d.rollout_id == again and d.attempt.sequence_id == 2
        await store.add_span(reward_span(again, d.attempt.attempt_id, 1, 0.9, 20.0))
        await store.update_attempt(again, d.attempt.attempt_id, status="succeeded")
        [got] = await sub.collect([again], timeout_s=20)
        assert (got.attempt_id, got.final_reward, got.latest) == (d.attempt.attempt_id, 0.9, True)


async def test_a_rollout_cancelled_while_it_waits_for_its_retry_is_collected(store: Any) -> None:
    """A retried rollout cancelled while it waits in the queue (its latest attempt failed at an
    earlier event, so the cancel finishes no attempt) is terminal: ``wait_for_rollouts`` returns it
    at once, ``collect`` should too (its latest attempt, ``rollout.status`` ``cancelled``), not
    leave it out as "not terminal" once ``timeout_s`` has passed."""
    config = RolloutConfig(max_attempts=3, retry_condition=["failed", "unresponsive"])
    async with store.subscribe(names) as sub:
        r = await store.enqueue_rollout({"task": "cancel in queue"}, config=config)
        a = await store.dequeue_rollout(worker_id="a")
        await store.update_attempt(r.rollout_id, a.attempt.attempt_id, status="failed")
        await store.update_rollout(r.rollout_id, status="cancelled")
        (ended,) = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=20)
        assert ended.status == "cancelled"
        got = await sub.collect([r.rollout_id], timeout_s=3)
    assert [(x.attempt_id, x.latest, x.rollout.status) for x in got] == [(a.attempt.attempt_id, True, "cancelled")]


async def test_a_rollout_cancelled_in_the_queue_with_a_stale_attempt_is_collected(store: Any) -> None:
    """As above, with a superseded attempt still ``unresponsive``: the cancel makes only that one
    done (``latest`` False). Before ``FinishedAttempt.latest`` ``collect`` returned the stale
    record (the wrong attempt, but the rollout came back); now it leaves the rollout out."""
    config = RolloutConfig(max_attempts=3, retry_condition=["failed", "unresponsive"])
    async with store.subscribe(names) as sub:
        r = await store.enqueue_rollout({"task": "stale then cancel"}, config=config)
        a = await store.dequeue_rollout(worker_id="a")
        await store.update_attempt(r.rollout_id, a.attempt.attempt_id, status="unresponsive")  # as the watchdog
        b = await store.dequeue_rollout(worker_id="b")
        assert (b.rollout_id, b.attempt.sequence_id) == (r.rollout_id, 2)
        await store.update_attempt(r.rollout_id, b.attempt.attempt_id, status="failed")
        await store.update_rollout(r.rollout_id, status="cancelled")
        (ended,) = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=20)
        assert ended.status == "cancelled"
        got = await sub.collect([r.rollout_id], timeout_s=3)
    assert [(x.attempt_id, x.latest, x.rollout.status) for x in got] == [(b.attempt.attempt_id, True, "cancelled")]


async def test_plain_iteration_yields_each_attempt_once_when_a_cancel_ends_its_rollout(store: Any) -> None:
    """The cancel that ends a rollout waiting for its retry is ``collect``'s signal only: iterating
    yields the failed attempt once, at its failure, and nothing at the cancel."""
    config = RolloutConfig(max_attempts=3, retry_condition=["failed"])
    async with store.subscribe(names) as sub:
        r = await store.enqueue_rollout({"task": "cancel in queue"}, config=config)
        a = await store.dequeue_rollout(worker_id="a")
        await store.update_attempt(r.rollout_id, a.attempt.attempt_id, status="failed")
        await store.update_rollout(r.rollout_id, status="cancelled")
        after = await finish_one(store)
        records = [await sub.next_record(timeout_s=20) for _ in range(2)]
        assert await sub.next_record(timeout_s=0.3) is None
    got = [(x.rollout_id, x.attempt.status, x.rollout.status) for x in records if x is not None]
    assert got == [(r.rollout_id, "failed", "requeuing"), (after, "succeeded", "succeeded")]


async def test_a_rollout_cancelled_before_any_attempt_is_not_waited_for(store: Any) -> None:
    """A rollout cancelled in the queue before any attempt has no attempt to return as a
    ``FinishedAttempt``: ``collect`` stops waiting for it at its cancel, leaves it out and lists
    it in ``unattempted``, instead of waiting ``timeout_s`` for a result that never comes. The
    same holds when another ``collect`` met the cancel first (kept for later)."""
    async with store.subscribe(names) as sub:
        never = await store.enqueue_rollout({"task": "never ran"})
        await store.update_rollout(never.rollout_id, status="cancelled")
        done = await finish_one(store)
        got = await sub.collect([never.rollout_id, done], timeout_s=10)
        assert [x.rollout_id for x in got] == [done] and not sub.unattempted.keys() - {never.rollout_id}
        assert sub.unattempted[never.rollout_id].status == "cancelled"
        kept = await store.enqueue_rollout({"task": "never ran either"})
        await store.update_rollout(kept.rollout_id, status="cancelled")
        other = await finish_one(store)
        assert [x.rollout_id for x in await sub.collect([other], timeout_s=20)] == [other]
        assert sub.unattempted == {}
        assert await sub.collect([kept.rollout_id], timeout_s=10) == []
        assert list(sub.unattempted) == [kept.rollout_id]


async def test_a_rollout_collected_before_comes_again_at_once(store: Any) -> None:
    """A rollout the previous ``collect`` returned, asked for again (the same ids once more after a
    partial result), comes again at once, the same record, as ``wait_for_rollouts`` answers again;
    it waited out ``timeout_s`` for an event the feed had passed and left it out. One returned by
    an earlier ``collect`` than the previous one is no longer held: ``InvalidInputError`` at once,
    unless it went back to the queue since (its next run is collected). A rollout cancelled before
    any attempt, asked again, is listed in ``unattempted`` again."""
    async with store.subscribe(names) as sub:
        first = await finish_one(store, reward=0.2)
        [got] = await sub.collect([first], timeout_s=20)
        second = await finish_one(store, reward=0.4)
        again = await sub.collect([first, second], timeout_s=10)
        assert [x.rollout_id for x in again] == [first, second] and again[0] == got
        assert await sub.collect([first, second], timeout_s=10) == again
        never = await store.enqueue_rollout({"task": "never ran"})
        await store.update_rollout(never.rollout_id, status="cancelled")
        assert await sub.collect([never.rollout_id], timeout_s=10) == []
        assert await sub.collect([never.rollout_id], timeout_s=10) == [] and list(sub.unattempted) == [never.rollout_id]
        with pytest.raises(InvalidInputError, match=f"rollout {second} was returned by an earlier collect"):
            await sub.collect([second], timeout_s=10)
        await store.update_rollout(first, status="queuing")
        d = await store.dequeue_rollout(worker_id="w2")
        assert d is not None and (d.rollout_id, d.attempt.sequence_id) == (first, 2)
        await store.add_span(reward_span(first, d.attempt.attempt_id, 1, 0.9, 20.0))
        await store.update_attempt(first, d.attempt.attempt_id, status="succeeded")
        [rerun] = await sub.collect([first], timeout_s=20)
        assert (rerun.attempt_id, rerun.final_reward) == (d.attempt.attempt_id, 0.9)


async def test_a_rollout_that_ended_before_the_subscription_started_is_collected_at_once(store: Any) -> None:
    """A rollout that ended before the subscription's first position (an algorithm that enqueued,
    then subscribed late) is collected at once, as a subscription that had started before it
    collects it: its latest attempt (the retry's, not the failed one), a rollout cancelled while it
    waited for its retry as its latest attempt, one cancelled before any attempt in ``unattempted``.
    ``timeout_s=0``: no waiting at all (the feed never brings their end; collect waited out its
    timeout and left them out). Asked again, the same records come (held)."""
    config = RolloutConfig(max_attempts=2, retry_condition=["failed"])
    r = await store.enqueue_rollout({"task": "retried"}, config=config)
    for status, reward in (("failed", 0.1), ("succeeded", 0.8)):
        d = await store.dequeue_rollout(worker_id="w1")
        await store.add_span(reward_span(r.rollout_id, d.attempt.attempt_id, 1, reward, 1.0))
        await store.update_attempt(r.rollout_id, d.attempt.attempt_id, status=status)
    waiting = await store.enqueue_rollout({"task": "cancelled in the queue"}, config=config)
    w = await store.dequeue_rollout(worker_id="w1")
    await store.update_attempt(waiting.rollout_id, w.attempt.attempt_id, status="failed")
    await store.update_rollout(waiting.rollout_id, status="cancelled")
    never = await store.enqueue_rollout({"task": "never ran"})
    await store.update_rollout(never.rollout_id, status="cancelled")
    ids = [r.rollout_id, waiting.rollout_id, never.rollout_id]
    async with store.subscribe(names, since=0) as early:  # started before any of them
        expected = await early.collect(ids, timeout_s=20)
    async with store.subscribe(names) as sub:
        got = await sub.collect(ids, timeout_s=0)
        assert got == expected and all(x.position < sub.start_seq for x in got)
        assert list(sub.unattempted) == [never.rollout_id]
        assert await sub.collect(ids, timeout_s=0) == got
    assert [(x.rollout_id, x.attempt.sequence_id, x.status, x.latest, x.rollout.status) for x in got] == [
        (r.rollout_id, 2, "succeeded", True, "succeeded"),
        (waiting.rollout_id, 1, "failed", True, "cancelled"),
    ]
    assert (got[0].final_reward, got[0].data) == (0.8, ["agentlightning.annotation"])


async def test_a_durable_resumed_past_a_rollouts_end_collects_it_at_once(store: Any) -> None:
    """A durable subscription opened again after it acknowledged a rollout's end starts past it:
    ``collect`` still returns that rollout at once, from the log (as a new process of the
    algorithm asking for what it enqueued before it died)."""
    async with store.subscribe(names, durable="late") as sub:
        done = await finish_one(store, reward=0.4)
        record = await sub.next_record(timeout_s=20)
        assert record is not None and record.rollout_id == done
    async with store.subscribe(names, durable="late") as sub:  # resumes after done's end
        [got] = await sub.collect([done], timeout_s=0)
        assert got.position < sub.start_seq
    assert got == record and got.final_reward == 0.4


async def test_a_rollout_requeued_after_it_ended_is_collected_from_its_next_run_however_late_one_subscribes(
    store: Any,
) -> None:
    """A rollout that finished and went back to the queue (``update_rollout(status="queuing")``)
    before the subscription started, or after, is not collected from its old result: ``collect``
    waits for its next run and returns that."""
    after = await finish_one(store, reward=0.3)
    before = await finish_one(store, reward=0.2)
    await store.update_rollout(before, status="queuing")
    async with store.subscribe(names) as sub:
        await store.update_rollout(after, status="queuing")
        assert await sub.collect([before, after], timeout_s=0.5) == []  # queued again: not finished
        reruns = {}
        for _ in range(2):
            d = await store.dequeue_rollout(worker_id="w2")
            assert d is not None and d.attempt.sequence_id == 2
            await store.add_span(reward_span(d.rollout_id, d.attempt.attempt_id, 1, 0.9, 20.0))
            await store.update_attempt(d.rollout_id, d.attempt.attempt_id, status="succeeded")
            reruns[d.rollout_id] = d.attempt.attempt_id
        got = await sub.collect([before, after], timeout_s=20)
    assert [(x.rollout_id, x.attempt_id, x.final_reward) for x in got] == [
        (before, reruns[before], 0.9),
        (after, reruns[after], 0.9),
    ]


async def test_unknown_odd_and_repeated_ids_beside_a_rollout_that_ended_before_the_start(store: Any) -> None:
    """Both backends answer alike: ids no rollout has (unknown, not a subject token, empty) are not
    an error and are left out, a repeated id comes once, and the rollout that ended before the
    subscription started comes at once (``timeout_s=0``), in the order asked."""
    done = await finish_one(store, reward=0.4)
    async with store.subscribe(names) as sub:
        got = await sub.collect(["ro-nope", done, "a.b", "ro-\x00", "*", ">", "", done], timeout_s=0)
        assert sub.unattempted == {}
    assert [(x.rollout_id, x.final_reward) for x in got] == [(done, 0.4)]


async def test_a_collect_of_rollouts_that_ended_before_and_after_the_subscription_started(store: Any) -> None:
    """Ended before the subscription started, running when it started, enqueued after it: one
    ``collect`` returns all three, each at its latest attempt, in the order asked."""
    old = await finish_one(store, reward=0.1)
    r = await store.enqueue_rollout({"task": "running at the start"})
    running = await store.dequeue_rollout(worker_id="w1")
    async with store.subscribe(names) as sub:
        await store.add_span(reward_span(r.rollout_id, running.attempt.attempt_id, 1, 0.5, 1.0))
        await store.update_attempt(r.rollout_id, running.attempt.attempt_id, status="succeeded")
        new = await finish_one(store, reward=0.7)
        got = await sub.collect([new, old, r.rollout_id], timeout_s=20)
    assert [(x.rollout_id, x.final_reward, x.latest, x.rollout.status) for x in got] == [
        (new, 0.7, True, "succeeded"),
        (old, 0.1, True, "succeeded"),
        (r.rollout_id, 0.5, True, "succeeded"),
    ]


async def test_a_kept_result_survives_a_collect_the_log_failed(store: Any, monkeypatch: Any) -> None:
    """``collect`` checks a kept result against the log (e41e0b1); when that read fails
    (``ServiceUnavailableError``) the kept results it had taken out are kept still: a retried
    ``collect`` returns them, not nothing (they were dropped and the retry waited out its timeout)."""
    async with store.subscribe(names) as sub:
        first = await finish_one(store, reward=0.2)
        second = await finish_one(store, reward=0.3)
        other = await finish_one(store, reward=0.5)
        assert [x.rollout_id for x in await sub.collect([other], timeout_s=20)] == [other]  # keeps two
        real = sub.log.load
        calls = 0

        async def fails_second(rollout_id: str) -> Any:
            nonlocal calls
            calls += 1
            if calls == 2:
                raise ServiceUnavailableError("nats://test", "the server went away")
            return await real(rollout_id)

        monkeypatch.setattr(sub.log, "load", fails_second)
        with pytest.raises(ServiceUnavailableError):
            await sub.collect([first, second], timeout_s=20)
        got = await sub.collect([first, second], timeout_s=0.5)
        assert [(x.rollout_id, x.final_reward) for x in got] == [(first, 0.2), (second, 0.3)]


async def test_since_reads_what_finished_before(store: Any) -> None:
    first = await finish_one(store)
    async with store.subscribe(names) as sub:
        assert await sub.next_record(timeout_s=0.3) is None  # default: from the head on
    async with store.subscribe(names, since=0) as sub:
        record = await sub.next_record(timeout_s=20)
    assert record is not None and record.rollout_id == first


async def test_durable_resumes_after_the_last_acknowledged(store: Any) -> None:
    async with store.subscribe(names, durable="algo-1") as sub:
        ids = [await finish_one(store) for _ in range(4)]
        assert (await sub.next_record(timeout_s=20)).rollout_id == ids[0]  # type: ignore[union-attr]
        assert (await sub.next_record(timeout_s=20)).rollout_id == ids[1]  # type: ignore[union-attr]
        await sub.close(ack=False)  # as a crash would: ids[1] was in hand, not acknowledged
    async with store.subscribe(names, durable="algo-1") as sub:
        again = await sub.next_record(timeout_s=20)
        assert again is not None and (again.rollout_id, again.redelivered) == (ids[1], True)
        third = await sub.next_record(timeout_s=20)
        assert third is not None and (third.rollout_id, third.redelivered) == (ids[2], False)
    async with store.subscribe(names, durable="algo-1") as sub:  # left normally: ids[2] acknowledged
        rest = [await sub.next_record(timeout_s=20) for _ in range(1)]
        assert [r.rollout_id for r in rest if r] == [ids[3]]
        assert await sub.next_record(timeout_s=0.3) is None
    async with store.subscribe(names, durable="algo-2", since=0) as sub:  # a new name starts where asked
        assert (await sub.next_record(timeout_s=20)).rollout_id == ids[0]  # type: ignore[union-attr]


async def test_each_attempt_once_even_when_cancelled_midway(store: Any) -> None:
    async with store.subscribe(names) as sub:
        ids = [await finish_one(store) for _ in range(5)]
        seen: list[str] = []
        while len(seen) < 5:
            try:
                async with asyncio.timeout(0.001):  # cancels pulls and folds at random points
                    record = await sub.next_record(None)
            except TimeoutError:
                continue
            assert isinstance(record, FinishedAttempt)
            seen.append(record.rollout_id)
    assert seen == ids


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"adapter": "nope"}, "unknown adapter 'nope'"),
        ({"adapter": "no_such_module:fn"}, "importing 'no_such_module' failed"),
        ({"durable": "a.b"}, "durable='a.b' is not a valid subscription name"),
        ({"durable": "x" * 65}, "is not a valid subscription name"),
        ({"durable": ""}, "is not a valid subscription name"),
        ({"since": -1}, "since=-1: expected a log position"),
        ({"statuses": "done"}, "unknown attempt status 'done'"),
        ({"modes": ["trian"]}, "unknown rollout mode 'trian'"),
    ],
)
async def test_bad_input_is_one_clear_line(store: Any, options: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError) as err:
        store.subscribe(**options)
    assert message in str(err.value) and "\n" not in str(err.value)
    await finish_one(store)  # nothing was lost or left half-open: the store goes on


async def test_an_adapter_that_raises_is_reported_and_the_subscription_goes_on() -> None:
    def broken(spans: list[Span]) -> list[str]:
        if any(s.name == "openai.chat.completion" for s in spans):
            raise RuntimeError("cannot adapt this")
        return names(spans)

    async with InMemoryLightningStore() as store, store.subscribe(broken) as sub:
        bad = await finish_one(store)
        good = await finish_one(store, llm=False)
        first, second = await sub.collect([bad, good], timeout_s=5)
    assert first.data == [] and "RuntimeError: cannot adapt this" in first.errors[0]
    assert [(e.rollout_id, e.attempt_id, e.position) for e in sub.errors] == [(bad, first.attempt_id, first.position)]
    assert (second.rollout_id, second.data, second.errors) == (good, ["agentlightning.annotation"], [])


# -- the JetStream log: foreign entries, the server going away --------------------------------


async def test_a_malformed_entry_is_reported_with_ids_and_the_subscription_goes_on(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace) as store, store.subscribe(names) as sub:
        r = await store.enqueue_rollout({"task": "t"})
        d = await store.dequeue_rollout(worker_id="w1")
        rid, aid = r.rollout_id, d.attempt.attempt_id
        await store.add_span(reward_span(rid, aid, 1, 1.0, 1.0))
        assert store.nc is not None
        js = store.nc.jetstream()
        bad_batch = (await js.publish(f"{namespace.subject_prefix}.s.{rid}.{aid}", b"{not json")).seq
        bad_event = (await js.publish(f"{namespace.subject_prefix}.r.ghost.e", b'{"type": "nope"}')).seq
        await store.update_attempt(rid, aid, status="succeeded")
        after = await finish_one(store)
        first, second = await sub.collect([rid, after], timeout_s=20)
    assert first.data == ["agentlightning.annotation"] and first.final_reward == 1.0
    assert f"log position {bad_batch}: span batch skipped" in first.errors[0]
    assert second.rollout_id == after and second.errors == []
    found = {(e.position, e.rollout_id, e.attempt_id) for e in sub.errors}
    assert found == {(bad_batch, rid, aid), (bad_event, "ghost", None)}


async def test_the_server_going_away_is_a_clear_error_then_resumes(tmp_path: Path, services: Any) -> None:
    server = NatsServer(tmp_path / "nats")
    server.start()
    await server.ready()
    settings = Settings(nats_url=server.url, namespace="subgone")
    nc = await connect_nats(server.url)
    await apply_streams(nc, settings)
    await nc.close()
    try:
        async with JetStreamLightningStore(settings) as store:
            sub = store.subscribe(names, durable="algo", server_timeout_s=2.0)
            await sub.start()
            first = await finish_one(store)
            assert (await sub.next_record(timeout_s=20)).rollout_id == first  # type: ignore[union-attr]
            await sub.ack()
            await asyncio.sleep(ACK_FLUSH_S)  # the server writes consumer state (acks) asynchronously
            server.kill9()
            started = time.monotonic()
            with pytest.raises(ServiceUnavailableError) as err:
                await sub.next_record(timeout_s=60)
            waited = time.monotonic() - started
            assert "the subscription 'algo' had no answer from NATS" in str(err.value)
            assert "resumes after position" in str(err.value) and waited < 15
            await sub.close(ack=False)
        server.start()
        await server.ready()
        async with JetStreamLightningStore(settings) as store, store.subscribe(names, durable="algo") as sub:
            second = await finish_one(store)
            record = await sub.next_record(timeout_s=20)
            assert record is not None and record.rollout_id == second  # nothing again, nothing skipped
    finally:
        server.kill9()


async def test_a_revived_attempt_of_a_rollout_cancelled_in_the_queue_is_collected_as_the_read_model_has_it(
    store: Any,
) -> None:
    """The latest attempt went ``unresponsive`` (the rollout waits for its retry), a late span
    revived it (``running``: the rollout runs again), then the rollout was cancelled: ``collect``
    returns that attempt as the read model has it at the cancel, not as the feed alone (no spans)
    would have it."""
    config = RolloutConfig(max_attempts=3, retry_condition=["failed", "unresponsive"])
    async with store.subscribe(names) as sub:
        r = await store.enqueue_rollout({"task": "revived then cancelled"}, config=config)
        a = await store.dequeue_rollout(worker_id="a")
        aid = a.attempt.attempt_id
        await store.update_attempt(r.rollout_id, aid, status="unresponsive")  # as the watchdog
        await store.add_span(reward_span(r.rollout_id, aid, 1, 0.7, 10.0))  # late: revives it
        await store.update_rollout(r.rollout_id, status="cancelled")
        (ended,) = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=20)
        assert ended.status == "cancelled"
        got = await sub.collect([r.rollout_id], timeout_s=5)
        again = await sub.collect([r.rollout_id], timeout_s=5)  # asked again: held, the same record
    await store.sync_all(timeout_s=10)
    [model] = (await store.query_attempts(r.rollout_id)).items
    assert [(x.attempt_id, x.latest, x.rollout.status) for x in got] == [(aid, True, "cancelled")]
    assert got[0].attempt.status == model.status, (got[0].attempt.status, model.status)
    assert got[0].final_reward == 0.7
    assert again == got
