"""Workers and the store's own state: ``/workers/*``, ``/statistics``, ``/health``."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from eventlight.core.errors import ServiceUnavailableError
from eventlight.core.types import Worker, WorkerStatus
from eventlight.server.codec import body, doc, json_response
from eventlight.server.errors import one_line
from eventlight.server.models import (
    ErrorBody,
    FilterLogic,
    Paginated,
    QueryWorkersRequest,
    SortOrder,
    UpdateWorkerRequest,
)
from eventlight.server.routes.common import check_page, store_of
from eventlight.store.service import EventStore

__all__ = ["router"]

router = APIRouter()


HEALTH_TIMEOUT_S = 2.0
"""How long ``/health`` waits for each server the store needs (NATS, Postgres) before it counts as down."""


@router.get("/health", openapi_extra=doc(response=dict[str, Any]))
async def health(request: Request) -> Response:
    """Which server answers, and whether the servers its store needs answer too.

    200 ``{"status": "ok", "instance": ..., "namespace": ..., "store": ...}`` when they do (the
    in-memory store needs none). 503 when one does not answer within ``HEALTH_TIMEOUT_S``
    (``EventStore.dependencies_down``): ``{"status": "unavailable", <the same identity>, "down":
    {"nats" | "postgres": why}, "detail", "error_type": "ServiceUnavailableError", "retryable": true}``,
    an ``ErrorBody`` (``LightningStoreClient.health`` raises it as ``ServiceUnavailableError``).
    """
    store = store_of(request)
    down = await store.dependencies_down(HEALTH_TIMEOUT_S) if isinstance(store, EventStore) else {}
    if not down:
        return json_response({"status": "ok", **request.app.state.identity})
    detail = one_line("; ".join(f"{name} is down: {why}" for name, why in down.items()))
    error = ErrorBody(detail=detail, error_type=ServiceUnavailableError.__name__, retryable=True)
    body = {"status": "unavailable", **request.app.state.identity, "down": down, **msgspec.structs.asdict(error)}
    return json_response(body, status_code=503)


@router.get("/statistics", openapi_extra=doc(response=dict[str, Any]))
async def statistics(request: Request) -> Response:
    """``statistics()`` of the store."""
    return json_response(await store_of(request).statistics())


async def _query_workers(request: Request, q: QueryWorkersRequest) -> Response:
    check_page(q.limit, q.offset)
    page = await store_of(request).query_workers(
        status_in=q.status_in,
        worker_id_contains=q.worker_id_contains,
        filter_logic=q.filter_logic,
        sort_by=q.sort_by,
        sort_order=q.sort_order,
        limit=q.limit,
        offset=q.offset,
    )
    return json_response(page)


@router.get("/workers", openapi_extra=doc(response=Paginated[Worker]))
async def query_workers(
    request: Request,
    status_in: Annotated[list[WorkerStatus] | None, Query()] = None,
    worker_id_contains: str | None = None,
    limit: int = -1,
    offset: int = 0,
    sort_by: str | None = None,
    sort_order: SortOrder = "asc",
    filter_logic: FilterLogic = "and",
) -> Response:
    """``query_workers`` (``status_in`` repeats)."""
    q = QueryWorkersRequest(
        status_in=status_in,
        worker_id_contains=worker_id_contains,
        limit=limit,
        offset=offset,
        sort_by=sort_by,
        sort_order=sort_order,
        filter_logic=filter_logic,
    )
    return await _query_workers(request, q)


@router.post("/workers/search", openapi_extra=doc(QueryWorkersRequest, Paginated[Worker], optional=True))
async def search_workers(request: Request) -> Response:
    """``query_workers``, the filters as a JSON body."""
    return await _query_workers(request, await body(request, QueryWorkersRequest, empty=QueryWorkersRequest()))


@router.get("/workers/{worker_id}", openapi_extra=doc(response=Worker | None))
async def get_worker(request: Request, worker_id: str) -> Response:
    """``get_worker_by_id``: ``null`` when unknown."""
    return json_response(await store_of(request).get_worker_by_id(worker_id))


@router.post("/workers/{worker_id}", openapi_extra=doc(UpdateWorkerRequest, Worker, optional=True))
async def update_worker(request: Request, worker_id: str) -> Response:
    """``update_worker``: a heartbeat, with ``heartbeat_stats`` when given."""
    req = await body(request, UpdateWorkerRequest, empty=UpdateWorkerRequest())
    return json_response(await store_of(request).update_worker(worker_id, req.heartbeat_stats))
