"""``agentlightning.utils.otlp``: not ported; ``eventlight serve`` takes OTLP at ``/v1/traces`` instead."""

from eventlight.unavailable import unavailable_function

__all__ = ["handle_otlp_export", "spans_from_proto"]

_WHY = "OTLP/HTTP is served by `eventlight serve` at /v1/traces (eventlight.server.otlp); OtelTracer records spans"
handle_otlp_export = unavailable_function("handle_otlp_export", _WHY, __name__)
spans_from_proto = unavailable_function("spans_from_proto", _WHY, __name__)
