"""Finding the servers (``$EVENTLIGHT_NATS_URL`` / ``$EVENTLIGHT_PG_DSN`` or the embedded ones), never starting them."""

from __future__ import annotations

from typing import Any

from eventlight.cli.common import EXIT_UNAVAILABLE, EXIT_USAGE, CliError
from eventlight.settings import Settings

# ---------------------------------------------------------------------------------------------
# finding the servers (never starting them)


def _no_servers(settings: Settings, variable: str) -> CliError:
    from eventlight.ops.lifecycle import unrecorded_servers

    if running := unrecorded_servers(settings):  # an `up` killed before it wrote services.json
        return CliError(
            f"no eventlight servers are recorded in the state folder {settings.state_dir}, but "
            f"{' and '.join(running)} run from it: an `eventlight up` was stopped before it finished; "
            "run `eventlight up` again (it reuses them) or `eventlight down`",
            EXIT_UNAVAILABLE,
        )
    return CliError(
        f"no eventlight servers are running (state folder {settings.state_dir}): "
        f"run `eventlight up`, or set {variable}",
        EXIT_UNAVAILABLE,
    )


async def _need_nats(settings: Settings) -> Any:
    from eventlight.ops import find_nats

    found = await find_nats(settings)
    if found is None:
        raise _no_servers(settings, "EVENTLIGHT_NATS_URL")
    return found


async def _need_pg(settings: Settings) -> Any:
    from eventlight.ops import find_pg

    found = await find_pg(settings)
    if found is None:
        raise _no_servers(settings, "EVENTLIGHT_PG_DSN")
    return found


def _no_namespace(settings: Settings, what: str) -> CliError:
    return CliError(
        f"namespace {settings.namespace!r} does not exist ({what}): run `eventlight up -N {settings.namespace}` "
        "or check EVENTLIGHT_NAMESPACE / --namespace",
        EXIT_USAGE,
    )


async def _connect_pg(settings: Settings, found: Any = None) -> Any:
    """A connection to the namespace's schema, on ``found`` or the Postgres ``_need_pg`` finds.

    While Postgres takes no connection now ("too many clients", starting up), the connection and
    the migrations are tried again for up to ``settings.pg_open_wait_s`` seconds
    (``EVENTLIGHT_PG_OPEN_WAIT_S``), one warning line a try, as a store opening does.

    Raises:
        CliError: No server, or the namespace's schema does not exist.
        ServiceUnavailableError: The server does not answer, or took no connection in time.
    """
    from eventlight.net import redact
    from eventlight.ops import apply_migrations
    from eventlight.store.jetstream import pg_errors
    from eventlight.store.jetstream.pg_open import open_waiting

    found = found or await _need_pg(settings)
    where = f"{found.origin} {redact(found.url)}"
    conn = await open_waiting(
        found.url,
        "connecting",
        lambda: pg_errors.connect(found.url, server_settings={"search_path": settings.pg_schema}, name=where),
        wait_s=settings.pg_open_wait_s,
    )
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_namespace WHERE nspname = $1", settings.pg_schema)
        if not exists:
            raise _no_namespace(settings, f"no schema {settings.pg_schema}")
        # idempotent: brings an older schema up to date
        await apply_migrations(found.url, settings.pg_schema, open_wait_s=settings.pg_open_wait_s)
    except BaseException:
        await conn.close()
        raise
    return conn
