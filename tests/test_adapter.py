"""Adapters, reward readers and attribute flattening (``adapter``, ``rewards``, ``attributes``)."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import pytest

from eventlight.adapter import (
    Adapter,
    LlmProxyTraceToTriplet,
    RewardMatchPolicy,
    TracerTraceToTriplet,
    TraceToMessages,
    TraceTree,
)
from eventlight.attributes import (
    filter_and_unflatten_attributes,
    filter_attributes,
    flatten_attributes,
    unflatten_attributes,
)
from eventlight.core.types import Span
from eventlight.rewards import (
    RewardDimension,
    find_final_reward,
    find_reward_spans,
    get_message_value,
    get_object_value,
    get_reward_value,
    get_rewards_from_span,
    is_reward_span,
)


def span(
    span_id: str,
    name: str,
    parent: str | None = None,
    start: float | None = 0.0,
    end: float | None = 1.0,
    seq: int = 0,
    **attrs: Any,
) -> Span:
    return Span.from_attributes(
        attributes=attrs,
        rollout_id="ro-1",
        attempt_id="at-1",
        sequence_id=seq,
        name=name,
        trace_id="t" * 32,
        span_id=span_id,
        parent_id=parent,
        start_time=start,
        end_time=end,
    )


def reward_span(span_id: str, value: float, parent: str | None = None, at: float = 0.0, seq: int = 0) -> Span:
    attrs = {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": value}
    return span(span_id, "agentlightning.annotation", parent, at, at, seq, **attrs)


def llm_span(
    span_id: str,
    parent: str | None,
    start: float,
    end: float,
    prompt: list[int],
    response: list[int],
    rid: str,
) -> Span:
    return span(
        span_id,
        "openai.chat.completion",
        parent,
        start,
        end,
        prompt_token_ids=prompt,
        response_token_ids=response,
        **{"gen_ai.response.id": rid},
    )


# ------------------------------------------------------------------------------------------
# attributes


def test_flatten_nested_dicts_lists_and_leaf_lists() -> None:
    data = {"a": {"b": 1, "c": [{"d": "x"}, {"d": "y"}]}, "ids": [1, 2, 3], "empty": [], "none": {}}
    assert flatten_attributes(data) == {"a.b": 1, "a.c.0.d": "x", "a.c.1.d": "y", "ids": [1, 2, 3]}
    assert flatten_attributes({"ids": [1, 2]}, expand_leaf_lists=True) == {"ids.0": 1, "ids.1": 2}


def test_flatten_mixed_primitive_list_expands_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="eventlight.attributes"):
        assert flatten_attributes({"m": [1, "a", True]}) == {"m.0": 1, "m.1": "a", "m.2": True}
    assert "mixed primitive list" in caplog.text
    # bool and int are different types: a mixed int/bool list is expanded too
    assert flatten_attributes({"m": [1, True]}) == {"m.0": 1, "m.1": True}


def test_flatten_rejects_non_string_keys_and_bare_values() -> None:
    with pytest.raises(ValueError):
        flatten_attributes({"a": {1: "x"}})  # type: ignore[dict-item]
    with pytest.raises(ValueError):
        flatten_attributes(3)  # type: ignore[arg-type]


def test_unflatten_lists_only_for_exact_ranges() -> None:
    assert unflatten_attributes({"a.b": 1, "a.c.0": 2, "a.c.1": 3}) == {"a": {"b": 1, "c": [2, 3]}}
    assert unflatten_attributes({"x.0": "a", "x.2": "b"}) == {"x": {"0": "a", "2": "b"}}
    assert unflatten_attributes({"x.0": "a", "x.k": "b"}) == {"x": {"0": "a", "k": "b"}}
    assert unflatten_attributes({"0.name": "p", "1.name": "q"}) == [{"name": "p"}, {"name": "q"}]
    assert unflatten_attributes({}) == {}


def test_unflatten_roundtrips_flatten() -> None:
    data = {"gen_ai": {"prompt": [{"role": "user", "content": "hi"}], "request": {"model": "m"}}}
    assert unflatten_attributes(flatten_attributes(data)) == data


def test_unflatten_conflicting_keys_raise() -> None:
    with pytest.raises(ValueError):
        unflatten_attributes({"a": 1, "a.b": 2})
    with pytest.raises(ValueError):
        unflatten_attributes({"a.b": 2, "a": 1})


def test_filter_and_unflatten() -> None:
    attrs = {"gen_ai.prompt.0.role": "user", "gen_ai.prompter": "x", "other": 1}
    assert filter_attributes(attrs, "gen_ai.prompt") == {"gen_ai.prompt.0.role": "user"}
    assert filter_and_unflatten_attributes(attrs, "gen_ai.prompt") == [{"role": "user"}]
    assert filter_and_unflatten_attributes(attrs, "nothing") == {}
    with pytest.raises(ValueError):
        filter_and_unflatten_attributes({"p": 1, "p.a": 2}, "p")


# ------------------------------------------------------------------------------------------
# rewards


def test_emit_reward_format_is_read() -> None:
    s = reward_span("r", 0.95)
    assert s.name == "agentlightning.annotation"
    assert get_reward_value(s) == 0.95
    assert get_rewards_from_span(s) == [RewardDimension(name="primary", value=0.95)]
    assert is_reward_span(s)


def test_multi_dimensional_reward_primary_first() -> None:
    s = span(
        "r",
        "agentlightning.annotation",
        **{
            "agentlightning.reward.0.name": "task_completion",
            "agentlightning.reward.0.value": 1.0,
            "agentlightning.reward.1.name": "efficiency",
            "agentlightning.reward.1.value": 0.8,
        },
    )
    assert [(r.name, r.value) for r in get_rewards_from_span(s)] == [
        ("task_completion", 1.0),
        ("efficiency", 0.8),
    ]
    assert get_reward_value(s) == 1.0


def test_malformed_reward_raises() -> None:
    with pytest.raises(ValueError):
        get_reward_value(span("r", "x", **{"agentlightning.reward.0.value": 1.0}))  # no name
    with pytest.raises(ValueError):
        get_reward_value(span("r", "x", **{"agentlightning.reward": 1.0}))


@pytest.mark.parametrize("name", ["agentlightning.annotation", "agentlightning.reward"])
def test_legacy_reward_attribute_under_both_span_names(name: str) -> None:
    assert get_reward_value(span("r", name, reward=0.5)) == 0.5
    assert get_reward_value(span("r", "some.other", reward=0.5)) is None


def test_agentops_reward_payload(caplog: pytest.LogCaptureFixture) -> None:
    as_json = span("r", "task", **{"agentops.task.output": json.dumps({"type": "reward", "value": 0.3})})
    as_dict = span("r", "task", **{"agentops.entity.output": {"type": "reward", "value": 0.7}})
    with caplog.at_level(logging.WARNING, logger="eventlight.rewards"):
        assert get_reward_value(as_json) == 0.3
        assert get_reward_value(as_dict) == 0.7
    assert "deprecated" in caplog.text
    assert get_reward_value(span("r", "task", **{"agentops.task.output": "not json"})) is None


def test_find_final_reward_is_last_in_list_order() -> None:
    spans = [reward_span("a", 0.1, at=5.0), span("b", "x"), reward_span("c", 0.9, at=1.0), span("d", "y")]
    assert find_final_reward(spans) == 0.9
    assert find_reward_spans(spans) == [spans[0], spans[2]]
    assert find_final_reward([span("b", "x")]) is None
    assert find_final_reward([]) is None


def test_get_message_value() -> None:
    assert get_message_value(span("m", "agentlightning.message", **{"agentlightning.message.body": "hi"})) == "hi"
    assert get_message_value(span("m", "x")) is None
    with pytest.raises(TypeError):
        get_message_value(span("m", "x", **{"agentlightning.message.body": 3}))


@pytest.mark.parametrize(
    ("kind", "literal", "expected"),
    [
        ("str", "abc", "abc"),
        ("int", "42", 42),
        ("float", "2.5", 2.5),
        ("bool", "True", True),
        ("bool", "false", False),
        ("bytes", base64.b64encode(b"\x00\x01").decode(), b"\x00\x01"),
    ],
)
def test_get_object_value_literals(kind: str, literal: str, expected: Any) -> None:
    s = span(
        "o",
        "agentlightning.object",
        **{"agentlightning.object.type": kind, "agentlightning.object.literal": literal},
    )
    assert get_object_value(s) == expected


def test_get_object_value_json_and_errors() -> None:
    both = {
        "agentlightning.object.type": "dict",
        "agentlightning.object.json": '{"a": 1}',
        "agentlightning.object.literal": "ignored",
    }
    assert get_object_value(span("o", "x", **both)) == {"a": 1}
    assert get_object_value(span("o", "x")) is None
    with pytest.raises(RuntimeError):
        get_object_value(span("o", "x", **{"agentlightning.object.json": "{nope"}))
    with pytest.raises(RuntimeError):
        get_object_value(
            span("o", "x", **{"agentlightning.object.type": "weird", "agentlightning.object.literal": "1"})
        )


# ------------------------------------------------------------------------------------------
# Adapter base


def test_adapter_call_delegates_and_base_raises() -> None:
    class Upper(Adapter[str, str]):
        def adapt(self, source: str, /) -> str:
            return source.upper()

    assert Upper()("ab") == "AB"
    with pytest.raises(NotImplementedError):
        Adapter[str, str]()("x")


# ------------------------------------------------------------------------------------------
# TracerTraceToTriplet


def test_single_call_triplet_fields() -> None:
    attrs = {
        "gen_ai.prompt.0.role": "user",
        "gen_ai.prompt.0.content": "2+2?",
        "gen_ai.completion.0.role": "assistant",
        "gen_ai.completion.0.content": "4",
        "gen_ai.request.model": "m",
        "gen_ai.response.id": "resp-1",
        "gen_ai.response.model": "m",
        "prompt_token_ids": [1, 2],
        "response_token_ids": [3],
    }
    spans = [
        span("root", "session", None, 0, 10),
        span("llm", "openai.chat.completion", "root", 1, 2, **attrs),
        reward_span("rew", 1.0, "root", at=3),
    ]
    (t,) = TracerTraceToTriplet().adapt(spans)
    assert t.prompt == {
        "token_ids": [1, 2],
        "raw_content": [{"role": "user", "content": "2+2?"}],
        "image_urls": [],
    }
    assert t.response == {"token_ids": [3], "raw_content": [{"role": "assistant", "content": "4"}]}
    assert t.reward == 1.0
    assert t.metadata == {
        "request": {"model": "m"},
        "response": {"id": "resp-1", "model": "m"},
        "response_id": "resp-1",
        "agent_name": "*",
    }


def c09_spans() -> list[Span]:
    """peer_failures.md C09: a reward inside one agent, an LLM call of a sibling agent just before it."""
    return [
        span("root", "session", None, 0, 10),
        span("agent", "agent.node", "root", 1, 9, **{"agent.name": "sibling-agent"}),
        span("agent-2", "agent.node", "root", 1, 9, **{"agent.name": "sibling-agent"}),
        llm_span("llm-1", "agent", 2, 3, [1], [2], "resp-1"),
        reward_span("reward", 0.8, "agent", at=3.5),
        llm_span("llm-2", "agent-2", 3.1, 3.2, [3], [4], "resp-2"),
    ]


def _ids_and_rewards(triplets: list[Any]) -> list[tuple[str, float | None]]:
    return [(t.metadata["response_id"], t.reward) for t in triplets]


def test_c09_first_sibling_credits_the_reward_to_its_own_agent() -> None:
    """peer_failures C09: under FIRST_SIBLING the reward goes to its own agent's call (checked on 0.3.0)."""
    adapter = TracerTraceToTriplet(
        agent_match="sibling-agent",
        reward_match=RewardMatchPolicy.FIRST_SIBLING,
        _skip_empty_token_spans=True,
    )
    triplets = adapter.adapt(c09_spans())
    assert _ids_and_rewards(triplets) == [("resp-1", 0.8), ("resp-2", None)]
    assert [t.prompt["token_ids"] for t in triplets] == [[1], [3]]
    assert [t.metadata["agent_name"] for t in triplets] == ["sibling-agent", "sibling-agent"]


