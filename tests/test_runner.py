"""The runner, the tracer and the emitters on the in-memory store (``tutorials_write-agents.md``);
the idle and the cancelled runner (peer_failures C19, C06) on both backends."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import fractions
import functools
import pickle
import threading
import time
from typing import Any

import opentelemetry.trace
import pytest

import eventlight as agl
from eventlight.runner import Hook
from tests import fault_agents


@agl.rollout
async def emitting_agent(task: dict, prompt_template: agl.PromptTemplate) -> None:
    with agl.operation(name="think") as op:
        op.set_input(question=task["q"])
        op.set_output(prompt_template.format(q=task["q"]))
    agl.emit_message("thinking done")
    agl.emit_reward({"task": task["score"], "style": 0.5}, primary_key="task")


@agl.rollout
def returning_agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
    return task["score"]


@agl.rollout
def failing_agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
    raise ConnectionError("the sub-agent's backend is down")


class Recorder(Hook):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def on_rollout_start(self, *, agent: Any, runner: Any, rollout: Any) -> None:
        self.calls.append("rollout_start")

    async def on_trace_start(self, *, agent: Any, runner: Any, tracer: Any, rollout: Any) -> None:
        self.calls.append("trace_start")

    async def on_trace_end(self, *, agent: Any, runner: Any, tracer: Any, rollout: Any) -> None:
        self.calls.append("trace_end")

    async def on_rollout_end(self, *, agent: Any, runner: Any, rollout: Any, spans: Any) -> None:
        self.calls.append(f"rollout_end:{len(spans)}")


RESOURCES = {"prompt": agl.PromptTemplate(template="Q: {q}")}


async def test_step_records_emitted_spans_and_final_reward() -> None:
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    hooks = Recorder()
    with runner.run_context(agent=emitting_agent, store=store, hooks=[hooks]):
        done = await runner.step({"q": "2+2", "score": 0.75}, resources=RESOURCES, mode="train")
    assert done.status == "succeeded"
    spans = await store.query_spans(done.rollout_id)
    names = [s.name for s in spans]
    assert names == ["agentlightning.operation", "agentlightning.message", "agentlightning.annotation"]
    assert [s.sequence_id for s in spans] == [1, 2, 3]
    op = spans[0].attributes
    assert op["agentlightning.operation.name"] == "think" and op["agentlightning.operation.output"] == "Q: 2+2"
    reward = spans[2].attributes
    assert reward["agentlightning.reward.0.name"] == "task" and reward["agentlightning.reward.1.name"] == "style"
    assert agl.find_final_reward(spans) == 0.75
    assert hooks.calls == ["rollout_start", "trace_start", "trace_end", "rollout_end:3"]


LIVE: dict[str, Any] = {}


@agl.rollout
async def waiting_agent(task: dict, prompt_template: agl.PromptTemplate, rollout: agl.Rollout) -> float:
    """Emits a message, then waits (up to 5 s) until the store has it, while still running."""
    agl.emit_message("first round done")
    for _ in range(100):
        spans = await LIVE["store"].query_spans(rollout.rollout_id)
        if any(s.name == "agentlightning.message" for s in spans):
            LIVE["seen_while_running"] = True
            break
        await asyncio.sleep(0.05)
    return 1.0


async def test_spans_reach_the_store_while_the_agent_still_runs() -> None:
    store = agl.InMemoryLightningStore()
    LIVE.clear()
    LIVE["store"] = store
    runner = agl.LitAgentRunner(agl.OtelTracer(flush_interval_s=0.1))
    with runner.run_context(agent=waiting_agent, store=store):
        done = await runner.step({"q": "x"}, resources=RESOURCES, mode="train")
    assert done.status == "succeeded" and LIVE.get("seen_while_running") is True


async def test_returned_number_becomes_the_final_reward() -> None:
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    with runner.run_context(agent=returning_agent, store=store):
        done = await runner.step({"score": 0.25}, resources=RESOURCES)
    spans = await store.query_spans(done.rollout_id)
    assert [s.name for s in spans] == ["agentlightning.annotation"]
    assert spans[0].attributes == {"agentlightning.reward.0.name": "primary", "agentlightning.reward.0.value": 0.25}


def test_a_reward_that_is_not_finite_is_refused_where_it_is_emitted() -> None:
    """NaN and infinity were stored as ``null`` on JetStream and as given in memory (a reviewer); no
    store keeps them now, so the emitter says so at once, naming the dimension."""
    for value in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match=f"'primary' must be a finite number, got: {value!r}"):
            agl.emit_reward(value, propagate=False)
    with pytest.raises(ValueError, match="'b' must be a finite number, got: nan"):
        agl.emit_reward({"a": 1.0, "b": float("nan")}, primary_key="a", propagate=False)


@agl.rollout
def nan_agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
    return float("nan")


async def test_an_agent_returning_nan_fails_its_attempt_with_the_reason() -> None:
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    with runner.run_context(agent=nan_agent, store=store), pytest.raises(ValueError, match="finite"):
        await runner.step({"q": 1}, resources=RESOURCES)  # step re-raises what the agent raised (0.3.0)
    (listed,) = await store.query_rollouts()
    rollout = await store.get_rollout_by_id(listed.rollout_id)
    assert rollout.status == "failed" and "must be a finite number, got: nan" in (rollout.status_reason or "")


async def test_agent_exception_fails_the_attempt_and_the_loop_goes_on() -> None:
    """peer_failures C16: the sub-agent's exception fails the attempt and is on it as a span."""
    store = agl.InMemoryLightningStore()
    await store.add_resources(RESOURCES)
    bad = await store.enqueue_rollout({"score": 1.0}, config=agl.RolloutConfig(max_attempts=1))
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=1, poll_interval=0.05, heartbeat_interval=0)
    with runner.run_context(agent=failing_agent, store=store):
        assert await asyncio.wait_for(runner.iter(), 10) == 1
    got = await store.get_rollout_by_id(bad.rollout_id)
    assert got.status == "failed" and got.attempt.status == "failed"
    # the failure is on the attempt, not only in the runner's log: an exception span
    (span,) = [s for s in await store.query_spans(bad.rollout_id) if s.name == "agentlightning.exception"]
    assert span.attributes["exception.type"] == "ConnectionError"
    assert span.attributes["exception.message"] == "the sub-agent's backend is down"
    assert "failing_agent" in span.attributes["exception.stacktrace"]


