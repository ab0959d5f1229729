"""An agent written with the OpenAI Python SDK directly, run under an eventlight runner.

The agent is plain SDK code: ``AsyncOpenAI(base_url=...)``, a function tool, a loop that runs the
tool calls the model makes until it answers. Its only eventlight line is where the base URL comes
from: the rollout's ``llm`` resource (the LLM proxy's route for this attempt). OpenInference's
OpenAI instrumentation (switched on by ``OtelTracer(instrument=["openai"])`` in ``harness.py``)
records each SDK call as a ``ChatCompletion`` span; the proxy records the same call with its token
ids, and the adapter keeps that copy.

    python -m examples.frameworks.openai_sdk --base-url http://127.0.0.1:8000/v1 --model NAME
"""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

import eventlight as agl
from examples.frameworks.harness import INSTRUCTIONS, add, main, reward

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@agl.rollout
async def calculator(task: dict[str, Any], llm: agl.LLM) -> float:
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused")
    messages: list[Any] = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": task["question"]},
    ]
    for _ in range(4):
        response = await client.chat.completions.create(model=llm.model, messages=messages, tools=[ADD_TOOL])
        message = response.choices[0].message
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = add(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    await client.close()
    return reward(message.content, task)


if __name__ == "__main__":
    main("OpenAI SDK", calculator, instrument=["openai"])
