"""LLMProxy against a scripted OpenAI-compatible upstream and an in-memory store."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import msgspec
import openai
import pytest
from llm_stub import Reply, ScriptedLLM, ToolCall, toy_tokenize
from slow_client import trickle_post

from eventlight.attributes import unflatten_attributes
from eventlight.core.types import LLM, ProxyLLM, Span
from eventlight.llm_proxy import LLMProxy, chat_completion_to_sse
from eventlight.net import free_port
from eventlight.store.memory import InMemoryLightningStore

MODEL = "stub-model"

# LiteLLM makes pydantic warn about ``ReadOnly`` TypedDict items on its first calls (some on every call).
pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")


def model_list(url: str, name: str = MODEL) -> list[dict[str, Any]]:
    return [
        {
            "model_name": name,
            "litellm_params": {"model": "openai/backend-model", "api_base": url, "api_key": "sk-test"},
        }
    ]


@asynccontextmanager
async def running_proxy(url: str, store: Any, **kwargs: Any) -> AsyncIterator[LLMProxy]:
    proxy = LLMProxy(model_list=model_list(url), store=store, **kwargs)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


def client_for(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="dummy", max_retries=0, timeout=30)


def last_user(messages: list[dict[str, Any]]) -> str:
    return next(m["content"] for m in reversed(messages) if m["role"] == "user")


async def spans_of(store: InMemoryLightningStore, rollout_id: str) -> list[Span]:
    return list(await store.query_spans(rollout_id))


def check_legal_attributes(attributes: dict[str, Any]) -> None:
    for key, value in attributes.items():
        if isinstance(value, list):
            assert len({type(v) for v in value}) <= 1, key
            assert all(isinstance(v, (str, int, float, bool)) for v in value), key
        else:
            assert isinstance(value, (str, int, float, bool)), (key, value)
    unflatten_attributes(attributes)  # no key both holds a value and nests others


# ---------------------------------------------------------------------------------------------


async def test_three_calls_give_three_spans_with_gen_ai_attributes() -> None:
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses=lambda messages, request: Reply(content=f"the answer to {last_user(messages)}"))
    async with stub as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        resource = proxy.as_resource()
        assert isinstance(resource, ProxyLLM)
        client = client_for(resource.get_base_url(rid, aid))
        answers = []
        for q in ("2+2?", "3+3?", "4+4?"):
            resp = await client.chat.completions.create(
                model=resource.model,
                messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": q}],
                temperature=0.25,
                max_tokens=32,
            )
            answers.append(resp.choices[0].message.content)
        await client.close()

        assert answers == ["the answer to 2+2?", "the answer to 3+3?", "the answer to 4+4?"]
        # Upstream: stream off, token ids asked for, the deployment's model name used.
        assert len(stub.requests) == 3
        for sent in stub.requests:
            assert not sent.get("stream")
            assert sent["return_token_ids"] is True
            assert sent["model"] == "backend-model"
            assert sent["temperature"] == 0.25 and sent["max_tokens"] == 32

        spans = await spans_of(store, rid)
        assert [s.sequence_id for s in spans] == [1, 2, 3]
        for span, q in zip(spans, ("2+2?", "3+3?", "4+4?"), strict=True):
            a = span.attributes
            assert span.name == "openai.chat.completion"
            assert span.rollout_id == rid and span.attempt_id == aid
            assert span.status.status_code == "OK"
            assert re.fullmatch(r"[0-9a-f]{32}", span.trace_id) and re.fullmatch(r"[0-9a-f]{16}", span.span_id)
            assert span.parent_id is None
            assert span.start_time is not None and span.end_time is not None
            assert 0 <= span.end_time - span.start_time < 30  # seconds, not ns
            assert span.resource.attributes["agentlightning.rollout_id"] == rid
            assert span.resource.attributes["agentlightning.attempt_id"] == aid
            assert span.resource.attributes["agentlightning.span_sequence_id"] == span.sequence_id
            assert a["gen_ai.system"] == "openai"
            assert a["gen_ai.request.model"] == MODEL
            assert a["gen_ai.request.temperature"] == 0.25
            assert a["gen_ai.request.max_tokens"] == 32
            assert a["gen_ai.prompt.0.role"] == "system" and a["gen_ai.prompt.0.content"] == "be brief"
            assert a["gen_ai.prompt.1.role"] == "user" and a["gen_ai.prompt.1.content"] == q
            assert a["gen_ai.completion.0.role"] == "assistant"
            assert a["gen_ai.completion.0.content"] == f"the answer to {q}"
            assert a["gen_ai.completion.0.finish_reason"] == "stop"
            assert a["gen_ai.response.id"].startswith("chatcmpl-")
            assert a["gen_ai.response.model"] == "backend-model"
            assert a["gen_ai.usage.completion_tokens"] == len(toy_tokenize(f"the answer to {q}"))
            assert a["gen_ai.usage.prompt_tokens"] == len(a["prompt_token_ids"])
            assert a["response_token_ids"] == toy_tokenize(f"the answer to {q}")
            assert a["prompt_token_ids"] and all(isinstance(t, int) for t in a["prompt_token_ids"])
            assert "token_ids_incomplete" not in a
            assert a["http.status_code"] == 200
            check_legal_attributes(a)
        assert len({s.attributes["gen_ai.response.id"] for s in spans}) == 3


async def test_concurrent_calls_get_distinct_sequence_ids() -> None:
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses=lambda messages, request: Reply(content=last_user(messages), delay_s=0.05))
    async with stub as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        client = client_for(proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
        replies = await asyncio.gather(
            *(
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"q{i}"}])
                for i in range(8)
            )
        )
        await client.close()
        assert [r.choices[0].message.content for r in replies] == [f"q{i}" for i in range(8)]
        spans = await spans_of(store, rollout.rollout_id)
        assert sorted(s.sequence_id for s in spans) == list(range(1, 9))
        # Each span holds its own call's prompt and answer.
        assert all(
            s.attributes["gen_ai.prompt.0.content"] == s.attributes["gen_ai.completion.0.content"] for s in spans
        )


async def test_client_response_carries_token_ids() -> None:
    store = InMemoryLightningStore()
    async with ScriptedLLM(responses="hello there") as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{base}/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
        assert r.status_code == 200
        body = r.json()
        assert body["choices"][0]["message"]["content"] == "hello there"
        assert body["choices"][0]["token_ids"] == toy_tokenize("hello there")
        assert body["prompt_token_ids"] == (await spans_of(store, rollout.rollout_id))[0].attributes["prompt_token_ids"]


async def test_stream_gives_same_text_ends_with_done_and_same_span() -> None:
    """peer_failures C12: a streamed call gives the same text, ends with [DONE] and records the same token ids."""
    store = InMemoryLightningStore()
    long_text = "The quick brown fox jumps over the lazy dog, " * 3 + "and that is all."
    stub = ScriptedLLM(responses=long_text)
    async with stub as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        rid, aid = rollout.rollout_id, rollout.attempt.attempt_id
        base = proxy.as_resource().get_base_url(rid, aid)
        messages = [{"role": "user", "content": "tell me"}]
        client = client_for(base)
        plain = await client.chat.completions.create(model=MODEL, messages=messages)
        stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True)
        chunks = [chunk async for chunk in stream]
        await client.close()
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == plain.choices[0].message.content == long_text
        assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # really chunked
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "stop"

        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{base}/chat/completions",
                json={
                    "model": MODEL,
                    "messages": messages,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.text.split("\n\n") if line]
        assert all(e.startswith("data: ") for e in events)
        assert events[-1] == "data: [DONE]"
        payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
        assert all(p["object"] == "chat.completion.chunk" for p in payloads)
        assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] > 0

        assert len(stub.requests) == 3 and not any(sent.get("stream") for sent in stub.requests)
        spans = await spans_of(store, rid)
        assert [s.sequence_id for s in spans] == [1, 2, 3]
        plain_span, stream_span = spans[0].attributes, spans[1].attributes
        assert plain_span["llm.is_streaming"] is False and stream_span["llm.is_streaming"] is True
        for key in (
            "prompt_token_ids",
            "response_token_ids",
            "gen_ai.completion.0.content",
            "gen_ai.prompt.0.content",
            "gen_ai.usage.completion_tokens",
        ):
            assert stream_span[key] == plain_span[key], key
        assert stream_span["response_token_ids"] == toy_tokenize(long_text)


async def test_stream_is_forced_off_upstream() -> None:
    """peer_failures C12: the proxy never streams from upstream."""
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses="ok")
    async with stub as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        client = client_for(proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == "ok"
        await client.close()
    assert len(stub.requests) == 1
    assert not stub.requests[0].get("stream") and "stream_options" not in stub.requests[0]


async def test_tool_calls_survive_stream_conversion_and_are_recorded() -> None:
    """peer_failures C12, C14: a streamed tool call survives and its ids are complete."""
    store = InMemoryLightningStore()
    args = {"location": "San Francisco, California, United States of America", "unit": "celsius"}
    reply = Reply(content=None, tool_calls=[ToolCall("get_current_weather", args, id="call_1")])
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_current_weather",
                "description": "weather now",
                "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
            },
        }
    ]
    async with ScriptedLLM(responses=reply) as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        client = client_for(proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
        messages = [{"role": "user", "content": "weather in SF?"}]
        stream = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools, stream=True)
        name, arguments, call_id, finish = "", "", None, None
        async for chunk in stream:
            for choice in chunk.choices:
                for tc in choice.delta.tool_calls or []:
                    assert tc.index == 0
                    call_id = tc.id or call_id
                    name += (tc.function.name or "") if tc.function else ""
                    arguments += (tc.function.arguments or "") if tc.function else ""
                finish = choice.finish_reason or finish
        await client.close()
        assert (name, call_id, finish) == ("get_current_weather", "call_1", "tool_calls")
        assert json.loads(arguments) == args

        (span,) = await spans_of(store, rollout.rollout_id)
        a = span.attributes
        assert a["gen_ai.completion.0.tool_calls.0.name"] == "get_current_weather"
        assert json.loads(a["gen_ai.completion.0.tool_calls.0.arguments"]) == args
        assert a["gen_ai.completion.0.tool_calls.0.id"] == "call_1"
        assert a["gen_ai.completion.0.finish_reason"] == "tool_calls"
        assert a["gen_ai.request.functions.0.name"] == "get_current_weather"
        assert json.loads(a["gen_ai.request.functions.0.parameters"])["type"] == "object"
        assert a["response_token_ids"] and "token_ids_incomplete" not in a
        check_legal_attributes(a)


async def test_prompt_with_tool_history_and_list_content_is_flattened() -> None:
    store = InMemoryLightningStore()
    async with ScriptedLLM(responses="done") as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        messages = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{base}/chat/completions", json={"model": MODEL, "messages": messages})
        assert r.status_code == 200, r.text
        (span,) = await spans_of(store, rollout.rollout_id)
        a = span.attributes
        assert json.loads(a["gen_ai.prompt.0.content"])[1]["type"] == "image_url"
        assert a["gen_ai.prompt.1.tool_calls.0.name"] == "f"
        assert a["gen_ai.prompt.1.tool_calls.0.id"] == "c1"
        assert a["gen_ai.prompt.2.tool_call_id"] == "c1" and a["gen_ai.prompt.2.content"] == "42"
        # the same call in the current GenAI conventions (JSON messages of parts)
        assert json.loads(a["gen_ai.input.messages"]) == [
            {
                "role": "user",
                "parts": [
                    {"type": "text", "content": "look"},
                    {"type": "uri", "modality": "image", "uri": "data:image/png;base64,AA"},
                ],
            },
            {"role": "assistant", "parts": [{"type": "tool_call", "id": "c1", "name": "f", "arguments": {"a": 1}}]},
            {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "42"}]},
        ]
        (out,) = json.loads(a["gen_ai.output.messages"])
        assert out["role"] == "assistant" and out["parts"] == [{"type": "text", "content": "done"}]
        assert out["finish_reason"] == a["gen_ai.completion.0.finish_reason"]
        assert a["gen_ai.provider.name"] == a["gen_ai.system"]
        assert a["gen_ai.usage.input_tokens"] == a["gen_ai.usage.prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == a["gen_ai.usage.completion_tokens"]
        assert "gen_ai.system_instructions" not in a  # no system message
        check_legal_attributes(a)


async def test_unknown_rollout_or_attempt_gives_404_and_records_nothing() -> None:
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses="never")
    async with stub as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        resource = proxy.as_resource()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient() as http:
            r = await http.post(resource.get_base_url("ro-doesnotexist", "at-nope") + "/chat/completions", json=body)
            assert r.status_code == 404
            assert "ro-doesnotexist" in r.json()["error"]["message"]
            r = await http.post(resource.get_base_url(rollout.rollout_id, "at-nope") + "/chat/completions", json=body)
            assert r.status_code == 404
            assert "at-nope" in r.json()["error"]["message"]
            assert "Traceback" not in r.text
        client = client_for(resource.get_base_url("ro-doesnotexist", "at-nope"))
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        await client.close()
        assert stub.requests == []
        assert await spans_of(store, rollout.rollout_id) == []
        # A failed lookup does not burn a sequence id of the real attempt.
        client = client_for(resource.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        await client.close()
        assert [s.sequence_id for s in await spans_of(store, rollout.rollout_id)] == [1]


async def test_upstream_400_is_returned_and_recorded_as_error_span_without_retry() -> None:
    """peer_failures C15: an over-long prompt's 400 is answered, recorded as an error span, not retried."""
    store = InMemoryLightningStore()
    too_long = "This model's maximum context length is 4608 tokens. However, you requested 6859 tokens."

    def script(messages: list[dict[str, Any]], request: dict[str, Any]) -> Reply:
        if len(last_user(messages)) > 100:
            return Reply(status=400, error_message=too_long)
        return Reply(content="short answer")

    stub = ScriptedLLM(responses=script)
    async with stub as url, running_proxy(url, store, num_retries=3) as proxy:
        rollout = await store.start_rollout(input={})
        client = client_for(proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
        with pytest.raises(openai.BadRequestError) as info:
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x " * 200}], max_tokens=512
            )
        assert info.value.status_code == 400
        assert "maximum context length" in str(info.value)
        assert len(stub.requests) == 1  # a deterministic 400 is not retried
        with pytest.raises(openai.BadRequestError):  # the stream path answers the error too
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "y " * 200}], stream=True
            )
        ok = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        assert ok.choices[0].message.content == "short answer"
        await client.close()

        spans = await spans_of(store, rollout.rollout_id)
        assert [s.sequence_id for s in spans] == [1, 2, 3]
        for err in spans[:2]:
            a = err.attributes
            assert err.status.status_code == "ERROR"
            assert "maximum context length" in (err.status.description or "")
            assert a["http.status_code"] == 400
            # LiteLLM's exception class; it recognises the context-length message.
            assert a["error.type"] in ("ContextWindowExceededError", "BadRequestError")
            assert "maximum context length" in a["error.message"]
            assert a["gen_ai.request.model"] == MODEL and a["gen_ai.prompt.0.role"] == "user"
            assert not any(k.startswith("gen_ai.completion") for k in a)
            assert "response_token_ids" not in a
            assert err.events and err.events[0].name == "exception"
            check_legal_attributes(a)
        assert spans[0].attributes["gen_ai.request.max_tokens"] == 512
        assert spans[2].status.status_code == "OK"


