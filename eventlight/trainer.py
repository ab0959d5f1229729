"""``Trainer``: start the services, the runner processes and the algorithm, and wire them together.

``Trainer(algorithm=APO(...), n_runners=N).fit(agent, train, val)`` (Agent-lightning's entry point):

1. finds or starts NATS and Postgres and applies ``streams/`` and ``migrations/``
   (``eventlight.ops.prepare_services``);
2. starts ``n_runners`` runner processes (``spawn``); each opens a write-only
   ``JetStreamLightningStore`` (no Postgres connection) and consumes the rollout queue;
3. opens the algorithm's store, which runs the projector and the watchdog in this process;
4. starts the LLM proxy, if one is given, on that store;
5. runs the algorithm; when it returns (or fails, or Ctrl+C), stops the runners — first by their
   stop event, then SIGTERM, then SIGKILL — and the servers it started itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import signal
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from eventlight.agent import LitAgent
from eventlight.algorithm.base import Algorithm
from eventlight.core.errors import LLMUnavailableError
from eventlight.ops import Services, prepare_services, stop_services
from eventlight.runner import Hook, LitAgentRunner
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.tracer import OtelTracer, Tracer

if TYPE_CHECKING:
    from eventlight.llm_proxy import LLMProxy

log = logging.getLogger(__name__)

GRACEFUL_STOP_S = 10.0


def _runner_main(
    agent: LitAgent[Any],
    runner: LitAgentRunner,
    hooks: Sequence[Hook],
    settings: Settings,
    nats_url: str,
    worker_index: int,
    stop: Any,
    log_level: str,
) -> None:
    """Entry point of a runner process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown (peer failure C06)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [runner-%(process)d] %(name)s: %(message)s")

    async def run() -> None:
        async with JetStreamLightningStore(settings, nats_url=nats_url) as store:
            with runner.run_context(agent=agent, store=store, hooks=hooks, worker_id=worker_index):
                await runner.iter(event=stop)

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        asyncio.run(run())


class RunnerPool:
    """``n`` runner processes consuming one namespace's queue.

    Args:
        agent: The agent each process runs (pickled into the process).
        n: Number of processes.
        settings: Namespace to consume.
        nats_url: NATS server.
        runner: Template runner (copied into each process); defaults to ``LitAgentRunner(OtelTracer())``.
        hooks: Hooks every runner calls.
    """

    def __init__(
        self,
        agent: LitAgent[Any],
        n: int,
        settings: Settings,
        nats_url: str,
        *,
        runner: LitAgentRunner | None = None,
        hooks: Sequence[Hook] = (),
        log_level: str = "WARNING",
    ):
        if n < 1:
            raise ValueError(f"n_runners must be >= 1, got {n}")
        self.ctx = mp.get_context("spawn")
        self.stop_event = self.ctx.Event()
        self.procs = [
            self.ctx.Process(
                target=_runner_main,
                name=f"eventlight-runner-{i}",
                daemon=True,
                args=(
                    agent,
                    runner or LitAgentRunner(OtelTracer()),
                    tuple(hooks),
                    settings,
                    nats_url,
                    i,
                    self.stop_event,
                    log_level,
                ),
            )
            for i in range(n)
        ]

    def start(self) -> None:
        for p in self.procs:
            p.start()
        log.info("started %d runner processes", len(self.procs))

    def alive(self) -> int:
        return sum(p.is_alive() for p in self.procs)

    def stop(self, graceful_s: float = GRACEFUL_STOP_S) -> list[int | None]:
        """Stop the processes: stop event, then SIGTERM, then SIGKILL. Returns their exit codes."""
        self.stop_event.set()
        deadline = time.monotonic() + graceful_s  # one deadline for all, not one per process
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=3)
            if p.is_alive():
                p.kill()
                p.join(timeout=3)
        return [p.exitcode for p in self.procs]


