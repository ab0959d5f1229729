"""``span_from_readable``: OpenTelemetry SDK spans become eventlight spans with plain attributes."""

from __future__ import annotations

from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from eventlight.otel import _plain, span_from_readable
from eventlight.store.validate import check_spans

ATTRIBUTES: dict[str, Any] = {
    "text": "hello",
    "count": 3,
    "ratio": 0.5,
    "flag": True,
    "words": ["a", "b"],
    "numbers": (1, 2, 3),
}
PLAIN = {**ATTRIBUTES, "numbers": [1, 2, 3]}  # the SDK keeps sequences as tuples; spans hold lists


class _Keep(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Any) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def _ended_span() -> ReadableSpan:
    kept = _Keep()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(kept))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("linked") as other:
        pass
    link = trace_api.Link(other.get_span_context(), attributes={"why": "retry", "tries": (1, 2)})
    with tracer.start_as_current_span("work", attributes=ATTRIBUTES, links=[link]) as span:
        span.add_event("step", attributes={"n": 1, "tags": ("x", "y")})
    return kept.spans[-1]


def test_sdk_span_attributes_become_plain_values_and_a_copy() -> None:
    readable = _ended_span()
    span = span_from_readable(readable, "ro-1", "at-1", 7)
    assert span.attributes == PLAIN
    assert all(type(v) is not tuple for v in span.attributes.values())
    assert span.events[0].attributes == {"n": 1, "tags": ["x", "y"]}
    assert span.links[0].attributes == {"why": "retry", "tries": [1, 2]}
    span.attributes["text"] = "changed"  # the span's own attributes are not touched
    assert (readable.attributes or {})["text"] == "hello"
    assert span_from_readable(readable, "ro-1", "at-1", 7).attributes == PLAIN


def test_the_sdk_attributes_are_copied_from_their_plain_dict() -> None:
    """The fast path (``BoundedAttributes``' own dict) applies on the pinned SDK; if a release renames
    that private field, conversion still works (the mapping is copied) and this test says so."""
    own: Any = _ended_span()._attributes  # type: ignore[attr-defined]
    assert _plain(own) is own._dict
    assert _plain({"a": 1}) == {"a": 1}


def test_a_readable_span_with_plain_attributes_converts_the_same() -> None:
    sdk = _ended_span()
    readable = ReadableSpan(
        name="work",
        context=sdk.get_span_context(),
        parent=None,
        attributes=dict(ATTRIBUTES),
        events=sdk.events,
        links=sdk.links,
        resource=sdk.resource,
        start_time=sdk.start_time,
        end_time=sdk.end_time,
    )
    converted = span_from_readable(readable, "ro-1", "at-1", 7)
    expected = span_from_readable(sdk, "ro-1", "at-1", 7)
    assert converted.attributes == PLAIN
    assert converted.events == expected.events and converted.links == expected.links


def test_nan_and_infinity_keep_their_otlp_json_text_and_the_span_is_stored() -> None:
    """A NaN or infinite double set by an instrumentation becomes ``"NaN"`` / ``"Infinity"`` /
    ``"-Infinity"`` (OTLP/JSON's text for them), so the store, whose JSON has neither and refuses
    such a span, keeps the span, in attributes, in sequences and in events."""
    kept = _Keep()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(kept))
    odd = {"nan": float("nan"), "up": float("inf"), "down": (1.5, float("-inf")), "fine": 2.5}
    with provider.get_tracer("test").start_as_current_span("odd", attributes=odd) as span:
        span.add_event("e", attributes={"x": float("inf")})
    converted = span_from_readable(kept.spans[-1], "ro-1", "at-1", 1)
    assert converted.attributes == {"nan": "NaN", "up": "Infinity", "down": [1.5, "-Infinity"], "fine": 2.5}
    assert converted.events[0].attributes == {"x": "Infinity"}
    check_spans([converted])  # what the stores check before writing: accepted
