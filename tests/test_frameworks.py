"""Agents written with the OpenAI SDK, the OpenAI Agents SDK and LangChain/LangGraph, unchanged,
run under an eventlight runner behind the LLM proxy (issue 15 item 1).

Each example of ``examples/frameworks/`` runs against the scripted OpenAI-compatible stand-in
(``tests/llm_stub.py``, token ids as vLLM returns them) on the test session's NATS and Postgres:
its LLM calls, tool calls and agent steps arrive as spans through OpenInference's instrumentation,
switched on by ``OtelTracer(instrument=[...])``, and each rollout ends in one triplet per LLM call,
taken from the proxy's copy (token ids) and rewarded. The tests skip, saying so, when the
``frameworks`` extra is not installed.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llm_stub import Reply, ScriptedLLM, ToolCall

import eventlight as agl
from eventlight import instrumentation
from eventlight.core.errors import InvalidInputError
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore

ROOT = Path(__file__).resolve().parent.parent


def needs(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if not _importable(m)]
    reason = f"the frameworks extra is not installed (missing {missing}): pip install -e '.[frameworks]'"
    return pytest.mark.skipif(bool(missing), reason=reason)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


OPENAI = needs("openinference.instrumentation.openai")
AGENTS = needs("agents", "openinference.instrumentation.openai_agents")
LANGCHAIN = needs("langchain_openai", "langgraph", "openinference.instrumentation.langchain")


def calculator(messages: list[dict[str, Any]], request: dict[str, Any]) -> Reply:
    """The stand-in's script: call ``add`` with the question's numbers, then answer the tool's
    result; a structured-output request gets the number of its prompt as JSON."""
    if request.get("response_format"):
        last = str(messages[-1].get("content"))
        return Reply(content=json.dumps({"answer": int(re.findall(r"-?\d+", last)[-1])}))
    results = [m for m in messages if m.get("role") == "tool"]
    if request.get("tools") and not results:
        question = next(str(m["content"]) for m in messages if m.get("role") == "user")
        a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
        return Reply(content=None, tool_calls=[ToolCall("add", {"a": a, "b": b})])
    return Reply(content=str(results[-1]["content"]) if results else "I do not know.")


@pytest.fixture
def clean_instrumentation() -> Iterator[None]:
    yield
    instrumentation.uninstrument_all()


async def run_example(module: str, framework: str, instrument: list[str], namespace: Settings) -> tuple[Any, Any]:
    from examples.frameworks import harness

    agent = importlib.import_module(f"examples.frameworks.{module}").calculator
    stub = ScriptedLLM(responses=calculator)
    async with stub as url, JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        report = await harness.run(framework, agent, instrument=instrument, base_url=url, model="stub", store=store)
        by_rollout = [await store.query_spans(r.rollout_id) for r in await store.query_rollouts()]
    spans = [s for rollout_spans in by_rollout for s in rollout_spans]
    assert len(stub.requests) == sum(1 for s in spans if harness.span_kind(s) == "proxy")
    # the default llm_call_match sees the proxy's copies only: the same triplets, nothing to drop
    default = agl.TracerTraceToTriplet()
    plain = [t for rollout_spans in by_rollout for t in default.adapt(rollout_spans)]
    assert [(t.response["token_ids"], t.reward) for t in plain] == [
        (t.response["token_ids"], t.reward) for t in report.triplets
    ]
    assert default.stats.duplicates == 0
    return report, spans


def check_report(report: Any, spans: list[agl.Span], llm_calls: int, framework_llm_copies: int) -> None:
    """Every rollout: one triplet per LLM call, from the proxy's copy, with ids; the last rewarded 1.0."""
    assert report.triplets_per_rollout == [llm_calls, llm_calls]
    assert report.token_ids and report.final_rewards == [1.0, 1.0]
    assert report.span_kinds["proxy"] == 2 * llm_calls
    assert report.duplicates_dropped == 2 * framework_llm_copies
    proxy_ids = {
        (tuple(s.attributes["prompt_token_ids"]), tuple(s.attributes["response_token_ids"]))
        for s in spans
        if s.name == "openai.chat.completion"
    }
    picked = {(tuple(t.prompt["token_ids"]), tuple(t.response["token_ids"])) for t in report.triplets}
    assert picked == proxy_ids  # each call once, from the proxy's copy
    for triplet in report.triplets:
        assert triplet.metadata["response_id"].startswith("chatcmpl-")
        assert triplet.metadata.get("duplicates_dropped") == framework_llm_copies // llm_calls


