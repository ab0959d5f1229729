"""Spans: ``/spans`` (add, query), ``/spans/search``, ``/spans/next`` (sequence ids)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from eventlight.core.types import Span
from eventlight.server.codec import body, doc, json_response
from eventlight.server.models import (
    FilterLogic,
    NextSequenceIdRequest,
    NextSequenceIdResponse,
    Paginated,
    QuerySpansRequest,
    SortOrder,
)
from eventlight.server.routes.common import check_page, store_of

__all__ = ["router"]

router = APIRouter()


@router.post("/spans", status_code=201, openapi_extra=doc(Span, Span | None, 201))
async def add_span(request: Request) -> Response:
    """``add_span``: the span as recorded, ``null`` when it was a duplicate."""
    span = await body(request, Span)
    return json_response(await store_of(request).add_span(span), 201)


async def _query_spans(request: Request, q: QuerySpansRequest) -> Response:
    check_page(q.limit, q.offset)
    page = await store_of(request).query_spans(
        q.rollout_id,
        q.attempt_id,
        trace_id=q.trace_id,
        trace_id_contains=q.trace_id_contains,
        span_id=q.span_id,
        span_id_contains=q.span_id_contains,
        parent_id=q.parent_id,
        parent_id_contains=q.parent_id_contains,
        name=q.name,
        name_contains=q.name_contains,
        filter_logic=q.filter_logic,
        limit=q.limit,
        offset=q.offset,
        sort_by=q.sort_by,
        sort_order=q.sort_order,
    )
    return json_response(page)


@router.get("/spans", openapi_extra=doc(response=Paginated[Span]))
async def query_spans(
    request: Request,
    rollout_id: str,
    attempt_id: str | None = None,
    trace_id: str | None = None,
    trace_id_contains: str | None = None,
    span_id: str | None = None,
    span_id_contains: str | None = None,
    parent_id: str | None = None,
    parent_id_contains: str | None = None,
    name: str | None = None,
    name_contains: str | None = None,
    filter_logic: FilterLogic = "and",
    limit: int = -1,
    offset: int = 0,
    sort_by: str | None = "sequence_id",
    sort_order: SortOrder = "asc",
) -> Response:
    """``query_spans`` (``attempt_id=latest`` for the latest attempt)."""
    q = QuerySpansRequest(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        trace_id=trace_id,
        trace_id_contains=trace_id_contains,
        span_id=span_id,
        span_id_contains=span_id_contains,
        parent_id=parent_id,
        parent_id_contains=parent_id_contains,
        name=name,
        name_contains=name_contains,
        filter_logic=filter_logic,
        limit=limit,
        offset=offset,
        sort_by=sort_by,
        sort_order=sort_order,
    )
    return await _query_spans(request, q)


@router.post("/spans/search", openapi_extra=doc(QuerySpansRequest, Paginated[Span]))
async def search_spans(request: Request) -> Response:
    """``query_spans``, the filters as a JSON body."""
    return await _query_spans(request, await body(request, QuerySpansRequest))


@router.post("/spans/next", openapi_extra=doc(NextSequenceIdRequest, NextSequenceIdResponse))
async def next_sequence_id(request: Request) -> Response:
    """``get_next_span_sequence_id``."""
    req = await body(request, NextSequenceIdRequest)
    sequence_id = await store_of(request).get_next_span_sequence_id(req.rollout_id, req.attempt_id)
    return json_response(NextSequenceIdResponse(sequence_id=sequence_id))
