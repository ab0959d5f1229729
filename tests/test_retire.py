"""Retirement (issue 14): terminal rollouts past the retention window leave the hot stream for the
archive stream JetStream sources; replay, export and rebuild read archive + hot as one log; a late
write to a retired rollout is refused with ``RolloutRetiredError``; off unless ``retention_s`` is set."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js.api import StreamConfig, StreamSource, SubjectTransform

import eventlight
from eventlight.core.errors import InvalidInputError, RolloutNotFoundError, RolloutRetiredError
from eventlight.core.types import RolloutConfig, Span
from eventlight.logreplay.rebuild import rebuild
from eventlight.logreplay.transfer import ImportReport, export_log, import_log
from eventlight.ops import apply_streams
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.archive import archive_head, archive_lag, ordered, source_position
from eventlight.store.jetstream.connect import connect_nats
from eventlight.store.jetstream.retire import retire, subscriber_floors
from tests.test_replay import llm_span, workload


async def _with_archive(namespace: Settings) -> Settings:
    settings = msgspec.structs.replace(namespace, retention_s=0.0)
    nc = await connect_nats(settings.nats_url or "")
    try:
        applied = await apply_streams(nc, settings)
        assert f"stream {settings.archive_stream_name}" in applied
        config = (await nc.jetstream().stream_info(settings.archive_stream_name)).config
        [source] = config.sources or []
        assert source.name == settings.stream_name and len(source.subject_transforms or []) == 1  # one filter
    finally:
        await nc.close()
    return settings


async def _archive_caught_up(store: JetStreamLightningStore) -> None:
    for _ in range(200):
        if await archive_lag(store.log) == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the archive stayed {await archive_lag(store.log)} positions behind")


async def _hot_log(store: JetStreamLightningStore) -> list[tuple[int, str, bytes]]:
    """The hot stream alone, read straight (what the log is before anything is retired)."""
    log = store.log
    cut = len(log.prefix) + 1
    head = await log.head_seq()
    return [
        (m.metadata.sequence.stream, m.subject[cut:], m.data)
        async for m in ordered(log, log.stream, f"{log.prefix}.>", 0, head)
    ]


async def _hot_subjects(store: JetStreamLightningStore) -> dict[str, int]:
    info = await store.log.js.stream_info(store.log.stream, subjects_filter=">")
    return dict(info.state.subjects or {})


def test_the_source_header_gives_position_and_subject() -> None:
    value = "EL_T 7 el.t.r.*.*\x0cel.t.s.*.* elarc.t.r\x0celarc.t.s el.t.r.ro-1.e Abc123"
    assert source_position({"Nats-Stream-Source": value}) == (7, "el.t.r.ro-1.e")
    assert source_position({}) is None and source_position(None) is None
    assert source_position({"Nats-Stream-Source": "EL_T x"}) is None


async def test_off_by_default_no_archive_and_retire_refuses(namespace: Settings) -> None:
    assert Settings().retention_s is None
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        assert await archive_head(store.log) is None
        with pytest.raises(InvalidInputError, match="retirement is off"):
            await retire(store.log, store.read_model.pool, namespace, now=time.time())  # type: ignore[union-attr]
        on = msgspec.structs.replace(namespace, retention_s=0.0)
        with pytest.raises(InvalidInputError, match="no archive stream"):
            await retire(store.log, store.read_model.pool, on, now=time.time())  # type: ignore[union-attr]


async def test_retired_rollouts_leave_the_hot_stream_and_the_log_reads_the_same(
    namespace: Settings, tmp_path: Path
) -> None:
    settings = await _with_archive(namespace)
    dsn = settings.pg_dsn
    assert dsn is not None
    hour = msgspec.structs.replace(settings, retention_s=3600.0)  # the leader's own rounds retire nothing
    async with JetStreamLightningStore(hour, pg_dsn=dsn) as store:  # (with 0 s, a round a second took them first)
        ids = await workload(store)  # three terminal rollouts
        await store.update_worker("w-beat", {"cpu": 1})  # a worker event between rollout events
        live = await store.enqueue_rollout({"task": "live"})
        claimed = await store.dequeue_rollout(worker_id="w2")
        assert claimed is not None and claimed.rollout_id == live.rollout_id
        await store.sync_all(timeout_s=10)
        await _archive_caught_up(store)
        whole = await _hot_log(store)
        assert {subject.split(".")[0] for _, subject, _ in whole} >= {"r", "s", "res", "w"}
        assert [e async for e in store.log.scan()] == whole  # archive (r, s) merged with the hot res and w
        before = [r async for r in eventlight.replay(settings, adapter="triplets")]
        await export_log(settings, tmp_path / "before.jsonl", 0, None)
        pool: Any = store.read_model.pool  # type: ignore[union-attr]

        not_yet = await retire(store.log, pool, msgspec.structs.replace(settings, retention_s=3600.0), now=time.time())
        assert not_yet.retired == 0  # ended within the retention window
        report = await retire(store.log, pool, settings, now=time.time() + 1)
        assert report.retired == 3
        subjects = await _hot_subjects(store)
        for rid in ids.values():
            assert not [s for s in subjects if f".{rid}." in s], f"{rid} is still in the hot stream"
        assert [s for s in subjects if f".{live.rollout_id}." in s], "the running rollout was retired"
        assert (await retire(store.log, pool, settings, now=time.time() + 1)).retired == 0  # nothing twice

        assert [e async for e in store.log.scan(0, whole[-1][0])] == whole  # retired events come from the archive
        after = [r async for r in eventlight.replay(settings, adapter="triplets")]
        assert after == before and len(after) == 6
        await export_log(settings, tmp_path / "after.jsonl", 0, None)
        assert (tmp_path / "after.jsonl").read_bytes() == (tmp_path / "before.jsonl").read_bytes()
        rebuilt = await rebuild(settings, dsn)
        assert rebuilt.same, rebuilt.tables

        rid = ids["good"]
        aid = (await store.get_latest_attempt(rid)).attempt_id  # type: ignore[union-attr]  # reads keep working
        with pytest.raises(RolloutRetiredError, match="is retired"):
            await store.update_attempt(rid, aid, status="failed")
        with pytest.raises(RolloutRetiredError):
            await store.add_span(llm_span(rid, aid, 9, "late", 20.0))
        await store.update_attempt(live.rollout_id, claimed.attempt.attempt_id, status="succeeded")  # live: fine
    async with JetStreamLightningStore(settings) as other:  # another process: reads the ledger
        with pytest.raises(RolloutRetiredError):
            await other.update_rollout(ids["bad"], status="cancelled")
        with pytest.raises(RolloutNotFoundError) as never:
            await other.update_rollout("ro-neverexisted", status="cancelled")
        assert not isinstance(never.value, RolloutRetiredError)


async def test_a_finished_rollout_the_watchdog_still_watches_stays_until_it_is_marked(namespace: Settings) -> None:
    """A finished rollout whose superseded attempt a late span revived (its runner then vanished)
    is watched while its config sets a limit (``fold.watched``); retired, its purged ``r.<rid>.>``
    would fail every watchdog append for ever (the fence), the attempt would stay ``running`` and
    the projector would keep the rollout in its watchdog set. So it is retired once the watchdog
    marked the attempt; one with no limit is not watched and retires at once."""
    settings = await _with_archive(namespace)
    assert settings.pg_dsn is not None
    limited = RolloutConfig(unresponsive_seconds=5.0, max_attempts=3, retry_condition=["unresponsive"])
    unlimited = RolloutConfig(max_attempts=3, retry_condition=["unresponsive"])
    hour = msgspec.structs.replace(settings, retention_s=3600.0)  # the leader's own rounds retire nothing
    async with JetStreamLightningStore(hour, pg_dsn=settings.pg_dsn) as store:
        assert store.projector is not None
        ids = []
        for config in (limited, unlimited):
            r = await store.enqueue_rollout("x", config=config)
            a = (await store.dequeue_rollout(worker_id="a")).attempt  # type: ignore[union-attr]
            await store.update_attempt(r.rollout_id, a.attempt_id, status="unresponsive")  # as the watchdog
            b = (await store.dequeue_rollout(worker_id="b")).attempt  # type: ignore[union-attr]
            await store.add_span(Span.from_attributes(attributes={}, rollout_id=r.rollout_id, attempt_id=a.attempt_id))
            await store.update_attempt(r.rollout_id, b.attempt_id, status="succeeded")
            ids.append(r.rollout_id)
        await store.sync_all(timeout_s=10)
        await _archive_caught_up(store)
        pool: Any = store.read_model.pool  # type: ignore[union-attr]
        assert (await retire(store.log, pool, settings, now=time.time() + 1)).retired == 1  # the unlimited one
        assert [rid for rid, _, _ in store.projector.in_flight()] == ids[:1]
        assert await store.projector.watch_once(time.time() + 60) == 1
        await store.sync_all(timeout_s=10)
        assert [x.status for x in await store.query_attempts(ids[0])] == ["unresponsive", "succeeded"]
        assert store.projector.in_flight() == []
        await _archive_caught_up(store)
        assert (await retire(store.log, pool, settings, now=time.time() + 61)).retired == 1


async def test_the_leading_projector_retires_what_is_due_by_itself(namespace: Settings) -> None:
    """With ``retention_s`` set, nothing has to call ``retire``: the projector's leader does it each
    round (every second for a window of 0 s) and leaves rollouts in flight alone."""
    settings = await _with_archive(namespace)
    assert settings.pg_dsn is not None
    async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        ids = await workload(store)
        live = await store.enqueue_rollout({"task": "live"})
        retired: list[str] = []
        assert store.projector is not None
        for _ in range(300):  # up to 30 s: a round a second, slower on a loaded machine (it failed 1 of 6 at 10 s)
            subjects = await _hot_subjects(store)
            retired = [rid for rid in ids.values() if not [s for s in subjects if f".{rid}." in s]]
            # the round counts them after their retired_rollouts rows, a while after the purge
            if len(retired) == len(ids) and store.projector.retired >= len(ids):
                break
            await asyncio.sleep(0.1)
        assert sorted(retired) == sorted(ids.values()), subjects
        assert [s for s in subjects if f".{live.rollout_id}." in s], "the queued rollout was retired"
        assert store.projector.retired >= len(ids)
        got = await store.get_rollout_by_id(ids["good"])  # reads still come from Postgres
        assert got is not None and got.status == "succeeded"


async def test_retirement_waits_for_a_durable_subscriber_that_is_behind(namespace: Settings) -> None:
    """A durable subscription that is down keeps its records in the hot stream: retirement stays at
    or below its acknowledged position, and goes on once it has read and acknowledged them."""
    settings = await _with_archive(namespace)
    dsn = settings.pg_dsn
    assert dsn is not None
    async with JetStreamLightningStore(settings, pg_dsn=dsn) as store:
        pool: Any = store.read_model.pool  # type: ignore[union-attr]
        async with store.subscribe_messages(durable="trainer-a"):
            pass  # created at the stream's head; acknowledged nothing yet
        assert list(await subscriber_floors(store.log)) == ["trainer-a"]
        ids = await workload(store)
        await store.sync_all(timeout_s=10)
        await _archive_caught_up(store)
        held = await retire(store.log, pool, settings, now=time.time() + 1)
        assert held.retired == 0, "retired records a durable subscriber has not read"
        assert held.bound == (await subscriber_floors(store.log))["trainer-a"]

        async with store.subscribe_messages(durable="trainer-a") as sub:  # resumes, reads, acknowledges
            got = await sub.collect(list(ids.values()), timeout_s=10)
        assert sorted(r.rollout_id for r in got) == sorted(ids.values())
        report = await retire(store.log, pool, settings, now=time.time() + 1)
        assert report.retired == 3


async def test_a_rollout_retired_before_the_subscription_started_is_collected_at_once(namespace: Settings) -> None:
    """DESIGN: the log keeps everything. A rollout that ended and was retired to the archive before
    a subscription started is collected at once, the record a subscription that had started before
    it returns, spans included (read from the archive; the hot stream no longer holds it). It was
    waited for until ``timeout_s`` and left out. More than ``READS_AT_ONCE`` retired rollouts in one
    ``collect``, an unknown id and a repeated one beside them."""
    from eventlight.store.subscription.subscription import READS_AT_ONCE

    settings = await _with_archive(namespace)
    hour = msgspec.structs.replace(settings, retention_s=3600.0)  # the leader's own rounds retire nothing
    assert settings.pg_dsn is not None
    async with JetStreamLightningStore(hour, pg_dsn=settings.pg_dsn) as store:
        ids = list((await workload(store)).values())
        for _ in range(READS_AT_ONCE):
            r = await store.enqueue_rollout({"task": "more"})
            d = (await store.dequeue_rollout(worker_id="w1")).attempt  # type: ignore[union-attr]
            await store.add_many_spans([llm_span(r.rollout_id, d.attempt_id, 1, "x", 10.0)])
            await store.update_attempt(r.rollout_id, d.attempt_id, status="succeeded")
            ids.append(r.rollout_id)
        async with store.subscribe_triplets(since=0) as early:
            expected = await early.collect(ids, timeout_s=20)
        assert len(expected) == len(ids)
        await store.sync_all(timeout_s=10)
        await _archive_caught_up(store)
        pool: Any = store.read_model.pool  # type: ignore[union-attr]
        assert (await retire(store.log, pool, settings, now=time.time() + 1)).retired == len(ids)
        assert not [s for s in await _hot_subjects(store) if s.split(".")[2] in ("r", "s")]
        async with store.subscribe_triplets() as sub:
            got = await sub.collect([*ids, "ro-unknown", ids[0]], timeout_s=0)
            assert await sub.collect(ids, timeout_s=0) == got  # held: the same again
    assert got == expected and got[0].data and got[0].final_reward == 0.9


async def test_retirement_waits_while_the_archive_is_behind(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round retires nothing while the archive is more than ``ARCHIVE_LAG_MAX`` messages behind
    (a purge then costs per message the archive's consumer has not been handed); once it is within
    the bound the same round retires what is due."""
    from eventlight.store.jetstream import retire as retire_module

    settings = await _with_archive(namespace)
    dsn = settings.pg_dsn
    assert dsn is not None
    async with JetStreamLightningStore(settings, pg_dsn=dsn) as store:
        pool: Any = store.read_model.pool  # type: ignore[union-attr]
        await workload(store)
        await store.sync_all(timeout_s=10)
        await _archive_caught_up(store)
        monkeypatch.setattr(retire_module, "ARCHIVE_LAG_MAX", -1)  # any lag, even none, is too much
        held = await retire(store.log, pool, settings, now=time.time() + 1)
        assert held.retired == 0 and held.archive_lag == 0
        monkeypatch.setattr(retire_module, "ARCHIVE_LAG_MAX", 10_000)
        report = await retire(store.log, pool, settings, now=time.time() + 1)
        assert report.retired == 3 and report.archive_lag == 0


