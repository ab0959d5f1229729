"""Runner processes: ``RunnerPool`` starts, restarts and stops them; ``serve`` is one process's loop.

A runner process (``_runner_main``) runs one runner, or several as asyncio tasks on one store
(``RunnerPool(runners_per_process=K)``, ``serve_many``). It is forked from a ``forkserver`` that imported the runner's
modules once (``FORKSERVER_PRELOAD``), so the processes share those pages instead of each
importing them again (``spawn`` where there is no forkserver). It takes the environment of the
pool's process at ``start`` (as a spawned process would), not the forkserver's. It:

* opens a write-only ``JetStreamLightningStore`` and runs each runner's ``LitAgentRunner.iter`` on it. When the
  NATS connection closes for good (nats-py gives up after ``max_reconnect_attempts``, about 10 s of
  outage), it closes that store and opens a new one, retrying every ``Backoff`` delay (0.1 s
  doubling to 5 s) until the server answers, then goes on consuming. An explicit loop rather than
  nats-py's ``max_reconnect_attempts=-1``: the store's connection settings stay what the projector,
  the CLI and the algorithm's store use, and a connection closed for any other reason (a server in
  lame-duck mode, a slow-consumer disconnect) is recovered the same way. The attempt in flight when
  the connection closes is cancelled and recorded ``failed`` once a store answers again (its spans
  from the outage are lost either way);
* on SIGTERM cancels the attempt in flight, which the runner records ``failed`` (the rollout is then
  requeued or failed by its ``RolloutConfig``: under the default one it fails, so nothing stays
  ``running``), and exits 0. A second SIGTERM kills it at once. SIGINT is ignored: the parent
  coordinates shutdown (peer failure C06);
* stops the same way when the pool's process dies (it checks every ``PARENT_CHECK_S`` that this
  pid still runs and is not a zombie; the process's OS parent is the forkserver), so a kill -9 of
  ``eventlight runner`` or of a trainer leaves no orphan working, and exits hard when that stop
  takes longer than ``GRACEFUL_STOP_S`` (a synchronous agent blocks the event loop). Not
  ``PR_SET_PDEATHSIG``: Linux ties it to the parent *thread*, and the parent is the forkserver.

``RunnerPool.stop`` sets the processes' stop event (each finishes its attempt in flight, if it can
within ``graceful_s``), then sends SIGTERM (the attempts still running are recorded ``failed``), then
SIGKILL. Until then the pool restarts a process that exits: after ``restart_delay_s`` (1 s, doubling
to ``RESTART_MAX_S`` while a slot's processes keep dying within ``RESTART_STABLE_S`` of their start),
each restart one warning line. A process of a runner with ``max_rollouts`` that exits 0 has done
its share and is not restarted; ``finished()`` tells when all have.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Coroutine, Sequence
from multiprocessing.process import BaseProcess
from typing import Any

from eventlight import instrumentation
from eventlight.agent import LitAgent
from eventlight.core.errors import ServiceUnavailableError
from eventlight.runner import Backoff, Hook, LitAgentRunner
from eventlight.runner.metrics import RunnerMetrics
from eventlight.settings import Settings
from eventlight.store.jetstream import JetStreamLightningStore
from eventlight.tracer import OtelTracer

log = logging.getLogger(__name__)

GRACEFUL_STOP_S = 10.0  # what a stop leaves attempts in flight to finish before SIGTERM fails them
KILL_AFTER_S = 3.0  # SIGTERM to SIGKILL
PARENT_CHECK_S = 0.5
FORKSERVER_PRELOAD = ["eventlight.runner_pool", "uvloop"]
"""Imported once by the forkserver, before it forks runner processes (what every runner imports)."""
CONNECTION_CHECK_S = 0.5
SUPERVISE_S = 0.5
RESTART_MIN_S = 1.0
RESTART_MAX_S = 60.0
RESTART_STABLE_S = 60.0  # a process that lived this long resets its slot's restart delay


def restart_delay_s(quick_deaths: int) -> float:
    """Seconds before restarting a slot whose processes died ``quick_deaths`` times in a row, each
    within ``RESTART_STABLE_S`` of its start: 1 s, 2 s, 4 s, ... up to ``RESTART_MAX_S``."""
    return float(min(RESTART_MAX_S, RESTART_MIN_S * 2.0 ** max(0, quick_deaths - 1)))


# -- one runner process ------------------------------------------------------------------------


def _runner_main(
    agent: LitAgent[Any],
    runner: LitAgentRunner,
    hooks: Sequence[Hook],
    settings: Settings,
    nats_url: str,
    worker_indexes: Sequence[int],
    stop: Any,
    log_level: str,
    parent_pid: int,
    metrics_port: int | None = None,
    environ: dict[str, str] | None = None,
    slot: int = 0,
) -> None:
    """Entry point of a runner process: the runners ``worker_indexes`` on one store (``/metrics``
    on ``metrics_port + slot`` when given; ``environ``: the pool process's environment, which
    replaces the forkserver's)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown (peer failure C06)
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [runner-%(process)d] %(name)s: %(message)s")
    _watch_parent(parent_pid)
    if metrics_port is not None and runner.metrics is not None:
        runner.metrics.serve(metrics_port + slot)
        log.info("runner process %d: metrics on http://127.0.0.1:%d/metrics", slot, metrics_port + slot)
    slots = runner_copies(agent, runner, worker_indexes)
    with contextlib.suppress(asyncio.CancelledError):  # SIGTERM: the attempts in flight are recorded failed
        _run(serve_many(slots, hooks, settings, nats_url, stop))


def runner_copies(
    agent: LitAgent[Any], runner: LitAgentRunner, worker_indexes: Sequence[int]
) -> list[tuple[int, LitAgent[Any], LitAgentRunner]]:
    """One ``(worker index, agent, runner)`` per index, for runners that share a process.

    One index: ``agent`` and ``runner`` themselves. Several: each runner gets its own copy of both
    (``copy.deepcopy``, as a process of its own would get by pickling; a ``@rollout`` function's
    agent is pickled by name, so its runners share the module's stateless object), sharing the one
    ``RunnerMetrics``; only the first runner's tracer instruments frameworks (instrumentation is
    process-wide, and every tracer's span processor routes a span to the attempt of the context it
    ended in), and a synchronous agent runs in a thread (``asyncio.to_thread``) so that it blocks
    neither the other runners nor the heartbeats.
    """
    if len(worker_indexes) == 1:
        return [(worker_indexes[0], agent, runner)]
    slots = []
    for j, index in enumerate(worker_indexes):
        memo: dict[int, Any] = {} if runner.metrics is None else {id(runner.metrics): runner.metrics}
        r = copy.deepcopy(runner, memo)
        if j > 0 and isinstance(r.tracer, OtelTracer):
            r.tracer.instrumented = instrumentation.Instrumented(())
        r.sync_agent_in_thread = True
        slots.append((index, copy.deepcopy(agent), r))
    return slots


def _run(coro: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        asyncio.run(coro)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it died and waits for its own parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): signal 0 tells whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _watch_parent(parent_pid: int) -> None:
    """Stop this process (SIGTERM to itself, then a hard exit) once the pool's process
    ``parent_pid`` has died."""

    def watch() -> None:
        while _alive(parent_pid):
            time.sleep(PARENT_CHECK_S)
        log.warning("runner process %d: parent %d is gone; stopping", os.getpid(), parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(GRACEFUL_STOP_S)
        os._exit(1)

    threading.Thread(target=watch, name="eventlight-parent-watch", daemon=True).start()


async def serve(
    agent: LitAgent[Any],
    runner: LitAgentRunner,
    hooks: Sequence[Hook],
    settings: Settings,
    nats_url: str,
    worker_index: int,
    stop: Any,
) -> None:
    """Run ``runner`` on the namespace's queue until ``stop`` is set (or ``max_rollouts``), opening
    a new store whenever the NATS connection closes for good (``serve_many`` with one runner).

    SIGTERM cancels it: the attempt in flight is recorded ``failed`` and ``CancelledError`` raised.

    Args:
        stop: Anything with ``is_set()`` (a ``multiprocessing`` or ``threading`` event).
    """
    await serve_many([(worker_index, agent, runner)], hooks, settings, nats_url, stop)


async def serve_many(
    slots: Sequence[tuple[int, LitAgent[Any], LitAgentRunner]],
    hooks: Sequence[Hook],
    settings: Settings,
    nats_url: str,
    stop: Any,
) -> None:
    """Run each ``(worker index, agent, runner)`` of ``slots`` as a task on one store (one NATS
    connection, so their commands share atomic batches) until ``stop`` is set or every runner has
    done its ``max_rollouts``; a new store whenever the NATS connection closes for good.

    A runner that raises cancels the others (their attempts are recorded ``failed``) and the
    exception propagates: the process exits and its pool restarts it. SIGTERM cancels them all.

    Args:
        stop: Anything with ``is_set()`` (a ``multiprocessing`` or ``threading`` event).
    """
    _cancel_on_sigterm()
    backoff = Backoff()
    first = slots[0][0]
    done: set[int] = set()  # runners that did their max_rollouts
    while not stop.is_set():
        try:
            store = await JetStreamLightningStore(settings, nats_url=nats_url).start()
        except ServiceUnavailableError as e:
            delay = backoff.next()
            log.warning("runner %d: no store yet, retrying in %.1f s: %s", first, delay, e)
            await asyncio.sleep(delay)
            continue
        backoff.reset()
        try:
            with contextlib.ExitStack() as contexts:
                for index, agent, runner in slots:
                    if index not in done:
                        contexts.enter_context(
                            runner.run_context(agent=agent, store=store, hooks=hooks, worker_id=index)
                        )
                work = _all_runners([(i, r) for i, _, r in slots if i not in done], stop, done)
                if await _unless_disconnected(store, work):
                    return
        finally:
            await store.close()
        log.warning("[%s] the NATS connection closed for good; reconnecting", slots[0][2].get_worker_id())


async def _all_runners(runners: Sequence[tuple[int, LitAgentRunner]], stop: Any, done: set[int]) -> None:
    """``iter`` of every runner, each in a task; the first to raise cancels the rest (``TaskGroup``).
    ``done`` collects the indexes of the runners whose ``iter`` returned."""

    async def one(index: int, runner: LitAgentRunner) -> None:
        await runner.iter(event=stop)
        done.add(index)

    if len(runners) == 1:
        await one(*runners[0])
        return
    async with asyncio.TaskGroup() as group:
        for index, runner in runners:
            group.create_task(one(index, runner), name=f"eventlight-runner-{index}")


def _cancel_on_sigterm() -> None:
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None

    def on_sigterm() -> None:
        log.info("runner process %d: SIGTERM; recording the attempt in flight as failed", os.getpid())
        loop.remove_signal_handler(signal.SIGTERM)  # a second one kills at once
        main.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)


async def _unless_disconnected(store: JetStreamLightningStore, work: Coroutine[Any, Any, Any]) -> bool:
    """Await ``work``; return ``True`` when it ends, ``False`` (after cancelling it) when the store's
    NATS connection closes for good first."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=CONNECTION_CHECK_S)
            if not task.done() and store.nc is not None and store.nc.is_closed:
                task.cancel()
                await asyncio.wait({task})
                return False
        task.result()
        return True
    finally:
        if not task.done():  # we were cancelled (SIGTERM): let the runner record its attempt first
            task.cancel()
            await asyncio.wait({task})


# -- the pool ----------------------------------------------------------------------------------


def _context() -> Any:
    """``forkserver`` with the runner's modules preloaded where the platform has it, else ``spawn``.

    The preload applies when this process starts its forkserver (the first pool's first process);
    a forkserver something else already started is used as it is.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def check_runners_per_process(value: Any) -> int:
    """``value`` when it is a whole number >= 1 (``RunnerPool``'s and ``Trainer``'s ``runners_per_process``).

    Raises:
        ValueError: Anything else (a bool, a float, a string, 0 or less).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"runners_per_process must be a whole number >= 1, got {value!r}")
    return value


class RunnerPool:
    """``n`` runners consuming one namespace's queue, in processes restarted when they die.

    Args:
        agent: The agent each runner runs (pickled into its process).
        n: Number of runners.
        settings: Namespace to consume.
        nats_url: NATS server.
        runner: Template runner (copied into each process); defaults to ``LitAgentRunner(OtelTracer())``.
        hooks: Hooks every runner calls.
        log_level: Log level inside the processes.
        metrics_port: When set, process ``i`` serves Prometheus ``/metrics`` on ``127.0.0.1:metrics_port + i``
            (``eventlight.runner.metrics``); the default runner then counts into a ``RunnerMetrics``.
        runners_per_process: Runners that share one process (eventlight's; default 1, as in
            Agent-lightning): ``ceil(n / runners_per_process)`` processes, each running its
            runners as asyncio tasks on one store (``runner_copies``: each its own copy of the
            agent and runner, a synchronous agent in a thread). Fewer processes hold less memory
            and their runners' commands share atomic batches; a process that dies takes its
            runners' attempts with it.

    Raises:
        ValueError: ``n`` or ``runners_per_process`` below 1, or ``metrics_port`` with a runner that
            does not count.
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
        metrics_port: int | None = None,
        runners_per_process: int = 1,
    ):
        if n < 1:
            raise ValueError(f"n_runners must be >= 1, got {n}")
        check_runners_per_process(runners_per_process)
        if runner is None:
            runner = LitAgentRunner(OtelTracer(), metrics=RunnerMetrics() if metrics_port is not None else None)
        elif metrics_port is not None and runner.metrics is None:
            raise ValueError("metrics_port needs a runner that counts: LitAgentRunner(metrics=RunnerMetrics())")
        self.metrics_port = metrics_port
        self.n_runners = n
        self.runners_per_process = runners_per_process
        # process i runs the runners with these worker indexes
        self.worker_indexes = [
            list(range(start, min(n, start + runners_per_process))) for start in range(0, n, runners_per_process)
        ]
        self.ctx = _context()
        self.stop_event = self.ctx.Event()
        self._args = (agent, runner, tuple(hooks), settings, nats_url)
        self._finite = runner.max_rollouts is not None
        self._done: set[int] = set()  # slots whose process finished its max_rollouts
        self._log_level = log_level
        self.procs: list[BaseProcess] = [self._process(i) for i in range(len(self.worker_indexes))]
        self.restarts = 0
        self._started_at = [0.0] * len(self.procs)
        self._lock = threading.Lock()
        self._stopping = False
        self._supervisor: threading.Thread | None = None

    def _process(self, index: int) -> BaseProcess:
        agent, runner, hooks, settings, nats_url = self._args
        return self.ctx.Process(  # type: ignore[attr-defined,no-any-return]
            target=_runner_main,
            name=f"eventlight-runner-{index}",
            daemon=True,
            args=(
                agent,
                runner,
                hooks,
                settings,
                nats_url,
                self.worker_indexes[index],
                self.stop_event,
                self._log_level,
                os.getpid(),
                self.metrics_port,
                dict(os.environ),
                index,
            ),  # fmt: skip
        )

    def start(self) -> None:
        """Start the processes and the thread that restarts them."""
        for i, p in enumerate(self.procs):
            p.start()
            self._started_at[i] = time.monotonic()
        self._supervisor = threading.Thread(target=self._supervise, name="eventlight-runner-pool", daemon=True)
        self._supervisor.start()
        procs = len(self.procs)
        # debug: `eventlight runner` and the trainer's runner role print their own line for this
        log.debug("started %d runners in %d process%s", self.n_runners, procs, "es" if procs != 1 else "")

    def alive(self) -> int:
        """How many processes are running now."""
        return sum(p.is_alive() for p in self.procs)

    def runners_alive(self) -> int:
        """How many runners the running processes hold."""
        return sum(len(ix) for p, ix in zip(self.procs, self.worker_indexes, strict=True) if p.is_alive())

    def finished(self) -> bool:
        """Whether every process has finished its ``max_rollouts`` (never, without one)."""
        with self._lock:
            return len(self._done) == len(self.procs)

    def supervising(self) -> bool:
        """Whether the pool still keeps its processes running (started and not stopped)."""
        return self._supervisor is not None and self._supervisor.is_alive()

    def _supervise(self) -> None:
        quick_deaths = [0] * len(self.procs)
        due: dict[int, float] = {}  # slot -> when to restart it
        while True:
            with self._lock:
                if self._stopping or self.stop_event.is_set():  # the processes exit on the event: no restart
                    return
                procs = list(self.procs)
            now = time.monotonic()
            for i, p in enumerate(procs):
                if i in due or i in self._done or p.exitcode is None:
                    continue
                if self._finite and p.exitcode == 0:
                    log.info("runner process %d (pid %s) finished its rollouts", i, p.pid)
                    with self._lock:
                        self._done.add(i)
                    continue
                lived = now - self._started_at[i]
                quick_deaths[i] = quick_deaths[i] + 1 if lived < RESTART_STABLE_S else 0
                due[i] = now + restart_delay_s(quick_deaths[i])
                log.warning(
                    "runner process %d (pid %s) exited with code %s after %.1f s; restarting it in %.1f s",
                    i, p.pid, p.exitcode, lived, due[i] - now,
                )  # fmt: skip
            for i, at in sorted(due.items()):
                if at <= now and self._restart(i):
                    del due[i]
            waits = [at - now for at in due.values() if at > now] + [SUPERVISE_S]
            sentinels = [p.sentinel for p in procs if p.exitcode is None]
            if sentinels:
                mp.connection.wait(sentinels, timeout=min(waits))
            else:
                time.sleep(min(waits))

    def _restart(self, index: int) -> bool:
        with self._lock:
            if self._stopping:
                return False
            p = self._process(index)
            p.start()
            self.procs[index] = p
            self._started_at[index] = time.monotonic()
            self.restarts += 1
        log.warning("runner process %d restarted as pid %s (restart %d of this pool)", index, p.pid, self.restarts)
        return True

    def stop(self, graceful_s: float = GRACEFUL_STOP_S) -> list[int | None]:
        """Stop the processes: stop event, then SIGTERM after ``graceful_s`` (attempts still in
        flight are recorded ``failed``), then SIGKILL. No process is restarted from the call on.

        Returns:
            Their exit codes (``0`` after a stop event or SIGTERM).
        """
        with self._lock:
            self._stopping = True
            procs = [p for p in self.procs if p.pid is not None]
        self.stop_event.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=SUPERVISE_S * 4)
        deadline = time.monotonic() + graceful_s  # one deadline for all, not one per process
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=KILL_AFTER_S)
            if p.is_alive():
                log.warning("runner process pid %s ignored SIGTERM for %.0f s; killing it", p.pid, KILL_AFTER_S)
                p.kill()
                p.join(timeout=KILL_AFTER_S)
        return [p.exitcode for p in procs]
