"""Prometheus ``/metrics`` of ``eventlight serve`` and of the LLM proxy, scraped over HTTP and parsed
with prometheus_client's own parser; every figure is checked to move after real operations."""

from __future__ import annotations

import asyncio
import pickle
import time
from collections.abc import Mapping
from typing import Any

import fault_agents
import httpx
import openai
import pytest
from llm_stub import Reply, ScriptedLLM
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import eventlight as agl
from eventlight.core.types import RolloutConfig
from eventlight.llm_proxy import LLMProxy
from eventlight.net import free_port
from eventlight.runner.metrics import RunnerMetrics
from eventlight.runner_pool import RunnerPool
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore

pytestmark = pytest.mark.filterwarnings("ignore:.*`ReadOnly` qualifier:UserWarning")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a scrape, keyed by (name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when the series is absent (a status nobody has yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


async def scrape(url: str) -> Samples:
    async with httpx.AsyncClient() as http:
        r = await http.get(url)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=")
    return parse(r.text)


def llm_span(rid: str, aid: str, model: str, prompt: int, completion: int) -> agl.Span:
    attributes: Mapping[str, Any] = {
        "gen_ai.request.model": model,
        "gen_ai.usage.prompt_tokens": prompt,
        "gen_ai.usage.completion_tokens": completion,
    }
    return agl.Span.from_attributes(
        attributes=dict(attributes), rollout_id=rid, attempt_id=aid, name="openai.chat.completion"
    )


async def test_store_metrics_move_with_the_store(store: Any) -> None:
    """On both backends: published/projected events, queue depth, rollouts and attempts by status,
    LLM calls and tokens by model, and the watchdog's actions."""
    async with agl.LightningStoreServer(store, port=free_port()) as server:
        url = f"{server.endpoint}/metrics"
        empty = await scrape(url)
        assert value(empty, "eventlight_queue_depth") == 0
        assert value(empty, "eventlight_llm_calls_total", model="m-1") == 0

        await store.enqueue_rollout({"q": 1})
        await store.enqueue_rollout({"q": 2}, config=RolloutConfig(timeout_seconds=1.0))
        if hasattr(store, "sync"):
            await store.sync()
        queued = await scrape(url)
        assert value(queued, "eventlight_queue_depth") == 2
        assert value(queued, "eventlight_rollouts", status="queuing") == 2
        assert value(queued, "eventlight_events_published_total") > value(empty, "eventlight_events_published_total")
        assert value(queued, "eventlight_projector_lag_events") == 0

        first = await store.dequeue_rollout(worker_id="w-1")
        rid, aid = first.rollout_id, first.attempt.attempt_id
        await store.add_many_spans([llm_span(rid, aid, "m-1", 11, 5), llm_span(rid, aid, "m-1", 7, 3)])
        await store.update_attempt(rid, aid, status="succeeded")
        second = await store.dequeue_rollout(worker_id="w-1")
        assert second.config.timeout_seconds == 1.0
        if hasattr(store, "sync"):
            await store.sync()  # the projector's watchdog decides on what it has projected
        appended = await store.run_watchdog(time.time() + 60)  # the second attempt has overrun
        assert appended
        if hasattr(store, "sync"):
            await store.sync_all()
        after = await scrape(url)
        assert value(after, "eventlight_queue_depth") == 0
        assert value(after, "eventlight_attempts", status="succeeded") == 1
        assert value(after, "eventlight_attempts", status="timeout") == 1
        assert value(after, "eventlight_rollouts", status="succeeded") == 1
        assert value(after, "eventlight_llm_calls_total", model="m-1") == 2
        assert value(after, "eventlight_llm_tokens_total", model="m-1", kind="prompt") == 18
        assert value(after, "eventlight_llm_tokens_total", model="m-1", kind="completion") == 8
        assert value(after, "eventlight_watchdog_actions_total", action="attempt_timeout") == 1
        published = value(after, "eventlight_events_published_total")
        assert published > value(queued, "eventlight_events_published_total")
        assert value(after, "eventlight_events_projected_total") == published


async def test_projector_lag_is_what_the_read_models_miss(namespace: Settings) -> None:
    """A server whose store does not project sees the log grow ahead of the checkpoint; once a
    projecting store runs, the lag closes."""
    async with (
        JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn, run_projector=False) as reader,
        agl.LightningStoreServer(reader, port=free_port()) as server,
    ):
        url = f"{server.endpoint}/metrics"
        async with JetStreamLightningStore(namespace) as writer:  # a runner's store: no Postgres
            for i in range(3):
                await writer.enqueue_rollout({"i": i})
        behind = await scrape(url)
        assert value(behind, "eventlight_projector_lag_events") >= 3
        assert value(behind, "eventlight_queue_depth") == 0  # the read models do not know them yet
        async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as projecting:
            await projecting.sync_all()
            caught_up = await scrape(url)
        assert value(caught_up, "eventlight_projector_lag_events") == 0
        assert value(caught_up, "eventlight_queue_depth") == 3
        assert value(caught_up, "eventlight_events_projected_total") == value(
            caught_up, "eventlight_events_published_total"
        )


async def test_llm_proxy_metrics_count_calls_errors_tokens_and_latency() -> None:
    store = agl.InMemoryLightningStore()

    def script(messages: list[dict[str, Any]], request: dict[str, Any]) -> Reply:
        if messages[-1]["content"] == "fail":
            return Reply(status=400, error_message="bad prompt")
        return Reply(content="four words in reply")

    stub = ScriptedLLM(responses=script)
    async with stub as backend:
        model_list = [{"model_name": "m", "litellm_params": {"model": "openai/b", "api_base": backend, "api_key": "k"}}]
        proxy = LLMProxy(model_list=model_list, store=store)
        await proxy.start()
        try:
            url = proxy.endpoint.removesuffix("/v1") + "/metrics"
            before = await scrape(url)
            assert value(before, "eventlight_llm_proxy_calls_total", model="m") == 0
            rollout = await store.start_rollout(input={})
            client = openai.AsyncOpenAI(
                base_url=proxy.as_resource().get_base_url(rollout.rollout_id, rollout.attempt.attempt_id),  # type: ignore[attr-defined]
                api_key="x",
                max_retries=0,
            )
            for _ in range(2):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2?"}])
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "fail"}])
            await client.close()
            after = await scrape(url)
        finally:
            await proxy.stop()
    assert value(after, "eventlight_llm_proxy_calls_total", model="m") == 3
    assert value(after, "eventlight_llm_proxy_errors_total", model="m", status="400") == 1
    assert value(after, "eventlight_llm_proxy_tokens_total", model="m", kind="completion") > 0
    assert value(after, "eventlight_llm_proxy_tokens_total", model="m", kind="prompt") > 0
    assert value(after, "eventlight_llm_proxy_latency_seconds_count", model="m") == 3
    assert value(after, "eventlight_llm_proxy_latency_seconds_bucket", model="m", le="+Inf") == 3
    assert value(after, "eventlight_llm_proxy_latency_seconds_sum", model="m") > 0


