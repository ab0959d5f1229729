"""Postgres taking no connection now ("too many clients"): opening waits it out, then says so in one
line; an open store's pool logs no traceback while its connections are lost and refused.

Each test gets a login role of its own with every privilege on the test's schema (``role_of``),
refused by Postgres with "too many connections for role" while its ``CONNECTION LIMIT`` is 0 (a
superuser is exempt from the limit, so the test itself lifts it); the role is dropped afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import AsyncIterator, Iterator

import asyncpg
import msgspec
import pytest

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.ops import apply_migrations
from eventlight.ops.lifecycle import configured_pg
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from tests.conftest import as_role, role_of

OPEN_LOGGER = "eventlight.store.jetstream.pg_open"


class LimitedRole:
    """A role limited to ``limit`` connections (``set_limit``), with a DSN holding its password."""

    def __init__(self, settings: Settings, admin: asyncpg.Connection, name: str):
        self.settings = settings
        self.admin = admin
        self.name = name
        self.host = urllib.parse.urlsplit(settings.pg_dsn or "").hostname or ""

    async def set_limit(self, limit: int) -> None:
        await self.admin.execute(f'ALTER ROLE "{self.name}" CONNECTION LIMIT {int(limit)}')


@pytest.fixture
async def limited(namespace: Settings) -> AsyncIterator[LimitedRole]:
    assert namespace.pg_dsn is not None
    async with role_of(namespace, "s3cret", prefix="busy", limit=0) as name:
        settings = Settings(
            nats_url=namespace.nats_url,
            pg_dsn=as_role(namespace.pg_dsn, name, "s3cret"),
            state_dir=namespace.state_dir,
            namespace=namespace.namespace,
        )
        admin = await asyncpg.connect(namespace.pg_dsn)
        try:
            yield LimitedRole(settings, admin, name)
        finally:
            await admin.close()


class _Warnings(logging.Handler):
    """The warning lines of ``pg_open``; ``first`` is set by the first one."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self.first = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.first.set()


@pytest.fixture
def warnings_() -> Iterator[_Warnings]:
    handler = _Warnings()
    logger = logging.getLogger(OPEN_LOGGER)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


async def _first_warning_or_end(warned: _Warnings, opening: asyncio.Task[object]) -> None:
    """Return once a warning was logged; fail if ``opening`` ended first (it did not wait)."""
    waiting = asyncio.ensure_future(warned.first.wait())
    await asyncio.wait({waiting, opening}, return_when=asyncio.FIRST_COMPLETED)
    waiting.cancel()
    if not warned.first.is_set():
        why = opening.exception() if not opening.cancelled() else "cancelled"
        pytest.fail(f"it did not wait for Postgres to take a connection: {why!r}")


async def test_a_store_opened_while_postgres_has_no_free_connection_waits_for_one(
    limited: LimitedRole, warnings_: _Warnings
) -> None:
    store = JetStreamLightningStore(limited.settings, pg_dsn=limited.settings.pg_dsn)
    opening = asyncio.ensure_future(store.start())
    try:
        await _first_warning_or_end(warnings_, opening)
        await limited.set_limit(-1)
        await opening
        rollout = await store.enqueue_rollout({"q": 1})
        await store.sync()
        assert [r.rollout_id for r in (await store.query_rollouts()).items] == [rollout.rollout_id]
    finally:
        opening.cancel()
        await asyncio.gather(opening, return_exceptions=True)
        await store.close()
    line = warnings_.records[0].getMessage()
    assert "too many connections" in line and limited.host in line and "s3cret" not in line
    assert "\n" not in line and warnings_.records[0].exc_info is None


async def test_a_store_that_gets_no_connection_in_time_says_so_in_one_line(
    limited: LimitedRole, warnings_: _Warnings
) -> None:
    settings = Settings(
        nats_url=limited.settings.nats_url,
        pg_dsn=limited.settings.pg_dsn,
        namespace=limited.settings.namespace,
        pg_open_wait_s=0.6,
    )
    store = JetStreamLightningStore(settings, pg_dsn=settings.pg_dsn)
    with pytest.raises(ServiceUnavailableError) as info:
        await store.start()
    await store.close()
    text = str(info.value)
    assert "\n" not in text and "s3cret" not in text
    assert limited.host in text and "too many connections" in text and "EVENTLIGHT_PG_OPEN_WAIT_S" in text
    assert isinstance(info.value.__cause__, asyncpg.TooManyConnectionsError)
    assert warnings_.records, "no warning line before giving up"
    assert all("\n" not in r.getMessage() and r.exc_info is None for r in warnings_.records)
    assert store.nc is not None and store.nc.is_closed  # nothing half-open left behind


