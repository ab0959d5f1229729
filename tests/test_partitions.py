"""Projection scaled out by partition (issue 17, item 4), on real NATS and Postgres.

* 2 and 4 partitions shared by 2 and 3 projector "processes" (stores of their own, each with its own
  Postgres sessions: the locks and the member lock are per session) give a read model equal to a
  rebuild of the log, which is the one-partition fold.
* kill -9 of a projector process (``tests/fault_projector.py``) while a workload writes: the others
  take its partitions over, a process added later takes partitions over from them, and nothing is
  lost or applied twice (rows against the log, every partition's checkpoint at the head).
* Runners and the algorithm given only the NATS URL of a 3-node cluster and the Postgres DSN run
  rollouts to the end with a partitioned projector.
* The partition count is fixed per namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
from faults import (
    Ledger,
    check_log_and_read_model,
    checkpoint,
    namespace_on,
    spawn_projector,
    stream_last_seq,
    wait_projected,
)
from faults import workload as fault_workload
from test_rebuild import TABLES, rebuild, span, table
from test_rebuild import workload as every_kind_of_event

import eventlight as agl
from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.core.types import RolloutStatus
from eventlight.ops import Services
from eventlight.ops.nats_server import _nats_binary
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.projector import ProjectorGroup
from eventlight.store.jetstream.projector.partition import fair_share, lock_key, partition_of, subject_partition


def test_a_rollout_partition_is_a_stable_hash_of_its_id() -> None:
    assert [partition_of(f"ro-{i}", 4) for i in range(6)] == [1, 3, 1, 3, 0, 2]  # CRC-32, not hash()
    assert subject_partition("el.ns.r.ro-1.e", 4) == subject_partition("el.ns.s.ro-1.at-1", 4) == 3
    assert subject_partition("el.ns.res.prod", 4) == subject_partition("el.ns.w.worker-7", 4) == 0
    assert lock_key("el_x", 0) < 2**32 <= lock_key("el_x", 1)  # partition 0 keeps the one-projector key
    assert [fair_share(4, [10, 20, 30], me) for me in (10, 20, 30)] == [2, 1, 1]
    assert fair_share(4, [10], 20) == 2  # a process not listed yet counts itself last


class _All:
    """The workload's view of the projection: watchdog ticks of every process's partitions."""

    def __init__(self, stores: list[JetStreamLightningStore]):
        self.stores = stores

    async def watch_once(self, now: float | None = None) -> int:
        return sum([await s.projector.watch_once(now) for s in self.stores if s.projector is not None])


class _Workload:
    def __init__(self, store: JetStreamLightningStore, stores: list[JetStreamLightningStore]):
        self._store, self.projector = store, _All(stores)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


async def balanced(stores: list[JetStreamLightningStore], partitions: int, timeout_s: float = 20) -> list[list[int]]:
    """Until every partition is led by exactly one store and each leads its fair share."""
    deadline = time.monotonic() + timeout_s
    while True:
        groups = [s.projector for s in stores]
        assert all(isinstance(g, ProjectorGroup) for g in groups)
        led = [g.led for g in groups]  # type: ignore[union-attr]
        if sorted(p for ps in led for p in ps) == list(range(partitions)) and all(
            len(ps) == g.target()  # type: ignore[union-attr]
            for ps, g in zip(led, groups, strict=True)
        ):
            return led
        assert time.monotonic() < deadline, f"not balanced after {timeout_s} s: {led}"
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def projectors(settings: Settings, n: int) -> AsyncIterator[list[JetStreamLightningStore]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn)) for _ in range(n)
        ]


async def assert_equal_to_rebuild(store: JetStreamLightningStore, settings: Settings) -> None:
    dsn = settings.pg_dsn
    assert dsn is not None
    fresh = f"{settings.pg_schema}_rebuilt"
    try:
        assert await rebuild(store, fresh, dsn) == await stream_last_seq(store)
        conn = await asyncpg.connect(dsn)
        try:
            for name in TABLES:
                live, rebuilt = await table(conn, settings.pg_schema, name), await table(conn, fresh, name)
                assert live, f"the workload left {name} empty: the comparison would prove nothing"
                assert live == rebuilt, f"{name}: the partitioned read model differs from the one-partition fold"
        finally:
            await conn.close()
    finally:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{fresh}" CASCADE')
        finally:
            await conn.close()


@pytest.mark.parametrize(("partitions", "processes"), [(2, 2), (4, 3)], ids=["2-partitions-2-processes", "4-over-3"])
async def test_partitions_over_processes_equal_the_one_partition_fold(
    namespace: Settings, partitions: int, processes: int
) -> None:
    settings = msgspec.structs.replace(namespace, projector_partitions=partitions)
    async with projectors(settings, processes) as stores:
        led = await balanced(stores, partitions)
        assert all(led), led  # every process leads some partition
        first = stores[0]
        view = _Workload(first, stores)
        for i in range(24):  # rollouts of every partition, claimed by workers whose records partition 0 keeps
            r = await first.start_rollout({"i": i}, worker_id=f"w{i % 3}")
            await first.add_span(span(r.rollout_id, r.attempt.attempt_id, 1, f"{i:016x}"))
            await first.update_attempt(r.rollout_id, r.attempt.attempt_id, status="succeeded" if i % 2 else "failed")
        # an attempt the watchdog finds silent, revived by a late span, then updated without a status:
        # its worker is busy again only if partition 0 saw the span of the attempt's own partition
        silent = await first.start_rollout(
            {"silent": 1}, worker_id="w9", config=agl.RolloutConfig(unresponsive_seconds=5)
        )
        await first.sync_all(timeout_s=20)
        assert await view.projector.watch_once(time.time() + 100) >= 1
        await first.add_span(span(silent.rollout_id, silent.attempt.attempt_id, 1, "00000000000000f1"))
        await first.update_attempt(silent.rollout_id, silent.attempt.attempt_id, metadata={"after": "revival"})
        await every_kind_of_event(view)
        await first.sync_all(timeout_s=20)
        async with first.pool.acquire() as conn:
            rows = await conn.fetch("SELECT id, last_seq FROM projector_checkpoint ORDER BY id")
            spread = {
                partition_of(r, partitions) for r in await conn.fetchval("SELECT array_agg(rollout_id) FROM rollouts")
            }
        assert [r[0] for r in rows] == list(range(partitions))
        assert {r[1] for r in rows} == {await stream_last_seq(first)}  # every partition read the whole stream
        assert spread == set(range(partitions))
        await assert_equal_to_rebuild(first, settings)


async def test_the_partition_count_is_fixed_per_namespace(namespace: Settings) -> None:
    two = msgspec.structs.replace(namespace, projector_partitions=2)
    async with JetStreamLightningStore(two, pg_dsn=two.pg_dsn):
        for n in (1, 4):
            other = msgspec.structs.replace(namespace, projector_partitions=n)
            with pytest.raises(InvalidInputError, match="projected in 2 partitions, not"):
                await JetStreamLightningStore(other, pg_dsn=other.pg_dsn).start()
        async with JetStreamLightningStore(two, pg_dsn=two.pg_dsn, run_projector=False):
            pass  # a store that does not project needs no count


async def test_every_status_has_its_count_row_before_the_first_rollout(namespace: Settings) -> None:
    """Partitions lock the status counts' rows in one order before writing rollouts; a row the
    trigger had to insert first was outside that order (two partitions' first batches deadlocked)."""
    two = msgspec.structs.replace(namespace, projector_partitions=2)
    async with JetStreamLightningStore(two, pg_dsn=two.pg_dsn):
        assert two.pg_dsn is not None
        conn = await asyncpg.connect(two.pg_dsn, server_settings={"search_path": two.pg_schema})
        try:
            rows = dict(await conn.fetch("SELECT status, n FROM rollout_status_counts"))
        finally:
            await conn.close()
    assert rows == dict.fromkeys(typing.get_args(RolloutStatus), 0)


async def holders(dsn: str, schema: str, partitions: int) -> dict[str, int]:
    """Partitions held per projector process (its connections' ``application_name``, ``spawn``)."""
    conn = await asyncpg.connect(dsn)
    try:
        keys = [lock_key(schema, p) for p in range(partitions)]
        rows = await conn.fetch(
            "SELECT a.application_name, count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
            " AND (l.classid::bigint << 32) + l.objid::bigint = ANY($1::bigint[]) GROUP BY 1",
            keys,
        )
    finally:
        await conn.close()
    return {str(r[0]): int(r[1]) for r in rows}


def spawn(settings: Settings, k: int) -> Any:
    """``spawn_projector`` whose Postgres sessions are named ``elproj<k>`` (``holders``)."""
    assert settings.pg_dsn is not None
    dsn = settings.pg_dsn + ("&" if "?" in settings.pg_dsn else "?") + f"application_name=elproj{k}"
    return spawn_projector(msgspec.structs.replace(settings, pg_dsn=dsn))


async def until_held(dsn: str, schema: str, partitions: int, shares: list[int], timeout_s: float = 30) -> float:
    """Seconds until the partitions are held in ``shares`` (counts per process, sorted)."""
    t0 = time.monotonic()
    while sorted((await holders(dsn, schema, partitions)).values()) != shares:
        assert time.monotonic() - t0 < timeout_s, f"not held as {shares}: {await holders(dsn, schema, partitions)}"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def test_kill9_of_a_projector_process_rebalances_without_loss(namespace: Settings) -> None:
    """Two projector processes share 4 partitions; one is killed with SIGKILL while a workload
    writes, the survivor takes its partitions over, then a third process takes half of them."""
    settings = msgspec.structs.replace(namespace, projector_partitions=4)
    dsn, schema = settings.pg_dsn, settings.pg_schema
    assert dsn is not None
    ledger = Ledger()
    async with JetStreamLightningStore(settings) as writer:  # a runner's store: NATS only
        procs = [spawn(settings, k) for k in range(2)]
        work: asyncio.Task[None] | None = None
        try:
            await until_held(dsn, schema, 4, [2, 2])
            work = asyncio.create_task(fault_workload(writer, ledger, n=300, spans=10, limit_s=90))
            # mid-run: a fifth of the workload's 1,500 events written, batches being applied (a fixed
            # sleep let a fast or a slow machine finish the workload before the kill)
            t0 = time.monotonic()
            while await stream_last_seq(writer) < 300:
                assert not work.done() and time.monotonic() - t0 < 60, "the workload stopped early"
                await asyncio.sleep(0.01)
            procs[0].send_signal(signal.SIGKILL)
            procs[0].wait(10)
            at_kill = await stream_last_seq(writer)
            behind = await checkpoint(dsn, schema) < at_kill
            takeover_s = await until_held(dsn, schema, 4, [4])
            recover_s = await wait_projected(dsn, schema, at_kill)
            procs.append(spawn(settings, 2))  # a process added later takes partitions over
            handover_s = await until_held(dsn, schema, 4, [2, 2])
            await asyncio.wait_for(work, 120)
            last = await stream_last_seq(writer)
            await wait_projected(dsn, schema, last)
        finally:
            for p in procs:
                p.kill()
                p.wait(10)
            if work is not None and not work.done():
                work.cancel()
        async with JetStreamLightningStore(settings, pg_dsn=dsn, run_projector=False) as reader:
            verdict = await check_log_and_read_model(reader, settings, ledger)
            async with reader.pool.acquire() as conn:
                rows = await conn.fetch("SELECT id, last_seq, term FROM projector_checkpoint ORDER BY id")
    print(
        f"\n[fault] partitioned projector kill -9: partitions=4, processes=2 then 1 then 2, "
        f"events={verdict.events}, rollouts={len(ledger.rollouts)}, spans={verdict.spans}, lost={verdict.lost}, "
        f"doubled={verdict.doubled}, stuck={verdict.stuck}, killed_at_seq={at_kill} (of {last}), "
        f"projection_behind_at_kill={behind}, "
        f"takeover_s={takeover_s:.2f}, recover_s={recover_s:.2f}, handover_s={handover_s:.2f}, "
        f"checkpoints={[(r['id'], r['last_seq'], r['term']) for r in rows]}"
    )
    assert (verdict.lost, verdict.doubled, verdict.stuck) == (0, 0, 0)
    assert at_kill < last, "the kill came after the workload: it proves nothing"
    assert [r["last_seq"] for r in rows] == [last] * 4
    assert sum(r["term"] >= 2 for r in rows) >= 2, rows  # the killed process's partitions changed hands


async def test_runners_and_the_algorithm_on_a_3_node_cluster_with_a_partitioned_projector(
    services: tuple[Settings, Services], tmp_path: Path
) -> None:
    """Two runners and the algorithm, given only the cluster's URLs and the Postgres DSN; the
    algorithm's store and a second process project 2 partitions between them."""
    from cluster import Cluster
    from test_cluster_faults import RESOURCES, _runner

    try:
        _nats_binary()
    except ServiceUnavailableError as e:
        pytest.skip(f"no nats-server binary for the cluster: {e}")
    _, svc = services
    cluster = Cluster(tmp_path / "cluster")
    try:
        await cluster.start()
        async with namespace_on(cluster.url, svc.pg_dsn, replicas=3) as plain:
            ns = msgspec.structs.replace(plain, projector_partitions=2)
            async with (
                JetStreamLightningStore(ns, pg_dsn=svc.pg_dsn) as algo,
                JetStreamLightningStore(ns, pg_dsn=svc.pg_dsn) as other,
            ):
                await balanced([algo, other], 2)
                await algo.add_resources(RESOURCES)
                stop = asyncio.Event()
                runners = [asyncio.create_task(_runner(ns, i, stop)) for i in range(2)]
                try:
                    ids = [(await algo.enqueue_rollout({"i": i, "spans": 3})).rollout_id for i in range(16)]
                    done = await algo.wait_for_rollouts(rollout_ids=ids, timeout=60)
                finally:
                    stop.set()
                    await asyncio.wait_for(asyncio.gather(*runners, return_exceptions=True), 30)
                assert sorted(r.status for r in done) == ["succeeded"] * len(ids)
                await algo.sync_all(timeout_s=20)
                ledger = Ledger(rollouts=dict.fromkeys(ids, 4), finished=set(ids))  # 3 objects and the reward
                verdict = await check_log_and_read_model(algo, ns, ledger)
    finally:
        with contextlib.suppress(Exception):
            cluster.stop()
    assert (verdict.lost, verdict.doubled, verdict.stuck) == (0, 0, 0)


async def test_a_rollout_event_not_in_utf8_is_dead_lettered_by_its_own_partition(namespace: Settings) -> None:
    """A foreign payload on a rollout subject holding bytes that are not UTF-8 is malformed
    (``InvalidInputError``), also where partition 0 decodes another partition's rollout events for
    its worker side: it is dead-lettered once, as a malformed event, and the projection goes on.
    It was a ``UnicodeDecodeError`` that failed the batches reading it (dead-lettered only by the
    one-by-one retry of a failed batch)."""
    settings = msgspec.structs.replace(namespace, projector_partitions=2)
    async with projectors(settings, 1) as [store]:
        await balanced([store], 2)
        rid = next(f"ro-bad{i}" for i in range(100) if partition_of(f"ro-bad{i}", 2) == 1)
        bad = b'{"type":"rollout_enqueued","v":1,"time":1.0,"rollout_id":"\xff"}'
        await store.log.js.publish(f"{store.log.prefix}.r.{rid}.q", bad)
        after = [await store.enqueue_rollout({"i": i}) for i in range(4)]  # both partitions' events behind it
        await store.sync_all(timeout_s=20)
        async with store.pool.acquire() as conn:
            dead = await conn.fetch("SELECT stream_seq, error FROM projector_dead_letters")
        assert len(dead) == 1 and "malformed event" in dead[0]["error"], dead
        projected = {r.rollout_id for r in await store.query_rollouts()}
        assert projected == {r.rollout_id for r in after}