async def test_iter_consumes_the_queue_until_stopped() -> None:
    store = agl.InMemoryLightningStore()
    await store.add_resources(RESOURCES)
    made = [await store.enqueue_rollout({"score": i / 10}) for i in range(5)]
    runner = agl.LitAgentRunner(agl.OtelTracer(), poll_interval=0.05, heartbeat_interval=0.05)
    stop = asyncio.Event()
    with runner.run_context(agent=returning_agent, store=store, worker_id=3):
        task = asyncio.create_task(runner.iter(event=stop))
        finished = await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=10)
        stop.set()
        assert await asyncio.wait_for(task, 10) == 5
    assert {r.status for r in finished} == {"succeeded"}
    worker = await store.get_worker_by_id(runner.get_worker_id())
    assert worker.status == "idle" and worker.last_heartbeat_time is not None and worker.heartbeat_stats


async def test_a_runner_that_stops_says_so_in_its_last_heartbeat(store: Any) -> None:
    """A stopped runner's worker was alive for ``LIVE_HEARTBEAT_S`` (30 s) after it exited: only its
    last heartbeat's age told. Its last heartbeat now carries ``STOPPED_AT`` (in the stats, which
    ``update_worker`` replaces; Agent-lightning's worker statuses have no stopped one and the status
    is left as the store derived it), on either backend."""
    from eventlight.store.liveness import is_alive, stopped_at

    runner = agl.LitAgentRunner(agl.OtelTracer(), poll_interval=0.05, heartbeat_interval=0.05)
    stop = asyncio.Event()
    with runner.run_context(agent=returning_agent, store=store):
        task = asyncio.create_task(runner.iter(event=stop))
        while (await store.get_worker_by_id(runner.get_worker_id())) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        worker = await store.get_worker_by_id(runner.get_worker_id())
        assert stopped_at(worker) is None and is_alive(worker, time.time())  # running
        stop.set()
        assert await asyncio.wait_for(task, 10) == 0
    if hasattr(store, "sync_all"):
        await store.sync_all()
    worker = await store.get_worker_by_id(runner.get_worker_id())
    assert worker is not None and worker.heartbeat_stats is not None
    assert stopped_at(worker) is not None and not is_alive(worker, time.time()), worker.heartbeat_stats
    assert worker.status == "idle" and "process_rss_mb" in worker.heartbeat_stats  # still a snapshot


def test_emitters_need_an_active_tracer_unless_not_propagated() -> None:
    with pytest.raises(RuntimeError, match="No active tracer"):
        agl.emit_reward(1.0)
    fields = agl.emit_reward(0.5, propagate=False)
    assert fields.name == "agentlightning.annotation"
    assert fields.attributes["agentlightning.reward.0.value"] == 0.5
    with pytest.raises(TypeError):
        agl.emit_reward("high", propagate=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="primary_key"):
        agl.emit_reward({"a": 1.0}, propagate=False)


async def test_a_scalar_reward_records_what_its_annotation_would() -> None:
    """``emit_reward(x)`` (no attributes) builds its span's attributes itself, without
    ``emit_annotation``'s walk: the span is the one ``emit_annotation`` records for the same reward."""
    annotation = {"agentlightning.reward": [{"name": "primary", "value": 0.25}]}
    fast, slow = agl.emit_reward(0.25, propagate=False), agl.emit_annotation(annotation, propagate=False)
    assert (fast.name, fast.status, fast.attributes) == (slow.name, slow.status, slow.attributes)
    assert list(fast.attributes) == list(slow.attributes)  # the same keys, in the same order
    tracer = agl.OtelTracer()
    tracer.init_worker(0, None)
    async with tracer.trace_context():
        recorded = [agl.emit_reward(0.25), agl.emit_annotation(annotation)]
    assert recorded[0].status == recorded[1].status and recorded[0].attributes == recorded[1].attributes
    with pytest.raises(ValueError, match="finite"):
        agl.emit_reward(float("inf"), propagate=False)


def test_rollout_decorator_checks_the_signature() -> None:
    with pytest.raises(NotImplementedError, match="does not match"):

        @agl.rollout
        def bad(question: str, llm: agl.LLM) -> None: ...

    assert returning_agent({"score": 0.5}, agl.PromptTemplate(template="x")) == 0.5


class Tools:
    def __init__(self) -> None:
        self.k = 10

    @agl.operation
    def add(self, a: int) -> int:
        return self.k + a

    @agl.operation(category="tool")
    async def mul(self, a: int) -> int:
        return self.k * a


@agl.rollout
async def method_agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
    tools = Tools()
    return float(tools.add(1) + await tools.mul(2))


