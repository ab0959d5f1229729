"""``agentlightning.instrumentation``: eventlight patches no library; ``OtelTracer`` records
OpenTelemetry spans from any instrumented one, and the LLM proxy records token ids itself."""

__all__: list[str] = []
