"""``Trainer`` takes Agent-lightning 0.3.0's execution strategies and runs them as queue consumers (issue 13).

Mappings tested: strategy specs (``None``, ``"shm"``, ``"cs"``, dicts, classes, instances, ``port``)
and the ``AGL_*`` variables; ``"shm"`` (runner threads on an in-memory store) with ``fit`` and
``dev``; ``"cs"`` role ``"both"`` with ``dev`` (runner processes); roles ``"algorithm"`` and
``"runner"`` as two processes sharing only the NATS URL, the Postgres DSN and the namespace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import eventlight as agl
from eventlight.core.errors import InvalidInputError, InvalidTypeError, WrongEventLoopError
from eventlight.core.types import STATUS_REASON
from eventlight.runner_pool import SIGTERM_REASON
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.trainer_strategies import resolve_strategy

ROOT = Path(__file__).resolve().parent.parent
ROLE_PROGRAM = ROOT / "tests" / "role_program.py"
TASKS = ["What's 1 + 1?", "What's the capital of France?", "Why is the sky blue?"]
PROMPT = agl.PromptTemplate(template="You are a helpful assistant. {any_question}", engine="f-string")


@agl.rollout
def score_length(task: str, prompt_template: agl.PromptTemplate) -> float:
    """A synchronous agent (as the tutorials write them): the reward says which task it got."""
    return float(len(prompt_template.format(any_question=task)))


# -- specs and environment variables -------------------------------------------------------------


def test_strategy_specs_resolve_as_in_agent_lightning(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AGL_CURRENT_ROLE", "AGL_MANAGED_STORE", "AGL_SERVER_HOST", "AGL_SERVER_PORT"):
        monkeypatch.delenv(name, raising=False)
    default = agl.Trainer(n_runners=3).strategy
    assert isinstance(default, agl.ClientServerExecutionStrategy)
    assert (default.n_runners, default.role, default.managed_store, default.server_port) == (3, "both", True, 4747)
    assert isinstance(agl.Trainer(strategy="shm").strategy, agl.SharedMemoryExecutionStrategy)
    shm = agl.Trainer(strategy={"type": "shm", "n_runners": 8, "main_thread": "algorithm"})
    assert shm.n_runners == 8 and isinstance(shm.strategy, agl.SharedMemoryExecutionStrategy)
    instance = agl.SharedMemoryExecutionStrategy(main_thread="algorithm", n_runners=4)
    trainer = agl.Trainer(n_runners=1, strategy=instance)
    assert trainer.strategy is instance and trainer.n_runners == 4
    cs = agl.Trainer(n_runners=8, strategy={"type": "cs", "server_port": 9999}).strategy
    assert isinstance(cs, agl.ClientServerExecutionStrategy) and (cs.server_port, cs.n_runners) == (9999, 8)
    assert resolve_strategy(agl.ClientServerExecutionStrategy, n_runners=2, port=1234).server_port == 1234  # type: ignore[attr-defined]
    assert resolve_strategy("cs", n_runners=2, port=99).n_runners == 2  # type: ignore[attr-defined]
    assert isinstance(
        resolve_strategy({"type": "eventlight.execution.SharedMemoryExecutionStrategy"}, n_runners=1),
        agl.SharedMemoryExecutionStrategy,
    )


def test_strategy_reads_agl_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGL_SERVER_PORT", "10000")
    monkeypatch.setenv("AGL_SERVER_HOST", "10.0.0.4")
    monkeypatch.setenv("AGL_CURRENT_ROLE", "algorithm")
    monkeypatch.setenv("AGL_MANAGED_STORE", "0")
    cs = agl.Trainer(n_runners=8, strategy="cs").strategy
    assert isinstance(cs, agl.ClientServerExecutionStrategy)
    assert (cs.role, cs.managed_store, cs.server_host, cs.server_port) == ("algorithm", False, "10.0.0.4", 10000)
    assert agl.ClientServerExecutionStrategy(role="runner").role == "runner"  # an argument wins
    assert agl.SharedMemoryExecutionStrategy().managed_store is False
    monkeypatch.setenv("AGL_CURRENT_ROLE", "boss")
    with pytest.raises(ValueError, match="role must be one of"):
        agl.Trainer(strategy="cs")
    monkeypatch.setenv("AGL_CURRENT_ROLE", "runner")
    with pytest.raises(ValueError, match="main_process='runner' requires role='both'"):
        agl.ClientServerExecutionStrategy(main_process="runner")


def test_bad_strategy_specs_raise() -> None:
    with pytest.raises(ValueError, match="n_runners must be 1"):
        agl.Trainer(n_runners=2, strategy="shm")  # the runner on the main thread: one runner (0.3.0)
    with pytest.raises(ValueError, match="needs a 'type'"):
        agl.Trainer(strategy={"n_runners": 2})
    with pytest.raises(TypeError, match="ExecutionStrategy"):
        agl.Trainer(strategy={"type": "eventlight.Baseline"})
    with pytest.raises(TypeError, match="FastAlgorithm"):
        agl.Trainer(algorithm=agl.APO(object())).dev(score_length, TASKS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot share a InMemoryLightningStore"):
        agl.Trainer(store=agl.InMemoryLightningStore(), algorithm=agl.Baseline()).fit(score_length, TASKS)


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_a_bad_n_runners_is_refused_at_construction(bad: Any) -> None:
    """``n_runners=0`` became 1, ``-2`` started no runner (the run hung; plain ``"shm"`` blamed
    ``main_thread``), ``1.5``, ``"2"`` and ``True`` were kept as given: each is refused now, from
    the trainer, a strategy spec or a strategy class."""
    error = InvalidTypeError if isinstance(bad, bool) or not isinstance(bad, int) else InvalidInputError
    for spec in (None, "cs", "shm", {"type": "shm", "main_thread": "algorithm"}):
        with pytest.raises(error, match=r"n_runners must be a whole number >= 1, got"):
            agl.Trainer(n_runners=bad, strategy=spec)
    for kind in ("shm", "cs"):
        with pytest.raises(error, match=r"n_runners must be a whole number >= 1, got"):
            agl.Trainer(
                strategy={"type": kind, "n_runners": bad, "main_thread": "algorithm"}
                if kind == "shm"
                else {"type": kind, "n_runners": bad}
            )
    with pytest.raises(error, match="n_runners"):
        agl.SharedMemoryExecutionStrategy(n_runners=bad, main_thread="algorithm")
    with pytest.raises(error, match="n_runners"):
        agl.ClientServerExecutionStrategy(n_runners=bad)


def test_n_runners_defaults_to_one_as_in_agent_lightning() -> None:
    assert agl.Trainer().n_runners == 1 and agl.Trainer(strategy="shm").n_runners == 1
    assert agl.Trainer(n_runners=None, strategy={"type": "shm", "main_thread": "algorithm"}).n_runners == 1


# -- shared memory -------------------------------------------------------------------------------


async def _rewards(store: Any) -> dict[str, float | None]:
    rollouts = await store.query_rollouts()
    out: dict[str, float | None] = {}
    for r in rollouts:
        assert r.status == "succeeded", (r.rollout_id, r.status)
        out[r.input] = agl.find_final_reward(list(await store.query_spans(r.rollout_id)))
    return out


def test_shm_dev_runs_baseline_on_runner_threads() -> None:
    store = agl.InMemoryLightningStore()
    trainer = agl.Trainer(
        strategy={"type": "shm", "n_runners": 2, "main_thread": "algorithm"},
        store=store,
        initial_resources={"prompt_template": PROMPT},
    )
    trainer.dev(score_length, TASKS)
    rewards = asyncio.run(_rewards(store))
    assert rewards == {t: float(len(PROMPT.format(any_question=t))) for t in TASKS}


class CountingRunner(agl.LitAgentRunner):
    """A runner subclass: which runner objects ran attempts, in which threads."""

    ran: set[tuple[int, str]] = set()

    async def _run_attempt(self, *args: Any, **kwargs: Any) -> Any:
        CountingRunner.ran.add((id(self.tracer), threading.current_thread().name))
        return await super()._run_attempt(*args, **kwargs)


def test_shm_threads_run_copies_of_the_runner_given() -> None:
    """Each thread ran a plain ``LitAgentRunner`` built from the template's tracer and a few settings:
    a subclass passed as ``runner=`` never ran, and the threads shared one tracer's last-trace state."""
    CountingRunner.ran = set()
    trainer = agl.Trainer(
        strategy={"type": "shm", "n_runners": 2, "main_thread": "algorithm"},
        runner=CountingRunner(agl.OtelTracer()),
        initial_resources={"prompt_template": PROMPT},
    )
    trainer.dev(score_length, TASKS * 4)
    threads = {name for _, name in CountingRunner.ran}
    tracers = {tracer for tracer, _ in CountingRunner.ran}
    assert threads and threads <= {"eventlight-runner-0", "eventlight-runner-1"}
    assert len(tracers) == len(threads)  # a tracer of its own per thread
    assert id(trainer.runner.tracer) not in tracers  # the template stays as given, for the next run


