"""The current OpenTelemetry GenAI message attributes: written by the proxy's span builder, read by
the adapters when a span carries only them (as newer instrumentation writes)."""

from __future__ import annotations

import json
from typing import Any

from eventlight.adapter import TraceToMessages
from eventlight.adapter.triplets import span_to_triplet
from eventlight.attributes import unflatten_attributes
from eventlight.core.types import Span
from eventlight.genai import INPUT_MESSAGES, OUTPUT_MESSAGES, SYSTEM_INSTRUCTIONS, genai_attributes, openai_messages
from eventlight.llm_proxy.span_attributes import build_chat_span_attributes

MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "2+3?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
]
RESPONSE: dict[str, Any] = {
    "id": "chatcmpl-1",
    "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "5"}}],
    "usage": {"prompt_tokens": 11, "completion_tokens": 1, "total_tokens": 12},
}


def test_messages_follow_the_schema_and_system_text_is_also_instructions() -> None:
    attrs = genai_attributes(MESSAGES, RESPONSE["choices"])
    inputs = json.loads(attrs[INPUT_MESSAGES])
    assert [m["role"] for m in inputs] == ["system", "user", "assistant", "tool"]
    assert inputs[2]["parts"] == [{"type": "tool_call", "id": "c1", "name": "add", "arguments": {"a": 2, "b": 3}}]
    assert inputs[3]["parts"] == [{"type": "tool_call_response", "id": "c1", "response": "5"}]
    assert json.loads(attrs[SYSTEM_INSTRUCTIONS]) == [{"type": "text", "content": "You add numbers."}]
    assert json.loads(attrs[OUTPUT_MESSAGES]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "5"}], "finish_reason": "stop"}
    ]


def test_reading_them_back_gives_the_flat_attributes_unflattened() -> None:
    """The current conventions read back into the same messages the flat ``gen_ai.prompt.{i}.*``
    attributes of the same call unflatten into: an adapter sees one shape whichever was written."""
    attrs = build_chat_span_attributes({"model": "m", "messages": MESSAGES}, RESPONSE, system="openai")
    flat = unflatten_attributes(
        {k: v for k, v in attrs.items() if k.startswith(("gen_ai.prompt", "gen_ai.completion"))}
    )
    current = openai_messages(attrs, INPUT_MESSAGES)
    assert current is not None
    for mine, theirs in zip(current, flat["gen_ai"]["prompt"], strict=True):
        assert mine["role"] == theirs["role"]
        assert mine.get("content") == theirs.get("content")
        assert mine.get("tool_calls") == theirs.get("tool_calls")
        assert mine.get("tool_call_id") == theirs.get("tool_call_id")
    (out,) = openai_messages(attrs, OUTPUT_MESSAGES) or []
    assert out["content"] == flat["gen_ai"]["completion"][0]["content"] == "5"
    assert out["finish_reason"] == "stop"


def test_malformed_or_missing_attributes_read_as_absent() -> None:
    assert openai_messages({}, INPUT_MESSAGES) is None
    assert openai_messages({INPUT_MESSAGES: "{not json"}, INPUT_MESSAGES) is None
    assert openai_messages({INPUT_MESSAGES: '{"role": "user"}'}, INPUT_MESSAGES) is None  # not a list


def _current_only_span() -> Span:
    """An LLM span as newer instrumentation writes it: no flat ``gen_ai.prompt.*`` attributes."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "openai",
        "gen_ai.request.model": "m",
        "gen_ai.response.id": "chatcmpl-1",
        "prompt_token_ids": [1, 2, 3],
        "response_token_ids": [4],
        **genai_attributes(MESSAGES[:2], RESPONSE["choices"]),
    }
    return Span.from_attributes(
        attributes=attrs,
        rollout_id="ro-1",
        attempt_id="at-1",
        sequence_id=1,
        name="openai.chat.completion",
        trace_id="t" * 32,
        span_id="s1",
        start_time=0.0,
        end_time=1.0,
    )


def test_triplet_adapter_reads_the_current_conventions() -> None:
    triplet = span_to_triplet(_current_only_span(), "agent")
    assert triplet.prompt["token_ids"] == [1, 2, 3] and triplet.response["token_ids"] == [4]
    assert [m["role"] for m in triplet.prompt["raw_content"]] == ["system", "user"]
    assert triplet.prompt["raw_content"][1]["content"] == "2+3?"
    assert triplet.response["raw_content"][0]["content"] == "5"
    assert triplet.metadata["response_id"] == "chatcmpl-1"


def test_messages_adapter_reads_the_current_conventions() -> None:
    (record,) = TraceToMessages().adapt([_current_only_span()])
    assert [(m["role"], m["content"]) for m in record["messages"]] == [
        ("system", "You add numbers."),
        ("user", "2+3?"),
        ("assistant", "5"),
    ]
