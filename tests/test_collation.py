"""Sorting by a string field gives the in-memory backend's order (Python's: by code point) on a
Postgres whose collation orders strings otherwise (ICU ``en-US``: "a" before "B", "_" first).

The database made here uses ICU's ``en-US`` collation; the test skips where Postgres has no ICU.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from eventlight.core.types import Span
from eventlight.ops import Services, apply_migrations, apply_streams, drop_namespace
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats
from eventlight.store.memory import InMemoryLightningStore

NAMES = ["b", "B", "a", "_x", "é", "A", "a"]  # en-US: _x a a A b B é; code points: A B _x a a b é


@pytest.fixture
async def en_us_namespace(services: tuple[Settings, Services]) -> AsyncIterator[Settings]:
    base, svc = services
    db = f"el_collate_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(svc.pg_dsn)
    try:
        try:
            await admin.execute(
                f"CREATE DATABASE {db} TEMPLATE template0 ENCODING 'UTF8' "
                "LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'"
            )
        except asyncpg.PostgresError as e:
            pytest.skip(f"this Postgres cannot make an ICU en-US database: {e}")
        dsn = svc.pg_dsn.rsplit("/", 1)[0] + f"/{db}"
        settings = Settings(
            nats_url=svc.nats_url, pg_dsn=dsn, state_dir=base.state_dir, namespace=f"t{uuid.uuid4().hex[:10]}"
        )
        nc = await connect_nats(svc.nats_url)
        try:
            await apply_streams(nc, settings)
        finally:
            await nc.close()
        await apply_migrations(dsn, settings.pg_schema)
        try:
            yield settings
        finally:
            await drop_namespace(svc.nats_url, dsn, settings)
    finally:
        await admin.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        await admin.close()


async def _sorted_reads(store: Any) -> dict[str, list[str]]:
    r = await store.enqueue_rollout("x")
    d = await store.dequeue_rollout(worker_id="w")
    for name in NAMES:
        span = Span.from_attributes(
            attributes={}, rollout_id=r.rollout_id, attempt_id=d.attempt.attempt_id, sequence_id=0,
            name=name, start_time=1.0, end_time=1.0,
        )  # fmt: skip
        await store.add_span(span)
        await store.update_worker(f"{name}-worker".replace("é", "e-acute").replace("_", "u"), {})
    reads: dict[str, list[str]] = {}
    for order in ("asc", "desc"):
        spans = await store.query_spans(r.rollout_id, sort_by="name", sort_order=order)
        reads[f"spans {order}"] = [f"{s.name}#{s.sequence_id}" for s in spans]
    await store.update_worker("Zed", {})
    reads["workers"] = [w.worker_id for w in await store.query_workers(sort_by="worker_id")]
    return reads


async def test_string_sorts_follow_code_points_on_an_en_us_database(en_us_namespace: Settings) -> None:
    async with InMemoryLightningStore() as memory:
        expected = await _sorted_reads(memory)
    assert [s.split("#")[0] for s in expected["spans asc"]] == sorted(NAMES)
    async with JetStreamLightningStore(en_us_namespace, pg_dsn=en_us_namespace.pg_dsn) as store:
        assert await _sorted_reads(store) == expected