def test_c09_first_occurrence_is_pure_time_order() -> None:
    """peer_failures C09: under the default FIRST_OCCURRENCE the reward goes to the last call before it."""
    adapter = TracerTraceToTriplet(agent_match="sibling-agent", _skip_empty_token_spans=True)
    assert adapter.reward_match is RewardMatchPolicy.FIRST_OCCURRENCE
    assert _ids_and_rewards(adapter.adapt(c09_spans())) == [("resp-1", None), ("resp-2", 0.8)]
    # the policy may also be given by its string value
    by_name = TracerTraceToTriplet(agent_match="sibling-agent", reward_match="first_sibling")
    assert _ids_and_rewards(by_name.adapt(c09_spans())) == [("resp-1", 0.8), ("resp-2", None)]


def test_c08_no_matching_span_returns_empty_and_names_the_spans(caplog: pytest.LogCaptureFixture) -> None:
    """peer_failures C08: no matching span gives no triplet and a warning listing the span names seen."""
    spans = [
        span("root", "agent.session", None, 0, 10),
        span("chat", "chat_model.llm", "root", 1, 2, **{"gen_ai.request.model": "m", "gen_ai.prompt": "[]"}),
        reward_span("rew", 1.0, "root", at=11),
    ]
    with caplog.at_level(logging.WARNING, logger="eventlight.adapter"):
        assert TracerTraceToTriplet().adapt(spans) == []
    assert "chat_model.llm" in caplog.text and "agent.session" in caplog.text
    assert TracerTraceToTriplet().adapt([]) == []


