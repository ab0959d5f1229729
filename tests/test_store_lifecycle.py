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
import time
import weakref

from eventlight.core.types import RolloutConfig
from eventlight.store.memory import InMemoryLightningStore


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