def test_shm_fit_with_an_algo_function_and_max_rollouts() -> None:
    seen: list[str] = []

    @agl.algo
    async def one_by_one(*, store: agl.LightningStore, train_dataset: Any = None, val_dataset: Any = None) -> None:
        await store.add_resources({"prompt_template": PROMPT})
        for task in train_dataset:
            rollout = await store.enqueue_rollout(input=task)
            [done] = await store.wait_for_rollouts(rollout_ids=[rollout.rollout_id], timeout=30)
            seen.append(done.status)

    store = agl.InMemoryLightningStore()
    agl.Trainer(algorithm=one_by_one, strategy="shm", max_rollouts=5, store=store).fit(score_length, TASKS)
    assert seen == ["succeeded"] * 3
    assert len(asyncio.run(_rewards(store))) == 3


def test_shm_trainer_store_is_usable_before_between_and_after_runs(caplog: pytest.LogCaptureFixture) -> None:
    """0.3.0 builds ``Trainer.store`` (``InMemoryLightningStore()``) in ``__init__``: it is there
    before ``fit``, stays readable after, and a second ``dev`` / ``fit`` runs on it (each run's
    ``LightningStoreThreaded`` wrapper was left as ``trainer.store``, closed, and the next run failed)."""
    trainer = agl.Trainer(
        algorithm=agl.Baseline(),
        strategy={"type": "shm", "n_runners": 2, "main_thread": "algorithm"},
        initial_resources={"prompt_template": PROMPT},
    )
    store = trainer.store
    assert isinstance(store, agl.InMemoryLightningStore)
    trainer.dev(score_length, TASKS[:1])
    assert trainer.store is store and len(asyncio.run(_rewards(store))) == 1
    with caplog.at_level(logging.WARNING, logger="eventlight.runner"):
        trainer.fit(score_length, TASKS[1:2], val_dataset=TASKS[2:])
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("eventlight.runner")]
    assert trainer.store is store
    assert asyncio.run(_rewards(store)) == {t: float(len(PROMPT.format(any_question=t))) for t in TASKS}