@OPENAI
async def test_openai_sdk_agent(namespace: Settings, clean_instrumentation: None) -> None:
    report, spans = await run_example("openai_sdk", "OpenAI SDK", ["openai"], namespace)
    check_report(report, spans, llm_calls=2, framework_llm_copies=2)
    assert report.span_kinds["LLM"] == 4  # OpenInference's ChatCompletion, one per call
    calls = [s for s in spans if s.name == "ChatCompletion"]
    assert {s.attributes["llm.output_messages.0.message.tool_calls.0.tool_call.function.name"] for s in calls[::2]} == {
        "add"
    }


@AGENTS
async def test_openai_agents_sdk_agent(namespace: Settings, clean_instrumentation: None) -> None:
    report, spans = await run_example("openai_agents_sdk", "OpenAI Agents SDK", ["openai_agents"], namespace)
    check_report(report, spans, llm_calls=2, framework_llm_copies=2)  # the SDK's generation spans
    assert report.span_kinds["TOOL"] == 2 and report.span_kinds["AGENT"] >= 2
    tools = [s for s in spans if s.attributes.get("openinference.span.kind") == "TOOL"]
    assert {s.attributes["tool.name"] for s in tools} == {"add"}
    assert sorted(str(s.attributes["output.value"]) for s in tools) == ["42", "5"]
    assert any(s.attributes.get("agent.name") == "calculator" for s in spans)


@AGENTS
def test_agents_sdk_exports_nothing_to_openai(clean_instrumentation: None) -> None:
    """With the instrumentation on, OpenInference's processor is the Agents SDK's only one: its
    default exporter to OpenAI's servers is gone."""
    from agents.tracing import get_trace_provider

    instrumentation.instrument("openai_agents")
    processors = get_trace_provider()._multi_processor._processors  # type: ignore[attr-defined]
    assert [type(p).__name__ for p in processors] == ["OpenInferenceTracingProcessor"]


@LANGCHAIN
async def test_langgraph_agent(namespace: Settings, clean_instrumentation: None) -> None:
    """peer_failures C08: LangChain's ``with_structured_output`` call gives one triplet, from the
    proxy's copy with its token ids."""
    report, spans = await run_example("langgraph_agent", "LangChain/LangGraph", ["langchain"], namespace)
    # two chat-model calls in the graph, one with_structured_output call; each a ChatOpenAI copy
    check_report(report, spans, llm_calls=3, framework_llm_copies=3)
    assert report.span_kinds["TOOL"] == 2  # the add tool, once per rollout
    steps = [s.name for s in spans if s.attributes.get("openinference.span.kind") == "CHAIN"]
    assert steps.count("LangGraph") == 2 and steps.count("model") == 4 and steps.count("tools") == 2  # graph, nodes
    contents = [str(t.response["raw_content"][0].get("content") or "") for t in report.triplets]
    structured = [c for c in contents if c.startswith("{")]  # one per rollout, from the proxy's copy
    answers = [json.loads(c) for c in structured]
    assert answers == [{"answer": 5}, {"answer": 42}]


@OPENAI
@AGENTS
@LANGCHAIN
async def test_all_layers_at_once_keep_one_triplet_per_call(namespace: Settings, clean_instrumentation: None) -> None:
    """The Agents SDK with every instrumentation on: each call is recorded three times (the proxy,
    the Agents SDK's generation, the OpenAI SDK's ChatCompletion); one triplet per call remains."""
    report, spans = await run_example("openai_agents_sdk", "OpenAI Agents SDK", ["all"], namespace)
    check_report(report, spans, llm_calls=2, framework_llm_copies=4)
    assert report.span_kinds["LLM"] == 8


@pytest.mark.parametrize(
    "module",
    [
        pytest.param("openai_sdk", marks=OPENAI),
        pytest.param("openai_agents_sdk", marks=AGENTS),
        pytest.param("langgraph_agent", marks=LANGCHAIN),
    ],
)
async def test_example_runs_as_a_program(module: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "EVENTLIGHT_"))}
    env.update(PYTHONPATH=str(ROOT), OPENAI_API_KEY="unused", LITELLM_LOCAL_MODEL_COST_MAP="True")
    async with ScriptedLLM(responses=calculator) as url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            f"examples.frameworks.{module}",
            "--base-url",
            url,
            env=env,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 240)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert "token ids yes" in last and "final rewards [1.0, 1.0]" in last, last


# -- switching instrumentation on and off -------------------------------------------------------


def test_unknown_framework_is_refused_at_once() -> None:
    with pytest.raises(InvalidInputError, match=r"unknown framework\(s\) \['crewai'\].*known: \['langchain'"):
        agl.OtelTracer(instrument=["crewai"])
    with pytest.raises(InvalidInputError, match="give it alone"):
        instrumentation.instrument("all", "openai")
    assert instrumentation.instrumented() == []