def test_first_occurrence_second_reward_walks_back_to_an_earlier_call() -> None:
    spans = [
        span("root", "session", None, 0, 10),
        llm_span("a", "root", 1, 2, [1], [1], "r-a"),
        llm_span("b", "root", 3, 4, [2], [2], "r-b"),
        reward_span("x", 0.5, "root", at=5),
        reward_span("y", 0.25, "root", at=6),
    ]
    assert _ids_and_rewards(TracerTraceToTriplet().adapt(spans)) == [("r-a", 0.25), ("r-b", 0.5)]


def test_reward_before_call_end_is_not_credited() -> None:
    spans = [
        span("root", "session", None, 0, 10),
        llm_span("a", "root", 1, 4, [1], [1], "r-a"),
        reward_span("x", 0.5, "root", at=3),
    ]
    assert _ids_and_rewards(TracerTraceToTriplet().adapt(spans)) == [("r-a", None)]


def test_dedup_by_response_id_and_nested_calls_without_id() -> None:
    spans = [
        span("root", "session", None, 0, 10),
        llm_span("outer", "root", 1, 3, [1], [2], "same"),
        span("inner", "openai.chat.completion.raw", "outer", 1.5, 2.5),  # nested, no response id
        llm_span("again", "root", 4, 5, [1], [2], "same"),  # second instrumentation of the same call
        llm_span("other", "root", 6, 7, [3], [4], "other"),
    ]
    assert [t.metadata["response_id"] for t in TracerTraceToTriplet().adapt(spans)] == ["same", "other"]