async def test_retryable_upstream_failure_is_retried() -> None:
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses=[Reply(status=503, error_message="overloaded"), Reply(content="second try")])
    async with stub as url, running_proxy(url, store, num_retries=1) as proxy:
        rollout = await store.start_rollout(input={})
        client = client_for(proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
        resp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        await client.close()
        assert resp.choices[0].message.content == "second try"
        assert len(stub.requests) == 2
        (span,) = await spans_of(store, rollout.rollout_id)
        assert span.status.status_code == "OK"


async def test_unreachable_backend_gives_502_and_error_span() -> None:
    store = InMemoryLightningStore()
    dead = f"http://127.0.0.1:{free_port()}/v1"
    async with running_proxy(dead, store) as proxy:
        rollout = await store.start_rollout(input={})
        base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{base}/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            )
        assert r.status_code == 502
        assert r.json()["error"]["message"]
        (span,) = await spans_of(store, rollout.rollout_id)
        assert span.status.status_code == "ERROR" and span.attributes["http.status_code"] == 502


async def test_incomplete_token_ids_are_flagged() -> None:
    """peer_failures C14: ids that do not add up to the usage counts are flagged on the span."""
    store = InMemoryLightningStore()
    replies = [
        Reply(content="a b c", completion_tokens=7),
        Reply(content="a b c"),
        Reply(content="no ids", return_token_ids=False),
    ]
    async with ScriptedLLM(responses=replies) as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        client = client_for(proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
        for _ in replies:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        await client.close()
        short, complete, absent = (s.attributes for s in await spans_of(store, rollout.rollout_id))
        assert short["token_ids_incomplete"] is True
        assert short["response_token_ids"] == toy_tokenize("a b c")
        assert "token_ids_incomplete" not in complete
        assert "response_token_ids" not in absent and "prompt_token_ids" not in absent
        assert "token_ids_incomplete" not in absent


async def test_latest_attempt_alias_records_under_the_real_attempt() -> None:
    store = InMemoryLightningStore()
    async with ScriptedLLM(responses="ok") as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        client = client_for(proxy.as_resource().get_base_url(rollout.rollout_id, "latest"))
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        await client.close()
        (span,) = await spans_of(store, rollout.rollout_id)
        assert span.attempt_id == rollout.attempt.attempt_id


async def test_unrouted_call_is_forwarded_not_recorded_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses="plain")
    async with stub as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        client = client_for(proxy.endpoint)
        with caplog.at_level(logging.WARNING, logger="eventlight.llm_proxy"):
            for _ in range(2):
                resp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
                assert resp.choices[0].message.content == "plain"
        models = await client.models.list()
        await client.close()
        assert [m.id for m in models.data] == [MODEL]
        warnings = [r for r in caplog.records if "not recorded" in r.getMessage()]
        assert len(warnings) == 1
        assert len(stub.requests) == 2
        assert await spans_of(store, rollout.rollout_id) == []
        async with httpx.AsyncClient() as http:
            health = await http.get(proxy.endpoint.removesuffix("/v1") + "/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"


async def test_store_failure_on_add_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    class BrokenStore(InMemoryLightningStore):
        async def add_many_spans(self, spans: Any) -> list[Span]:
            raise RuntimeError("disk on fire")

    store = BrokenStore()
    async with ScriptedLLM(responses="fine") as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        client = client_for(proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
        with caplog.at_level(logging.ERROR, logger="eventlight.llm_proxy"):
            resp = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        await client.close()
        assert resp.choices[0].message.content == "fine"
        assert any("could not record span" in r.getMessage() for r in caplog.records)


async def test_bad_request_bodies_get_json_errors() -> None:
    store = InMemoryLightningStore()
    async with ScriptedLLM(responses="x") as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        async with httpx.AsyncClient() as http:
            r = await http.post(f"{base}/chat/completions", content=b"{not json")
            assert r.status_code == 400 and "error" in r.json()
            r = await http.post(f"{base}/chat/completions", json={"model": MODEL})
            assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
            r = await http.post(
                f"{base}/chat/completions",
                json={"model": "unknown-model", "messages": [{"role": "user", "content": "x"}]},
            )
            assert r.status_code == 400 and "unknown-model" in r.json()["error"]["message"]


async def test_nan_and_lone_surrogates_get_400_not_an_unrecorded_500() -> None:
    # Python's json takes NaN / Infinity and a lone "\\ud800"; LiteLLM then failed to send them (500,
    # counted as a backend failure) and the store refused the span (the call left no trace).
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses="x")
    async with stub as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        head = b'{"model": "stub-model", "messages": [{"role": "user", "content": '
        bodies = [
            head + b'"a\\ud800b"}]}',
            head + b'"a\\uDC00"}]}',
            head + b'"x"}], "temperature": NaN}',
            head + b'"x", "extra": -Infinity}]}',
        ]
        async with httpx.AsyncClient() as http:
            for body in bodies:
                r = await http.post(f"{base}/chat/completions", content=body)
                assert r.status_code == 400, (body, r.text)
                assert r.json()["error"]["type"] == "invalid_request_error"
            ok = head + b'"\\ud83d\\ude00 \\u00e9"}]}'  # a surrogate pair is text
            r = await http.post(f"{base}/chat/completions", content=ok)
            assert r.status_code == 200, r.text
        assert [m["messages"][0]["content"] for m in stub.requests] == ["\U0001f600 \u00e9"]
        assert proxy.health.calls == 1
        (span,) = await spans_of(store, rollout.rollout_id)
        assert span.status.status_code == "OK"


async def test_wrong_field_types_get_400_forward_nothing_and_leave_health_alone() -> None:
    # LiteLLM fails on these before sending, as a 502 "cannot reach the upstream" that counted as a
    # backend failure (a client bug could trip the Trainer's LLM health) and burnt an error span.
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses="x")
    async with stub as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        hi = [{"role": "user", "content": "hi"}]
        cases = [
            ({"model": 5, "messages": hi}, "model"),
            ({"model": ["a"], "messages": hi}, "model"),
            ({"model": MODEL, "messages": ["hi"]}, "messages"),
            ({"model": MODEL, "messages": [*hi, None]}, "messages"),
            ({"model": MODEL, "messages": hi, "stream": "false"}, "stream"),
            ({"model": MODEL, "messages": hi, "stream": True, "stream_options": "yes"}, "stream_options"),
            ({"model": MODEL, "messages": hi, "stream": True, "stream_options": ["include_usage"]}, "stream_options"),
        ]
        async with httpx.AsyncClient() as http:
            for body, param in cases:
                r = await http.post(f"{base}/chat/completions", json=body)
                assert r.status_code == 400, (body, r.text)
                assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param
                r = await http.post(f"{base}/messages", json={**body, "max_tokens": 5})
                assert r.status_code == 400, (body, r.text)
                assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
        assert stub.requests == []
        assert await spans_of(store, rollout.rollout_id) == []
        assert proxy.health.calls == 0