async def test_a_store_that_is_refused_otherwise_fails_at_once(limited: LimitedRole, warnings_: _Warnings) -> None:
    """Only "takes no connection now" is waited out: a database that does not exist is not."""
    parts = urllib.parse.urlsplit(limited.settings.pg_dsn or "")
    dsn = urllib.parse.urlunsplit(parts._replace(path="/no_such_database_here"))
    await limited.set_limit(-1)
    store = JetStreamLightningStore(limited.settings, pg_dsn=dsn)
    with pytest.raises(ServiceUnavailableError) as info:
        await store.start()
    await store.close()
    assert isinstance(info.value.__cause__, asyncpg.InvalidCatalogNameError)
    assert not warnings_.records


async def test_migrations_wait_for_a_connection(limited: LimitedRole, warnings_: _Warnings) -> None:
    dsn = limited.settings.pg_dsn or ""
    applying = asyncio.ensure_future(apply_migrations(dsn, limited.settings.pg_schema))
    try:
        await _first_warning_or_end(warnings_, applying)
        await limited.set_limit(-1)
        assert await applying == []  # the schema is migrated already: nothing to apply, no error
    finally:
        applying.cancel()
        await asyncio.gather(applying, return_exceptions=True)


async def test_a_configured_postgres_with_no_free_connection_is_used_not_replaced(limited: LimitedRole) -> None:
    """A "too many clients" answer counts: the configured server is there, and the data must go there,
    not to the embedded Postgres that ``ensure_services`` falls back to when nothing answers."""
    found = await configured_pg(limited.settings, limited.settings.state_dir)
    assert found is not None and found.dsn == limited.settings.pg_dsn and found.kind == "external"


def test_the_wait_is_a_setting_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().pg_open_wait_s == 30.0
    monkeypatch.setenv("EVENTLIGHT_PG_OPEN_WAIT_S", "2.5")
    assert Settings.from_env().pg_open_wait_s == 2.5
    for bad in ("-1", "nan", "inf"):
        monkeypatch.setenv("EVENTLIGHT_PG_OPEN_WAIT_S", bad)
        with pytest.raises(InvalidInputError, match="EVENTLIGHT_PG_OPEN_WAIT_S"):
            Settings.from_env()