async def test_operation_decorates_sync_and_async_methods() -> None:
    """``@operation`` returns a function (0.3.0: ``functools.wraps``), so a method binds ``self``."""
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    with runner.run_context(agent=method_agent, store=store):
        done = await runner.step({}, resources=RESOURCES)
    assert done.status == "succeeded"
    spans = await store.query_spans(done.rollout_id)
    add, mul = (s.attributes for s in spans if s.name == "agentlightning.operation")
    assert add["agentlightning.operation.name"] == "add" and add["agentlightning.operation.input.a"] == 1
    assert add["agentlightning.operation.output"] == 11
    assert mul["category"] == "tool" and mul["agentlightning.operation.output"] == 20
    assert agl.find_final_reward(spans) == 31.0
    assert Tools.add.__name__ == "add" and Tools.add.__wrapped__.__qualname__ == "Tools.add"  # type: ignore[attr-defined]


@agl.rollout
def otel_spans_agent(task: dict, prompt_template: agl.PromptTemplate) -> list[Any]:
    from opentelemetry.sdk.trace import TracerProvider

    span = TracerProvider().get_tracer("mine").start_span("my.span", attributes={"k": 1})
    span.end()
    return [span]


@agl.rollout
def core_fields_agent(task: dict, prompt_template: agl.PromptTemplate) -> list[Any]:
    return [agl.emit_object({"a": 1}, propagate=False), agl.emit_reward(0.3, propagate=False)]


@agl.rollout
def id_less_spans_agent(task: dict, prompt_template: agl.PromptTemplate) -> list[Any]:
    reward = agl.emit_reward(0.4, propagate=False)
    return [agl.Span.from_attributes(attributes=reward.attributes, name=reward.name)]


@agl.rollout
def mixed_agent(task: dict, prompt_template: agl.PromptTemplate) -> list[Any]:
    return [agl.emit_reward(0.3, propagate=False), "not a span"]


@pytest.mark.parametrize(
    ("agent", "names", "reward"),
    [
        (otel_spans_agent, ["my.span"], None),
        (core_fields_agent, ["agentlightning.object", "agentlightning.annotation"], 0.3),
        (id_less_spans_agent, ["agentlightning.annotation"], 0.4),
    ],
)
async def test_returned_spans_become_the_attempts_spans(agent: Any, names: list[str], reward: float | None) -> None:
    """``list[ReadableSpan]``, ``list[SpanCoreFields]`` and ``list[Span]`` (``RolloutRawResult``, 0.3.0)
    are stored as spans of the attempt, with its ids and the next sequence ids."""
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    with runner.run_context(agent=agent, store=store):
        done = await runner.step({}, resources=RESOURCES)
    assert done.status == "succeeded"
    spans = await store.query_spans(done.rollout_id)
    assert [s.name for s in spans] == names
    assert {(s.rollout_id, s.attempt_id) for s in spans} == {(done.rollout_id, done.attempt.attempt_id)}
    assert [s.sequence_id for s in spans] == list(range(1, len(names) + 1))
    assert agl.find_final_reward(spans) == reward


async def test_a_returned_list_of_other_items_fails_the_attempt() -> None:
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    with runner.run_context(agent=mixed_agent, store=store):
        with pytest.raises(
            ValueError, match="list of ReadableSpan, Span or SpanCoreFields, but got: SpanCoreFields, str"
        ):
            await runner.step({}, resources=RESOURCES)


def needs_foo(task: dict, prompt_template: agl.PromptTemplate, foo: float) -> float:
    return foo


def keyword_only_task(*, task: dict, prompt_template: agl.PromptTemplate) -> None: ...


def positional_only(task: dict, prompt_template: agl.PromptTemplate, /) -> None: ...


@pytest.mark.parametrize(
    ("func", "why"),
    [
        (needs_foo, "missing a required argument: 'foo'"),
        (keyword_only_task, "positional parameter called 'task'"),
        (positional_only, "'prompt_template' parameter is positional only"),
    ],
)
def test_rollout_refuses_signatures_the_runner_cannot_call(func: Any, why: str) -> None:
    with pytest.raises(NotImplementedError, match=why):
        agl.rollout(func)
    with pytest.raises(ValueError, match=why):
        agl.prompt_rollout(func)


async def test_rollout_takes_a_partial() -> None:
    agent = agl.rollout(functools.partial(needs_foo, foo=0.5))
    assert pickle.loads(pickle.dumps(agent))({}, RESOURCES["prompt"]) == 0.5  # a runner process gets a copy
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    with runner.run_context(agent=agent, store=store):
        done = await runner.step({}, resources=RESOURCES)
    assert agl.find_final_reward(await store.query_spans(done.rollout_id)) == 0.5
    with pytest.raises(NotImplementedError, match="does not match"):
        agl.rollout(functools.partial(needs_foo, {}))  # the task bound: no 'task' parameter left


class LegacyHooksAgent(agl.LitAgent[dict]):
    def __init__(self, *, fail_end: bool = False) -> None:
        super().__init__()
        self.fail_end = fail_end
        self.calls: list[str] = []

    def on_rollout_start(self, task: dict, runner: Any, tracer: Any) -> None:
        self.calls.append(f"start {task['score']} {runner is self.runner} {tracer is self.get_tracer()}")

    def on_rollout_end(self, task: dict, rollout: agl.Rollout, runner: Any, tracer: Any) -> None:
        self.calls.append(f"end {rollout.status} {runner is self.runner}")
        if self.fail_end:
            raise RuntimeError("a broken hook")

    def rollout(self, task: dict, resources: agl.NamedResources, rollout: agl.Rollout) -> float:
        self.calls.append("rollout")
        return float(task["score"])