@pytest.mark.parametrize("main_thread", ["algorithm", "runner"])
def test_shm_stops_with_a_clear_error_once_its_runner_threads_stopped_and_rollouts_wait(main_thread: str) -> None:
    """One runner thread with ``max_rollouts=1`` and two tasks: it stops after the first rollout,
    and ``Baseline`` waited for the second for ever (no guard watched the threads). Now the
    trainer raises ``NoRunnersError`` as it does when its runner processes are gone."""
    trainer = agl.Trainer(
        strategy={"type": "shm", "main_thread": main_thread},
        n_runners=1,
        max_rollouts=1,
        initial_resources={"prompt_template": PROMPT},
    )
    outcome: list[BaseException | None] = []

    def dev() -> None:
        try:
            trainer.dev(score_length, TASKS[:2])
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=dev, daemon=True)  # a daemon: a hang fails the test, not the session
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "Trainer.dev still waits for a rollout no runner will take"
    [error] = outcome
    assert isinstance(error, agl.NoRunnersError), repr(error)
    assert "1 rollout(s) wait in the queue and no runner is alive" in str(error), str(error)
    assert "runner thread" in str(error) and "max_rollouts=1" in str(error), str(error)
    rollouts = asyncio.run(trainer.store.query_rollouts())
    assert sorted(r.status for r in rollouts) == ["cancelled", "succeeded"]  # the run's leftover, cancelled


async def test_shm_leaves_a_jetstream_store_the_user_opened_open(namespace: Settings) -> None:
    """Whoever opens a store closes it. A ``"shm"`` run started the ``JetStreamLightningStore`` the
    user had opened again, on its wrapper's loop (new connections over the user's), and closed it at
    its end: inside the user's ``async with`` the store was closed after ``fit``. Now its runner
    threads call it on its own loop, and it stays open for reads and another run; a store that was
    not open is opened by the run and closed by it."""
    async with JetStreamLightningStore(namespace, nats_url=namespace.nats_url, pg_dsn=namespace.pg_dsn) as store:
        nc = store.nc
        trainer = agl.Trainer(
            strategy={"type": "shm", "n_runners": 2, "main_thread": "algorithm"},
            store=store,
            initial_resources={"prompt_template": PROMPT},
        )
        with pytest.raises(RuntimeError, match="run it in a thread"):  # it would stop the store's loop
            trainer.dev(score_length, TASKS[:1])
        await asyncio.wait_for(asyncio.to_thread(trainer.dev, score_length, TASKS[:2]), 60)
        assert trainer.store is store and store.nc is nc and len(await _rewards(store)) == 2
        await asyncio.wait_for(asyncio.to_thread(trainer.dev, score_length, TASKS[2:]), 60)
        assert await _rewards(store) == {t: float(len(PROMPT.format(any_question=t))) for t in TASKS}
    closed = JetStreamLightningStore(namespace, nats_url=namespace.nats_url, pg_dsn=namespace.pg_dsn)
    trainer = agl.Trainer(strategy="shm", store=closed, initial_resources={"prompt_template": PROMPT})
    await asyncio.wait_for(asyncio.to_thread(trainer.dev, score_length, TASKS[:1]), 60)
    with pytest.raises(InvalidInputError, match="a closed store does not open again"):
        await closed.query_rollouts()