async def test_an_archive_made_with_one_filter_per_kind_reads_the_same_after_the_upgrade(namespace: Settings) -> None:
    """An archive an older eventlight made (one source filter per kind, resources and worker events
    archived too) is switched by ``apply_streams`` to the one-filter source: the new source starts
    again from the hot stream's first message, and the log still reads as one, each position once,
    before and after retirement."""
    settings = msgspec.structs.replace(namespace, retention_s=0.0)
    ns = settings.namespace
    legacy = StreamConfig(
        name=settings.archive_stream_name,
        subjects=[f"{settings.archive_prefix}.retired"],
        allow_direct=True,
        sources=[
            StreamSource(
                name=settings.stream_name,
                subject_transforms=[
                    SubjectTransform(src=f"el.{ns}.{kind}.{wild}", dest=f"elarc.{ns}.{kind}")
                    for kind, wild in (("r", "*.*"), ("s", "*.*"), ("res", "*"), ("w", "*"))
                ],
            )
        ],
    )
    nc = await connect_nats(settings.nats_url or "")
    try:
        await nc.jetstream().add_stream(legacy)
        assert settings.pg_dsn is not None
        async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
            ids = await workload(store)
            await store.update_worker("w-beat", {"cpu": 1})
            head = await store.log.head_seq()
            for _ in range(200):  # the old source archives everything, res and w included
                if (await nc.jetstream().stream_info(settings.archive_stream_name)).state.messages >= head:
                    break
                await asyncio.sleep(0.05)
            await apply_streams(nc, settings)  # the upgrade
            [source] = (await nc.jetstream().stream_info(settings.archive_stream_name)).config.sources or []
            assert len(source.subject_transforms or []) == 1
            await store.update_worker("w-beat", {"cpu": 2})
            await store.enqueue_rollout({"task": "after the upgrade"})
            await store.sync_all(timeout_s=10)
            await _archive_caught_up(store)
            whole = await _hot_log(store)
            assert [e async for e in store.log.scan()] == whole
            report = await retire(store.log, store.read_model.pool, settings, now=time.time() + 1)  # type: ignore[union-attr]
            assert report.retired == len(ids)
            assert [e async for e in store.log.scan(0, whole[-1][0])] == whole
    finally:
        await nc.close()


