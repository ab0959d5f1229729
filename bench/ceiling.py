"""The ceiling: what raw JetStream publishing, consuming and Postgres COPY reach for the workload's
event mix on this machine, in the same run, without eventlight's store in the way.

    python -m bench.ceiling [--spans 14,39] [--seconds 2] [--out F]

Runs in eventlight's venv against freshly started embedded servers (the same nats-server config as
eventlight, ``sync_interval: always``, and the same Postgres), with nats-py, msgspec and asyncpg
directly. One rollout is 5 small events (~300 B) plus ``S`` spans whose attributes come from the
workload's generator, all spans of a rollout in one message (the most favourable batching). For
each ``S`` it measures, one phase after another:

* ``publish``: pipelined ``js.publish_async`` (window 1024) for ``--seconds``, then waits for every
  ack; rollouts/s = rollouts published / time until the last ack;
* ``consume``: a durable pull consumer (ack policy *all*) fetches and msgspec-decodes all of them;
* ``copy``: ``COPY`` of the decoded rows (5 event rows and ``S`` span rows per rollout, span rows
  shaped like the ``spans`` read model, with its lz4 TOAST compression) in transactions of ~1000 rows.

It also sums the CPU of every process (this one, nats-server, Postgres) per phase. The ceiling is
``min(publish, consume, copy, cores / CPU seconds per rollout of all three phases)``: no stage can go
faster than it does alone, and all stages together cannot use more than the machine's cores. It
is an upper bound for any store on these servers that persists every event and span durably in
both NATS and Postgres, not a target a Python store can reach.

``round_trips`` measures the server round trips single store operations are made of (the micro
benchmarks call it on eventlight's own servers, right after their operations).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import nats
from nats.js.api import AckPolicy, ConsumerConfig, StorageType, StreamConfig

from bench import bench_durability, positive_ints, require_positive, write_json
from bench.procs import ProcessSampler
from bench.workload import SCENARIOS, expected_spans_per_rollout, random_attributes

WINDOW = 1024
COPY_ROWS = 1000
EVENTS_PER_ROLLOUT = 5
SELECT_SPANS = 20  # as bench.micro's query_spans

SPAN_COLUMNS = [
    "rollout_id",
    "attempt_id",
    "span_id",
    "sequence_id",
    "trace_id",
    "parent_id",
    "name",
    "status",
    "attributes",
    "events",
    "links",
    "start_time",
    "end_time",
    "context",
    "parent",
    "resource",
    "stream_seq",
]
EVENT_COLUMNS = ["stream_seq", "rollout_id", "kind", "body"]

DDL = """
CREATE TABLE {s}.events (stream_seq bigint PRIMARY KEY, rollout_id text NOT NULL, kind text NOT NULL,
                         body jsonb NOT NULL);
CREATE TABLE {s}.spans (
    rollout_id text NOT NULL, attempt_id text NOT NULL, span_id text NOT NULL, sequence_id integer NOT NULL,
    trace_id text NOT NULL, parent_id text, name text NOT NULL, status jsonb NOT NULL, attributes jsonb NOT NULL,
    events jsonb NOT NULL, links jsonb NOT NULL, start_time double precision, end_time double precision,
    context jsonb, parent jsonb, resource jsonb NOT NULL, stream_seq bigint NOT NULL,
    PRIMARY KEY (rollout_id, attempt_id, span_id));
CREATE INDEX ON {s}.spans (rollout_id, sequence_id, stream_seq);
"""
# the read models' TOAST compression (migrations/003_lz4_compression.sql), where the server has lz4
LZ4 = """
ALTER TABLE {s}.events ALTER COLUMN body SET COMPRESSION lz4;
ALTER TABLE {s}.spans ALTER COLUMN status SET COMPRESSION lz4, ALTER COLUMN attributes SET COMPRESSION lz4,
  ALTER COLUMN events SET COMPRESSION lz4, ALTER COLUMN links SET COMPRESSION lz4,
  ALTER COLUMN context SET COMPRESSION lz4, ALTER COLUMN parent SET COMPRESSION lz4,
  ALTER COLUMN resource SET COMPRESSION lz4;