def test_llm_calls_inside_reward_spans_are_excluded() -> None:
    judge = {"agentlightning.operation.name": "agentlightning.reward"}
    spans = [
        span("root", "session", None, 0, 10),
        llm_span("policy", "root", 1, 2, [1], [2], "r-policy"),
        span("judge", "agentlightning.operation", "root", 3, 6, **judge),
        llm_span("judge-call", "judge", 4, 5, [9], [9], "r-judge"),
        reward_span("rew", 1.0, "root", at=7),
    ]
    assert _ids_and_rewards(TracerTraceToTriplet().adapt(spans)) == [("r-policy", 1.0)]
    kept = TracerTraceToTriplet(exclude_llm_call_in_reward=False).adapt(spans)
    assert [t.metadata["response_id"] for t in kept] == ["r-policy", "r-judge"]


def test_agent_match_is_a_regex_search() -> None:
    spans = [
        span("root", "session", None, 0, 10),
        span("w", "agent", "root", 1, 3, **{"agent.name": "write_query"}),
        span("rw", "agent", "root", 4, 6, **{"agent.name": "rewrite_query"}),
        span("c", "agent", "root", 7, 9, **{"agent.name": "check_query"}),
        llm_span("l1", "w", 1.5, 2, [1], [1], "r1"),
        llm_span("l2", "rw", 4.5, 5, [2], [2], "r2"),
        llm_span("l3", "c", 7.5, 8, [3], [3], "r3"),
    ]
    triplets = TracerTraceToTriplet(agent_match="write").adapt(spans)
    assert [(t.metadata["response_id"], t.metadata["agent_name"]) for t in triplets] == [
        ("r1", "write_query"),
        ("r2", "rewrite_query"),
    ]


