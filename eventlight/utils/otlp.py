"""OTLP ingestion (``agentlightning.utils.otlp``): not built yet; the tracer publishes spans to the stream."""

from eventlight.unavailable import unavailable_function

__all__ = ["handle_otlp_export", "spans_from_proto"]

_WHY = "eventlight has no OTLP/HTTP endpoint yet (the REST server issue builds it); OtelTracer records spans"
handle_otlp_export = unavailable_function("handle_otlp_export", _WHY, __name__)
spans_from_proto = unavailable_function("spans_from_proto", _WHY, __name__)
