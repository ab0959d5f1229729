"""An agent written with LangChain and LangGraph, run under an eventlight runner.

Plain LangChain code: ``ChatOpenAI(base_url=...)`` (the base URL is the rollout's ``llm``
resource, the LLM proxy's route for this attempt) with a tool bound, in a LangGraph
``StateGraph`` (model node, ``ToolNode``, ``tools_condition``), then one
``with_structured_output`` call that extracts the answer as a pydantic model. OpenInference's
LangChain instrumentation (``OtelTracer(instrument=["langchain"])`` in ``harness.py``) records the
graph, its nodes, the chat model calls and the tool call as spans; the proxy's copy of each call
has the token ids.

    python -m examples.frameworks.langgraph_agent --base-url http://127.0.0.1:8000/v1 --model NAME
"""

from __future__ import annotations

from typing import Any

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from pydantic import BaseModel

import eventlight as agl
from examples.frameworks.harness import INSTRUCTIONS, add, main, reward

add_tool = tool(add)


class Answer(BaseModel):
    """The final answer, extracted by ``with_structured_output``."""

    answer: int


def build_graph(chat: ChatOpenAI) -> Any:
    model = chat.bind_tools([add_tool])

    async def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([add_tool]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile()


@agl.rollout
async def calculator(task: dict[str, Any], llm: agl.LLM) -> float:
    chat = ChatOpenAI(model=llm.model, base_url=llm.endpoint, api_key=llm.api_key or "unused")
    state = await build_graph(chat).ainvoke({"messages": [("system", INSTRUCTIONS), ("user", task["question"])]})
    final = state["messages"][-1].content
    answer = await chat.with_structured_output(Answer).ainvoke(f"Give the number in this answer: {final}")
    return reward(answer.answer, task)  # type: ignore[union-attr]


if __name__ == "__main__":
    main("LangChain/LangGraph", calculator, instrument=["langchain"])