async def test_litagent_has_the_members_of_the_agent_reference() -> None:
    """``trained_agents`` (deprecated), ``runner``/``trainer``/``tracer``, ``get_tracer()`` and the
    deprecated ``on_rollout_start``/``on_rollout_end``, which the runner calls around each attempt."""
    with pytest.deprecated_call(match="agent_match"):
        assert agl.LitAgent(trained_agents="x").trained_agents == "x"
    agent = LegacyHooksAgent()
    with pytest.raises(ValueError, match="Runner has not been set"):
        agent.get_tracer()
    with pytest.raises(ValueError, match="Trainer has not been set"):
        _ = agent.trainer
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    hooks = Recorder()
    with runner.run_context(agent=agent, store=store, hooks=[hooks]):
        assert agent.runner is runner and agent.get_tracer() is runner.tracer and agent.tracer is runner.tracer
        done = await runner.step({"score": 0.5}, resources=RESOURCES)
    assert done.status == "succeeded"
    assert agent.calls == ["start 0.5 True True", "rollout", "end preparing True"]
    assert hooks.calls == ["rollout_start", "trace_start", "trace_end", "rollout_end:1"]
    failing_hook = LegacyHooksAgent(fail_end=True)
    with runner.run_context(agent=failing_hook, store=store):
        done = await runner.step({"score": 0.5}, resources=RESOURCES)
    assert done.status == "succeeded" and failing_hook.calls[-1] == "end preparing True"  # logged, not raised


def test_emit_reward_takes_any_real_number() -> None:
    np = pytest.importorskip("numpy")
    for value in (np.float32(0.5), np.int64(1), fractions.Fraction(1, 2), True):
        recorded = agl.emit_reward(value, propagate=False).attributes["agentlightning.reward.0.value"]
        assert type(recorded) is float and recorded == float(value)
    dims = agl.emit_reward({"a": np.float32(0.25), "b": np.int64(2)}, primary_key="a", propagate=False).attributes
    assert dims["agentlightning.reward.0.value"] == 0.25 and dims["agentlightning.reward.1.value"] == 2.0


@agl.rollout
def numpy_agent(task: dict, prompt_template: agl.PromptTemplate) -> Any:
    agl.emit_annotation({"tags": [], "nested": {"none": []}, "kept": 1})
    return pytest.importorskip("numpy").float32(0.25)


async def test_a_numpy_reward_and_an_empty_annotation_list_are_recorded() -> None:
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    with runner.run_context(agent=numpy_agent, store=store):
        done = await runner.step({}, resources=RESOURCES)
    assert done.status == "succeeded"
    annotation, reward = await store.query_spans(done.rollout_id)
    assert annotation.attributes == {"tags": [], "nested.none": [], "kept": 1}
    assert agl.find_final_reward([reward]) == 0.25


def test_numpy_values_in_annotations_objects_and_attributes_are_recorded_as_python_values() -> None:
    """``emit_annotation({"n": np.int64(2)})`` raised "unsupported value" (and a ``np.float64``, a float
    subclass, passed here but the store refused it), while rewards take any ``numbers.Real``."""
    np = pytest.importorskip("numpy")
    annotation = {
        "f": np.float64(0.5),
        "i": np.int64(2),
        "b": np.bool_(True),
        "s": np.str_("x"),
        "array": np.array([1.0, 2.0]),
        "scalars": [np.int64(1), np.int64(2)],
        "mixed": [np.float64(1.0), 2.0],
    }
    attrs = agl.emit_annotation(annotation, propagate=False).attributes
    expected = {"f": 0.5, "i": 2, "b": True, "s": "x", "array": [1.0, 2.0], "scalars": [1, 2], "mixed": [1.0, 2.0]}
    assert attrs == expected and [type(v) for v in attrs.values()] == [type(v) for v in expected.values()]
    assert [type(v) for v in attrs["scalars"]] == [int, int]
    with pytest.raises(ValueError, match="unsupported value"):  # only 1-d arrays are lists
        agl.emit_annotation({"grid": np.zeros((2, 2))}, propagate=False)
    obj = agl.emit_object({"n": np.int64(3), "v": np.array([0.5])}, propagate=False).attributes
    assert obj["agentlightning.object.json"] == '{"n": 3, "v": [0.5]}'
    with agl.operation(propagate=False, k=np.int64(1)) as op:
        op.set_output(np.array([1, 2]))
    assert op.span().attributes == {"k": 1, "agentlightning.operation.output": [1, 2]}


@agl.rollout
def numpy_annotation_agent(task: dict, prompt_template: agl.PromptTemplate) -> None:
    np = pytest.importorskip("numpy")
    agl.emit_annotation({"score": np.float64(0.5), "n": np.int64(2), "nan": np.float64("nan"), "py_nan": float("nan")})
    agl.emit_message("m", attributes={"ok": np.bool_(True)})


async def test_numpy_annotations_reach_the_store_and_a_numpy_nan_goes_as_a_float_nan_does() -> None:
    pytest.importorskip("numpy")
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    with runner.run_context(agent=numpy_annotation_agent, store=store):
        done = await runner.step({}, resources=RESOURCES)
    assert done.status == "succeeded"
    annotation, message = await store.query_spans(done.rollout_id)
    assert annotation.attributes == {"score": 0.5, "n": 2, "nan": "NaN", "py_nan": "NaN"}  # OTLP/JSON's NaN
    assert message.attributes["ok"] is True


# -- threads the agent starts, tasks it leaves running ---------------------------------------


@agl.rollout
def threaded_agent(task: dict, prompt_template: agl.PromptTemplate) -> None:
    """Emitters and a plain OpenTelemetry span in threads that do not inherit the rollout's context."""

    def in_thread(value: float) -> None:
        agl.emit_reward(value)
        with opentelemetry.trace.get_tracer("lib").start_as_current_span(f"lib.call.{value}"):
            pass

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(in_thread, [0.1, 0.2]))

    async def grade() -> None:  # the tutorials' run_sync_ephemeral: asyncio.run in a fresh thread
        agl.emit_message("graded")

    worker = threading.Thread(target=lambda: asyncio.run(grade()))
    worker.start()
    worker.join()


