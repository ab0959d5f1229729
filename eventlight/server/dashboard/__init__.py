"""The dashboard of ``eventlight serve``: ``GET /dashboard`` (one HTML page, plain JS, no build step)
and the JSON routes it polls, under ``/dashboard/api``:

============================================= ===============================================================
``/summary``                                  log head, projector lag, queue depth, rollouts and attempts by
                                              status, workers (alive by heartbeat age, ``eventlight.store.liveness``)
``/rollouts?status=…&q=…&limit=…``            rollouts, newest first (``status`` repeats; ``q``: part of the id)
``/rollouts/{rollout_id}/attempts``           a rollout's attempts (start, end, status, worker): the timeline
``/rollouts/{rollout_id}/attempts/{id}/spans`` an attempt's spans (ids, parent, times, status, attributes)
``/rewards``                                  mean final reward per resources version and mode
                                              (the ``reward_by_resources`` view)
============================================= ===============================================================

Every answer is read from the store when asked (its queries or the SQL views), so the page shows
what the log holds, whoever wrote it; it polls every two seconds.
"""

from __future__ import annotations

import time
from importlib.resources import files
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.responses import HTMLResponse, Response

from eventlight.core.errors import InvalidInputError
from eventlight.core.types import ROLLOUT_STATUSES
from eventlight.server.codec import json_response
from eventlight.server.overview import overview, reward_by_resources
from eventlight.server.routes.common import store_of
from eventlight.store.liveness import LIVE_HEARTBEAT_S, is_alive, stopped_at

__all__ = ["router"]

router = APIRouter(prefix="/dashboard", include_in_schema=False)

MAX_ROLLOUTS = 500


def _page() -> str:
    return (files(__package__) / "page.html").read_text(encoding="utf-8")


@router.get("")
async def page() -> HTMLResponse:
    """The dashboard page."""
    return HTMLResponse(_page(), headers={"Cache-Control": "no-cache"})


@router.get("/api/summary")
async def summary(request: Request) -> Response:
    """Log head, projector lag, queue depth, counts by status, and the workers (live first)."""
    store = store_of(request)
    o = await overview(store)
    now = time.time()
    workers = [
        {
            "worker_id": w.worker_id,
            "status": w.status,
            "alive": is_alive(w, now),
            "stopped": stopped_at(w) is not None,
            "heartbeat_age_s": None if w.last_heartbeat_time is None else max(0.0, now - w.last_heartbeat_time),
            "current_rollout_id": w.current_rollout_id,
        }
        for w in await store.query_workers()
    ]
    workers.sort(key=lambda w: (not w["alive"], w["heartbeat_age_s"] is None, w["heartbeat_age_s"] or 0.0))
    return json_response(
        {
            "head_seq": o.head_seq,
            "projected_seq": o.projected_seq,
            "projector_lag": o.projector_lag,
            "queue_depth": o.queue_depth,
            "rollouts_by_status": o.rollouts_by_status,
            "attempts_by_status": o.attempts_by_status,
            "live_heartbeat_s": LIVE_HEARTBEAT_S,
            "workers": workers,
            "time": now,
        }
    )


@router.get("/api/rollouts")
async def rollouts(
    request: Request,
    status: Annotated[list[str] | None, Query()] = None,
    q: str | None = None,
    limit: int = 100,
) -> Response:
    """Rollouts, newest first, filtered by status (any of ``status``) and id (``q``).

    Raises:
        InvalidInputError: An unknown status (400).
    """
    unknown = sorted(set(status or ()) - ROLLOUT_STATUSES)
    if unknown:
        raise InvalidInputError(
            f"unknown rollout status {', '.join(unknown)}; one of {', '.join(sorted(ROLLOUT_STATUSES))}"
        )
    page = await store_of(request).query_rollouts(
        status_in=status or None,
        rollout_id_contains=q or None,
        sort_by="start_time",
        sort_order="desc",
        limit=max(1, min(limit, MAX_ROLLOUTS)),
    )
    return json_response({"items": page.items, "total": page.total})


@router.get("/api/rollouts/{rollout_id}/attempts")
async def attempts(request: Request, rollout_id: str) -> Response:
    """The rollout and its attempts, oldest first (404 for an unknown rollout)."""
    store = store_of(request)
    found = await store.query_attempts(rollout_id)
    return json_response({"rollout": await store.get_rollout_by_id(rollout_id), "attempts": found.items})


@router.get("/api/rollouts/{rollout_id}/attempts/{attempt_id}/spans")
async def spans(request: Request, rollout_id: str, attempt_id: str) -> Response:
    """The attempt's spans by sequence id; the page builds the tree from ``parent_id``."""
    found = await store_of(request).query_spans(rollout_id, attempt_id)
    return json_response([_span(s) for s in found])


def _span(s: Any) -> dict[str, Any]:
    return {
        "span_id": s.span_id,
        "parent_id": s.parent_id,
        "sequence_id": s.sequence_id,
        "name": s.name,
        "start_time": s.start_time,
        "end_time": s.end_time,
        "status_code": s.status.status_code,
        "attributes": s.attributes,
    }


@router.get("/api/rewards")
async def rewards(request: Request) -> Response:
    """Mean final reward per resources version and mode (rollouts without a reward count as 0)."""
    return json_response(await reward_by_resources(store_of(request)))
