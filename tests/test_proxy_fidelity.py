"""LLM proxy fidelity (issue 15 item 3): token ids wherever LiteLLM places them, logprobs, streamed
tool calls, the Anthropic Messages route, per-rollout routing, and the marks of missing ids."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anthropic
import httpx
import msgspec
import openai
import pytest
from llm_stub import TOKEN_ID_PLACEMENTS, Reply, ScriptedLLM, ToolCall, toy_tokenize

import eventlight as agl
from eventlight.core.types import Span
from eventlight.llm_proxy import LLMProxy
from eventlight.store.memory import InMemoryLightningStore

pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")

MODEL = "stub-model"
MISSING = "eventlight.token_ids.missing"


@asynccontextmanager
async def proxy_for(url: str, store: Any, provider: str = "hosted_vllm") -> AsyncIterator[LLMProxy]:
    entry = {"model_name": MODEL, "litellm_params": {"model": f"{provider}/m", "api_base": url, "api_key": "sk-key"}}
    proxy = LLMProxy(model_list=[entry], store=store)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def routed(store: InMemoryLightningStore, proxy: LLMProxy) -> tuple[str, str]:
    rollout = await store.start_rollout(input={})
    return rollout.rollout_id, proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)


def openai_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="sk-client", max_retries=0, timeout=30)


async def spans_of(store: InMemoryLightningStore, rollout_id: str) -> list[Span]:
    return list(await store.query_spans(rollout_id))


# -- token ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", ["hosted_vllm", "openai"])
@pytest.mark.parametrize("placement", TOKEN_ID_PLACEMENTS)
async def test_token_ids_are_found_in_every_placement(placement: str, provider: str) -> None:
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses=Reply(content="four is the answer", placement=placement))
    async with stub as url, proxy_for(url, store, provider) as proxy:
        rid, base = await routed(store, proxy)
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{base}/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "2+2?"}]}
            )
    assert r.status_code == 200, r.text
    (span,) = await spans_of(store, rid)
    a = span.attributes
    assert stub.requests[0]["return_token_ids"] is True  # asked for, vLLM's way
    assert a["response_token_ids"] == toy_tokenize("four is the answer")
    assert a["prompt_token_ids"] == toy_tokenize("<user> 2+2? <assistant>")
    assert MISSING not in a and "token_ids_incomplete" not in a
    body = r.json()  # the client sees vLLM's shape whatever the backend's placement
    assert body["prompt_token_ids"] == a["prompt_token_ids"]
    assert body["choices"][0]["token_ids"] == a["response_token_ids"]


async def test_missing_and_incomplete_token_ids_are_marked_on_the_span() -> None:
    """peer_failures C14: missing and incomplete token ids are marked on the span."""
    store = InMemoryLightningStore()
    no_prompt = {
        "id": "c-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "a b"},
                "finish_reason": "stop",
                "token_ids": [7, 8],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    replies = [
        Reply(content="none at all", return_token_ids=False),
        no_prompt,
        Reply(content="a b c", completion_tokens=9),
        Reply(content="a b", prompt_token_ids=[1], placement="vllm"),  # usage counts more prompt tokens
    ]
    async with ScriptedLLM(responses=replies) as url, proxy_for(url, store) as proxy:
        rid, base = await routed(store, proxy)
        client = openai_client(base)
        for _ in replies:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x y"}])
        await client.close()
    none, prompt_missing, short, short_prompt = (s.attributes for s in await spans_of(store, rid))
    assert none[MISSING] == ["prompt", "response"]
    assert prompt_missing[MISSING] == ["prompt"] and prompt_missing["response_token_ids"] == [7, 8]
    assert short["token_ids_incomplete"] is True and MISSING not in short
    assert short_prompt["prompt_token_ids"] == [1]
    # the stub's usage counts the ids it was told to send, so a mismatch needs a dict answer; here
    # prompt_tokens == 1 == len(ids): complete
    assert "token_ids_incomplete" not in short_prompt


async def test_an_upstream_error_carries_no_token_id_mark_but_its_reason() -> None:
    store = InMemoryLightningStore()
    too_long = "This model's maximum context length is 4096 tokens. However, you requested 9000 tokens."
    async with ScriptedLLM(responses=Reply(status=400, error_message=too_long)) as url, proxy_for(url, store) as proxy:
        rid, base = await routed(store, proxy)
        client = openai_client(base)
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "long"}])
        await client.close()
    (span,) = await spans_of(store, rid)
    assert span.status.status_code == "ERROR" and "maximum context length" in (span.status.description or "")
    assert span.attributes["http.status_code"] == 400 and MISSING not in span.attributes


# -- logprobs ---------------------------------------------------------------------------------


async def test_logprobs_when_the_client_asks_and_not_otherwise() -> None:
    store = InMemoryLightningStore()
    async with ScriptedLLM(responses="red green blue") as url, proxy_for(url, store) as proxy:
        rid, base = await routed(store, proxy)
        client = openai_client(base)
        asked = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "colours"}], logprobs=True, top_logprobs=2
        )
        plain = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "colours"}])
        await client.close()
    assert asked.choices[0].logprobs is not None
    assert [t.token for t in asked.choices[0].logprobs.content or []] == ["red", "green", "blue"]
    assert plain.choices[0].logprobs is None
    with_lp, without_lp = (s.attributes for s in await spans_of(store, rid))
    recorded = json.loads(with_lp["logprobs.content"])
    assert [t["token"] for t in recorded] == ["red", "green", "blue"] and len(recorded[0]["top_logprobs"]) == 2
    assert "logprobs.content" not in without_lp
    triplets = agl.TracerTraceToTriplet().adapt(await spans_of(store, rid))
    assert triplets[0].response["logprobs"] == recorded and "logprobs" not in triplets[1].response


# -- streaming with tool calls ---------------------------------------------------------------


async def test_stream_with_parallel_tool_calls_assembles_ids_and_arguments() -> None:
    """peer_failures C14: streamed tool calls carry every token id."""
    store = InMemoryLightningStore()
    weather = {"location": "San Francisco, California, United States of America", "unit": "celsius"}
    clock = {"timezone": "America/Los_Angeles", "format": "24h", "with_seconds": True}
    reply = Reply(
        content="Let me look both up.",
        tool_calls=[ToolCall("get_weather", weather, id="call_w"), ToolCall("get_time", clock, id="call_t")],
    )
    async with ScriptedLLM(responses=reply) as url, proxy_for(url, store) as proxy:
        rid, base = await routed(store, proxy)
        client = openai_client(base)
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "weather and time?"}], stream=True
        )
        calls: dict[int, dict[str, str]] = {}
        content, finish = "", None
        async for chunk in stream:
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for tc in choice.delta.tool_calls or []:
                    call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    call["id"] = tc.id or call["id"]
                    if tc.function is not None:
                        call["name"] += tc.function.name or ""
                        call["arguments"] += tc.function.arguments or ""
                finish = choice.finish_reason or finish
        await client.close()
        async with httpx.AsyncClient() as http:
            raw = await http.post(
                f"{base}/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "weather and time?"}], "stream": True},
            )
    assert content == "Let me look both up." and finish == "tool_calls"
    assert [(c["id"], c["name"]) for c in calls.values()] == [("call_w", "get_weather"), ("call_t", "get_time")]
    assert json.loads(calls[0]["arguments"]) == weather and json.loads(calls[1]["arguments"]) == clock
    chunks = [json.loads(e[len("data: ") :]) for e in raw.text.split("\n\n") if e and e != "data: [DONE]"]
    first, last = chunks[0], chunks[-1]
    span = (await spans_of(store, rid))[0]
    a = span.attributes
    assert first["prompt_token_ids"] == a["prompt_token_ids"]  # the stream carries the ids, vLLM's way
    assert last["choices"][0]["token_ids"] == a["response_token_ids"]
    assert a["llm.is_streaming"] is True
    for j, (cid, name, args) in enumerate([("call_w", "get_weather", weather), ("call_t", "get_time", clock)]):
        assert a[f"gen_ai.completion.0.tool_calls.{j}.id"] == cid
        assert a[f"gen_ai.completion.0.tool_calls.{j}.name"] == name
        assert json.loads(a[f"gen_ai.completion.0.tool_calls.{j}.arguments"]) == args
    output = json.loads(a["gen_ai.output.messages"])[0]
    assert [p["id"] for p in output["parts"] if p["type"] == "tool_call"] == ["call_w", "call_t"]


# -- Anthropic Messages ---------------------------------------------------------------------


TOOLS = [
    {
        "name": "get_weather",
        "description": "weather now",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def anthropic_client(base_url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key="sk-ant-secret", max_retries=0)


async def test_anthropic_messages_route_translates_and_records_one_span() -> None:
    store = InMemoryLightningStore()
    replies = [
        Reply(content=None, tool_calls=[ToolCall("get_weather", {"city": "Paris"}, id="call_p")]),
        Reply(content="It is sunny in Paris."),
    ]
    stub = ScriptedLLM(responses=replies)
    async with stub as url, proxy_for(url, store) as proxy:
        rid, base = await routed(store, proxy)
        client = anthropic_client(base)
        history: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await client.messages.create(
            model=MODEL,
            max_tokens=64,
            system="Answer briefly.",
            messages=history,
            tools=TOOLS,  # type: ignore[arg-type]
        )
        (tool_use,) = [b for b in first.content if b.type == "tool_use"]
        history += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "sunny"}]},
        ]
        second = await client.messages.create(model=MODEL, max_tokens=64, messages=history, tools=TOOLS)  # type: ignore[arg-type]
        await client.close()
    assert first.stop_reason == "tool_use" and tool_use.name == "get_weather" and tool_use.input == {"city": "Paris"}
    assert second.content[0].type == "text" and second.content[0].text == "It is sunny in Paris."
    assert second.stop_reason == "end_turn"
    sent = stub.requests[1]["messages"]  # LiteLLM translated the tool turn into OpenAI's shape
    assert sent[1]["tool_calls"][0]["id"] == tool_use.id and sent[2] == {
        "role": "tool",
        "tool_call_id": tool_use.id,
        "content": "sunny",
    }
    one, two = await spans_of(store, rid)
    assert one.name == two.name == "openai.chat.completion"
    a = one.attributes
    assert a["eventlight.llm_proxy.route"] == "anthropic.messages"
    assert json.loads(a["gen_ai.system_instructions"]) == [{"type": "text", "content": "Answer briefly."}]
    assert a["gen_ai.completion.0.tool_calls.0.name"] == "get_weather"
    assert a["response_token_ids"] and a["prompt_token_ids"] and MISSING not in a
    assert two.attributes["gen_ai.completion.0.content"] == "It is sunny in Paris."
    assert len(agl.LlmProxyTraceToTriplet().adapt([one, two])) == 2


async def test_anthropic_stream_and_errors() -> None:
    """peer_failures C12: an Anthropic ``stream: true`` call is answered as a stream and recorded."""
    store = InMemoryLightningStore()

    def script(messages: list[dict[str, Any]], request: dict[str, Any]) -> Reply:
        if "fail" in str(messages[-1]["content"]):
            return Reply(status=400, error_message="prompt is too long: 9000 tokens > 4096 maximum")
        return Reply(content="A fairly long answer, so that the stream has several text deltas in it.")

    async with ScriptedLLM(responses=script) as url, proxy_for(url, store) as proxy:
        rid, base = await routed(store, proxy)
        client = anthropic_client(base)
        deltas: list[str] = []
        async with client.messages.stream(
            model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "hi"}]
        ) as s:
            async for text in s.text_stream:
                deltas.append(text)
            final = await s.get_final_message()
        with pytest.raises(anthropic.BadRequestError) as bad:
            await client.messages.create(model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "fail"}])
        with pytest.raises(anthropic.BadRequestError) as no_max:
            await client.post("/v1/messages", cast_to=object, body={"model": MODEL, "messages": []})
        unknown = anthropic_client(proxy.as_resource().get_base_url("ro-missing", "at-missing"))
        with pytest.raises(anthropic.NotFoundError):
            await unknown.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        await client.close()
        await unknown.close()
    assert len(deltas) > 1 and "".join(deltas) == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    assert "prompt is too long" in str(bad.value) and "max_tokens" in str(no_max.value)
    ok, failed = await spans_of(store, rid)  # the bad request and the unknown rollout record nothing
    assert ok.attributes["llm.is_streaming"] is True and ok.status.status_code == "OK"
    assert failed.status.status_code == "ERROR" and failed.attributes["http.status_code"] == 400
    assert "prompt is too long" in failed.attributes["error.message"]


async def test_no_key_or_authorization_in_any_span_of_either_route() -> None:
    store = InMemoryLightningStore()
    secrets = ("sk-key", "sk-client", "sk-ant-secret", "sk-body-secret")
    async with ScriptedLLM(responses="fine") as url, proxy_for(url, store) as proxy:
        rid, base = await routed(store, proxy)
        client = anthropic_client(base)
        await client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        async with client.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as s:
            await s.get_final_message()
        await client.close()
        async with httpx.AsyncClient() as http:
            headers = {"Authorization": "Bearer sk-client", "x-api-key": "sk-ant-secret"}
            body = {
                "model": MODEL,
                "max_tokens": 8,
                "api_key": "sk-body-secret",
                "messages": [{"role": "user", "content": "hi"}],
            }
            for path in ("/v1/messages", "/chat/completions"):
                r = await http.post(
                    base.removesuffix("/v1") + path if path == "/v1/messages" else base + path,
                    json=body,
                    headers=headers,
                )
                assert r.status_code == 200, r.text
    spans = await spans_of(store, rid)
    assert len(spans) == 4
    stored = msgspec.json.encode(spans).decode()
    for secret in secrets:
        assert secret not in stored, secret
    assert "authorization" not in stored.lower() and "x-api-key" not in stored.lower()


# -- per-rollout routing ---------------------------------------------------------------------


@agl.rollout
async def asking_agent(task: dict[str, Any], llm: agl.LLM) -> float:
    client = openai_client(llm.endpoint)
    answer = await client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["q"]}])
    await client.close()
    return 1.0 if answer.choices[0].message.content == f"echo: {task['q']}" else 0.0


async def test_a_proxy_llm_routes_each_rollout_to_its_own_attempt() -> None:
    store = InMemoryLightningStore()
    async with ScriptedLLM() as url, proxy_for(url, store) as proxy:
        await store.add_resources({"llm": proxy.as_resource()})
        runners = [agl.LitAgentRunner(agl.OtelTracer()) for _ in range(3)]
        questions = ["alpha", "beta", "gamma"]

        async def one(runner: agl.LitAgentRunner, q: str) -> Any:
            with runner.run_context(agent=asking_agent, store=store):
                return await runner.step({"q": q})

        done = await asyncio.gather(*(one(r, q) for r, q in zip(runners, questions, strict=True)))
    for rollout, q in zip(done, questions, strict=True):
        calls = [s for s in await spans_of(store, rollout.rollout_id) if s.name == "openai.chat.completion"]
        assert len(calls) == 1 and calls[0].attributes["gen_ai.prompt.0.content"] == q
        assert calls[0].attempt_id == rollout.attempt.attempt_id
        assert agl.find_final_reward(await spans_of(store, rollout.rollout_id)) == 1.0
