"""``Trainer``: start the services, the runner processes and the algorithm, and wire them together.

``Trainer(algorithm=APO(...), n_runners=N).fit(agent, train, val)`` (Agent-lightning's entry point):

1. finds or starts NATS and Postgres and applies ``streams/`` and ``migrations/``
   (``eventlight.ops.prepare_services``);
2. starts ``n_runners`` runner processes (``spawn``); each opens a write-only
   ``JetStreamLightningStore`` (no Postgres connection) and consumes the rollout queue;
3. opens the algorithm's store, which runs the projector and the watchdog in this process;
4. starts the LLM proxy, if one is given, on that store;
5. runs the algorithm; when it returns (or fails, or Ctrl+C), stops the runners — first by their
   stop event, then SIGTERM (attempts still in flight are recorded ``failed``), then SIGKILL — and
   the servers it started itself. Until then a runner process that dies is restarted
   (``eventlight.runner_pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from eventlight.agent import LitAgent
from eventlight.algorithm.base import Algorithm
from eventlight.component import build_component
from eventlight.core.errors import LLMUnavailableError
from eventlight.ops import Services, prepare_services, stop_services
from eventlight.runner import Hook, LitAgentRunner
from eventlight.runner_pool import RunnerPool
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.tracer import OtelTracer, Tracer

if TYPE_CHECKING:
    from eventlight.llm_proxy import LLMProxy

log = logging.getLogger(__name__)


__all__ = ["Trainer", "build_component"]


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
        backends = sorted({str(e["litellm_params"].get("api_base") or "?") for e in proxy.model_list})
        where = f"{proxy.endpoint} (backend {', '.join(backends)})"
        raise LLMUnavailableError(where, f"{failing.result()}; the run was stopped, its results are void")
    finally:
        failing.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
