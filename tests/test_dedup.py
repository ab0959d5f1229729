"""One triplet per LLM call when framework instrumentation and the LLM proxy both recorded it
(issue 15 item 4, duplicates): the copy with token ids is kept, the others are counted, on traces
the tests build in the shapes the instrumentations write (``eventlight.adapter.dedup``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from eventlight.adapter import LlmProxyTraceToTriplet, TracerTraceToTriplet, TraceToMessages
from eventlight.adapter.dedup import keep_one_copy, output_fingerprint, response_id
from eventlight.core.types import OtelResource, Span
from tests.test_adapter import span

ALL_LLM = r"^(openai\.chat\.completion|ChatCompletion|ChatOpenAI|generation)$"


def proxy(span_id: str, start: float, end: float, seq: int, rid: str, text: str, counts: tuple[int, int]) -> Span:
    """The LLM proxy's copy: flat and current GenAI attributes, the response id, token ids."""
    s = span(
        span_id,
        "openai.chat.completion",
        None,
        start,
        end,
        seq,
        **{
            "gen_ai.response.id": rid,
            "gen_ai.prompt.0.role": "user",
            "gen_ai.prompt.0.content": "What is 2 + 3?",
            "gen_ai.completion.0.role": "assistant",
            "gen_ai.completion.0.content": text,
            "gen_ai.usage.input_tokens": counts[0],
            "gen_ai.usage.output_tokens": counts[1],
            "prompt_token_ids": list(range(1, counts[0] + 1)),
            "response_token_ids": list(range(100, 100 + counts[1])),
        },
    )
    s.resource = OtelResource(attributes={"service.name": "eventlight.llm_proxy"})
    return s


def openinference_llm(
    span_id: str, name: str, parent: str | None, start: float, end: float, seq: int, text: str, **extra: Any
) -> Span:
    """A framework's copy as OpenInference writes it: no token ids, no ``gen_ai.response.id``."""
    return span(
        span_id,
        name,
        parent,
        start,
        end,
        seq,
        **{
            "openinference.span.kind": "LLM",
            "llm.output_messages.0.message.role": "assistant",
            "llm.output_messages.0.message.content": text,
            **extra,
        },
    )


