"""Connecting to NATS: fail fast when nothing listens, and refuse servers older than 2.11."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.aio.client import Client as NATS

from eventlight.core.errors import ServiceUnavailableError
from eventlight.net import redact

log = logging.getLogger(__name__)


async def _nats_error(e: Exception) -> None:
    log.warning("NATS: %s", e if str(e) else type(e).__name__)


class _Events:
    """Logs a lost and a regained connection; a close asked for by the program logs nothing."""

    def __init__(self, url: str):
        self.url = url
        self.nc: NATS | None = None

    async def disconnected(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            log.warning(
                "NATS connection to %s lost; reconnecting every %.0f s until it is back", self.url, RECONNECT_WAIT_S
            )

    async def reconnected(self) -> None:
        log.warning("NATS reconnected to %s", self.url)


RECONNECT_WAIT_S = 1.0
"""Seconds between reconnect attempts after the connection is lost (nats-py's default is 2)."""


async def _reachable(url: str, timeout_s: float = 3.0) -> str | None:
    """``None`` if something accepts TCP connections at the first server of ``url``, else why not."""
    from urllib.parse import urlsplit

    first = url.split(",")[0].strip()
    parts = urlsplit(first if "://" in first else f"nats://{first}")
    host, port = parts.hostname or "127.0.0.1", parts.port or 4222
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError) as e:
        return f"nothing answers at {host}:{port} ({e.strerror or type(e).__name__})"
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return None


async def _quiet(_e: Exception) -> None:
    return None


async def connect_nats(
    url: str, *, name: str = "eventlight", timeout_s: float = 3.0, reconnect: bool = True, quiet: bool = False
) -> NATS:
    """Connect to NATS and check the server can do per-rollout optimistic appends.

    The one way eventlight connects to NATS: the stores, the runners, ``eventlight.ops`` and the CLI.
    With ``reconnect`` (the default) the client reconnects for as long as it takes after the server
    goes away (every ``RECONNECT_WAIT_S``), so a store, its projector and a runner resume by themselves.

    Args:
        url: A NATS URL, or several separated by commas.
        name: The client name the server shows.
        timeout_s: Seconds to wait for the TCP connection and for the server's answer.
        reconnect: Reconnect after a lost connection, for ever; ``False`` for a one-off call.
        quiet: Do not log connection errors (probes, which report them themselves).

    Raises:
        ServiceUnavailableError: The server cannot be reached (at once when nothing listens, instead
            of nats-py's reconnect attempts), or is older than 2.11 (it ignores
            ``Nats-Expected-Last-Subject-Sequence-Subject``, which eventlight's fencing needs).
    """
    import nats

    why = await _reachable(url, timeout_s)
    if why is not None:
        raise ServiceUnavailableError(redact(url), f"NATS is not reachable: {why}")
    events = _Events(redact(url))
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                url,
                name=name,
                connect_timeout=timeout_s,
                # an outage of any length is waited out: a store never closes for good because the
                # server was away (5 tries, as before, gave up in ~10 s); calls made meanwhile time
                # out as ServiceUnavailableError (retryable)
                max_reconnect_attempts=-1 if reconnect else 0,
                reconnect_time_wait=RECONNECT_WAIT_S,
                allow_reconnect=reconnect,
                error_cb=_quiet if quiet else _nats_error,
                disconnected_cb=events.disconnected,
                reconnected_cb=events.reconnected,
            ),
            timeout_s + 0.5,
        )
    except Exception as e:  # nats-py raises several unrelated types for "cannot connect"
        raise ServiceUnavailableError(redact(url), f"NATS did not accept a connection ({e!r})") from e
    events.nc = nc
    sv = nc.connected_server_version
    if (sv.major, sv.minor) < (2, 11):
        await nc.close()
        raise ServiceUnavailableError(
            redact(url),
            f"nats-server {nc.connected_server_version} is too old: eventlight needs >= 2.11 "
            "(per-rollout expected-sequence appends); unset EVENTLIGHT_NATS_URL to use the bundled 2.15",
        )
    return nc
