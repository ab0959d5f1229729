"""Fault suites (issue 12): seeded kill -9 loops, Postgres stopped mid-run, the lock connection killed.

Each run writes a workload through the store API while a fault is injected, then checks (``faults``):
every acknowledged rollout is in the log once, no span lost or stored twice, every finished rollout
terminal in the read model, and the read model equal to a fresh rebuild of the log, table by table.
Servers that get killed are the test's own (loopback, temporary folders). Each test prints its figures
(runs, kills, events, lost, doubled, stuck, time to recover). ``EVENTLIGHT_FAULT_KILLS`` scales the loops.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from faults import (
    KILLS,
    Ledger,
    NatsServer,
    check_log_and_read_model,
    checkpoint,
    namespace_on,
    seeded,
    spawn_projector,
    stream_last_seq,
    wait_projected,
    workload,
)

from eventlight.core.errors import ServiceUnavailableError
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.projector import Projector

pytestmark = pytest.mark.faults


def report(name: str, **figures: Any) -> None:
    print(f"\n[fault] {name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


async def test_projector_killed_mid_batch_loses_nothing(namespace: Settings) -> None:
    """kill -9 of a projector process at seeded moments while a workload writes; each restart
    catches up from the committed checkpoint. Afterwards the read model equals a rebuild."""
    rng = seeded(12)
    ledger = Ledger()
    kills, behind, recover_s = 0, 0, []
    async with JetStreamLightningStore(namespace) as writer:  # a runner's store: no Postgres
        proc = spawn_projector(namespace)
        work = asyncio.create_task(workload(writer, ledger, n=100 * KILLS, spans=20, limit_s=90))
        try:
            while kills < KILLS * 2:
                await asyncio.sleep(rng.uniform(0.2, 1.0))
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                kills += 1
                at_kill = await stream_last_seq(writer)
                behind += int(await checkpoint(namespace.pg_dsn, namespace.pg_schema) < at_kill)
                proc = spawn_projector(namespace)
                recover_s.append(await wait_projected(namespace.pg_dsn, namespace.pg_schema, at_kill))
            await asyncio.wait_for(work, 120)
            await wait_projected(namespace.pg_dsn, namespace.pg_schema, await stream_last_seq(writer))
        finally:
            proc.kill()
            proc.wait(10)
            if not work.done():
                work.cancel()
        async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, run_projector=False) as reader:
            verdict = await check_log_and_read_model(reader, namespace, ledger)
    report(
        "projector kill -9",
        runs=1,
        kills=kills,
        kills_while_behind=behind,
        events=verdict.events,
        rollouts=len(ledger.rollouts),
        spans=verdict.spans,
        lost=verdict.lost,
        doubled=verdict.doubled,
        stuck=verdict.stuck,
        recover_max_s=round(max(recover_s, default=0), 2),
    )
    assert kills >= 1 and (verdict.lost, verdict.doubled, verdict.stuck) == (0, 0, 0)


async def test_nats_server_killed_and_restarted_loses_no_acknowledged_write(tmp_path: Path) -> None:
    """kill -9 of nats-server (the test's own, fsync always) at seeded moments mid-workload, restarted
    on the same port and store. The writer retries what failed; the projector (in the reading store)
    re-reads from its checkpoint. Nothing acknowledged is lost or doubled; the read model equals a rebuild."""
    dsn = os.environ.get("EVENTLIGHT_PG_DSN")
    if not dsn:
        pytest.skip("needs EVENTLIGHT_PG_DSN")
    rng = seeded(7)
    server = NatsServer(tmp_path / "nats")
    server.start()
    await server.ready()
    ledger = Ledger()
    kills, recover_s = 0, []
    try:
        async with namespace_on(server.url, dsn) as ns:
            store = JetStreamLightningStore(ns, pg_dsn=dsn)
            await store.start()
            try:
                work = asyncio.create_task(workload(store, ledger, n=30 * KILLS, spans=10, limit_s=90))
                while not work.done() and kills < KILLS:
                    await asyncio.sleep(rng.uniform(0.5, 1.5))
                    server.kill9()
                    kills += 1
                    await asyncio.sleep(rng.uniform(0.1, 0.5))
                    t0 = time.monotonic()
                    server.start()
                    await server.ready()
                    recover_s.append(time.monotonic() - t0)
                await asyncio.wait_for(work, 120)
                t0 = time.monotonic()
                await wait_projected(dsn, ns.pg_schema, await stream_last_seq(store))
                catch_up_s = time.monotonic() - t0
                verdict = await check_log_and_read_model(store, ns, ledger)
            finally:
                await store.close()
    finally:
        server.stop()
    report(
        "nats-server kill -9",
        runs=1,
        kills=kills,
        events=verdict.events,
        rollouts=len(ledger.rollouts),
        spans=verdict.spans,
        failed_calls_retried=ledger.failures,
        lost=verdict.lost,
        doubled=verdict.doubled,
        stuck=verdict.stuck,
        restart_max_s=round(max(recover_s, default=0), 2),
        catch_up_s=round(catch_up_s, 2),
    )
    assert kills >= 1 and (verdict.lost, verdict.doubled, verdict.stuck) == (0, 0, 0)


async def test_lock_connection_killed_mid_run_never_two_writers(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two stores with projectors; the leader's advisory-lock connection is terminated at seeded
    moments while a workload writes. Every committed batch is recorded (term, from, to): the ranges
    never overlap (never two writers), terms only grow, and the read model equals a rebuild."""
    rng = seeded(3)
    commits: list[tuple[int, int, int]] = []
    refused = {"n": 0}
    apply = Projector.apply

    async def recording(self: Projector, msgs: list[Any]) -> None:
        before = self.checkpoint
        try:
            await apply(self, msgs)
        except Exception:
            refused["n"] += 1
            raise
        if self.checkpoint != before:  # committed
            commits.append((self.term, before, self.checkpoint))

    monkeypatch.setattr(Projector, "apply", recording)
    ledger = Ledger()
    kills = 0
    async with (
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as a,
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as b,
        JetStreamLightningStore(namespace) as writer,
    ):
        work = asyncio.create_task(workload(writer, ledger, n=80 * KILLS, spans=10))
        admin = await asyncpg.connect(namespace.pg_dsn)
        try:
            while not work.done() and kills < KILLS * 2:
                await asyncio.sleep(rng.uniform(0.2, 0.8))
                leaders = [s.projector for s in (a, b) if s.projector.leader.is_set()]
                assert len(leaders) <= 1, "two projectors lead at once"
                if leaders and leaders[0]._lock_conn is not None:
                    await admin.execute("SELECT pg_terminate_backend($1)", leaders[0]._lock_conn.get_server_pid())
                    kills += 1
            await asyncio.wait_for(work, 120)
        finally:
            await admin.close()
        await wait_projected(namespace.pg_dsn, namespace.pg_schema, await stream_last_seq(writer))
        live = list(commits)  # the rebuild below commits into another schema
        verdict = await check_log_and_read_model(a, namespace, ledger)
    ordered = sorted(live, key=lambda c: c[1])
    # no two writers: committed ranges never overlap (a gap is a commit whose caller was cancelled
    # after it committed, as a deposed leader is: the next leader starts from the row, not from it)
    chained = all(prev[2] <= nxt[1] for prev, nxt in zip(ordered, ordered[1:], strict=False))
    unobserved = sum(1 for prev, nxt in zip(ordered, ordered[1:], strict=False) if prev[2] < nxt[1])
    terms_grow = all(prev[0] <= nxt[0] for prev, nxt in zip(ordered, ordered[1:], strict=False))
    report(
        "lock connection killed",
        runs=1,
        kills=kills,
        terms=len({c[0] for c in live}),
        batches=len(live),
        failed_batches=refused["n"],
        commits_unobserved=unobserved,
        events=verdict.events,
        lost=verdict.lost,
        doubled=verdict.doubled,
        stuck=verdict.stuck,
    )
    assert kills >= 1 and chained and terms_grow and ordered[0][1] == 0, ordered
    assert (verdict.lost, verdict.doubled, verdict.stuck) == (0, 0, 0)


async def test_postgres_stopped_and_started_mid_run() -> None:
    """peer_failures C25 (Postgres refusing connections): an embedded Postgres of the test's own
    (and its own nats-server) is stopped mid-workload and started again: runners' writes go on
    (they need NATS only), the projection pauses, then catches up from its checkpoint, and the
    read model equals a rebuild of the log."""
    from eventlight import ops as svc
    from eventlight.ops.pg_pgserver import stop_pgserver
    from eventlight.ops.pg_system import stop_system_pg
    from eventlight.ops.state import state_dir

    home = Path(tempfile.mkdtemp(prefix="eventlight-pgfault-"))  # Postgres runs as `postgres`: not under
    os.chmod(home, 0o755)  # pytest's root-only tmp_path
    base = Settings(state_dir=home / "state", namespace="pgfault")
    started = await svc.ensure_services(base)
    stops, recover_s, named = 0, [], []
    ledger = Ledger()
    try:
        async with namespace_on(started.nats_url, started.pg_dsn) as ns:
            reader = JetStreamLightningStore(ns, pg_dsn=started.pg_dsn)
            await reader.start()
            try:
                async with JetStreamLightningStore(ns) as writer:
                    work = asyncio.create_task(workload(writer, ledger, n=60 * KILLS, spans=10, limit_s=90))
                    rng = seeded(5)
                    for _ in range(max(1, KILLS // 2)):
                        await asyncio.sleep(rng.uniform(0.3, 1.0))
                        state = state_dir(base)
                        await stop_system_pg(state)
                        await stop_pgserver(state)
                        stops += 1
                        with pytest.raises(ServiceUnavailableError) as down:  # item 7: the cause is named
                            await reader.sync(10**12, timeout_s=1.5)
                        named.append(down.value.server)
                        await asyncio.sleep(rng.uniform(0.5, 1.5))  # writes go on meanwhile
                        at_stop = await stream_last_seq(writer)
                        t0 = time.monotonic()
                        await svc.ensure_services(base)
                        await wait_projected(started.pg_dsn, ns.pg_schema, at_stop, timeout_s=60)
                        recover_s.append(time.monotonic() - t0)
                    await asyncio.wait_for(work, 120)
                    await wait_projected(started.pg_dsn, ns.pg_schema, await stream_last_seq(writer))
                verdict = await check_log_and_read_model(reader, ns, ledger)
            finally:
                await reader.close()
    finally:
        await svc.stop_services(base)
        shutil.rmtree(home, ignore_errors=True)
    report(
        "postgres stopped and started",
        runs=1,
        stops=stops,
        events=verdict.events,
        rollouts=len(ledger.rollouts),
        spans=verdict.spans,
        lost=verdict.lost,
        doubled=verdict.doubled,
        stuck=verdict.stuck,
        catch_up_max_s=round(max(recover_s, default=0), 2),
        sync_error_names=sorted(set(named)),
    )
    assert stops >= 1 and (verdict.lost, verdict.doubled, verdict.stuck) == (0, 0, 0)
    assert named == ["Postgres"] * stops