@pytest.mark.filterwarnings("ignore:Sending a large body:ResourceWarning")  # aiohttp, under LiteLLM
async def test_a_call_too_large_for_one_event_is_recorded_with_its_largest_texts_left_off() -> None:
    # A 5 MB prompt (an image, a document) is held twice by the span (flattened and as
    # gen_ai.input.messages): over the 8 MiB an event holds, the store refused the span and the
    # client's successful call left no span at all.
    store = InMemoryLightningStore()
    big = "x" * 5_000_000
    async with ScriptedLLM(responses="seen it") as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        client = client_for(proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
        messages: Any = [{"role": "system", "content": "look"}, {"role": "user", "content": big}]
        resp = await client.chat.completions.create(model=MODEL, messages=messages)
        await client.close()
        assert resp.choices[0].message.content == "seen it"
        (span,) = await spans_of(store, rollout.rollout_id)
    a = span.attributes
    assert span.status.status_code == "OK"
    omitted = a["eventlight.llm_proxy.omitted_attributes"]
    assert omitted and set(omitted) <= {"gen_ai.prompt.1.content", "gen_ai.input.messages"}
    assert not set(omitted) & set(a)
    assert len(msgspec.json.encode(span)) < 8 * 1024 * 1024
    assert a["gen_ai.prompt.0.content"] == "look" and a["gen_ai.completion.0.content"] == "seen it"
    assert a["prompt_token_ids"] and a["response_token_ids"] == toy_tokenize("seen it")
    check_legal_attributes(a)


async def test_internal_failure_answers_json_500(monkeypatch: pytest.MonkeyPatch) -> None:
    import eventlight.llm_proxy.span_attributes as module

    def broken(*args: Any, **kwargs: Any) -> dict[str, Any]:
        raise KeyError("bug")

    monkeypatch.setattr(module, "build_chat_span_attributes", broken)
    store = InMemoryLightningStore()
    async with ScriptedLLM(responses="x") as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{base}/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
            )
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "internal_error" and "Traceback" not in r.text
        assert proxy.is_running()


