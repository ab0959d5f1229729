"""What an emitter or an operation recorded: ``SpanCoreFields`` (Agent-lightning's name), and the
recording handed out by ``OtelTracer.operation_context``."""

from __future__ import annotations

from typing import Any

import msgspec
from opentelemetry.trace import Status, StatusCode

from eventlight.core.types import TraceStatus
from eventlight.otel import _own_attributes, _plain

__all__ = ["SpanCoreFields"]


class SpanCoreFields(msgspec.Struct, kw_only=True):
    """What an emitter or operation recorded (Agent-lightning ``SpanCoreFields``); times in seconds."""

    name: str
    status: TraceStatus
    attributes: dict[str, Any]
    start_time: float | None
    end_time: float | None


class _Recording:
    def __init__(self, span: Any):
        self.span = span
        self.done: SpanCoreFields | None = None

    def record_attributes(self, attributes: dict[str, Any]) -> None:
        self.span.set_attributes(attributes)

    def record_exception(self, exception: BaseException) -> None:
        self.span.record_exception(exception)

    def record_status(self, status_code: str, description: str | None = None) -> None:
        self.span.set_status(Status(StatusCode[status_code], description))

    def get_recorded_span(self) -> SpanCoreFields:
        if self.done is None:
            raise RuntimeError("Span is not ready yet.")
        return self.done


def _core(span: Any) -> SpanCoreFields:
    return SpanCoreFields(
        name=span.name,
        status=TraceStatus(status_code=span.status.status_code.name, description=span.status.description),
        attributes=dict(_plain(_own_attributes(span)) or {}),  # the SDK's dict copied in C, if it has one
        start_time=span.start_time / 1e9 if span.start_time else None,
        end_time=span.end_time / 1e9 if span.end_time else None,
    )