async def test_shm_refuses_a_store_open_on_a_loop_that_does_not_run(namespace: Settings) -> None:
    """Its calls would wait for ever; the run stops before it starts, naming the way out."""
    loop = asyncio.new_event_loop()
    store = JetStreamLightningStore(namespace, nats_url=namespace.nats_url, pg_dsn=namespace.pg_dsn)
    await asyncio.to_thread(loop.run_until_complete, store.start())
    try:
        trainer = agl.Trainer(strategy="shm", store=store, initial_resources={"prompt_template": PROMPT})
        with pytest.raises(WrongEventLoopError, match="open on an event loop that is not running"):
            await asyncio.wait_for(asyncio.to_thread(trainer.dev, score_length, TASKS[:1]), 30)
    finally:
        await asyncio.to_thread(loop.run_until_complete, store.close())
        loop.close()


# -- client-server -------------------------------------------------------------------------------


async def test_cs_dev_with_runner_processes(namespace: Settings) -> None:
    trainer = agl.Trainer(n_runners=1, initial_resources={"prompt_template": PROMPT}, settings=namespace)
    await asyncio.to_thread(trainer.dev, score_length, TASKS)
    # a second run on the same Trainer opens its own store (it reused the first run's, closed:
    # "this store is closed"; a reviewer)
    await asyncio.to_thread(trainer.dev, score_length, TASKS[:1])
    with pytest.raises(InvalidInputError, match="a closed store does not open again"):  # the run's, which it closed
        await trainer.store.query_rollouts()
    async with JetStreamLightningStore(namespace, nats_url=namespace.nats_url, pg_dsn=namespace.pg_dsn) as store:
        rewards = await _rewards(store)
        workers = {a.worker_id for r in await store.query_rollouts() for a in await store.query_attempts(r.rollout_id)}
        assert (await store.query_rollouts(status_in=["succeeded"])).total == len(TASKS) + 1
    assert rewards == {t: float(len(PROMPT.format(any_question=t))) for t in TASKS}
    assert all(w and w.startswith("Worker-0@") and f"-{os.getpid()}-" not in w for w in workers), workers


