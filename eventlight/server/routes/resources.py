"""Resources: ``/resources``, ``/resources/latest``, ``/resources/{resources_id}``."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from eventlight.core.types import NamedResources, ResourcesUpdate
from eventlight.server.codec import body, doc, json_response
from eventlight.server.models import Paginated, SortOrder
from eventlight.server.routes.common import check_page, store_of

__all__ = ["router"]

router = APIRouter()


@router.get("/resources", openapi_extra=doc(response=Paginated[ResourcesUpdate]))
async def query_resources(
    request: Request,
    resources_id: str | None = None,
    resources_id_contains: str | None = None,
    limit: int = -1,
    offset: int = 0,
    sort_by: str | None = None,
    sort_order: SortOrder = "asc",
) -> Response:
    """``query_resources``."""
    check_page(limit, offset)
    page = await store_of(request).query_resources(
        resources_id=resources_id,
        resources_id_contains=resources_id_contains,
        sort_by=sort_by,
        sort_order=sort_order,
        limit=limit,
        offset=offset,
    )
    return json_response(page)


@router.post("/resources", status_code=201, openapi_extra=doc(NamedResources, ResourcesUpdate, 201))
async def add_resources(request: Request) -> Response:
    """``add_resources``: a new snapshot (``{name: {"resource_type": "llm", ...}}``), now the latest."""
    resources = await body(request, NamedResources)
    return json_response(await store_of(request).add_resources(resources), 201)


@router.get("/resources/latest", openapi_extra=doc(response=ResourcesUpdate | None))
async def latest_resources(request: Request) -> Response:
    """``get_latest_resources``: ``null`` when there is none."""
    return json_response(await store_of(request).get_latest_resources())


@router.post("/resources/{resources_id}", openapi_extra=doc(NamedResources, ResourcesUpdate))
async def update_resources(request: Request, resources_id: str) -> Response:
    """``update_resources``: replace (or create) the snapshot ``resources_id``."""
    resources = await body(request, NamedResources)
    return json_response(await store_of(request).update_resources(resources_id, resources))


@router.get("/resources/{resources_id}", openapi_extra=doc(response=ResourcesUpdate | None))
async def get_resources(request: Request, resources_id: str) -> Response:
    """``get_resources_by_id``: ``null`` when unknown."""
    return json_response(await store_of(request).get_resources_by_id(resources_id))