class Trainer:
    """Runs an algorithm against runner processes on the event-sourced store.

    Args:
        algorithm: What improves the agent (``APO``, ``Baseline``, an ``@algo`` function).
        n_runners: Runner processes to start.
        initial_resources: Resources the algorithm starts from (e.g. a ``PromptTemplate``).
        adapter: Turns spans into what the algorithm learns from (default ``TracerTraceToTriplet``).
        llm_proxy: An ``LLMProxy`` to start on the algorithm's store.
        tracer: The runners' tracer (default ``OtelTracer()``).
        hooks: Runner hooks.
        settings: Namespace and services (default ``Settings.from_env()``).
        keep_services: Leave servers this trainer started running after ``fit`` (default: stop them).
        runner_log_level: Log level inside runner processes.
        check_llm: With an ``llm_proxy``: send one request through it before the first rollout and
            stop the run (``LLMUnavailableError``) when it fails or, later, when most recent calls
            fail (``LLMProxy.health``), rather than train on errors.
    """

    def __init__(
        self,
        *,
        algorithm: Algorithm | None = None,
        n_runners: int = 1,
        initial_resources: dict[str, Any] | None = None,
        adapter: Any = None,
        llm_proxy: Any = None,
        tracer: Tracer | None = None,
        hooks: Sequence[Hook] | Hook | None = None,
        settings: Settings | None = None,
        keep_services: bool = False,
        runner_log_level: str = "WARNING",
        check_llm: bool = True,
    ):
        from eventlight.adapter import TracerTraceToTriplet

        self.algorithm = algorithm
        self.n_runners = n_runners
        self.initial_resources = initial_resources
        self.adapter = adapter if adapter is not None else TracerTraceToTriplet()
        self.llm_proxy = llm_proxy
        self.tracer = tracer or OtelTracer()
        self.hooks: tuple[Hook, ...] = (hooks,) if isinstance(hooks, Hook) else tuple(hooks or ())
        self.settings = settings or Settings.from_env()
        self.keep_services = keep_services
        self.runner_log_level = runner_log_level
        self.check_llm = check_llm
        self.store: JetStreamLightningStore | None = None
        self.services: Services | None = None

    def fit(self, agent: LitAgent[Any], train_dataset: Any = None, *, val_dataset: Any = None) -> None:
        """Train ``agent``; blocks until the algorithm finishes.

        Raises:
            KeyboardInterrupt: After a clean shutdown, when interrupted.
            ServiceUnavailableError: NATS or Postgres could not be started or reached.
        """
        try:
            import uvloop

            uvloop.run(self.fit_async(agent, train_dataset, val_dataset=val_dataset))
        except ImportError:  # pragma: no cover
            asyncio.run(self.fit_async(agent, train_dataset, val_dataset=val_dataset))

    async def fit_async(self, agent: LitAgent[Any], train_dataset: Any = None, *, val_dataset: Any = None) -> None:
        """``fit`` for callers that already run an event loop."""
        agent.set_trainer(self)
        self.services = await prepare_services(self.settings)
        pool = RunnerPool(
            agent,
            self.n_runners,
            self.settings,
            self.services.nats_url,
            runner=LitAgentRunner(self.tracer),
            hooks=self.hooks,
            log_level=self.runner_log_level,
        )
        pool.start()
        try:
            async with JetStreamLightningStore(
                self.settings, nats_url=self.services.nats_url, pg_dsn=self.services.pg_dsn
            ) as store:
                self.store = store
                try:
                    await self._run_algorithm(store, train_dataset, val_dataset)
                finally:
                    await self._stop_runners(pool)
                    # leave complete read models behind: project what the runners wrote last
                    with contextlib.suppress(Exception):
                        await store.sync_all(timeout_s=30)
        finally:
            if pool.alive():
                await self._stop_runners(pool)
            if not self.keep_services and self.services.started:
                with contextlib.suppress(Exception):
                    await stop_services(self.settings)

    @staticmethod
    async def _stop_runners(pool: RunnerPool) -> None:
        codes = await asyncio.to_thread(pool.stop)
        bad = [c for c in codes if c not in (0, None, -signal.SIGTERM)]
        if bad:
            log.warning("runner processes exited with codes %s", codes)

    async def _run_algorithm(self, store: JetStreamLightningStore, train: Any, val: Any) -> None:
        algo = self.algorithm
        if algo is None:
            log.info("no algorithm: runners serve the queue until interrupted")
            await asyncio.Event().wait()
            return
        algo.set_trainer(self)
        algo.set_store(store)
        algo.set_adapter(self.adapter)
        if self.initial_resources is not None:
            algo.set_initial_resources(self.initial_resources)
        proxy = self.llm_proxy
        if proxy is not None:
            proxy.set_store(store)
            algo.set_llm_proxy(proxy)
            await proxy.start()
        try:
            if proxy is not None and self.check_llm:
                await proxy.check()
                proxy.health.reset()
            if algo.is_async():
                watched = proxy if self.check_llm else None
                await _stop_when_llm_fails(algo.run(train_dataset=train, val_dataset=val), watched)
            else:
                algo.run(train_dataset=train, val_dataset=val)
        finally:
            if proxy is not None:
                await proxy.stop()


async def _stop_when_llm_fails(run: Coroutine[Any, Any, Any], proxy: LLMProxy | None) -> None:
    """Await ``run``; cancel it and raise ``LLMUnavailableError`` once most calls through ``proxy`` fail."""
    if proxy is None:
        await run
        return
    task = asyncio.ensure_future(run)
    failing = asyncio.ensure_future(proxy.health.wait_failing())
    try:
        await asyncio.wait({task, failing}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            return
        log.error("stopping the run: %s", failing.result())
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise LLMUnavailableError(proxy.endpoint, f"{failing.result()}; the run was stopped")
    finally:
        failing.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