async def test_spans_and_emitters_in_threads_the_agent_starts_are_recorded() -> None:
    """A thread does not inherit context variables: emitters there raised "No active tracer found" and
    OpenTelemetry spans were dropped without a mark (a reviewer). With one rollout running in the
    process they go to it, as 0.3.0's process-wide tracer does."""
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    with runner.run_context(agent=threaded_agent, store=store):
        done = await runner.step({"q": 1}, resources=RESOURCES)
    assert done.status == "succeeded"
    spans = await store.query_spans(done.rollout_id)
    assert sorted(agl.get_reward_value(s) for s in spans if agl.is_reward_span(s)) == [0.1, 0.2]
    names = {s.name for s in spans}
    assert {"lib.call.0.1", "lib.call.0.2", "agentlightning.message"} <= names


async def test_a_server_task_on_the_rollouts_event_loop_records_nothing_into_it() -> None:
    """An in-process server on the runner's event loop (the LLM proxy, a stand-in model) is not the
    agent: its request spans went into the rollout by the one-open-context rule of threads, so the
    framework examples' rollouts held the proxy's FastAPI spans and a second ChatCompletion copy
    (CI). Only the agent's own spans, and those of the threads it starts, are the rollout's."""
    go, served = asyncio.Event(), asyncio.Event()

    async def serve() -> None:  # started before the rollout, as a server is: no attempt in its context
        await go.wait()
        with opentelemetry.trace.get_tracer("server").start_as_current_span("server.request"):
            pass
        served.set()

    @agl.rollout
    async def agent(task: dict, prompt_template: agl.PromptTemplate) -> None:
        go.set()
        await served.wait()
        with opentelemetry.trace.get_tracer("lib").start_as_current_span("agent.step"):
            pass
        await asyncio.to_thread(threaded_agent, task, prompt_template)

    server = asyncio.create_task(serve())
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    with runner.run_context(agent=agent, store=store):
        done = await runner.step({"q": 1}, resources=RESOURCES)
    await server
    assert done.status == "succeeded"
    names = {s.name for s in await store.query_spans(done.rollout_id)}
    assert {"agent.step", "lib.call.0.1", "lib.call.0.2"} <= names
    assert "server.request" not in names


async def test_emitting_from_a_thread_with_several_rollouts_running_says_how_to_carry_the_context() -> None:
    tracer = agl.OtelTracer()
    tracer.init_worker(0, agl.InMemoryLightningStore())
    errors: list[str] = []

    def from_thread() -> None:
        try:
            agl.emit_reward(1.0)
        except RuntimeError as exc:
            errors.append(str(exc))

    async with tracer.trace_context("a"), tracer.trace_context("b"):
        await asyncio.to_thread(contextvars.Context().run, from_thread)  # a bare context: no rollout
    assert len(errors) == 1 and errors[0].startswith("No active tracer found. Cannot emit annotation span.")
    assert "contextvars.copy_context().run" in errors[0]


@agl.rollout
async def leaving_agent(task: dict, prompt_template: agl.PromptTemplate) -> None:
    async def late() -> None:
        await asyncio.sleep(0.2)
        agl.emit_reward(0.66)

    LEFT.append(asyncio.ensure_future(late()))


LEFT: list[asyncio.Future[None]] = []


async def test_a_span_ending_after_its_attempt_finished_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A task the agent leaves running emitted into a finished attempt: lost without a word (a
    reviewer). It is still not recorded (the attempt has ended), but the runner's log says so."""
    store = agl.InMemoryLightningStore()
    runner = agl.LitAgentRunner(agl.OtelTracer())
    with runner.run_context(agent=leaving_agent, store=store):
        done = await runner.step({"q": 1}, resources=RESOURCES)
    await asyncio.gather(*LEFT)
    assert list(await store.query_spans(done.rollout_id)) == []
    assert any("ended after the attempt finished" in r.getMessage() for r in caplog.records)


@agl.rollout
async def quiet_agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
    await asyncio.sleep(task["sleep_s"])  # a long LLM call: no span for a while
    return 1.0


async def test_the_runners_heartbeats_keep_a_quiet_attempt_alive() -> None:
    """With ``unresponsive_seconds`` set, an attempt busy without spans for longer was marked
    ``unresponsive`` (and, retried on it, run again beside itself) although its runner beat every
    ``heartbeat_interval`` (a reviewer): the heartbeats now stamp the runner's attempt too."""
    store = agl.InMemoryLightningStore(watchdog_interval_s=0.1)
    await store.add_resources(RESOURCES)
    # 1.5 s without a stamp against a beat every 0.2 s: a margin a loaded machine keeps (at 0.6 s a
    # late beat under the full suite let the watchdog mark it once, and the next beat revived it)
    config = agl.RolloutConfig(unresponsive_seconds=1.5, max_attempts=2, retry_condition=["unresponsive"])
    r = await store.enqueue_rollout({"sleep_s": 3.5}, config=config)
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=1, poll_interval=0.05, heartbeat_interval=0.2)
    seen: set[str] = set()

    async def watch() -> None:
        while True:
            seen.update(a.status for a in await store.query_attempts(r.rollout_id))
            await asyncio.sleep(0.05)

    watching = asyncio.create_task(watch())
    with runner.run_context(agent=quiet_agent, store=store):
        await asyncio.wait_for(runner.iter(), 20)
    watching.cancel()
    [done] = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=5)
    attempts = await store.query_attempts(r.rollout_id)
    assert done.status == "succeeded" and [a.status for a in attempts] == ["succeeded"]
    assert "unresponsive" not in seen and "running" not in seen  # no span: preparing until it succeeded


