"""A partitioned projection (issue 17 item 4): N partitions over several projector processes give
the read model a rebuild of the log gives (a one-partition fold), and the count is fixed per namespace."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest
from test_rebuild import TABLES, rebuild, table, workload

from eventlight.core.errors import InvalidInputError
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.projector import ProjectorGroup
from eventlight.store.jetstream.projector.partition import fair_share, partition_of


def test_the_partition_of_a_rollout_is_a_stable_hash() -> None:
    assert partition_of("ro-abc", 4) == partition_of("ro-abc", 4)
    assert {partition_of(f"ro-{i}", 4) for i in range(100)} == {0, 1, 2, 3}
    assert [fair_share(4, [10, 20, 30], me) for me in (10, 20, 30)] == [2, 1, 1]


def led(store: JetStreamLightningStore) -> list[int]:
    assert isinstance(store.projector, ProjectorGroup)
    return store.projector.led


class Both:
    """``a`` whose ``projector.watch_once`` ticks the watchdogs of both processes' partitions."""

    def __init__(self, a: JetStreamLightningStore, b: JetStreamLightningStore):
        self._a, self.projector = a, self
        self._b = b

    def __getattr__(self, name: str) -> Any:
        return getattr(self._a, name)

    async def watch_once(self, now: float) -> int:
        assert self._a.projector is not None and self._b.projector is not None
        return int(await self._a.projector.watch_once(now)) + int(await self._b.projector.watch_once(now))


@pytest.mark.parametrize("partitions", [2, 4])
async def test_partitions_over_two_processes_equal_a_rebuild(namespace: Settings, partitions: int) -> None:
    dsn = namespace.pg_dsn
    assert dsn is not None
    settings = Settings(
        nats_url=namespace.nats_url, pg_dsn=dsn, namespace=namespace.namespace, projector_partitions=partitions
    )
    fresh = f"{namespace.pg_schema}_rebuilt"
    async with (
        JetStreamLightningStore(settings, pg_dsn=dsn) as a,
        JetStreamLightningStore(settings, pg_dsn=dsn) as b,
    ):
        deadline = time.monotonic() + 20
        while len(led(a)) + len(led(b)) < partitions or not led(a) or not led(b):
            assert time.monotonic() < deadline, f"not shared: {led(a)} {led(b)}"
            await asyncio.sleep(0.1)
        assert not set(led(a)) & set(led(b))
        await workload(Both(a, b))
        for i in range(20):
            await b.enqueue_rollout({"more": i})
        await b.sync_all(timeout_s=20)
        await a.sync_all(timeout_s=20)
        try:
            conn = await asyncpg.connect(dsn)
            try:
                last = await conn.fetchval(f'SELECT min(last_seq) FROM "{namespace.pg_schema}".projector_checkpoint')
                assert await rebuild(a, fresh, dsn) == last
                for name in TABLES:
                    live, rebuilt = await table(conn, namespace.pg_schema, name), await table(conn, fresh, name)
                    assert live, f"{name} is empty: the comparison would prove nothing"
                    assert live == rebuilt, f"{name}: the partitioned projection differs from a rebuild"
            finally:
                await conn.close()
        finally:
            conn = await asyncpg.connect(dsn)
            try:
                await conn.execute(f'DROP SCHEMA IF EXISTS "{fresh}" CASCADE')
            finally:
                await conn.close()


async def test_the_partition_count_is_fixed_per_namespace(namespace: Settings) -> None:
    dsn = namespace.pg_dsn
    two = Settings(nats_url=namespace.nats_url, pg_dsn=dsn, namespace=namespace.namespace, projector_partitions=2)
    async with JetStreamLightningStore(two, pg_dsn=dsn) as store:
        await store.enqueue_rollout("x")
    with pytest.raises(InvalidInputError, match="projected in 2 partitions, not 1"):
        async with JetStreamLightningStore(namespace, pg_dsn=dsn):
            pass
