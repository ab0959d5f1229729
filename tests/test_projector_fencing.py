"""The projector keeps its promise across restarts (issue 12, items 1-3), on real NATS and Postgres.

* It applies the log in order with no gap: a projector stopped in the middle of a batch leaves the
  checkpoint where it was, and the next one applies everything (no acknowledgement can skip a batch).
* One projector at a time, fenced: losing the advisory-lock connection ends leadership at once, and a
  deposed projector cannot commit (the checkpoint row's term).
* The watchdog reads the rollouts in flight from the read model when it takes the lead.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest

from eventlight.core.types import RolloutConfig, Span
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.projector import Deposed, Projector


async def counts(store: JetStreamLightningStore) -> tuple[int, int]:
    stats = await store.statistics()
    return stats["total_rollouts"], stats["total_attempts"]


async def wait_until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_a_projector_stopped_mid_batch_loses_nothing(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first projector hangs inside its first batch's transaction and is then stopped (as a
    kill would): nothing of that batch is committed, and the next projector, started after newer
    events arrived, applies the old batch and the new events, in order."""
    hang = asyncio.Event()
    real_advance = Projector._advance

    async def hanging_advance(self: Projector, conn: Any, last_seq: int) -> None:
        hang.set()
        await asyncio.sleep(3600)

    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, run_projector=False) as store:
        first = [await store.enqueue_rollout({"i": i}) for i in range(30)]
        monkeypatch.setattr(Projector, "_advance", hanging_advance)
        doomed = Projector(store.log, store.pool)
        await doomed.start()
        await asyncio.wait_for(hang.wait(), 10)
        await doomed.close()
        monkeypatch.setattr(Projector, "_advance", real_advance)
        assert await store.pool.fetchval("SELECT last_seq FROM projector_checkpoint") == 0
        later = [await store.enqueue_rollout({"j": j}) for j in range(30)]
        projector = Projector(store.log, store.pool)
        await projector.start()
        try:
            await wait_until(lambda: projector.checkpoint >= store._last_write)
            rows = await store.pool.fetch("SELECT rollout_id FROM rollouts")
            assert {r["rollout_id"] for r in rows} == {r.rollout_id for r in first + later}
        finally:
            await projector.close()


async def test_losing_the_lock_connection_ends_leadership_and_fences_the_old_leader(namespace: Settings) -> None:
    """``pg_terminate_backend`` on the leader's lock connection: it stops leading within a second,
    the standby takes a newer term, and a batch the old leader still tries to commit is refused."""
    async with (
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as a,
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as b,
    ):
        await a.enqueue_rollout("before")
        await a.sync(timeout_s=10)
        leader, standby = (a, b) if a.projector.leader.is_set() else (b, a)
        assert not standby.projector.leader.is_set()
        old_term = leader.projector.term
        pid = leader.projector._lock_conn.get_server_pid()
        conn = await asyncpg.connect(namespace.pg_dsn)
        try:
            t0 = time.monotonic()
            await conn.execute("SELECT pg_terminate_backend($1)", pid)
            await wait_until(lambda: not leader.projector.leader.is_set(), 5)
            lost_after_s = time.monotonic() - t0
            await wait_until(lambda: leader.projector.leader.is_set() or standby.projector.leader.is_set(), 10)
            now_leading = leader if leader.projector.leader.is_set() else standby
            assert now_leading.projector.term > old_term
        finally:
            await conn.close()
        assert lost_after_s < 1.5
        # a deposed projector (the old term) cannot commit a batch
        deposed = Projector(leader.log, leader.pool)
        deposed.term, deposed.checkpoint = old_term, now_leading.projector.checkpoint
        r = await standby.enqueue_rollout("after")
        msg = await leader.log.js.get_msg(leader.log.stream, seq=standby._last_write)
        with pytest.raises(Deposed):
            await deposed.apply([_Stored(msg)])
        await standby.sync(timeout_s=10)
        assert (await standby.get_rollout_by_id(r.rollout_id)).input == "after"
        assert await counts(standby) == (2, 0)


class _Stored:
    """A stored message in the shape ``Projector.apply`` takes."""

    def __init__(self, raw: Any):
        self.subject, self.data = raw.subject, raw.data
        self.metadata = type("M", (), {"sequence": type("S", (), {"stream": raw.seq})()})()


@pytest.mark.parametrize("stop", ["close", "abandon"])
async def test_the_watchdog_remembers_running_attempts_across_a_projector_restart(
    namespace: Settings, stop: str
) -> None:
    """A running attempt that falls silent is marked unresponsive by the *next* projector too, after
    a clean close or after the first one was abandoned without closing (as kill -9 leaves it)."""
    cfg = RolloutConfig(unresponsive_seconds=5.0, timeout_seconds=600.0)
    first = JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn)
    await first.start()
    r = await first.enqueue_rollout("silent", config=cfg)
    d = await first.dequeue_rollout(worker_id="w")
    await first.update_attempt(r.rollout_id, d.attempt.attempt_id, status="running")
    await first.sync(timeout_s=10)
    if stop == "close":
        await first.close()
    else:  # kill -9 of the projector's process: its lock connection goes, nothing else is said
        first.projector._stopping = True
        first.projector._lock_conn.terminate()
    try:
        async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as second:
            await wait_until(second.projector.leader.is_set, 10)
            assert [rid for rid, _, _ in second.projector.in_flight()] == [r.rollout_id]
            assert await second.projector.watch_once(time.time() + 60) == 1
            await second.sync_all(timeout_s=10)
            [attempt] = await second.query_attempts(r.rollout_id)
            assert attempt.status == "unresponsive"
    finally:
        await first.close()


async def test_the_next_projector_watches_a_finished_rollouts_revived_superseded_attempt(namespace: Settings) -> None:
    """peer_failures C20: a finished rollout whose superseded attempt a late span revived (its
    runner then vanished) is read from the read model by the next projector too, and its watchdog
    marks that attempt ``unresponsive``; a finished rollout with no live attempt is not read, nor
    one whose config sets no limit the watchdog could enforce."""
    cfg = RolloutConfig(unresponsive_seconds=5.0, max_attempts=3, retry_condition=["unresponsive"])
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as first:
        ids = []
        for config in (cfg, RolloutConfig(max_attempts=3, retry_condition=["unresponsive"])):
            r = await first.enqueue_rollout("x", config=config)
            a = (await first.dequeue_rollout(worker_id="a")).attempt
            await first.update_attempt(r.rollout_id, a.attempt_id, status="unresponsive")  # as the watchdog
            b = (await first.dequeue_rollout(worker_id="b")).attempt
            await first.add_span(Span.from_attributes(attributes={}, rollout_id=r.rollout_id, attempt_id=a.attempt_id))
            await first.update_attempt(r.rollout_id, b.attempt_id, status="succeeded")
            ids.append(r.rollout_id)
        done = await first.enqueue_rollout("done")
        d = (await first.dequeue_rollout(worker_id="c")).attempt
        await first.update_attempt(done.rollout_id, d.attempt_id, status="succeeded")
        await first.sync(timeout_s=10)
        assert [rid for rid, _, _ in first.projector.in_flight()] == ids[:1]
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as second:
        await wait_until(second.projector.leader.is_set, 10)
        assert [rid for rid, _, _ in second.projector.in_flight()] == ids[:1]
        assert await second.projector.watch_once(time.time() + 60) == 1
        await second.sync_all(timeout_s=10)
        assert [x.status for x in await second.query_attempts(ids[0])] == ["unresponsive", "succeeded"]
        assert (await second.get_rollout_by_id(ids[0])).status == "succeeded"
        assert second.projector.in_flight() == []
