"""A store used the ways Agent-lightning 0.3.0 programs use theirs (issue 13).

* an ``InMemoryLightningStore()`` used without ``async with`` still enforces ``timeout_seconds`` and
  ``unresponsive_seconds`` (its watchdog starts on first use from a running loop);
* on JetStream, a burst of concurrent reads right after ``start()`` does not starve the projector of
  Postgres connections (readers waiting for read-your-writes hold none);
* a JetStream store used from a second event loop fails at once, naming the cause.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from typing import Any

import pytest

from eventlight.core.errors import WrongEventLoopError
from eventlight.core.types import RolloutConfig
from eventlight.ops import Services
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.memory import InMemoryLightningStore
from tests.conftest import fresh_namespace


async def test_memory_store_without_async_with_times_out_attempts() -> None:
    store = InMemoryLightningStore(watchdog_interval_s=0.05)  # no `async with`, no start()
    slow = await store.enqueue_rollout("slow", config=RolloutConfig(timeout_seconds=0.2))
    silent = await store.enqueue_rollout("silent", config=RolloutConfig(unresponsive_seconds=0.2))
    for _ in range(2):
        d = await store.dequeue_rollout(worker_id="w")
        assert d is not None
        await store.update_attempt(d.rollout_id, d.attempt.attempt_id, last_heartbeat_time=time.time())
    done = await store.wait_for_rollouts(rollout_ids=[slow.rollout_id, silent.rollout_id], timeout=10)
    assert [r.status for r in done] == ["failed", "failed"]
    statuses = [(await store.get_latest_attempt(r.rollout_id)).status for r in (slow, silent)]  # type: ignore[union-attr]
    assert statuses == ["timeout", "unresponsive"]
    await store.close()


def test_memory_store_enforces_timeouts_across_event_loops() -> None:
    """Used from one ``asyncio.run`` after another (as sync programs do), the watchdog follows the loop."""
    store = InMemoryLightningStore(watchdog_interval_s=0.05)

    async def claim() -> str:
        r = await store.enqueue_rollout("x", config=RolloutConfig(timeout_seconds=0.2))
        assert await store.dequeue_rollout() is not None
        return r.rollout_id

    rid = asyncio.run(claim())

    async def wait() -> str:
        [done] = await store.wait_for_rollouts(rollout_ids=[rid], timeout=10)
        return done.status

    assert asyncio.run(wait()) == "failed"


async def test_a_memory_store_nobody_holds_stops_its_watchdog() -> None:
    store = InMemoryLightningStore(watchdog_interval_s=0.01)
    await store.enqueue_rollout("x")
    task = store._watchdog_task
    assert task is not None and not task.done()
    ref = weakref.ref(store)
    del store
    gc.collect()
    assert ref() is None
    await asyncio.wait_for(task, 5)  # it ends on its own


async def test_a_closed_memory_store_keeps_its_data_and_runs_no_watchdog() -> None:
    store = InMemoryLightningStore(watchdog_interval_s=0.01)
    r = await store.enqueue_rollout("x")
    await store.close()
    assert (await store.get_rollout_by_id(r.rollout_id)) is not None
    assert store._watchdog_task is None


@pytest.mark.parametrize("n", [8, 16])
async def test_concurrent_reads_right_after_start_do_not_stall(namespace: Settings, n: int) -> None:
    """Each reader waits for read-your-writes without holding a pooled connection, so the projector
    (which needs one to commit) is never starved by them (pool of 4 connections)."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:

        async def write_then_read(i: int) -> str:
            r = await store.enqueue_rollout(i)
            got = await store.get_rollout_by_id(r.rollout_id)
            assert got is not None
            return got.status

        t0 = time.monotonic()
        statuses = await asyncio.wait_for(asyncio.gather(*(write_then_read(i) for i in range(n))), 20)
        reads = await asyncio.wait_for(asyncio.gather(*(store.query_rollouts() for _ in range(n))), 20)
        assert statuses == ["queuing"] * n and all(len(page) == n for page in reads)
        assert time.monotonic() - t0 < 10


async def test_concurrent_reads_on_a_standby_store_do_not_stall(namespace: Settings) -> None:
    """A second store of the namespace (its projector a standby) reads through the first one's projection."""
    async with (
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as leader,
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as standby,
    ):
        assert leader.projector is not None and leader.projector.leader.is_set()

        async def write_then_read(i: int) -> int:
            r = await standby.enqueue_rollout(i)
            got = await standby.get_rollout_by_id(r.rollout_id)
            assert got is not None
            return int(got.input)

        got = await asyncio.wait_for(asyncio.gather(*(write_then_read(i) for i in range(16))), 20)
        assert got == list(range(16))


async def test_readers_waiting_for_a_projector_hold_no_connection(namespace: Settings) -> None:
    """16 reads wait for read-your-writes while no projector runs yet: the pool stays free for
    others (the projector, a query) the whole time, and the reads complete once one runs."""
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, run_projector=False, pool_size=4) as store:
        rollout = await store.enqueue_rollout("first")
        readers = [asyncio.create_task(store.get_rollout_by_id(rollout.rollout_id)) for _ in range(16)]
        assert store.pool is not None
        for _ in range(10):  # 0.5 s in which every reader waits
            await asyncio.sleep(0.05)
            assert await asyncio.wait_for(store.pool.fetchval("SELECT 1"), 0.2) == 1
        assert not any(t.done() for t in readers)
        async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn):  # a projector, at last
            got = await asyncio.wait_for(asyncio.gather(*readers), 10)
        assert [r.rollout_id for r in got if r is not None] == [rollout.rollout_id] * 16