# -- configuration and lifecycle -------------------------------------------------------------


def test_as_resource_model_resolution_and_routing() -> None:
    proxy = LLMProxy(port=12345, model_list=model_list("http://x/v1"))
    res = proxy.as_resource(sampling_parameters={"temperature": 0.7})
    assert isinstance(res, ProxyLLM)
    assert res.endpoint == "http://127.0.0.1:12345/v1" == proxy.endpoint
    assert res.model == MODEL and res.sampling_parameters == {"temperature": 0.7}
    assert res.get_base_url("ro-1", "at-1") == "http://127.0.0.1:12345/rollout/ro-1/attempt/at-1/v1"
    baked = proxy.as_resource("ro-1", "at-1")
    assert type(baked) is LLM and baked.endpoint == "http://127.0.0.1:12345/rollout/ro-1/attempt/at-1/v1"
    with pytest.raises(ValueError):
        proxy.as_resource("ro-1", None)
    assert proxy.as_resource(model="other").model == "other"

    two = LLMProxy(model_list=model_list("http://a/v1", "a") + model_list("http://b/v1", "b"))
    with pytest.raises(ValueError, match="model"):
        two.as_resource()
    same = LLMProxy(model_list=model_list("http://a/v1", "m") + model_list("http://b/v1", "m"))
    assert same.as_resource().model == "m"
    with pytest.raises(ValueError):
        LLMProxy(model_list=[]).as_resource()
    with pytest.raises(ValueError):
        LLMProxy(model_list=[{"model_name": "m"}])
    assert isinstance(LLMProxy().port, int)