async def test_an_idle_runner_waits_quietly_then_runs_a_rollout_once(
    store: Any, runner_store: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """peer_failures C19: an empty queue is no error (nats-py's ``fetch`` raises ``TimeoutError``
    on one). On both backends, a runner that finds nothing for 1.5 s logs nothing, is ``idle``,
    polls by long polls (not a loop of empty answers) and uses next to no CPU; the one rollout
    then queued runs once."""
    import logging
    import time

    await store.add_resources(RESOURCES)
    polls: list[float] = []
    dequeue = runner_store.dequeue_rollout

    async def counted(*args: Any, **kwargs: Any) -> Any:
        polls.append(kwargs.get("wait_s", 0.0))
        return await dequeue(*args, **kwargs)

    monkeypatch.setattr(runner_store, "dequeue_rollout", counted)
    runs: list[Any] = []

    @agl.rollout
    def counting_agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
        runs.append(task)
        return 1.0

    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=1, poll_interval=0.5, heartbeat_interval=0.5)
    with caplog.at_level(logging.INFO), runner.run_context(agent=counting_agent, store=runner_store, worker_id=0):
        loop = asyncio.create_task(runner.iter())
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(1.5)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
        assert not loop.done() and 1 <= len(polls) <= 5 and all(w >= 0.5 for w in polls), polls
        await store.sync_all(timeout_s=10)
        assert (await store.get_worker_by_id(runner.get_worker_id())).status == "idle"
        r = await store.enqueue_rollout({"q": "once"})
        assert await asyncio.wait_for(loop, 10) == 1
    assert cpu < 0.25 * wall, f"{cpu:.2f} s of CPU in {wall:.2f} s idle"
    assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING] == []
    assert runs == [{"q": "once"}]
    [done] = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=10)
    assert done.status == "succeeded" and len(await store.query_attempts(r.rollout_id)) == 1


async def test_a_runner_cancelled_from_inside_records_why_on_its_attempt(store: Any, runner_store: Any) -> None:
    """peer_failures C06: a cancel that no Ctrl+C explains must stay visible (0.3.0 keeps its
    traceback for it, and hides the ones Ctrl+C causes). On both backends, a runner task cancelled
    from inside re-raises ``CancelledError`` and records its attempt ``failed`` with the reason,
    so the rollout is not left running for the watchdog to find."""
    from eventlight.core.types import STATUS_REASON
    from eventlight.runner.loop import CANCELLED

    await store.add_resources(RESOURCES)
    r = await store.enqueue_rollout({"sleep_s": 600})
    runner = agl.LitAgentRunner(agl.OtelTracer(), poll_interval=0.05, heartbeat_interval=0)
    with runner.run_context(agent=fault_agents.slow, store=runner_store, worker_id=0):
        task = asyncio.create_task(runner.iter())
        while (await store.get_rollout_by_id(r.rollout_id)).status == "queuing":  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    [done] = await store.wait_for_rollouts(rollout_ids=[r.rollout_id], timeout=10)
    assert done.status == "failed" and done.attempt.metadata[STATUS_REASON] == CANCELLED


@pytest.mark.parametrize("when", ["closing", "closed"])
async def test_a_runner_stopping_after_its_store_closed_does_not_warn(
    runner_store: Any, backend: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """A runner that stops while its store closes, or after it closed, skips its last heartbeat
    (nobody to tell) at DEBUG, with no "could not record that it stopped" warning; the store says
    so by ``closing``. (The in-memory store takes calls again once closed: its heartbeat is sent.)"""
    import logging

    @agl.rollout
    def agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
        return 1.0

    held, drain = asyncio.Event(), runner_store._drain_calls

    async def held_drain() -> None:  # the close stays in its drain until the runner has stopped
        await drain()
        await held.wait()

    monkeypatch.setattr(runner_store, "_drain_calls", held_drain)
    assert not runner_store.closing
    closing = asyncio.create_task(runner_store.close())
    await asyncio.sleep(0)
    if when == "closed":
        held.set()
        await closing
    refused = runner_store.closing
    stop = asyncio.Event()
    stop.set()  # the runner claims nothing: it only stops
    runner = agl.LitAgentRunner(agl.OtelTracer(), heartbeat_interval=0.5)
    with caplog.at_level(logging.DEBUG), runner.run_context(agent=agent, store=runner_store, worker_id=0):
        assert await runner.iter(event=stop) == 0
    held.set()
    await closing
    assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING] == []
    skipped = any("not recording that it stopped" in rec.getMessage() for rec in caplog.records)
    assert refused == skipped and refused == (when == "closing" or backend == "jetstream")


