"""Rollouts, the queue and attempts: ``/queues/rollouts/*``, ``/rollouts/*``, ``/waits/rollouts``."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from eventlight.core.types import Attempt, AttemptedRollout, Rollout, RolloutStatus
from eventlight.server.codec import body, doc, json_response
from eventlight.server.models import (
    DequeueRequest,
    EnqueueManyRolloutsRequest,
    FilterLogic,
    Paginated,
    QueryAttemptsRequest,
    QueryRolloutsRequest,
    RolloutRequest,
    SortOrder,
    StartAttemptRequest,
    UpdateAttemptRequest,
    UpdateRolloutRequest,
    WaitForRolloutsRequest,
)
from eventlight.server.routes.common import check_page, store_of

__all__ = ["router"]

router = APIRouter()

MAX_WAIT_S = 25.0
"""Longest one ``/waits/rollouts`` request waits (``timeout`` null or larger): the rollouts finished
by then are answered, and a client waiting longer asks again (``LightningStoreClient`` does)."""


@router.post(
    "/queues/rollouts/enqueue", status_code=201, openapi_extra=doc(EnqueueManyRolloutsRequest, list[Rollout], 201)
)
async def enqueue(request: Request) -> Response:
    """``enqueue_rollout`` / ``enqueue_many_rollouts``: the rollouts in ``queuing``, in order."""
    req = await body(request, EnqueueManyRolloutsRequest)
    store = store_of(request)
    if len(req.rollouts) == 1:
        r = req.rollouts[0]
        out = [await store.enqueue_rollout(r.input, r.mode, r.resources_id, r.config, r.metadata)]
    else:
        out = await store.enqueue_many_rollouts(req.rollouts)
    return json_response(out, 201)


@router.post("/queues/rollouts/dequeue", openapi_extra=doc(DequeueRequest, list[AttemptedRollout], optional=True))
async def dequeue(request: Request) -> Response:
    """``dequeue_rollout`` / ``dequeue_many_rollouts``: up to ``limit`` claims, ``[]`` when none wait."""
    req = await body(request, DequeueRequest, empty=DequeueRequest())
    store = store_of(request)
    if req.limit <= 0:
        return json_response([])
    if req.limit == 1:
        one = await store.dequeue_rollout(worker_id=req.worker_id)
        return json_response([one] if one is not None else [])
    return json_response(await store.dequeue_many_rollouts(limit=req.limit, worker_id=req.worker_id))


@router.post("/rollouts", status_code=201, openapi_extra=doc(RolloutRequest, AttemptedRollout, 201))
async def start_rollout(request: Request) -> Response:
    """``start_rollout``: a rollout and its first attempt, bypassing the queue."""
    r = await body(request, RolloutRequest)
    out = await store_of(request).start_rollout(r.input, r.mode, r.resources_id, r.config, r.metadata, r.worker_id)
    return json_response(out, 201)


async def _query_rollouts(request: Request, q: QueryRolloutsRequest) -> Response:
    check_page(q.limit, q.offset)
    page = await store_of(request).query_rollouts(
        status_in=q.status_in,
        rollout_id_in=q.rollout_id_in,
        rollout_id_contains=q.rollout_id_contains,
        filter_logic=q.filter_logic,
        sort_by=q.sort_by,
        sort_order=q.sort_order,
        limit=q.limit,
        offset=q.offset,
    )
    return json_response(page)


@router.get("/rollouts", openapi_extra=doc(response=Paginated[Rollout]))
async def query_rollouts(
    request: Request,
    status_in: Annotated[list[RolloutStatus] | None, Query()] = None,
    rollout_id_in: Annotated[list[str] | None, Query()] = None,
    rollout_id_contains: str | None = None,
    limit: int = -1,
    offset: int = 0,
    sort_by: str | None = None,
    sort_order: SortOrder = "asc",
    filter_logic: FilterLogic = "and",
) -> Response:
    """``query_rollouts`` (``status_in`` and ``rollout_id_in`` repeat)."""
    q = QueryRolloutsRequest(
        status_in=status_in,
        rollout_id_in=rollout_id_in,
        rollout_id_contains=rollout_id_contains,
        limit=limit,
        offset=offset,
        sort_by=sort_by,
        sort_order=sort_order,
        filter_logic=filter_logic,
    )
    return await _query_rollouts(request, q)


@router.post("/rollouts/search", openapi_extra=doc(QueryRolloutsRequest, Paginated[Rollout], optional=True))
async def search_rollouts(request: Request) -> Response:
    """``query_rollouts``, the filters as a JSON body."""
    return await _query_rollouts(request, await body(request, QueryRolloutsRequest, empty=QueryRolloutsRequest()))


def _maybe_attempted() -> dict[str, Any]:
    """``doc`` of an answer that is an ``AttemptedRollout``, a ``Rollout`` (no attempt yet) or ``null``
    (msgspec cannot describe a union of two untagged structs, so the ``anyOf`` is written here)."""
    extra = doc(response=AttemptedRollout | None)
    doc(response=Rollout)  # registers its schema
    refs = [{"$ref": f"#/components/schemas/{t.__name__}"} for t in (AttemptedRollout, Rollout)]
    extra["responses"]["200"]["content"]["application/json"]["schema"] = {"anyOf": [*refs, {"type": "null"}]}
    return extra


@router.get("/rollouts/{rollout_id}", openapi_extra=_maybe_attempted())
async def get_rollout(request: Request, rollout_id: str) -> Response:
    """``get_rollout_by_id``: with its latest attempt when it has one, ``null`` when unknown."""
    return json_response(await store_of(request).get_rollout_by_id(rollout_id))


@router.post("/rollouts/{rollout_id}", openapi_extra=doc(UpdateRolloutRequest, Rollout))
async def update_rollout(request: Request, rollout_id: str) -> Response:
    """``update_rollout``: only the keys given change."""
    u = await body(request, UpdateRolloutRequest)
    out = await store_of(request).update_rollout(
        rollout_id, u.input, u.mode, u.resources_id, u.status, u.config, u.metadata
    )
    return json_response(out)


@router.post(
    "/rollouts/{rollout_id}/attempts",
    status_code=201,
    openapi_extra=doc(StartAttemptRequest, AttemptedRollout, 201, optional=True),
)
async def start_attempt(request: Request, rollout_id: str) -> Response:
    """``start_attempt``: a new attempt outside the queue."""
    req = await body(request, StartAttemptRequest, empty=StartAttemptRequest())
    return json_response(await store_of(request).start_attempt(rollout_id, worker_id=req.worker_id), 201)


async def _query_attempts(request: Request, rollout_id: str, q: QueryAttemptsRequest) -> Response:
    check_page(q.limit, q.offset)
    page = await store_of(request).query_attempts(
        rollout_id, sort_by=q.sort_by, sort_order=q.sort_order, limit=q.limit, offset=q.offset
    )
    return json_response(page)


@router.get("/rollouts/{rollout_id}/attempts", openapi_extra=doc(response=Paginated[Attempt]))
async def query_attempts(
    request: Request,
    rollout_id: str,
    limit: int = -1,
    offset: int = 0,
    sort_by: str | None = "sequence_id",
    sort_order: SortOrder = "asc",
) -> Response:
    """``query_attempts``."""
    q = QueryAttemptsRequest(limit=limit, offset=offset, sort_by=sort_by, sort_order=sort_order)
    return await _query_attempts(request, rollout_id, q)


@router.post(
    "/rollouts/{rollout_id}/attempts/search",
    openapi_extra=doc(QueryAttemptsRequest, Paginated[Attempt], optional=True),
)
async def search_attempts(request: Request, rollout_id: str) -> Response:
    """``query_attempts``, paging as a JSON body."""
    q = await body(request, QueryAttemptsRequest, empty=QueryAttemptsRequest())
    return await _query_attempts(request, rollout_id, q)


@router.get("/rollouts/{rollout_id}/attempts/latest", openapi_extra=doc(response=Attempt | None))
async def latest_attempt(request: Request, rollout_id: str) -> Response:
    """``get_latest_attempt``: ``null`` when the rollout has no attempt."""
    return json_response(await store_of(request).get_latest_attempt(rollout_id))


@router.post("/rollouts/{rollout_id}/attempts/{attempt_id}", openapi_extra=doc(UpdateAttemptRequest, Attempt))
async def update_attempt(request: Request, rollout_id: str, attempt_id: str) -> Response:
    """``update_attempt`` (``attempt_id`` may be ``latest``): only the keys given change."""
    u = await body(request, UpdateAttemptRequest)
    out = await store_of(request).update_attempt(
        rollout_id, attempt_id, u.status, u.worker_id, u.last_heartbeat_time, u.metadata
    )
    return json_response(out)


@router.post("/waits/rollouts", openapi_extra=doc(WaitForRolloutsRequest, list[Rollout]))
async def wait_for_rollouts(request: Request) -> Response:
    """``wait_for_rollouts``: the rollouts finished within ``timeout`` (at most ``MAX_WAIT_S``)."""
    req = await body(request, WaitForRolloutsRequest)
    timeout = MAX_WAIT_S if req.timeout is None else min(max(req.timeout, 0.0), MAX_WAIT_S)
    return json_response(await store_of(request).wait_for_rollouts(rollout_ids=req.rollout_ids, timeout=timeout))