async def test_a_jetstream_store_used_from_another_event_loop_fails_at_once(namespace: Settings) -> None:
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        r = await store.enqueue_rollout("x")

        def elsewhere() -> tuple[BaseException | None, float]:
            t0 = time.monotonic()
            try:
                asyncio.run(store.get_rollout_by_id(r.rollout_id))
            except BaseException as e:
                return e, time.monotonic() - t0
            return None, time.monotonic() - t0

        for _ in range(2):  # a thread's loop; then the same again (nothing was left half-done)
            error, took_s = await asyncio.to_thread(elsewhere)
            assert isinstance(error, WrongEventLoopError) and isinstance(error, RuntimeError), error
            assert "another event loop" in str(error) and "one store per event loop" in str(error)
            assert took_s < 1.0
        assert (await store.get_rollout_by_id(r.rollout_id)) is not None  # its own loop still works


def test_asyncio_run_ends_although_nats_py_swallows_the_projectors_cancel(
    services: tuple[Settings, Services], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``asyncio.run`` ending with a store still open cancels the projector's task; Python 3.11's
    ``wait_for`` inside nats-py's ``fetch`` can return the batch instead of raising (simulated here:
    every cancelled fetch returns an empty batch), and the projector's loop then ran on, so
    ``asyncio.run`` never returned (a fresh user's ``make test`` hung 300 s in the test below)."""
    from nats.js.client import JetStreamContext

    fetch = JetStreamContext.PullSubscription.fetch
    swallowed = []

    async def swallowing_fetch(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await fetch(self, *args, **kwargs)
        except asyncio.CancelledError:
            swallowed.append(1)
            return []

    monkeypatch.setattr(JetStreamContext.PullSubscription, "fetch", swallowing_fetch)
    fixture_loop = asyncio.new_event_loop()
    namespace_cm = fresh_namespace(services)
    settings = fixture_loop.run_until_complete(namespace_cm.__aenter__())
    try:

        async def program() -> None:
            store = await JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn).start()
            await store.enqueue_rollout("x")
            await asyncio.sleep(0.3)  # the projector is in its fetch loop

        runner = threading.Thread(target=asyncio.run, args=(program(),), daemon=True)
        runner.start()
        runner.join(20)
        assert not runner.is_alive(), "asyncio.run did not end: the projector ignored its cancel"
        assert swallowed, "the simulated swallow never happened"
    finally:
        fixture_loop.run_until_complete(namespace_cm.__aexit__(None, None, None))
        fixture_loop.close()


def test_asyncio_run_ends_at_once_with_a_projecting_store_left_open(services: tuple[Settings, Services]) -> None:
    """A program that returns with its store (and so its projector) still open: ``asyncio.run``
    cancels the projector's task, whose clean-up used to wait 2 s for NATS to delete its consumer
    although NATS's own read loop was cancelled too, so no answer could come (2.0 s every time).
    Now the consumer is left to expire on its own (its ``inactive_threshold``)."""
    fixture_loop = asyncio.new_event_loop()
    namespace_cm = fresh_namespace(services)
    settings = fixture_loop.run_until_complete(namespace_cm.__aenter__())
    returned: list[float] = []
    try:

        async def program() -> None:
            store = await JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn).start()
            await store.enqueue_rollout("x")
            await store.sync_all(timeout_s=10)  # the projector has read the stream
            returned.append(time.monotonic())

        runner = threading.Thread(target=asyncio.run, args=(program(),), daemon=True)
        runner.start()
        runner.join(30)
        ended = time.monotonic()
        assert not runner.is_alive() and returned
        assert ended - returned[0] < 1.5, f"asyncio.run took {ended - returned[0]:.1f} s to end after the program"
    finally:
        fixture_loop.run_until_complete(namespace_cm.__aexit__(None, None, None))
        fixture_loop.close()


def test_a_jetstream_store_after_its_asyncio_run_ended_fails_at_once(services: tuple[Settings, Services]) -> None:
    fixture_loop = asyncio.new_event_loop()  # the namespace's set-up and tear-down (an async generator)
    namespace_cm = fresh_namespace(services)
    settings = fixture_loop.run_until_complete(namespace_cm.__aenter__())
    try:
        store = JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn)

        async def first() -> str:
            await store.start()
            return (await store.enqueue_rollout("x")).rollout_id

        rid = asyncio.run(first())
        t0 = time.monotonic()
        with pytest.raises(WrongEventLoopError, match=r"another event loop \(closed\)"):
            asyncio.run(store.get_rollout_by_id(rid))
        assert time.monotonic() - t0 < 1.0
    finally:
        fixture_loop.run_until_complete(namespace_cm.__aexit__(None, None, None))
        fixture_loop.close()


def test_memory_store_waits_from_one_event_loop_after_another() -> None:
    """A wait (an idle ``dequeue_rollout``'s long poll, ``wait_for_rollouts``) from a later loop
    works although an earlier loop waited on the same store (asyncio's events bind to one loop):
    Trainer's "shm" runs each on a fresh loop around one store."""
    store = InMemoryLightningStore()

    async def first() -> str:
        assert await store.dequeue_rollout(wait_s=0.05) is None
        r = await store.enqueue_rollout("x")
        assert await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=0.05) == []
        return r.rollout_id

    rid = asyncio.run(first())

    async def second() -> None:
        assert await store.wait_for_rollouts(rollout_ids=[rid], timeout=0.05) == []
        assert await store.dequeue_rollout(wait_s=0.05) is not None
        assert await store.dequeue_rollout(wait_s=0.05) is None

    asyncio.run(second())