async def test_a_runner_stops_the_agent_of_a_cancelled_rollout_and_takes_the_next(
    store: Any, runner_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``update_rollout(status="cancelled")`` (what GRPO and APO do to late rollouts) left the
    runner's agent running to its end, holding the runner and its model. On both backends the
    runner now sees the cancel with a heartbeat, cancels its agent (which gets ``CancelledError``
    where it awaits), records the attempt ``failed`` with the reason in one INFO line, and claims
    the next rollout while the cancelled agent's event is still unset."""
    import logging

    from eventlight.core.types import STATUS_REASON

    await store.add_resources(RESOURCES)
    started, never = asyncio.Event(), asyncio.Event()
    seen: list[str] = []

    @agl.rollout
    async def agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
        seen.append(f"start {task['n']}")
        if task["n"] == 0:
            started.set()
            try:
                await never.wait()  # set by nobody: only a cancel ends it
            except asyncio.CancelledError:
                seen.append("cancelled 0")
                raise
        return 1.0

    first = await store.enqueue_rollout({"n": 0})
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=2, poll_interval=0.05, heartbeat_interval=0.05)
    with caplog.at_level(logging.INFO), runner.run_context(agent=agent, store=runner_store, worker_id=0):
        loop = asyncio.create_task(runner.iter())
        await asyncio.wait_for(started.wait(), 30)
        second = await store.enqueue_rollout({"n": 1})
        cancelled_by = {"pid": 1, "reason": "test: late"}
        await store.update_rollout(first.rollout_id, status="cancelled", metadata={"cancelled_by": cancelled_by})
        assert await asyncio.wait_for(loop, 30) == 2
    assert not never.is_set() and seen == ["start 0", "cancelled 0", "start 1"]
    [done] = await store.wait_for_rollouts(rollout_ids=[second.rollout_id], timeout=10)
    assert done.status == "succeeded"
    [cancelled] = await store.wait_for_rollouts(rollout_ids=[first.rollout_id], timeout=10)
    assert cancelled.status == "cancelled" and cancelled.metadata["cancelled_by"] == cancelled_by
    if hasattr(store, "sync_all"):
        await store.sync_all(timeout_s=10)
    [attempt] = await store.query_attempts(first.rollout_id)
    assert attempt.status == "failed" and attempt.metadata[STATUS_REASON].startswith("the rollout was cancelled")
    said = [r for r in caplog.records if r.name.startswith("eventlight") and "rollout was cancelled" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO] and first.rollout_id in said[0].getMessage()
    loud = [r.getMessage() for r in caplog.records if r.name.startswith("eventlight") and r.levelno >= logging.WARNING]
    assert loud == [] and not any(r.exc_info for r in caplog.records if r.name.startswith("eventlight"))


async def test_an_agent_that_fails_once_its_rollout_was_cancelled_is_no_error(
    store: Any, runner_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """At the end of a GRPO run the step cancels the rollouts it gave up on, then stops the policy
    server: each agent in flight got the server's 503 before its runner's next heartbeat saw the
    cancel, and each runner logged "agent raised … InternalServerError" with a traceback (8 of
    them). An agent that raises after its rollout was cancelled is now that cancel: one INFO line,
    the attempt failed with the cancel's reason, no error logged."""
    import logging

    from eventlight.core.types import STATUS_REASON

    await store.add_resources(RESOURCES)
    started, refused = asyncio.Event(), asyncio.Event()

    @agl.rollout
    async def agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
        started.set()
        await refused.wait()
        raise RuntimeError("Error code: 503 - the policy server stopped before this request's generation")

    first = await store.enqueue_rollout({"n": 0})
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=1, poll_interval=0.05, heartbeat_interval=3600)
    with caplog.at_level(logging.INFO), runner.run_context(agent=agent, store=runner_store, worker_id=0):
        loop = asyncio.create_task(runner.iter())
        await asyncio.wait_for(started.wait(), 30)
        await store.update_rollout(first.rollout_id, status="cancelled", metadata={"cancelled_by": {"pid": 1}})
        if hasattr(store, "sync_all"):
            await store.sync_all(timeout_s=10)
        refused.set()  # the server refuses its request before a heartbeat sees the cancel
        assert await asyncio.wait_for(loop, 30) == 1
    if hasattr(store, "sync_all"):
        await store.sync_all(timeout_s=10)
    [attempt] = await store.query_attempts(first.rollout_id)
    assert attempt.status == "failed" and attempt.metadata[STATUS_REASON].startswith("the rollout was cancelled")
    loud = [r.getMessage() for r in caplog.records if r.name.startswith("eventlight") and r.levelno >= logging.WARNING]
    assert loud == [] and not any(r.exc_info for r in caplog.records if r.name.startswith("eventlight"))