def _role_env(namespace: Settings, role: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGL_", "EVENTLIGHT_"))}
    assert namespace.nats_url is not None and namespace.pg_dsn is not None
    env.update(
        AGL_CURRENT_ROLE=role,
        AGL_MANAGED_STORE="0",
        EVENTLIGHT_NATS_URL=namespace.nats_url,
        EVENTLIGHT_PG_DSN=namespace.pg_dsn,
        EVENTLIGHT_NAMESPACE=namespace.namespace,
        PYTHONPATH=str(ROOT),
    )
    return env


async def _queued(namespace: Settings) -> list[str]:
    async with JetStreamLightningStore(namespace, nats_url=namespace.nats_url, pg_dsn=namespace.pg_dsn) as store:
        return [r.status for r in await store.query_rollouts()]


async def test_algorithm_and_runner_roles_as_separate_processes(namespace: Settings) -> None:
    run = [sys.executable, str(ROLE_PROGRAM), "--max-rollouts", str(len(TASKS))]
    algorithm = await asyncio.create_subprocess_exec(*run, env=_role_env(namespace, "algorithm"), cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while (statuses := await _queued(namespace)) != ["queuing"] * len(TASKS):
            assert time.monotonic() < deadline and algorithm.returncode is None, statuses
            await asyncio.sleep(0.3)
        await asyncio.sleep(2.0)  # the algorithm role started no runner: nothing is claimed
        assert await _queued(namespace) == ["queuing"] * len(TASKS)
        runner = await asyncio.create_subprocess_exec(*run, env=_role_env(namespace, "runner"), cwd=ROOT)
        assert await asyncio.wait_for(runner.wait(), 120) == 0  # it stops after its max_rollouts
        assert await asyncio.wait_for(algorithm.wait(), 60) == 0
    finally:
        if algorithm.returncode is None:
            algorithm.kill()
            await algorithm.wait()
    assert await _queued(namespace) == ["succeeded"] * len(TASKS)


async def test_a_trainer_whose_runners_die_at_start_stops_with_a_clear_error(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """peer_failures C07: its runner processes exit as they start and the pool keeps restarting
    them: rollouts wait with no live runner, and the trainer says so and stops instead of waiting
    for ever."""
    import eventlight.trainer_guards as guards
    from tests.fault_agents import DyingRunner

    monkeypatch.setattr(guards, "LIVE_HEARTBEAT_S", 2.0)
    monkeypatch.setattr(guards, "RUNNERS_CHECK_S", 0.5)
    runner = DyingRunner(agl.OtelTracer(), heartbeat_interval=0.5)
    trainer = agl.Trainer(n_runners=1, runner=runner, initial_resources={"prompt_template": PROMPT}, settings=namespace)
    with pytest.raises(agl.NoRunnersError, match=r"rollout\(s\) wait in the queue and no runner is alive") as info:
        await asyncio.wait_for(asyncio.to_thread(trainer.dev, score_length, TASKS), 120)
    assert "runner processes up" in str(info.value) and "restarts" in str(info.value)


@pytest.mark.parametrize("strategy", ["cs", "shm"])
async def test_a_trainer_whose_tracer_cannot_instrument_stops_before_any_runner_starts(
    namespace: Settings, monkeypatch: pytest.MonkeyPatch, strategy: str
) -> None:
    """peer_failures C07: the framework instrumentation a runner's tracer asks for is not installed.
    The run's runner processes died as they instrumented, over and over, and the algorithm waited
    until the no-runners guard gave up, the missing package named only in the runners' log. The
    trainer now checks before any runner starts and stops at once, naming it; nothing is enqueued."""
    from eventlight import instrumentation

    monkeypatch.setitem(instrumentation.FRAMEWORKS, "openai", ("no_such_module.x", "X", "no-such-package"))
    trainer = agl.Trainer(
        strategy=strategy,
        n_runners=1,
        tracer=agl.OtelTracer(instrument=["openai"]),
        initial_resources={"prompt_template": PROMPT},
        settings=namespace,
    )
    started = time.monotonic()
    with pytest.raises(InvalidInputError, match=r"instrumenting 'openai' needs no-such-package"):
        await asyncio.wait_for(asyncio.to_thread(trainer.dev, score_length, TASKS), 60)
    assert time.monotonic() - started < 10
    if strategy == "cs":
        assert await _queued(namespace) == []


async def test_a_run_cancelled_from_outside_stops_its_algorithm_with_it() -> None:
    """Ctrl+C cancels the trainer's task: the guard left the algorithm's task running, so it went on
    enqueueing while the store closed ("Task exception was never retrieved"; a reviewer)."""
    from eventlight.trainer_guards import _stop_when

    ticks: list[float] = []

    async def algorithm() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    async def never_gone() -> str:
        await asyncio.sleep(3600)
        return ""

    guarded = asyncio.create_task(_stop_when(algorithm(), never_gone))
    await asyncio.sleep(0.1)
    guarded.cancel()
    with pytest.raises(asyncio.CancelledError):
        await guarded
    stopped = len(ticks)
    await asyncio.sleep(0.1)
    assert len(ticks) == stopped  # nothing ran after the cancel


@agl.rollout
async def asks_the_llm(task: dict, llm: agl.LLM) -> float:
    """One chat completion through the LLM resource (the trainer's proxy), without retries."""
    import openai

    async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key="x", max_retries=0) as client:
        await client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task["q"]}])
    return 1.0