async def test_a_cancel_caught_before_does_not_end_a_scan_of_the_archive(namespace: Settings) -> None:
    """A task that caught a ``CancelledError`` without taking the cancel back (3.11's ``TaskGroup``
    can leave its parent so when a child fails) then scans the log through the archive: it reads
    every event. The check for a cancel nats-py swallowed counts only cancels that arrive during a
    read; before, it counted the left-over one and the scan raised ``CancelledError`` with nobody
    cancelling (a fresh reviewer's repro with ``eventlight.replay``)."""
    settings = msgspec.structs.replace(await _with_archive(namespace), retention_s=3600.0)
    async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        await workload(store)
        await _archive_caught_up(store)
        expected = len([e async for e in store.log.scan()])
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            pass
        assert task.cancelling() == 1  # left over, as such a TaskGroup leaves it
        try:
            assert len([e async for e in store.log.scan()]) == expected > 0
        finally:
            task.uncancel()


async def test_importing_an_export_again_after_retirement_appends_nothing(namespace: Settings, tmp_path: Path) -> None:
    """A reviewer: what import holds was read from the hot stream only, so once the rollouts were
    retired an import of the namespace's own export appended all of them again."""
    settings = await _with_archive(namespace)
    assert settings.pg_dsn is not None
    async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn) as store:
        ids = await workload(store)
        await store.sync_all(timeout_s=10)
        await _archive_caught_up(store)
        await retire(store.log, store.read_model.pool, settings, now=time.time() + 1)  # type: ignore[union-attr]
        subjects = await _hot_subjects(store)
        assert not [s for s in subjects if s.split(".")[2] in ("r", "s")], subjects  # every rollout retired
        out = tmp_path / "log.jsonl"
        n = (await export_log(settings, out, 0, None))[0]
        head = await store.log.head_seq()
        assert await import_log(settings, out) == ImportReport(present=n)
        assert await store.log.head_seq() == head and await _hot_subjects(store) == subjects

        lines = out.read_text().splitlines()  # an event of a retired rollout that the namespace lacks
        i = max(i for i, line in enumerate(lines) if f'"subject":"r.{ids["bad"]}.e"' in line)
        entry = msgspec.json.decode(lines[i])
        entry["data"]["time"] += 1.0
        lines[i] = msgspec.json.encode(entry).decode()
        changed = tmp_path / "changed.jsonl"
        changed.write_text("\n".join(lines) + "\n")
        with pytest.raises(InvalidInputError, match=f"rollout {ids['bad']} is retired in the namespace"):
            await import_log(settings, changed)
        assert await store.log.head_seq() == head


