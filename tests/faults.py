"""What the fault suites share: servers of their own, a workload, and the checks made afterwards.

Every server here is started by the test on a free loopback port in a temporary folder and killed by
it; the machine's own NATS and Postgres are never stopped. Every loop is bounded in count and time.
``EVENTLIGHT_FAULT_KILLS`` scales the number of kills (default: a few, for ``make test``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from eventlight.core.errors import ConcurrencyError, ServiceUnavailableError
from eventlight.core.types import Span
from eventlight.ops import apply_migrations, apply_streams, drop_namespace
from eventlight.ops.nats_server import _nats_binary
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats

KILLS = int(os.environ.get("EVENTLIGHT_FAULT_KILLS", "3"))
"""Kills per fault loop (CI default small; raise it for a longer soak)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NatsServer:
    """A nats-server of the test's own, on loopback, with a file store that survives kill -9."""

    def __init__(self, home: Path, *, cluster: tuple[str, int, list[int]] | None = None):
        self.home = home
        self.port = free_port()
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None
        home.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _conf(self) -> Path:
        conf = self.home / "nats.conf"
        text = (
            f"listen: 127.0.0.1:{self.port}\nserver_name: n{self.port}\n"
            f'jetstream {{\n  store_dir: "{self.home / "js"}"\n  sync_interval: always\n}}\nmax_payload: 8MB\n'
        )
        if self.cluster is not None:
            name, port, peers = self.cluster
            routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in peers)
            text += f"cluster {{\n  name: {name}\n  listen: 127.0.0.1:{port}\n  routes: [{routes}]\n}}\n"
        conf.write_text(text)
        return conf

    def start(self) -> None:
        out = open(self.home / "nats.out", "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen([_nats_binary(), "-c", str(self._conf())], stdout=out, stderr=out)

    async def ready(self, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                _, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.close()
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"nats-server on {self.port} did not start")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill9()


class Relay:
    """A TCP relay on a free loopback port to the server of ``url`` (a NATS URL or a Postgres DSN):
    ``cut()`` stops listening and drops every connection through it, as a server that went away
    (the server itself, maybe the machine's own, goes on); ``mend()`` listens again on that port.

    ``url``: the same URL with the relay's address, for the clients under test."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.target = (parts.hostname or "127.0.0.1", parts.port or (4222 if parts.scheme == "nats" else 5432))
        self.port = free_port()
        userinfo = parts.netloc.rpartition("@")[0]
        self.url = urlunsplit(parts._replace(netloc=f"{userinfo}@127.0.0.1:{self.port}".lstrip("@")))
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def mend(self) -> None:
        self._server = await asyncio.start_server(self._link, "127.0.0.1", self.port)

    def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def _link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


@contextlib.asynccontextmanager
async def namespace_on(nats_url: str, pg_dsn: str, replicas: int = 1) -> AsyncIterator[Settings]:
    """A fresh namespace (stream + schema) on the given servers, dropped afterwards."""
    settings = Settings(
        nats_url=nats_url,
        pg_dsn=pg_dsn,
        namespace=f"f{uuid.uuid4().hex[:10]}",
        stream_replicas=replicas if replicas > 1 else None,
    )
    nc = await connect_nats(nats_url)
    try:
        await apply_streams(nc, settings)
    finally:
        await nc.close()
    await apply_migrations(pg_dsn, settings.pg_schema)
    try:
        yield settings
    finally:
        with contextlib.suppress(Exception):
            await drop_namespace(nats_url, pg_dsn, settings)


@dataclass
class Ledger:
    """What the workload was told was written (acknowledged), to check against the log afterwards."""

    rollouts: dict[str, int] = field(default_factory=dict)  # rollout id -> spans acknowledged
    finished: set[str] = field(default_factory=set)
    failures: int = 0


RETRYABLE = (ServiceUnavailableError, ConcurrencyError, OSError, TimeoutError)


async def retry(fn: Any, ledger: Ledger, deadline: float) -> Any:
    """Call ``fn`` until it succeeds (a fault may fail some calls), bounded by ``deadline``."""
    while True:
        try:
            return await fn()
        except RETRYABLE:
            ledger.failures += 1
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


def make_spans(rid: str, aid: str, n: int, tag: str) -> list[Span]:
    return [
        Span.from_attributes(attributes={"k": k, "tag": tag}, rollout_id=rid, attempt_id=aid, name=f"s{k}")
        for k in range(n)
    ]


async def one_rollout(store: JetStreamLightningStore, i: int, ledger: Ledger, deadline: float, spans: int) -> None:
    """A runner's life of one rollout: start, two span batches, succeed; each step retried on a fault
    (a span batch by ``add_many_spans`` with fixed ids, so a retried batch cannot be stored twice)."""
    r = await retry(lambda: store.start_rollout({"i": i}, worker_id=f"w{i % 4}"), ledger, deadline)
    rid, aid = r.rollout_id, r.attempt.attempt_id
    ledger.rollouts[rid] = 0
    for b in range(2):
        batch = make_spans(rid, aid, spans, f"{i}-{b}")
        for k, s in enumerate(batch):
            s.sequence_id, s.span_id = b * spans + k + 1, f"{i:06x}{b:02x}{k:08x}"
        await retry(lambda batch=batch: store.add_many_spans(batch), ledger, deadline)
        ledger.rollouts[rid] += spans
    await retry(lambda: store.update_attempt(rid, aid, status="succeeded"), ledger, deadline)
    ledger.finished.add(rid)


async def workload(
    store: JetStreamLightningStore, ledger: Ledger, n: int, spans: int = 5, concurrency: int = 8, limit_s: float = 60
) -> None:
    deadline = time.monotonic() + limit_s
    sem = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> None:
        async with sem:
            await one_rollout(store, i, ledger, deadline, spans)

    await asyncio.gather(*(guarded(i) for i in range(n)))


async def stream_last_seq(store: JetStreamLightningStore) -> int:
    info = await store.log.js.stream_info(store.log.stream)
    return int(info.state.last_seq)


async def checkpoint(dsn: str, schema: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(f'SELECT min(last_seq) FROM "{schema}".projector_checkpoint'))
    finally:
        await conn.close()


async def wait_projected(dsn: str, schema: str, seq: int, timeout_s: float = 60) -> float:
    """Seconds until the checkpoint in ``schema`` reaches ``seq``."""
    t0 = time.monotonic()
    conn = await asyncpg.connect(dsn)
    try:
        while (await conn.fetchval(f'SELECT min(last_seq) FROM "{schema}".projector_checkpoint')) < seq:
            assert time.monotonic() - t0 < timeout_s, f"the projection did not reach {seq} in {timeout_s} s"
            await asyncio.sleep(0.05)
    finally:
        await conn.close()
    return time.monotonic() - t0


@dataclass
class Verdict:
    events: int
    lost: int
    doubled: int
    stuck: int
    spans: int


async def check_log_and_read_model(store: JetStreamLightningStore, settings: Settings, ledger: Ledger) -> Verdict:
    """After a fault run: every acknowledged rollout is in the log once with its spans, none stored
    twice, every finished one is terminal, and the read model equals a fresh rebuild of the log."""
    from test_rebuild import TABLES, rebuild, table

    assert settings.pg_dsn is not None
    last = await stream_last_seq(store)
    created: dict[str, int] = {}
    span_ids: dict[str, list[str]] = {}
    async for _, event in store.log.read(0):
        tag = type(event).__struct_config__.tag
        if tag == "rollout_created":
            created[event.rollout.rollout_id] = created.get(event.rollout.rollout_id, 0) + 1
        elif tag == "spans_added":
            span_ids.setdefault(event.rollout_id, []).extend(s.span_id for s in event.spans)
    lost = sum(1 for rid in ledger.rollouts if rid not in created)
    doubled = sum(1 for n in created.values() if n > 1)
    conn = await asyncpg.connect(settings.pg_dsn)
    try:
        rows = await conn.fetch(f'SELECT rollout_id, count(*) AS n FROM "{settings.pg_schema}".spans GROUP BY 1')
        projected = {r["rollout_id"]: r["n"] for r in rows}
        statuses = dict(await conn.fetch(f'SELECT rollout_id, status FROM "{settings.pg_schema}".rollouts'))
    finally:
        await conn.close()
    for rid, n in ledger.rollouts.items():  # acknowledged spans are projected once each
        if projected.get(rid, 0) < n:
            lost += 1
        if len(set(span_ids.get(rid, []))) != projected.get(rid, 0):
            doubled += 1
    stuck = sum(1 for rid in ledger.finished if statuses.get(rid) != "succeeded")
    fresh = f"{settings.pg_schema}_rebuilt"
    try:
        assert await rebuild(store, fresh, settings.pg_dsn) == last
        conn = await asyncpg.connect(settings.pg_dsn)
        try:
            for name in TABLES:
                live, rebuilt = await table(conn, settings.pg_schema, name), await table(conn, fresh, name)
                assert live == rebuilt, f"{name}: the live read model differs from a rebuild of the log"
        finally:
            await conn.close()
    finally:
        conn = await asyncpg.connect(settings.pg_dsn)
        try:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{fresh}" CASCADE')
        finally:
            await conn.close()
    return Verdict(events=last, lost=lost, doubled=doubled, stuck=stuck, spans=sum(projected.values()))


def spawn_projector(settings: Settings) -> subprocess.Popen[bytes]:
    """A projector in its own process (``tests/fault_projector.py``), to be killed with SIGKILL."""
    env = {
        **os.environ,
        "EL_FAULT_NATS": settings.nats_url or "",
        "EL_FAULT_PG": settings.pg_dsn or "",
        "EL_FAULT_NS": settings.namespace,
        "EL_FAULT_PARTITIONS": str(settings.projector_partitions),
    }
    script = Path(__file__).with_name("fault_projector.py")
    return subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def seeded(seed: int) -> random.Random:
    return random.Random(seed)