class ServesItsModel(agl.Algorithm):
    """As ``GRPO``: the model its rollouts call is a server that its ``run`` starts and stops (behind
    the trainer's LLM proxy); it answers after ``delay_s``."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.llm: Any = None
        self.stop_asked_at_end: bool | None = None

    async def run(self, train_dataset: Any = None, val_dataset: Any = None) -> None:
        from llm_stub import Reply, ScriptedLLM

        self.llm = ScriptedLLM(Reply(content="4", delay_s=self.delay_s))
        async with self.llm as url:
            proxy = self.get_llm_proxy()
            litellm_params = {"model": "openai/m", "api_base": url, "api_key": "x"}
            proxy.update_model_list([{"model_name": "m", "litellm_params": litellm_params}])
            store = self.get_store()
            await store.update_resources("r1", {"llm": proxy.as_resource(model="m")})
            made = await store.enqueue_many_rollouts(
                [agl.EnqueueRolloutRequest(input=t, resources_id="r1") for t in train_dataset]
            )
            try:
                await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made], timeout=600)
            finally:  # cancelled, or its rollouts ended (recorded failed by the runners' stop)
                self.stop_asked_at_end = self.stop_requested


async def test_a_cancelled_run_stops_its_runners_before_the_model_they_call(
    namespace: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Ctrl+C in ``make demo`` (a fresh user): the algorithm's policy server and the LLM proxy stopped
    first, so the agents' calls in flight failed and their attempts were recorded failed with
    ``APIConnectionError`` / ``InternalServerError: Error code: 500``, as if the model had failed (and
    uvicorn printed a traceback for each call it cut). The runners now stop first, while the model
    still answers: attempts in flight get the grace, then are recorded with the stop's reason. (peer_failures C06)"""
    algorithm = ServesItsModel(delay_s=30)
    trainer = agl.Trainer(
        algorithm=algorithm,
        strategy={"type": "cs", "n_runners": 1, "graceful_timeout": 1.0},
        llm_proxy=agl.LLMProxy(),
        check_llm=False,
        settings=namespace,
    )
    run = asyncio.create_task(trainer.fit_async(asks_the_llm, [{"q": "2 + 2?"}]))
    deadline = time.monotonic() + 60
    while algorithm.llm is None or not algorithm.llm.requests:  # the agent's call reached the model
        assert time.monotonic() < deadline and not run.done(), run
        await asyncio.sleep(0.1)
    with caplog.at_level(logging.WARNING, logger="eventlight.trainer"):
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
    async with JetStreamLightningStore(namespace, nats_url=namespace.nats_url, pg_dsn=namespace.pg_dsn) as store:
        await store.sync_all(timeout_s=10)
        [rollout] = await store.query_rollouts()
        attempts = await store.query_attempts(rollout.rollout_id)
    assert [(a.status, a.metadata.get(STATUS_REASON)) for a in attempts] == [("failed", SIGTERM_REASON)]
    assert any("stopping its 1 runner(s) first" in r.getMessage() for r in caplog.records), caplog.text
    assert algorithm.stop_asked_at_end  # asked before its end: it could start nothing new meanwhile


def test_ctrl_c_on_a_shm_run_stops_its_runner_threads_before_the_model_they_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``"shm"``: on Ctrl+C the algorithm (whose server the agent calls) and the LLM proxy stopped
    at once, and the runner threads only after the event loop had ended, so the agent's call in
    flight failed and its attempt was recorded with the agent's error (``InternalServerError``), as
    if the model had failed. The threads now stop first, as the runner processes of ``"cs"`` do:
    their attempts get ``graceful_delay`` while the model still answers, then are recorded failed
    with the stop's reason."""
    import os
    import signal

    from eventlight.trainer_strategies import THREAD_STOP_REASON

    store = agl.InMemoryLightningStore()
    algorithm = ServesItsModel(delay_s=30)
    trainer = agl.Trainer(
        algorithm=algorithm,
        strategy={"type": "shm", "n_runners": 1, "main_thread": "algorithm", "graceful_delay": 1.0},
        llm_proxy=agl.LLMProxy(),
        check_llm=False,
        store=store,
    )

    def ctrl_c_once_the_call_reached_the_model() -> None:
        deadline = time.monotonic() + 60
        while (algorithm.llm is None or not algorithm.llm.requests) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # asyncio.run's handler goes over it
    interrupter = threading.Thread(target=ctrl_c_once_the_call_reached_the_model, daemon=True)
    interrupter.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO), pytest.raises(KeyboardInterrupt):
        trainer.fit(asks_the_llm, [{"q": "2 + 2?"}, {"q": "3 + 3?"}])  # one runs, one waits
    interrupter.join(5)
    assert time.monotonic() - t0 < 25  # the grace, not the model's 30 s
    [claimed] = asyncio.run(store.query_rollouts(status_in=["failed", "requeuing"]))
    attempts = asyncio.run(store.query_attempts(claimed.rollout_id))
    assert [(a.status, a.metadata.get(STATUS_REASON)) for a in attempts] == [("failed", THREAD_STOP_REASON)]
    assert [r.status for r in asyncio.run(store.query_rollouts(status_in=["cancelled"]))] == ["cancelled"]
    assert any("stopping its 1 runner(s) first" in r.getMessage() for r in caplog.records), caplog.text
    assert algorithm.stop_asked_at_end
    ours = [r for r in caplog.records if r.name.startswith("eventlight") and r.levelno >= logging.ERROR]
    assert not ours, caplog.text  # no "stopping the run: ... runner threads have stopped" either