RESOURCES = {"prompt_template": agl.PromptTemplate(template="{q}")}


@agl.rollout
async def pass_or_raise(task: dict[str, Any], prompt_template: agl.PromptTemplate) -> float:
    if task.get("fail"):
        raise RuntimeError("told to fail")
    return 1.0


async def test_runner_metrics_count_attempts_by_status() -> None:
    """In one process: an attempt that succeeds and one whose agent raises, scraped from the
    runner's own HTTP endpoint (``RunnerMetrics.serve``)."""
    store = agl.InMemoryLightningStore()
    await store.add_resources(RESOURCES)
    await store.enqueue_rollout({"q": 1}, mode="train")
    await store.enqueue_rollout({"q": 2, "fail": True}, mode="train")
    metrics = RunnerMetrics()
    port = free_port()
    server = metrics.serve(port)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert value(await scrape(url), "eventlight_runner_attempts_total", status="succeeded", mode="train") == 0
        runner = agl.LitAgentRunner(
            agl.OtelTracer(), max_rollouts=2, poll_interval=0.05, heartbeat_interval=0, metrics=metrics
        )
        with runner.run_context(agent=pass_or_raise, store=store):
            assert await asyncio.wait_for(runner.iter(), 20) == 2
        after = await scrape(url)
    finally:
        server.shutdown()
        server.server_close()
    assert value(after, "eventlight_runner_attempts_total", status="succeeded", mode="train") == 1
    assert value(after, "eventlight_runner_attempts_total", status="failed", mode="train") == 1
    assert value(after, "eventlight_runner_attempt_seconds_count", mode="train") == 2
    assert value(after, "eventlight_runner_attempts_in_flight") == 0
    assert value(after, "eventlight_runner_dequeue_failures_total") == 0
    fresh = pickle.loads(pickle.dumps(metrics))  # what a spawned runner process gets: its own, empty
    assert (
        value(
            parse(generate_latest(fresh.registry).decode()),
            "eventlight_runner_attempts_total",
            status="succeeded",
            mode="train",
        )
        == 0
    )


async def test_runner_pool_serves_metrics_on_its_port(namespace: Settings) -> None:
    """``eventlight runner --metrics-port P``'s pool: the runner process answers on P + its index."""
    port = free_port()
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        await store.add_resources(RESOURCES)
        made = [await store.enqueue_rollout({"q": i}) for i in range(2)]
        pool = RunnerPool(fault_agents.quick, 1, namespace, namespace.nats_url or "", metrics_port=port)
        pool.start()
        try:
            done = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=60)
            after = await scrape(f"http://127.0.0.1:{port}/metrics")
        finally:
            await asyncio.to_thread(pool.stop, 5)
    assert [r.status for r in done] == ["succeeded", "succeeded"]
    assert value(after, "eventlight_runner_attempts_total", status="succeeded", mode="") == 2
    with pytest.raises(ValueError, match="metrics_port needs a runner that counts"):
        RunnerPool(fault_agents.quick, 1, namespace, "", runner=agl.LitAgentRunner(), metrics_port=port)
