"""``Trainer``: start the services, the runners and the algorithm, and wire them together.

``Trainer(algorithm=APO(...), n_runners=N).fit(agent, train, val)`` (Agent-lightning's entry point).
Under the default strategy (``"cs"``, ``ClientServerExecutionStrategy``, role ``"both"``) it:

1. finds or starts NATS and Postgres and applies ``streams/`` and ``migrations/``
   (``eventlight.ops.use_services``, ``prepare_services`` with ``keep_services``; not with
   ``managed_store`` false or a given store);
2. starts ``n_runners`` runner processes (forked from a ``forkserver`` that imported the runner
   once, ``spawn`` without one; ``eventlight.runner_pool``); each opens a write-only
   ``JetStreamLightningStore`` (no Postgres connection) and consumes the rollout queue;
3. opens the algorithm's store, which runs the projector and the watchdog in this process;
4. starts the LLM proxy, if one is given, on that store;
5. runs the algorithm; when it returns (or fails) stops the runners — first by their stop event,
   then SIGTERM (attempts still in flight are recorded ``failed``), then SIGKILL — then the LLM
   proxy (the runners' agents call it: they stop first); on Ctrl+C (the run cancelled) it stops
   the runners before the algorithm, which goes on serving its model meanwhile
   (``trainer_guards.stop_runners_first``), so an attempt cut short is recorded with the stop's
   reason, not with its agent's connection error (Ctrl+C again: at once,
   ``trainer_guards.ctrl_c_again_hurries``). Last, the servers it started itself, unless someone
   else still uses them (another run, ``eventlight runner`` or ``serve``: the last of them stops
   them) or ``eventlight up`` used them meanwhile (they run until ``eventlight down``). Until then
   a runner process that dies is restarted (``eventlight.runner_pool``).

Role ``"algorithm"`` (``AGL_CURRENT_ROLE=algorithm``) skips step 2, role ``"runner"`` does only
steps 1–2 and waits; ``"shm"`` runs runner threads on one store in this process instead
(``eventlight.trainer_strategies``), stopped in the same order: before the LLM proxy, and on Ctrl+C
before the algorithm (their attempts in flight get ``graceful_delay``). ``dev`` is ``fit`` with a
``FastAlgorithm`` (``Baseline`` by default), as in 0.3.0.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from eventlight import instrumentation
from eventlight.agent import LitAgent
from eventlight.algorithm.base import Algorithm, FastAlgorithm
from eventlight.algorithm.baseline import Baseline
from eventlight.component import build_component
from eventlight.core.types import RolloutConfig
from eventlight.execution import (
    ClientServerExecutionStrategy,
    ExecutionStrategy,
    SharedMemoryExecutionStrategy,
    check_n_runners,
)
from eventlight.ops import Services, apply_migrations, apply_streams, prepare_services, use_services
from eventlight.runner import Hook, LitAgentRunner
from eventlight.runner_pool import RunnerPool, check_runners_per_process
from eventlight.settings import Settings
from eventlight.store.base import LightningStore
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.store.jetstream.connect import connect_nats
from eventlight.store.validate import check_rollout_config
from eventlight.tracer import OtelTracer, Tracer
from eventlight.trainer_guards import (
    cancel_left_in_queue,
    ctrl_c_again_hurries,
    refuse_running_loop,
    refuse_unguarded_main,
    stop_runners_first,
    stop_signal_name,
    stop_when_llm_fails,
    stop_when_runners_gone,
    stopped_early_reason,
)
from eventlight.trainer_strategies import (
    RunnerThreads,
    resolve_strategy,
    run_event_loop,
    run_shared_memory,
    serve_runner_role,
    shared_store,
    wait_for_pool,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


__all__ = ["Trainer", "build_component"]


class Trainer:
    """Runs an algorithm against runners on the event-sourced store.

    Args (Agent-lightning 0.3.0's, unless marked eventlight's):
        algorithm: What improves the agent (``APO``, ``Baseline``, an ``@algo`` function), or a
            component spec (class, import path, ``{"type": ..., **kwargs}``).
        n_runners: Runners to start, a whole number >= 1 (default 1; a strategy instance's own
            ``n_runners`` wins).
        max_rollouts: Rollouts each runner takes before it stops (``None``: until stopped).
        initial_resources: Resources the algorithm starts from (e.g. a ``PromptTemplate``).
        adapter: Turns spans into what the algorithm learns from (default ``TracerTraceToTriplet``;
            a dict is its keyword arguments, as in 0.3.0).
        store: Whoever opens a store closes it: a store open when the run starts is used and left
            open; one that is not is opened by the run and closed at its end (a closed
            ``JetStreamLightningStore`` does not open again). ``"cs"``: a ``JetStreamLightningStore``
            whose namespace and servers every side uses (an open one: call ``fit_async`` on its
            loop). Default: the namespace's, opened and closed by each ``fit`` / ``dev``; afterwards
            ``trainer.store`` is the last run's, closed, and a call on it raises
            ``InvalidInputError`` ("this store is closed ..."): read the run with a store of your
            own on ``trainer.settings`` (while the servers run: ``keep_services``).
            ``"shm"``: any store (default ``InMemoryLightningStore()``, built here as in 0.3.0, so
            ``trainer.store`` is there before ``fit``), shared through a ``LightningStoreThreaded``:
            it opens a store that is not open on a loop of its own and closes it at the run's end
            (an in-memory store stays readable and writable, and the next run starts it again); a
            ``JetStreamLightningStore`` open on a running loop (inside ``async with store:``,
            ``await asyncio.to_thread(trainer.fit, ...)``) is called on that loop and left open.
        runner: A ``LitAgentRunner`` used as the template of every runner.
        strategy: ``"cs"`` (default), ``"shm"``, a dict with a ``"type"``, or a strategy of
            ``eventlight.execution``; ``AGL_CURRENT_ROLE``, ``AGL_MANAGED_STORE``,
            ``AGL_SERVER_HOST``/``AGL_SERVER_PORT`` are read as in 0.3.0.
        port: 0.3.0's store server port (``server_port`` of a ``"cs"`` strategy); unused.
        llm_proxy: An ``LLMProxy`` to start on the algorithm's store; with a ``token``, the runner gets it as
            ``proxy_token`` (unless it has one), so agents reach the proxy with it as ``api_key``.
        tracer: The runners' tracer (default ``OtelTracer()``).
        hooks: Runner hooks.
        settings: eventlight's: namespace and services (default ``Settings.from_env()``).
        keep_services: eventlight's: leave the servers running after ``fit`` until ``eventlight
            down``, as ``eventlight up`` does. Without it, the embedded servers a run started are
            stopped at its end, unless another process still uses them (another ``Trainer``,
            ``eventlight runner``, ``eventlight serve``: the last of them stops them) or
            ``eventlight up`` used them meanwhile (``eventlight.ops.use_services``).
        runner_log_level: eventlight's: log level inside runner processes.
        check_llm: eventlight's: with an ``llm_proxy``, send one request through it before the first
            rollout and stop the run (``LLMUnavailableError``) when it fails or, later, when most
            recent calls fail (``LLMProxy.health``), rather than train on errors.
        rollout_config: eventlight's: the ``RolloutConfig`` (or a dict of its fields:
            ``timeout_seconds``, ``unresponsive_seconds``, ``max_attempts``, ``retry_condition``) of
            every rollout the algorithm enqueues without its own.
        runners_per_process: eventlight's: runners that share one runner process (``"cs"``; default
            1, one process per runner as in 0.3.0). ``RunnerPool``'s: fewer processes, less memory,
            and their commands share atomic batches; a synchronous agent then runs in a thread.

    Raises:
        InvalidTypeError: ``n_runners`` (the trainer's or the strategy's) is not an ``int``.
        InvalidInputError: ``n_runners`` is below 1.
        TypeError, ValueError: A spec that builds the wrong thing, or invalid strategy settings.
    """

    def __init__(
        self,
        *,
        algorithm: Any = None,
        n_runners: int | None = None,
        max_rollouts: int | None = None,
        initial_resources: dict[str, Any] | None = None,
        adapter: Any = None,
        store: Any = None,
        runner: LitAgentRunner | None = None,
        strategy: Any = None,
        port: int | None = None,
        llm_proxy: Any = None,
        tracer: Tracer | None = None,
        hooks: Sequence[Hook] | Hook | None = None,
        settings: Settings | None = None,
        keep_services: bool = False,
        runner_log_level: str = "WARNING",
        check_llm: bool = True,
        rollout_config: RolloutConfig | Mapping[str, Any] | None = None,
        runners_per_process: int = 1,
    ):
        from eventlight.adapter import TraceAdapter, TracerTraceToTriplet

        self.algorithm = build_component(algorithm, expected_type=Algorithm, spec_name="algorithm", allow_none=True)
        n = 1 if n_runners is None else check_n_runners(n_runners)
        self.strategy: ExecutionStrategy = resolve_strategy(strategy, n_runners=n, port=port)
        self.n_runners: int = check_n_runners(getattr(self.strategy, "n_runners", n))  # the strategy's wins
        self.runners_per_process = check_runners_per_process(runners_per_process)
        if runners_per_process != 1 and isinstance(self.strategy, SharedMemoryExecutionStrategy):
            raise ValueError("runners_per_process applies to runner processes (strategy 'cs'), not to 'shm' threads")
        self.max_rollouts = max_rollouts
        self.initial_resources = initial_resources
        self.adapter: Any = build_component(
            adapter,
            expected_type=TraceAdapter,
            spec_name="adapter",
            default_factory=TracerTraceToTriplet,
            dict_requires_type=False,
            dict_default_cls=TracerTraceToTriplet,
        )
        self.llm_proxy = llm_proxy
        self.tracer = tracer or (runner.tracer if runner is not None else OtelTracer())
        self.runner = runner or LitAgentRunner(self.tracer, max_rollouts=max_rollouts)
        if getattr(llm_proxy, "token", None) and self.runner.proxy_token is None:
            self.runner.proxy_token = llm_proxy.token  # its agents' ProxyLLM carry it as api_key
        if max_rollouts is not None:
            self.runner.max_rollouts = max_rollouts
        self.hooks: tuple[Hook, ...] = (hooks,) if isinstance(hooks, Hook) else tuple(hooks or ())
        self.settings = settings or (
            store.settings if isinstance(store, JetStreamLightningStore) else Settings.from_env()
        )
        self.keep_services = keep_services
        self.runner_log_level = runner_log_level
        self.check_llm = check_llm
        self.rollout_config = check_rollout_config(rollout_config)
        self.store: Any = store
        self._given_store = store  # "cs": each fit opens its own store on the namespace unless one was given
        if store is None and isinstance(self.strategy, SharedMemoryExecutionStrategy):
            from eventlight.store.memory import InMemoryLightningStore

            self.store = InMemoryLightningStore()  # 0.3.0's default, there from construction
        self.services: Services | None = None

    def fit(self, agent: LitAgent[Any], train_dataset: Any = None, *, val_dataset: Any = None) -> None:
        """Train ``agent``; blocks until the algorithm finishes (role ``"runner"``: the runners).

        Raises:
            KeyboardInterrupt: After a clean shutdown, when interrupted.
            InvalidInputError: The runners' tracer instruments a framework whose instrumentation
                package is missing here (``OtelTracer(instrument=...)``); nothing was started.
            ServiceUnavailableError: NATS or Postgres could not be started or reached.
            NoRunnersError: Rollouts wait and no runner this trainer started is left: its runner
                processes keep dying (``"cs"``), or every ``"shm"`` runner thread has stopped (at
                its ``max_rollouts``, or on an error); the algorithm was cancelled.
            RuntimeError: Called from the main file's top-level code outside ``if __name__ ==
                "__main__":`` (``"cs"``), which runner processes import again, or on a running
                event loop (run it in a thread, or use ``fit_async``); nothing was started.
            WrongEventLoopError: ``"shm"`` with a store open on an event loop that does not run.
        """
        self._execute("Trainer.fit()", agent, self.algorithm, train_dataset, val_dataset)

    def dev(self, agent: LitAgent[Any], train_dataset: Any = None, *, val_dataset: Any = None) -> None:
        """``fit`` with a fast algorithm: the trainer's own if it is a ``FastAlgorithm``, else ``Baseline()``
        when none was given (0.3.0's dry run: same store, runners, hooks and tracer).

        Raises:
            TypeError: The trainer's algorithm is not a ``FastAlgorithm``.
            NoRunnersError, RuntimeError: As for ``fit``.
        """
        algorithm = self.algorithm if self.algorithm is not None else Baseline()
        if not isinstance(algorithm, FastAlgorithm):
            raise TypeError(
                "Trainer.dev() requires an algorithm that inherits from FastAlgorithm. "
                f"Received {type(algorithm).__name__}."
            )
        self._execute("Trainer.dev()", agent, algorithm, train_dataset, val_dataset)

    def _execute(self, what: str, agent: LitAgent[Any], algorithm: Algorithm | None, train: Any, val: Any) -> None:
        refuse_running_loop(what)
        if isinstance(self.strategy, SharedMemoryExecutionStrategy):
            self._check_instrumentation()
            self._run_shared_memory(self.strategy, agent, algorithm, train, val)
            return
        self._refuse_unguarded_main(what)
        run_event_loop(self._fit_async(agent, algorithm, train, val))

    def _refuse_unguarded_main(self, what: str) -> None:
        """Before runner processes start (``"cs"``, not role ``"algorithm"``): ``refuse_unguarded_main``
        and ``_check_instrumentation``."""
        if isinstance(self.strategy, ClientServerExecutionStrategy) and self.strategy.role != "algorithm":
            refuse_unguarded_main(what)
            self._check_instrumentation()

    def _check_instrumentation(self) -> None:
        """Before any runner starts: the frameworks its tracer instruments can be instrumented here
        (``eventlight.instrumentation.require``), as ``eventlight runner --instrument`` checks. A
        missing package made every runner die as it started, named only in the runners' log, until
        the no-runners guard stopped the run (peer failure C07).

        Raises:
            InvalidInputError: A package is missing or its version conflicts.
        """
        instrumented = getattr(self.runner.tracer, "instrumented", None)
        if isinstance(instrumented, instrumentation.Instrumented) and instrumented.frameworks:
            instrumentation.require(*instrumented.frameworks)

    def _run_shared_memory(
        self,
        strategy: SharedMemoryExecutionStrategy,
        agent: LitAgent[Any],
        algo: Algorithm | None,
        train: Any,
        val: Any,
    ) -> None:
        agent.set_trainer(self)
        store = shared_store(strategy, self.store)
        threads = RunnerThreads(strategy.n_runners, self.runner, agent, self.hooks, store)
        algorithm = self._run_beside_threads(store, train, val, algo, threads) if algo is not None else None
        started = time.time()
        try:
            run_shared_memory(strategy, threads, algorithm)
        except BaseException as error:
            if algo is not None:
                with contextlib.suppress(Exception):
                    asyncio.run(cancel_left_in_queue(store, started, reason=stopped_early_reason(error)))
            raise
        finally:
            if store is not self.store:  # the wrapper (and its loop's thread) lasts one run
                run_event_loop(store.close())

    async def _run_beside_threads(
        self, store: Any, train: Any, val: Any, algo: Algorithm, threads: RunnerThreads
    ) -> None:
        """``"shm"``'s algorithm: ``_run_algorithm``, with a second Ctrl+C while the threads stop
        cutting their grace short (``ctrl_c_again_hurries``; inside the event loop, over its handler)."""
        with ctrl_c_again_hurries(threads):
            await self._run_algorithm(store, train, val, algo, threads)

    async def fit_async(self, agent: LitAgent[Any], train_dataset: Any = None, *, val_dataset: Any = None) -> None:
        """``fit`` for callers that already run an event loop (strategy ``"cs"`` only).

        Raises:
            ValueError: The strategy is ``"shm"`` (which owns its threads' loops: call ``fit``).
            RuntimeError: As for ``fit``.
        """
        if isinstance(self.strategy, SharedMemoryExecutionStrategy):
            raise ValueError("fit_async runs the 'cs' strategy; call fit() for 'shm'")
        self._refuse_unguarded_main("Trainer.fit_async()")
        await self._fit_async(agent, self.algorithm, train_dataset, val_dataset)

    def _cs(self) -> ClientServerExecutionStrategy:
        strategy = self.strategy
        if not isinstance(strategy, ClientServerExecutionStrategy):
            raise TypeError(f"unsupported execution strategy {type(strategy).__name__}: use 'cs' or 'shm'")
        return strategy

    async def _services(self, strategy: ClientServerExecutionStrategy, run: contextlib.AsyncExitStack) -> Services:
        """The servers of a ``"cs"`` run; the lease on embedded ones (``use_services``) goes on ``run``."""
        store = self._given_store
        if store is not None and not isinstance(store, JetStreamLightningStore):
            raise ValueError(
                f"strategy 'cs' runs runners in other processes, which cannot share a {type(store).__name__}: "
                "pass a JetStreamLightningStore, or use strategy='shm'"
            )
        if store is not None:
            if store.pg_dsn is None:
                raise ValueError("Trainer(store=...) needs a JetStreamLightningStore with a pg_dsn")
            return Services(nats_url=store.nats_url or "", pg_dsn=store.pg_dsn)
        if strategy.managed_store and self.keep_services:
            return await prepare_services(self.settings)
        if strategy.managed_store:
            return await run.enter_async_context(use_services(self.settings, what="Trainer"))
        if self.settings.nats_url is None or self.settings.pg_dsn is None:
            raise ValueError(
                "AGL_MANAGED_STORE=0 starts no server: set EVENTLIGHT_NATS_URL and EVENTLIGHT_PG_DSN, "
                "or pass Trainer(store=JetStreamLightningStore(...))"
            )
        services = Services(nats_url=self.settings.nats_url, pg_dsn=self.settings.pg_dsn)
        # the namespace's streams and tables, idempotently
        nc = await connect_nats(services.nats_url, auth=self.settings.nats_auth)
        try:
            await apply_streams(nc, self.settings)
        finally:
            await nc.close()
        await apply_migrations(services.pg_dsn, self.settings.pg_schema, open_wait_s=self.settings.pg_open_wait_s)
        return services

    async def _fit_async(self, agent: LitAgent[Any], algo: Algorithm | None, train: Any, val: Any) -> None:
        strategy = self._cs()
        agent.set_trainer(self)
        async with contextlib.AsyncExitStack() as run:  # its end stops the servers no one else uses
            self.services = services = await self._services(strategy, run)
            await self._run_cs(strategy, services, agent, algo, train, val)

    async def _run_cs(
        self,
        strategy: ClientServerExecutionStrategy,
        services: Services,
        agent: LitAgent[Any],
        algo: Algorithm | None,
        train: Any,
        val: Any,
    ) -> None:
        pool = None
        if strategy.role != "algorithm":
            pool = RunnerPool(
                agent,
                self.n_runners,
                self.settings,
                services.nats_url,
                runner=self.runner,
                hooks=self.hooks,
                log_level=self.runner_log_level,
                runners_per_process=self.runners_per_process,
                graceful_s=strategy.graceful_timeout,
            )
            pool.start()
        with ctrl_c_again_hurries(pool):
            await self._serve_or_train(strategy, services, algo, train, val, pool)

    async def _serve_or_train(
        self,
        strategy: ClientServerExecutionStrategy,
        services: Services,
        algo: Algorithm | None,
        train: Any,
        val: Any,
        pool: RunnerPool | None,
    ) -> None:
        try:
            if strategy.role == "runner":
                assert pool is not None
                await serve_runner_role(pool)
                return
            given = self._given_store if isinstance(self._given_store, JetStreamLightningStore) else None
            store = given or JetStreamLightningStore(self.settings, nats_url=services.nats_url, pg_dsn=services.pg_dsn)
            async with contextlib.AsyncExitStack() as stack:
                if given is None or given.nc is None:
                    await stack.enter_async_context(store)
                self.store = store
                started = time.time()
                try:
                    await self._run_algorithm(store, train, val, algo, pool)
                except BaseException as error:  # Ctrl+C, the runners or the LLM gone, the algorithm failed
                    if algo is not None:
                        await cancel_left_in_queue(store, started, reason=stopped_early_reason(error))
                    raise
                finally:
                    if pool is not None:
                        await self._stop_runners(pool)
                    # leave complete read models behind: project what the runners wrote last
                    with contextlib.suppress(Exception):
                        await store.sync_all(timeout_s=30)
        finally:
            if pool is not None:
                await self._stop_runners(pool)

    async def _stop_runners(self, runners: RunnerPool | RunnerThreads, *, cancelled: bool = False) -> None:
        """Stop ``runners`` (nothing when they are stopped): processes with the strategy's
        ``graceful_timeout``, threads with its ``graceful_delay`` and ``join_timeout``; ``cancelled``:
        the run was cancelled (Ctrl+C), which a warning line says."""
        if runners.stopped:
            return
        if isinstance(runners, RunnerThreads):
            strategy = self.strategy
            assert isinstance(strategy, SharedMemoryExecutionStrategy)
            self._say_runners_stop_first(cancelled, len(runners.threads), strategy.graceful_delay)
            await asyncio.to_thread(runners.stop, strategy.graceful_delay, strategy.join_timeout)
            return
        graceful_s = self._cs().graceful_timeout
        self._say_runners_stop_first(cancelled, runners.n_runners, graceful_s)
        codes = await asyncio.to_thread(runners.stop, graceful_s)
        bad = [c for c in codes if c not in (0, None, -signal.SIGTERM)]
        if bad:
            log.warning("runner processes exited with codes %s", codes)

    async def _on_cancel(self, algo: Algorithm, runners: RunnerPool | RunnerThreads) -> None:
        """The run was cancelled: the algorithm starts nothing new (``Algorithm.request_stop``; ``GRPO``:
        no update) while its runners stop, before it is cancelled."""
        algo.request_stop()
        await self._stop_runners(runners, cancelled=True)

    @staticmethod
    def _say_runners_stop_first(cancelled: bool, n: int, graceful_s: float) -> None:
        if cancelled:
            by = stop_signal_name()
            again = "Ctrl+C again" if by == "Ctrl+C?" else f"Ctrl+C or {by} again"
            log.warning(
                "the run was cancelled (%s): stopping its %d runner(s) first; attempts in flight get "
                "%.0f s to finish, then are recorded failed (%s: at once)",
                by, n, graceful_s, again,
            )  # fmt: skip

    async def _run_algorithm(
        self,
        store: Any,
        train: Any,
        val: Any,
        algo: Algorithm | None,
        runners: RunnerPool | RunnerThreads | None = None,
    ) -> None:
        if algo is None:
            log.info("no algorithm: runners serve the queue until they finish or are interrupted")
            if isinstance(runners, RunnerPool):
                await wait_for_pool(runners)
            return
        algo.set_trainer(self)
        if self.rollout_config is not None:  # a wrapper (LightningStoreThreaded) passes it to its store
            getattr(store, "store", store).default_rollout_config = self.rollout_config
        algo.set_store(cast(LightningStore, store))
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
                run = stop_when_llm_fails(algo.run(train_dataset=train, val_dataset=val), watched)
                guarded = stop_when_runners_gone(run, store, runners, self.runner)
                on_cancel = None if runners is None else functools.partial(self._on_cancel, algo, runners)
                await stop_runners_first(guarded, on_cancel)
            else:
                algo.run(train_dataset=train, val_dataset=val)
        finally:
            if runners is not None:  # their agents call the proxy: they stop before it
                await self._stop_runners(runners)
            if proxy is not None:
                await proxy.stop()