"""


def default_span_counts() -> list[int]:
    """``S`` of every scenario: the mean spans per rollout, rounded."""
    return sorted({round(expected_spans_per_rollout(s.max_rounds)) for s in SCENARIOS.values()})


def _small_event(rid: str, k: int) -> bytes:
    return msgspec.json.encode(
        {
            "type": ["RolloutCreated", "AttemptStarted", "AttemptUpdated", "AttemptUpdated", "RolloutUpdated"][k],
            "v": 1,
            "time": time.time(),
            "rollout_id": rid,
            "attempt_id": "at-0123abcd",
            "worker_id": "Worker-3",
            "status": "running",
            "metadata": {"k": "x" * 120},
        }
    )


def _spans(rid: str, count: int, attrs: list[dict[str, str]]) -> bytes:
    spans = []
    for i in range(count):
        sid = uuid.uuid4().hex[:16]
        spans.append(
            {
                "rollout_id": rid,
                "attempt_id": "at-0123abcd",
                "sequence_id": i + 1,
                "trace_id": uuid.uuid4().hex,
                "span_id": sid,
                "parent_id": None,
                "name": f"round{i}_1",
                "status": {"status_code": "OK", "description": None},
                "attributes": attrs[i % len(attrs)],
                "events": [],
                "links": [],
                "start_time": time.time(),
                "end_time": time.time(),
                "context": {"trace_id": "0" * 32, "span_id": sid, "is_remote": False, "trace_state": {}},
                "parent": None,
                "resource": {"attributes": {"service.name": "bench"}, "schema_url": ""},
            }
        )
    return msgspec.json.encode({"type": "SpansAdded", "rollout_id": rid, "spans": spans})


class _Phase:
    def __init__(self, sampler: ProcessSampler):
        self.sampler = sampler

    def __enter__(self) -> _Phase:
        self.sampler.open_window()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.t0
        self.cpu_s = self.sampler.close_window()["cpu_s"]["total"]


async def _probe(nc: Any, pg: asyncpg.Connection, sampler: ProcessSampler, s: int, seconds: float) -> dict[str, Any]:
    js = nc.jetstream(timeout=30.0, publish_async_max_pending=WINDOW)
    tag = uuid.uuid4().hex[:8]
    stream, prefix = f"CEIL_{tag.upper()}", f"ceil.{tag}"
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{prefix}.>"], storage=StorageType.FILE))
    rng = random.Random(s)
    attrs = [random_attributes(rng) for _ in range(64)]
    out: dict[str, Any] = {"spans_per_rollout": s}
    try:
        # publish
        n = 0
        with _Phase(sampler) as ph:
            deadline = time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                rid = f"ro-{tag}{n:08d}"
                for k in range(EVENTS_PER_ROLLOUT):
                    await js.publish_async(f"{prefix}.r.{rid}", _small_event(rid, k))
                await js.publish_async(f"{prefix}.s.{rid}", _spans(rid, s, attrs))
                n += 1
            await js.publish_async_completed()
        out["publish"] = _rates(n, s, ph)
        out["message_bytes_spans"] = len(_spans("ro-x", s, attrs))
        # consume
        total = n * (EVENTS_PER_ROLLOUT + 1)
        decoded: list[tuple[int, Any]] = []
        cfg = ConsumerConfig(durable_name="ceiling", ack_policy=AckPolicy.ALL, max_ack_pending=20000)
        psub = await js.pull_subscribe(f"{prefix}.>", durable="ceiling", stream=stream, config=cfg)
        with _Phase(sampler) as ph:
            while len(decoded) < total:
                msgs = await psub.fetch(256, timeout=5)
                decoded.extend((m.metadata.sequence.stream, msgspec.json.decode(m.data)) for m in msgs)
                await msgs[-1].ack()
        out["consume"] = _rates(n, s, ph)
        # copy
        schema = f"ceil_{tag}"
        await pg.execute(f"CREATE SCHEMA {schema}")
        await pg.execute(DDL.format(s=schema))
        with contextlib.suppress(asyncpg.FeatureNotSupportedError, asyncpg.PostgresSyntaxError):
            await pg.execute(LZ4.format(s=schema))
        with _Phase(sampler) as ph:
            events: list[tuple[Any, ...]] = []
            spans: list[tuple[Any, ...]] = []
            for seq, body in decoded:
                if body["type"] == "SpansAdded":
                    spans.extend(_span_row(sp, seq) for sp in body["spans"])
                else:
                    events.append((seq, body["rollout_id"], body["type"], msgspec.json.encode(body).decode()))
                if len(events) + len(spans) >= COPY_ROWS:
                    await _copy(pg, schema, events, spans)
                    events, spans = [], []
            await _copy(pg, schema, events, spans)
        out["copy"] = _rates(n, s, ph)
        await pg.execute(f"DROP SCHEMA {schema} CASCADE")
    finally:
        await js.delete_stream(stream)
    return out


def _span_row(sp: dict[str, Any], seq: int) -> tuple[Any, ...]:
    enc = msgspec.json.encode
    return (
        sp["rollout_id"],
        sp["attempt_id"],
        sp["span_id"],
        sp["sequence_id"],
        sp["trace_id"],
        sp["parent_id"],
        sp["name"],
        enc(sp["status"]).decode(),
        enc(sp["attributes"]).decode(),
        "[]",
        "[]",
        sp["start_time"],
        sp["end_time"],
        enc(sp["context"]).decode(),
        None,
        enc(sp["resource"]).decode(),
        seq,
    )


async def _copy(pg: asyncpg.Connection, schema: str, events: list[Any], spans: list[Any]) -> None:
    async with pg.transaction():
        if events:
            await pg.copy_records_to_table("events", schema_name=schema, records=events, columns=EVENT_COLUMNS)
        if spans:
            await pg.copy_records_to_table("spans", schema_name=schema, records=spans, columns=SPAN_COLUMNS)


def _rates(n: int, s: int, ph: _Phase) -> dict[str, Any]:
    return {
        "rollouts": n,
        "seconds": round(ph.elapsed, 3),
        "rollouts_per_s": round(n / ph.elapsed, 1),
        "spans_per_s": round(n * s / ph.elapsed, 1),
        "cpu_s_per_rollout": round(ph.cpu_s / max(1, n), 6),
    }


def _combine(p: dict[str, Any], cores: int) -> dict[str, Any]:
    stages = [p[k]["rollouts_per_s"] for k in ("publish", "consume", "copy")]
    cpu = sum(p[k]["cpu_s_per_rollout"] for k in ("publish", "consume", "copy"))
    cpu_bound = cores / cpu if cpu > 0 else float("inf")
    ceiling = min([*stages, cpu_bound])
    serial = 1 / sum(1 / r for r in stages)
    return {
        "cpu_s_per_rollout": round(cpu, 6),
        "cpu_bound_rollouts_per_s": round(cpu_bound, 1),
        "serial_rollouts_per_s": round(serial, 1),
        "ceiling_rollouts_per_s": round(ceiling, 1),
        "ceiling_spans_per_s": round(ceiling * p["spans_per_rollout"], 1),
    }


async def round_trips(
    nats_url: str, pg_dsn: str, sampler: ProcessSampler, concurrency: int, seconds: float
) -> dict[str, Any]:
    """Requests per second, with ``concurrency`` tasks each waiting for its answer before the next
    request, for ``seconds`` each, by nats-py and asyncpg alone (no store), on these servers:

    * ``publish``: ``js.publish`` of one ~300 B event on a subject of its own, with a
      ``Nats-Msg-Id``, until the server's ack: one fsynced append (``sync_interval: always``);
    * ``pull``: a ``no_wait`` pull request to an empty filtered consumer, until its answer;
    * ``pg_select``: ``SELECT`` of one rollout's 20 span rows (the workload's attributes) by id.

    Works in a stream and a schema of its own, removed afterwards. ``bench.report`` chains them into
    each micro operation's raw rate (``MICRO_ROUND_TRIPS``).
    """
    nc = await nats.connect(nats_url)
    pg = await asyncpg.connect(pg_dsn)
    try:
        return await _round_trips(nc, pg, pg_dsn, sampler, concurrency, seconds)
    finally:
        await pg.close()
        await nc.close()


async def _round_trips(
    nc: Any, pg: asyncpg.Connection, pg_dsn: str, sampler: ProcessSampler, concurrency: int, seconds: float
) -> dict[str, Any]:
    js = nc.jetstream(timeout=30.0)
    tag = uuid.uuid4().hex[:8]
    stream, prefix, schema = f"RT_{tag.upper()}", f"rt.{tag}", f"rt_{tag}"
    await js.add_stream(StreamConfig(name=stream, subjects=[f"{prefix}.>"], storage=StorageType.FILE))
    await js.add_consumer(
        stream, ConsumerConfig(durable_name="runners", ack_policy=AckPolicy.EXPLICIT, filter_subject=f"{prefix}.r.*.q")
    )
    await pg.execute(f"CREATE SCHEMA {schema}")
    pool = None
    try:
        await pg.execute(DDL.format(s=schema))
        with contextlib.suppress(asyncpg.FeatureNotSupportedError, asyncpg.PostgresSyntaxError):
            await pg.execute(LZ4.format(s=schema))
        rng = random.Random(5)
        attrs = [random_attributes(rng) for _ in range(SELECT_SPANS)]
        body = msgspec.json.decode(_spans("ro-select", SELECT_SPANS, attrs))
        await _copy(pg, schema, [], [_span_row(sp, 1) for sp in body["spans"]])
        pool = await asyncpg.create_pool(pg_dsn, min_size=concurrency, max_size=concurrency)
        event = _small_event("ro-x", 0)
        pull_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.runners"
        select = f"SELECT * FROM {schema}.spans WHERE rollout_id = $1 ORDER BY sequence_id"

        async def publish(w: int, k: int) -> None:
            await js.publish(f"{prefix}.x.{w}-{k}", event, headers={"Nats-Msg-Id": f"{tag}-{w}-{k}"})

        async def pull(w: int, k: int) -> None:
            await nc.request(pull_subject, b'{"batch":1,"no_wait":true}', timeout=10)

        async def pg_select(w: int, k: int) -> None:
            async with pool.acquire() as conn:  # type: ignore[union-attr]
                if len(await conn.fetch(select, "ro-select")) != SELECT_SPANS:
                    raise RuntimeError("pg_select found the wrong number of rows")

        out: dict[str, Any] = {"concurrency": concurrency}
        for name, op in (("publish", publish), ("pull", pull), ("pg_select", pg_select)):
            with _Phase(sampler) as ph:
                n = await _closed_loop(op, concurrency, seconds)
            out[name] = {
                "ops_per_s": round(n / ph.elapsed, 1),
                "cpu_us_per_op": round(ph.cpu_s / max(1, n) * 1e6, 1),
            }
        return out
    finally:
        if pool is not None:
            await pool.close()
        await pg.execute(f"DROP SCHEMA {schema} CASCADE")
        await js.delete_stream(stream)


async def _closed_loop(op: Any, concurrency: int, seconds: float) -> int:
    """Run ``op(task, k)`` back to back in ``concurrency`` tasks for ``seconds``; how many finished."""
    done = 0
    deadline = time.perf_counter() + seconds

    async def task(w: int) -> None:
        nonlocal done
        k = 0
        while time.perf_counter() < deadline:
            await op(w, k)
            k += 1
            done += 1

    await asyncio.gather(*(task(w) for w in range(concurrency)))
    return done


async def run_ceiling(span_counts: list[int], seconds: float) -> dict[str, Any]:
    """Start embedded servers in a temporary state dir, probe each ``S``, stop them; never raises."""
    from eventlight.ops import ensure_services, stop_services
    from eventlight.settings import Settings

    cores = os.cpu_count() or 1
    result: dict[str, Any] = {"ok": False, "error": None, "cores": cores, "seconds_per_phase": seconds, "by_spans": {}}
    state = Path(tempfile.mkdtemp(prefix="elceiling-", dir=tempfile.gettempdir()))
    os.chmod(state, 0o755)
    settings = Settings(state_dir=state, namespace="ceiling", log_level="WARNING", durability=bench_durability())  # type: ignore[arg-type]
    sampler = ProcessSampler(0.5, own_role="client").start()
    sampler.add("client", os.getpid())
    try:
        svc = await ensure_services(settings)
        for pid in (svc.nats_pid, svc.pg_pid):
            if pid is not None:
                sampler.add("servers", pid)
        result["servers"] = {"pg_kind": svc.pg_kind, "nats": f"embedded, durability {settings.durability}"}
        nc = await nats.connect(svc.nats_url)
        pg = await asyncpg.connect(svc.pg_dsn)
        try:
            for s in span_counts:
                p = await _probe(nc, pg, sampler, s, seconds)
                p.update(_combine(p, cores))
                result["by_spans"][str(s)] = p
        finally:
            await pg.close()
            await nc.close()
        result["ok"] = True
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        sampler.stop()
        try:
            await stop_services(settings)
        finally:
            shutil.rmtree(state, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--spans", type=positive_ints, default=default_span_counts(), help="spans per rollout, e.g. 14,39"
    )
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    require_positive(parser, args, "seconds")
    import uvloop

    result = uvloop.run(run_ceiling(args.spans, args.seconds))
    write_json(result, args.out)


if __name__ == "__main__":
    main()
