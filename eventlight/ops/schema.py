"""Apply the SQL migrations of ``eventlight/_data/migrations/``; drop a namespace."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import asyncpg

from eventlight._data import data_dir
from eventlight.credentials import NatsAuth
from eventlight.net import redact
from eventlight.settings import PG_OPEN_WAIT_S, Settings
from eventlight.sql_reader import drop_reader
from eventlight.store.jetstream import pg_errors
from eventlight.store.jetstream.connect import connect_nats
from eventlight.store.jetstream.nats_errors import JsNotFoundError, nats_errors
from eventlight.store.jetstream.pg_open import open_waiting

_log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def apply_migrations(
    pg_dsn: str, schema: str, migrations_dir: Path | None = None, *, open_wait_s: float = PG_OPEN_WAIT_S
) -> list[str]:
    """Apply ``NNN_*.sql`` files not yet recorded in ``<schema>.schema_migrations``, in order.

    Each file runs in its own transaction with ``SET LOCAL search_path TO <schema>`` under
    ``pg_advisory_xact_lock(hashtext(schema))``, so concurrent callers apply each file once.

    Args:
        pg_dsn: Postgres DSN.
        schema: Schema to create and migrate (e.g. ``settings.pg_schema``).
        migrations_dir: Folder of SQL files; default the packaged ``eventlight/_data/migrations``.
        open_wait_s: Seconds to keep trying to connect while Postgres answers "too many clients"
            (or that it is starting up), one warning line a try (``Settings.pg_open_wait_s``).

    Returns:
        Versions (file stems, e.g. ``"001_read_models"``) applied by this call.

    Raises:
        FileNotFoundError: No migrations folder was found.
        ServiceUnavailableError: Postgres cannot be reached or failed, or took no connection
            within ``open_wait_s`` seconds.
        asyncpg.PostgresError: A migration's SQL failed; its transaction is rolled back.
    """
    files = _read_migrations(migrations_dir or data_dir("migrations"))
    connect = lambda: pg_errors.connect(pg_dsn, timeout_s=CONNECT_TIMEOUT_S)  # noqa: E731
    conn = await open_waiting(pg_dsn, "applying migrations", connect, wait_s=open_wait_s)
    try:
        with pg_errors.pg_errors(pg_dsn, "apply migrations"):
            return await _apply_all(conn, schema, files)
    finally:
        await conn.close()


async def _apply_all(conn: asyncpg.Connection, schema: str, files: list[tuple[str, str]]) -> list[str]:
    q = _quote_ident(schema)
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", schema)
        await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {q}")
        await conn.execute(
            f"CREATE TABLE IF NOT EXISTS {q}.schema_migrations"
            "(version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
        )
    return [version for version, sql in files if await _apply_one(conn, schema, version, sql)]


def _read_migrations(folder: Path) -> list[tuple[str, str]]:
    """(version, SQL text) of ``NNN_*.sql`` in ``folder``, sorted by name."""
    return [(p.stem, p.read_text()) for p in sorted(folder.glob("[0-9][0-9][0-9]_*.sql"))]


async def _apply_one(conn: asyncpg.Connection, schema: str, version: str, sql: str) -> bool:
    """Apply one migration unless recorded; return whether it ran."""
    q = _quote_ident(schema)
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", schema)
        if await conn.fetchval(f"SELECT 1 FROM {q}.schema_migrations WHERE version = $1", version):
            return False
        await conn.execute(f"SET LOCAL search_path TO {q}")
        await conn.execute(sql)
        await conn.execute(f"INSERT INTO {q}.schema_migrations(version) VALUES ($1)", version)
    _log.info("applied migration %s to schema %s", version, schema)
    return True


async def drop_namespace(nats_url: str | None, pg_dsn: str | None, settings: Settings) -> None:
    """Delete the namespace's stream (with its consumers) and archive stream, and ``DROP SCHEMA … CASCADE``, with the
    schemas ``eventlight replay --rebuild`` leaves beside it (``<schema>_rebuild``, ``<schema>_replaced_*``), then the
    namespace's ``eventlight sql`` reader role (``eventlight.sql_reader.drop_reader``; roles are cluster-wide).

    Args:
        nats_url: NATS server; ``None`` skips the stream.
        pg_dsn: Postgres DSN; ``None`` skips the schema.
        settings: Gives the namespace (stream ``EL_<NS>``, schema ``el_<ns>``).

    Raises:
        ServiceUnavailableError: A server cannot be reached, or Postgres took no connection within
            ``settings.pg_open_wait_s`` seconds (tried again meanwhile while it answers "too many
            clients" or that it is starting up, one warning line a try, as ``apply_migrations`` does).
    """
    if nats_url:
        await _delete_stream(nats_url, settings.stream_name, settings.nats_auth)
    if pg_dsn:
        connect = lambda: pg_errors.connect(pg_dsn, timeout_s=CONNECT_TIMEOUT_S)  # noqa: E731
        conn = await open_waiting(
            pg_dsn, f"dropping schema {settings.pg_schema}", connect, wait_s=settings.pg_open_wait_s
        )
        try:
            with pg_errors.pg_errors(pg_dsn, f"drop schema {settings.pg_schema}"):
                siblings = await conn.fetch(
                    "SELECT nspname FROM pg_namespace WHERE nspname = $1 || '_rebuild' "
                    "OR starts_with(nspname, $1 || '_replaced_')",
                    settings.pg_schema,
                )
                for name in [settings.pg_schema, *(r[0] for r in siblings)]:
                    await conn.execute(f"DROP SCHEMA IF EXISTS {_quote_ident(name)} CASCADE")
                await drop_reader(conn, settings.pg_schema)
        finally:
            await conn.close()


async def _delete_stream(nats_url: str, stream: str, auth: NatsAuth) -> None:
    nc = await connect_nats(nats_url, auth=auth, name="eventlight-ops", reconnect=False)
    try:
        # the archive (it sources the events), the events, and the span counters of older versions
        for name in (f"{stream}_ARCHIVE", stream, f"KV_{stream}_SEQ"):
            with nats_errors(redact(nats_url), f"deleting stream {name}"), contextlib.suppress(JsNotFoundError):
                await nc.jetstream().delete_stream(name)
    finally:
        await nc.close()
