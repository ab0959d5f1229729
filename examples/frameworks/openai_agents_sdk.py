"""An agent written with the OpenAI Agents SDK, run under an eventlight runner.

Plain Agents SDK code: an ``Agent`` with one ``function_tool``, run by ``Runner.run``, its model an
``OpenAIChatCompletionsModel`` over ``AsyncOpenAI(base_url=...)`` where the base URL is the
rollout's ``llm`` resource (the LLM proxy's route for this attempt). OpenInference's Agents SDK
instrumentation (``OtelTracer(instrument=["openai_agents"])`` in ``harness.py``) records the agent,
its turns, each generation and each tool call as spans, and replaces the SDK's own trace exporter
to OpenAI's servers (nothing leaves the machine). The proxy's copy of each call has the token ids.

    python -m examples.frameworks.openai_agents_sdk --base-url http://127.0.0.1:8000/v1 --model NAME
"""

from __future__ import annotations

from typing import Any

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool
from openai import AsyncOpenAI

import eventlight as agl
from examples.frameworks.harness import INSTRUCTIONS, add, main, reward

add_tool = function_tool(add)


@agl.rollout
async def calculator(task: dict[str, Any], llm: agl.LLM) -> float:
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused")
    agent = Agent(
        name="calculator",
        instructions=INSTRUCTIONS,
        model=OpenAIChatCompletionsModel(model=llm.model, openai_client=client),
        tools=[add_tool],
    )
    result = await Runner.run(agent, task["question"])
    await client.close()
    return reward(result.final_output, task)


if __name__ == "__main__":
    main("OpenAI Agents SDK", calculator, instrument=["openai_agents"])