async def test_retire_locks_the_rows_it_marks_in_rollout_id_order_whatever_the_plan(namespace: Settings) -> None:
    """``retire`` marked rollouts retired (``_FLAG``) with ``UPDATE … WHERE rollout_id = ANY(…)``, which
    locks rows in the order its plan reads them (here the heap's: z, a, m), while the projector wrote
    rollouts in the order of its batch: two such transactions could deadlock (Postgres then fails one
    of them). Both now go in ``rollout_id`` byte order. With the middle row held by another
    transaction, the marking waits there having locked the row before it (a), not the one after (z)."""
    import asyncpg

    from eventlight.store.jetstream.retire import _FLAG

    ids = ["ro-z", "ro-a", "ro-m"]  # inserted in this order: a sequential scan reads them so
    on_schema = {"search_path": namespace.pg_schema}
    setup, holder, retirer, probe = [await asyncpg.connect(namespace.pg_dsn, server_settings=on_schema) for _ in "1234"]
    try:
        for seq, rid in enumerate(ids, 1):
            await setup.execute(
                "INSERT INTO rollouts (rollout_id, start_time, status, config, created_seq, last_seq)"
                " VALUES ($1, 0, 'succeeded', '{}'::jsonb, $2, $2)",
                rid,
                seq,
            )
        for knob in ("enable_indexscan", "enable_bitmapscan", "enable_indexonlyscan"):
            await retirer.execute(f"SET {knob} = off")  # a plan that reads the heap in its own order
        async with holder.transaction():
            await holder.execute("SELECT 1 FROM rollouts WHERE rollout_id = 'ro-m' FOR UPDATE")
            marking = asyncio.ensure_future(retirer.execute(_FLAG, ids))  # ids out of order, as given
            waits = "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = $1"
            for _ in range(600):
                if marking.done() or await probe.fetchval(waits, retirer.get_server_pid()):
                    break
                await asyncio.sleep(0.05)
            async with probe.transaction():
                free = await probe.fetch(
                    "SELECT rollout_id FROM rollouts WHERE rollout_id = ANY($1) ORDER BY rollout_id"
                    " FOR UPDATE SKIP LOCKED",
                    ids,
                )
        await asyncio.wait_for(marking, 30)
        assert [r[0] for r in free] == ["ro-z"], "the marking locked rows out of rollout_id order"
        retired = await setup.fetch("SELECT rollout_id FROM rollouts WHERE retired ORDER BY rollout_id")
        assert [r[0] for r in retired] == ["ro-a", "ro-m", "ro-z"]
    finally:
        for conn in (setup, holder, retirer, probe):
            await conn.close()


