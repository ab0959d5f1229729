"""Connecting to NATS: fail fast when nothing listens, and refuse servers older than 2.11."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import nats.errors
from nats.aio.client import Client as NATS

from eventlight.core.errors import InvalidInputError, ServiceUnavailableError
from eventlight.credentials import NatsAuth
from eventlight.net import redact, redact_unparsed

log = logging.getLogger(__name__)


async def _nats_error(e: Exception) -> None:
    log.warning("NATS: %s", _describe(e))


class _Events:
    """Logs a lost connection once, a reminder at growing intervals while it stays lost, and how long
    it was away once it is back; a close asked for by the program logs nothing.

    nats-py reports every failed reconnect attempt (one a ``RECONNECT_WAIT_S``) to the error callback:
    while the connection is lost those are counted, not logged, and the reminders name the last one.
    """

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic):
        self.url = url
        self.nc: NATS | None = None
        self.clock = clock
        self.cause: Exception | None = None  # what ended the connection
        self.lost_at: float | None = None
        self.attempts = 0
        self.remind_after_s = REMINDER_FIRST_S
        self.remind_at = 0.0

    async def error(self, e: Exception) -> None:
        if self.lost_at is None and not isinstance(e, _CONNECTION_ENDED):
            await _nats_error(e)
            return
        if self.lost_at is None:
            self.cause = e  # the connection ended: the reconnect that follows logs it
            return
        self.attempts += 1
        if (now := self.clock()) >= self.remind_at:
            log.warning(
                "NATS at %s still unreachable after %s (%d attempts, the last: %s); still retrying",
                self.url,
                _duration(now - self.lost_at),
                self.attempts,
                _describe(e),
            )
            self.remind_after_s = min(self.remind_after_s * 2, REMINDER_MAX_S)
            self.remind_at = now + self.remind_after_s

    async def disconnected(self) -> None:
        if self.nc is None or self.nc.is_closed or self.lost_at is not None:
            return
        self.lost_at = self.clock()
        self.attempts = 0
        self.remind_after_s = REMINDER_FIRST_S
        self.remind_at = self.lost_at + REMINDER_FIRST_S
        cause = f" ({_describe(self.cause)})" if self.cause is not None else ""
        self.cause = None
        log.warning(
            "NATS connection to %s lost%s; retrying every %.0f s until it is back (a reminder after %s, "
            "then at doubling intervals)",
            self.url,
            cause,
            RECONNECT_WAIT_S,
            _duration(REMINDER_FIRST_S),
        )

    async def reconnected(self) -> None:
        away = "" if self.lost_at is None else f" after {_duration(self.clock() - self.lost_at)} away"
        log.info("NATS reconnected to %s%s", self.url, away)
        self.lost_at = None


_CONNECTION_ENDED: tuple[type[Exception], ...] = (OSError, nats.errors.UnexpectedEOF)
"""What nats-py reports to the error callback just before it reconnects: logged with the loss."""

RECONNECT_WAIT_S = 1.0
"""Seconds between reconnect attempts after the connection is lost (nats-py's default is 2)."""

REMINDER_FIRST_S = 60.0
"""Seconds after a lost connection until the first reminder that it is still lost; each next one
comes twice as long after the one before, up to ``REMINDER_MAX_S``."""

REMINDER_MAX_S = 3600.0


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.0f} min"


def _describe(e: Exception) -> str:
    return str(e) or type(e).__name__


def connected_server(nc: NATS) -> str:
    """The server ``nc`` is connected to, as ``nats://host:port`` for messages (never nats-py's
    ``ParseResult`` repr, never credentials); ``"NATS"`` when it is not connected."""
    url = nc.connected_url
    return f"nats://{url.hostname}:{url.port}" if url else "NATS"


def server_urls(url: str | Sequence[str]) -> list[str]:
    """The servers named by ``url``: one URL, several separated by commas, or a list of them.

    ``host:port`` without a scheme gets ``nats://``. ``EVENTLIGHT_NATS_URL`` takes the same form, so a
    cluster is given by all its servers (``nats://a:4222,nats://b:4222,nats://c:4222``).

    Raises:
        InvalidInputError: No server is named, or a port is out of range or not a number.
    """
    parts = url.split(",") if isinstance(url, str) else [p for u in url for p in u.split(",")]
    urls = [p.strip() if "://" in p else f"nats://{p.strip()}" for p in parts if p.strip()]
    if not urls:
        raise InvalidInputError(f"no NATS server in {url!r}")
    from urllib.parse import urlsplit

    for u in urls:
        try:
            urlsplit(u).port  # noqa: B018 - parsing it raises on a port out of range or not a number
        except ValueError as e:
            raise InvalidInputError(redact_unparsed(u, "a NATS URL", e)) from None
    return urls