class _Records(logging.Handler):
    """Every record at WARNING or above; ``seen(text)`` is set once a message holds ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self.text = text
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if self.text in record.getMessage():
            self.seen.set()


async def test_an_open_store_whose_connections_are_lost_and_refused_logs_no_traceback(limited: LimitedRole) -> None:
    """asyncpg's pool kept a floor of one open connection and, once it was lost, reopened it in a
    task of its own that logged each failed try with its whole traceback ("Failed to restore the
    pool connection floor; retrying"). Now the next call that needs a connection opens it, and the
    store reports what fails in its own lines (the projector: one line a try)."""
    await limited.set_limit(-1)
    records = _Records("retrying in 1.0 s")  # the projector's second try: the floor's first was before
    root = logging.getLogger()
    root.addHandler(records)
    try:
        async with JetStreamLightningStore(limited.settings, pg_dsn=limited.settings.pg_dsn) as store:
            await store.enqueue_rollout({"q": 1})
            await store.sync()
            await limited.set_limit(0)
            await limited.admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", limited.name
            )
            await asyncio.wait_for(records.seen.wait(), 60)
            await limited.set_limit(-1)
            await store.sync_all()
    finally:
        root.removeHandler(records)
    tracebacks = [f"{r.name}: {r.getMessage()}" for r in records.records if r.exc_info]
    assert not tracebacks


async def test_a_trainer_on_given_servers_waits_as_its_settings_say(limited: LimitedRole, warnings_: _Warnings) -> None:
    """``AGL_MANAGED_STORE=0``: the Trainer applies the namespace's migrations itself. README says
    its wait is ``EVENTLIGHT_PG_OPEN_WAIT_S`` (``Settings.pg_open_wait_s``); it waited the default
    30 s whatever that said. Told not to wait (0), it fails at once, with no warning line."""
    import contextlib

    from eventlight.execution import ClientServerExecutionStrategy
    from eventlight.trainer import Trainer

    settings = msgspec.structs.replace(limited.settings, pg_open_wait_s=0)
    trainer = Trainer(strategy=ClientServerExecutionStrategy(managed_store=False), settings=settings)
    async with contextlib.AsyncExitStack() as run:
        opening = asyncio.ensure_future(trainer._services(trainer._cs(), run))
        try:
            waiting = asyncio.ensure_future(warnings_.first.wait())
            await asyncio.wait({waiting, opening}, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            assert not warnings_.records, "it waited for a connection though pg_open_wait_s=0"
            with pytest.raises(ServiceUnavailableError, match="too many connections"):
                await opening
        finally:
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)


async def test_cli_commands_wait_for_a_connection(limited: LimitedRole, warnings_: _Warnings) -> None:
    """``eventlight sql`` / ``status`` / ``replay`` find Postgres (``find_pg``) and connect to the
    namespace's schema (``_connect_pg``): a configured server that answers "too many connections"
    is there, and both the connection and the migrations wait for room as a store does. They failed
    at once ("answered but takes no connection now")."""
    from eventlight.cli.discovery import _connect_pg

    connecting = asyncio.ensure_future(_connect_pg(limited.settings))
    try:
        await _first_warning_or_end(warnings_, connecting)
        await limited.set_limit(-1)
        conn = await connecting
        assert await conn.fetchval("SELECT to_regclass('projector_checkpoint') IS NOT NULL")
        await conn.close()
    finally:
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
    line = warnings_.records[0].getMessage()
    assert "too many connections" in line and "s3cret" not in line and "\n" not in line


async def test_a_rebuild_waits_for_a_connection(limited: LimitedRole, warnings_: _Warnings) -> None:
    """``eventlight replay --rebuild`` opens Postgres (its connection, the migrations of the fresh
    schema, the projector's pool) waiting for room as a store does; it failed at once."""
    from eventlight.logreplay.rebuild import rebuild

    rebuilding = asyncio.ensure_future(rebuild(limited.settings))
    try:
        await _first_warning_or_end(warnings_, rebuilding)
        await limited.set_limit(-1)
        report = await rebuilding
    finally:
        rebuilding.cancel()
        await asyncio.gather(rebuilding, return_exceptions=True)
    assert report.same and report.schema == f"{limited.settings.pg_schema}_rebuild"


async def test_the_sql_reader_login_waits_for_a_connection(namespace: Settings, warnings_: _Warnings) -> None:
    """``eventlight sql`` runs its query as the namespace's reader role (``sql_reader.connect_reader``),
    whose login failed at once while Postgres took no connection for it; it now waits for room as the
    other openings do (``EVENTLIGHT_PG_OPEN_WAIT_S``). Here the role is at ``CONNECTION LIMIT 0``."""
    from eventlight.cli.sql import _query
    from eventlight.sql_reader import ensure_reader

    admin = await asyncpg.connect(namespace.pg_dsn)
    try:
        role = await ensure_reader(admin, namespace.pg_schema)
        await admin.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT 0')
        querying = asyncio.ensure_future(_query(namespace, "SELECT 1 AS one", 5.0))
        try:
            await _first_warning_or_end(warnings_, querying)
            await admin.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT -1')
            _, rows = await querying
        finally:
            querying.cancel()
            await asyncio.gather(querying, return_exceptions=True)
    finally:
        await admin.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT -1')
        await admin.close()
    assert [tuple(r) for r in rows] == [(1,)]
    line = warnings_.records[0].getMessage()
    assert "too many connections" in line and role in line and "\n" not in line


async def test_dropping_a_namespace_waits_for_a_connection(limited: LimitedRole, warnings_: _Warnings) -> None:
    """``drop_namespace`` (tests, ``eventlight.ops``) opened Postgres at once, failing while it took no
    connection; it now waits for room as ``apply_migrations`` does. (A namespace that was never made
    here: the limited role may drop what does not exist.)"""
    from eventlight.ops import drop_namespace

    gone = msgspec.structs.replace(limited.settings, namespace=f"{limited.settings.namespace}_gone")
    dropping = asyncio.ensure_future(drop_namespace(None, gone.pg_dsn, gone))
    try:
        await _first_warning_or_end(warnings_, dropping)
        await limited.set_limit(-1)
        await dropping
    finally:
        dropping.cancel()
        await asyncio.gather(dropping, return_exceptions=True)
    line = warnings_.records[0].getMessage()
    assert "too many connections" in line and "s3cret" not in line and "\n" not in line