async def test_stop_cutting_a_call_short_records_it_as_an_error_span(monkeypatch: pytest.MonkeyPatch) -> None:
    # stop() gives requests in flight a grace period, then uvicorn cancels them; the cancelled call had
    # its sequence id and left no span at all (the call vanished from the attempt's trace).
    import eventlight.llm_proxy.server as server_module

    monkeypatch.setattr(server_module, "_SHUTDOWN_TIMEOUT_S", 1.0)
    store = InMemoryLightningStore()
    arrived = asyncio.Event()

    def script(messages: list[dict[str, Any]], request: dict[str, Any]) -> Reply:
        arrived.set()
        return Reply(content="late", delay_s=4)

    stub = ScriptedLLM(responses=script)
    async with stub as url:
        proxy = LLMProxy(model_list=model_list(url), store=store)
        await proxy.start()
        rollout = await store.start_rollout(input={})
        base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        async with httpx.AsyncClient(timeout=30) as http:
            call = asyncio.create_task(
                http.post(
                    f"{base}/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                )
            )
            await asyncio.wait_for(arrived.wait(), 10)
            await proxy.stop()
            r = await call
        assert r.status_code >= 500
        (span,) = await spans_of(store, rollout.rollout_id)
        assert span.sequence_id == 1 and span.status.status_code == "ERROR"
        assert span.attributes["error.type"] == "Cancelled" and span.attributes["http.status_code"] == 503
        assert "stopped" in (span.status.description or "")
        assert span.attributes["gen_ai.prompt.0.content"] == "hi"


async def test_stop_under_calls_in_flight_answers_each_503_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The proxy stopped under calls still waiting for their model (runners on other machines, a
    trainer of role ``algorithm``, ``proxy.stop()`` called directly): uvicorn cancelled each after its
    grace, logged "Exception in ASGI application" with a traceback per call and answered a plain-text
    500. Each now answers 503 with OpenAI's error object (the Anthropic route: Anthropic's), one
    warning line says how many were cut, and each call's span is still recorded as cancelled. (peer_failures C06)"""
    import eventlight.llm_proxy.server as server_module

    monkeypatch.setattr(server_module, "_SHUTDOWN_TIMEOUT_S", 1.0)
    store = InMemoryLightningStore()
    arrived: list[str] = []

    def script(messages: list[dict[str, Any]], request: dict[str, Any]) -> Reply:
        arrived.append(last_user(messages))
        return Reply(content="late", delay_s=20)

    n = 4
    async with ScriptedLLM(responses=script) as url:
        proxy = LLMProxy(model_list=model_list(url), store=store)
        await proxy.start()
        rollout = await store.start_rollout(input={})
        base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                calls = [asyncio.create_task(http.post(f"{base}/chat/completions", json=body)) for _ in range(n)]
                calls.append(asyncio.create_task(http.post(f"{base}/messages", json=body)))
                while len(arrived) < n + 1:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
                t0 = asyncio.get_running_loop().time()
                with caplog.at_level(logging.INFO):
                    await proxy.stop()
                    answers = await asyncio.wait_for(asyncio.gather(*calls), 10)
                    stop_s = asyncio.get_running_loop().time() - t0
                    logged = list(caplog.records)  # the stub's own stop, later, cuts its sleeping handlers
        finally:
            await proxy.stop()
    assert [a.status_code for a in answers] == [503] * (n + 1)
    error = answers[0].json()["error"]
    assert error["type"] == "server_stopping" and "stopped" in error["message"], error
    assert answers[-1].json()["type"] == "error"  # the Anthropic route answers in Anthropic's shape
    assert stop_s < 5, stop_s  # the grace, not uvicorn's own timeout on top
    lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in logged]
    assert not [r for r in logged if r.exc_info or r.levelno >= logging.ERROR], lines
    cut = [line for line in lines if "503" in line]
    assert len(cut) == 1 and f"{n + 1} call(s)" in cut[0], lines
    spans = await spans_of(store, rollout.rollout_id)
    assert len(spans) == n + 1
    assert all(s.status.status_code == "ERROR" and s.attributes["error.type"] == "Cancelled" for s in spans)
    assert all(s.attributes["http.status_code"] == 503 for s in spans)


async def test_lifecycle_stop_is_idempotent_and_restart_keeps_the_port() -> None:
    store = InMemoryLightningStore()
    async with ScriptedLLM(responses="hi") as url:
        proxy = LLMProxy(model_list=model_list(url), store=store)
        assert not proxy.is_running()
        await proxy.stop()  # never started: no-op
        await proxy.start()
        await proxy.start()  # already running: no-op
        assert proxy.is_running()
        port = proxy.port
        await proxy.restart()
        assert proxy.is_running() and proxy.port == port
        rollout = await store.start_rollout(input={})
        client = client_for(proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
        assert (await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])).choices[
            0
        ].message.content == "hi"
        await client.close()
        await proxy.stop()
        await proxy.stop()
        assert not proxy.is_running()
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(f"http://127.0.0.1:{port}/health")


async def test_port_in_use_raises_oserror() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        proxy = LLMProxy(port=s.getsockname()[1])
        with pytest.raises(OSError):
            await proxy.start()
        assert not proxy.is_running()


async def test_update_model_list_switches_backend_of_a_running_proxy() -> None:
    store = InMemoryLightningStore()
    async with ScriptedLLM(responses="from A") as url_a, ScriptedLLM(responses="from B") as url_b:
        async with running_proxy(url_a, store) as proxy:
            rollout = await store.start_rollout(input={})
            client = client_for(proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id))
            msgs = [{"role": "user", "content": "x"}]
            assert (await client.chat.completions.create(model=MODEL, messages=msgs)).choices[0].message.content == (
                "from A"
            )
            proxy.update_model_list(model_list(url_b))
            assert (await client.chat.completions.create(model=MODEL, messages=msgs)).choices[0].message.content == (
                "from B"
            )
            await client.close()
            assert [s.sequence_id for s in await spans_of(store, rollout.rollout_id)] == [1, 2]


async def test_return_token_ids_setting() -> None:
    stub = ScriptedLLM(responses="x")
    async with stub as url:
        for setting, expected in ((None, True), (False, False), (True, True)):
            async with running_proxy(url, None, return_token_ids=setting) as proxy:
                client = client_for(proxy.endpoint)
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
                await client.close()
            assert ("return_token_ids" in stub.requests[-1]) is expected, setting


