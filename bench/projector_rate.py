"""Projection rate: how fast fresh projectors catch up on a pre-filled stream, by partition count.

    python -m bench.projector_rate [--rollouts 1000] [--spans 20] [--partitions 1,2,4] [--processes 1,2]

A write-only store (what a runner opens) fills one fresh namespace with ``--rollouts`` started
rollouts, ``--spans`` spans each (one batch per rollout) and a finish each, with no projector
running. Then, for every partition count N of ``--partitions`` and process count P of
``--processes``, the namespace's Postgres schema is made afresh (the stream stays, so every case
projects the same log from sequence 0) and P projector processes (each a store with
``projector_partitions=N``, as ``EVENTLIGHT_PROJECTOR_PARTITIONS=N`` gives, sharing the partitions)
are started together; the clock runs from their start (imports done) until every partition's
checkpoint row has reached the stream's last sequence. That gives events/s (stream messages) and
spans/s, read-model rows/s (rows in the schema's tables at the end), and CPU per message of the
projector processes, of their Postgres backends and of the embedded nats-server. Each partition
reads the whole stream, so on few cores more partitions cannot go much faster. Uses
``EVENTLIGHT_NATS_URL`` and ``EVENTLIGHT_PG_DSN`` when set, else the embedded services of a
temporary state dir.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import resource
import shutil
import tempfile
import time
import uuid
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import asyncpg
import psutil

from bench import bench_durability, positive_ints, require_positive
from bench.report import print_and_save
from eventlight.core.types import Span
from eventlight.ops import (
    Services,
    apply_migrations,
    apply_streams,
    drop_namespace,
    ensure_services,
    stop_services,
)
from eventlight.settings import MAX_PARTITIONS, Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats
from eventlight.store.jetstream.projector import ProjectorGroup

APP = "eventlight-projrate"
"""``application_name`` of the projector processes' Postgres sessions (their backends' CPU is read)."""


async def fill(settings: Settings, rollouts: int, spans: int) -> int:
    """Write the rollouts with no projector running; the stream's last sequence."""
    async with JetStreamLightningStore(settings) as writer:

        async def one(i: int) -> None:
            r = await writer.start_rollout({"i": i}, worker_id=f"w{i % 8}")
            aid = r.attempt.attempt_id
            batch = [
                Span.from_attributes(
                    attributes={"i": i, "k": k, "text": "x" * 200}, rollout_id=r.rollout_id, attempt_id=aid, name="s"
                )
                for k in range(spans)
            ]
            await writer.add_spans_numbered(r.rollout_id, aid, batch)
            await writer.update_attempt(r.rollout_id, aid, status="succeeded")

        for start in range(0, rollouts, 32):
            await asyncio.gather(*(one(i) for i in range(start, min(rollouts, start + 32))))
        assert writer.log is not None
        info = await writer.log.js.stream_info(writer.log.stream)
        return int(info.state.last_seq)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _Retries(logging.Handler):
    """Counts the projector's failed batches (each retried after 1 s), keeping their tracebacks
    off stderr; ``first``: the first one's exception."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count, self.first = 0, ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if not self.first and record.exc_info and record.exc_info[1] is not None:
            self.first = f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}".splitlines()[0]


def projector_process(settings: Settings, ready: Event, go: Event, stop: Event, out: Any) -> None:
    """One projector process: imports done, waits for ``go``, projects until ``stop``, then puts
    ``{"led": [...], "terms_led": n, "cpu_s": s, "retried": n, "first_error": str}`` (CPU from
    ``go`` to ``stop``; ``retried``: batches that failed and were retried) on ``out``."""
    retries = _Retries()
    logging.getLogger("eventlight.store.jetstream.projector.consume").addHandler(retries)
    ready.set()
    go.wait()
    cpu0 = _cpu_s()

    async def run() -> dict[str, Any]:
        async with JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn, watchdog_interval_s=3600) as store:
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)
            p = store.projector
            assert p is not None
            led = p.led if isinstance(p, ProjectorGroup) else [0] if p.leader.is_set() else []
            cpu_s = _cpu_s() - cpu0
            return {
                "led": led,
                "terms_led": p.terms_led,
                "cpu_s": cpu_s,
                "retried": retries.count,
                "first_error": retries.first,
            }

    out.put(asyncio.run(run()))


async def _fresh_schema(settings: Settings) -> None:
    conn = await asyncpg.connect(settings.pg_dsn)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{settings.pg_schema}" CASCADE')
    finally:
        await conn.close()
    assert settings.pg_dsn is not None
    await apply_migrations(settings.pg_dsn, settings.pg_schema)


async def _progress(conn: asyncpg.Connection, schema: str) -> tuple[int, int]:
    """(checkpoint rows, their lowest ``last_seq``)."""
    row = await conn.fetchrow(f'SELECT count(*), coalesce(min(last_seq), 0) FROM "{schema}".projector_checkpoint')
    assert row is not None
    return int(row[0]), int(row[1])


async def _rows(conn: asyncpg.Connection, schema: str) -> int:
    """Rows of the read model's tables: the projector's bookkeeping and the status counter (whose
    rows at count 0 depend on how the log fell into batches) left out."""
    tables = await conn.fetch(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = $1 AND table_type = 'BASE TABLE'"
        " AND table_name NOT LIKE 'projector_%' AND table_name NOT IN ('schema_migrations', 'rollout_status_counts')",
        schema,
    )
    return sum([int(await conn.fetchval(f'SELECT count(*) FROM "{schema}"."{t[0]}"')) for t in tables])


def _backend_cpu_s(pids: list[int]) -> float:
    """CPU seconds of Postgres backends by pid; 0 for those not on this machine (or not readable)."""
    total = 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if not proc.name().startswith("postgres"):
                continue  # Postgres runs elsewhere: this pid is another process
            t = proc.cpu_times()
        except psutil.Error:  # gone, or not ours to read
            continue
        total += t.user + t.system
    return float(total)


def _nats_cpu_s(pid: int | None) -> float:
    if pid is None:
        return 0.0
    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


async def one_case(
    settings: Settings, last_seq: int, partitions: int, processes: int, nats_pid: int | None, timeout_s: float
) -> dict[str, Any]:
    """P projector processes with N partitions over a fresh schema, until every partition reaches ``last_seq``."""
    assert settings.pg_dsn is not None
    await _fresh_schema(settings)
    sep = "&" if "?" in settings.pg_dsn else "?"
    child = Settings(
        nats_url=settings.nats_url,
        pg_dsn=f"{settings.pg_dsn}{sep}application_name={APP}",
        state_dir=settings.state_dir,
        namespace=settings.namespace,
        durability=settings.durability,
        projector_partitions=partitions,
    )
    ctx = mp.get_context("spawn")
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    readies = [ctx.Event() for _ in range(processes)]
    procs = [ctx.Process(target=projector_process, args=(child, r, go, stop, out), daemon=True) for r in readies]
    for p in procs:
        p.start()
    conn = await asyncpg.connect(settings.pg_dsn)
    try:
        for r in readies:
            await asyncio.get_running_loop().run_in_executor(None, r.wait, 60)
        nats0 = _nats_cpu_s(nats_pid)
        t0 = time.perf_counter()
        go.set()
        while (await _progress(conn, settings.pg_schema)) < (partitions, last_seq):
            if time.perf_counter() - t0 > timeout_s or not all(p.is_alive() for p in procs):
                raise RuntimeError(f"{partitions} partitions, {processes} processes: not caught up in {timeout_s} s")
            await asyncio.sleep(0.01)
        secs = round(time.perf_counter() - t0, 3)  # every rate below from this value
        nats_cpu = _nats_cpu_s(nats_pid) - nats0
        pids = [
            int(r[0]) for r in await conn.fetch("SELECT pid FROM pg_stat_activity WHERE application_name = $1", APP)
        ]
        pg_cpu = _backend_cpu_s(pids)  # the sessions opened after go: all their CPU is this case's
        rows = await _rows(conn, settings.pg_schema)
    finally:
        stop.set()
        await conn.close()
    reports = [out.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(10)
    return {
        "partitions": partitions,
        "processes": processes,
        "catchup_s": secs,
        "messages_per_s": round(last_seq / secs),
        "rows": rows,
        "rows_per_s": round(rows / secs),
        "led": sorted(len(r["led"]) for r in reports),
        "terms_led": sum(r["terms_led"] for r in reports),
        "retried_batches": sum(r["retried"] for r in reports),
        "first_error": next((r["first_error"] for r in reports if r["first_error"]), ""),
        "projector_cpu_s": round(sum(r["cpu_s"] for r in reports), 2),
        "postgres_cpu_s": round(pg_cpu, 2),
        "nats_cpu_s": round(nats_cpu, 2),
    }


async def measure(
    svc: Services,
    state_dir: Path,
    rollouts: int,
    spans: int,
    partitions: list[int],
    processes: list[int],
    repeat: int = 1,
    timeout_s: float = 600,
) -> dict[str, Any]:
    """Fill a fresh namespace on ``svc``'s servers, then run every case ``repeat`` times (in
    rounds) and drop the namespace; the raw result (``report`` renders it)."""
    base = Settings.from_env(state_dir=state_dir, namespace="projrate")
    settings = Settings(
        nats_url=svc.nats_url,
        pg_dsn=svc.pg_dsn,
        state_dir=state_dir,
        namespace=f"p{uuid.uuid4().hex[:8]}",
        durability=base.durability,
    )
    nc = await connect_nats(svc.nats_url)
    await apply_streams(nc, settings)
    await nc.close()
    await apply_migrations(svc.pg_dsn, settings.pg_schema)
    load_start = os.getloadavg()
    try:
        t0 = time.perf_counter()
        last = await fill(settings, rollouts, spans)
        fill_s = time.perf_counter() - t0
        cases = []
        for round_ in range(1, repeat + 1):  # rounds, not repeats in a row: the load drifts
            for n in partitions:
                for p in processes:
                    case = await one_case(settings, last, n, p, svc.nats_pid, timeout_s)
                    case["round"] = round_
                    case["spans_per_s"] = round(rollouts * spans / case["catchup_s"])
                    case["load_avg_1m"] = round(os.getloadavg()[0], 2)
                    cases.append(case)
                    print(f"  round {round_}: {n} partitions, {p} processes: {case['catchup_s']} s", flush=True)
        return {
            "durability": settings.durability,
            "cores": os.cpu_count(),
            "rollouts": rollouts,
            "spans": rollouts * spans,
            "messages": last,
            "fill_s": round(fill_s, 2),
            "load_avg_at_start": [round(x, 2) for x in load_start],
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
            "cases": cases,
        }
    finally:
        await drop_namespace(svc.nats_url, svc.pg_dsn, settings)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    """``measure`` on the configured servers, else embedded ones in a temporary state dir, removed
    (with the embedded servers' data) once they are stopped, whether the run succeeded or not."""
    state = Path(tempfile.mkdtemp(prefix="eventlight-projrate-"))
    try:
        base = Settings.from_env(state_dir=state, namespace="projrate")
        svc = await ensure_services(base)
        try:
            return await measure(
                svc, state, args.rollouts, args.spans, args.partitions, args.processes, args.repeat, args.timeout_s
            )
        finally:
            await stop_services(base)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (partitions, processes): the median round by catch-up time, with every
    round's spans/s and the failed batches of all rounds."""
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for c in result["cases"]:
        groups.setdefault((c["partitions"], c["processes"]), []).append(c)
    rows = []
    for runs in groups.values():
        ranked = sorted(runs, key=lambda c: c["catchup_s"])
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["spans_per_s_rounds"] = [c["spans_per_s"] for c in runs]
        row["retried_batches_rounds"] = sum(c["retried_batches"] for c in runs)
        rows.append(row)
    return rows


def report(result: dict[str, Any]) -> str:
    """The table: one row per (partitions, processes), the median round; CPU in µs per stream message."""

    def us(cpu_s: float) -> str:
        return f"{cpu_s * 1e6 / result['messages']:,.0f}"

    rounds = max(c["round"] for c in result["cases"])
    lines = [
        f"{result['rollouts']:,} rollouts, {result['messages']:,} messages, {result['spans']:,} spans "
        f"(filled in {result['fill_s']} s); durability {result['durability']}; {result['cores']} cores; "
        f"load average {result['load_avg_at_start'][0]:.1f} at start, {result['load_avg_at_end'][0]:.1f} at end; "
        f"median of {rounds} round{'s' if rounds > 1 else ''}",
        "",
        "| partitions | processes | partitions led | catch-up s | messages/s | spans/s (every round) | rows/s "
        "| CPU µs/message: projectors · Postgres · nats | failed batches (all rounds) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summary(result):
        every = ", ".join(f"{x:,}" for x in c["spans_per_s_rounds"])
        lines.append(
            f"| {c['partitions']} | {c['processes']} | {' + '.join(map(str, c['led']))} | {c['catchup_s']:.2f} "
            f"| {c['messages_per_s']:,} | {c['spans_per_s']:,} ({every}) | {c['rows_per_s']:,} "
            f"| {us(c['projector_cpu_s'])} · {us(c['postgres_cpu_s'])} · {us(c['nats_cpu_s'])} "
            f"| {c['retried_batches_rounds']} |"
        )
    errors = sorted({c["first_error"] for c in result["cases"] if c["first_error"]})
    if errors:
        lines += ["", "failed batches (retried after 1 s each): " + "; ".join(errors)]
    return "\n".join(lines)


def partition_counts(text: str) -> list[int]:
    """An argparse type: ``"1,2,4"`` -> ``[1, 2, 4]``, each 1 to ``MAX_PARTITIONS`` (what a namespace takes)."""
    values = positive_ints(text)
    if any(v > MAX_PARTITIONS for v in values):
        raise argparse.ArgumentTypeError(f"expected partition counts 1 to {MAX_PARTITIONS}, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.projector_rate", description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=1000)
    ap.add_argument("--spans", type=int, default=20, help="spans per rollout, one batch")
    ap.add_argument(
        "--partitions",
        type=partition_counts,
        default=[1, 2, 4],
        help=f"partition counts, each 1 to {MAX_PARTITIONS}, e.g. 1,2,4",
    )
    ap.add_argument("--processes", type=positive_ints, default=[1, 2], help="projector process counts, e.g. 1,2")
    ap.add_argument("--repeat", type=int, default=1, help="rounds of every case (the table shows the median)")
    ap.add_argument("--timeout-s", type=float, default=600, help="limit of each case's catch-up")
    ap.add_argument("--out", type=Path, default=None, help="also write the raw result as JSON here")
    args = ap.parse_args(argv)
    require_positive(ap, args, "rollouts", "spans", "repeat", "timeout_s")
    bench_durability()  # fsync or interval (EVENTLIGHT_DURABILITY), refused otherwise
    result = asyncio.run(main_async(args))
    print_and_save(report(result), result, args.out)


if __name__ == "__main__":
    main()
