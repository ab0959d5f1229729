"""A caller's cancel reaches it even where a library below the store swallows it.

Python 3.11's ``asyncio.wait_for`` (inside nats-py's publish, request and ``ack_sync``) returns the
inner result instead of raising when a cancel lands as that result arrives. The cancel is then
lost: a fresh reviewer's loop of ``enqueue_rollout`` ran on after ``task.cancel()`` in 43 of 200
tasks, a ``TaskGroup`` with such a writer and a failing sibling never ended in 25 of 40 trials,
and a program whose writer task was still running took 10 s more to exit. These tests make the
swallow happen every time (the append answers the cancelled caller, as ``wait_for`` does), on
both backends, and check that the caller stops all the same, and that a claim whose answer its
caller never got is settled.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from tests.conftest import fresh_namespace


def answering_cancelled(
    call: Callable[..., Awaitable[Any]], swallowed: list[int], on_its_way: asyncio.Event | None = None
) -> Callable[..., Awaitable[Any]]:
    """``call`` as 3.11's ``wait_for`` around it behaves when the answer and a cancel arrive
    together: a caller cancelled meanwhile gets the answer, not ``CancelledError``. Each swallowed
    cancel appends to ``swallowed``; ``on_its_way`` is set while a call is on its way."""

    async def answer_anyway(*args: Any, **kwargs: Any) -> Any:
        if on_its_way is not None:
            on_its_way.set()  # first: whoever waits for it runs before the call's first step
        work = asyncio.ensure_future(call(*args, **kwargs))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            swallowed.append(1)
            return await work
        finally:
            if on_its_way is not None:
                on_its_way.clear()

    return answer_anyway


def swallow_cancels_in_appends(store: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, list[int]]:
    """Make ``store``'s appends answer a caller cancelled while they were on their way. Returns an
    event set while an append is on its way (the moment to cancel) and the list of swallows."""
    appending = asyncio.Event()
    swallowed: list[int] = []
    monkeypatch.setattr(store._event_log, "append", answering_cancelled(store._event_log.append, swallowed, appending))
    return appending, swallowed


async def test_a_write_loop_stops_when_cancelled_although_the_append_swallows_the_cancel(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    appending, swallowed = swallow_cancels_in_appends(store, monkeypatch)
    written = 0
    three = asyncio.Event()

    async def writer() -> None:
        nonlocal written
        while True:
            await store.enqueue_rollout({"n": written})
            written += 1
            if written == 3:
                three.set()

    task = asyncio.create_task(writer())
    await asyncio.wait_for(three.wait(), 10)
    await asyncio.wait_for(appending.wait(), 10)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=10)
    assert task in done, f"the writer ran on after its cancel ({written} rollouts written)"
    assert task.cancelled()
    assert swallowed, "the simulated swallow never happened"
    await store.sync_all(timeout_s=10)
    assert len(await store.query_rollouts()) in (written, written + 1)  # the last write may be stored


async def test_a_task_group_with_a_writer_ends_when_a_sibling_fails(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``TaskGroup`` cancels the writer when its sibling fails; the writer must stop for the
    group to end (it never did in 25 of 40 of a reviewer's trials)."""
    appending, swallowed = swallow_cancels_in_appends(store, monkeypatch)

    async def writer() -> None:
        while True:
            await store.enqueue_rollout("x")

    async def failing() -> None:
        await asyncio.wait_for(appending.wait(), 10)
        raise ValueError("a sibling failed")

    async def group() -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(writer())
            tg.create_task(failing())

    with pytest.raises(ExceptionGroup) as caught:
        await asyncio.wait_for(group(), 10)
    assert caught.group_contains(ValueError)
    assert swallowed, "the simulated swallow never happened"


