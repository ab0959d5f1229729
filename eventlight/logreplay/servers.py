"""The servers of the log's Python entry points, found as the commands find them.

``replay``, ``export_log``, ``import_log``, ``catch_up`` and ``rebuild`` take a ``Settings``; one
without ``nats_url`` (or ``pg_dsn``) uses the embedded servers that ``eventlight up`` or a trainer
left running under ``settings.state_dir`` (``eventlight.ops.discovery``: nothing is started), and
says to run ``eventlight up`` when none runs. A namespace without a stream is named, with the
command that makes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.settings import Settings


def _none_running(settings: Settings, setting: str, variable: str, server: str) -> ServiceUnavailableError:
    return ServiceUnavailableError(
        server,
        f"settings.{setting} ({variable}) is not set and no eventlight servers are running "
        f"(state folder {settings.state_dir}): run `eventlight up`, or set {variable}",
    )


async def nats_url_of(settings: Settings) -> str:
    """``settings.nats_url``, else the NATS of the embedded servers under ``settings.state_dir``
    (``find_nats``: nothing is started).

    Raises:
        ServiceUnavailableError: No URL is set and no embedded server runs, or the server found
            does not answer.
    """
    if settings.nats_url:
        return settings.nats_url
    from eventlight.ops.discovery import find_nats

    found = await find_nats(settings)
    if found is None:
        raise _none_running(settings, "nats_url", "EVENTLIGHT_NATS_URL", "NATS")
    return found.url


async def pg_dsn_of(settings: Settings, pg_dsn: str | None = None) -> str:
    """``pg_dsn``, else ``settings.pg_dsn``, else the Postgres of the embedded servers under
    ``settings.state_dir`` (``find_pg``: nothing is started).

    Raises:
        ServiceUnavailableError: No DSN is given or set and no embedded server runs, or the
            server found does not answer.
    """
    if pg_dsn or settings.pg_dsn:
        return str(pg_dsn or settings.pg_dsn)
    from eventlight.ops.discovery import find_pg

    found = await find_pg(settings)
    if found is None:
        raise _none_running(settings, "pg_dsn", "EVENTLIGHT_PG_DSN", "Postgres")
    return found.url


async def stream_info(nc: Any, url: str, settings: Settings) -> Any:
    """The namespace's stream info (``state.last_seq``: the log's head), on the connection ``nc`` to ``url``.

    Raises:
        InvalidInputError: The namespace has no stream there (a typo, or ``eventlight up -N`` not run).
        ServiceUnavailableError: NATS did not answer.
    """
    from eventlight.net import redact
    from eventlight.store.jetstream.nats_errors import JsNotFoundError, nats_errors

    with nats_errors(redact(url), "stream info"):
        try:
            return await nc.jetstream().stream_info(settings.stream_name)
        except JsNotFoundError:
            raise InvalidInputError(
                f"namespace {settings.namespace!r} has no stream {settings.stream_name} on {redact(url)}: "
                f"run `eventlight up -N {settings.namespace}`, or check the namespace"
            ) from None


@contextlib.asynccontextmanager
async def log_of(settings: Settings, name: str, clock: Callable[[], float] | None = None) -> AsyncIterator[Any]:
    """The namespace's event log (``JetStreamEventLog``) on its own NATS connection (``nats_url_of``),
    named ``name`` on the server and closed on exit, after checking the stream exists.

    Raises:
        ServiceUnavailableError: No server is set or running, or it does not answer.
        InvalidInputError: The namespace has no stream.
    """
    from eventlight.store.jetstream.connect import connect_nats
    from eventlight.store.jetstream.log import JetStreamEventLog

    url = await nats_url_of(settings)
    nc = await connect_nats(url, auth=settings.nats_auth, name=name)
    try:
        await stream_info(nc, url, settings)
        yield JetStreamEventLog(nc, settings, clock)
    finally:
        await nc.close()
