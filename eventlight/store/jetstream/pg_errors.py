"""asyncpg errors mapped to eventlight's, in one place (``raise ... from e``).

* ``pg_errors(server, what)``: a failure of the server or of the connection (refused, lost, shut
  down, out of resources, a bad password, a missing database, a timeout) becomes
  ``ServiceUnavailableError`` naming the server with its password hidden; any other Postgres error
  (an error in the statement or its data) is left to the caller, which knows what it asked.
* ``sql_error_detail(e)``: what to tell a user whose own SQL failed (``eventlight sql``).
* ``SERVER_FAILURES``: the exception types that mean "the server failed, not the event": the
  projector retries a batch failing with one as it is.
* ``AUTH_FAILURES``: a role that may not log in that way (``eventlight sql`` then sets a password).
* ``BUSY``: a server that answered but takes no connection now ("too many clients", starting up):
  opening waits it out (``pg_open.open_waiting``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import TracebackType
from typing import Literal

import asyncpg

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.net import redact, redact_unparsed

__all__ = ["AUTH_FAILURES", "BUSY", "SERVER_FAILURES", "connect", "dsn_errors", "pg_errors", "sql_error_detail"]

SERVER_FAILURES: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,  # 08: connection lost
    asyncpg.exceptions.OperatorInterventionError,  # 57: shutdown, cancelled
    asyncpg.exceptions.InsufficientResourcesError,  # 53: disk full, too many connections
    asyncpg.exceptions.TransactionRollbackError,  # 40: serialization failure, deadlock
    asyncpg.exceptions.LockNotAvailableError,
)

BUSY: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.InsufficientResourcesError,  # 53: "too many clients" (53300), out of memory
    asyncpg.exceptions.CannotConnectNowError,  # 57P03: starting up, shutting down, in recovery
)
"""What a server that answered says when it takes no connection *now* (a subset of ``SERVER_FAILURES``)."""

AUTH_FAILURES: tuple[type[BaseException], ...] = (
    asyncpg.InvalidPasswordError,
    asyncpg.InvalidAuthorizationSpecificationError,
)

_CONNECT_FAILURES: tuple[type[BaseException], ...] = (
    *SERVER_FAILURES,
    *AUTH_FAILURES,
    asyncpg.exceptions.InvalidCatalogNameError,  # no such database
)


class pg_errors:  # noqa: N801 - used as a function: ``with pg_errors(server, what):``
    """Map server failures raised inside the block to ``ServiceUnavailableError``.

    A plain class, not a ``contextlib.contextmanager`` generator: it wraps every read-model query,
    and entering it must cost nothing when nothing fails (as ``nats_errors``).

    Args:
        server: The DSN (redacted here) named in the error.
        what: What the block does, for the message (``"connect"``, ``"apply migrations"``).

    Raises:
        ServiceUnavailableError: The server or the connection failed.
    """

    __slots__ = ("_server", "_what")

    def __init__(self, server: str, what: str):
        self._server = server
        self._what = what

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        if e is not None and isinstance(e, _CONNECT_FAILURES):
            raise ServiceUnavailableError(redact(self._server), f"Postgres: {self._what} failed ({e!r})") from e
        return False


async def connect(
    dsn: str, *, timeout_s: float = 5.0, server_settings: dict[str, str] | None = None, name: str | None = None
) -> asyncpg.Connection:
    """One connection, or ``ServiceUnavailableError`` naming ``name`` (default: the redacted DSN).

    Raises:
        ServiceUnavailableError: Postgres refused or did not answer within ``timeout_s`` seconds.
        InvalidInputError: asyncpg cannot parse ``dsn`` (``postgresql://user:secret/db``, the host
            forgotten, reads as port ``secret``: the message hides it, ``redact_unparsed``).
    """
    with dsn_errors(dsn), pg_errors(name or dsn, "connect"):
        conn: asyncpg.Connection = await asyncpg.connect(dsn, timeout=timeout_s, server_settings=server_settings)
        return conn


@contextlib.contextmanager
def dsn_errors(dsn: str) -> Iterator[None]:
    """Around ``asyncpg.connect`` / ``create_pool``: the ``ValueError`` asyncpg raises on a DSN it
    cannot parse (``OverflowError``: a port over 65535) becomes ``InvalidInputError``, the DSN and the
    password in it hidden (``redact_unparsed``).

    Raises:
        InvalidInputError: ``dsn`` is not a DSN asyncpg can parse.
    """
    try:
        yield
    except InvalidInputError:
        raise
    except (ValueError, OverflowError) as e:  # OverflowError: a port over 65535, from the socket call
        raise InvalidInputError(redact_unparsed(dsn, "a Postgres DSN", e)) from None


def sql_error_detail(e: BaseException, timeout_s: float) -> str | None:
    """What to tell a user whose own statement failed with ``e``; ``None`` when ``e`` is no SQL error.

    ``timeout_s`` is the statement timeout in force (a cancelled statement names it).
    """
    text = str(e)
    if isinstance(e, asyncpg.QueryCanceledError) and "statement timeout" in text:
        return f"the query ran longer than --timeout-s {timeout_s:g} s and was cancelled"
    if isinstance(e, asyncpg.InsufficientPrivilegeError):
        return (
            f"{text} (`eventlight sql` runs as the namespace's read-only role: "
            "it reads the namespace's own tables and views only)"
        )
    if isinstance(e, asyncpg.ReadOnlySQLTransactionError):
        return (
            f"{text}: `eventlight sql` only reads; the tables are projected from the stream, "
            "so write through the store API"
        )
    if isinstance(e, asyncpg.InterfaceError | asyncpg.PostgresConnectionError):  # e.g. it ended its own session
        return f"the connection to Postgres closed during the query ({text})"
    if "cannot insert multiple commands into a prepared statement" in text:
        return "several statements given; `eventlight sql` runs one statement at a time"
    if isinstance(e, asyncpg.PostgresError):
        return text
    return None
