"""User SQL runs as a role that can only read one namespace's projections.

``eventlight sql`` takes SQL from a person. Run with the DSN's own role — often a superuser — a
query could run a shell command (``COPY … TO PROGRAM``), read server files (``pg_read_file``) or end
other sessions (``pg_terminate_backend``). Migration ``005_sql_reader_role`` creates the cluster role
``eventlight_reader`` (LOGIN, no other attribute) and grants it ``SELECT`` on each namespace's tables;
:func:`connect_reader` connects *as* that role (a ``SET ROLE`` would not do: a query can undo it with
``set_config('role', …)`` while the session user is a superuser), read-only, with a statement timeout.

Authentication: the same host, port and database as the DSN, with user ``eventlight_reader``.
Where the server asks for a password (not ``trust``), the DSN's role gives the reader a fresh random
password first, so it needs ``CREATEROLE`` or superuser there.
"""

from __future__ import annotations

import secrets
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from eventlight.core.errors import ServiceUnavailableError
from eventlight.store.jetstream import pg_errors

__all__ = ["READER_ROLE", "connect_reader", "reader_dsn"]

READER_ROLE = "eventlight_reader"
CONNECT_TIMEOUT_S = 5.0


def reader_dsn(dsn: str, password: str | None = None) -> str:
    """``dsn`` with its user (and password) replaced by the reader role's.

    Raises:
        ValueError: ``dsn`` is not a ``postgresql://`` / ``postgres://`` URL.
    """
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError(f"not a postgresql:// DSN: {parts.scheme!r}")
    host = parts.netloc.rsplit("@", 1)[-1]
    user = READER_ROLE if password is None else f"{READER_ROLE}:{password}"
    return urlunsplit((parts.scheme, f"{user}@{host}", parts.path, parts.query, parts.fragment))


async def connect_reader(owner: asyncpg.Connection, dsn: str, schema: str, *, timeout_s: float) -> asyncpg.Connection:
    """Connect as ``eventlight_reader`` to ``schema``: read-only, ``statement_timeout = timeout_s``.

    Args:
        owner: An open connection with the DSN's role (which ran the migrations); used only to set
            the reader's password when the server does not trust local connections.
        dsn: The DSN ``owner`` came from.
        schema: The namespace's schema, put first on the reader's ``search_path``.
        timeout_s: Seconds a statement may run before the server cancels it.

    Raises:
        ServiceUnavailableError: The reader role cannot log in (say, ``pg_hba.conf`` refuses it).
    """
    settings = {
        "search_path": schema,
        "statement_timeout": str(max(1, int(timeout_s * 1000))),
        "default_transaction_read_only": "on",
    }
    parts = urlsplit(dsn)
    where = f"{READER_ROLE}@{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path}"
    try:
        return await pg_errors.connect(
            reader_dsn(dsn), server_settings=settings, timeout_s=CONNECT_TIMEOUT_S, name=where
        )
    except ServiceUnavailableError as e:
        if not isinstance(e.__cause__, pg_errors.AUTH_FAILURES):
            raise
    password = secrets.token_urlsafe(24)
    await owner.execute(f"ALTER ROLE {READER_ROLE} PASSWORD '{password}'")  # urlsafe: no quote inside
    return await pg_errors.connect(
        reader_dsn(dsn, password), server_settings=settings, timeout_s=CONNECT_TIMEOUT_S, name=where
    )