def reward(span_id: str, at: float, seq: int, value: float) -> Span:
    return span(
        span_id,
        "agentlightning.annotation",
        None,
        at,
        at,
        seq,
        **{"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value},
    )


def test_agentops_style_copy_of_the_same_name_loses_to_the_proxy_copy() -> None:
    """Both copies are named ``openai.chat.completion`` and share the response id; the framework's
    comes first in the tree (it encloses the proxy's). Agent-lightning keeps the first seen: a
    triplet without token ids. Here the proxy's is kept and the other counted."""
    spans = [
        span("agent", "agent", None, 0.0, 10.0, 1, **{"agent.name": "calc"}),
        span("fw", "openai.chat.completion", "agent", 1.0, 4.0, 2, **{"gen_ai.response.id": "chatcmpl-1"}),
        proxy("px", 1.5, 3.5, 3, "chatcmpl-1", "5", (10, 1)),
        reward("r", 9.0, 4, 1.0),
    ]
    adapter = TracerTraceToTriplet()
    (triplet,) = adapter.adapt(spans)
    assert triplet.prompt["token_ids"] == list(range(1, 11)) and triplet.response["token_ids"] == [100]
    assert triplet.reward == 1.0 and triplet.metadata["response_id"] == "chatcmpl-1"
    assert triplet.metadata["duplicates_dropped"] == 1 and adapter.stats.duplicates == 1
    adapter.adapt(spans)
    assert adapter.stats.duplicates == 2  # summed over calls


def test_openinference_copies_are_matched_by_the_id_in_output_value_or_by_output() -> None:
    """The Agents SDK case: ``generation`` (no id) > ``ChatCompletion`` (the id inside its JSON
    ``output.value``) > the proxy's copy, for each of two calls with the same answer text."""
    spans: list[Span] = [span("run", "Agent workflow", None, 0.0, 20.0, 1, **{"agent.name": "calc"})]
    for n, (start, rid, prompt) in enumerate([(1.0, "chatcmpl-a", 10), (6.0, "chatcmpl-b", 14)]):
        body = json.dumps({"id": rid, "object": "chat.completion", "choices": []})
        counts = {"llm.token_count.prompt": prompt, "llm.token_count.completion": 1}
        spans += [
            openinference_llm(f"gen{n}", "generation", "run", start, start + 4, 10 * n + 2, "5", **counts),
            openinference_llm(
                f"cc{n}",
                "ChatCompletion",
                f"gen{n}",
                start + 0.5,
                start + 3.5,
                10 * n + 3,
                "5",
                **{"output.value": body, "output.mime_type": "application/json"},
            ),
            proxy(f"px{n}", start + 1, start + 3, 10 * n + 4, rid, "5", (prompt, 1)),
        ]
    spans.append(reward("r", 19.0, 30, 1.0))
    adapter = TracerTraceToTriplet(llm_call_match=ALL_LLM)
    triplets = adapter.adapt(spans)
    assert [t.metadata["response_id"] for t in triplets] == ["chatcmpl-a", "chatcmpl-b"]
    assert [len(t.prompt["token_ids"]) for t in triplets] == [10, 14]  # each generation joined its own call
    assert [t.reward for t in triplets] == [None, 1.0]
    assert adapter.stats.duplicates == 4
    assert all(t.metadata["duplicates_dropped"] == 2 for t in triplets)


def test_langchain_copy_floating_at_the_top_level_is_matched_by_llm_output_id() -> None:
    result = {"generations": [[{"text": "5"}]], "llm_output": {"id": "chatcmpl-lc"}, "type": "LLMResult"}
    spans = [
        openinference_llm("lc", "ChatOpenAI", None, 1.0, 4.0, 2, "5", **{"output.value": json.dumps(result)}),
        proxy("px", 1.5, 3.5, 1, "chatcmpl-lc", "5", (5, 1)),
        reward("r", 9.0, 3, 0.5),
    ]
    adapter = TracerTraceToTriplet(llm_call_match=ALL_LLM)
    (triplet,) = adapter.adapt(spans)
    assert triplet.response["token_ids"] == [100] and triplet.reward == 0.5
    assert adapter.stats.duplicates == 1


def test_no_false_merges_and_no_lost_calls() -> None:
    """A framework copy whose token counts differ, or a second copy of the same layer, is another
    call: it stays (without ids), never merged into a call it is not, never dropped."""
    spans = [
        proxy("px", 1.0, 2.0, 1, "chatcmpl-1", "5", (10, 1)),
        openinference_llm("g1", "generation", None, 1.0, 2.5, 2, "5", **{"llm.token_count.prompt": 10}),
        openinference_llm("g2", "generation", None, 3.0, 4.0, 3, "5", **{"llm.token_count.prompt": 10}),
        openinference_llm("g3", "ChatCompletion", None, 5.0, 6.0, 4, "5", **{"llm.token_count.prompt": 99}),
    ]
    adapter = TracerTraceToTriplet(llm_call_match=ALL_LLM)
    triplets = adapter.adapt(spans)
    assert len(triplets) == 3 and adapter.stats.duplicates == 1  # g1 joined the proxy's call
    with_ids = [t for t in triplets if t.prompt["token_ids"]]
    assert len(with_ids) == 1 and with_ids[0].metadata["response_id"] == "chatcmpl-1"
    kept, dropped = keep_one_copy(spans)
    assert kept == [0, 2, 3] and dropped == {0: 1}


def test_a_call_only_the_framework_recorded_stays() -> None:
    spans = [openinference_llm("g", "generation", None, 1.0, 2.0, 1, "5"), reward("r", 3.0, 2, 1.0)]
    adapter = TracerTraceToTriplet(llm_call_match=ALL_LLM)
    (triplet,) = adapter.adapt(spans)
    assert triplet.prompt["token_ids"] == [] and triplet.reward == 1.0 and adapter.stats.duplicates == 0


def test_messages_adapter_gives_one_record_per_call() -> None:
    """A GenAI-conventions copy (OpenTelemetry's openai-v2 writes ``gen_ai.response.id`` and the
    request) beside the proxy's: one conversation, from the proxy's copy."""
    spans = [
        span(
            "fw",
            "chat stub",
            None,
            1.0,
            4.0,
            1,
            **{"gen_ai.operation.name": "chat", "gen_ai.request.model": "stub", "gen_ai.response.id": "chatcmpl-1"},
        ),
        proxy("px", 1.5, 3.5, 2, "chatcmpl-1", "5", (3, 1)),
    ]
    adapter = TraceToMessages()
    (record,) = adapter.adapt(spans)
    assert [m["role"] for m in record["messages"]] == ["user", "assistant"] and record["messages"][1]["content"] == "5"
    assert adapter.stats.duplicates == 1


def test_proxy_adapter_counts_repeated_response_ids() -> None:
    spans = [proxy("a", 1.0, 2.0, 1, "chatcmpl-1", "5", (3, 1)), proxy("b", 1.0, 2.0, 2, "chatcmpl-1", "5", (3, 1))]
    spans.append(openinference_llm("g", "generation", None, 1.0, 2.0, 3, "5"))  # no ids: never a proxy triplet
    adapter = LlmProxyTraceToTriplet()
    assert len(adapter.adapt(spans)) == 1 and adapter.stats.duplicates == 1


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('{"id": "chatcmpl-9", "choices": []}', "chatcmpl-9"),
        ('{"llm_output": {"id": "chatcmpl-8"}}', "chatcmpl-8"),
        ('{"id": "not-a-response"}', None),  # an id without choices is not a chat completion
        ("[1, 2]", None),
        ("{not json", None),
        ("plain text", None),
        ('{"id": "x", "choices": [' + "1," * 1_000_000 + "1]}", "x"),  # a large payload parses, or not
    ],
)
def test_response_id_from_output_value(value: str, expected: str | None) -> None:
    assert response_id({"openinference.span.kind": "LLM", "output.value": value}) == expected
    assert response_id({"openinference.span.kind": "CHAIN", "output.value": value}) is None