# -- the SSE converter and the stub themselves ----------------------------------------------


def test_chat_completion_to_sse_pieces_reassemble() -> None:
    completion = {
        "id": "chatcmpl-1",
        "created": 1,
        "model": "m",
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "finish_reason": None,
                "token_ids": [5, 6, 7],
                "message": {
                    "role": "assistant",
                    "content": "word " * 20,
                    "tool_calls": [
                        {
                            "id": "t",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"k": "' + "v" * 90 + '"}'},
                        }
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5},
    }
    events = [e.decode() for e in chat_completion_to_sse(completion, include_usage=True)]
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "word " * 20
    pieces = [d["content"] for d in deltas if d.get("content")]
    assert all(len(p) <= 28 for p in pieces) and all(p.endswith(" ") for p in pieces)
    args = "".join(tc["function"].get("arguments", "") for d in deltas for tc in d.get("tool_calls", []))
    assert json.loads(args) == {"k": "v" * 90}
    assert chunks[0]["prompt_token_ids"] == [1, 2]
    finals = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["finish_reason"] == "tool_calls" and finals[0]["token_ids"] == [5, 6, 7]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


async def test_scripted_llm_script_forms() -> None:
    async def script(messages: list[dict[str, Any]], request: dict[str, Any]) -> str:
        return last_user(messages).upper()

    async with ScriptedLLM(responses=script) as url:
        client = client_for(url)
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "shout"}])
        assert r.choices[0].message.content == "SHOUT"
        await client.close()
    stub = ScriptedLLM(responses=["one", Reply(content="two")])
    async with stub as url:
        client = client_for(url)
        got = [
            (await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "q"}]))
            .choices[0]
            .message.content
            for _ in range(3)
        ]
        await client.close()
    assert got == ["one", "two", "two"] and len(stub.requests) == 3
    async with ScriptedLLM() as url:
        client = client_for(url)
        r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "ping"}])
        assert r.choices[0].message.content == "echo: ping"
        await client.close()


async def test_no_credential_reaches_a_span_or_a_client_chosen_backend() -> None:
    """A client cannot point the proxy at another backend (LiteLLM would hand it the deployment's
    ``api_key``), and no key or authorization header is stored in any span, on success, on a
    stream or on an upstream error."""
    store = InMemoryLightningStore()
    secrets = ("sk-test", "sk-client-secret", "sk-body-secret", "x-secret-header")

    def script(messages: list[dict[str, Any]], request: dict[str, Any]) -> Reply:
        if last_user(messages) == "fail":
            return Reply(status=400, error_message="bad request")
        return Reply(content="fine")

    hijack = ScriptedLLM(responses="hijacked")
    async with ScriptedLLM(responses=script) as url, hijack as other:
        async with running_proxy(url, store) as proxy:
            rollout = await store.start_rollout(input={})
            base = proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
            headers = {"Authorization": "Bearer sk-client-secret", "x-api-key": "x-secret-header"}
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "api_base": other,
                "base_url": other,
                "api_key": "sk-body-secret",
                "litellm_params": {"api_base": other},
                "temperature": 0.5,
            }
            async with httpx.AsyncClient(timeout=30) as http:
                ok = await http.post(f"{base}/chat/completions", json=body, headers=headers)
                streamed = await http.post(f"{base}/chat/completions", json={**body, "stream": True}, headers=headers)
                failed = await http.post(
                    f"{base}/chat/completions",
                    json={**body, "messages": [{"role": "user", "content": "fail"}]},
                    headers=headers,
                )
        other_requests = len(hijack.requests)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"
    assert streamed.status_code == 200 and failed.status_code == 400
    assert other_requests == 0  # the client's api_base / base_url were not used
    spans = await spans_of(store, rollout.rollout_id)
    assert len(spans) == 3 and spans[0].attributes["gen_ai.request.temperature"] == 0.5  # sampling passes on
    stored = msgspec.json.encode(spans).decode()
    for secret in secrets:
        assert secret not in stored, secret
    assert "authorization" not in stored.lower()


async def test_proxy_connections_have_nagle_off() -> None:
    """Each call through the proxy on a kept-alive connection waited ~45 ms for a delayed ACK while
    the proxy's own socket had Nagle's algorithm on (p50 of a call to the scripted backend: 57 ms
    before, 10 ms after); the accepted connections must have ``TCP_NODELAY``."""
    import socket

    store = InMemoryLightningStore()
    async with ScriptedLLM(responses="ok") as url, running_proxy(url, store) as proxy:
        async with httpx.AsyncClient() as http:
            r = await http.get(f"{proxy.endpoint.rsplit('/v1', 1)[0]}/health")
            assert r.status_code == 200
            server = proxy._server
            assert server is not None
            flags = [
                conn.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                for conn in server.server_state.connections
            ]
    assert flags and all(flags), flags


# -- request body limit ------------------------------------------------------------------------


async def _post_raw(proxy: LLMProxy, path: str, header: str, chunks: AsyncIterator[bytes]) -> tuple[int, Any, int]:
    """POST ``chunks`` on a raw connection while reading the answer; the body is never finished.

    Returns the status, the JSON body of the answer and the bytes sent when it came. A proxy that
    waited for the whole body before answering would never answer (the 15 s timeout).
    """
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: {proxy.host}\r\n{header}\r\n\r\n".encode())
    sent = 0

    async def send() -> None:
        nonlocal sent
        with contextlib.suppress(ConnectionError):  # the proxy closes the connection after its 413
            async for chunk in chunks:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
                await asyncio.sleep(0.001)
        await asyncio.Future()  # the body never ends

    sending = asyncio.create_task(send())
    try:
        status_line = await asyncio.wait_for(reader.readline(), 15)
        answered_after = sent
        head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        length = re.search(r"content-length: (\d+)", head)
        assert length is not None, head
        body = json.loads(await reader.readexactly(int(length.group(1))))
    finally:
        sending.cancel()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return int(status_line.split()[1]), body, answered_after


async def _no_body() -> AsyncIterator[bytes]:
    return
    yield b""


async def _chunked_body(chunks: int, size: int) -> AsyncIterator[bytes]:
    """A chat request in chunked transfer encoding: its JSON head, then ``chunks`` chunks of ``size``
    bytes of one long string, and never the closing chunk."""
    head = b'{"model": "stub-model", "messages": [{"role": "user", "content": "'
    yield f"{len(head):x}\r\n".encode() + head + b"\r\n"
    for _ in range(chunks):
        yield f"{size:x}\r\n".encode() + b"x" * size + b"\r\n"