async def test_runners_stopped_on_purpose_are_not_gone() -> None:
    """The runner threads or processes a cancelled run stops first (rollouts still queued) are not
    "gone": the guard would raise ``NoRunnersError`` into the run while its cancel waits for them."""
    import types

    from eventlight.trainer_guards import _pool_gone, _threads_gone

    store = agl.InMemoryLightningStore()
    await store.enqueue_rollout(input="waits")
    threads: Any = types.SimpleNamespace(
        alive=lambda: 0, stopping=True, worker_ids=frozenset(), threads=[None], template=agl.LitAgentRunner()
    )
    pool: Any = types.SimpleNamespace(alive=lambda: 0, procs=[None], restarts=0, stopping=True)
    for gone in (_threads_gone(store, threads), _pool_gone(store, pool, 0.01)):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(gone, 1.5)
    threads.stopping = pool.stopping = False  # stopped on their own (max_rollouts, an error, dead): gone
    assert "1 rollout(s) wait" in await asyncio.wait_for(_threads_gone(store, threads), 5)
    assert "0 of 1 runner processes up" in await asyncio.wait_for(_pool_gone(store, pool, 0.01), 5)


@agl.rollout
async def sleeps_long(task: str, prompt_template: agl.PromptTemplate) -> float:
    await asyncio.sleep(60)
    return 1.0


def test_hurry_cuts_the_grace_of_a_runner_threads_stop_short() -> None:
    """A second Ctrl+C while ``"shm"``'s threads stop (``ctrl_c_again_hurries``) ends their grace at
    once: the attempt in flight is recorded failed with the stop's reason, and ``stop`` is idempotent."""
    from eventlight.store.threaded import LightningStoreThreaded
    from eventlight.trainer_strategies import THREAD_STOP_REASON, RunnerThreads

    store = LightningStoreThreaded(agl.InMemoryLightningStore())  # as "shm" shares it
    runner = agl.LitAgentRunner(agl.OtelTracer(), poll_interval=0.05, heartbeat_interval=0)
    threads = RunnerThreads(1, runner, sleeps_long, [], store)
    threads.hurry()  # before the stop: nothing
    asyncio.run(store.add_resources({"prompt_template": PROMPT}))
    rollout = asyncio.run(store.enqueue_rollout(input="t"))
    threads.start()
    try:
        deadline = time.monotonic() + 30
        while asyncio.run(store.query_rollouts(status_in=["preparing", "running"])).total == 0:
            assert time.monotonic() < deadline and threads.alive()
            time.sleep(0.05)
        stopping = threading.Thread(target=threads.stop, args=(60, 10))
        t0 = time.monotonic()
        stopping.start()
        while not threads.stopping:
            time.sleep(0.01)
        threads.hurry()
        stopping.join(30)
        assert not stopping.is_alive() and threads.stopped and not threads.alive()
        assert time.monotonic() - t0 < 15
        threads.stop(60, 10)  # stopped already: at once
        attempts = asyncio.run(store.query_attempts(rollout.rollout_id))
    finally:
        threads.stop(0, 10)
        asyncio.run(store.close())
    assert [(a.status, a.metadata.get(STATUS_REASON)) for a in attempts] == [("failed", THREAD_STOP_REASON)]


def test_ctrl_c_again_while_the_runners_stop_hurries_them_instead_of_breaking_into_the_loop() -> None:
    """A second Ctrl+C in ``make demo`` while the runners stopped: ``asyncio.run`` raised
    ``KeyboardInterrupt`` into its event loop, whose shutdown printed ~3,000 lines of tracebacks. The
    first Ctrl+C still goes to the handler in place (``asyncio.run``'s cancels the run); once the pool
    stops, another one cuts the runners' grace short instead."""
    import signal
    import types

    from eventlight.trainer_guards import ctrl_c_again_hurries

    seen: list[str] = []
    pool: Any = types.SimpleNamespace(stopping=False, hurry=lambda: seen.append("hurry"))
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append("previous"))
    try:
        mine = signal.getsignal(signal.SIGINT)
        with ctrl_c_again_hurries(pool):
            signal.raise_signal(signal.SIGINT)
            pool.stopping = True
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is mine  # restored
        with ctrl_c_again_hurries(None):  # no runner processes: nothing changes
            assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == ["previous", "hurry", "hurry"]