async def test_a_runner_stops_waiting_for_a_sync_agent_in_a_thread_whose_rollout_was_cancelled(
    store: Any, runner_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A synchronous agent in a thread (``sync_agent_in_thread``, as ``RunnerPool`` runs them)
    cannot be killed: the runner stops waiting for it, says so, takes the next rollout while the
    thread still blocks, and ignores what the thread returns later."""
    import logging

    from eventlight.core.types import STATUS_REASON

    await store.add_resources(RESOURCES)
    started, release, returned = threading.Event(), threading.Event(), threading.Event()
    seen: list[str] = []

    @agl.rollout
    def agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
        seen.append(f"start {task['n']}")
        if task["n"] == 0:
            started.set()
            release.wait()
            returned.set()
        return 1.0

    first = await store.enqueue_rollout({"n": 0})
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=2, poll_interval=0.05, heartbeat_interval=0.05)
    runner.sync_agent_in_thread = True
    try:
        with caplog.at_level(logging.INFO), runner.run_context(agent=agent, store=runner_store, worker_id=0):
            loop = asyncio.create_task(runner.iter())
            assert await asyncio.to_thread(started.wait, 30)
            second = await store.enqueue_rollout({"n": 1})
            await store.update_rollout(first.rollout_id, status="cancelled")
            assert await asyncio.wait_for(loop, 30) == 2
            assert not returned.is_set() and seen == ["start 0", "start 1"]  # the thread still blocks
    finally:
        release.set()
    assert await asyncio.to_thread(returned.wait, 30)
    [done] = await store.wait_for_rollouts(rollout_ids=[second.rollout_id], timeout=10)
    assert done.status == "succeeded"
    if hasattr(store, "sync_all"):
        await store.sync_all(timeout_s=10)
    [attempt] = await store.query_attempts(first.rollout_id)
    assert attempt.status == "failed" and attempt.metadata[STATUS_REASON].startswith("the rollout was cancelled")
    said = [r.getMessage() for r in caplog.records if "rollout was cancelled" in r.getMessage()]
    assert len(said) == 1 and "its thread cannot be stopped" in said[0]


async def test_rollout_cancelled_answers_from_the_log_on_a_runners_store(store: Any, runner_store: Any) -> None:
    """``rollout_cancelled`` (what the heartbeats ask) answers on a runner's store without Postgres,
    and sees a cancel written by another process's store."""
    await store.add_resources(RESOURCES)
    r = await store.enqueue_rollout({"n": 0})
    claimed = await runner_store.dequeue_rollout(worker_id="w-0")
    assert claimed is not None and claimed.rollout_id == r.rollout_id
    assert await runner_store.rollout_cancelled(r.rollout_id) is False
    await store.update_rollout(r.rollout_id, status="cancelled")
    assert await runner_store.rollout_cancelled(r.rollout_id) is True
    with pytest.raises(agl.RolloutNotFoundError):
        await runner_store.rollout_cancelled("ro-unknown")


async def test_a_rollout_requeued_after_its_cancel_stopped_the_agent_runs_again(store: Any, runner_store: Any) -> None:
    """A rollout cancelled under a runner and sent back to the queue (``update_rollout(status=
    "queuing")``) after the runner stopped its agent, before the runner recorded the attempt: the
    runner's ``failed`` (ROLLOUT_CANCELLED) is recorded on the attempt, and the rollout stays in
    the queue for its next run. It used to follow that attempt to ``failed``: the requeue was
    lost, the rollout ended without running again."""
    from eventlight.core.types import STATUS_REASON

    await store.add_resources(RESOURCES)
    started, never = asyncio.Event(), asyncio.Event()

    @agl.rollout
    async def agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
        if task["n"] == 0:
            started.set()
            await never.wait()  # only the cancel ends it
        return 1.0

    class Requeue(Hook):  # runs after the agent was stopped, before the attempt is recorded
        async def on_rollout_end(self, *, agent: Any, runner: Any, rollout: Any, spans: Any) -> None:
            if rollout.rollout_id == first.rollout_id:
                await store.update_rollout(first.rollout_id, status="queuing")

    first = await store.enqueue_rollout({"n": 0})
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=1, poll_interval=0.05, heartbeat_interval=0.05)
    with runner.run_context(agent=agent, store=runner_store, worker_id=0, hooks=[Requeue()]):
        loop = asyncio.create_task(runner.iter())
        await asyncio.wait_for(started.wait(), 30)
        await store.update_rollout(first.rollout_id, status="cancelled")
        assert await asyncio.wait_for(loop, 30) == 1
    if hasattr(store, "sync_all"):
        await store.sync_all(timeout_s=10)
    [attempt] = await store.query_attempts(first.rollout_id)
    assert attempt.status == "failed" and attempt.metadata[STATUS_REASON].startswith("the rollout was cancelled")
    assert (await store.get_rollout_by_id(first.rollout_id)).status == "queuing"
    again = await runner_store.dequeue_rollout(worker_id="w-2")
    assert again is not None and again.rollout_id == first.rollout_id and again.attempt.sequence_id == 2


async def test_a_rollout_cancelled_and_requeued_before_the_next_heartbeat_stops_the_old_agent(
    store: Any, runner_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancel, then requeue, between two heartbeats of the runner running the rollout: its next
    heartbeat took the requeued rollout back (0.3.0's revive rule) and its cancel check, asking
    about the rollout, said no: the agent of a cancelled run ran on as the rollout's run. Now the
    cancel records the attempt ``failed`` and the check asks about the attempt: the old agent is
    stopped, and the requeued rollout is claimed by a fresh attempt (here by the same runner)."""
    from eventlight.core.types import STATUS_REASON

    await store.add_resources(RESOURCES)
    started, never, beat = asyncio.Event(), asyncio.Event(), asyncio.Event()
    seen: list[str] = []

    @agl.rollout
    async def agent(task: dict, prompt_template: agl.PromptTemplate) -> float:
        seen.append("start")
        if len(seen) == 1:
            started.set()
            try:
                await never.wait()  # set by nobody: only a cancel ends it
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
        return 1.0

    update_attempt = runner_store.update_attempt

    async def beating(*args: Any, **kwargs: Any) -> Any:  # the runner's heartbeats, seen
        try:
            return await update_attempt(*args, **kwargs)
        finally:
            if "last_heartbeat_time" in kwargs:
                beat.set()

    monkeypatch.setattr(runner_store, "update_attempt", beating)
    first = await store.enqueue_rollout({"n": 0}, config=agl.RolloutConfig(unresponsive_seconds=600))
    runner = agl.LitAgentRunner(agl.OtelTracer(), max_rollouts=2, poll_interval=0.05, heartbeat_interval=1.0)
    with runner.run_context(agent=agent, store=runner_store, worker_id=0):
        loop = asyncio.create_task(runner.iter())
        await asyncio.wait_for(started.wait(), 30)
        beat.clear()
        await asyncio.wait_for(beat.wait(), 30)  # a heartbeat just went: the next is 1 s away
        await store.update_rollout(first.rollout_id, status="cancelled")
        await store.update_rollout(first.rollout_id, status="queuing")
        assert await asyncio.wait_for(loop, 30) == 2
    assert seen == ["start", "cancelled", "start"]
    [done] = await store.wait_for_rollouts(rollout_ids=[first.rollout_id], timeout=10)
    assert (done.status, done.attempt.sequence_id) == ("succeeded", 2)
    if hasattr(store, "sync_all"):
        await store.sync_all(timeout_s=10)
    old, new = await store.query_attempts(first.rollout_id)
    assert old.status == "failed" and old.metadata[STATUS_REASON].startswith("the rollout was cancelled")
    assert new.status == "succeeded"