async def test_a_body_over_the_limit_gets_413_as_it_arrives_and_reaches_nothing() -> None:
    """The proxy had no body limit: it read any body whole (``request.body()``) before answering, so
    a 1 GiB ``Content-Length`` or an endless chunked body held a connection and the memory it sent
    for as long as the client liked (here: no answer within the timeout). Now ``max_body_bytes``
    (32 MiB by default) is counted while the body arrives: a ``Content-Length`` over it is refused
    before a byte is read, a chunked body as soon as it passes it; nothing is forwarded or recorded."""
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses="x")
    async with stub as url, running_proxy(url, store) as proxy:
        rollout = await store.start_rollout(input={})
        path = f"/rollout/{rollout.rollout_id}/attempt/{rollout.attempt.attempt_id}/v1/chat/completions"
        status, body, _ = await _post_raw(proxy, path, "Content-Length: 1073741824", _no_body())
        assert status == 413, body
        assert body["error"] == {
            "message": "request body of 1073741824 bytes is over the server's limit of 33554432 bytes "
            "(the LLM proxy's max_body_bytes)",
            "type": "invalid_request_error",
            "param": None,
            "code": 413,
        }
        body_64_mib = _chunked_body(chunks=256, size=256 * 1024)
        status, body, sent = await _post_raw(proxy, path, "Transfer-Encoding: chunked", body_64_mib)
        assert status == 413 and "more than 33554432 bytes (sent in chunks)" in body["error"]["message"], body
        assert sent < 64 * 1024 * 1024, sent  # answered before the client ran out of body to send
    assert stub.requests == [] and proxy.health.calls == 0
    assert await spans_of(store, rollout.rollout_id) == []


async def test_the_body_limit_is_set_on_the_proxy_and_guards_every_route() -> None:
    limit = 64 * 1024
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses="x")
    async with stub as url, running_proxy(url, store, max_body_bytes=limit) as proxy:
        rollout = await store.start_rollout(input={})
        path = f"/rollout/{rollout.rollout_id}/attempt/{rollout.attempt.attempt_id}/v1"
        for route in ("chat/completions", "messages"):  # Anthropic's route too, with OpenAI's error as its 401
            chunked = _chunked_body(chunks=1024, size=8 * 1024)
            status, body, _ = await _post_raw(proxy, f"{path}/{route}", "Transfer-Encoding: chunked", chunked)
            assert status == 413 and f"more than {limit} bytes" in body["error"]["message"], body
        async with httpx.AsyncClient() as http:  # just under the limit: served
            r = await http.post(
                f"http://{proxy.host}:{proxy.port}{path}/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "y" * (limit - 200)}]},
            )
            assert r.status_code == 200, r.text
    assert len(stub.requests) == 1 and len(await spans_of(store, rollout.rollout_id)) == 1


def test_the_body_limit_defaults_to_32_mib_and_refuses_nonsense() -> None:
    assert LLMProxy(port=12345)._max_body_bytes == 32 * 1024 * 1024
    for bad in (0, -1, 1.5, "1MB", True):
        with pytest.raises(ValueError, match="max_body_bytes"):
            LLMProxy(port=12345, max_body_bytes=bad)


async def _start_body(proxy: LLMProxy, path: str, length: int, first: bytes) -> tuple[asyncio.StreamReader, Any]:
    """Open a raw connection and send a POST's head (``Content-Length: length``) and ``first`` bytes of its body."""
    reader, writer = await asyncio.open_connection(proxy.host, proxy.port)
    head = f"POST {path} HTTP/1.1\r\nHost: {proxy.host}\r\nContent-Type: application/json\r\nContent-Length: {length}"
    writer.write(head.encode() + b"\r\n\r\n" + first)
    await writer.drain()
    return reader, writer


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], Any]:
    """The status, headers (lower-cased names) and JSON body of the answer on a raw connection (15 s at most)."""
    status_line = await asyncio.wait_for(reader.readline(), 15)
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)).decode()
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in head.split("\r\n") if ": " in line)}
    return int(status_line.split()[1]), headers, json.loads(await reader.readexactly(int(headers["content-length"])))


async def _until(condition: Any, what: str) -> None:
    """Wait for ``condition()`` (the proxy's side of a raw connection), failing after 15 s."""
    for _ in range(1500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_bodies_held_at_once_are_capped_and_a_stalled_body_times_out() -> None:
    """Nothing capped the request bodies the proxy held at once (N clients each sending a body just
    under ``max_body_bytes`` held N times it), and a client that sent its headers and then stalled
    held its call for ever. Now a call that would take the bytes held past ``max_buffered_bytes``
    gets 503 ``server_busy`` with ``Retry-After`` (which the OpenAI SDK honours), and a body without
    a byte for ``body_timeout_s`` gets 408 ``request_timeout`` and its connection closed; both in
    OpenAI's error object, nothing forwarded or recorded."""
    limit = 64 * 1024
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses="x")
    limits = {"max_body_bytes": limit, "max_buffered_bytes": limit + 1000, "body_timeout_s": 0.5}
    async with stub as url, running_proxy(url, store, **limits) as proxy:
        rollout = await store.start_rollout(input={})
        path = f"/rollout/{rollout.rollout_id}/attempt/{rollout.attempt.attempt_id}/v1/chat/completions"
        sent = b'{"model": "' + b"m" * (limit - 112)  # all but the last 101 bytes, then it stalls
        reader, writer = await _start_body(proxy, path, limit - 100, sent)
        try:
            await _until(lambda: proxy._body_reads.held_bytes == len(sent), "the stalled body's bytes counted")
            client = openai.AsyncOpenAI(base_url=proxy.endpoint, api_key="dummy", max_retries=0)
            with pytest.raises(openai.InternalServerError) as busy:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "y" * 2000}])
            await client.close()
            assert busy.value.status_code == 503 and busy.value.response.headers["retry-after"] == "1"
            assert busy.value.type == "server_busy" and "the LLM proxy's max_buffered_bytes" in busy.value.message
            status, headers, body = await _read_answer(reader)  # the stalled one, after body_timeout_s
            assert await asyncio.wait_for(reader.read(), 15) == b""  # and its connection closed
        finally:
            writer.close()
    assert status == 408 and headers["connection"] == "close", (status, headers, body)
    assert body["error"]["type"] == "request_timeout" and body["error"]["code"] == 408, body
    assert f"came for 0.5 s ({len(sent)} of 65436 bytes read)" in body["error"]["message"], body
    assert "the LLM proxy's body_timeout_s" in body["error"]["message"], body
    assert proxy._body_reads.held_bytes == 0
    assert stub.requests == [] and proxy.health.calls == 0
    assert await spans_of(store, rollout.rollout_id) == []