@agl.rollout
async def slow_agent(task: str, prompt_template: agl.PromptTemplate) -> float:
    await asyncio.sleep(0.5)
    return 1.0


@agl.algo
async def enqueue_then_fail(*, store: agl.LightningStore, train_dataset: Any = None, val_dataset: Any = None) -> None:
    await store.add_resources({"prompt_template": PROMPT})
    for task in train_dataset:
        await store.enqueue_rollout(input=task)
    for _ in range(200):  # until a runner has claimed one
        if (await store.query_rollouts(status_in=["running", "preparing"])).total:
            break
        await asyncio.sleep(0.05)
    raise RuntimeError("the algorithm failed")


def test_a_run_that_stops_early_cancels_what_it_left_in_the_queue() -> None:
    """A stopped run (Ctrl+C, its runners gone, its algorithm failing) left its queued rollouts
    ``queuing``: nothing would read them, and the next run's runners ran them first (a reviewer)."""
    trainer = agl.Trainer(
        algorithm=enqueue_then_fail, strategy={"type": "shm", "n_runners": 1, "main_thread": "algorithm"}
    )
    with pytest.raises(RuntimeError, match="the algorithm failed"):
        trainer.fit(slow_agent, [f"t{i}" for i in range(6)])
    rollouts = list(asyncio.run(trainer.store.query_rollouts()))
    statuses = sorted(r.status for r in rollouts)
    assert statuses.count("cancelled") >= 4 and "queuing" not in statuses, statuses
    assert set(statuses) <= {"cancelled", "succeeded", "failed", "running", "preparing"}
    # each says why, as the algorithms' cancels do (it had no metadata: a report said "no reason recorded")
    by = {str((r.metadata or {}).get("cancelled_by")) for r in rollouts if r.status == "cancelled"}
    assert by == {str({"pid": os.getpid(), "reason": "the run stopped early: RuntimeError: the algorithm failed"})}


async def test_the_queue_left_by_a_stopped_run_is_cancelled_with_its_reason_and_claimed_ones_kept() -> None:
    from eventlight.trainer_guards import cancel_left_in_queue, stopped_early_reason

    store = agl.InMemoryLightningStore()
    since = time.time() - 1
    queued = await store.enqueue_rollout("queued", metadata={"keep": 1})
    claimed = await store.enqueue_rollout("claimed")
    await store.update_rollout(claimed.rollout_id, status="running")
    reason = stopped_early_reason(KeyboardInterrupt())
    assert await cancel_left_in_queue(store, since, reason=reason) == 1
    after = {r.rollout_id: r for r in await store.query_rollouts()}
    assert after[claimed.rollout_id].status == "running"
    assert after[queued.rollout_id].status == "cancelled"
    assert after[queued.rollout_id].metadata == {"keep": 1, "cancelled_by": {"pid": os.getpid(), "reason": reason}}
    assert reason == "the run stopped early: it was cancelled (Ctrl+C?)"


async def test_a_cs_run_that_stops_early_cancels_what_it_left_in_the_queue(namespace: Settings) -> None:
    trainer = agl.Trainer(n_runners=1, algorithm=enqueue_then_fail, settings=namespace)
    with pytest.raises(RuntimeError, match="the algorithm failed"):
        await trainer.fit_async(slow_agent, [f"t{i}" for i in range(6)])
    async with JetStreamLightningStore(namespace, nats_url=namespace.nats_url, pg_dsn=namespace.pg_dsn) as store:
        await store.sync_all(timeout_s=10)
        statuses = sorted(r.status for r in await store.query_rollouts())
    assert statuses.count("cancelled") >= 4 and "queuing" not in statuses, statuses


async def test_baseline_stops_quietly_when_the_store_closes_under_its_wait() -> None:
    """``wait_for_rollouts`` answers what finished when the store closes: nothing, for the rollout
    ``Baseline`` waited on ("not enough values to unpack (expected 1, got 0)"; a reviewer)."""
    store = agl.InMemoryLightningStore()
    baseline = agl.Baseline()
    baseline.set_store(store)
    rollout = await store.enqueue_rollout("never claimed")
    harvest = asyncio.create_task(baseline._harvest(rollout.rollout_id))
    await asyncio.sleep(0.05)
    await store.close()
    assert await asyncio.wait_for(harvest, 5) is None
