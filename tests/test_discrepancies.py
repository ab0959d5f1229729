"""Where the backends disagree today: one minimal case per discrepancy that ``test_equivalence`` found.

Each test runs on both backends (the ``store`` fixture) and states the one behaviour the contract
asks for (``spec/seed_store_types.md``, Agent-lightning's in-memory store), so one backend fails it
until issue 11's single store lands. Nothing here is marked xfail.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from eventlight.core.errors import InvalidInputError, InvalidTransitionError, ResourcesNotFoundError
from eventlight.core.types import EnqueueRolloutRequest, Span
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.service import IDLE_REFRESH_S


async def settle(store: Any) -> None:
    if isinstance(store, JetStreamLightningStore):
        await store.sync_all(timeout_s=10)


def span(rollout_id: str, attempt_id: str, span_id: str) -> Span:
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=1,
        trace_id="ab" * 16,
        span_id=span_id,
        parent_id=None,
        name="step",
    )


async def test_metadata_only_update_after_a_span_keeps_the_attempt_running(store: Any) -> None:
    """The first span moves an attempt to ``running``; a later update without a status keeps it."""
    r = await store.start_rollout({"x": 1})
    await store.add_span(span(r.rollout_id, r.attempt.attempt_id, "0000000000000001"))
    got = await store.update_attempt(r.rollout_id, r.attempt.attempt_id, metadata={"k": 1})
    assert got.status == "running"
    await settle(store)
    assert (await store.get_latest_attempt(r.rollout_id)).status == "running"


async def test_an_update_after_a_span_keeps_its_heartbeat(store: Any) -> None:
    """A span is a heartbeat; ``update_attempt`` must not roll ``last_heartbeat_time`` back."""
    r = await store.start_rollout({"x": 1})
    await store.add_span(span(r.rollout_id, r.attempt.attempt_id, "0000000000000001"))
    await settle(store)
    beat = (await store.get_latest_attempt(r.rollout_id)).last_heartbeat_time
    assert beat is not None
    got = await store.update_attempt(r.rollout_id, r.attempt.attempt_id, status="succeeded")
    assert got.last_heartbeat_time == beat


async def test_start_attempt_refuses_a_malformed_worker_id(store: Any) -> None:
    """Worker ids are NATS subject tokens (no dots, no spaces), as ``dequeue_rollout`` already checks."""
    r = await store.enqueue_rollout({"x": 1})
    with pytest.raises(InvalidInputError):
        await store.start_attempt(r.rollout_id, worker_id="bad id.with dots")


async def test_each_empty_poll_moves_last_dequeue_time_to_within_a_second(store: Any) -> None:
    """``last_dequeue_time`` is the worker's last poll, empty or not, to within ``IDLE_REFRESH_S``."""
    assert await store.dequeue_rollout(worker_id="w1") is None
    await settle(store)
    first = (await store.get_worker_by_id("w1")).last_dequeue_time
    assert await store.dequeue_rollout(worker_id="w1") is None  # at once: within the refresh, no write
    await settle(store)
    assert (await store.get_worker_by_id("w1")).last_dequeue_time == first
    await asyncio.sleep(IDLE_REFRESH_S + 0.05)
    assert await store.dequeue_rollout(worker_id="w1") is None
    await settle(store)
    assert (await store.get_worker_by_id("w1")).last_dequeue_time >= first + IDLE_REFRESH_S


async def test_an_empty_poll_after_start_attempt_makes_the_worker_idle(store: Any) -> None:
    """A worker that polls and finds nothing is idle, whatever it was doing since its last empty poll."""
    assert await store.dequeue_rollout(worker_id="w1") is None
    r = await store.enqueue_rollout({"x": 1})
    await store.start_attempt(r.rollout_id, worker_id="w1")
    await settle(store)
    assert (await store.get_worker_by_id("w1")).status == "busy"
    assert await store.dequeue_rollout(worker_id="w1") is None
    await settle(store)
    assert (await store.get_worker_by_id("w1")).status == "idle"


async def test_workers_come_in_insertion_order(store: Any) -> None:
    """``query_workers(sort_by=None)``: insertion order (spec, ``query_workers``)."""
    await store.update_worker("w2")
    await store.update_worker("w1")
    assert [w.worker_id for w in await store.query_workers()] == ["w2", "w1"]


async def test_enqueue_many_with_one_unknown_resources_id_enqueues_nothing(store: Any) -> None:
    """A refused batch leaves nothing behind (JetStream checks every item before it writes)."""
    with pytest.raises(ResourcesNotFoundError):
        await store.enqueue_many_rollouts(
            [EnqueueRolloutRequest(input=1), EnqueueRolloutRequest(input=2, resources_id="rs-missing")]
        )
    assert len(await store.query_rollouts()) == 0


async def test_add_many_spans_returns_spans_in_the_order_given(store: Any) -> None:
    a = await store.start_rollout({"x": 1})
    b = await store.start_rollout({"x": 2})
    spans = [
        span(a.rollout_id, a.attempt.attempt_id, "0000000000000001"),
        span(b.rollout_id, b.attempt.attempt_id, "0000000000000002"),
        span(a.rollout_id, a.attempt.attempt_id, "0000000000000003"),
    ]
    got = await store.add_many_spans(spans)
    assert [s.span_id for s in got] == [s.span_id for s in spans]


async def test_an_attempt_running_on_its_spans_cannot_go_back_to_preparing(store: Any) -> None:
    """``running`` -> ``preparing`` is not a transition; the writer must know the span made it running."""
    r = await store.start_rollout({"x": 1})
    await store.add_span(span(r.rollout_id, r.attempt.attempt_id, "0000000000000001"))
    with pytest.raises(InvalidTransitionError):
        await store.update_attempt(r.rollout_id, r.attempt.attempt_id, status="preparing")