async def _reachable_one(url: str, timeout_s: float) -> str | None:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 4222
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError) as e:
        return f"nothing answers at {host}:{port} ({e.strerror or type(e).__name__})"
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return None


async def _reachable(urls: list[str], timeout_s: float = 3.0) -> str | None:
    """``None`` if something accepts TCP connections at one of ``urls`` at least, else why not (each)."""
    whys = await asyncio.gather(*(_reachable_one(u, timeout_s) for u in urls))
    return None if any(w is None for w in whys) else "; ".join(w for w in whys if w is not None)


async def _quiet(_e: Exception) -> None:
    return None


async def connect_nats(
    url: str | Sequence[str],
    *,
    auth: NatsAuth | None = None,
    name: str = "eventlight",
    timeout_s: float = 3.0,
    reconnect: bool = True,
    quiet: bool = False,
) -> NATS:
    """Connect to NATS and check the server can do per-rollout optimistic appends.

    The one way eventlight connects to NATS: the stores, the runners, ``eventlight.ops`` and the CLI.
    With ``reconnect`` (the default) the client reconnects for as long as it takes after the server
    goes away (every ``RECONNECT_WAIT_S``), so a store, its projector and a runner resume by themselves;
    it logs one warning when the connection is lost, reminders after ``REMINDER_FIRST_S`` and then at
    doubling intervals (up to ``REMINDER_MAX_S``), and how long it was away when it is back.

    Args:
        url: A NATS URL, several separated by commas, or a list of URLs (``server_urls``): the servers
            of a cluster, tried in turn; the client also learns the others from the one it reaches.
            Credentials in it (``nats://user:pass@host``, ``nats://token@host``) are used and never shown.
        auth: Credentials to send (``Settings.nats_auth``: a token, a user and password, or a
            ``.creds`` file); ``None``: only those in ``url``.
        name: The client name the server shows.
        timeout_s: Seconds to wait for the TCP connection and for the server's answer.
        reconnect: Reconnect after a lost connection, for ever; ``False`` for a one-off call.
        quiet: Do not log connection errors (probes, which report them themselves).

    Raises:
        InvalidInputError: ``url`` names no server.
        ServiceUnavailableError: No server can be reached (at once when nothing listens, instead
            of nats-py's reconnect attempts), refuses the credentials, or is older than 2.11 (it ignores
            ``Nats-Expected-Last-Subject-Sequence-Subject``, which eventlight's fencing needs).
    """
    urls = server_urls(url)
    shown = redact(",".join(urls))
    why = await _reachable(urls, timeout_s)
    if why is not None:
        raise ServiceUnavailableError(shown, f"NATS is not reachable: {why}")
    events = _Events(shown)
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                urls,
                name=name,
                connect_timeout=timeout_s,
                # an outage of any length is waited out: a store never closes for good because the
                # server was away (5 tries, as before, gave up in ~10 s); calls made meanwhile time
                # out as ServiceUnavailableError (retryable)
                max_reconnect_attempts=-1 if reconnect else 0,
                reconnect_time_wait=RECONNECT_WAIT_S,
                allow_reconnect=reconnect,
                error_cb=_quiet if quiet else events.error if reconnect else _nats_error,
                disconnected_cb=events.disconnected,
                reconnected_cb=events.reconnected,
                **(auth.connect_kwargs() if auth is not None else {}),
            ),
            timeout_s + 0.5,
        )
    except Exception as e:  # nats-py raises several unrelated types for "cannot connect"
        raise ServiceUnavailableError(shown, f"NATS did not accept a connection ({e!r})") from e
    events.nc = nc
    sv = nc.connected_server_version
    if (sv.major, sv.minor) < (2, 11):
        await nc.close()
        raise ServiceUnavailableError(
            shown,
            f"nats-server {nc.connected_server_version} is too old: eventlight needs >= 2.11 "
            "(per-rollout expected-sequence appends); unset EVENTLIGHT_NATS_URL to use the bundled 2.15",
        )
    return nc
