"""OTLP spans to store spans: which attempt each belongs to, and the fields in eventlight's shape.

As Agent-lightning 0.3.0's ``spans_from_proto``: ``agentlightning.rollout_id``,
``agentlightning.attempt_id`` and ``agentlightning.span_sequence_id`` are read from the span's
attributes, else from its resource's; a span's value that is empty (``""`` or unset) is none, so the
resource's is used (0.3.0 does so for an unset value, but takes ``""`` as the id). Ids are lowercase
hex (trace 32, span 16 digits); times are seconds; ``AnyValue`` becomes Python (bytes as hex,
key-value lists as dicts, arrays as lists). A span without a rollout or attempt id is not taken: it
is reported with its reason, which says where an id is empty (0.3.0 drops it with a log line only).
A missing sequence id is allocated by the store; so is one that is no integer of 0 or more
(negative, fractional as 3.7, a string that is no decimal integer, a boolean), which 0.3.0 logs and
the answer reports (never truncated: 3.7 is not 3; an integral double as 3.0 is 3).
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable
from typing import Any

import msgspec
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from eventlight.core.types import Event, Link, OtelResource, Span, SpanContext, TraceStatus
from eventlight.otel import json_double
from eventlight.semconv import LightningResourceAttributes as Keys

__all__ = ["SpanNote", "spans_from_request"]

_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


class SpanNote(msgspec.Struct, frozen=True):
    """A span and one line about it: why it was not taken, or why its sequence id was not used."""

    span_id: str
    name: str
    reason: str

    def describe(self) -> str:
        return f"span {self.span_id} ({self.name!r}): {self.reason}"


def value_of(v: AnyValue) -> Any:
    """An OTLP ``AnyValue`` as Python; a NaN or infinite double as OTLP/JSON writes it (``"NaN"``,
    ``"Infinity"``, ``"-Infinity"``, proto3's JSON mapping), since the store's JSON has neither."""
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [value_of(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes_of(v.kvlist_value.values)
    if kind == "bytes_value":
        return v.bytes_value.hex()
    if kind == "double_value":
        return json_double(v.double_value)
    return getattr(v, kind)


def attributes_of(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    """OTLP attributes as a flat dict (later keys win, as the SDK does)."""
    return {kv.key: value_of(kv.value) for kv in kvs}


def _seconds(ns: int) -> float | None:
    return ns / 1e9 if ns else None


def _given(value: Any) -> bool:
    """Whether an ``agentlightning.*`` attribute holds a value: not unset (``None``) nor ``""``."""
    return value is not None and value != ""


def _id_text(value: Any) -> str | None:
    return str(value) if _given(value) else None


def _why_missing(keys: list[Keys], span_ids: dict[Keys, Any], resource_attrs: dict[str, Any]) -> str:
    """Why a span names no rollout or attempt: for each of ``keys``, missing from both attribute
    sets, or empty where it is given (an empty value on the span does not hide the resource's)."""
    absent = [k.value for k in keys if k not in span_ids and k.value not in resource_attrs]
    parts = [f"no {' and '.join(absent)} in its span or resource attributes"] if absent else []
    for k in keys:
        if k in span_ids or k.value in resource_attrs:
            on_span, on_resource = (
                _state(given, where)
                for given, where in ((k in span_ids, "span"), (k.value in resource_attrs, "resource"))
            )
            parts.append(f"{k.value} is {on_span} and {on_resource}")
    return "; ".join(parts)


def _state(given: bool, where: str) -> str:
    return f"empty in its {where} attributes" if given else f"missing from its {where} attributes"


def _sequence(value: Any) -> tuple[int, str]:
    """The sequence id ``value`` gives (0: none, the store allocates one) and, when one was given but
    is not used, why (else ``""``).

    An int, an integral double (3.0) or a decimal string (``"7"``) is used; a negative, fractional
    or infinite number, a boolean or any other value is not (Agent-lightning 0.3.0 reads
    ``int(str(value))``, so it too numbers such a span itself, with a warning, and never truncates).
    """
    if value is None:
        return 0, ""
    n: int | None = None
    if isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        try:
            n = int(value)
        except ValueError:
            pass
    if n is None or n < 0:
        return 0, f"{Keys.SPAN_SEQUENCE_ID.value} {reprlib.repr(value)} is not an integer of 0 or more"
    return n, ""


def _convert(pb: PbSpan, rollout_id: str, attempt_id: str, sequence_id: int, resource: OtelResource) -> Span:
    trace_id, span_id = pb.trace_id.hex(), pb.span_id.hex()
    parent_id = pb.parent_span_id.hex() if pb.parent_span_id else None
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=trace_id,
        span_id=span_id,
        parent_id=parent_id,
        name=pb.name,
        status=TraceStatus(status_code=_STATUS.get(pb.status.code, "UNSET"), description=pb.status.message or None),
        attributes=attributes_of(pb.attributes),
        events=[
            Event(name=e.name, attributes=attributes_of(e.attributes), timestamp=_seconds(e.time_unix_nano))
            for e in pb.events
        ],
        links=[
            Link(
                context=SpanContext(trace_id=link.trace_id.hex(), span_id=link.span_id.hex()),
                attributes=attributes_of(link.attributes) or None,
            )
            for link in pb.links
        ],
        start_time=_seconds(pb.start_time_unix_nano),
        end_time=_seconds(pb.end_time_unix_nano),
        context=SpanContext(trace_id=trace_id, span_id=span_id),
        parent=SpanContext(trace_id=trace_id, span_id=parent_id) if parent_id else None,
        resource=resource,
    )


def spans_from_request(request: ExportTraceServiceRequest) -> tuple[list[Span], list[SpanNote], list[SpanNote]]:
    """The spans of ``request`` that name their attempt; those that do not (not taken), each with
    why; and those taken whose sequence id is not used (``_sequence``), each with why.

    A span whose sequence id must be allocated has ``sequence_id == 0`` (the store's own spans
    start at 1).
    """
    spans: list[Span] = []
    rejected: list[SpanNote] = []
    renumbered: list[SpanNote] = []
    for rs in request.resource_spans:
        resource_attrs = attributes_of(rs.resource.attributes)
        resource = OtelResource(attributes=resource_attrs, schema_url=rs.schema_url)
        for ss in rs.scope_spans:
            for pb in ss.spans:
                attrs = {k: v.value for k, v in ((kv.key, kv) for kv in pb.attributes)}
                span_ids = {k: value_of(attrs[k]) for k in Keys if k in attrs}
                ids = {k: span_ids[k] if _given(span_ids.get(k)) else resource_attrs.get(k) for k in Keys}
                rollout_id, attempt_id = _id_text(ids[Keys.ROLLOUT_ID]), _id_text(ids[Keys.ATTEMPT_ID])
                if rollout_id is None or attempt_id is None:
                    missing = [
                        k for k, v in ((Keys.ROLLOUT_ID, rollout_id), (Keys.ATTEMPT_ID, attempt_id)) if v is None
                    ]
                    reason = _why_missing(missing, span_ids, resource_attrs)
                    rejected.append(SpanNote(pb.span_id.hex(), pb.name, reason))
                    continue
                sequence_id, unused = _sequence(ids[Keys.SPAN_SEQUENCE_ID])
                if unused:
                    renumbered.append(SpanNote(pb.span_id.hex(), pb.name, unused))
                spans.append(_convert(pb, rollout_id, attempt_id, sequence_id, resource))
    return spans, rejected, renumbered
