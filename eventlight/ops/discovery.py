"""Finding the servers a namespace uses, without starting any (``eventlight status``, ``sql``)."""

from __future__ import annotations

from urllib.parse import urlsplit

import msgspec

from eventlight.core.errors import InvalidInputError, ServerTooOldError, ServiceUnavailableError
from eventlight.net import redact, redact_configured, server_urls
from eventlight.ops.nats_server import nats_probe
from eventlight.ops.postgres import BUSY_NOW, pg_probe
from eventlight.ops.procs import pid_running
from eventlight.ops.state import Services, embedded_pids, read_record
from eventlight.settings import Settings


class Endpoint(msgspec.Struct, frozen=True):
    """A server found by ``find_nats`` / ``find_pg``, which answered.

    Attributes:
        url: NATS URL or Postgres DSN, as configured (may hold credentials: print ``redact(url)``).
        origin: ``"EVENTLIGHT_NATS_URL"`` / ``"EVENTLIGHT_PG_DSN"`` when configured, else ``"embedded"``.
        pid: Pid of the embedded server, ``None`` when external.
        kind: ``"external"``, ``"embedded"`` (NATS), ``"system"`` or ``"pgserver"`` (Postgres).
        recorded: Found in ``services.json`` (what ``eventlight up`` used), not in the settings: an
            external one's ``origin`` is then the variable that configured it then, unset now.
    """

    url: str
    origin: str
    pid: int | None = None
    kind: str = "external"
    recorded: bool = False


async def find_nats(settings: Settings) -> Endpoint | None:
    """Find the NATS server to use without starting one.

    ``settings.nats_url`` when set, else the embedded server ``ensure_services`` recorded in
    ``services.json`` (whether or not the embedded Postgres still runs: runners need only NATS).

    Returns:
        The server, which answered within 2 s; ``None`` when none is configured or recorded, or
        no embedded server recorded still runs.

    Raises:
        ServiceUnavailableError: The configured or recorded server does not answer, or the
            recorded nats-server stopped while the embedded Postgres runs (the URL redacted).
        ServerTooOldError: It answered, but it is older than eventlight needs (named as above).
    """
    if settings.nats_url:
        found = Endpoint(settings.nats_url, "EVENTLIGHT_NATS_URL")
    elif (recorded := _recorded(settings)) is not None:
        embedded = recorded.nats_pid is not None
        origin, kind = ("embedded", "embedded") if embedded else ("EVENTLIGHT_NATS_URL", "external")
        found = _still_running(Endpoint(recorded.nats_url, origin, recorded.nats_pid, kind, True), "nats-server")
    else:
        return None
    try:
        why = await nats_probe(found.url, auth=settings.nats_auth)
    except ServerTooOldError as e:  # named as configured, as the errors below
        where = redact_configured(found.url, f"{found.origin} {found.url}")
        raise ServerTooOldError(where, found=e.found, required=e.required, detail=e.detail) from None
    if why:
        raise ServiceUnavailableError(
            redact_configured(found.url, f"{found.origin} {found.url}"),
            redact_configured(found.url, why),
        )
    return found


async def find_pg(settings: Settings) -> Endpoint | None:
    """Find the Postgres to use without starting one.

    ``settings.pg_dsn`` when set (unlike ``ensure_services``, an unreachable one is an error, not a
    fallback), else the one ``ensure_services`` recorded in ``services.json``, only when that record
    is of the same NATS as ``settings.nats_url`` (or none is set): a configured NATS is never shown
    beside the rows of another deployment's Postgres.

    Returns:
        The server, which answered ``SELECT 1`` within 3 s, or answered that it takes no connection
        now ("too many clients", starting up: the caller's opening waits, ``open_waiting``);
        ``None`` when none is configured or recorded, or no embedded server recorded still runs.

    Raises:
        ServiceUnavailableError: The configured or recorded server does not answer, or the
            recorded postmaster stopped while the embedded NATS runs (the DSN redacted).
        InvalidInputError: ``settings.nats_url`` is set, ``settings.pg_dsn`` is not, and the
            recorded servers are of another NATS (their Postgres is not this NATS's).
    """
    if settings.pg_dsn:
        found = Endpoint(settings.pg_dsn, "EVENTLIGHT_PG_DSN")
    elif (recorded := _recorded(settings)) is not None:
        _refuse_another_deployment(settings, recorded)
        origin = "embedded" if recorded.pg_pid is not None else "EVENTLIGHT_PG_DSN"
        found = _still_running(Endpoint(recorded.pg_dsn, origin, recorded.pg_pid, recorded.pg_kind, True), "postgres")
    else:
        return None
    why = await pg_probe(found.url)
    if why and not why.startswith(BUSY_NOW):  # busy: it is there; what connects next waits for room (open_waiting)
        raise ServiceUnavailableError(
            redact_configured(found.url, f"{found.origin} {found.url}"),
            redact_configured(found.url, f"Postgres {why}"),
        )
    return found


def _refuse_another_deployment(settings: Settings, recorded: Services) -> None:
    """Raise unless ``recorded`` (``services.json``) is of the NATS ``settings.nats_url`` names, if it names one.

    Raises:
        InvalidInputError: It names another NATS: the recorded Postgres holds that one's namespace.
    """
    if not settings.nats_url or _servers(settings.nats_url) == _servers(recorded.nats_url):
        return
    raise InvalidInputError(
        redact_configured(
            settings.nats_url,
            f"EVENTLIGHT_NATS_URL is {settings.nats_url}, not the NATS of the servers `eventlight up` recorded in "
            f"{settings.state_dir} ({redact(recorded.nats_url)}), so their Postgres is not this NATS's: set "
            "EVENTLIGHT_PG_DSN to the Postgres that goes with it, or unset EVENTLIGHT_NATS_URL",
        )
    )


def _servers(url: str) -> set[tuple[str, int]]:
    """The ``(host, port)`` of each server ``url`` names (``server_urls``), however it is spelled:
    credentials, a trailing ``/``, the order of a cluster's servers and the host's case do not
    matter; no port is NATS's 4222.

    Raises:
        InvalidInputError: ``url`` names no NATS server (``server_urls``).
    """
    parts = [urlsplit(u) for u in server_urls(url)]
    return {((p.hostname or "").lower(), p.port or 4222) for p in parts}


def _recorded(settings: Settings) -> Services | None:
    """``services.json`` while some embedded server it names still runs; ``None`` when there is no
    record or every one of them stopped (a record left behind: as if no server had been started)."""
    recorded = read_record(settings)
    if recorded is None or not any(pid_running(pid, "") for pid in embedded_pids(recorded)):
        return None
    return recorded


def _still_running(found: Endpoint, name: str) -> Endpoint:
    """``found``, unless it is an embedded server whose recorded process stopped.

    Raises:
        ServiceUnavailableError: It stopped (the other embedded server still runs).
    """
    if found.pid is not None and not pid_running(found.pid, ""):
        raise ServiceUnavailableError(
            redact_configured(found.url, f"{found.origin} {found.url}"),
            f"{name} pid {found.pid} is no longer running (`eventlight up` starts it again)",
        )
    return found
