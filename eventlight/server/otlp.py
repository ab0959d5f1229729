"""``POST /v1/traces``: OTLP/HTTP trace export into the store, so any OpenTelemetry SDK or Collector can send.

The spans of each attempt go to the log together (``add_spans_numbered`` when the store allocates
their sequence ids, one append on JetStream; ``add_many_spans`` when they carry their own), the
attempts of one request concurrently. Spans that cannot be taken (no rollout or attempt id, an
attempt the store does not know, a span the store refuses) are counted and explained in
``partial_success`` of a 200 answer, as the OTLP specification asks; the others are recorded (a
sequence id that is not used, ``otlp_spans``, is said there too, with no span counted rejected; so
is a request that holds no ``resourceSpans`` but fields of other names, a typo such as
``resourceSpan``, or of other numbers in protobuf: they are ignored, as the specification asks, and
the log says so once per field). A
span id its attempt already has, sent earlier or again within the same request, is recorded once
and is no rejection (the store drops the copy with Agent-lightning's warning line: an exporter's
retry is no failure).
Wire format, content types and whole-request errors: ``eventlight.server.otlp_wire``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from fastapi import APIRouter, Request
from starlette.responses import Response

from eventlight.core.errors import ConcurrencyError, InvalidInputError, NotFoundError
from eventlight.core.types import Span
from eventlight.server.errors import error_response
from eventlight.server.limits import RETRY_AFTER_S
from eventlight.server.otlp_spans import SpanNote, spans_from_request
from eventlight.server.otlp_wire import OTLP_PATH, PROTOBUF, OtlpError, encode_response, parse_request
from eventlight.server.routes.common import store_of
from eventlight.store.base import LightningStore

__all__ = ["ingest", "router"]

log = logging.getLogger(__name__)

router = APIRouter()

_MAX_REASONS = 20
_MAX_WARNED_FIELDS = 100
_warned_fields: set[str] = set()
"""Ignored fields already logged (OTLP/JSON names quoted, protobuf numbers ``#2``): each is logged once (at most
``_MAX_WARNED_FIELDS`` of them), so a misconfigured exporter does not flood the log."""


async def _record_attempt(store: LightningStore, rollout_id: str, attempt_id: str, spans: list[Span]) -> list[SpanNote]:
    """Record one attempt's spans; those the store refused, each with its reason.

    A group the store refuses as bad input is sent again span by span, so that one bad span (over
    the 8 MiB an event holds, a sequence id out of range) does not take the attempt's good spans
    with it; the runner's tracer does the same (``eventlight.tracer``). An unknown attempt or a
    conflict refuses every span not yet recorded, with that reason.
    """

    async def numbered_by_store(group: list[Span]) -> None:
        await store.add_spans_numbered(rollout_id, attempt_id, group)

    async def own_numbers(group: list[Span]) -> None:
        await store.add_many_spans(group)

    groups = [
        (numbered_by_store, [s for s in spans if s.sequence_id <= 0]),
        (own_numbers, [s for s in spans if s.sequence_id > 0]),
    ]
    refused: dict[int, SpanNote] = {}  # by id() of the span
    recorded: set[int] = set()
    try:
        for add, group in groups:
            if not group:
                continue
            try:  # (NotFoundError is no InvalidInputError: an unknown attempt ends the loop)
                await add(group)
                recorded.update(map(id, group))
                continue
            except InvalidInputError as e:
                if len(group) == 1:
                    refused[id(group[0])] = _rejected(group[0], e)
                    continue
            for span in group:
                try:
                    await add([span])
                    recorded.add(id(span))
                except InvalidInputError as e:
                    refused[id(span)] = _rejected(span, e)
    except (NotFoundError, ConcurrencyError) as e:
        for span in spans:
            if id(span) not in recorded and id(span) not in refused:
                refused[id(span)] = _rejected(span, e)
    return list(refused.values())


def _rejected(span: Span, error: Exception) -> SpanNote:
    return SpanNote(span.span_id, span.name, str(error))


async def ingest(store: LightningStore, spans: list[Span]) -> list[SpanNote]:
    """Record ``spans`` attempt by attempt; the spans the store refused, each with its reason.

    Raises:
        ServiceUnavailableError: NATS or Postgres did not answer (503: the exporter retries).
    """
    by_attempt: dict[tuple[str, str], list[Span]] = defaultdict(list)
    for span in spans:
        by_attempt[(span.rollout_id, span.attempt_id)].append(span)
    refused = await asyncio.gather(*(_record_attempt(store, r, a, group) for (r, a), group in by_attempt.items()))
    return [r for group in refused for r in group]


def _listed(what: str, notes: list[SpanNote]) -> str:
    shown = "; ".join(n.describe() for n in notes[:_MAX_REASONS])
    more = f"; and {len(notes) - _MAX_REASONS} more" if len(notes) > _MAX_REASONS else ""
    return f"{len(notes)} span(s) {what}: {shown}{more}"


def _message(rejected: list[SpanNote], renumbered: list[SpanNote]) -> str:
    """``partial_success.error_message``: the spans rejected, then those recorded with a sequence id
    the store allocated instead of theirs (a warning: OTLP lets a fully accepted request carry one)."""
    parts = [_listed("rejected", rejected)] if rejected else []
    if renumbered:
        parts.append(_listed("recorded with a sequence id the store allocated", renumbered))
    return ". ".join(parts)


def _ignored(names: list[str]) -> str:
    """``partial_success.error_message`` for a request of no ``resourceSpans``, only fields of other
    names (OTLP/JSON, quoted and shortened) or numbers (protobuf, ``#2``), ignored as the OTLP
    specification asks; logged once per field."""
    more = f" and {len(names) - _MAX_REASONS} more" if len(names) > _MAX_REASONS else ""
    message = (
        f"no resourceSpans in the request, so no span was recorded: its field(s) {', '.join(names[:_MAX_REASONS])}"
        f"{more} are not ExportTraceServiceRequest fields and were ignored"
    )
    new = [n for n in dict.fromkeys(names) if n not in _warned_fields][: _MAX_WARNED_FIELDS - len(_warned_fields)]
    if new:
        _warned_fields.update(new)
        log.warning("OTLP export: %s (logged once per field name)", message)
    return message


@router.post(
    OTLP_PATH,
    summary="OTLP/HTTP trace export",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
                "application/json": {"schema": {"type": "object", "description": "OTLP/JSON request"}},
            },
        },
        "responses": {"200": {"description": "ExportTraceServiceResponse, partial_success when spans were rejected"}},
    },
)
async def export_traces(request: Request) -> Response:
    """Take an ``ExportTraceServiceRequest`` (protobuf or JSON, optionally gzip) and record its spans.

    A gzip body's inflated copy counts with the request bodies held at once (``BodyReads.holding``)
    until the request is answered: 503 with ``Retry-After`` when it would pass ``max_buffered_bytes``.
    """
    state = request.app.state
    with state.body_reads.holding(state.max_buffered_bytes) as hold:
        try:
            parsed, kind, ignored = parse_request(
                await request.body(),
                request.headers.get("content-type"),
                request.headers.get("content-encoding"),
                state.max_body_bytes,
                hold,
            )
        except OtlpError as e:  # a Status in the request's encoding, as every error of this route
            return _refusal(e, request)
        spans, rejected, renumbered = spans_from_request(parsed)
        rejected += await ingest(store_of(request), spans)
    refused = {r.span_id for r in rejected}
    message = _message(rejected, [n for n in renumbered if n.span_id not in refused])
    if message:
        log.warning("OTLP export: %s", message)
    if ignored:
        message = ". ".join(filter(None, (message, _ignored(ignored))))
    return Response(encode_response(kind, len(rejected), message), media_type=kind)


def _refusal(e: OtlpError, request: Request) -> Response:
    response = error_response(e.status, str(e), type(e).__name__, retryable=e.status == 503, scope=request.scope)
    if e.status == 503:  # the bytes held at once: one request answered frees its bytes
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response