async def test_the_projector_writes_rollouts_in_rollout_id_order() -> None:
    """The other side of the lock order above: the projector upserted a batch's rollouts in the order
    the batch first touched them; it writes them (and their attempts) in ``rollout_id`` byte order,
    as ``retire`` locks them."""
    from eventlight.core.commands import RolloutState
    from eventlight.core.types import Attempt, Rollout
    from eventlight.store.fold import Changes
    from eventlight.store.jetstream.projector.batch import BatchWriter

    class Recording:
        def __init__(self) -> None:
            self.rows: list[tuple[str, list[tuple[Any, ...]]]] = []

        async def executemany(self, query: str, rows: list[tuple[Any, ...]]) -> None:
            self.rows.append((query.split("(")[0].split()[-1], rows))

    changes = Changes()
    for rid in ["ro-z", "ro-a", "ro-B", "ro-m"]:  # as a batch touched them; byte order: B, a, m, z
        attempt = Attempt(rollout_id=rid, attempt_id=f"at-{rid}", sequence_id=1, start_time=0.0)
        changes.rollouts[rid] = RolloutState(Rollout(rollout_id=rid, input=None, start_time=0.0), (attempt,))
    writer = BatchWriter()
    writer.partitions, writer.rollout_seq = 1, {}
    conn = Recording()
    await writer._write(conn, changes)  # type: ignore[arg-type]
    written = {table: [row[0] for row in rows] for table, rows in conn.rows}
    assert written == {"attempts": ["ro-B", "ro-a", "ro-m", "ro-z"], "rollouts": ["ro-B", "ro-a", "ro-m", "ro-z"]}
