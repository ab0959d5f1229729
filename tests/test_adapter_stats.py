"""What the adapters skip or mark is counted and reachable (issue 15 item 4): missing and incomplete
token ids, upstream errors, duplicates; never an empty or silently wrong triplet."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from eventlight.adapter import AdapterStats, LlmProxyTraceToTriplet, TracerTraceToTriplet, TraceToMessages
from eventlight.core.types import Span
from eventlight.llm_proxy.span_attributes import make_span

REQUEST = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}


def completion(response_id: str, *, ids: bool = True, completion_tokens: int = 2) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": "4 ."}, "finish_reason": "stop"}
    out: dict[str, Any] = {
        "id": response_id,
        "model": "m",
        "choices": [choice],
        "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens, "total_tokens": 3 + completion_tokens},
    }
    if ids:
        out["prompt_token_ids"], choice["token_ids"] = [1, 2, 3], [4, 5]
    return out


def call(seq: int, answer: dict[str, Any] | None, error: dict[str, Any] | None = None) -> Span:
    return make_span(
        dict(REQUEST),
        answer,
        error,
        system="hosted_vllm",
        streaming=False,
        rollout_id="ro-1",
        attempt_id="at-1",
        sequence_id=seq,
        start_time=float(seq),
    )


def trace() -> list[Span]:
    too_long = {"type": "ContextWindowExceededError", "status_code": 400, "message": "maximum context length"}
    return [
        call(1, completion("r-good")),
        call(2, completion("r-noids", ids=False)),
        call(3, completion("r-short", completion_tokens=7)),
        call(4, None, too_long),
        call(5, completion("r-good")),  # the same call recorded twice
    ]


def test_the_proxy_marks_what_the_adapters_count() -> None:
    good, noids, short, failed, _ = (s.attributes for s in trace())
    assert "eventlight.token_ids.missing" not in good
    assert noids["eventlight.token_ids.missing"] == ["prompt", "response"]
    assert short["token_ids_incomplete"] is True
    assert "eventlight.token_ids.missing" not in failed and failed["http.status_code"] == 400


def test_tracer_adapter_marks_missing_and_incomplete_and_skips_errors_and_duplicates() -> None:
    """peer_failures C14, C15: incomplete ids are flagged on the triplet; error calls give none."""
    adapter = TracerTraceToTriplet()
    triplets = adapter.adapt(trace())
    assert [t.metadata["response_id"] for t in triplets] == ["r-good", "r-noids", "r-short"]
    good, noids, short = triplets
    assert "token_ids_missing" not in good.metadata and "token_ids_incomplete" not in good.metadata
    assert noids.metadata["token_ids_missing"] == ["prompt", "response"]
    assert short.metadata["token_ids_incomplete"] is True
    assert adapter.last_stats == AdapterStats(
        llm_calls=5, triplets=3, missing_token_ids=1, incomplete_token_ids=1, errors=1, duplicates=1
    )
    assert adapter.last_stats.skipped == 2


def test_a_trace_of_refused_calls_only_says_why_it_gave_no_triplet(caplog: pytest.LogCaptureFixture) -> None:
    """peer_failures C15: a call vLLM refused (400, prompt longer than the context) gives no
    triplet, and the warning says the call was left out as an error; it said "no span matches
    llm_call_match", naming the very span that matched."""
    refused = trace()[3]
    with caplog.at_level(logging.WARNING, logger="eventlight.adapter"):
        assert TracerTraceToTriplet().adapt([refused]) == []
    assert "no triplet: all 1 LLM call(s) were left out (rollout ro-1, attempt at-1)" in caplog.text
    assert "1 LLM call(s), 0 record(s); 1 failed (span status ERROR)" in caplog.text  # not AdapterStats(...)
    assert "no span matches" not in caplog.text


def test_tracer_adapter_skipping_empty_token_spans_counts_them() -> None:
    adapter = TracerTraceToTriplet(_skip_empty_token_spans=True)
    assert [t.metadata["response_id"] for t in adapter.adapt(trace())] == ["r-good", "r-short"]
    assert adapter.last_stats is not None
    assert (adapter.last_stats.triplets, adapter.last_stats.missing_token_ids) == (2, 1)


def test_proxy_adapter_skips_calls_without_ids_and_counts_everything() -> None:
    adapter = LlmProxyTraceToTriplet()
    triplets = adapter.adapt(trace())
    assert [t.metadata["response_id"] for t in triplets] == ["r-good", "r-short"]
    assert triplets[1].metadata["token_ids_incomplete"] is True and "token_ids_incomplete" not in triplets[0].metadata
    assert adapter.last_stats == AdapterStats(
        llm_calls=5, triplets=2, missing_token_ids=1, incomplete_token_ids=1, errors=1, duplicates=1
    )


def test_messages_adapter_skips_error_spans_and_duplicates_and_counts_them() -> None:
    adapter = TraceToMessages()
    records = adapter.adapt(trace())
    assert len(records) == 3 and all(r["messages"][-1]["role"] == "assistant" for r in records)
    assert adapter.last_stats == AdapterStats(llm_calls=5, triplets=3, errors=1, duplicates=1)


def test_stats_add_up_over_calls_and_reset() -> None:
    adapter = LlmProxyTraceToTriplet()
    adapter.adapt(trace())
    adapter.adapt(trace()[:2])
    assert adapter.stats.llm_calls == 7 and adapter.stats.triplets == 3 and adapter.stats.missing_token_ids == 2
    assert adapter.last_stats is not None and adapter.last_stats.llm_calls == 2
    adapter.reset_stats()
    assert adapter.stats == AdapterStats() and adapter.last_stats is None
    other = TracerTraceToTriplet()
    assert other.adapt([]) == [] and other.stats == AdapterStats()  # nothing shared between adapters
