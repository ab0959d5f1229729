"""Conversion of OpenTelemetry SDK spans into eventlight ``Span`` structs.

Follows Agent-lightning's ``Span.from_opentelemetry``: ids become lowercase hex (trace 32, span 16
characters), timestamps become seconds, the status code becomes its name (``UNSET``/``OK``/``ERROR``),
events, links and the resource are copied.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.attributes import BoundedAttributes

from eventlight.core.types import Event, Link, OtelResource, Span, SpanContext, TraceStatus


def _hex_trace(value: int) -> str:
    return format(value, "032x")


def _hex_span(value: int) -> str:
    return format(value, "016x")


def _seconds(ns: int | None) -> float | None:
    return None if not ns else ns / 1e9


def json_double(value: float) -> float | str:
    """``value``, or a NaN or infinity as OTLP/JSON writes it (``"NaN"``, ``"Infinity"``,
    ``"-Infinity"``: proto3's JSON mapping of a double). The store's JSON holds neither, and refuses
    a span that carries one; an instrumentation's span keeps the value this way."""
    if value - value == 0.0:
        return value
    return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")


def _attrs(attributes: Any) -> dict[str, Any]:
    """A plain ``dict`` copy; OpenTelemetry's sequence values (tuples) become lists, a NaN or
    infinite float becomes its OTLP/JSON text (``json_double``)."""
    if not attributes:
        return {}
    out = dict(_plain(attributes))  # OpenTelemetry keys are already strings
    if not _TO_CONVERT.intersection(map(type, out.values())):
        return out  # nothing to convert (strings, ints, bools: most attributes), found in C
    for key, value in out.items():
        kind = type(value)
        if kind is tuple:
            out[key] = [json_double(x) if type(x) is float else x for x in value]
        elif kind is float and value - value != 0.0:
            out[key] = json_double(value)
    return out


_TO_CONVERT = frozenset((tuple, float))
"""The value types ``_attrs`` may convert (a tuple into a list, a NaN or infinite float into text)."""


def _plain(attributes: Any) -> Any:
    """The dict behind the SDK's ``BoundedAttributes`` (its cleaned values), else ``attributes``.

    Copying that dict is C code; copying the mapping costs two Python calls per key (about 3/4 of
    the bench workload's span conversion).
    """
    if type(attributes) is BoundedAttributes:
        inner = getattr(attributes, "_dict", None)  # a private field: without it, the mapping
        if type(inner) is dict:
            return inner
    return attributes


_resources: dict[int, tuple[Any, dict[str, Any], str]] = {}


def _resource(resource: Any) -> OtelResource:
    """The span's resource; a tracer provider's spans share one, converted once (a copy per span)."""
    if resource is None:
        return OtelResource(attributes={}, schema_url="")
    cached = _resources.get(id(resource))
    if cached is None or cached[0] is not resource:
        if len(_resources) > 64:
            _resources.clear()
        cached = _resources[id(resource)] = (resource, _attrs(resource.attributes), resource.schema_url or "")
    return OtelResource(attributes=dict(cached[1]), schema_url=cached[2])


def _context(ctx: Any, trace_id: str | None = None, span_id: str | None = None) -> SpanContext | None:
    """``ctx`` as a ``SpanContext``; ``trace_id`` and ``span_id``: its ids in hex, when known."""
    if ctx is None:
        return None
    state = dict(ctx.trace_state.items()) if getattr(ctx, "trace_state", None) is not None else {}
    return SpanContext(
        trace_id=trace_id or _hex_trace(ctx.trace_id),
        span_id=span_id or _hex_span(ctx.span_id),
        is_remote=bool(ctx.is_remote),
        trace_state=state,
    )


def _own_attributes(readable: Any) -> Any:
    """The span's attributes without the read-only proxy ``ReadableSpan.attributes`` wraps them in."""
    own = getattr(readable, "_attributes", None)
    return own if type(own) is BoundedAttributes else readable.attributes


def span_from_readable(readable: Any, rollout_id: str, attempt_id: str, sequence_id: int) -> Span:
    """Convert an OpenTelemetry ``ReadableSpan`` into a ``Span`` of the given attempt.

    Args:
        readable: An ``opentelemetry.sdk.trace.ReadableSpan``.
        rollout_id: The rollout the span belongs to.
        attempt_id: The attempt the span belongs to.
        sequence_id: The store-assigned order key.
    """
    ctx = readable.get_span_context()
    parent = readable.parent
    status = readable.status
    resource = readable.resource
    trace_id, span_id = _hex_trace(ctx.trace_id), _hex_span(ctx.span_id)
    parent_id = _hex_span(parent.span_id) if parent is not None else None
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=trace_id,
        span_id=span_id,
        parent_id=parent_id,
        name=readable.name,
        status=TraceStatus(status_code=status.status_code.name, description=status.description),
        attributes=_attrs(_own_attributes(readable)),
        events=[
            Event(name=e.name, attributes=_attrs(e.attributes), timestamp=_seconds(e.timestamp))
            for e in readable.events
        ],
        links=[
            Link(context=_context(link.context), attributes=_attrs(link.attributes) or None)  # type: ignore[arg-type]
            for link in readable.links
        ],
        start_time=_seconds(readable.start_time),
        end_time=_seconds(readable.end_time),
        context=_context(ctx, trace_id, span_id),
        parent=_context(parent, None, parent_id),
        resource=_resource(resource),
    )
