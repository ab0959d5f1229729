"""tutorials_debug.md as a program: only the import changed (``agentlightning`` -> ``eventlight``).

``apo_rollout`` (after Agent-lightning's ``examples/apo/apo_debug.py``: answer with the prompt, ask
a judge for a score, emit it) runs three ways, as the tutorial shows: one ``Runner.step`` on an
``InMemoryLightningStore`` with a query of the store, the same with a ``DebugHook`` that prints the
trace, and ``Trainer.dev`` on the dataset (``Baseline``, one runner). The LLM is whatever
``OPENAI_BASE_URL`` names (the tests: a scripted stand-in).
"""

from __future__ import annotations

import asyncio
import re

from openai import AsyncOpenAI

import eventlight as agl


@agl.rollout
async def apo_rollout(task: str, prompt_template: agl.PromptTemplate) -> None:
    client = AsyncOpenAI()
    answer = await client.chat.completions.create(
        model="gpt-4.1-nano", messages=[{"role": "user", "content": prompt_template.format(any_question=task)}]
    )
    judged = await client.chat.completions.create(
        model="gpt-4.1-nano",
        messages=[
            {
                "role": "user",
                "content": f"Evaluate how well the output fulfills the task. Task: {task}\n"
                f"Output: {answer.choices[0].message.content}\nReply with a score between 0 and 1.",
            }
        ],
    )
    score = re.search(r"\d+(\.\d+)?", judged.choices[0].message.content or "")
    agl.emit_reward(float(score.group()) if score else 0.0)


class DebugHook(agl.Hook):
    async def on_trace_end(self, *, agent, runner, tracer, rollout):  # type: ignore[no-untyped-def]
        trace = tracer.get_last_trace()
        print("Trace spans collected during the rollout:")
        for span in trace:
            print(f"- {span.name} (status: {span.status}):\n  {span.attributes}")


async def run_in_isolation() -> None:
    tracer = agl.OtelTracer()
    runner = agl.LitAgentRunner(tracer)
    store = agl.InMemoryLightningStore()
    with runner.run_context(agent=apo_rollout, store=store):
        resource = agl.PromptTemplate(template="You are a helpful assistant. {any_question}", engine="f-string")
        rollout = await runner.step(
            "Explain why the sky appears blue using principles of light scattering in 100 words.",
            resources={"main_prompt": resource},
        )
    print(await store.query_rollouts())
    print(await store.query_spans(rollout.rollout_id))
    with runner.run_context(agent=apo_rollout, store=store, hooks=[DebugHook()]):
        await runner.step(
            "Explain why the sky appears blue using principles of light scattering in 100 words.",
            resources={"main_prompt": resource},
        )


def main() -> None:
    agl.setup_logging("INFO")
    asyncio.run(run_in_isolation())
    dataset: agl.Dataset[str] = [
        "Explain why the sky appears blue using principles of light scattering in 100 words.",
        "What's the capital of France?",
    ]
    resource = agl.PromptTemplate(template="You are a helpful assistant. {any_question}", engine="f-string")
    trainer = agl.Trainer(n_runners=1, initial_resources={"main_prompt": resource})
    trainer.dev(apo_rollout, dataset)
    print("debug: done")


if __name__ == "__main__":
    main()
