"""User SQL runs as a role that can only read one namespace's projections.

``eventlight sql`` takes SQL from a person. Run with the DSN's own role — often a superuser — a
query could run a shell command (``COPY … TO PROGRAM``), read server files (``pg_read_file``) or end
other sessions (``pg_terminate_backend``). :func:`connect_reader` connects *as* a reader role instead
(a ``SET ROLE`` would not do: a query can undo it with ``set_config('role', …)`` while the session
user is a superuser), read-only, with a statement timeout.

Each namespace has its own reader role, so a query from one namespace cannot read another's schema
(``SELECT * FROM el_other.rollouts`` is refused: permission denied for schema ``el_other``):

* Name: :func:`reader_role` — ``<schema>_reader`` (``el_default_reader``); where that passes
  Postgres's 63 bytes, the schema's first bytes, ``_``, 8 hex digits of its SHA-256 and ``_reader``.
  Roles are cluster-wide and schemas per database: the same schema name in two databases shares the
  role, which reads in each database only what that database granted it (a query never leaves the
  database it connected to).
* Creation: :func:`ensure_reader`, through the DSN's (owner) connection, at each call —
  ``LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOREPLICATION NOBYPASSRLS``, with
  ``statement_timeout = 30s`` and ``default_transaction_read_only = on`` even if a client sets
  none. It runs under the schema's migration lock (``pg_advisory_xact_lock(hashtext(schema))``), and
  a role created at the same moment from another database is taken as it is. A role of that name
  made by someone else with more powers (superuser, ``CREATEROLE``, … , a member of another role, an
  owner of objects) is refused rather than used.
* Grants, at each call (idempotent; covers tables and views added since): ``USAGE`` on the schema
  and ``SELECT`` on its tables and views, nothing else; ``USAGE`` granted on any other schema (the
  ``<schema>_replaced_*`` a rebuild swapped out) is revoked. The shared ``eventlight_reader`` of
  migration 005 lost its grants in migration 013.
* Removal: ``eventlight.ops.drop_namespace`` drops the schema, then the role (:func:`drop_reader`).

Authentication: the same host, port and database as the DSN, with the reader role as user. Where
the server asks for a password (not ``trust``), the DSN's role gives the reader a fresh random
password first. The DSN's role therefore needs ``CREATEROLE`` (or superuser), as migration 005
already did.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Awaitable
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.settings import PG_OPEN_WAIT_S
from eventlight.store.jetstream import pg_errors
from eventlight.store.jetstream.pg_open import open_waiting

__all__ = ["connect_reader", "drop_reader", "ensure_reader", "reader_dsn", "reader_role"]

_log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
MAX_ROLE_BYTES = 63
"""Postgres's ``NAMEDATALEN - 1``: a longer role name would be cut, and could match another's."""
ROLE_SUFFIX = "_reader"
ROLE_STATEMENT_TIMEOUT = "30s"
_PASSWORD_LOCK = "eventlight_sql_reader"  # first key of the two-key advisory lock held while setting a password
_RELKINDS = ["r", "p", "v", "m", "f"]  # tables, partitioned tables, views, materialized views, foreign tables


def reader_role(schema: str) -> str:
    """The name of ``schema``'s reader role: ``<schema>_reader``, at most 63 bytes.

    A name that would be longer keeps the schema's first bytes and adds 8 hex digits of its
    SHA-256, so two long schemas sharing a prefix still get two roles.
    """
    name = f"{schema}{ROLE_SUFFIX}"
    if len(name.encode()) <= MAX_ROLE_BYTES:
        return name
    digest = hashlib.sha256(schema.encode()).hexdigest()[:8]
    room = MAX_ROLE_BYTES - len(ROLE_SUFFIX) - len(digest) - 1
    head = schema.encode()[:room].decode("utf-8", "ignore")
    return f"{head}_{digest}{ROLE_SUFFIX}"


def reader_dsn(dsn: str, role: str, password: str | None = None) -> str:
    """``dsn`` with its user (and password) replaced by ``role`` (and ``password``).

    Raises:
        ValueError: ``dsn`` is not a ``postgresql://`` / ``postgres://`` URL.
    """
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError(f"not a postgresql:// DSN: {parts.scheme!r}")
    host = parts.netloc.rsplit("@", 1)[-1]
    user = quote(role, safe="") if password is None else f"{quote(role, safe='')}:{quote(password, safe='')}"
    return urlunsplit((parts.scheme, f"{user}@{host}", parts.path, parts.query, parts.fragment))


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


async def ensure_reader(owner: asyncpg.Connection, schema: str) -> str:
    """Create ``schema``'s reader role if missing and grant it reading ``schema``, and only that.

    Args:
        owner: A connection with the role that owns ``schema`` (it ran the migrations).
        schema: The namespace's schema.

    Returns:
        The role's name (:func:`reader_role`).

    Raises:
        InvalidInputError: The DSN's role may not create or grant to roles, or a role of that name
            exists with more powers than reading.
    """
    role = reader_role(schema)
    try:
        async with owner.transaction():
            await owner.execute("SELECT pg_advisory_xact_lock(hashtext($1))", schema)  # the migrations' lock
            await _create_role(owner, role)
            await _refuse_powers(owner, role)
            await _grant_only(owner, role, schema)
    except asyncpg.InsufficientPrivilegeError as e:
        raise InvalidInputError(
            f"cannot set up the reader role {role} of schema {schema}: {e} "
            "(the DSN's role needs CREATEROLE and to own the schema)"
        ) from e
    return role


async def _create_role(owner: asyncpg.Connection, role: str) -> None:
    if await owner.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
        return
    q = _q(role)
    try:
        async with owner.transaction():  # a savepoint: another database's call may create it first
            await owner.execute(
                f"CREATE ROLE {q} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT NOREPLICATION NOBYPASSRLS"
            )
            await owner.execute(f"ALTER ROLE {q} SET statement_timeout = '{ROLE_STATEMENT_TIMEOUT}'")
            await owner.execute(f"ALTER ROLE {q} SET default_transaction_read_only = on")
    except (asyncpg.DuplicateObjectError, asyncpg.UniqueViolationError):
        return
    _log.debug("created reader role %s", role)


async def _refuse_powers(owner: asyncpg.Connection, role: str) -> None:
    powers = await owner.fetchval(
        "SELECT rolsuper OR rolcreaterole OR rolcreatedb OR rolreplication OR rolbypassrls"
        " OR EXISTS (SELECT FROM pg_auth_members WHERE member = r.oid)"
        " OR EXISTS (SELECT FROM pg_shdepend WHERE refobjid = r.oid AND deptype = 'o')"
        " FROM pg_roles r WHERE rolname = $1",
        role,
    )
    if powers:
        raise InvalidInputError(
            f"role {role} exists with more powers than reading (superuser, CREATEROLE, CREATEDB, REPLICATION, "
            "BYPASSRLS, a member of a role, or an owner of objects): `eventlight sql` will not run as it; "
            "drop it or take those away"
        )


async def _grant_only(owner: asyncpg.Connection, role: str, schema: str) -> None:
    """``USAGE`` on ``schema`` and ``SELECT`` on its relations for ``role``; its ``USAGE`` elsewhere revoked."""
    if not await owner.fetchval("SELECT has_schema_privilege($1, $2, 'USAGE')", role, schema):
        await owner.execute(f"GRANT USAGE ON SCHEMA {_q(schema)} TO {_q(role)}")
    unreadable = await owner.fetchval(
        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = $1 AND c.relkind::text = ANY($3::text[]) AND NOT has_table_privilege($2, c.oid, 'SELECT')",
        schema,
        role,
        _RELKINDS,
    )
    if unreadable:  # a GRANT rewrites every table's catalog row, so only when one is missing
        await owner.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA {_q(schema)} TO {_q(role)}")
    others = await owner.fetch(
        "SELECT DISTINCT n.nspname FROM pg_namespace n, aclexplode(n.nspacl) a"
        " WHERE a.grantee = (SELECT oid FROM pg_roles WHERE rolname = $1) AND n.nspname <> $2",
        role,
        schema,
    )
    for (other,) in others:
        await owner.execute(f"REVOKE ALL ON SCHEMA {_q(other)} FROM {_q(role)}")


async def connect_reader(
    owner: asyncpg.Connection, dsn: str, schema: str, *, timeout_s: float, open_wait_s: float = PG_OPEN_WAIT_S
) -> asyncpg.Connection:
    """Connect as ``schema``'s reader role: read-only, ``statement_timeout = timeout_s``.

    While Postgres takes no connection now ("too many clients", starting up), the login is tried
    again for up to ``open_wait_s`` seconds, one warning line a try, as a store's opening does
    (``pg_open.open_waiting``).

    Args:
        owner: An open connection with the DSN's role (which ran the migrations); creates the role
            and grants it ``schema`` (:func:`ensure_reader`), and sets its password when the server
            does not trust local connections.
        dsn: The DSN ``owner`` came from.
        schema: The namespace's schema, put first on the reader's ``search_path``.
        timeout_s: Seconds a statement may run before the server cancels it.
        open_wait_s: Seconds to keep trying to log in while Postgres takes no connection now
            (``Settings.pg_open_wait_s``, ``EVENTLIGHT_PG_OPEN_WAIT_S``); 0: one try.

    Raises:
        InvalidInputError: The reader role cannot be set up (:func:`ensure_reader`).
        ServiceUnavailableError: The reader role cannot log in (say, ``pg_hba.conf`` refuses it), or
            Postgres took no connection within ``open_wait_s`` seconds.
    """
    role = await ensure_reader(owner, schema)
    settings = {
        "search_path": schema,
        "statement_timeout": str(max(1, int(timeout_s * 1000))),
        "default_transaction_read_only": "on",
    }
    parts = urlsplit(dsn)
    where = f"{role}@{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path}"

    def login(password: str | None = None) -> Awaitable[asyncpg.Connection]:
        connect = lambda: pg_errors.connect(  # noqa: E731
            reader_dsn(dsn, role, password), server_settings=settings, timeout_s=CONNECT_TIMEOUT_S, name=where
        )
        return open_waiting(where, "logging in as the reader role", connect, wait_s=open_wait_s)

    try:
        return await login()
    except ServiceUnavailableError as e:
        if not isinstance(e.__cause__, pg_errors.AUTH_FAILURES):
            raise
    password = secrets.token_urlsafe(24)
    # held until this login is done, so a second `eventlight sql` cannot change the password in between
    await owner.execute("SELECT pg_advisory_lock(hashtext($1), hashtext($2))", _PASSWORD_LOCK, role)
    try:
        await owner.execute(f"ALTER ROLE {_q(role)} PASSWORD '{password}'")  # urlsafe: no quote inside
        return await login(password)
    finally:
        await owner.execute("SELECT pg_advisory_unlock(hashtext($1), hashtext($2))", _PASSWORD_LOCK, role)


async def drop_reader(owner: asyncpg.Connection, schema: str) -> None:
    """Drop ``schema``'s reader role, if any; call after dropping the schema (which drops its grants).

    A role still granted something in another database of the cluster (the same schema name there)
    or that the DSN's role may not drop is left, with a log line.
    """
    role = reader_role(schema)
    try:
        await owner.execute(f"DROP ROLE IF EXISTS {_q(role)}")
    except (asyncpg.DependentObjectsStillExistError, asyncpg.InsufficientPrivilegeError) as e:
        _log.warning("left reader role %s: %s", role, e)
