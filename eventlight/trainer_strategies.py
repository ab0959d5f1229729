"""Where ``Trainer`` runs the algorithm and the runners: Agent-lightning 0.3.0's strategies as queue consumers.

``resolve_strategy`` turns what 0.3.0's ``Trainer(strategy=...)`` accepts (``None``, ``"shm"``,
``"cs"``, a dict with a ``"type"``, a class, an instance) into a strategy of
``eventlight.execution``; ``Trainer`` then places the two sides by it:

* ``ClientServerExecutionStrategy`` (the default, as in 0.3.0): ``role="both"`` starts
  ``n_runners`` runner processes (``RunnerPool``) on the namespace's JetStream queue and runs the
  algorithm in this process; ``"algorithm"`` runs only the algorithm; ``"runner"`` only the runner
  processes (``serve_runner_role``), until each finished ``max_rollouts`` or until Ctrl+C / SIGTERM.
  The sides meet through NATS and Postgres (``EVENTLIGHT_NATS_URL``, ``EVENTLIGHT_PG_DSN``,
  ``EVENTLIGHT_NAMESPACE``), on one machine or several;
* ``SharedMemoryExecutionStrategy``: ``run_shared_memory`` runs the algorithm on this thread and
  ``n_runners`` runner threads (``RunnerThreads``), each with its own event loop, on one store.
  Stopped, they take no new rollout, their attempts in flight get ``graceful_delay`` seconds (as in
  0.3.0), then are cancelled and recorded ``failed`` (``THREAD_STOP_REASON``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import signal
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any

from eventlight import instrumentation
from eventlight.agent import LitAgent
from eventlight.component import build_component, import_path
from eventlight.execution import (
    ClientServerExecutionStrategy,
    ExecutionStrategy,
    ExecutionStrategyRegistry,
    SharedMemoryExecutionStrategy,
)
from eventlight.runner import Hook, LitAgentRunner, worker_name
from eventlight.runner_pool import RunnerPool
from eventlight.store.threaded import LightningStoreThreaded
from eventlight.tracer import OtelTracer

log = logging.getLogger(__name__)

__all__ = [
    "THREAD_STOP_REASON",
    "RunnerThreads",
    "resolve_strategy",
    "run_event_loop",
    "run_shared_memory",
    "serve_runner_role",
    "shared_store",
    "wait_for_pool",
]

POOL_CHECK_S = 0.5
THREAD_STOP_REASON = "the runner thread stopped (its run ended) while the attempt ran"
"""The ``eventlight.status_reason`` of an attempt a ``"shm"`` runner thread was still running at the
end of its stop's grace (``RunnerThreads.stop``)."""


def resolve_strategy(spec: Any, *, n_runners: int, port: int | None = None) -> ExecutionStrategy:
    """The strategy ``spec`` names, built as 0.3.0's ``Trainer._make_strategy`` does.

    ``n_runners`` (and ``port`` as ``server_port``) fill in what a string or dict spec leaves out;
    an instance is returned as it is (``port`` then overrides its ``server_port``).

    Raises:
        TypeError: ``spec`` gives something that is not an ``ExecutionStrategy``.
        ValueError: An invalid setting (see the strategy classes).
    """
    if isinstance(spec, ExecutionStrategy):
        if port is not None and isinstance(spec, ClientServerExecutionStrategy):
            spec.server_port = port
        return spec
    defaults: dict[str, Any] = {"n_runners": n_runners}
    if port is not None:
        defaults["server_port"] = port
    if spec is None:
        return ClientServerExecutionStrategy(**defaults)
    if isinstance(spec, str | type):
        spec = {"type": spec}
    if not isinstance(spec, dict):
        built = build_component(spec, expected_type=ExecutionStrategy, spec_name="strategy")
        assert built is not None
        return built
    kind = spec.get("type")
    if kind is None:
        raise ValueError("strategy: a dict spec needs a 'type' ('shm', 'cs' or a class)")
    cls = import_path(ExecutionStrategyRegistry.get(kind, kind)) if isinstance(kind, str) else kind
    if not (isinstance(cls, type) and issubclass(cls, ExecutionStrategy)):
        raise TypeError(f"strategy must name an ExecutionStrategy, got {kind!r}")
    if not issubclass(cls, ClientServerExecutionStrategy):
        defaults.pop("server_port", None)
    return cls(**{**defaults, **{k: v for k, v in spec.items() if k != "type"}})


