"""bench.adapters: the recorded trace it builds is one the adapters read in full."""

from __future__ import annotations

from bench.adapters import measure, recorded_trace


def test_every_llm_call_of_the_recorded_trace_becomes_a_record() -> None:
    spans = recorded_trace(1_000)
    calls = [s for s in spans if s.name == "openai.chat.completion"]
    assert len(spans) == 1_000 and len(calls) > 300
    assert len({s.span_id for s in spans}) == len(spans)  # ids unique, parents inside the trace
    assert all(s.parent_id in {p.span_id for p in spans} for s in spans[1:])
    result = measure(spans, repeat=1)
    assert {name: r["records"] for name, r in result.items()} == dict.fromkeys(result, len(calls))
    assert all(r["spans_per_s"] > 0 for r in result.values())
