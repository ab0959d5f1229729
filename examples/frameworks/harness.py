"""What the three framework examples share: run an agent under an eventlight runner, behind the LLM
proxy, with the framework's OpenTelemetry instrumentation on, and turn its spans into triplets.

The agents themselves (``openai_sdk.py``, ``openai_agents_sdk.py``, ``langgraph_agent.py``) are
ordinary framework code; the only eventlight thing they do is read the base URL from the
rollout's ``llm`` resource (``llm.endpoint``: the proxy's route for this attempt, so the proxy
records each call with its token ids as a span of the attempt). Everything else is here:

* ``LLMProxy`` in front of ``--base-url`` (any OpenAI-compatible server; the tests use a scripted
  stand-in that returns token ids as vLLM does);
* ``LitAgentRunner(OtelTracer(instrument=[...]))``: the runner and the one line that switches on
  OpenInference's instrumentation of the framework (``eventlight.instrumentation``);
* ``TracerTraceToTriplet`` over *every* LLM span of the trace, the proxy's and the framework's
  (``LLM_SPANS``): each call becomes one triplet, from the proxy's copy (the one with token ids),
  and the framework's copies are counted as dropped duplicates.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import eventlight as agl

LLM_SPANS = r"^(openai\.chat\.completion|ChatCompletion|ChatOpenAI|generation)$"
"""Names of LLM-call spans: the proxy's, OpenInference's OpenAI SDK and LangChain chat model spans,
and the Agents SDK's generation spans."""

TASKS = [{"question": "What is 2 + 3?", "answer": 5}, {"question": "What is 17 + 25?", "answer": 42}]
INSTRUCTIONS = "You are a calculator. Use the add tool for every sum, then answer with the number only."


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def reward(answer: Any, task: dict[str, Any]) -> float:
    """1.0 when the answer is the task's number (text or a number), else 0.0."""
    return 1.0 if str(answer).strip().rstrip(".") == str(task["answer"]) else 0.0


@dataclass
class Report:
    """What one example produced, per rollout."""

    framework: str
    spans_per_rollout: list[int] = field(default_factory=list)
    span_kinds: Counter[str] = field(default_factory=Counter)
    triplets_per_rollout: list[int] = field(default_factory=list)
    token_ids: bool = True
    final_rewards: list[float | None] = field(default_factory=list)
    duplicates_dropped: int = 0
    triplets: list[agl.Triplet] = field(default_factory=list)

    def line(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.span_kinds.items()))
        return (
            f"{self.framework}: {len(self.spans_per_rollout)} rollouts, spans per rollout {self.spans_per_rollout} "
            f"({kinds}), triplets per rollout {self.triplets_per_rollout}, token ids "
            f"{'yes' if self.token_ids else 'no'}, final rewards {self.final_rewards}, "
            f"duplicates dropped {self.duplicates_dropped}"
        )


def span_kind(span: agl.Span) -> str:
    """``proxy`` for the LLM proxy's spans, OpenInference's span kind, else the span's name."""
    if span.name == "openai.chat.completion" and "prompt_token_ids" in (span.attributes or {}):
        return "proxy"
    return str((span.attributes or {}).get("openinference.span.kind") or span.name)


async def run(
    framework: str,
    agent: Any,
    *,
    instrument: Sequence[str],
    base_url: str,
    model: str,
    api_key: str = "unused",
    tasks: Sequence[dict[str, Any]] = TASKS,
    store: agl.LightningStore | None = None,
) -> Report:
    """Run ``agent`` once per task and adapt each rollout's spans.

    Args:
        framework: A label for the report.
        agent: A ``@rollout`` agent taking ``(task, llm)``.
        instrument: Frameworks to instrument (``eventlight.instrumentation.FRAMEWORKS``).
        base_url: The OpenAI-compatible backend behind the proxy (``http://host:port/v1``).
        model: The model name the agent asks for.
        api_key: The backend's key (the proxy sends it; it is never recorded).
        tasks: ``{"question", "answer"}`` items.
        store: Where rollouts and spans go; ``None``: a fresh in-memory store.

    Raises:
        RuntimeError: A rollout did not succeed.
    """
    store = store or agl.InMemoryLightningStore()
    params = {"model": f"openai/{model}", "api_base": base_url, "api_key": api_key}
    proxy = agl.LLMProxy(model_list=[{"model_name": model, "litellm_params": params}], store=store)
    await proxy.start()
    rollouts = []
    try:
        runner = agl.LitAgentRunner(agl.OtelTracer(instrument=instrument))
        with runner.run_context(agent=agent, store=store):
            for task in tasks:
                rollouts.append(await runner.step(task, resources={"llm": proxy.as_resource(model=model)}))
    finally:
        await proxy.stop()
    report = Report(framework)
    adapter = agl.TracerTraceToTriplet(llm_call_match=LLM_SPANS)
    for rollout in rollouts:
        if rollout.status != "succeeded":
            raise RuntimeError(f"rollout {rollout.rollout_id} ended {rollout.status}")
        spans = await store.query_spans(rollout.rollout_id)
        triplets = adapter.adapt(spans)
        report.spans_per_rollout.append(len(spans))
        report.span_kinds.update(span_kind(s) for s in spans)
        report.triplets_per_rollout.append(len(triplets))
        report.token_ids &= bool(triplets) and all(t.prompt["token_ids"] and t.response["token_ids"] for t in triplets)
        report.final_rewards.append(triplets[-1].reward if triplets else None)
        report.triplets.extend(triplets)
    report.duplicates_dropped = adapter.stats.duplicates
    return report


def main(framework: str, agent: Any, instrument: Sequence[str]) -> None:
    """The examples' command line: ``--base-url`` (default ``$OPENAI_BASE_URL``), ``--model``."""
    parser = argparse.ArgumentParser(description=f"Run the {framework} example agent under an eventlight runner.")
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    parser.add_argument("--model", default=os.environ.get("EVENTLIGHT_EXAMPLE_MODEL", "stub"))
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    args = parser.parse_args()
    report = asyncio.run(
        run(framework, agent, instrument=instrument, base_url=args.base_url, model=args.model, api_key=args.api_key)
    )
    for triplet in report.triplets:
        print(
            f"triplet: {len(triplet.prompt['token_ids'])} prompt ids, {len(triplet.response['token_ids'])} "
            f"response ids, reward {triplet.reward}"
        )
    print(report.line())
