"""``GET /metrics``: the store in Prometheus' text format (``prometheus-client``).

Every value is read at scrape time from the store (``eventlight.server.overview``), so the figures
are the namespace's, whoever wrote them, not this process's:

=========================================== ==========================================================
``eventlight_events_published_total``       events on the log (its last position)
``eventlight_events_projected_total``       events the read models hold (the projector's checkpoint)
``eventlight_projector_lag_events``         the difference: events not yet visible to queries
``eventlight_queue_depth``                  rollouts waiting for a runner (``queuing`` + ``requeuing``)
``eventlight_rollouts{status}``             rollouts by status
``eventlight_attempts{status}``             attempts by status
``eventlight_llm_calls_total{model}``       LLM call spans (the ``llm_calls`` view)
``eventlight_llm_tokens_total{model,kind}`` their ``prompt`` and ``completion`` tokens
``eventlight_watchdog_actions_total{action}`` events the watchdog of this process appended
=========================================== ==========================================================
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.responses import Response

from eventlight.server.overview import StoreOverview, overview
from eventlight.server.routes.common import store_of

__all__ = ["render", "router"]

router = APIRouter()


class _Snapshot(Collector):
    """Yields the families of one ``StoreOverview`` (a registry per scrape: nothing is shared)."""

    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def _families(o: StoreOverview) -> Iterator[Metric]:
    yield CounterMetricFamily("eventlight_events_published", "Events on the log (its last position).", o.head_seq)
    yield CounterMetricFamily(
        "eventlight_events_projected", "Events the read models hold (the projector's checkpoint).", o.projected_seq
    )
    yield GaugeMetricFamily("eventlight_projector_lag_events", "Events on the log not yet projected.", o.projector_lag)
    yield GaugeMetricFamily("eventlight_queue_depth", "Rollouts waiting for a runner.", o.queue_depth)
    rollouts = GaugeMetricFamily("eventlight_rollouts", "Rollouts by status.", labels=["status"])
    for status, n in sorted(o.rollouts_by_status.items()):
        rollouts.add_metric([status], n)
    yield rollouts
    attempts = GaugeMetricFamily("eventlight_attempts", "Attempts by status.", labels=["status"])
    for status, n in sorted(o.attempts_by_status.items()):
        attempts.add_metric([status], n)
    yield attempts
    calls = CounterMetricFamily("eventlight_llm_calls", "LLM call spans by model.", labels=["model"])
    tokens = CounterMetricFamily("eventlight_llm_tokens", "Tokens of LLM calls by model.", labels=["model", "kind"])
    for model, usage in sorted(o.llm_by_model.items()):
        calls.add_metric([model], usage.calls)
        tokens.add_metric([model, "prompt"], usage.prompt_tokens)
        tokens.add_metric([model, "completion"], usage.completion_tokens)
    yield calls
    yield tokens
    actions = CounterMetricFamily(
        "eventlight_watchdog_actions", "Events the watchdog of this process appended.", labels=["action"]
    )
    for action, n in sorted(o.watchdog_actions.items()):
        actions.add_metric([action], n)
    yield actions


def render(o: StoreOverview) -> bytes:
    """``o`` in Prometheus' text exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(_families(o)))
    return generate_latest(registry)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """The store's metrics, read now (see the module's table)."""
    return Response(render(await overview(store_of(request))), media_type=CONTENT_TYPE_LATEST)