async def test_a_claim_whose_caller_was_cancelled_before_it_is_settled(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel lands while ``dequeue_rollout`` acknowledges a queue entry it cannot claim (its
    rollout was cancelled) and is swallowed there; the dequeue goes on to claim the next rollout.
    Its caller gets ``CancelledError``, and the attempt it never received is marked ``failed`` (as
    for a caller cancelled mid-claim) instead of staying ``preparing`` until the watchdog's timeouts."""
    stale = await store.enqueue_rollout("stale")
    await store.update_rollout(stale.rollout_id, status="cancelled")
    r = await store.enqueue_rollout("x")
    next_queued = store._event_log.next_queued
    acking = asyncio.Event()
    swallowed: list[int] = []

    async def with_swallowing_ack(*args: Any, **kwargs: Any) -> Any:
        item = await next_queued(*args, **kwargs)
        if item is not None and item.rollout_id == stale.rollout_id:
            monkeypatch.setattr(item, "ack", answering_cancelled(item.ack, swallowed, acking))
        return item

    monkeypatch.setattr(store._event_log, "next_queued", with_swallowing_ack)
    dequeue = asyncio.create_task(store.dequeue_rollout(worker_id="w1"))
    await asyncio.wait_for(acking.wait(), 10)
    dequeue.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(dequeue, 10)
    assert swallowed, "the simulated swallow never happened"
    deadline = time.monotonic() + 10
    attempts: list[Any] = []
    while time.monotonic() < deadline:
        await store.sync_all(timeout_s=10)
        attempts = await store.query_attempts(r.rollout_id)
        if attempts and attempts[0].status == "failed":
            break
        await asyncio.sleep(0.05)
    assert [(a.status, a.worker_id) for a in attempts] == [("failed", "w1")]


def test_a_jetstream_writer_cancelled_in_nats_py_publish_stops(services: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same at nats-py's own request (where the swallow happens: its ``wait_for`` for the
    publish's ack), in a program of its own: ``asyncio.run`` returns once the program's writer task
    is cancelled."""
    from nats.aio.client import Client

    swallowed: list[int] = []
    monkeypatch.setattr(Client, "request", answering_cancelled(Client.request, swallowed))
    fixture_loop = asyncio.new_event_loop()
    namespace_cm = fresh_namespace(services)
    settings: Settings = fixture_loop.run_until_complete(namespace_cm.__aenter__())
    ended: list[str] = []
    try:

        async def program() -> None:
            async with JetStreamLightningStore(settings) as store:

                async def writer() -> None:
                    while True:
                        await store.enqueue_rollout("x")

                for _ in range(200):  # until a cancel lands inside a publish
                    task = asyncio.create_task(writer())
                    await asyncio.sleep(0.005)
                    before = len(swallowed)
                    task.cancel()
                    done, _ = await asyncio.wait([task], timeout=5)
                    if task not in done or len(swallowed) > before:
                        ended.append("stopped" if task in done else "ran on")
                        task.cancel()
                        break

        runner = threading.Thread(target=asyncio.run, args=(program(),), daemon=True)
        runner.start()
        runner.join(60)
        assert not runner.is_alive(), "the program did not end"
        assert swallowed, "the simulated swallow never happened"
        assert ended == ["stopped"], "the writer ran on after its cancel was swallowed"
    finally:
        fixture_loop.run_until_complete(namespace_cm.__aexit__(None, None, None))
        fixture_loop.close()


async def test_a_subscriber_cancelled_in_its_ack_stops(namespace: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """An algorithm's loop (``async for record in sub: ...; await sub.ack()``) cancelled while
    nats-py confirms the acknowledgement stops; the acknowledgement stands."""
    from nats.aio.msg import Msg

    acking = asyncio.Event()
    swallowed: list[int] = []
    monkeypatch.setattr(Msg, "ack_sync", answering_cancelled(Msg.ack_sync, swallowed, acking))
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await _finished_rollouts(store, 2)
        seen: list[str] = []

        async def algorithm() -> None:
            async with store.subscribe_triplets(durable="algo", since=0) as sub:
                async for record in sub:
                    seen.append(record.rollout_id)
                    await sub.ack()

        await _cancel_when(acking, asyncio.create_task(algorithm()))
        assert swallowed, "the simulated swallow never happened"
        assert len(seen) == 1


async def test_a_subscriber_cancelled_while_records_are_folded_stops(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cancel lands while the subscription reads a finished attempt's spans (on JetStream a
    ``get_msg`` request, in nats-py's ``wait_for``) and is swallowed there: the consumer stops all
    the same (a fresh reviewer saw 5 of 30 consumers idle on in ``async for`` after ``cancel()``)."""
    await _finished_rollouts(store, 3)
    reading = asyncio.Event()
    swallowed: list[int] = []
    log = store._event_log
    monkeypatch.setattr(log, "span_entries", answering_cancelled(log.span_entries, swallowed, reading))

    async def algorithm() -> None:
        async with store.subscribe_triplets(since=0) as sub:
            async for _ in sub:
                await sub.ack()

    task = asyncio.create_task(algorithm())
    await _cancel_when(reading, task)
    assert swallowed, "the simulated swallow never happened"
    assert task.cancelled()


async def _finished_rollouts(store: Any, n: int) -> None:
    for _ in range(n):
        r = await store.enqueue_rollout("x")
        claimed = await store.dequeue_rollout(worker_id="w1")
        await store.update_attempt(r.rollout_id, claimed.attempt.attempt_id, status="succeeded")


async def _cancel_when(event: asyncio.Event, task: asyncio.Task[None]) -> None:
    """Cancel ``task`` once ``event`` is set; it must end within 10 s."""
    await asyncio.wait_for(event.wait(), 10)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=10)
    assert task in done, "the subscriber ran on after its cancel"