def test_missing_instrumentation_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """peer_failures C07: an instrumentation that cannot be imported is an error naming the package, not silence."""
    monkeypatch.setitem(instrumentation.FRAMEWORKS, "openai", ("no_such_module.x", "X", "no-such-package"))
    with pytest.raises(InvalidInputError, match=r"instrumenting 'openai' needs no-such-package: pip install"):
        instrumentation.instrument("openai")
    assert instrumentation.instrumented() == []


def test_eventlight_runner_without_the_instrumentation_package_exits_before_starting() -> None:
    """peer_failures C07: ``eventlight runner --instrument openai`` where the instrumentation cannot
    be imported exits 2 at once with one line naming the package; no runner process starts to die
    silently while rollouts wait."""
    import subprocess

    code = (
        "import sys; sys.modules['openinference.instrumentation.openai'] = None; "
        "from eventlight.cli.app import main; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "runner", "tests/fault_agents.py:quick", "--instrument", "openai"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert "--instrument: instrumenting 'openai' needs openinference-instrumentation-openai" in line, line
    assert "consuming" not in done.stdout


@OPENAI
def test_instrumentation_is_counted_per_user(clean_instrumentation: None) -> None:
    from openinference.instrumentation.openai import OpenAIInstrumentor

    first, second = agl.OtelTracer(instrument="openai"), agl.OtelTracer(instrument=["openai"])
    first.init_worker(0)
    second.init_worker(1)
    assert instrumentation.instrumented() == ["openai"] and OpenAIInstrumentor().is_instrumented_by_opentelemetry
    first.teardown_worker(0)
    assert OpenAIInstrumentor().is_instrumented_by_opentelemetry  # the second tracer still uses it
    second.teardown_worker(1)
    assert not OpenAIInstrumentor().is_instrumented_by_opentelemetry and instrumentation.instrumented() == []


@LANGCHAIN
@pytest.mark.e2e
async def test_under_a_trainer_the_runner_processes_instrument_themselves(namespace: Settings) -> None:
    """The production path: the Trainer's runner process (spawned) instruments LangChain from
    ``OtelTracer(instrument=...)``, the proxy runs in the trainer's process; the agent is the
    example's, unchanged."""
    from examples.frameworks.harness import LLM_SPANS, TASKS
    from examples.frameworks.langgraph_agent import calculator as agent

    async with ScriptedLLM(responses=calculator) as url:
        params = {"model": "openai/stub", "api_base": url, "api_key": "unused"}
        proxy = agl.LLMProxy(model_list=[{"model_name": "stub", "litellm_params": params}])
        trainer = agl.Trainer(
            algorithm=agl.Baseline(span_verbosity="none"),
            n_runners=1,
            tracer=agl.OtelTracer(instrument=["langchain"]),
            llm_proxy=proxy,
            initial_resources={"llm": proxy.as_resource(model="stub")},
            settings=namespace,
        )
        await trainer.fit_async(agent, TASKS)
    assert instrumentation.instrumented() == []  # only the runner process instrumented itself
    async with JetStreamLightningStore(namespace, pg_dsn=namespace.pg_dsn) as store:
        rollouts = await store.query_rollouts()
        assert [r.status for r in rollouts] == ["succeeded", "succeeded"]
        adapter = agl.TracerTraceToTriplet(llm_call_match=LLM_SPANS)
        for rollout in rollouts:
            spans = await store.query_spans(rollout.rollout_id)
            names = [s.name for s in spans]
            assert names.count("ChatOpenAI") == 3 and names.count("openai.chat.completion") == 3, names
            triplets = adapter.adapt(spans)
            assert len(triplets) == 3 and all(t.prompt["token_ids"] and t.response["token_ids"] for t in triplets)
            assert triplets[-1].reward == 1.0
        assert adapter.stats.duplicates == 6


@OPENAI
def test_the_programs_own_instrumentation_is_never_undone(clean_instrumentation: None) -> None:
    from openinference.instrumentation.openai import OpenAIInstrumentor

    OpenAIInstrumentor().instrument()
    try:
        assert instrumentation.instrument("openai") == ["openai"]
        instrumentation.uninstrument("openai")
        assert OpenAIInstrumentor().is_instrumented_by_opentelemetry
        instrumentation.instrument("openai")
        instrumentation.uninstrument_all()
        assert OpenAIInstrumentor().is_instrumented_by_opentelemetry
    finally:
        OpenAIInstrumentor().uninstrument()
