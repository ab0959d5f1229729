"""OpenTelemetry helpers (``agentlightning.utils.otel``): flat attributes and span conversion."""

from eventlight.attributes import (
    filter_and_unflatten_attributes,
    filter_attributes,
    flatten_attributes,
    unflatten_attributes,
)
from eventlight.otel import span_from_readable

__all__ = [
    "filter_and_unflatten_attributes",
    "filter_attributes",
    "flatten_attributes",
    "span_from_readable",
    "unflatten_attributes",
]
