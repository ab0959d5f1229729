"""tutorials_traces.md as a program: only the import changed (``agentlightning`` -> ``eventlight``).

A rollout whose LLM calls go through the ``LLMProxy`` (the tutorial's "LLM Proxy" section: the
proxy, not the agent's process, records the spans, each with its rollout, attempt and sequence
id), then reads the trace back: ``store.query_spans``, ``find_final_reward`` from
``agentlightning.emitter``, and the two adapters, ``TracerTraceToTriplet`` and
``TraceToMessages``. The backend is whatever ``OPENAI_BASE_URL`` names (the tests: a scripted
stand-in).
"""

from __future__ import annotations

import asyncio
import os

from openai import AsyncOpenAI

import eventlight as agl
from eventlight.emitter import find_final_reward


@agl.rollout
async def proxied_agent(task: str, llm: agl.LLM, rollout: agl.Rollout) -> float:
    base_url = llm.get_base_url(rollout.rollout_id, rollout.attempt.attempt_id)  # type: ignore[attr-defined]
    client = AsyncOpenAI(base_url=base_url, api_key="dummy")
    response = await client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task}])
    return 1.0 if "Paris" in (response.choices[0].message.content or "") else 0.0


async def main() -> None:
    store = agl.InMemoryLightningStore()
    backend = os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    llm_proxy = agl.LLMProxy(
        model_list=[{"model_name": "stub", "litellm_params": {"model": "openai/stub", "api_base": backend}}],
        store=store,
    )
    await llm_proxy.start()
    try:
        runner = agl.LitAgentRunner(agl.OtelTracer())
        with runner.run_context(agent=proxied_agent, store=store):
            rollout = await runner.step("What's the capital of France?", resources={"llm": llm_proxy.as_resource()})
    finally:
        await llm_proxy.stop()
    spans = await store.query_spans(rollout.rollout_id)
    reward = find_final_reward(spans)
    print(f"Final reward: {reward}")
    for span in spans:
        print(f"- #{span.sequence_id} {span.name}")
    print("triplets:", agl.TracerTraceToTriplet().adapt(spans))
    print("messages:", agl.TraceToMessages().adapt(spans))
    print(f"traces: {len(spans)} spans, reward {reward}")


if __name__ == "__main__":
    asyncio.run(main())