async def test_a_body_trickling_in_under_the_idle_timeout_gets_408() -> None:
    """A client sending a byte of its body every ``body_timeout_s`` less a little (slowloris) never
    tripped the idle timeout and held its call, and its bytes against ``max_buffered_bytes``, for
    ever (here: 600 bytes a byte per 20 ms, 12 s, were read whole). Now a body ``body_timeout_s``
    behind ``body_min_bytes_per_s`` gets 408 ``request_timeout`` naming that setting, and its
    connection closed; nothing forwarded."""
    stub = ScriptedLLM(responses="x")
    limits = {"body_timeout_s": 2, "body_min_bytes_per_s": 1000}
    async with stub as url, running_proxy(url, InMemoryLightningStore(), **limits) as proxy:
        path = "/v1/chat/completions"  # 50 bytes/s below, a byte well inside 2 s
        answer = await trickle_post(proxy.port, path, first=b"", piece=b" ", count=600, every_s=0.02)
        await _until(lambda: proxy._body_reads.held_bytes == 0, "the bytes given back")
    assert answer.status == 408 and answer.headers["connection"] == "close" and answer.closed, answer
    error = json.loads(answer.body)["error"]
    assert error["type"] == "request_timeout" and error["code"] == 408, error
    assert "came slower than 1000 bytes/s" in error["message"], error
    assert "(the LLM proxy's body_min_bytes_per_s)" in error["message"], error
    assert stub.requests == []


async def test_a_call_waiting_for_its_model_does_not_hold_its_body_against_the_cap() -> None:
    """A call's body bytes counted against ``max_buffered_bytes`` until its model answered, so calls
    waiting on a slow model made the proxy refuse new bodies 503 ``server_busy`` though it held none
    of their bytes still to read. Now they stop counting once the proxy has parsed the call: with a
    cap below two bodies, a second call goes through while the first waits for its model."""
    go = asyncio.Event()
    arrived: list[int] = []

    async def slow_model(messages: list[dict[str, Any]], request: dict[str, Any]) -> Reply:
        arrived.append(len(messages[-1]["content"]))
        await go.wait()
        return Reply(content="done")

    limit = 64 * 1024
    stub = ScriptedLLM(responses=slow_model)
    limits = {"max_body_bytes": limit, "max_buffered_bytes": limit + 1000}
    async with stub as url, running_proxy(url, InMemoryLightningStore(), **limits) as proxy:
        client = openai.AsyncOpenAI(base_url=proxy.endpoint, api_key="dummy", max_retries=0)
        user = [{"role": "user", "content": "y" * 40_000}]  # two bodies of it pass the cap
        first = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=user))  # type: ignore[arg-type]
        await _until(lambda: len(arrived) == 1, "the first call at the model")
        held_while_waiting = proxy._body_reads.held_bytes
        second = asyncio.create_task(client.chat.completions.create(model=MODEL, messages=user))  # type: ignore[arg-type]
        await _until(lambda: len(arrived) == 2 or second.done(), "the second call at the model, or refused")
        go.set()
        answers = await asyncio.gather(first, second, return_exceptions=True)
        await client.close()
        held_after = proxy._body_reads.held_bytes
    assert [a.choices[0].message.content if not isinstance(a, BaseException) else a for a in answers] == [
        "done",
        "done",
    ]
    assert held_while_waiting == 0 and arrived == [40_000, 40_000] and held_after == 0


def test_the_body_limits_default_and_refuse_nonsense() -> None:
    proxy = LLMProxy(port=12345)
    assert (proxy._max_buffered_bytes, proxy._body_timeout_s) == (256 * 1024 * 1024, 30.0)
    assert proxy._body_min_bytes_per_s == 1024.0 and LLMProxy(port=12345, body_min_bytes_per_s=None)
    assert LLMProxy(port=12345, max_body_bytes=128 * 1024 * 1024)._max_buffered_bytes == 512 * 1024 * 1024
    with pytest.raises(ValueError, match="max_buffered_bytes"):
        LLMProxy(port=12345, max_body_bytes=1000, max_buffered_bytes=999)
    for bad in (0, -1.0, float("nan"), "30"):
        with pytest.raises(ValueError, match="body_timeout_s"):
            LLMProxy(port=12345, body_timeout_s=bad)
        with pytest.raises(ValueError, match="body_min_bytes_per_s must be a number of bytes per second > 0"):
            LLMProxy(port=12345, body_min_bytes_per_s=bad)


async def test_stop_answers_a_call_still_sending_its_body_503_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """The proxy stopped while a call was still sending its body: nothing answered it until
    uvicorn's shutdown timeout cancelled it, with "Exception in ASGI application" and a traceback.
    Now it answers 503 ``server_stopping`` when ``stop()`` cuts the calls in flight, and a call
    arriving once ``stop()`` began answers the same at once."""
    import eventlight.llm_proxy.server as server_module

    monkeypatch.setattr(server_module, "_SHUTDOWN_TIMEOUT_S", 1.0)
    store = InMemoryLightningStore()
    async with ScriptedLLM(responses="x") as url:
        proxy = LLMProxy(model_list=model_list(url), store=store)
        await proxy.start()
        reader, writer = await _start_body(proxy, "/v1/chat/completions", 1000, b'{"model": "')
        try:
            await _until(lambda: proxy._body_reads.reading == 1, "the body read in progress")
            with caplog.at_level(logging.INFO):
                await proxy.stop()
                status, _, body = await _read_answer(reader)
                logged = list(caplog.records)
        finally:
            writer.close()
            await proxy.stop()
        late = LLMProxy(model_list=model_list(url), store=store)
        late._body_reads.stop()  # as stop() does first: a call arriving now
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=late.app), base_url="http://proxy") as http:
            r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert status == 503 and body["error"]["type"] == "server_stopping", body
    assert "stopped while the request body was still arriving (11 of 1000 bytes read)" in body["error"]["message"]
    lines = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in logged]
    assert not [r for r in logged if r.exc_info or r.levelno >= logging.ERROR], lines
    assert "Traceback" not in capfd.readouterr().err
    assert r.status_code == 503 and r.json()["error"]["type"] == "server_stopping", r.text
    assert "takes no new requests" in r.json()["error"]["message"]