def test_order_is_dfs_with_input_order_not_time() -> None:
    spans = [
        span("root", "session", None, 0, 10),
        span("a1", "agent", "root", 5, 9, **{"agent.name": "late"}),
        span("a2", "agent", "root", 1, 4, **{"agent.name": "early"}),
        llm_span("l-late", "a1", 6, 7, [1], [1], "late"),
        llm_span("l-early", "a2", 2, 3, [2], [2], "early"),
    ]
    assert [t.metadata["response_id"] for t in TracerTraceToTriplet().adapt(spans)] == ["late", "early"]


def test_missing_parent_and_several_roots_get_synthetic_nodes() -> None:
    spans = [
        llm_span("l1", "lost-session", 1, 2, [1], [1], "r1"),
        reward_span("rew", 0.5, "lost-session", at=3),
        llm_span("l2", None, 4, 5, [2], [2], "r2"),
    ]
    tree = TraceTree.from_spans(spans)
    assert tree.id == "virtual-root"
    assert [c.id for c in tree.children] == ["l2", "lost-session"]
    lost = tree.children[1]
    assert (lost.start_time, lost.end_time, lost.span.attributes) == (1, 3, {})
    assert (tree.start_time, tree.end_time) == (1, 5)
    assert _ids_and_rewards(TracerTraceToTriplet().adapt(spans)) == [("r2", None), ("r1", 0.5)]
    with pytest.raises(ValueError):
        TraceTree.from_spans([])


def test_repair_hierarchy_moves_floating_calls_under_their_agent() -> None:
    spans = [
        span("root", "session", None, 0, 10),
        span("agent", "agent", "root", 1, 5, **{"agent.name": "solver"}),
        llm_span("floating", "root", 2, 3, [1], [1], "r1"),  # recorded by another instrumentation layer
    ]
    repaired = TracerTraceToTriplet(agent_match="solver").adapt(spans)
    assert [(t.metadata["response_id"], t.metadata["agent_name"]) for t in repaired] == [("r1", "solver")]
    assert TracerTraceToTriplet(agent_match="solver", repair_hierarchy=False).adapt(spans) == []