def test_output_fingerprints_agree_across_conventions() -> None:
    tool_call = "call_1"
    proxy_attrs = {"gen_ai.completion.0.tool_calls.0.id": tool_call, "gen_ai.completion.0.tool_calls.0.name": "add"}
    current = {
        "gen_ai.output.messages": json.dumps(
            [{"role": "assistant", "parts": [{"type": "tool_call", "id": tool_call, "name": "add"}]}]
        )
    }
    openinference = {"llm.output_messages.0.message.tool_calls.0.tool_call.id": tool_call}
    assert output_fingerprint(proxy_attrs) == output_fingerprint(current) == output_fingerprint(openinference)
    assert output_fingerprint(proxy_attrs) == ("", ("call_1",))
    assert output_fingerprint({}) is None and output_fingerprint({"gen_ai.output.messages": "{bad"}) is None


def test_c08_structured_output_through_the_proxy_gives_one_triplet_with_its_ids() -> None:
    """peer_failures C08: LangChain's ``with_structured_output`` leaves a ``chat_model.llm`` span
    with an empty prompt and no token ids (0.3.0 made no triplet of it: reward ``None``); the same
    call through the LLM proxy gives exactly one triplet, with the proxy's token ids and the reward."""
    spans = [
        span("root", "agent.session", None, 0.0, 10.0, 1),
        span("chat", "chat_model.llm", "root", 1.0, 2.0, 2, **{"gen_ai.request.model": "m", "gen_ai.prompt": "[]"}),
        proxy("px", 1.2, 1.8, 3, "chatcmpl-so", '{"answer": 4}', (6, 3)),
        reward("r", 11.0, 4, 1.0),
    ]
    adapter = TracerTraceToTriplet()
    (triplet,) = adapter.adapt(spans)
    assert triplet.prompt["token_ids"] == [1, 2, 3, 4, 5, 6] and triplet.response["token_ids"] == [100, 101, 102]
    assert triplet.reward == 1.0 and triplet.metadata["response_id"] == "chatcmpl-so"
