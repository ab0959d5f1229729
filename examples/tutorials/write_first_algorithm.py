"""how-to_write-first-algorithm.md as a program, in the tutorial's terminals (``runner``, ``algo``).

Changed besides the import (``agentlightning`` -> ``eventlight``), each where eventlight lacks the
tutorial's piece (``docs/porting.md``):

* ``agl.LightningStoreClient("http://localhost:4747")`` and ``agl store`` -> ``store()`` below, a
  ``JetStreamLightningStore`` on ``EVENTLIGHT_NATS_URL`` / ``EVENTLIGHT_PG_DSN`` /
  ``EVENTLIGHT_NAMESPACE`` (eventlight has no REST store server: NATS and Postgres are the store);
* ``AgentOpsTracer()`` -> ``OtelTracer()`` (no AgentOps in eventlight);
* as in Agent-lightning's own ``apo_custom_algorithm.py``: ``wait_for_rollouts`` by keyword (it is
  keyword-only in 0.3.0 too) and the prompt as a ``PromptTemplate`` resource.

Run ``python write_first_algorithm.py runner`` in one terminal, ``... algo`` in another. The LLM is
whatever ``OPENAI_BASE_URL`` names (the tests: a scripted stand-in).
"""

from __future__ import annotations

import asyncio
import random
import sys

from openai import OpenAI

import eventlight as agl
from eventlight import LitAgentRunner, OtelTracer, PromptTemplate
from eventlight.emitter import find_final_reward


def store() -> agl.JetStreamLightningStore:
    settings = agl.Settings.from_env()
    return agl.JetStreamLightningStore(settings, nats_url=settings.nats_url, pg_dsn=settings.pg_dsn)


async def find_best_prompt(store, prompts_to_test, task_input):  # type: ignore[no-untyped-def]
    """A simple algorithm to find the best prompt from a list."""
    results = []
    # Iterate through each prompt to test it
    for prompt in prompts_to_test:
        print(f"[Algo] Updating prompt template to: '{prompt}'")
        # 1. Update the resources in the store with the new prompt
        resources_update = await store.add_resources(
            resources={"prompt_template": PromptTemplate(template=prompt, engine="f-string")}
        )
        # 2. Enqueue a rollout task for a runner to execute
        print("[Algo] Queuing task for clients...")
        rollout = await store.enqueue_rollout(input=task_input, resources_id=resources_update.resources_id)
        print(f"[Algo] Task '{rollout.rollout_id}' is now available for clients.")
        # 3. Wait for the rollout to be completed by a runner
        await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id])
        # 4. Query the completed rollout and its spans
        completed_rollout = await store.get_rollout_by_id(rollout.rollout_id)
        print(f"[Algo] Received Result: {completed_rollout.model_dump_json(indent=None)}")
        spans = await store.query_spans(rollout.rollout_id)
        print("[Algo] Queried Spans:\n  - " + "\n  - ".join(str(span) for span in spans))
        final_reward = find_final_reward(spans)
        print(f"[Algo] Final reward: {final_reward}\n")
        results.append((prompt, final_reward))
    # 5. Find and print the best prompt based on the collected rewards
    print(f"[Algo] All prompts and their rewards: {results}")
    best_prompt, best_reward = max(results, key=lambda item: item[1])
    print(f"[Algo] Best prompt found: '{best_prompt}' with reward {best_reward}")


def simple_agent(task: str, prompt_template: PromptTemplate) -> float:
    """An agent that answers a question and gets judged by an LLM."""
    client = OpenAI()
    prompt = prompt_template.format(any_question=task)
    response = client.chat.completions.create(model="gpt-4.1-nano", messages=[{"role": "user", "content": prompt}])
    llm_output = response.choices[0].message.content
    print(f"[Rollout] LLM returned: {llm_output}")
    score = random.uniform(0, 1)  # Replace with actual scoring logic if needed
    return score


async def runner_main() -> None:
    async with store() as s:
        runner = LitAgentRunner[str](tracer=OtelTracer())
        with runner.run_context(agent=agl.rollout(simple_agent), store=s):
            await runner.iter()  # polling for new tasks forever


async def algo_main() -> None:
    prompts_to_test = [
        "You are a helpful assistant. {any_question}",
        "You are a knowledgeable AI. {any_question}",
        "You are a friendly chatbot. {any_question}",
    ]
    task_input = "Why is the sky blue?"
    async with store() as s:
        await find_best_prompt(s, prompts_to_test, task_input)


if __name__ == "__main__":
    asyncio.run(runner_main() if sys.argv[1:] == ["runner"] else algo_main())