def test_skip_empty_token_spans() -> None:
    spans = [
        span("root", "session", None, 0, 10),
        llm_span("with", "root", 1, 2, [1], [2], "r1"),
        span("without", "openai.chat.completion", "root", 3, 4, **{"gen_ai.response.id": "r2"}),
    ]
    assert len(TracerTraceToTriplet().adapt(spans)) == 2
    assert [t.metadata["response_id"] for t in TracerTraceToTriplet(_skip_empty_token_spans=True).adapt(spans)] == [
        "r1"
    ]


def test_image_urls_and_logprobs() -> None:
    content = json.dumps([{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}, {"type": "text"}])
    attrs = {
        "gen_ai.prompt.0.role": "user",
        "gen_ai.prompt.0.content": content,
        "logprobs.content": json.dumps([{"token": "a", "logprob": -0.1}]),
        "gen_ai.response.id": "r",
    }
    (t,) = TracerTraceToTriplet().adapt([span("l", "openai.chat.completion", None, 0, 1, **attrs)])
    assert t.prompt["image_urls"] == ["http://x/cat.png"]
    assert t.response["logprobs"] == [{"token": "a", "logprob": -0.1}]


# ------------------------------------------------------------------------------------------
# LlmProxyTraceToTriplet


def test_llm_proxy_adapter_orders_by_sequence_only() -> None:
    spans = [
        # timestamps deliberately contradict the sequence ids
        span("p2", "litellm_request", None, 0, 1, seq=3, prompt_token_ids=[3], response_token_ids=[4]),
        span(
            "p1",
            "raw_gen_ai_request",
            None,
            9,
            9.5,
            seq=1,
            **{
                "llm.hosted_vllm.prompt_token_ids": "[1, 2]",
                "llm.hosted_vllm.response_token_ids": "[[5, 6]]",
                "llm.hosted_vllm.id": "req-1",
            },
        ),
        reward_span("r", 0.5, at=0, seq=2),
        reward_span("r2", 0.7, at=0, seq=3),  # same sequence as p2: strict < means p2 is not eligible
        span(
            "dup",
            "litellm_request",
            None,
            0,
            1,
            seq=4,
            prompt_token_ids=[1, 2],
            response_token_ids=[5],
            **{"gen_ai.response.id": "req-1"},
        ),
        span("noids", "litellm_request", None, 0, 1, seq=5, prompt_token_ids=[1]),
    ]
    triplets = LlmProxyTraceToTriplet().adapt(spans)
    assert [(t.prompt, t.response, t.reward, t.metadata) for t in triplets] == [
        ({"token_ids": [1, 2]}, {"token_ids": [5, 6]}, 0.5, {"response_id": "req-1"}),
        ({"token_ids": [3]}, {"token_ids": [4]}, None, {"response_id": None}),
    ]


def test_llm_proxy_adapter_choices_fallback() -> None:
    choices = repr([{"token_ids": [7, 8]}])
    s = span(
        "p",
        "raw_gen_ai_request",
        seq=1,
        **{
            "llm.hosted_vllm.prompt_token_ids": [1],
            "llm.hosted_vllm.choices": choices,
        },
    )
    (t,) = LlmProxyTraceToTriplet().adapt([s, reward_span("r", 1.0, seq=2)])
    assert (t.response, t.reward) == ({"token_ids": [7, 8]}, 1.0)


# ------------------------------------------------------------------------------------------
# TraceToMessages


def test_trace_to_messages_with_tools() -> None:
    call = span(
        "llm",
        "openai.chat.completion",
        None,
        **{
            "gen_ai.prompt.0.role": "system",
            "gen_ai.prompt.0.content": "be brief",
            "gen_ai.prompt.1.role": "user",
            "gen_ai.prompt.1.content": "weather?",
            "gen_ai.completion.0.role": "assistant",
            "gen_ai.completion.0.content": "checking",
            "gen_ai.request.functions.0.name": "get_weather",
            "gen_ai.request.functions.0.description": "Weather by city",
            "gen_ai.request.functions.0.parameters": '{"type": "object"}',
        },
    )
    tool = span(
        "tool",
        "tool_call",
        "llm",
        **{
            "tool.name": "get_weather",
            "tool.parameters": '{"city": "Oslo"}',
            "tool.call.id": "c1",
            "tool.call.type": "function",
        },
    )
    other = span(
        "misc",
        "agentlightning.annotation",
        None,
        **{"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 1.0},
    )
    (record,) = TraceToMessages()([call, tool, other])
    assert record["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "checking",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
    ]
    assert record["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather by city",
                "parameters": {"type": "object"},
            },
        }
    ]


