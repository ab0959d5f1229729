"""``agentlightning.types.tracer``: spans and their parts (``eventlight.core.types``)."""

from eventlight.core.types import Event, Link, OtelResource, Span, SpanContext, StatusCode, TraceStatus
from eventlight.tracer import SpanCoreFields

__all__ = ["Event", "Link", "OtelResource", "Span", "SpanContext", "SpanCoreFields", "StatusCode", "TraceStatus"]
