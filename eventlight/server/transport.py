"""The HTTP side of ``LightningStoreClient``: one httpx client per event loop, retries, errors back into the tree.

What is retried (with ``retry_delays`` between tries):

* a *safe* request (a read, a search, a wait: ``idempotent=True``) after a connection failure, a
  timeout, 408, 502, 503 or 504;
* any request, writes included, only when it cannot have been carried out: the connection was
  never made, or the server answered ``ConcurrencyError`` (nothing was written). A write whose
  answer was lost is not repeated (it would be a second command), so its error is raised, saying
  that its outcome is unknown (it may have been stored).

An error answer becomes the error class it names (``error_type``, e.g. ``RolloutNotFoundError``
is a ``NotFoundError``) with the server's one-line message; 401 is ``AuthenticationError``; a
server that stays unreachable is ``ServiceUnavailableError``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import httpx
import msgspec

from eventlight.core import errors as E
from eventlight.net import redact

__all__ = ["Transport"]

log = logging.getLogger(__name__)

_RETRY_STATUSES = frozenset({408, 502, 503, 504})
_BY_STATUS: dict[int, type[E.EventlightError]] = {
    400: E.InvalidInputError,
    401: E.AuthenticationError,
    404: E.NotFoundError,
    408: E.ServiceUnavailableError,  # the server gave up waiting for the body: a transient, retried first
    409: E.InvalidTransitionError,
    413: E.InvalidInputError,
    422: E.InvalidTypeError,
    502: E.ServiceUnavailableError,
    503: E.ServiceUnavailableError,
    504: E.ServiceUnavailableError,
}
_BY_NAME: dict[str, type[E.EventlightError]] = {
    cls.__name__: cls for cls in vars(E).values() if isinstance(cls, type) and issubclass(cls, E.EventlightError)
}


_GATEWAY_STATUSES = frozenset({502, 504})
_OUTCOME_UNKNOWN = "the write was sent and its outcome is unknown (read it back before writing again)"


def _with_detail(error: E.EventlightError, message: str) -> E.EventlightError:
    """``error`` (its class and attributes) with ``message`` as its text."""
    error.args = (message,)
    return error


def _decoded(response: httpx.Response, method: str, path: str) -> Any:
    """The JSON of a success answer.

    Raises:
        EventlightError: The body is not JSON (something else than the store server answered; the
            store servers answer a missing entity with ``null``, so an empty 200 is not one).
    """
    if not response.content and response.status_code == 204:
        return None
    try:
        return msgspec.json.decode(response.content)
    except msgspec.DecodeError:
        shown = response.content[:80].decode(errors="replace")
        raise E.EventlightError(
            f"{method} {path}: the server answered {response.status_code} with a body that is not JSON ({shown!r});"
            " is the address an eventlight server?"
        ) from None


def _error(status: int, content: bytes, request: str = "", where: str = "") -> E.EventlightError:
    """The error an error answer stands for, built without its class's own constructor.

    ``request`` (``"POST /v1/agl/…"``) and ``where`` (the server) name an answer that is not the
    store server's own (a gateway's 502/504 page, a redirect): its first line follows.
    """
    try:
        body = msgspec.json.decode(content)
        detail, name = str(body.get("detail") or ""), str(body.get("error_type") or "")
    except (msgspec.DecodeError, AttributeError):
        detail, name = "", ""
    if not detail:
        first = next((line.strip() for line in content[:300].decode(errors="replace").splitlines() if line.strip()), "")
        detail = f"{request}: HTTP {status} from {where or 'the server'}" + (f" ({first})" if first else "")
    cls = _BY_NAME.get(name) or _BY_STATUS.get(status) or E.EventlightError
    exc = cls.__new__(cls)
    Exception.__init__(exc, detail)
    if isinstance(exc, E.ServiceUnavailableError):
        exc.server, exc.detail = where, detail
    return exc


class Transport:
    """Requests to ``base_url`` (``http://host:port``) with the retry rules above."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None,
        retry_delays: Sequence[float],
        request_timeout_s: float,
        connect_timeout_s: float,
    ):
        self.base_url = base_url.rstrip("/")
        self.retry_delays = tuple(float(d) for d in retry_delays)
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._clients: dict[int, httpx.AsyncClient] = {}

    def _client(self) -> httpx.AsyncClient:
        key = id(asyncio.get_running_loop())
        client = self._clients.get(key)
        if client is None or client.is_closed:
            timeout = httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s)
            limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
            client = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=timeout, limits=limits)
            self._clients[key] = client
        return client

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Any = None,
        idempotent: bool,
        timeout_s: float | None = None,
    ) -> Any:
        """The decoded JSON answer of ``method path``.

        Raises:
            EventlightError: The error the server answered (its class from ``error_type``).
            ServiceUnavailableError: The server could not be reached (after the retries allowed); for
                a write that was sent but not answered (the connection dropped or timed out after
                the request left) the message says the outcome is unknown: it may have been stored.
        """
        content = msgspec.json.encode(json) if json is not None else None
        headers = {"Content-Type": "application/json"} if content is not None else None
        timeout = httpx.Timeout(timeout_s, connect=self.connect_timeout_s) if timeout_s else None
        last: Exception | None = None
        for delay in (0.0, *self.retry_delays):
            if delay:
                await asyncio.sleep(delay)
            try:
                kwargs: dict[str, Any] = {"content": content, "params": params, "headers": headers}
                if timeout is not None:
                    kwargs["timeout"] = timeout
                response = await self._client().request(method, path, **kwargs)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # never reached the server
                last = e
                continue
            except (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError, httpx.DecodingError) as e:
                last = e
                if idempotent:
                    continue
                break
            if response.is_success:
                return _decoded(response, method, path)
            error = _error(response.status_code, response.content, f"{method} {path}", redact(self.base_url))
            if not idempotent and response.status_code in _GATEWAY_STATUSES:  # a proxy between us gave up
                error = _with_detail(error, f"{error}; {_OUTCOME_UNKNOWN}")
            retry = isinstance(error, E.ConcurrencyError) or (idempotent and response.status_code in _RETRY_STATUSES)
            if not retry:
                raise error
            last = error
        if isinstance(last, E.EventlightError):
            raise last
        where = redact(self.base_url)
        what = f"{method} {path}: {type(last).__name__}" + (f": {last}" if str(last) else "")
        if not idempotent and not isinstance(last, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
            error = E.ServiceUnavailableError(where, what)
            raise _with_detail(error, f"no answer from {where} to {what}; {_OUTCOME_UNKNOWN}") from last
        raise E.ServiceUnavailableError(where, what) from last

    async def close(self) -> None:
        """Close the httpx clients of this loop (others are dropped); idempotent."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            try:
                await client.aclose()
            except RuntimeError:  # made on another, closed loop
                log.debug("dropped an httpx client of another event loop")
