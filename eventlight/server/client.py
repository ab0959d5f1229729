"""``LightningStoreClient``: the store API over HTTP, against ``eventlight serve`` (Agent-lightning 0.3.0's name).

Every ``LightningStore`` method is one request to the ``/v1/agl`` routes (``add_many_spans`` and
``get_many_span_sequence_ids`` are one request per item, as 0.3.0's client does, the server having
no bulk route). Errors come back as the server raised them (``RolloutNotFoundError`` is still a
``NotFoundError`` and a ``ValueError``); retries: ``eventlight.server.transport``.

Where it differs from 0.3.0's client: errors are raised, not turned into ``None`` (``dequeue_rollout``
and the ``get_*`` methods answer ``None`` only for "nothing there", as the store does);
``wait_for_rollouts`` accepts any timeout (a long wait is several requests of at most 20 s).
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from typing import Any, Literal, TypeVar

import msgspec

from eventlight.core.commands import UNSET
from eventlight.core.errors import EventlightError, InvalidInputError, InvalidTypeError, RolloutNotFoundError
from eventlight.core.types import (
    Attempt,
    AttemptedRollout,
    EnqueueRolloutRequest,
    NamedResources,
    PaginatedResult,
    ResourcesUpdate,
    Rollout,
    RolloutConfig,
    Span,
    Worker,
)
from eventlight.server.transport import Transport
from eventlight.settings import server_token_from_env
from eventlight.store.base import LightningStore, LightningStoreCapabilities

__all__ = ["LightningStoreClient"]

T = TypeVar("T")

_WAIT_CHUNK_S = 20.0
_AGL = "/v1/agl"


def _unexpected(what: str, data: Any, why: str = "") -> EventlightError:
    """The error for a success answer of another shape than the route's (another server, or a version
    that does not match)."""
    shown = msgspec.json.encode(data)[:120].decode(errors="replace")
    return EventlightError(
        f"the server answered with something that is not {what} ({why + '; ' if why else ''}got {shown});"
        " is the address an eventlight or Agent-lightning store server of a matching version?"
    )


def _convert(data: Any, kind: type[T]) -> T:
    """A decoded answer as ``kind``.

    Raises:
        EventlightError: The answer has another shape.
    """
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as e:
        raise _unexpected(f"a {kind.__name__}", data, str(e)) from None


def _list(data: Any, kind: type[T]) -> list[T]:
    """A decoded answer that is a JSON array of ``kind``.

    Raises:
        EventlightError: The answer is not an array, or an item has another shape.
    """
    if not isinstance(data, list):
        raise _unexpected(f"a list of {kind.__name__}", data)
    return [_convert(x, kind) for x in data]


def _rollout(item: Any) -> Rollout:
    return _convert(item, AttemptedRollout if isinstance(item, dict) and "attempt" in item else Rollout)


def _page(data: Any, item: type[T]) -> PaginatedResult[T]:
    """A decoded ``{"items", "limit", "offset", "total"}`` answer.

    Raises:
        EventlightError: The answer has another shape.
    """
    fields = ("items", "limit", "offset", "total")
    if not isinstance(data, dict) or not all(k in data for k in fields) or not isinstance(data["items"], list):
        raise _unexpected(f"a page of {item.__name__}", data)
    convert: Any = _rollout if item is Rollout else (lambda x: _convert(x, item))
    items = [convert(x) for x in data["items"]]
    limit, offset, total = (_convert(data[k], int) for k in fields[1:])
    return PaginatedResult(items, limit=limit, offset=offset, total=total)


def _seg(name: str, value: Any, *, routes: tuple[str, ...] = ()) -> str:
    """An id as one URL path segment, percent-encoded: ``w?x=1`` must reach the server as that id,
    not as worker ``w`` with a query string (nor ``.`` as the collection itself). An id with ``/``
    is refused: servers decode ``%2F`` before routing, so it would reach another route.

    Args:
        routes: Words that are a route of their own at this place (``POST /workers/search``):
            such an id cannot be told from the route, so it is refused rather than sent.

    Raises:
        InvalidTypeError: The id is not a string.
        InvalidInputError: The id is empty, holds ``/``, or is one of ``routes``.
    """
    if not isinstance(value, str):
        raise InvalidTypeError(f"{name} must be a string, not {type(value).__name__}: {value!r}")
    if not value:
        raise InvalidInputError(f"{name} must not be empty")
    if value in routes:
        raise InvalidInputError(
            f"{name} {value!r} cannot be sent over HTTP: it names a route of Agent-lightning's API at that place"
        )
    if "/" in value:  # servers decode %2F before routing: 'ro-1/attempts' would start an attempt
        raise InvalidInputError(f"{name} {value!r} cannot be sent over HTTP: no id holds '/'")
    if value in (".", ".."):  # a client (httpx too) removes dot segments from a path
        return value.replace(".", "%2E")
    return urllib.parse.quote(value, safe="")


def _rollout_seg(rollout_id: Any, *, routes: tuple[str, ...] = ()) -> str:
    """A rollout id as a path segment; one that is not a string, or empty, names no rollout.

    Raises:
        RolloutNotFoundError: ``rollout_id`` is not a string or is empty (as the stores answer).
        InvalidInputError: The id holds ``/`` or is one of ``routes`` (see ``_seg``).
    """
    if not isinstance(rollout_id, str) or not rollout_id:
        raise RolloutNotFoundError(rollout_id)
    return _seg("rollout_id", rollout_id, routes=routes)


def _names_nothing(value: Any) -> bool:
    """An id no entity can have: not a string, or empty (a ``get_*_by_id`` answers ``None``, as the stores do)."""
    return not isinstance(value, str) or not value


def _set(**fields: Any) -> dict[str, Any]:
    """The fields that are not ``UNSET`` (what an update sends)."""
    return {k: msgspec.to_builtins(v) for k, v in fields.items() if v is not UNSET}


class LightningStoreClient(LightningStore):
    """A store reached over HTTP (``eventlight serve``, or anything serving 0.3.0's ``/v1/agl`` routes).

    Args:
        server_address: ``http://host:port`` of the server.
        token: Bearer token; default ``$EVENTLIGHT_SERVER_TOKEN`` (or the file ``$EVENTLIGHT_SERVER_TOKEN_FILE``
            names) when set.
        retry_delays: Seconds between tries of a request that may be retried (see the transport).
        request_timeout: Seconds one request may take.
        connection_timeout: Seconds to connect.

    Raises:
        InvalidInputError: ``EVENTLIGHT_SERVER_TOKEN_FILE`` cannot be read or is empty.
    """

    def __init__(
        self,
        server_address: str,
        *,
        token: str | None = None,
        retry_delays: Sequence[float] = (0.2, 0.5, 1.0, 2.0),
        request_timeout: float = 30.0,
        connection_timeout: float = 5.0,
    ):
        self.server_address = server_address.rstrip("/")
        self._http = Transport(
            self.server_address,
            token=token if token is not None else server_token_from_env(),
            retry_delays=retry_delays,
            request_timeout_s=request_timeout,
            connect_timeout_s=connection_timeout,
        )

    @property
    def capabilities(self) -> LightningStoreCapabilities:
        return {"async_safe": True, "thread_safe": False, "zero_copy": True, "otlp_traces": True}

    def otlp_traces_endpoint(self) -> str:
        return f"{self.server_address}/v1/traces"

    async def _get(self, path: str, params: Any = None) -> Any:
        return await self._http.request("GET", _AGL + path, params=params, idempotent=True)

    async def _post(self, path: str, body: Any = None, *, safe: bool = False, timeout_s: float | None = None) -> Any:
        return await self._http.request("POST", _AGL + path, json=body, idempotent=safe, timeout_s=timeout_s)

    async def health(self) -> dict[str, Any]:
        """What ``/v1/agl/health`` says while its store's servers answer: ``{"status": "ok", ...}``
        and which server answers (``instance``, ``namespace``, ``store``).

        Raises:
            ServiceUnavailableError: The server answered 503 (still after the retries of a read):
                NATS or Postgres of its store is down, and the message names which
                (``"postgres is down: ..."``); or the server itself cannot be reached.
        """
        return _convert(await self._get("/health"), dict[str, Any])

    async def statistics(self) -> dict[str, Any]:
        return _convert(await self._get("/statistics"), dict[str, Any])

    async def close(self) -> None:
        await self._http.close()

    # -- rollouts and the queue ------------------------------------------------------------

    async def enqueue_rollout(
        self,
        input: Any,
        mode: str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Rollout:
        request = EnqueueRolloutRequest(
            input=input, mode=mode, resources_id=resources_id, config=config, metadata=metadata
        )
        return (await self.enqueue_many_rollouts([request]))[0]

    async def enqueue_many_rollouts(self, rollouts: Sequence[EnqueueRolloutRequest]) -> list[Rollout]:
        if not rollouts:
            return []
        data = await self._post("/queues/rollouts/enqueue", {"rollouts": msgspec.to_builtins(list(rollouts))})
        if not isinstance(data, list):
            raise _unexpected("a list of Rollout", data)
        return [_rollout(x) for x in data]

    async def start_rollout(
        self,
        input: Any,
        mode: str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | None = None,
        metadata: dict[str, Any] | None = None,
        worker_id: str | None = None,
    ) -> AttemptedRollout:
        body = {
            "input": input,
            "mode": mode,
            "resources_id": resources_id,
            "config": msgspec.to_builtins(config),
            "metadata": metadata,
            "worker_id": worker_id,
        }
        return _convert(await self._post("/rollouts", body), AttemptedRollout)

    async def dequeue_rollout(self, worker_id: str | None = None) -> AttemptedRollout | None:
        got = await self.dequeue_many_rollouts(limit=1, worker_id=worker_id)
        return got[0] if got else None

    async def dequeue_many_rollouts(self, *, limit: int = 1, worker_id: str | None = None) -> list[AttemptedRollout]:
        if limit <= 0:
            return []
        data = await self._post("/queues/rollouts/dequeue", {"limit": limit, "worker_id": worker_id})
        return _list(data, AttemptedRollout)

    async def start_attempt(self, rollout_id: str, worker_id: str | None = None) -> AttemptedRollout:
        data = await self._post(f"/rollouts/{_rollout_seg(rollout_id)}/attempts", {"worker_id": worker_id})
        return _convert(data, AttemptedRollout)

    async def update_rollout(
        self,
        rollout_id: str,
        input: Any = UNSET,
        mode: Any = UNSET,
        resources_id: Any = UNSET,
        status: Any = UNSET,
        config: Any = UNSET,
        metadata: Any = UNSET,
    ) -> Rollout:
        body = _set(input=input, mode=mode, resources_id=resources_id, status=status, config=config, metadata=metadata)
        return _convert(await self._post(f"/rollouts/{_rollout_seg(rollout_id, routes=('search',))}", body), Rollout)

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        status: Any = UNSET,
        worker_id: Any = UNSET,
        last_heartbeat_time: Any = UNSET,
        metadata: Any = UNSET,
    ) -> Attempt:
        body = _set(status=status, worker_id=worker_id, last_heartbeat_time=last_heartbeat_time, metadata=metadata)
        path = f"/rollouts/{_rollout_seg(rollout_id)}/attempts/{_seg('attempt_id', attempt_id, routes=('search',))}"
        return _convert(await self._post(path, body), Attempt)

    # -- reads -----------------------------------------------------------------------------

    async def query_rollouts(
        self,
        *,
        status_in: Sequence[str] | None = None,
        rollout_id_in: Sequence[str] | None = None,
        rollout_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
        status: Sequence[str] | None = None,
        rollout_ids: Sequence[str] | None = None,
    ) -> PaginatedResult[Rollout]:
        status_in = status_in if status_in is not None else status
        rollout_id_in = rollout_id_in if rollout_id_in is not None else rollout_ids
        body = {
            "status_in": list(status_in) if status_in is not None else None,
            "rollout_id_in": list(rollout_id_in) if rollout_id_in is not None else None,
            "rollout_id_contains": rollout_id_contains,
            "filter_logic": filter_logic,
            "sort_by": sort_by,
            "sort_order": sort_order,
            "limit": limit,
            "offset": offset,
        }
        return _page(await self._post("/rollouts/search", body, safe=True), Rollout)

    async def get_rollout_by_id(self, rollout_id: str) -> Rollout | None:
        if _names_nothing(rollout_id):
            return None
        data = await self._get(f"/rollouts/{_rollout_seg(rollout_id)}")
        return None if data is None else _rollout(data)

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Attempt]:
        body = {"sort_by": sort_by, "sort_order": sort_order, "limit": limit, "offset": offset}
        return _page(
            await self._post(f"/rollouts/{_rollout_seg(rollout_id)}/attempts/search", body, safe=True), Attempt
        )

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        data = await self._get(f"/rollouts/{_rollout_seg(rollout_id)}/attempts/latest")
        return None if data is None else _convert(data, Attempt)

    async def wait_for_rollouts(self, *, rollout_ids: list[str], timeout: float | None = None) -> list[Rollout]:
        if isinstance(rollout_ids, (str, bytes)) or not isinstance(rollout_ids, Iterable):
            raise InvalidTypeError(f"rollout_ids must be a list of rollout ids, got {rollout_ids!r:.80}")
        rollout_ids = list(rollout_ids)
        for rollout_id in rollout_ids:
            if not isinstance(rollout_id, str):
                raise RolloutNotFoundError(rollout_id)
        deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
        while True:
            left = _WAIT_CHUNK_S if deadline is None else max(0.0, deadline - time.monotonic())
            chunk = min(left, _WAIT_CHUNK_S)
            body = {"rollout_ids": list(rollout_ids), "timeout": chunk}
            data = await self._post("/waits/rollouts", body, safe=True, timeout_s=chunk + 15.0)
            if not isinstance(data, list):
                raise _unexpected("a list of Rollout", data)
            done = [_rollout(x) for x in data]
            if len(done) >= len(set(rollout_ids)) or (deadline is not None and time.monotonic() >= deadline):
                return done
            await asyncio.sleep(0)

    # -- spans -----------------------------------------------------------------------------

    async def add_span(self, span: Span) -> Span | None:
        data = await self._post("/spans", msgspec.to_builtins(span))
        return None if data is None else _convert(data, Span)

    async def add_many_spans(self, spans: Sequence[Span]) -> list[Span]:
        added = [await self.add_span(span) for span in spans]
        return [s for s in added if s is not None]

    async def get_next_span_sequence_id(self, rollout_id: str, attempt_id: str) -> int:
        data = await self._post("/spans/next", {"rollout_id": rollout_id, "attempt_id": attempt_id})
        if not isinstance(data, dict) or not isinstance(data.get("sequence_id"), int):
            raise _unexpected('{"sequence_id": <int>}', data)
        return int(data["sequence_id"])

    async def get_many_span_sequence_ids(self, rollout_attempt_ids: Sequence[tuple[str, str]]) -> list[int]:
        return [await self.get_next_span_sequence_id(r, a) for r, a in rollout_attempt_ids]

    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
        *,
        trace_id: str | None = None,
        trace_id_contains: str | None = None,
        span_id: str | None = None,
        span_id_contains: str | None = None,
        parent_id: str | None = None,
        parent_id_contains: str | None = None,
        name: str | None = None,
        name_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        limit: int = -1,
        offset: int = 0,
        sort_by: str | None = "sequence_id",
        sort_order: Literal["asc", "desc"] = "asc",
    ) -> PaginatedResult[Span]:
        body = {
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "trace_id": trace_id,
            "trace_id_contains": trace_id_contains,
            "span_id": span_id,
            "span_id_contains": span_id_contains,
            "parent_id": parent_id,
            "parent_id_contains": parent_id_contains,
            "name": name,
            "name_contains": name_contains,
            "filter_logic": filter_logic,
            "limit": limit,
            "offset": offset,
            "sort_by": sort_by,
            "sort_order": sort_order,
        }
        return _page(await self._post("/spans/search", body, safe=True), Span)

    # -- resources -------------------------------------------------------------------------

    async def add_resources(self, resources: NamedResources) -> ResourcesUpdate:
        return _convert(await self._post("/resources", msgspec.to_builtins(resources)), ResourcesUpdate)

    async def update_resources(self, resources_id: str, resources: NamedResources) -> ResourcesUpdate:
        data = await self._post(f"/resources/{_seg('resources_id', resources_id)}", msgspec.to_builtins(resources))
        return _convert(data, ResourcesUpdate)

    async def get_resources_by_id(self, resources_id: str) -> ResourcesUpdate | None:
        if _names_nothing(resources_id):
            return None
        data = await self._get(f"/resources/{_seg('resources_id', resources_id, routes=('latest',))}")
        return None if data is None else _convert(data, ResourcesUpdate)

    async def get_latest_resources(self) -> ResourcesUpdate | None:
        data = await self._get("/resources/latest")
        return None if data is None else _convert(data, ResourcesUpdate)

    async def query_resources(
        self,
        *,
        resources_id: str | None = None,
        resources_id_contains: str | None = None,
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[ResourcesUpdate]:
        params = {"resources_id": resources_id, "resources_id_contains": resources_id_contains, "sort_by": sort_by}
        query = {k: v for k, v in params.items() if v is not None} | {
            "sort_order": sort_order,
            "limit": limit,
            "offset": offset,
        }
        return _page(await self._get("/resources", query), ResourcesUpdate)

    # -- workers ---------------------------------------------------------------------------

    async def update_worker(self, worker_id: str, heartbeat_stats: Any = UNSET) -> Worker:
        return _convert(
            await self._post(
                f"/workers/{_seg('worker_id', worker_id, routes=('search',))}", _set(heartbeat_stats=heartbeat_stats)
            ),
            Worker,
        )

    async def get_worker_by_id(self, worker_id: str) -> Worker | None:
        if _names_nothing(worker_id):
            return None
        data = await self._get(f"/workers/{_seg('worker_id', worker_id)}")
        return None if data is None else _convert(data, Worker)

    async def query_workers(
        self,
        *,
        status_in: Sequence[str] | None = None,
        worker_id_contains: str | None = None,
        filter_logic: Literal["and", "or"] = "and",
        sort_by: str | None = None,
        sort_order: Literal["asc", "desc"] = "asc",
        limit: int = -1,
        offset: int = 0,
    ) -> PaginatedResult[Worker]:
        body = {
            "status_in": list(status_in) if status_in is not None else None,
            "worker_id_contains": worker_id_contains,
            "filter_logic": filter_logic,
            "sort_by": sort_by,
            "sort_order": sort_order,
            "limit": limit,
            "offset": offset,
        }
        return _page(await self._post("/workers/search", body, safe=True), Worker)