def run_event_loop(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` to its end on a new event loop (uvloop where installed)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        asyncio.run(coro)
        return
    uvloop.run(coro)


# -- client-server: the runner role -------------------------------------------------------------


async def wait_for_pool(pool: RunnerPool, stop: asyncio.Event | None = None) -> None:
    """Return once every process of ``pool`` finished its ``max_rollouts``, or ``stop`` is set."""
    while not pool.finished() and not (stop is not None and stop.is_set()):
        if stop is None:
            await asyncio.sleep(POOL_CHECK_S)
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POOL_CHECK_S)


async def serve_runner_role(pool: RunnerPool) -> None:
    """Role ``"runner"``: keep ``pool``'s processes consuming until they finish or SIGTERM / Ctrl+C.

    The caller stops the pool afterwards (attempts still in flight are recorded ``failed``).
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
        loop.add_signal_handler(signal.SIGTERM, stop.set)
    procs = len(pool.procs)
    log.info(
        "runner role: %d runners in %d process%s consume the queue", pool.n_runners, procs, "es" if procs != 1 else ""
    )
    try:
        await wait_for_pool(pool, stop)
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGTERM)


# -- shared memory ------------------------------------------------------------------------------


def _runner_copy(template: LitAgentRunner, index: int) -> LitAgentRunner:
    """Thread ``index``'s runner: a deep copy of ``template`` (its class, settings and tracer; a
    plain ``LitAgentRunner`` with the template's tracer before, which dropped a subclass and let the
    threads' attempts share the tracer's last-trace state), sharing the template's ``RunnerMetrics``.
    Only the first copy's tracer instruments frameworks (instrumentation is process-wide). A tracer
    that cannot be copied (an initialized provider) is shared, as before."""
    memo: dict[int, Any] = {} if template.metrics is None else {id(template.metrics): template.metrics}
    try:
        runner = copy.deepcopy(template, dict(memo))
    except TypeError:
        runner = copy.deepcopy(template, {**memo, id(template.tracer): template.tracer})
    if index > 0 and isinstance(runner.tracer, OtelTracer) and runner.tracer is not template.tracer:
        runner.tracer.instrumented = instrumentation.Instrumented(())
    return runner


class RunnerThreads:
    """The runner threads of ``"shm"``: ``n`` copies of ``template``, each on its own event loop, on ``store``.

    Args:
        n: Threads (``Worker-0`` .. ``Worker-<n-1>`` of this process, ``worker_name``).
        template: The runner whose tracer and settings each copy takes.
        agent, hooks: What each copy runs.
        store: The store they share (``shared_store``).

    Attributes:
        worker_ids: The worker ids the threads' runners use in the store.
    """

    def __init__(
        self, n: int, template: LitAgentRunner, agent: LitAgent[Any], hooks: Sequence[Hook], store: Any
    ) -> None:
        self.template = template
        self.stop_event = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(agent, hooks, store, i), name=f"eventlight-runner-{i}")
            for i in range(n)
        ]
        self.worker_ids = frozenset(worker_name(i) for i in range(n))
        self._running: dict[int, tuple[LitAgentRunner, asyncio.AbstractEventLoop, asyncio.Task[Any]]] = {}
        self._hurried = threading.Event()  # hurry(): the grace of a stop under way ends now
        self._stop_lock = threading.Lock()  # one stop at a time; a later one finds it done
        self._stopped = False

    def _run(self, agent: LitAgent[Any], hooks: Sequence[Hook], store: Any, index: int) -> None:
        runner = _runner_copy(self.template, index)

        async def main() -> None:
            task = asyncio.current_task()
            assert task is not None
            self._running[index] = (runner, asyncio.get_running_loop(), task)
            try:
                with runner.run_context(agent=agent, store=store, hooks=hooks, worker_id=index):
                    await runner.iter(event=self.stop_event)
            finally:
                self._running.pop(index, None)

        try:
            run_event_loop(main())
        except asyncio.CancelledError:  # cut by stop(): the runner recorded its attempt failed
            pass
        except Exception:
            log.exception("runner thread %d failed", index)

    def start(self) -> None:
        for t in self.threads:
            t.start()
        log.info("shared memory: %d runner threads", len(self.threads))

    def alive(self) -> int:
        """Threads still running (one that stopped, at its ``max_rollouts`` or on an error, is gone for good)."""
        return sum(t.is_alive() for t in self.threads)

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` has been called (it may still wait for the threads)."""
        return self.stop_event.is_set()

    @property
    def stopped(self) -> bool:
        """Whether ``stop`` has ended."""
        return self._stopped

    def join(self) -> None:
        """Wait until every thread stopped on its own."""
        for t in self.threads:
            t.join()

    def hurry(self) -> None:
        """End the grace of a ``stop`` under way now: the attempts in flight are cancelled and recorded
        ``failed`` at once. Nothing before ``stop`` or after it; safe from a signal handler (a second
        Ctrl+C) while ``stop`` runs in another thread."""
        if self.stopping and not self._stopped and not self._hurried.is_set():
            log.warning("stopping the runner threads now: their attempts in flight are recorded failed")
            self._hurried.set()

    def stop(self, graceful_s: float, join_timeout_s: float) -> None:
        """Stop the threads: no new rollout from now on; the attempts in flight get ``graceful_s``
        seconds to finish (``hurry`` ends that at once), then those still running are cancelled and
        recorded ``failed`` (``THREAD_STOP_REASON``); then wait up to ``join_timeout_s`` in all for
        the threads to end (a warning names one that does not: an agent blocking its event loop).
        Idempotent: a later call (or one from another thread meanwhile) waits for the first to end."""
        with self._stop_lock:
            if not self._stopped:
                self._stop(graceful_s, join_timeout_s)
                self._stopped = True

    def _stop(self, graceful_s: float, join_timeout_s: float) -> None:
        self.stop_event.set()
        deadline = time.monotonic() + graceful_s
        while self.alive() and time.monotonic() < deadline:
            if self._hurried.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
                break
        running = [(i, *self._running[i]) for i in sorted(self._running) if self.threads[i].is_alive()]
        if running:
            log.info(
                "runner thread(s) %s still ran an attempt %.0f s after the stop: recording it failed",
                ", ".join(str(i) for i, *_ in running), graceful_s,
            )  # fmt: skip
        for _, runner, loop, task in running:
            runner.cancel_reason = THREAD_STOP_REASON
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile: the thread ended
                loop.call_soon_threadsafe(task.cancel)
        deadline = time.monotonic() + join_timeout_s
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                log.warning("runner thread %s still running %.0f s after its stop", t.name, graceful_s + join_timeout_s)


def run_shared_memory(
    strategy: SharedMemoryExecutionStrategy, threads: RunnerThreads, algorithm: Coroutine[Any, Any, None] | None
) -> None:
    """``"shm"``: start ``threads`` and run ``algorithm`` on this thread.

    ``algorithm`` is a coroutine function's call on the store the threads share (``None``: the
    runners work until each finished ``max_rollouts``, or Ctrl+C). When it ends, or fails, the
    threads are stopped (``RunnerThreads.stop``: ``strategy.graceful_delay``, then
    ``strategy.join_timeout``) unless ``algorithm`` stopped them already.
    """
    threads.start()
    try:
        if algorithm is not None:
            run_event_loop(algorithm)
        else:
            threads.join()
    finally:
        if algorithm is not None:
            algorithm.close()  # never awaited if the loop failed to start: no warning
        threads.stop(strategy.graceful_delay, strategy.join_timeout)


def shared_store(strategy: SharedMemoryExecutionStrategy, store: Any) -> Any:
    """``store`` as the threads of ``"shm"`` share it: in ``LightningStoreThreaded`` when managed."""
    if strategy.managed_store and not isinstance(store, LightningStoreThreaded):
        return LightningStoreThreaded(store)
    return store
