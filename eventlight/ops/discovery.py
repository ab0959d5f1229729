"""Finding the servers a namespace uses, without starting any (``eventlight status``, ``sql``)."""

from __future__ import annotations

import msgspec

from eventlight.core.errors import ServiceUnavailableError
from eventlight.net import redact_configured
from eventlight.ops.nats_server import nats_probe
from eventlight.ops.postgres import pg_probe
from eventlight.ops.state import read_services
from eventlight.settings import Settings


class Endpoint(msgspec.Struct, frozen=True):
    """A server found by ``find_nats`` / ``find_pg``, which answered.

    Attributes:
        url: NATS URL or Postgres DSN, as configured (may hold credentials: print ``redact(url)``).
        origin: ``"EVENTLIGHT_NATS_URL"`` / ``"EVENTLIGHT_PG_DSN"`` when configured, else ``"embedded"``.
        pid: Pid of the embedded server, ``None`` when external.
        kind: ``"external"``, ``"embedded"`` (NATS), ``"system"`` or ``"pgserver"`` (Postgres).
    """

    url: str
    origin: str
    pid: int | None = None
    kind: str = "external"


async def find_nats(settings: Settings) -> Endpoint | None:
    """Find the NATS server to use without starting one.

    ``settings.nats_url`` when set, else the embedded server ``ensure_services`` recorded in
    ``services.json``.

    Returns:
        The server, which answered within 2 s; ``None`` when none is configured or recorded.

    Raises:
        ServiceUnavailableError: The configured or recorded server does not answer (the URL redacted).
    """
    if settings.nats_url:
        found = Endpoint(settings.nats_url, "EVENTLIGHT_NATS_URL")
    elif (recorded := read_services(settings)) is not None:
        embedded = recorded.nats_pid is not None
        origin, kind = ("embedded", "embedded") if embedded else ("EVENTLIGHT_NATS_URL", "external")
        found = Endpoint(recorded.nats_url, origin, recorded.nats_pid, kind)
    else:
        return None
    why = await nats_probe(found.url, auth=settings.nats_auth)
    if why:
        raise ServiceUnavailableError(
            redact_configured(found.url, f"{found.origin} {found.url}"),
            redact_configured(found.url, why),
        )
    return found


async def find_pg(settings: Settings) -> Endpoint | None:
    """Find the Postgres to use without starting one.

    ``settings.pg_dsn`` when set (unlike ``ensure_services``, an unreachable one is an error, not a
    fallback), else the one ``ensure_services`` recorded in ``services.json``.

    Returns:
        The server, which answered ``SELECT 1`` within 3 s; ``None`` when none is configured or recorded.

    Raises:
        ServiceUnavailableError: The configured or recorded server does not answer (the DSN redacted).
    """
    if settings.pg_dsn:
        found = Endpoint(settings.pg_dsn, "EVENTLIGHT_PG_DSN")
    elif (recorded := read_services(settings)) is not None:
        origin = "embedded" if recorded.pg_pid is not None else "EVENTLIGHT_PG_DSN"
        found = Endpoint(recorded.pg_dsn, origin, recorded.pg_pid, recorded.pg_kind)
    else:
        return None
    why = await pg_probe(found.url)
    if why:
        raise ServiceUnavailableError(
            redact_configured(found.url, f"{found.origin} {found.url}"),
            redact_configured(found.url, f"Postgres did not answer ({why})"),
        )
    return found
