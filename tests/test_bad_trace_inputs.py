"""Bad trace input (issue 15, "Bad input"): a span with missing ids, a cyclic parent chain, a 10 MB
attribute, a non-JSON body, a proxy request for an unknown rollout. Each gets a clear error or a
recorded, visible drop; the runner, the proxy and the projection go on."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
import pytest
from llm_stub import ScriptedLLM

import eventlight as agl
from eventlight.adapter import TracerTraceToTriplet, TraceTree
from eventlight.core.errors import InvalidInputError
from eventlight.core.types import Span
from eventlight.llm_proxy import LLMProxy
from eventlight.store.memory import InMemoryLightningStore

pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")

TEN_MB = "x" * (10 * 1024 * 1024)


def span(rid: str, aid: str, sid: str, parent: str | None = None, name: str = "step", **attrs: Any) -> Span:
    return Span(
        rollout_id=rid,
        attempt_id=aid,
        sequence_id=1,
        trace_id="t" * 32,
        span_id=sid,
        parent_id=parent,
        name=name,
        attributes=attrs,
        start_time=1.0,
        end_time=2.0,
    )


@pytest.mark.parametrize(
    ("field", "value"), [("span_id", ""), ("trace_id", None), ("rollout_id", ""), ("attempt_id", "")]
)
async def test_a_span_with_missing_ids_is_refused_in_one_line(store: Any, field: str, value: Any) -> None:
    r = await store.start_rollout(input={})
    bad = span(r.rollout_id, r.attempt.attempt_id, "a" * 16)
    setattr(bad, field, value)
    with pytest.raises(InvalidInputError, match=f"lacks a {field}"):
        await store.add_span(bad)
    assert await store.query_spans(r.rollout_id) == []


async def test_a_10_mb_attribute_is_refused_and_the_next_span_is_stored(store: Any) -> None:
    r = await store.start_rollout(input={})
    rid, aid = r.rollout_id, r.attempt.attempt_id
    with pytest.raises(InvalidInputError, match=r"over the 8,388,608 an event may hold"):
        await store.add_span(span(rid, aid, "b" * 16, big=TEN_MB))
    await store.add_span(span(rid, aid, "c" * 16, small="ok"))  # the projection is not stalled
    assert [s.span_id for s in await store.query_spans(rid)] == ["c" * 16]


@agl.rollout
def oversharing_agent(task: dict[str, Any], prompt_template: agl.PromptTemplate) -> float:
    agl.emit_message("a normal step")
    if task["big"]:
        agl.emit_object({"blob": TEN_MB})
    return 1.0


async def test_the_runner_drops_a_10_mb_span_visibly_keeps_the_rest_and_goes_on(store: Any, runner_store: Any) -> None:
    await store.add_resources({"prompt": agl.PromptTemplate(template="{q}")})
    big = await store.enqueue_rollout({"big": True})
    fine = await store.enqueue_rollout({"big": False})
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=2, poll_interval=0.05, heartbeat_interval=0)
    with runner.run_context(agent=oversharing_agent, store=runner_store):
        assert await asyncio.wait_for(runner.iter(), 60) == 2
    for _ in range(100):
        got_big, got_fine = await store.query_rollouts(rollout_id_in=[big.rollout_id, fine.rollout_id])
        if got_big.status == "failed" and got_fine.status == "succeeded":
            break
        await asyncio.sleep(0.1)
    assert got_big.status == "failed" and got_fine.status == "succeeded"
    assert got_big.status_reason is not None
    assert got_big.status_reason.startswith("1 span(s) could not be delivered")
    assert "over the 8,388,608" in got_big.status_reason
    names = [s.name for s in await store.query_spans(big.rollout_id)]
    assert "agentlightning.message" in names and "agentlightning.object" not in names  # the rest is kept
    assert got_fine.status_reason is None


def test_a_cyclic_parent_chain_is_cut_with_a_warning_and_nothing_is_lost(caplog: pytest.LogCaptureFixture) -> None:
    spans = [
        span("ro-1", "at-1", "root"),
        span(
            "ro-1", "at-1", "a", parent="b", name="openai.chat.completion", prompt_token_ids=[1], response_token_ids=[2]
        ),
        span("ro-1", "at-1", "b", parent="a"),
        span("ro-1", "at-1", "self", parent="self"),
    ]
    with caplog.at_level(logging.WARNING, logger="eventlight.adapter.tree"):
        tree = TraceTree.from_spans(spans)
    assert sorted(n.id for n in tree.traverse()) == ["a", "b", "root", "self", "virtual-root"]
    assert tree.cycles_cut == 2 and "parent links form a cycle" in caplog.text
    adapter = TracerTraceToTriplet()
    (triplet,) = adapter.adapt(spans)
    assert triplet.prompt["token_ids"] == [1] and triplet.response["token_ids"] == [2]
    assert adapter.last_stats is not None and adapter.last_stats.cycles_cut == 2
    only_cycle = TraceTree.from_spans(spans[1:3])  # no root at all: no crash either
    assert sorted(n.id for n in only_cycle.traverse()) == ["a", "b"]


async def test_the_proxy_answers_bad_bodies_and_unknown_rollouts_on_both_routes() -> None:
    store = InMemoryLightningStore()
    stub = ScriptedLLM(responses="never")
    async with stub as url:
        entry = {"model_name": "m", "litellm_params": {"model": "hosted_vllm/m", "api_base": url, "api_key": "k"}}
        proxy = LLMProxy(model_list=[entry], store=store)
        await proxy.start()
        try:
            r = await store.start_rollout(input={})
            base = proxy.as_resource().get_base_url(r.rollout_id, r.attempt.attempt_id).removesuffix("/v1")
            unknown = proxy.as_resource().get_base_url("ro-nope", "at-nope").removesuffix("/v1")
            body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            async with httpx.AsyncClient() as http:
                chat_bad = await http.post(f"{base}/v1/chat/completions", content=b"\xff{not json")
                messages_bad = await http.post(f"{base}/v1/messages", content=b"{not json")
                chat_unknown = await http.post(f"{unknown}/v1/chat/completions", json=body)
                messages_unknown = await http.post(f"{unknown}/v1/messages", json=body)
                healthy = await http.get(f"{proxy.endpoint.removesuffix('/v1')}/health")
        finally:
            await proxy.stop()
    assert chat_bad.status_code == 400 and "not JSON" in chat_bad.json()["error"]["message"]
    assert messages_bad.status_code == 400 and messages_bad.json()["type"] == "error"
    assert "not JSON" in messages_bad.json()["error"]["message"]
    assert chat_unknown.status_code == 404 and "ro-nope" in chat_unknown.json()["error"]["message"]
    assert messages_unknown.status_code == 404 and messages_unknown.json()["error"]["type"] == "not_found_error"
    assert healthy.status_code == 200  # the proxy goes on
    assert stub.requests == [] and await store.query_spans(r.rollout_id) == []