def test_trace_to_messages_prompt_tool_calls_and_roles() -> None:
    s = span(
        "llm",
        "openai.chat.completion",
        **{
            "gen_ai.prompt.0.role": "user",
            "gen_ai.prompt.0.content": "hi",
            "gen_ai.prompt.1.tool_calls.0.id": "c9",
            "gen_ai.prompt.1.tool_calls.0.name": "f",
            "gen_ai.prompt.1.tool_calls.0.arguments": "{}",
            "gen_ai.prompt.2.tool_call_id": "c9",
            "gen_ai.prompt.2.content": "42",
            "gen_ai.prompt.5.role": "user",  # index gaps keep the order
            "gen_ai.prompt.5.content": "thanks",
            "gen_ai.response.id": "r",
        },
    )
    (record,) = TraceToMessages().adapt([s])
    assert record == {
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "42", "tool_call_id": "c9"},
            {"role": "user", "content": "thanks"},
        ],
        "tools": None,
    }


def test_trace_to_messages_rejects_non_list_prompt() -> None:
    with pytest.raises(ValueError):
        TraceToMessages().adapt([span("x", "llm", **{"gen_ai.prompt.role": "user"})])
    assert TraceToMessages().adapt([span("x", "plain", foo=1)]) == []


def test_llm_proxy_adapter_reads_eventlight_proxy_spans() -> None:
    spans = [
        llm_span("call", None, 0, 1, [1, 2], [3], "resp-1"),
        span("no-ids", "openai.chat.completion", None, seq=2, **{"gen_ai.response.id": "resp-2"}),
        reward_span("r", 1.0, seq=3),
    ]
    spans[0].sequence_id = 1
    (t,) = LlmProxyTraceToTriplet().adapt(spans)
    assert (t.prompt, t.response, t.reward, t.metadata) == (
        {"token_ids": [1, 2]},
        {"token_ids": [3]},
        1.0,
        {"response_id": "resp-1"},
    )


def test_opentelemetry_readable_spans_are_accepted() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    call = {"gen_ai.response.id": "r1", "prompt_token_ids": [1, 2], "response_token_ids": [3]}
    reward = {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 0.5}
    with tracer.start_as_current_span("session"):
        with tracer.start_as_current_span("openai.chat.completion", attributes=call):
            pass
        with tracer.start_as_current_span("agentlightning.annotation", attributes=reward):
            pass
    readable = list(exporter.get_finished_spans())
    assert find_final_reward(readable) == 0.5
    (t,) = TracerTraceToTriplet().adapt(readable)
    assert (t.prompt["token_ids"], t.response["token_ids"], t.reward) == ([1, 2], [3], 0.5)
    provider.shutdown()


def test_image_urls_from_content_parts_as_lists_or_json_text() -> None:
    from eventlight.adapter.triplets import _image_urls

    part = {"type": "image_url", "image_url": {"url": "http://x/1.png"}}
    prompt = [
        {"role": "user", "content": [part, {"type": "text", "text": "hi"}]},
        {"role": "user", "content": " \n" + json.dumps([{**part, "image_url": {"url": "http://x/2.png"}}])},
        {"role": "user", "content": json.dumps({"type": "image_url", "image_url": {"url": "http://x/3.png"}})},
        {"role": "user", "content": "[not json"},
        {"role": "user", "content": "plain text"},
    ]
    assert _image_urls(prompt) == ["http://x/1.png", "http://x/2.png"]
